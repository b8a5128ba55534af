"""Training the EAGLE-3-style head by distillation, with training-time test (TTT).

The same data, held-out split, draft vocabulary and learning-rate schedule as the PDM trainer
(spd.trainer), so the two drafters are compared on equal terms. Each sequence's chain is
unrolled `ttt_steps` steps over every position at once (EagleHead.forward_ttt); the loss is
KL(target || head) on the draft vocabulary against the target's distribution of the predicted
token, averaged over the steps (weights ttt_decay**(j-1)), leaving out rows whose target argmax
lies outside the draft vocabulary and rows whose chain would start before the sequence.
"""
from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from spd.eagle import (DEFAULT_DRAFT_STEPS, EagleHead, check_feature_layers,
                       default_feature_layers)
from spd.errors import SPDError
from spd.trainer import STATE, _lr_at, build_draft_vocab, crop

# A resumed run must agree with the saved one on these.
_RESUME_KEYS = ("feature_layers", "ttt_steps", "draft_vocab_size", "intermediate_size")


@dataclass
class EagleTrainConfig:
    steps: int = 1000
    batch_sequences: int = 2
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    crop_len: int = 256
    eval_every: int = 100
    save_every: int = 100
    eval_sequences: int = 16
    seed: int = 0
    draft_vocab_size: int = 8192
    feature_layers: list | None = None     # default: default_feature_layers(L)
    ttt_steps: int = 3
    ttt_decay: float = 1.0                 # weight of step j is ttt_decay ** (j - 1)
    intermediate_size: int | None = None   # default: the target's
    draft_steps: int = DEFAULT_DRAFT_STEPS # stored in the checkpoint: the decoder's default
    history: list = field(default_factory=list)


class EagleDistiller:
    """The TTT loss of one sequence and its per-step agreement with the target."""

    def __init__(self, target, head: EagleHead, feature_anchors: list[int], ttt_steps: int,
                 ttt_decay: float = 1.0):
        wanted = list(head.config.feature_layers)
        missing = [b for b in wanted if b not in feature_anchors]
        if missing:
            raise SPDError(f"the features hold hidden states {list(feature_anchors)} but the "
                           f"EAGLE-3 head needs layers {wanted} (missing {missing}); extract "
                           "features with these anchors or pick feature_layers among them")
        self.slots = [list(feature_anchors).index(b) for b in wanted]
        self.head = head
        self.steps = ttt_steps
        self.weights = [ttt_decay ** j for j in range(ttt_steps)]
        vocab = head.draft_to_target
        self.target_rows = target.lm_head.weight.detach().float()[vocab]
        self.embed = target.embed.weight.detach().float()
        self.in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
        self.in_vocab[vocab] = True

    def loss(self, item):
        """(weighted mean KL, per-step KL list, per-step top-1 agreement list)."""
        tokens = item["tokens"].long()
        R = len(tokens) - 1                      # row i predicts x_{i+2} from final[i+1]
        feats = item["anchors"][self.slots, :R].float()
        step_logits = self.head.forward_ttt(feats, self.embed[tokens[1:]], self.steps)
        p_logp = F.log_softmax(item["final"][1:].float() @ self.target_rows.t(), dim=-1)
        want = item["argmax"][1:].long()
        in_vocab = self.in_vocab[want]
        pos = torch.arange(R)
        total, kls, agrees = 0.0, [], []
        for j, logits in enumerate(step_logits):          # j = step - 1
            started = pos >= j                              # the chain starts at i - j >= 0
            valid = started & in_vocab
            q_logp = F.log_softmax(logits, dim=-1)
            kl = (p_logp.exp() * (p_logp - q_logp)).sum(-1)
            kl = (kl * valid).sum() / max(1, int(valid.sum()))
            total = total + self.weights[j] * kl
            kls.append(float(kl.detach()))
            draft = self.head.draft_to_target[logits.argmax(-1)]
            agrees.append(float((draft == want)[started].float().mean()) if started.any()
                          else 0.0)
        return total / sum(self.weights), kls, agrees


