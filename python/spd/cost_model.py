"""Measured costs for draft-cost-adjusted speedups (the evaluation harness's cost model).

Theoretical speedup counts target work only. To charge each method its drafting where drafting is
not hidden, the harness times the target's pieces on the current device, here and now:

- one full forward of one token (all layers, final norm and LM head): the plain AR step;
- each stage's forward of one token, for every stage count in the grid;
- the final norm + LM head on one row (the verify that SPD's draft rank runs every cycle);
- one forward of a chunk of k+1 tokens (EAGLE-3's verification pass).

All at a fixed context length (a prefilled KV cache), median of `reps` runs after a warm-up.
Draft steps are timed inside each method's own decoding runs (its `draft` phase seconds over its
draft calls), so every method's drafter is measured as it actually runs.

The formulas (t_fwd = full forward, t_s = slowest stage, t_head, t_draft, t_chunk(k+1)):

  ar      1
  pp      t_fwd / (sum of stage forwards + t_head)         one token per pass through n stages
  spd     alpha*n * t_fwd / (n * max(t_s, t_draft + t_head)) the draft rank drafts and verifies
                                                         while the stages run (hidden up to t_s)
  ppsd    alpha*n * t_fwd / (n * (t_s + t_draft))           drafting waits for each step (not hidden)
  eagle3  tau * t_fwd / (k * t_draft + t_chunk(k+1))       k serial drafts, one verification pass

(alpha*n is S_theory; a cycle of SPD/PPSD costs one stage time, so tokens/s relative to AR is
alpha * t_fwd / cycle_time.)
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from spd.partition import DepthLayout
from spd.target import Stage


@dataclass
class Costs:
    device: str
    context: int
    reps: int
    forward_s: float = 0.0                       # one token through every layer + head
    head_s: float = 0.0                          # final norm + LM head, one row
    stage_s: dict = field(default_factory=dict)  # str(n) -> [seconds per stage], one token
    chunk_s: dict = field(default_factory=dict)  # str(rows) -> full forward of `rows` tokens

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(**d)

    def slowest_stage(self, n: int) -> float:
        return max(self.stage_s[str(n)])


def _median_time(fn, reps: int) -> float:
    for _ in range(2):  # warm-up (first calls pay allocation and dispatch set-up)
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.no_grad()
def measure_costs(target, stage_counts, chunk_rows=(), context: int = 256,
                  reps: int = 10) -> Costs:
    """Time the target's pieces on its device (see the module docstring)."""
    costs = Costs(device=str(target.device), context=context, reps=reps)
    capacity = context + max([1, *chunk_rows]) + 1
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (context,), generator=gen).to(target.device)
    one = prompt[:1]

    def prefilled(stages):
        h = target.embed_tokens(prompt)
        for st in stages:
            st.cache.truncate(0)
            h = st.forward(h, 0)

    full = [Stage(target, 0, range(target.num_layers), capacity)]
    prefilled(full)

    def forward(rows: int):
        def run():
            full[0].cache.truncate(context)
            h = full[0].forward(target.embed_tokens(prompt[:rows]), context)
            target.logits(h[-1:])
        return run

    costs.forward_s = _median_time(forward(1), reps)
    for rows in chunk_rows:
        costs.chunk_s[str(rows)] = _median_time(forward(rows), reps)
    hidden = target.embed_tokens(one)
    costs.head_s = _median_time(lambda: target.logits(hidden), reps)
    for n in sorted(set(stage_counts)):
        layout = DepthLayout.build(target.num_layers, n)
        stages = [Stage(target, i, r, capacity) for i, r in enumerate(layout.stages)]
        prefilled(stages)
        per_stage = []
        for st in stages:
            def run(st=st):
                st.cache.truncate(context)
                st.forward(hidden, context)
            per_stage.append(_median_time(run, reps))
        costs.stage_s[str(n)] = per_stage
    return costs


def adjusted_speedup(method: str, costs: Costs, *, n: int = 1, s_theory: float = 1.0,
                     draft_s: float = 0.0, draft_steps: int = 0) -> float:
    """Draft-cost-adjusted speedup over AR on one device (module docstring)."""
    t_fwd = costs.forward_s
    if method == "ar":
        return 1.0
    if method == "pp":
        return t_fwd / (sum(costs.stage_s[str(n)]) + costs.head_s)
    if method == "spd":
        cycle = max(costs.slowest_stage(n), draft_s + costs.head_s)
        return s_theory / n * t_fwd / cycle
    if method == "ppsd":
        return s_theory / n * t_fwd / (costs.slowest_stage(n) + draft_s)
    if method == "eagle3":
        return s_theory * t_fwd / (draft_steps * draft_s + costs.chunk_s[str(draft_steps + 1)])
    raise ValueError(f"unknown method {method}")


def devices_used(method: str, n: int) -> int:
    """Devices each method occupies: SPD adds a draft rank to its n stage ranks; PPSD drafts on
    its first stage's device; PP uses the n stage ranks; AR and EAGLE-3 one device."""
    return {"ar": 1, "eagle3": 1, "pp": n, "ppsd": n, "spd": n + 1}[method]


__all__ = ["Costs", "adjusted_speedup", "devices_used", "measure_costs"]
