"""A batch of token trees' cycle: the control as three ops over every slot at once.

The token tree's twin of spd.runtime.chain_batch (read that first): each sequence's Cycle holds
views of its slot's rows of the batch's TreeControl (spd.runtime.control), and a batch's cycle
runs each control op once over all the slots:

  1. tree_open over every slot (the plans, masks and windows, and where a sequence samples,
     every slot's draws), then on the drafter's stream one PDM step over every decoding
     sequence's tree window (in the batch's slot caches) and each leaf's top children, into
     its slot's rows;
  2. every stage once over one unit a sequence (BatchStages.run);
  3. tree_children over every slot, the judge (greedy: the target's argmax of every slot's
     judged row in one verify_greedy; sampled: one LM head over the sampled rows and each
     one's recursive rejection), and tree_commit over every slot.
"""
from __future__ import annotations

import time

import torch

from spd.draft.lookup import trust_tables
from spd.runtime.chain_batch import FusedBatch
from spd_kernels import filtered_probs, tree_rejection_sample
from spd_kernels.control import TRASH
from spd_kernels.tree_control import (
    T_LIVE,
    T_W0,
    judge_fields,
    tplan_fields,
    tree_children,
    tree_commit,
    tree_open,
)


class TreeBatch(FusedBatch):
    """The fused cycle of a batch's token trees (module docstring)."""
    plain_steps = ("tree_top", "tree_logits")

    def __init__(self, batch, lookup: int):
        """lookup: the context lookup's shortest match (each slot's constants carry it; the
        children always take the trust tables)."""
        super().__init__(batch)
        self.trust, self.log_trust = trust_tables(self.device)
        self.W = self.control.W
        self._starts: dict[tuple, torch.Tensor] = {}

    def cycle(self, entries) -> None:
        """One cycle of `entries` (the Running sequences decoding): device work only, over the
        slots up to the last one decoding (spd.runtime.chain_batch.ChainBatch.cycle)."""
        b_ = self.batch
        cycles = {e.slot: e.cycle for e in entries}
        k, bucketed = self.shape(cycles)
        self.control.tops(b_.drafters[0].tree_top_k(self.W))  # (every slot's: one PDM)
        ctl = self.control.first(k)
        tokens, anchors, final = b_.tokens[:k], b_.anchors[:k], b_.final[:k]
        b_.stages.begin(cycles, k if bucketed else None)
        sampled = any(not c.seq.sampling.greedy for c in cycles.values())
        groups = self.bucket_groups(cycles, k, bucketed)
        tree_open(ctl.state, ctl.units, ctl.consts, ctl.lanes, tokens, anchors,
                  self.type_of_depth, ctl.tplan, ctl.mask, ctl.window, 0,
                  ctl.draws if sampled else None)
        self.roles.fork()
        with self.roles.on(0):
            self._draft(ctl, cycles, groups)
        b_.stages.run(cycles, False, bucket=k if bucketed else None)
        self.roles.join()
        tree_children(ctl.tplan, ctl.lanes, ctl.top, ctl.top_ids, ctl.pmax, self.trust,
                      self.log_trust, ctl.kids, ctl.kid_score, ctl.judge, final,
                      ctl.judged_hidden)
        verdict, accepted = self._judge_trees(ctl, cycles, groups)
        tree_commit(ctl.state, ctl.units, ctl.consts, ctl.tplan, ctl.kids, ctl.kid_score,
                    ctl.judge, ctl.lanes, tokens, anchors, self.embed_weight, ctl.stops, verdict,
                    accepted, self.margin)

    def _draft(self, ctl, cycles, groups: list | None) -> None:
        """Every decoding sequence's top children of each leaf into its slot's rows of the
        control (top, top_cols, top_ids, pmax: what PDMDrafter.tree_top writes of one): the PDM
        over every sequence's tree window at once (bucketed: every slot's, a bubble's rows
        written at its trash row), in the batch's slot caches
        (PipelineDraftModule.batch_tree_step: the weight reads shared), then each leaf's
        log-probabilities (greedy: the softmax's; each sampling group: its filtered
        distribution's, merged at the group's rows) and their top k. A drafter of its own
        drafts alone. The step's host time is shared among the sequences. groups: the
        bucket's (FusedBatch.bucket_groups), or None: not bucketed."""
        b_, k, bucketed = self.batch, ctl.tplan.shape[0], groups is not None
        run = tuple(range(k)) if bucketed else tuple(sorted(cycles))
        if not run:  # (across ranks a cycle may carry no sequence: bubbles only)
            return
        if not bucketed and not self.in_slot_caches(cycles, run, *self.plain_steps):
            for b, c in cycles.items():
                t0 = time.perf_counter()
                c.drafting.tree(ctl.tplan[b:b + 1], ctl.mask[b:b + 1], ctl.window[b:b + 1],
                                ctl.top_rows(b))
                c.draft_s += time.perf_counter() - t0
            return
        t0 = time.perf_counter()
        n, W, U = b_.n, self.W, len(run)
        R = (n + 1) * W  # (a window's rows)
        idx = b_.stages.slot_sets(run)[0]
        tplan, mask, window = ctl.tplan, ctl.mask, ctl.window
        f = tplan_fields(tplan, n, W)
        # a finished or parked slot's rows at its trash row (its prompt's rows untouched)
        writes = torch.where(tplan[:, T_LIVE:T_LIVE + 1] == 1, f["pdm"],
                             ctl.consts[:, TRASH:TRASH + 1])
        pos, types, leaves, w0 = f["pos"], f["types"], f["leaves"], tplan[:, T_W0]
        if U < k:  # (free slots among the first k: only the decoding ones' trees)
            mask, window, writes, pos, types, leaves, w0 = (
                x.index_select(0, idx) for x in (mask, window, writes, pos, types, leaves, w0))
        m, d = window.shape[1], window.shape[3]
        pdm = b_.drafters[run[0]].pdm
        features = pdm.features(window.transpose(0, 1).reshape(m, U * R, d), types.reshape(-1))
        leaves = (leaves + self._tree_starts(U, R)).reshape(-1)            # [U W]
        logits = pdm.batch_tree_step(features, *b_.draft_caches, list(run), writes,
                                     pos.reshape(-1), w0, mask, leaves)
        logp = None
        if not cycles or any(c.seq.sampling.greedy for c in cycles.values()):
            logp = torch.log_softmax(logits, dim=-1)                       # [U W, Vd]
        at = {b: r for r, b in enumerate(run)}
        for b, rows in groups if bucketed else self.groups(cycles, at, U, False):
            s = cycles[b].seq.sampling
            lp = filtered_probs(logits, s.temperature, s.top_k, s.top_p).float().log()
            if rows is None or logp is None:  # (the first: every row, the rest overwrite)
                logp = lp
                continue
            # (a tree's W leaf rows follow its row's mask: [U, 1, 1] over [U, W, Vd])
            logp = torch.where(rows.view(U, 1, 1), lp.view(U, W, -1),
                               logp.view(U, W, -1)).view(U * W, -1)
        kk = ctl.top.shape[2]
        if U == k:  # (every slot drafts: straight into the control's rows)
            out = (ctl.top.view(U * W, kk), ctl.top_cols.view(U * W, kk),
                   ctl.top_ids.view(U * W, kk), ctl.pmax.view(U * W))
            torch.topk(logp, kk, dim=-1, out=out[:2])
            torch.index_select(pdm.draft_to_target, 0, out[1].view(-1), out=out[2].view(-1))
            torch.exp(out[0][:, 0], out=out[3])
        else:
            top, cols = torch.topk(logp, kk, dim=-1)
            ids = pdm.draft_to_target.index_select(0, cols.view(-1))
            for table, got in zip((ctl.top, ctl.top_cols, ctl.top_ids, ctl.pmax),
                                  (top, cols, ids, top[:, 0].exp())):
                table.index_copy_(0, idx, got.view((U,) + table.shape[1:]))
        for c in cycles.values():
            c.draft_s += (time.perf_counter() - t0) / len(cycles)

    def _tree_starts(self, U: int, R: int) -> torch.Tensor:
        """[U, 1] int64: where each of U windows of R rows starts (made once a shape)."""
        key = (U, R)
        if key not in self._starts:
            self._starts[key] = (torch.arange(U, device=self.device) * R).view(U, 1)
        return self._starts[key]

    def _judge_trees(self, ctl, cycles, groups: list | None):
        """(verdict [k], accepted [k] or None) for tree_commit: greedy, every slot's judged
        row's argmax in one op (a sampled or free slot's is never read); sampled, the target's
        logits of every slot's row once, then the recursive rejection of every row by each
        sampling group (one temperature, top-k and top-p) in one op, merged at the group's
        slots (FusedBatch.merge_group; a free slot's rows: padding, never read)."""
        t = self.batch.target
        if groups is None:  # (not bucketed: made here; else the bucket's, `bucket_groups`)
            groups = self.groups(cycles, {b: b for b in cycles}, ctl.verdict.shape[0], False)
        verdict = ctl.verdict
        if any(c.seq.sampling.greedy for c in cycles.values()):
            verdict, _ = t.verify_greedy(ctl.judged_hidden, ctl.no_drafts)
            if not groups:
                return verdict, None
            ctl.verdict.copy_(verdict)
        cands, u = judge_fields(ctl.judge, self.W)["cands"], ctl.draws[:, 1:]
        logits = t.judge_logits(ctl.judged_hidden)  # (every slot's rows, once)
        for b, mask in groups:
            s = cycles[b].seq.sampling
            got = tree_rejection_sample(logits, cands, u, s.temperature, s.top_k, s.top_p)
            if mask is None:
                return got
            self.merge_group(ctl, mask, *got)
        return ctl.verdict, ctl.accepted


__all__ = ["TreeBatch"]
