"""The control state of a batch of token chains, the batch first (spd_kernels.control's terms).

A chain's cycle (spd.runtime.cycle) decides on the device with three ops, cycle_open,
cycle_candidate and cycle_commit, each over a batch: the state, units and lanes of every
sequence are rows of the tensors here, and each sequence's Cycle holds views of its slot's rows.
One sequence decodes as a batch of one; a batch of sequences (spd.runtime.batch_spd) runs the
three ops once over all its slots, a free slot a finished sequence (`done`: nothing it does
changes a thing another reads).

Per slot: state [S] and units [n, H] int64, lanes (tok, alive, look, fill [R]), the plan and
the candidate the ops pass on, the constants (trash row, budget, lookup, greedy) and the stop
ids [T] (-1 pads), the window of anchors the drafter reads [m, n + 1, d]; for sampling the q
ring [R, Vr], the judged q [Vr] and the judged final row [d] (made at the first sampled draft,
when q's size is known).
"""
from __future__ import annotations

import torch

from spd.errors import SPDError
from spd_kernels.control import (
    CAND,
    CONST,
    DONE,
    UNIT,
    plan_rows,
    plan_size,
    state_size,
)

STOP_IDS = 8  # stop ids a slot holds at first (more: the table grows, at a join)


class ChainControl:
    """The control rows of `slots` chains of n stages; anchors [m, ., d] of `dtype` (module
    docstring)."""

    def __init__(self, slots: int, n: int, m: int, d: int, device, dtype):
        i64 = dict(dtype=torch.int64, device=device)
        self.slots, self.n, self.R = slots, n, n + 1
        self.device = torch.device(device)
        self.state = torch.zeros(slots, state_size(n), **i64)
        self.state[:, DONE] = 1  # a free slot: a finished sequence
        self.units = torch.zeros(slots, n, len(UNIT) + 1, **i64)
        self.lanes = [torch.zeros(slots, n + 1, **i64),
                      torch.zeros(slots, n + 1, dtype=torch.bool, device=device),
                      torch.zeros(slots, n + 1, dtype=torch.bool, device=device),
                      torch.zeros(slots, n + 1, **i64)]
        self.plan = torch.zeros(slots, plan_size(n), **i64)
        self.cand = torch.zeros(slots, len(CAND), **i64)
        self.consts = torch.zeros(slots, len(CONST), **i64)
        self.stops = torch.full((slots, STOP_IDS), -1, **i64)
        self.window = torch.zeros(slots, m, n + 1, d, dtype=dtype, device=device)
        self.judged_hidden = torch.zeros(slots, d, dtype=dtype, device=device)
        self.draws = torch.zeros(slots, 3, device=device)  # each slot's uniforms this cycle
        self.verdict = torch.zeros(slots, **i64)
        self.accepted = torch.zeros(slots, dtype=torch.bool, device=device)
        self.q_ring: torch.Tensor | None = None    # [slots, R, Vr] float32
        self.q_judged: torch.Tensor | None = None  # [slots, Vr] float32

    def take(self, slot: int, seq) -> None:
        """Slot `slot`'s rows for sequence `seq` (spd.runtime.sequence.Sequence): cleared, its
        constants and stop ids set, and finished until its cycle begins (Cycle.begin)."""
        if not 0 <= slot < self.slots:
            raise SPDError(f"slot {slot} is not one of the {self.slots} slots")
        for t in (self.state, self.units, self.plan, self.cand, *self.lanes):
            t[slot].zero_()
        self.state[slot, DONE].fill_(1)
        self.consts[slot] = torch.tensor([seq.trash, seq.max_new, seq.lookup_min,
                                          int(seq.sampling.greedy)])
        stop = sorted(seq.stop.stop_ids)
        if len(stop) > self.stops.shape[1]:  # (a new table: the next cycle is captured anew)
            grown = torch.full((self.slots, len(stop)), -1, dtype=torch.int64,
                               device=self.device)
            grown[:, :self.stops.shape[1]] = self.stops
            self.stops = grown
        self.stops[slot].fill_(-1)
        if stop:
            self.stops[slot, :len(stop)] = torch.tensor(stop)

    def first(self, k: int) -> ChainControl:
        """The first k slots' rows (views), as a control of k slots."""
        part = object.__new__(ChainControl)
        part.__dict__.update(self.__dict__)
        part.slots = k
        for name in ("state", "units", "plan", "cand", "consts", "stops", "window",
                     "judged_hidden", "draws", "verdict", "accepted", "q_ring", "q_judged"):
            t = getattr(self, name)
            setattr(part, name, None if t is None else t[:k])
        part.lanes = [t[:k] for t in self.lanes]
        return part

    def free(self, slot: int) -> None:
        """The slot's sequence left (ended, or told to): it is finished on the device too."""
        self.state[slot, DONE].fill_(1)

    def rows(self, slot: int) -> dict:
        """Slot `slot`'s views: its state [S], units [n, H], lanes (tok, alive, look, fill [R]),
        and where each stage's unit rows land [n, 1] (cycle_open writes them)."""
        return dict(state=self.state[slot], units=self.units[slot],
                    lanes=[t[slot] for t in self.lanes],
                    rows=plan_rows(self.plan[slot], self.n).view(self.n, 1))

    def ring(self, cols: int) -> None:
        """The q ring [slots, R, cols] and the judged q [slots, cols] (the first sampled draft
        fixes cols: the drafter's columns, or every target id with the context lookup)."""
        if self.q_ring is None or self.q_ring.shape[2] != cols:
            # (uniform where nothing was drafted: a free slot's row is judged too, and never
            # read; it must be a distribution)
            self.q_ring = torch.ones(self.slots, self.R, cols, device=self.device).div_(cols)
            self.q_judged = torch.ones(self.slots, cols, device=self.device).div_(cols)


__all__ = ["ChainControl"]
