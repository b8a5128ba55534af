"""The control state of a batch of sequences, the batch first (spd_kernels.control's terms).

A chain's cycle (spd.runtime.cycle) decides on the device with three ops, cycle_open,
cycle_candidate and cycle_commit, each over a batch: the state, units and lanes of every
sequence are rows of the tensors here, and each sequence's Cycle holds views of its slot's rows.
One sequence decodes as a batch of one; a batch of sequences (spd.runtime.batch_spd) runs the
three ops once over all its slots, a free slot a finished sequence (`done`: nothing it does
changes a thing another reads).

Per slot: state [S] and units [n, H] int64, lanes (tok, alive, look, fill [R]), the plan and
the candidate the ops pass on, the constants (trash row, budget, lookup, greedy, the draws'
key) and the stop ids [T] (-1 pads), the window of anchors the drafter reads [m, n + 1, d],
the cycle's uniforms [W + 2] (the open draws them: spd_kernels.philox); for sampling the q
ring [R, Vr], the judged q [Vr] and the judged final row [d] (made at the first sampled draft,
when q's size is known).

A token tree's (TreeControl) holds spd_kernels.tree_control's tensors instead: its lanes, the
tree plan and mask, the window's anchors [m, R W, d], the children and the judged candidates.
"""
from __future__ import annotations

import torch

from spd.errors import SPDError
from spd_kernels.control import (
    CAND,
    CONST,
    DONE,
    TRASH,
    UNIT,
    plan_rows,
    plan_size,
    state_size,
)
from spd_kernels.philox import seed_key
from spd_kernels.tree_control import (
    KID,
    judge_size,
    tplan_fields,
    tplan_size,
    tree_unit_size,
)

STOP_IDS = 8  # stop ids a slot holds at first (more: the table grows, at a join)


class Control:
    """What every slot holds, chain or tree: state [S], the constants and the stop ids, the
    judged final row [d], the verdict."""
    cleared: tuple[str, ...] = ()  # the per-slot tensors `take` clears, beside state and units

    def __init__(self, slots: int, n: int, d: int, H: int, device, dtype):
        i64 = dict(dtype=torch.int64, device=device)
        self.slots, self.n, self.R = slots, n, n + 1
        self.device = torch.device(device)
        self.state = torch.zeros(slots, state_size(n), **i64)
        self.state[:, DONE] = 1  # a free slot: a finished sequence
        self.units = torch.zeros(slots, n, H, **i64)
        self.consts = torch.zeros(slots, len(CONST), **i64)
        self.stops = torch.full((slots, STOP_IDS), -1, **i64)
        self.judged_hidden = torch.zeros(slots, d, dtype=dtype, device=device)
        self.verdict = torch.zeros(slots, **i64)
        self.tables = 0  # the stop table's generation (a graph records its address)

    def take(self, slot: int, seq) -> None:
        """Slot `slot`'s rows for sequence `seq` (spd.runtime.sequence.Sequence): cleared, its
        constants and stop ids set, and finished until its cycle begins (Cycle.begin)."""
        if not 0 <= slot < self.slots:
            raise SPDError(f"slot {slot} is not one of the {self.slots} slots")
        for t in (self.state, self.units, *(getattr(self, name) for name in self.cleared),
                  *self.lanes):
            t[slot].zero_()
        self.state[slot, DONE].fill_(1)
        self.consts[slot] = torch.tensor([seq.trash, seq.max_new, seq.lookup_min,
                                          int(seq.sampling.greedy),
                                          seed_key(seq.sampling.seed)])
        stop = sorted(seq.stop.stop_ids)
        if len(stop) > self.stops.shape[1]:  # (a new table: the next cycle is captured anew)
            self.tables += 1
            grown = torch.full((self.slots, len(stop)), -1, dtype=torch.int64,
                               device=self.device)
            grown[:, :self.stops.shape[1]] = self.stops
            self.stops = grown
        self.stops[slot].fill_(-1)
        if stop:
            self.stops[slot, :len(stop)] = torch.tensor(stop)

    def free(self, slot: int) -> None:
        """The slot's sequence left (ended, or told to): it is finished on the device too."""
        self.state[slot, DONE].fill_(1)

    def park(self, slot: int, head: torch.Tensor) -> None:
        """Every unit of slot `slot` becomes `head` [H] (a dead unit at the slot's trash row:
        spd.runtime.unit.dead_unit, on the device): a batch whose stage steps run over every
        slot (docs/batching.md, decision 5) then writes nothing of a free or prefilling slot
        that a sequence reads. The open leaves a finished slot's units as they are."""
        self.units[slot].copy_(head.expand_as(self.units[slot]))

    def park_all(self, trash: int, head: torch.Tensor) -> None:
        """Every slot parked (`park`) at row `trash` with unit `head` [H] (set-up: free slots
        before any sequence, their trash row `trash` until one takes them)."""
        self.consts[:, TRASH] = trash
        self.park(slice(None), head)

    def first(self, k: int):
        """The first k slots' rows (views), as a control of k slots."""
        part = object.__new__(type(self))
        part.__dict__.update(self.__dict__)
        part.slots = k
        for name, t in self.__dict__.items():
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == self.slots:
                setattr(part, name, t[:k])
        part.lanes = [t[:k] for t in self.lanes]
        return part


