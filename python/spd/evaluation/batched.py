"""The grid's batched rows: B sequences decoding at once, projected from measured costs.

Issue 54 (docs/batching.md). Each method's tokens/s over all B sequences, from the cost model's
pieces at R rows (`Costs.forward_at`, `stages_at`, `head_at`: one decode row per sequence, each
against its own slot's cache at the grid's context; B = 1 without a batched measurement falls
back on the one-row pieces) and, for SPD, the counts and draft time measured in its grid cell.
Each cost is charged where it runs:

  ar   one device; a step is one full forward over B rows (BatchedAR):
         B / t_fwd(B)
  pp   n devices, no speculation; the B requests in the system are held as g = min(B, n)
       groups of r_1 >= ... >= r_g rows, as even as they go (`cost_model.pipeline_groups`;
       B >= n: n groups of about B / n, B < n: B groups of one): a stage steps one group while
       the others are at other stages; a group's next token needs its last one, so it gains
       one token per trip through the n stages. A trip lasts the longest of the largest
       group's own pass and each stage's steps of all g groups (the last stage with the head
       over each group's rows), a step at least t_fwd(r) / n (the balanced premise, as
       `Costs.cycle`):
         B / max(t_fwd(r_1), sum_i t_i(r_1) + t_head(r_1), sum_j t_fwd(r_j) / n,
                 max_i sum_j t_i(r_j) (the last + t_head(r_j)))
       so at B = 1 the grid's pp row (1 / max(t_fwd, sum_i t_i + t_head)), and at B = g * r
       B / max(pass(r), g * slowest step(r)). As the unbatched pp row, no runtime cost per
       cycle is charged. (A device here steps a group as soon as it arrives; the one-process
       runtime spd.runtime.batch_pipeline steps every stage in lockstep cycles, a token every
       n cycles, which for B < n pays n slowest steps instead of one pass: no more than the
       stages' imbalance, and the same for B >= n in n even groups)
  spd  n stage devices and a draft rank (BatchedSPD): a cycle steps every stage once over one
       row per sequence (B rows: greedy, the last stage with the head over B rows, it judges
       every sequence's draft), while the draft rank runs one draft step over every
       sequence's window (the batched PDM step: its cell's t_draft scaled by the measured
       step over B windows against one's, `Costs.draft_scale`) and, under sampling, the head
       over the B judged rows. Each sequence gains its own alpha = S / n tokens a cycle (the
       measured N / K of the spd cell: its speculation is its own, as alone):
         B * (S / n) / cycle_B,
         cycle_B = max(t_fwd(B) / n, slowest t_i(B) (the last + t_head(B) when greedy),
                       t_draft * draft_scale(B) (+ t_head(B) under sampling))
                   + the runtime's cost per cycle
       (`Costs.runtime_s`, measured at one sequence, where given). The draft's picks and the
       sampling over the B rows are charged as at one (inside t_draft).

Per sequence: the total over B. At B = 1, with the batched pieces equal to the one-row ones,
each row's ratio over `ar` is the grid's adjusted speedup (spd, pp). `crossover` finds, from
the ratios over `ar` at each B, where a method overtakes batched AR and where it stops.
"""
from __future__ import annotations

from spd.evaluation.cost_model import Costs, pipeline_groups

BATCH_SIZES = (1, 2, 4, 8, 16)  # the grid's default B


def ar_tok_s(c: Costs, batch: int) -> float | None:
    """AR batched on one device: tokens/s over all `batch` sequences (None: not measured)."""
    fwd = c.forward_at(batch)
    return None if fwd is None else batch / fwd


def pp_tok_s(c: Costs, n: int, batch: int) -> float | None:
    """The pipeline without speculation on n devices, `batch` requests in groups (module
    docstring): tokens/s over all of them (None: not measured). The last stage computes the
    head at every temperature (AR's choice of the next token)."""
    groups = pipeline_groups(batch, n)
    need = {r: (c.forward_at(r), c.head_at(r), c.stages_at(n, r)) for r in set(groups)}
    if any(x is None for piece in need.values() for x in piece):
        return None
    fwd, head, per = need[groups[0]]           # the largest group's pass
    one_pass = max(fwd, sum(per) + head)
    busy = [0.0] * n                           # each stage's steps of every group in a trip
    floor = 0.0                                # the balanced premise: t_fwd(r) / n a step
    for r in groups:
        f, h, p = need[r]
        floor += f / n
        for i, t in enumerate(p):
            busy[i] += t + (h if i == n - 1 else 0.0)
    return batch / max(one_pass, floor, *busy)


def spd_cycle(c: Costs, n: int, batch: int, draft_s: float, greedy: bool) -> float | None:
    """A cycle of SPD over `batch` sequences on n stages and a draft rank (module docstring)."""
    fwd, head, per = c.forward_at(batch), c.head_at(batch), c.stages_at(n, batch)
    scale = c.draft_scale(n, batch)
    if fwd is None or head is None or per is None or scale is None:
        return None
    if greedy:
        per[-1] += head
    rank0 = draft_s * scale + (0.0 if greedy else head)
    return max(fwd / n, *per, rank0) + c.runtime_s.get(str(n), 0.0)


def spd_tok_s(c: Costs, n: int, batch: int, s_theory: float, draft_s: float,
              greedy: bool = True) -> float | None:
    """SPD batched: tokens/s over all `batch` sequences, each gaining S / n a cycle."""
    cycle = spd_cycle(c, n, batch, draft_s, greedy)
    return None if cycle is None else batch * (s_theory / n) / cycle


def crossover(ratios: dict) -> dict:
    """From {B: tokens/s over batched AR's at that B} (a None: not measured, left out): the B
    where the method beats AR, the first at which it does (`overtakes_at`), and the first
    larger B at which it no longer does (`stops_at`, None: it beats AR up to the largest B
    given; with `last_beating`, the largest B before it that still beats, and `again`, the
    larger B at which it beats AR once more: the pieces' cost need not grow smoothly in B)."""
    pts = sorted((int(b), r) for b, r in ratios.items() if r is not None)
    beats = [b for b, r in pts if r > 1.0]
    out = {"beats": beats, "overtakes_at": beats[0] if beats else None, "stops_at": None,
           "last_beating": None, "again": []}
    if beats:
        after = [b for b, r in pts if b > beats[0] and r <= 1.0]
        if after:
            out["stops_at"] = after[0]
            out["last_beating"] = max(b for b in beats if b < after[0])
            out["again"] = [b for b in beats if b > after[0]]
    return out


__all__ = ["BATCH_SIZES", "ar_tok_s", "crossover", "pp_tok_s", "spd_cycle", "spd_tok_s"]
