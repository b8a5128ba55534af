"""A batch of token trees' cycle: the control as three ops over every slot at once.

The token tree's twin of spd.runtime.chain_batch (read that first): each sequence's Cycle holds
views of its slot's rows of the batch's TreeControl (spd.runtime.control), and a batch's cycle
runs each control op once over all the slots:

  1. tree_open over every slot (the plans, masks and windows, and where a sequence samples,
     every slot's draws), then each sequence's draft step (PDMDrafter.tree_top) on the
     drafter's stream, into its slot's rows of the top children;
  2. every stage once over one unit a sequence (BatchStages.run);
  3. tree_children over every slot, the judge (greedy: the target's argmax of every slot's
     judged row in one verify_greedy; sampled: one LM head over the sampled rows and each
     one's recursive rejection), and tree_commit over every slot.
"""
from __future__ import annotations

import time

from spd.draft.lookup import trust_tables
from spd.runtime.chain_batch import FusedBatch
from spd_kernels import tree_rejection_sample
from spd_kernels.tree_control import judge_fields, tree_children, tree_commit, tree_open


class TreeBatch(FusedBatch):
    """The fused cycle of a batch's token trees (module docstring)."""

    def __init__(self, batch, lookup: int):
        """lookup: the context lookup's shortest match (each slot's constants carry it; the
        children always take the trust tables)."""
        super().__init__(batch)
        self.trust, self.log_trust = trust_tables(self.device)
        self.W = self.control.W

    def cycle(self, entries) -> None:
        """One cycle of `entries` (the Running sequences decoding): device work only, over the
        slots up to the last one decoding (spd.runtime.chain_batch.ChainBatch.cycle)."""
        b_ = self.batch
        cycles = {e.slot: e.cycle for e in entries}
        k = max(cycles, default=0) + 1
        self.control.tops(b_.drafters[0].tree_top_k(self.W))  # (every slot's: one PDM)
        ctl = self.control.first(k)
        tokens, anchors, final = b_.tokens[:k], b_.anchors[:k], b_.final[:k]
        b_.stages.begin(cycles)
        sampled = any(not c.seq.sampling.greedy for c in cycles.values())
        tree_open(ctl.state, ctl.units, ctl.consts, ctl.lanes, tokens, anchors,
                  self.type_of_depth, ctl.tplan, ctl.mask, ctl.window, 0,
                  ctl.draws if sampled else None)
        self.roles.fork()
        with self.roles.on(0):
            for b, c in cycles.items():
                t0 = time.perf_counter()
                c.drafting.tree(ctl.tplan[b:b + 1], ctl.mask[b:b + 1], ctl.window[b:b + 1],
                                ctl.top_rows(b))
                c.draft_s += time.perf_counter() - t0
        b_.stages.run(cycles, False)
        self.roles.join()
        tree_children(ctl.tplan, ctl.lanes, ctl.top, ctl.top_ids, ctl.pmax, self.trust,
                      self.log_trust, ctl.kids, ctl.kid_score, ctl.judge, final,
                      ctl.judged_hidden)
        verdict, accepted = self._judge_trees(ctl, cycles)
        tree_commit(ctl.state, ctl.units, ctl.consts, ctl.tplan, ctl.kids, ctl.kid_score,
                    ctl.judge, ctl.lanes, tokens, anchors, self.embed_weight, ctl.stops, verdict,
                    accepted, self.margin)

    def _judge_trees(self, ctl, cycles):
        """(verdict [k], accepted [k] or None) for tree_commit: greedy, every slot's judged
        row's argmax in one op (a sampled or free slot's is never read); sampled, the target's
        logits of every slot's row once, then the recursive rejection of every row by each
        sampling group (one temperature, top-k and top-p) in one op, merged at the group's
        slots (FusedBatch.merge_group; a free slot's rows: padding, never read)."""
        t = self.batch.target
        sampled = [b for b, c in cycles.items() if not c.seq.sampling.greedy]
        verdict = ctl.verdict
        if not sampled or len(sampled) < len(cycles):
            verdict, _ = t.verify_greedy(ctl.judged_hidden, ctl.no_drafts)
            if not sampled:
                return verdict, None
            ctl.verdict.copy_(verdict)
        groups = self.sampling_groups(cycles, sampled)
        cands, u = judge_fields(ctl.judge, self.W)["cands"], ctl.draws[:, 1:]
        logits = t.judge_logits(ctl.judged_hidden)  # (every slot's rows, once)
        if len(groups) == 1 and len(sampled) == len(cycles):
            (temperature, top_k, top_p), = groups
            return tree_rejection_sample(logits, cands, u, temperature, top_k, top_p)
        for (temperature, top_k, top_p), group in groups.items():
            self.merge_group(ctl, group, *tree_rejection_sample(logits, cands, u, temperature,
                                                                top_k, top_p))
        return ctl.verdict, ctl.accepted


__all__ = ["TreeBatch"]
