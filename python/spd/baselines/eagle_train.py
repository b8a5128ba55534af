"""Training the EAGLE-3-style head by distillation, with training-time test (TTT).

The same data, held-out split, draft vocabulary and learning-rate schedule as the PDM trainer
(spd.train.trainer), so the two drafters are compared on equal terms. Each sequence's chain is
unrolled `ttt_steps` steps over every position at once (EagleHead.forward_ttt); the loss is
KL(target || head) on the draft vocabulary against the target's distribution of the predicted
token, averaged over the steps (weights ttt_decay**(j-1)), leaving out rows whose target argmax
lies outside the draft vocabulary and rows whose chain would start before the sequence.

`TRAIN` describes the method to `spd train --method eagle3`: the hidden states its features need,
the PDM options it refuses, and the trainer run from the command's flags.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from spd.baselines.eagle import (
    DEFAULT_DRAFT_STEPS,
    METHOD,
    EagleHead,
    check_feature_layers,
    default_feature_layers,
)
from spd.errors import SPDError
from spd.train.loop import crop, run_loop
from spd.train.methods import ARGMAX_MESSAGE, Refusal, TrainJob, TrainMethod
from spd.train.trainer import build_draft_vocab

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
    precision: str = "fp32"                # or "bf16": the loss under bf16 autocast (train_loop)
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

    def item_loss(item, rng):
        loss, _, agrees = distiller.loss(item)
        return loss, agrees[0]

    def same_run(saved: dict) -> bool:
        return saved.get("method") == METHOD and \
            all(saved.get(k) == getattr(cfg, k) for k in _RESUME_KEYS)

    run_loop(head, cfg, out, train_items, held_out, item_loss=item_loss,
             evaluate=lambda items: evaluate(distiller, items),
             config=dict(asdict(cfg), method=METHOD, data=features.data_id()),
             same_run=same_run,
             desc="training EAGLE-3 head", progress=progress)
    head.config.extra.update(train={k: v for k, v in asdict(cfg).items() if k != "history"},
                             final_eval=dict(cfg.history[-1]) if cfg.history else {},
                             train_tokens=features.token_count() - sum(
                                 len(x["tokens"]) for x in held_out))
    head.save(out, storage=storage)
    (out / "history.json").write_text(json.dumps(cfg.history))
    return cfg.history[-1] if cfg.history else {}


def _check_options(options) -> None:
    if options.ttt_steps < 1:
        raise SPDError(f"--ttt-steps must be >= 1, got {options.ttt_steps}")


def _train_from_options(method: TrainMethod, job: TrainJob) -> dict:
    """`spd train --method eagle3`: the head on the same data and vocabulary as the PDM."""
    o = job.options
    cfg = EagleTrainConfig(steps=o.steps, batch_sequences=o.batch, lr=o.lr,
                           crop_len=o.crop_len, eval_every=o.eval_every,
                           save_every=o.eval_every, seed=o.seed,
                           eval_sequences=o.eval_sequences,
                           draft_vocab_size=o.draft_vocab_size, ttt_steps=o.ttt_steps,
                           intermediate_size=o.intermediate_size,
                           draft_steps=o.draft_steps or DEFAULT_DRAFT_STEPS,
                           precision=job.precision)
    return train_eagle(job.target, job.features, cfg, o.out, storage=o.storage)


TRAIN = TrainMethod(
    METHOD, summary="the EAGLE-3-style chain-drafting head (one layer)",
    train=_train_from_options, feature_layers=default_feature_layers, check=_check_options,
    refuses=(
        Refusal(("fill_weights",), "--fill-weights is a PDM option; the eagle3 head has no fill "
                "levels", given=lambda v: v is not None),
        Refusal(("argmax_weight",), ARGMAX_MESSAGE),
        Refusal(("draft_vocab_coverage",), "--draft-vocab-coverage is a PDM option; give the "
                "eagle3 head a --draft-vocab-size", given=lambda v: v is not None),
        Refusal(("init_from", "pdm_layers", "feature_timing"), "--init-from, --pdm-layers and "
                "--feature-timing are PDM options; the eagle3 head has one layer and drafts in a "
                "chain"),
    ))