class ChainControl(Control):
    """The control rows of `slots` chains of n stages; anchors [m, ., d] of `dtype` (module
    docstring)."""
    cleared = ("plan", "cand", "draws")

    def __init__(self, slots: int, n: int, m: int, d: int, device, dtype):
        super().__init__(slots, n, d, len(UNIT) + 1, device, dtype)
        i64 = dict(dtype=torch.int64, device=device)
        self.lanes = [torch.zeros(slots, n + 1, **i64),
                      torch.zeros(slots, n + 1, dtype=torch.bool, device=device),
                      torch.zeros(slots, n + 1, dtype=torch.bool, device=device),
                      torch.zeros(slots, n + 1, **i64)]
        self.plan = torch.zeros(slots, plan_size(n), **i64)
        self.cand = torch.zeros(slots, len(CAND), **i64)
        self.window = torch.zeros(slots, m, n + 1, d, dtype=dtype, device=device)
        self.draws = torch.zeros(slots, 3, device=device)  # each slot's uniforms this cycle
        self.accepted = torch.zeros(slots, dtype=torch.bool, device=device)
        self.q_ring: torch.Tensor | None = None    # [slots, R, Vr] float32
        self.q_judged: torch.Tensor | None = None  # [slots, Vr] float32

    def rows(self, slot: int) -> dict:
        """Slot `slot`'s views: its state [S], units [n, H], lanes (tok, alive, look, fill [R]),
        and where each stage's unit rows land [n, 1] (cycle_open writes them)."""
        return dict(state=self.state[slot], units=self.units[slot],
                    lanes=[t[slot] for t in self.lanes],
                    rows=plan_rows(self.plan[slot], self.n).view(self.n, 1))

    def unit_rows(self) -> torch.Tensor:
        """[slots, n, 1]: where each stage's unit row lands, every slot (a view)."""
        return plan_rows(self.plan, self.n).unsqueeze(-1)

    def ring(self, cols: int) -> None:
        """The q ring [slots, R, cols] and the judged q [slots, cols] (the first sampled draft
        fixes cols: the drafter's columns, or every target id with the context lookup)."""
        if self.q_ring is None or self.q_ring.shape[2] != cols:
            # (uniform where nothing was drafted: a free slot's row is judged too, and never
            # read; it must be a distribution)
            self.q_ring = torch.ones(self.slots, self.R, cols, device=self.device).div_(cols)
            self.q_judged = torch.ones(self.slots, cols, device=self.device).div_(cols)


