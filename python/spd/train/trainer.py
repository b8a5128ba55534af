"""PDM training by distillation from the frozen target (docs/training.md).

Every step takes sequences with the target's features (computed now by the frozen target:
online, spd.train.teacher; or read from the feature cache: spd.train.distill), samples a fill
level per sequence (full with probability `full_fill_prob`, else uniform in 1..n-1; or from
`fill_weights`, one weight per fill level 1..n, to match how often each occurs at inference),
lays the sequences out with spd.train.layout so each draft row sees exactly what it would see at
inference (several sequences packed into one forward), and minimises KL(target || draft) on the
draft vocabulary (plus, with `argmax_weight` > 0, that weight times the cross-entropy of the
target's argmax: greedy decoding accepts a draft only when it is that token, which the KL weighs
no more than the rest of the distribution). Positions whose target argmax lies outside the draft
vocabulary are left out of the loss (the draft can never propose it). The loss of a step is the
mean over the loss tokens of its whole global batch (every rank and micro-batch).
Checkpoints every `save_every` steps; a run started again on the same output folder resumes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from spd.draft.pdm import PipelineDraftModule, pdm_config_for
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.train.batches import BatchPlan, CachedBatches, Piece, packs
from spd.train.estimate import projected_acceptance, projected_alpha
from spd.train.layout import packed_layout
from spd.train.loop import STATE, crop, run_steps


@dataclass
class TrainConfig:
    n_stages: int = 4
    split: list | None = None
    anchors: list | None = None
    pdm_layers: int = 2
    intermediate_size: int = 768
    draft_vocab_size: int = 8192
    # the fewest frequent ids covering this share of the argmax counts, capped by
    # draft_vocab_size when that is > 0 (None: draft_vocab_size ids)
    draft_vocab_coverage: float | None = None
    steps: int = 1000
    batch_sequences: int = 2    # the global batch: sequences per step, every rank together
    micro_batch: int = 0         # sequences per forward on one rank (0: the whole rank's share)
    pack_tokens: int = 0         # tokens packed into one PDM forward (0: one sequence each)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    full_fill_prob: float = 0.5
    # Relative weights of fill levels 1..n (None: the rule above). At inference with acceptance
    # a, the draft after a rejection is at fill 1 and each acceptance moves one level up, so
    # fill k is judged about a^(k-1) as often as fill 1: with a weak drafter most judgments
    # (and so most of the speedup) are at low fill.
    fill_weights: list | None = None
    # Weight of an extra cross-entropy term on the target's argmax token (0: KL only).
    argmax_weight: float = 0.0
    max_len: int = 512
    crop_len: int = 256          # train on random windows of this many tokens (cost ~ len^2)
    eval_every: int = 100
    save_every: int = 100
    eval_sequences: int = 16
    seed: int = 0
    features: str = "pre-step"   # or "post-step" (the paper's ablation: drafting not hidden)
    method: str = "spd"          # or "ppsd" (first-stage features, post-step); metadata only
    precision: str = "fp32"      # or "bf16": the loss under bf16 autocast (train_loop)
    loss_on: str = "all"         # or "answers": the rows predicting the target's own answers
    init_from: str | None = None  # warm start: copy every matching weight of this checkpoint
    history: list = field(default_factory=list)
    peak_memory: list = field(default_factory=list)  # per rank, filled at the end of a run


def check_fill_weights(weights, n: int) -> list[float]:
    """Validated fill weights: n non-negative numbers, not all zero."""
    w = [float(x) for x in weights]
    if len(w) != n or any(x < 0 or x != x for x in w) or sum(w) <= 0:
        raise SPDError(f"fill weights must be {n} non-negative numbers (fill levels 1..{n}), "
                       f"not all zero; got {list(weights)}")
    return w


def sample_fill(rng, n: int, cfg: TrainConfig) -> int:
    """A fill level in 1..n for one training sequence."""
    if cfg.fill_weights is not None:
        return rng.choices(range(1, n + 1), weights=check_fill_weights(cfg.fill_weights, n))[0]
    if n == 1 or rng.random() < cfg.full_fill_prob:
        return n
    return rng.randint(1, n - 1)


def coverage_size(counts: torch.Tensor, coverage: float) -> int:
    """The fewest most-frequent ids whose counts hold `coverage` (in (0, 1]) of all counts
    (counts [V]: how often each target id is the target's argmax in the data)."""
    if not 0.0 < coverage <= 1.0:
        raise SPDError(f"draft vocabulary coverage must lie in (0, 1], got {coverage}")
    total = int(counts.sum())
    if total == 0:
        return int(counts.numel())
    cum = torch.sort(counts.to(torch.int64), descending=True).values.cumsum(0)
    # integer comparison of cum / total >= coverage, so 1.0 means every counted id
    need = coverage * total
    return int(torch.searchsorted(cum.to(torch.float64), torch.tensor([need - 1e-9 * total],
                                                                       dtype=torch.float64))) + 1


def build_draft_vocab(counts: torch.Tensor, size: int | None,
                      coverage: float | None = None) -> torch.Tensor:
    """The `size` most frequent target ids (ties broken by id), sorted by id. With `coverage`:
    the fewest that cover that fraction of the counts (coverage_size), at most `size` ids when
    `size` is given (None or 0: no cap)."""
    if coverage is not None:
        need = coverage_size(counts, coverage)
        size = min(need, size) if size else need
    elif not size:
        raise SPDError("a draft vocabulary needs a size or a coverage")
    size = min(size, counts.numel())
    order = sorted(range(counts.numel()), key=lambda i: (-int(counts[i]), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.int64)


def init_pdm(target, layout: DepthLayout, cfg: TrainConfig, vocab: torch.Tensor):
    """A PDM that starts close to 'read the deepest anchor through the target's head'.

    Output projections of every layer start at zero (each layer starts as the identity), each
    type's projection but type 0's starts as the identity on its deepest anchor block (type 0
    holds only the token's own embedding; through the tied head that would predict the token
    itself, so it starts small and random), the final norm copies
    the target's and the LM head is the target's rows of the draft vocabulary (kept frozen).
    """
    pdm_cfg = pdm_config_for(target, layout, cfg.pdm_layers, len(vocab))
    pdm_cfg.intermediate_size = cfg.intermediate_size
    pdm_cfg.extra = {"head_from_target": True, "method": cfg.method}
    if cfg.features not in ("pre-step", "post-step"):
        raise SPDError(f"features must be pre-step or post-step, got {cfg.features}")
    pdm_cfg.features = cfg.features
    torch.manual_seed(cfg.seed)
    pdm = PipelineDraftModule(pdm_cfg)
    d = target.hidden_size
    with torch.no_grad():
        for name, p in pdm.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                p.zero_()
        for layer in pdm.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for key, proj in pdm.projections.items():
            e = int(key)
            if e == 0:
                continue  # type 0 is the embedding alone: identity there would predict a repeat
            proj.weight.mul_(0.1)
            proj.weight[:, e * d:(e + 1) * d] += torch.eye(d)
        pdm.norm.weight.copy_(target.final_norm_weight().detach().float())  # 1 + w on hybrids
        pdm.draft_to_target.copy_(vocab)
        pdm.lm_head.weight.copy_(target.lm_head.weight.detach().float()[vocab])
    pdm.lm_head.weight.requires_grad_(False)
    return pdm.float()


def warm_start(pdm, folder) -> list[str]:
    """Copy every weight of the PDM checkpoint `folder` whose name and shape match `pdm`'s
    (decoder layers, norms, the projections of types both layouts share). Lets a PDM for
    another n start from a trained one. Decoder layers the source lacks (a deeper PDM) keep
    init_pdm's zeroed output projections: they start as the identity, and the warm-started PDM
    first computes what the source did. Returns the names copied."""
    from spd.draft.checkpoint import WEIGHTS_NAME, read_weights
    if not (Path(folder) / WEIGHTS_NAME).exists():
        raise SPDError(f"--init-from {folder}: no {WEIGHTS_NAME} there")
    source = read_weights(folder)
    own = pdm.state_dict()
    copied = []
    with torch.no_grad():
        for name, value in source.items():
            if name in ("lm_head.weight", "draft_to_target") or name not in own:
                continue
            if own[name].shape == value.shape:
                own[name].copy_(value.to(own[name].dtype))
                copied.append(name)
    if not copied:
        raise SPDError(f"--init-from {folder}: no weight matches this PDM's shapes")
    return copied


def _anchor_index(features_anchors: list[int], wanted: list[int]) -> list[int]:
    missing = [b for b in wanted if b not in features_anchors]
    if missing:
        raise SPDError(f"the features hold anchors {features_anchors} but the PDM needs "
                       f"{wanted} (missing {missing}); extract features with these anchors")
    return [features_anchors.index(b) for b in wanted]


class Distiller:
    """Computes the training loss of sequences at given fill levels."""

    def __init__(self, target, pdm, feature_anchors: list[int], argmax_weight: float = 0.0):
        self.pdm = pdm
        self.argmax_weight = argmax_weight
        self.layout = pdm.layout
        self.slots = _anchor_index(feature_anchors, list(self.layout.anchors))
        vocab = pdm.draft_to_target
        device = vocab.device
        self.head = target.lm_head.weight.detach().float()[vocab.to(target.device)].to(device)
        self.in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool, device=device)
        self.in_vocab[vocab] = True
        self.draft_index = torch.zeros(target.vocab_size, dtype=torch.long, device=device)
        self.draft_index[vocab] = torch.arange(len(vocab), device=device)  # target id -> row
        self._layouts = {}
        self._cast: dict = {}  # (which head, dtype) -> the frozen head cast once under autocast
        self.shift = 1 if pdm.config.features == "post-step" else 0

    def _logits(self, hidden: torch.Tensor, draft: bool) -> torch.Tensor:
        """hidden [T, d] through the draft head (draft=True; frozen, init_pdm) or the target's
        head on the draft vocabulary -> [T, draft_vocab] fp32. Under autocast each head is cast
        once per run, not on every call (autocast caches only weights that train)."""
        head = self.pdm.lm_head.weight if draft else self.head
        if head.requires_grad or not torch.is_autocast_enabled(hidden.device.type):
            return F.linear(hidden, head).float()
        dtype = torch.get_autocast_dtype(hidden.device.type)
        key = (draft, dtype, head.data_ptr(), head._version)
        if key not in self._cast:
            self._cast = {k: v for k, v in self._cast.items() if k[0] != draft}
            self._cast[key] = head.detach().to(dtype)
        return F.linear(hidden.to(dtype), self._cast[key]).float()

    def layout_for(self, lengths: tuple[int, ...], fills: tuple[int, ...]):
        key = (lengths, fills)
        if key not in self._layouts:
            if len(self._layouts) > 64:
                self._layouts.clear()
            self._layouts[key] = packed_layout(list(lengths), self.layout, list(fills),
                                               device=self.in_vocab.device, shift=self.shift)
        return self._layouts[key]

    def _terms(self, items: list[dict], fills: list[int], kl_only: bool):
        """Per-position loss [T], loss mask [T], draft-equals-argmax [T] and the rows that count
        [T] (an item's `mask`, else all) of items laid out side by side (T: their tokens
        together)."""
        dev = self.in_vocab.device
        # float before cat: autocast refuses to concatenate fp16 cache tensors on a CPU
        anchors = torch.cat([it["anchors"][self.slots].to(dev).float() for it in items], dim=1)
        final = torch.cat([it["final"].to(dev).float() for it in items])
        argmax = torch.cat([it["argmax"] for it in items]).to(dev).long()
        tl = self.layout_for(tuple(len(it["tokens"]) for it in items), tuple(fills))
        q_logits = self._logits(self.pdm.forward_train(anchors, tl, head=False), draft=True)
        p_logp = F.log_softmax(self._logits(final, draft=False), dim=-1)
        q_logp = F.log_softmax(q_logits, dim=-1)
        per_row = (p_logp.exp() * (p_logp - q_logp)).sum(-1)
        if self.argmax_weight and not kl_only:
            rows = self.draft_index[argmax]
            per_row = per_row - self.argmax_weight * q_logp.gather(-1, rows[:, None])[:, 0]
        agree = self.pdm.draft_to_target[q_logits.argmax(-1)] == argmax
        counted = torch.cat([it["mask"].to(dev) if "mask" in it else
                             torch.ones(len(it["tokens"]), dtype=torch.bool, device=dev)
                             for it in items])
        return per_row, self.in_vocab[argmax] & counted, agree & counted, counted

    def loss(self, item, fill: int, kl_only: bool = False):
        """(mean loss over valid positions, #valid, top-1 agreement with the target's argmax)
        of one sequence. The loss is the KL, plus `argmax_weight` times the argmax
        cross-entropy unless `kl_only` (evaluation reports the KL alone, comparable across
        runs)."""
        per_row, valid, agree, counted = self._terms([item], [fill], kl_only)
        nvalid = int(valid.sum())
        return ((per_row * valid).sum() / max(1, nvalid), nvalid,
                float(agree.sum()) / max(1, int(counted.sum())))

    def sums(self, pieces: list[Piece], pack_tokens: int = 0):
        """(loss summed over the loss tokens [scalar tensor], loss tokens, agreeing rows, rows
        that count, tokens) of a micro-batch, its pieces packed into forwards of at most
        pack_tokens tokens."""
        total, valid_n, agree_n, counted_n, tokens = None, 0, 0, 0, 0
        for pack in packs(pieces, pack_tokens):
            per_row, valid, agree, counted = self._terms([p.item for p in pack],
                                                         [p.fill for p in pack], False)
            part = (per_row * valid).sum()
            total = part if total is None else total + part
            valid_n += int(valid.sum())
            agree_n += int(agree.sum())
            counted_n += int(counted.sum())
            tokens += len(counted)
        return total, valid_n, agree_n, counted_n, tokens


@torch.no_grad()
def evaluate(distiller: Distiller, items) -> dict:
    """Held-out KL and top-1 agreement at every fill level, and what they project: `accept`,
    the share of judged drafts accepted, and `S_est`, the theoretical speedup, if each draft
    made at fill f were accepted with its top-1 rate (greedy, PDM alone, no context lookup;
    spd.train.estimate)."""
    n = distiller.layout.n
    out, top1 = {}, []
    if not items:  # a set too small to hold one out (spd.train.corpus): nothing to report
        return out
    for fill in range(1, n + 1):
        losses, agrees = [], []
        for it in items:
            loss, _, agree = distiller.loss(it, fill, kl_only=True)
            losses.append(float(loss))
            agrees.append(agree)
        out[f"fill{fill}_kl"] = sum(losses) / len(losses)
        out[f"fill{fill}_top1"] = sum(agrees) / len(agrees)
        top1.append(out[f"fill{fill}_top1"])
    out["accept"] = projected_acceptance(top1)
    out["S_est"] = projected_alpha(top1) * n
    return out


def fill_sampler(n: int, cfg: TrainConfig):
    return lambda rng: sample_fill(rng, n, cfg)


def train(target, features, cfg: TrainConfig, out_dir, progress: bool = True,
          storage: str = "int8", group=None) -> dict:
    """Train a PDM on a FeatureSet (the cached path); writes the checkpoint to out_dir and
    returns the last history record."""
    if len(features) <= cfg.eval_sequences:
        raise SPDError(f"only {len(features)} sequences of features: need more than the "
                       f"{cfg.eval_sequences} held out for evaluation")
    held_out = [crop(x, cfg.crop_len, None) for x in features.items[-cfg.eval_sequences:]]
    train_items = features.items[:-cfg.eval_sequences]
    vocab = build_draft_vocab(features.argmax_counts(target.vocab_size), cfg.draft_vocab_size,
                              cfg.draft_vocab_coverage)
    cfg.draft_vocab_size = int(vocab.numel())  # the size coverage chose: record that one

    def batches(plan, rank, n):
        return CachedBatches(train_items, plan, rank, cfg.crop_len, cfg.seed,
                             fill_sampler(n, cfg))
    return fit(target, cfg, out_dir, vocab=vocab, feature_anchors=features.anchors,
               held_out=held_out, make_batches=batches, data_id=features.data_id(),
               train_tokens=features.token_count() - sum(len(x["tokens"]) for x in held_out),
               progress=progress, storage=storage, group=group)


def fit(target, cfg: TrainConfig, out_dir, *, vocab, feature_anchors, held_out, make_batches,
        data_id: str, train_tokens, progress: bool = True, storage: str = "int8", group=None,
        extra: dict | None = None) -> dict:
    """The PDM training run both paths share: build (or resume) the PDM, train it on
    make_batches(plan, rank, n) (spd.train.batches), evaluate on `held_out` items, save."""
    from spd.train.ranks import RankGroup, peak_memory_mb
    group = group or RankGroup()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layout = DepthLayout.build(target.num_layers, cfg.n_stages, cfg.split, cfg.anchors)
    micro = cfg.micro_batch or cfg.batch_sequences // group.world
    plan = BatchPlan(cfg.batch_sequences, max(1, micro), group.world)
    pdm = init_pdm(target, layout, cfg, vocab).to(group.device)
    if cfg.init_from and not (out / STATE).exists():
        copied = warm_start(pdm, cfg.init_from)
        if progress and group.main:
            print(f"[spd] warm start from {cfg.init_from}: {len(copied)} tensors copied")
    distiller = Distiller(target, pdm, feature_anchors, cfg.argmax_weight)

    def same_run(saved: dict) -> bool:
        return all(saved.get(k) == getattr(cfg, k) for k in ("n_stages", "anchors", "features"))

    run_steps(pdm, cfg, out, make_batches(plan, group.rank, layout.n),
              batch_loss=lambda micro: distiller.sums(micro, cfg.pack_tokens),
              evaluate=lambda: evaluate(distiller, held_out),
              config=dict(asdict(cfg), data=data_id, ranks=group.world), same_run=same_run,
              desc=f"training PDM (n={layout.n})", group=group, progress=progress)
    last = cfg.history[-1] if cfg.history else {}
    mine = peak_memory_mb(group.device)
    cfg.peak_memory = [dict(zip(mine, p))  # per rank, for the run's summary
                       for p in group.gather_floats(list(mine.values()))]
    if group.main:
        pdm.config.extra.update(train={k: v for k, v in asdict(cfg).items()
                                       if k not in ("history", "peak_memory")},
                                final_eval=dict(last), train_tokens=train_tokens,
                                **(extra or {}))
        pdm.save(out, storage=storage)
        (out / "history.json").write_text(json.dumps(cfg.history))
        (out / "memory.json").write_text(json.dumps({"peak_per_rank": cfg.peak_memory}))
    return last
