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
            of its trust.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.draft.lookup import TRUST, propose_on_device
from spd_kernels import filtered_probs
from spd_kernels.control import P_CHILD, P_LAST, P_W0, plan_window


@dataclass
class Children:
    """The rows drafted for the next position: W lanes (a chain: one), all on the device."""
    tok: torch.Tensor      # [W] int64
    par: torch.Tensor      # [W] int64: the parent's lane at the newest position
    score: torch.Tensor    # [W] float32: cumulative draft log-probability (a chain: 0)
    alive: torch.Tensor    # [W] bool
    look: torch.Tensor     # [W] bool: the context lookup proposed it
    q: torch.Tensor | None = None      # a sampled chain: the draft distribution [Vq]
    q_ids: torch.Tensor | None = None  # its columns as target ids (None: every id)
    anc: torch.Tensor | None = None    # a tree: [W, n + 1] the lane of each row's ancestor k
    #                                    positions back (k = 0: its own; Lanes.anc)


class Lanes:
    """The rows of the positions in flight, by position mod (n + 1) and lane: tok, par, score,
    alive, look [n + 1, W]; anc [n + 1, W, n + 1] the lane of each row's ancestor k positions
    back (k = 0: its own; kept with the row, so a branch is one gather, never a walk); clane
    [n + 1] the committed lane (-1: not committed); fill [n + 1] the tokens in flight when the
    position was drafted (its draft position)."""

    def __init__(self, n: int, width: int, device, chain=None):
        R, W = n + 1, width
        self.n, self.R, self.W = n, R, W
        if chain is not None:  # a chain's (tok, alive, look, fill [R]): a batch's rows
            tok, alive, look, fill = chain
            self.tok, self.alive, self.look = tok.view(R, 1), alive.view(R, 1), look.view(R, 1)
            self.fill = fill
            return
        self.tok = torch.zeros(R, W, dtype=torch.int64, device=device)
        self.par = torch.zeros(R, W, dtype=torch.int64, device=device)
        self.score = torch.zeros(R, W, dtype=torch.float32, device=device)
        self.alive = torch.zeros(R, W, dtype=torch.bool, device=device)
        self.look = torch.zeros(R, W, dtype=torch.bool, device=device)
        self.anc = torch.zeros(R, W, R, dtype=torch.int64, device=device)
        self.clane = torch.full((R,), -1, dtype=torch.int64, device=device)
        self.fill = torch.zeros(R, dtype=torch.int64, device=device)

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
    """Drafts the children of the newest position for one sequence (spd.runtime.sequence) with
    the cycle's lane tables."""

    def __init__(self, seq, lanes: Lanes):
        self.seq, self.lanes = seq, lanes
        n, W, dev = seq.n, seq.width, seq.device
        self.n, self.W, self.tree = n, W, W > 1
        self.offsets = torch.arange(n + 1, device=dev)
        self.lane_ids = torch.arange(W, device=dev)
        self.stage_ids = torch.arange(n, device=dev)
        if seq.lookup_min:
            self.trust = torch.tensor(TRUST, device=dev)
            self.log_trust = self.trust.log()
        # the token trees' PDM rows past its cache's positions (rewritten every cycle)
        self.pdm_slots = seq.capacity + self.offsets.view(-1, 1) * W + self.lane_ids
        self.eye = torch.eye((n + 1) * W, dtype=torch.bool, device=dev)
        # [k, l, k']: how far back offset k' lies from offset k (0 past it: masked anyway)
        back = (self.offsets.view(-1, 1) - self.offsets.view(1, -1)).clamp(min=0)
        self.back = back.view(n + 1, 1, n + 1).expand(n + 1, W, n + 1).contiguous()
        # constants a cycle reads (made here once: a cycle makes no tensor of a Python value)
        self.zero = torch.zeros((), dtype=torch.int64, device=dev)
        self.no_score = torch.tensor(float("-inf"), device=dev)

    def window(self, newest, start, final, occ, extra: int):
        """(positions [n + 1], w0 [1], last [1]: the newest's offset, types [n + 1]) of this
        cycle's window; types one stage deeper when `extra` (post-step features)."""
        seq, n = self.seq, self.n
        w0 = torch.maximum(newest - n, final).view(1)
        pos = w0 + self.offsets
        # depth: n under the window's in-flight rows, else the stage whose unit holds it
        at = (occ.view(1, n) == pos.view(-1, 1)).to(torch.int64)
        depth = torch.where(pos < start, n, (at * self.stage_ids).sum(1))
        types = seq.type_of_depth[(depth + extra).clamp(max=n)]
        return pos, w0, newest - w0, types

    def draft(self, newest, start, final, occ, extra: int, committed) -> Children:
        """A token tree's children of the newest position."""
        pos, w0, last, types = self.window(newest, start, final, occ, extra)
        return self._tree(pos, w0, last, types, start, committed, newest)

    # --- a chain ---------------------------------------------------------------------------------
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

    # --- a token tree ----------------------------------------------------------------------------
    def _ancestors(self, pos, start):
        """(alive [n + 1, W], anc [n + 1, W, n + 1]: the lane of row (k, l)'s ancestor at offset
        k' <= k) of the window's rows; committed rows are lane 0."""
        L, n = self.lanes, self.n
        r = pos % (n + 1)
        committed = pos <= start
        alive = torch.where(committed.view(-1, 1), self.lane_ids == 0,
                            L.alive.index_select(0, r))
        anc = L.anc.index_select(0, r).gather(2, self.back)   # [k, l, k']: k - k' back
        return alive, torch.where(committed.view(1, 1, -1), 0, anc)

    def _tree(self, pos, w0, last, types, start, committed, newest) -> Children:
        seq, n, W = self.seq, self.n, self.W
        trash = seq.trash
        real = (pos <= newest).view(-1, 1)
        alive, anc = self._ancestors(pos, start)
        alive = alive & real
        before = (self.offsets.view(-1, 1) >= self.offsets.view(1, -1))   # k' <= k
        mask = (before.view(n + 1, 1, n + 1, 1)
                & (anc.unsqueeze(-1) == self.lane_ids)                   # [k, l, k', l']
                & alive.view(n + 1, W, 1, 1) & alive.view(1, 1, n + 1, W))
        R = (n + 1) * W
        # a dead row sees itself alone (never NaN; no live row sees it)
        mask = mask.reshape(R, R) | self.eye
        committed_row = (pos <= start).view(-1, 1)
        slot = seq.capacity + (pos % (n + 1)).view(-1, 1) * W + self.lane_ids
        buf = torch.where(alive, torch.where(committed_row, pos.view(-1, 1), slot), trash)
        pdm = torch.where(alive, torch.where(committed_row, pos.view(-1, 1), self.pdm_slots),
                          trash)
        leaves = last * W + self.lane_ids
        logits = seq.drafter.tree_logits(
            seq.anchors.index_select(1, buf.view(-1)), types.repeat_interleave(W),
            pos.repeat_interleave(W), pdm.view(-1), w0, mask, leaves)
        return self._children(logits, leaves, alive.view(-1), anc, last, pos, newest, start,
                              committed)

    def _children(self, logits, leaves, alive, anc, last, pos, newest, start, committed):
        seq, L, n, W, s = self.seq, self.lanes, self.n, self.W, self.seq.sampling
        leaf_alive = alive.index_select(0, leaves)
        r_new = (newest % (n + 1)).view(1)
        uncommitted = newest > start
        base = torch.where(uncommitted, L.score.index_select(0, r_new).view(W), 0.0)
        base = torch.where(leaf_alive, base, float("-inf"))
        if s.greedy:
            logp = torch.log_softmax(logits.float(), dim=-1)
        else:
            logp = filtered_probs(logits, s.temperature, s.top_k, s.top_p).log()
        top, cols = logp.topk(min(W, logp.shape[-1]), dim=-1)   # [W leaves, per]
        per = top.shape[1]
        ids = seq.drafter.pdm.draft_to_target.index_select(0, cols.reshape(-1)).view(W, per)
        # a dead leaf's logits are never read (they may be anything, NaN included)
        scores = torch.where(leaf_alive.view(W, 1), base.view(W, 1) + top, float("-inf")).view(-1)
        parents = self.lane_ids.view(W, 1).expand(W, per).reshape(-1)
        tokens = ids.reshape(-1)
        leaf_anc = anc.index_select(0, last).view(W, n + 1)   # [leaf, k']
        look_tok, look_score = self.zero, self.no_score
        best = base.argmax()
        if seq.lookup_min:
            # the best leaf's branch: committed tokens, then its uncommitted ancestors
            branch = leaf_anc.index_select(0, best.view(1)).view(n + 1)
            mine = L.tok.index_select(0, pos % (n + 1)).gather(1, branch.view(-1, 1)).view(-1)
            where_ = torch.where((pos > start) & (self.offsets <= last), pos, seq.trash)
            ctx = seq.tokens.clone().index_copy_(0, where_, mine)
            look_tok, length = propose_on_device(ctx, committed, newest, seq.lookup_min)
            trust = self.trust.index_select(0, length.view(1)).view(())
            pmax = logp.index_select(0, best.view(1)).amax().exp()
            use = (length > 0) & ((trust >= 1.0) | (pmax < trust))
            look_score = torch.where(use, base.index_select(0, best.view(1)).view(())
                                     + self.log_trust.index_select(0, length.view(1)).view(()),
                                     float("-inf"))
            # the lookup's token replaces the same child of the same leaf (at its trust)
            dup = use & (parents == best) & (tokens == look_tok)
            scores = torch.where(dup, float("-inf"), scores)
        all_scores = torch.cat([look_score.view(1), scores])
        all_tok = torch.cat([look_tok.view(1), tokens])
        all_par = torch.cat([best.view(1), parents])
        order = torch.sort(all_scores, descending=True, stable=True).indices[:W]
        score, par = all_scores.index_select(0, order), all_par.index_select(0, order)
        # each child's ancestors: itself, then its leaf's (kept with the leaf's row)
        leaf_rows = L.anc.index_select(0, r_new).view(W, n + 1)
        anc = torch.cat([self.lane_ids.view(W, 1), leaf_rows.index_select(0, par)[:, :n]], 1)
        return Children(all_tok.index_select(0, order), par, score, score > float("-inf"),
                        order == 0, anc=anc)