class TreeControl(Control):
    """The control rows of `slots` token trees of n stages and W rows a position; anchors
    [m, ., d] of `dtype` (module docstring; spd_kernels.tree_control's terms)."""
    cleared = ("tplan", "kids", "kid_score", "judge", "draws")

    def __init__(self, slots: int, n: int, W: int, m: int, d: int, device, dtype):
        super().__init__(slots, n, d, tree_unit_size(n, W), device, dtype)
        i64 = dict(dtype=torch.int64, device=device)
        R, RW = n + 1, (n + 1) * W
        self.W = W
        # tok, par, score, alive, look, anc, clane, fill (spd_kernels.tree_control.LANES)
        self.lanes = [torch.zeros(slots, R, W, **i64), torch.zeros(slots, R, W, **i64),
                      torch.zeros(slots, R, W, device=device),
                      torch.zeros(slots, R, W, dtype=torch.bool, device=device),
                      torch.zeros(slots, R, W, dtype=torch.bool, device=device),
                      torch.zeros(slots, R, W, R, **i64), torch.full((slots, R), -1, **i64),
                      torch.zeros(slots, R, **i64)]
        self.tplan = torch.zeros(slots, tplan_size(n, W), **i64)
        self.mask = torch.zeros(slots, RW, RW, dtype=torch.bool, device=device)
        self.window = torch.zeros(slots, m, RW, d, dtype=dtype, device=device)
        self.kids = torch.zeros(slots, W, len(KID) + R, **i64)
        self.kid_score = torch.zeros(slots, W, device=device)
        self.judge = torch.zeros(slots, judge_size(W), **i64)
        self.accepted = torch.zeros(slots, **i64)  # the accepted candidate's index, -1: none
        self.no_drafts = torch.zeros(slots, **i64)  # (a greedy judge's stand-in drafts)
        self.draws = torch.zeros(slots, W + 2, device=device)
        # the draft step's top children of each leaf (made at the first, when k is known)
        self.top: torch.Tensor | None = None       # [slots, W, k] float32 log-probabilities
        self.top_cols: torch.Tensor | None = None  # [slots, W, k] int64 the drafter's columns
        self.top_ids: torch.Tensor | None = None   # [slots, W, k] int64 their target ids
        self.pmax: torch.Tensor | None = None      # [slots, W] float32 each leaf's top p

    def unit_rows(self) -> torch.Tensor:
        """[slots, n, W]: where each stage's unit rows land, every slot (a view)."""
        return tplan_fields(self.tplan, self.n, self.W)["rows"]

    def tops(self, k: int) -> None:
        """The draft step's outputs for k children a leaf (the first draft fixes k: W, or the
        drafter's vocabulary where smaller)."""
        if self.top is None or self.top.shape[2] != k:
            W, dev = self.W, self.device
            self.top = torch.zeros(self.slots, W, k, device=dev)
            self.top_cols = torch.zeros(self.slots, W, k, dtype=torch.int64, device=dev)
            self.top_ids = torch.zeros(self.slots, W, k, dtype=torch.int64, device=dev)
            self.pmax = torch.zeros(self.slots, W, device=dev)

    def top_rows(self, b: int) -> tuple:
        """Slot b's (top, top_cols, top_ids, pmax) rows: where its draft step writes."""
        return self.top[b], self.top_cols[b], self.top_ids[b], self.pmax[b]

    def take(self, slot: int, seq) -> None:
        super().take(slot, seq)
        self.lanes[6][slot].fill_(-1)  # no committed lane yet

    def rows(self, slot: int) -> dict:
        """Slot `slot`'s views: its state [S], units [n, H], lanes, and where each stage's unit
        rows land [n, W] (tree_open writes them)."""
        return dict(state=self.state[slot], units=self.units[slot],
                    lanes=[t[slot] for t in self.lanes],
                    rows=tplan_fields(self.tplan[slot], self.n, self.W)["rows"])


__all__ = ["ChainControl", "Control", "TreeControl"]
