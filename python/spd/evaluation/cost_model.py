"""Measured costs for draft-cost-adjusted speedups (the evaluation harness's cost model).

Theoretical speedup counts target work only. To charge each method what it pays beyond that, on
the device where it pays it, the harness times the target's pieces on the current device:

- one full forward of one token (all layers, final norm and LM head): the plain AR step, t_fwd;
- each stage's forward of one token (its layers only), for every stage count in the grid;
- the final norm + LM head on one row, t_head (verification: greedy, the last stage runs it
  fused after its layers; under sampling SPD's draft rank runs it);
- one forward of a chunk of k+1 tokens (EAGLE-3's verification pass).

All at a fixed context length (a prefilled KV cache), median of `reps` runs after a warm-up.

For the batched rows (issue 54, docs/batching.md; the projections are in
`spd.evaluation.batched`), the same pieces at R rows, one decode row per sequence, each row at
the fixed context against its own slot's cache (`spd_kernels.stage.batch_stage_step` over slot
caches, as the batched runtime and benchmarks/bench_batch_step.py run it, so each row pays its
own attention): the full forward (embed, every layer, final norm + LM head over the R rows),
each stage's step and the head, for every R the batched rows need (`batch_rows`), and for
every n the PDM's step over the windows of B sequences (n + 1 rows each, in its slot caches:
`PipelineDraftModule.batch_step`, as a batch's cycle drafts; an untrained PDM of the default
shape for that n) against its step over one window (`Costs.draft_scale`). Dense
targets only (the batched runtime's scope); the slot caches hold random keys and values (what
they hold does not change the work).
Draft steps are timed inside each method's own decoding runs (its `draft` phase seconds over its
draft calls), so every method's drafter is measured as it actually runs. The formulas are in
`spd.evaluation.methods`; what they share is here (`Costs.cycle`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, fields

import torch

from spd.model.partition import DepthLayout, balanced_split, stage_times
from spd.model.target import Stage


@dataclass
class Costs:
    device: str
    context: int
    reps: int
    forward_s: float = 0.0                       # one token through every layer + head
    head_s: float = 0.0                          # final norm + LM head, one row
    stage_s: dict = field(default_factory=dict)  # str(n) -> [seconds per stage], one token
    chunk_s: dict = field(default_factory=dict)  # str(rows) -> full forward of `rows` tokens
    num_layers: int = 0                          # the target's L (0: not recorded, older grids)
    # str(n) -> the distributed runtime's own seconds per cycle beyond its compute, measured
    # (`runtime_overhead`); empty: none charged
    runtime_s: dict = field(default_factory=dict)
    # The batched rows (issue 54): B sequences, one decode row each against its own slot at
    # `context`. Empty: not measured (grids stored before them, hybrid targets).
    batch_sizes: list = field(default_factory=list)      # the B of the report's batched rows
    batch_forward_s: dict = field(default_factory=dict)  # str(R) -> full forward of R rows
    batch_head_s: dict = field(default_factory=dict)     # str(R) -> norm + LM head, R rows
    batch_stage_s: dict = field(default_factory=dict)    # str(n) -> {str(R): [s per stage]}
    batch_draft_s: dict = field(default_factory=dict)    # str(n) -> {str(B): one PDM step
    #                                                       over B sequences' windows}

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        """From `as_dict`'s dict; an older one, without the later fields, gets their defaults
        (a field this version does not know is left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    # --- the batched pieces (None: not measured). One row falls back on the one-row
    # measurements, so a grid stored before the batched rows still has its B = 1 row.
    def forward_at(self, rows: int) -> float | None:
        """One full forward over `rows` decode rows (one per sequence)."""
        got = self.batch_forward_s.get(str(rows))
        return self.forward_s if got is None and rows == 1 else got

    def head_at(self, rows: int) -> float | None:
        """The final norm + LM head over `rows` rows."""
        got = self.batch_head_s.get(str(rows))
        return self.head_s if got is None and rows == 1 else got

    def stages_at(self, n: int, rows: int) -> list[float] | None:
        """Each of the n stages' step over `rows` decode rows."""
        got = self.batch_stage_s.get(str(n), {}).get(str(rows))
        if got is None and rows == 1:
            got = self.stage_s.get(str(n))
        return None if got is None else list(got)

    def draft_scale(self, n: int, batch: int) -> float | None:
        """One draft step over `batch` sequences' windows (the batched PDM step at n stages)
        over one sequence's: 1 at B = 1, None where not measured."""
        per = self.batch_draft_s.get(str(n), {})
        one, got = per.get("1"), per.get(str(batch))
        if batch == 1:
            return 1.0
        return None if one is None or got is None else got / one

    def covers_batches(self, batch_sizes, stage_counts) -> bool:
        """Whether every piece the batched rows of `batch_sizes` on `stage_counts` need was
        measured (`batch_rows`)."""
        if not set(batch_sizes) <= set(self.batch_sizes):
            return False
        ns = list(stage_counts)
        return all(self.forward_at(r) is not None and self.head_at(r) is not None
                   and all(self.stages_at(n, r) is not None for n in ns)
                   for r in batch_rows(batch_sizes, ns)) and all(
            self.draft_scale(n, b) is not None for n in ns for b in batch_sizes)

    def slowest_stage(self, n: int, head_on_last: bool = False) -> float:
        """The slowest of the n stage forwards; `head_on_last`: the last stage also runs the
        final norm + LM head (it verifies greedy drafts, fused after its layers)."""
        per = list(self.stage_s[str(n)])
        if head_on_last:
            per[-1] += self.head_s
        return max(per)

    def layer_costs(self, n: int) -> list[float] | None:
        """Seconds per layer from the n-stage measurement: each layer of uniform stage i costs
        t_i / its layer count (so a hybrid's dearer stages stay dearer); None when the layer
        count was not recorded."""
        if not self.num_layers:
            return None
        sizes = [len(r) for r in DepthLayout.build(self.num_layers, n).stages]
        return [t / k for t, k in zip(self.stage_s[str(n)], sizes) for _ in range(k)]

    def balanced_cycle(self, n: int, last_extra: float = 0.0,
                       extra: dict[int, float] | None = None) -> float:
        """The slowest stage of the balanced split (spd.model.partition.balanced_split) of the
        measured layer costs, the last stage paying `last_extra` and stage s `extra[s]`.
        Without the layer count, the bound of a split into fractions of layers: the total over
        n, and no stage below its own extra work."""
        per = self.layer_costs(n)
        if per is None:
            total = sum(self.stage_s[str(n)]) + last_extra + sum((extra or {}).values())
            return max(total / n, last_extra, *(extra or {}).values())
        split = balanced_split(per, n, last_extra, extra)
        return max(stage_times(per, split, last_extra, extra))

    def balanced(self, n: int) -> float:
        """A cycle as S_theory assumes it: an n-th of the full forward (layers and head)."""
        return self.forward_s / n

    def cycle(self, n: int, *work: float) -> float:
        """One pipelined cycle: the slowest of the devices' work in it (`work`: seconds per
        device), and never less than the balanced cycle S_theory assumes. So the adjusted
        speedup charges what a method pays beyond S_theory's premise (a stage slower than its
        share, the head where it runs, drafting that is not hidden) and never credits more than
        the premise (measurement noise, or work moved to an extra device). Where the
        runtime's own cost per cycle was measured (`runtime_s`), it is added."""
        return max(self.balanced(n), *work) + self.runtime_s.get(str(n), 0.0)


def pipeline_groups(batch: int, n: int) -> list[int]:
    """How the batched pipeline without speculation holds `batch` requests on n stages: as
    min(batch, n) groups, as even as they go (a stage steps one group while the others are at
    other stages; a group's next token needs its last one, so it waits for its own trip) ->
    each group's rows, largest first (8 on 3 stages: [3, 3, 2])."""
    groups = min(batch, n)
    q, rem = divmod(batch, groups)
    return [q + 1] * rem + [q] * (groups - rem)


def batch_rows(batch_sizes, stage_counts) -> list[int]:
    """The row counts the batched rows need measured: every B (AR and SPD run one row per
    sequence a step) and every pipeline group's (`pipeline_groups`)."""
    rows = set(batch_sizes)
    rows |= {r for b in batch_sizes for n in stage_counts for r in pipeline_groups(b, n)}
    return sorted(rows)


def runtime_overhead(path, device_type: str) -> dict[str, float]:
    """{str(n): seconds} from a `benchmarks/bench_protocol.py` JSON: per n, the median over its
    F of (cycle - F) with the always-right drafter (what the runtime costs a steady cycle beyond
    its compute); n + 1 processes. The file must have been measured on `device_type` ("cpu" or
    "cuda")."""
    import json
    import statistics
    from pathlib import Path

    from spd.errors import SPDError
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        meta, rows = data["meta"], data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SPDError(f"--runtime-from {path}: not a bench_protocol.py JSON ({exc})") from None
    if meta.get("device_type") != device_type:
        raise SPDError(f"--runtime-from {path}: measured on {meta.get('device_type')!r}, the "
                       f"grid runs on {device_type!r}")
    steady = [r for r in rows if r.get("drafter") == "always-right"
              and r.get("draft_on_stage") is None]
    loop = "device" if any(r.get("loop") == "device" for r in steady) else "host"
    out: dict[str, list[float]] = {}
    for r in steady:
        if r.get("loop", "host") == loop:
            out.setdefault(str(r["n"]), []).append(max(0.0, r["cycle_ms"] - r["F_ms"]) * 1e-3)
    if not out:
        raise SPDError(f"--runtime-from {path}: no always-right rows with n + 1 processes")
    return {n: statistics.median(v) for n, v in out.items()}


def _interleaved_medians(pieces: dict, reps: int) -> dict:
    """Median seconds of each callable, timed round-robin (one run of each per round) after a
    warm-up, so a load that comes and goes on a shared machine hits every piece alike and the
    ratios between them (what the speedups use) stay fair."""
    for fn in pieces.values():
        for _ in range(2):  # first calls pay allocation and dispatch set-up
            fn()
    times = {k: [] for k in pieces}
    for _ in range(reps):
        for k, fn in pieces.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _draft_pieces(target, stage_counts, batch_sizes, context: int) -> dict:
    """The PDM's step over the windows of B sequences for every B of `batch_sizes` and 1, at
    every n (the module docstring): {name: callable}. Slot caches of random keys and values,
    each window of n + 1 rows at `context`, random anchor rows."""
    from spd.draft.pdm import PipelineDraftModule

    t, pieces = target, {}
    sizes = sorted(set(batch_sizes) | {1})
    most = max(sizes)
    gen = torch.Generator().manual_seed(2)
    for n in sorted(set(stage_counts)):
        layout = DepthLayout.build(t.num_layers, n)
        pdm = PipelineDraftModule.untrained(t, layout)
        R = n + 1
        k, v, _ = pdm.slot_caches(most, context + R + 1)
        for x in (k, v):
            x.copy_(torch.randn(x.shape, generator=gen))
        window = torch.randn(len(layout.anchors), most * R, t.hidden_size,
                             generator=gen).to(device=t.device, dtype=t.dtype)
        types = torch.tensor([layout.agg_type(j) for j in range(R)],
                             device=t.device).repeat(most)
        slots = torch.arange(most, device=t.device).repeat_interleave(R)
        positions = (context + torch.arange(R, device=t.device)).repeat(most)
        last = torch.arange(most, device=t.device) * R + n

        def step(pdm, k, v, window, types, slots, positions, last, b, R=R):
            return lambda: pdm.batch_step(pdm.features(window[:, :b * R], types[:b * R]), k, v,
                                          slots[:b * R], positions[:b * R], last[:b])
        for b in sizes:
            pieces[f"bdraft{n}_{b}"] = step(pdm, k, v, window, types, slots, positions, last, b)
    return pieces


def _batch_pieces(target, stage_counts, rows, context: int) -> dict:
    """The batched pieces at every R in `rows` (the module docstring): {name: callable}, read
    back by `_store_batches`. One slot cache [max R, layers, kv_heads, context + 1, head_dim]
    serves every piece: a stage steps its layers' slice of it, row r in slot r at `context`."""
    from spd_kernels.stage import batch_stage_step

    t = target
    most = max(rows)
    gen = torch.Generator().manual_seed(1)
    shape = (most, t.num_layers, t.num_kv_heads, context + 1, t.head_dim)
    k = torch.randn(shape, generator=gen).to(device=t.device, dtype=t.dtype)
    v = torch.randn(shape, generator=gen).to(device=t.device, dtype=t.dtype)
    cos, sin = t.rope(0, context + 1)
    tokens = torch.randint(0, t.vocab_size, (most,), generator=gen).to(t.device)
    hidden = t.embed_tokens(tokens)
    slots = torch.arange(most, device=t.device)
    at = torch.full((most,), context, dtype=torch.int64, device=t.device)

    def step(weights, first: int, last: int, r: int, x=None):
        def run():  # x None: the full forward, from the tokens' embedding to the head
            h = batch_stage_step(t.embed_tokens(tokens[:r]) if x is None else x[:r], weights,
                                 k[:, first:last], v[:, first:last], slots[:r], at[:r], cos,
                                 sin)[-1]
            return t.logits(h) if x is None else h
        return run

    full = t.stage_weights(range(t.num_layers))
    pieces = {}
    for r in rows:
        pieces[f"bforward{r}"] = step(full, 0, t.num_layers, r)
        pieces[f"bhead{r}"] = (lambda r_: lambda: t.logits(hidden[:r_]))(r)
    for n in sorted(set(stage_counts)):
        for i, layer_ids in enumerate(DepthLayout.build(t.num_layers, n).stages):
            w = t.stage_weights(layer_ids)
            for r in rows:
                pieces[f"bstage{n}_{i}_{r}"] = step(w, layer_ids.start, layer_ids.stop, r,
                                                    hidden)
    return pieces


def _store_batches(costs: Costs, med: dict, batch_sizes, stage_counts, rows) -> None:
    costs.batch_sizes = sorted(set(batch_sizes))
    costs.batch_forward_s = {str(r): med[f"bforward{r}"] for r in rows}
    costs.batch_head_s = {str(r): med[f"bhead{r}"] for r in rows}
    costs.batch_stage_s = {str(n): {str(r): [med[f"bstage{n}_{i}_{r}"] for i in range(n)]
                                    for r in rows} for n in sorted(set(stage_counts))}
    costs.batch_draft_s = {str(n): {str(b): med[f"bdraft{n}_{b}"]
                                    for b in sorted(set(batch_sizes) | {1})}
                           for n in sorted(set(stage_counts))}


@torch.no_grad()
def measure_batch_costs(target, stage_counts, batch_sizes, context: int = 256,
                        reps: int = 10, costs: Costs | None = None) -> Costs:
    """Only the batched pieces (a grid stored before them gains its batched rows): into
    `costs` (a new Costs when None), replacing its batched fields. A hybrid target: none (the
    batched runtime is dense only)."""
    if costs is None:
        costs = Costs(device=str(target.device), context=context, reps=reps,
                      num_layers=target.num_layers)
    if target.hybrid or not batch_sizes:
        return costs
    rows = batch_rows(batch_sizes, stage_counts)
    med = _interleaved_medians(_batch_pieces(target, stage_counts, rows, context)
                               | _draft_pieces(target, stage_counts, batch_sizes, context), reps)
    _store_batches(costs, med, batch_sizes, stage_counts, rows)
    return costs


@torch.no_grad()
def measure_costs(target, stage_counts, chunk_rows=(), context: int = 256,
                  reps: int = 10, batch_sizes=()) -> Costs:
    """Time the target's pieces on its device (see the module docstring); `batch_sizes`: the B
    of the batched rows (none: not measured; a hybrid target: none)."""
    costs = Costs(device=str(target.device), context=context, reps=reps,
                  num_layers=target.num_layers)
    batch_sizes = () if target.hybrid else tuple(batch_sizes)
    capacity = context + max([1, *chunk_rows]) + 1
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).to(target.device)

    def prefilled(stages):
        h = target.embed_tokens(prompt)
        for st in stages:
            h = st.forward(h, 0)
        return stages

    def step(stage, x):  # one forward at the end of the prefilled context, rolled back after
        def run():
            stage.cache.truncate(context)
            return stage.forward(x, context)
        return run

    # each timed step is rolled back: as deep as its rows (hybrid targets' state rings)
    deep = max([1, *chunk_rows])
    full = prefilled([Stage(target, 0, range(target.num_layers), capacity,
                            max_rollback=deep)])[0]

    def forward(rows: int):  # embed, every layer, then the LM head on the last row
        return lambda: target.logits(step(full, target.embed_tokens(prompt[:rows]))()[-1:])

    hidden = target.embed_tokens(prompt[:1])
    pieces = {"forward": forward(1), "head": lambda: target.logits(hidden)}
    for rows in chunk_rows:
        pieces[f"chunk{rows}"] = forward(rows)
    for n in sorted(set(stage_counts)):
        layout = DepthLayout.build(target.num_layers, n)
        stages = prefilled([Stage(target, i, r, capacity) for i, r in enumerate(layout.stages)])
        for i, st in enumerate(stages):
            pieces[f"stage{n}_{i}"] = step(st, hidden)
    rows = batch_rows(batch_sizes, stage_counts)
    if batch_sizes:  # timed round-robin with the one-row pieces
        pieces |= _batch_pieces(target, stage_counts, rows, context)
        pieces |= _draft_pieces(target, stage_counts, batch_sizes, context)
    med = _interleaved_medians(pieces, reps)
    if batch_sizes:
        _store_batches(costs, med, batch_sizes, stage_counts, rows)
    costs.forward_s = med["forward"]
    costs.head_s = med["head"]
    costs.chunk_s = {str(r): med[f"chunk{r}"] for r in chunk_rows}
    costs.stage_s = {str(n): [med[f"stage{n}_{i}"] for i in range(n)]
                     for n in sorted(set(stage_counts))}
    return costs


__all__ = ["Costs", "batch_rows", "measure_batch_costs", "measure_costs", "pipeline_groups"]
