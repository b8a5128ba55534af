"""Measured costs for draft-cost-adjusted speedups (the evaluation harness's cost model).

Theoretical speedup counts target work only. To charge each method what it pays beyond that, on
the device where it pays it, the harness times the target's pieces on the current device:

- one full forward of one token (all layers, final norm and LM head): the plain AR step, t_fwd;
- each stage's forward of one token (its layers only), for every stage count in the grid;
- the final norm + LM head on one row, t_head (verification: greedy, the last stage runs it
  fused after its layers; under sampling SPD's draft rank runs it);
- one forward of a chunk of k+1 tokens (EAGLE-3's verification pass).

All at a fixed context length (a prefilled KV cache), median of `reps` runs after a warm-up.
Draft steps are timed inside each method's own decoding runs (its `draft` phase seconds over its
draft calls), so every method's drafter is measured as it actually runs. The formulas are in
`spd.evaluation.methods`; what they share is here (`Costs.cycle`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

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

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(**d)

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


@torch.no_grad()
def measure_costs(target, stage_counts, chunk_rows=(), context: int = 256,
                  reps: int = 10) -> Costs:
    """Time the target's pieces on its device (see the module docstring)."""
    costs = Costs(device=str(target.device), context=context, reps=reps,
                  num_layers=target.num_layers)
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
    med = _interleaved_medians(pieces, reps)
    costs.forward_s = med["forward"]
    costs.head_s = med["head"]
    costs.chunk_s = {str(r): med[f"chunk{r}"] for r in chunk_rows}
    costs.stage_s = {str(n): [med[f"stage{n}_{i}"] for i in range(n)]
                     for n in sorted(set(stage_counts))}
    return costs


__all__ = ["Costs", "measure_costs"]
