"""The draft step of a cycle: the rows that enter stage 0 next, as fixed-shape device work.

Terms.
  window    the drafter's rows this cycle: the n + 1 positions w0 .. w0 + n, each with W lanes
            (a chain: one), w0 = max(newest - n, final): `final` is the last cycle's `start`
            (the oldest in flight), the rows below it are in the drafter's cache with their
            final features. Positions up to `start` are committed, one row each, final below
            it; those in flight have the depth they are at; positions past the newest are dead
            rows, never read (their type is the newest's: they add no projection). So every
            cycle drafts the same shapes, whatever the schedule, and computes each committed
            row's final features once.
  lane      a row's index among its position's rows; with the position it names the row. The
            lanes' tokens, parents (the lane at the position before), cumulative draft
            log-probabilities and liveness are kept by position mod (n + 1) (`Lanes`).
  children  what is drafted for position newest + 1: a chain's one token (the drafter's guess,
            or the context lookup's where the gate trusts it more: spd.draft.lookup), or a
            token tree's W most probable (leaf, token) pairs by cumulative draft
            log-probability, the lookup's token for the most probable leaf competing at the log
            of its trust. The draft step gives the drafter's guess (a tree: each leaf's most
            probable children); the cycle's control ops pick the children from it
            (spd_kernels.cycle_candidate, spd_kernels.tree_children).
"""
from __future__ import annotations

import torch

from spd_kernels.control import P_CHILD, P_LAST, P_W0, plan_window
from spd_kernels.tree_control import T_W0, tplan_fields


class Lanes:
    """The rows of the positions in flight, by position mod (n + 1) and lane: views of a
    control slot's lane tensors (spd.runtime.control): a chain's (tok, alive, look, fill [R]),
    a token tree's spd_kernels.tree_control.LANES: tok, par, score, alive, look [R, W]; anc
    [R, W, R] the lane of each row's ancestor k positions back (k = 0: its own; kept with the
    row, so a branch is one gather, never a walk); clane [R] the committed lane (-1: not
    committed); fill [R] the tokens in flight when the position was drafted (its draft
    position)."""

    def __init__(self, n: int, width: int, rows: list[torch.Tensor]):
        R, W = n + 1, width
        self.n, self.R, self.W = n, R, W
        if W == 1:
            tok, alive, look, fill = rows
            self.tok, self.alive, self.look = tok.view(R, 1), alive.view(R, 1), look.view(R, 1)
            self.fill = fill
            return
        (self.tok, self.par, self.score, self.alive, self.look, self.anc, self.clane,
         self.fill) = rows

    def write(self, position: torch.Tensor, tok, alive, look, fill, tree=None) -> None:
        """Position `position` (0-d) gets these rows (tok, alive, look [W]; fill 0-d) and, for a
        tree, tree = (par [W], score [W], clane 0-d, anc [W, n + 1])."""
        r = (position % self.R).view(1)
        fields = [(self.tok, tok), (self.alive, alive), (self.look, look), (self.fill, fill)]
        if tree is not None:
            fields += zip((self.par, self.score, self.clane, self.anc), tree)
        for table, value in fields:
            table.index_copy_(0, r, value.reshape((1,) + table.shape[1:]).to(table.dtype))


class Drafting:
    """The draft step of one sequence (spd.runtime.sequence), from the window its cycle's open
    laid out."""

    def __init__(self, seq):
        self.seq, self.n, self.W = seq, seq.n, seq.width

    def chain(self, plan, window, uniform):
        """The drafter's guess (spd.draft.drafters.Draft) for the newest position's child, from
        spd_kernels.cycle_open's plan [1, P] and window [1, m, n + 1, d] (None: post-step
        features, read now). The context lookup's proposal and its gate are the candidate's
        (spd_kernels.cycle_candidate)."""
        seq, p = self.seq, plan[0]
        pos, types = plan_window(p, self.n)
        window = seq.anchors.index_select(1, pos) if window is None else window[0]
        return seq.drafter.draft(window, types, p[P_W0:P_W0 + 1], p[P_CHILD], seq.sampling,
                                 uniform, p[P_LAST:P_LAST + 1])

    def tree(self, tplan, mask, window, out) -> None:
        """A token tree's top children of each leaf into its control slot's rows `out`
        (spd.draft.drafters.PDMDrafter.tree_top), from spd_kernels.tree_open's tplan [1, TP],
        mask [1, R W, R W] and window [1, m, R W, d] (None: post-step features, read now). The
        children are spd_kernels.tree_children's."""
        seq, p = self.seq, tplan[0]
        f = tplan_fields(p, self.n, self.W)
        window = seq.anchors.index_select(1, f["buf"]) if window is None else window[0]
        seq.drafter.tree_top(window, f["types"], f["pos"], f["pdm"], p[T_W0:T_W0 + 1],
                             mask[0], f["leaves"], seq.sampling, out)