@torch.no_grad()
def evaluate(distiller: EagleDistiller, items) -> dict:
    kls = torch.zeros(distiller.steps)
    agrees = torch.zeros(distiller.steps)
    for it in items:
        _, k, a = distiller.loss(it)
        kls += torch.tensor(k)
        agrees += torch.tensor(a)
    kls /= len(items)
    agrees /= len(items)
    out = {"kl": float(kls.mean())}
    for j in range(distiller.steps):
        out[f"step{j + 1}_kl"] = float(kls[j])
        out[f"step{j + 1}_top1"] = float(agrees[j])
    return out


def train_eagle(target, features, cfg: EagleTrainConfig, out_dir, progress: bool = True,
                storage: str = "int8") -> dict:
    """Train an EAGLE-3 head on a FeatureSet; writes the checkpoint to out_dir and returns the
    last history record."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.ttt_steps < 1 or int(cfg.ttt_steps) != cfg.ttt_steps:
        raise SPDError(f"ttt_steps must be a positive integer, got {cfg.ttt_steps}")
    cfg.feature_layers = check_feature_layers(
        cfg.feature_layers if cfg.feature_layers is not None
        else default_feature_layers(target.num_layers), target.num_layers)
    if len(features) <= cfg.eval_sequences:
        raise SPDError(f"only {len(features)} sequences of features: need more than the "
                       f"{cfg.eval_sequences} held out for evaluation")
    held_out = [crop(x, cfg.crop_len, None) for x in features.items[-cfg.eval_sequences:]]
    # A head row reads x_{i+1}: a sequence needs two tokens to give one row.
    train_items = [x for x in features.items[:-cfg.eval_sequences] if len(x["tokens"]) >= 2]
    if cfg.crop_len < 2 or not train_items or any(len(x["tokens"]) < 2 for x in held_out):
        raise SPDError("crop_len and every held-out sequence need at least 2 tokens, and some "
                       "training sequence too (a head row reads x_{i+1} to predict x_{i+2})")
    vocab = build_draft_vocab(features.argmax_counts(target.vocab_size), cfg.draft_vocab_size)
    torch.manual_seed(cfg.seed)
    head = EagleHead.initial(target, vocab, cfg.feature_layers, cfg.intermediate_size,
                             cfg.draft_steps, seed=cfg.seed)
    distiller = EagleDistiller(target, head, features.anchors, cfg.ttt_steps, cfg.ttt_decay)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = 0
    rng = random.Random(cfg.seed)
    order: list[int] = []   # what is left of this epoch's shuffled sequence order
    state_path = out / STATE
    if state_path.exists():  # resume
        st = torch.load(state_path, weights_only=False)
        if st["config"].get("method") != "eagle3" or \
                any(st["config"].get(k) != getattr(cfg, k) for k in _RESUME_KEYS):
            raise SPDError(f"{out} holds a run with another configuration; use a fresh --out")
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        order = list(st["order"])
        cfg.history = st["history"]
    head.train()
    bar = tqdm(total=cfg.steps, initial=step, desc="training EAGLE-3 head", unit="step",
               disable=not progress)
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        total, agree1 = 0.0, 0.0
        for _ in range(cfg.batch_sequences):
            if not order:
                order = list(range(len(train_items)))
                rng.shuffle(order)
            item = crop(train_items[order.pop()], cfg.crop_len, rng)
            loss, _, agrees = distiller.loss(item)
            (loss / cfg.batch_sequences).backward()
            total += loss.item() / cfg.batch_sequences
            agree1 += agrees[0] / cfg.batch_sequences
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{total:.3f}", top1=f"{agree1:.2f}")
        record = {"step": step, "loss": total, "top1": agree1}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            head.eval()
            record.update(evaluate(distiller, held_out))
            head.train()
            bar.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in record.items()}))
        cfg.history.append(record)
        if step % cfg.save_every == 0 or step == cfg.steps:
            torch.save({"step": step, "head": head.state_dict(), "opt": opt.state_dict(),
                        "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                        "order": list(order), "history": cfg.history,
                        "config": dict(asdict(cfg), method="eagle3")}, state_path)
    bar.close()
    head.eval()
    head.config.extra.update(train={k: v for k, v in asdict(cfg).items() if k != "history"},
                             final_eval=dict(cfg.history[-1]) if cfg.history else {},
                             train_tokens=features.token_count() - sum(
                                 len(x["tokens"]) for x in held_out))
    head.save(out, storage=storage)
    (out / "history.json").write_text(json.dumps(cfg.history))
    return cfg.history[-1] if cfg.history else {}
