"""A batch of token chains' cycle: the control as three ops over every slot at once.

Each sequence's Cycle (spd.runtime.cycle) holds views of its slot's rows of the batch's
ChainControl (spd.runtime.control), and one sequence's cycle runs its three control ops over a
batch of one. Here a batch's cycle runs each of them once over all the slots:

  1. cycle_open over every slot (the plans, the windows, and where a sequence samples, every
     slot's draws: spd_kernels.philox), then on the drafter's stream one PDM step over every
     decoding sequence's window (in the batch's slot caches) and the picks over its rows;
  2. every stage once over one unit a sequence (BatchStages.run), a greedy verdict landing at
     its slot;
  3. cycle_candidate over every slot, each sampled group (sequences of one temperature, top-k,
     top-p) judged by one rejection sampling over its rows, and cycle_commit over every slot.

A free slot is a finished sequence: the ops run over it and change nothing another reads. The
host reads every slot's state from one copy a step, each sequence its row (`publish`).

Buckets. Where every member drafts in the batch's slot caches, a cycle runs over every slot
up to a bucket (1, 2, 4, 8, ... up to the slots: `bucket_of`), free and prefilling slots as
bubbles: their units parked dead at their trash row (Control.park), their drafter's window
written at that row too, their rows judged and never read (a hybrid target's dead rows write
no DeltaNet ring entry: batch_hybrid_stage_step). Which rows a sampling group judges is device
state (`group`: each slot's group), so the cycle is the same work whichever sequences are in
it: one graph a key (`key`: the bucket, whether a greedy sequence is in it and which sampling
groups), replayed across joins and leaves; a group's mask is made once a cycle, for the draft
step and the judge. Else (a drafter of its own) the ops run over the members' slots and a
graph serves one set of members. In one process and across ranks alike.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from spd.draft.drafters import Draft, PDMDrafter, top_probability
from spd.draft.lookup import trust_tables
from spd.runtime.cycle import Roles, end_margin
from spd.runtime.driver import Published
from spd_kernels import filtered_probs, sample_from_probs
from spd_kernels.control import (
    C_TOK,
    P_LAST,
    P_LIVE,
    TRASH,
    cycle_candidate,
    cycle_commit,
    cycle_open,
    plan_window,
)


class SlotReader:
    """A sequence's row of the batch's published states (its Cycle's `published`): its cycle
    c is the batch's step `first` + c."""

    def __init__(self, batch: FusedBatch, slot: int, first: int):
        self.batch, self.slot, self.first = batch, slot, first

    def read(self, c: int) -> list[int]:
        S = self.batch.control.state.shape[1]
        got = self.batch.published.read(self.first + c)
        return got[self.slot * S:(self.slot + 1) * S]


def bucket_of(k: int, slots: int) -> int:
    """The bucket of a cycle over the first k slots: the next power of two, at most `slots`."""
    return min(1 << max(k - 1, 0).bit_length(), slots)


def settings(sampling) -> tuple:
    """What a sampling group shares: (temperature, top-k, top-p)."""
    return sampling.temperature, sampling.top_k, sampling.top_p


class FusedBatch:
    """What a batch's fused cycle keeps, chain or tree (ChainBatch, and TreeBatch in
    spd.runtime.tree_batch): the batch and its control, the feature type of each depth, the
    embedding the commit reads, the drafter's role, the end margin and the published states."""

    def __init__(self, batch):
        self.batch, self.control = batch, batch.control
        t, dev = batch.target, torch.device(batch.target.device)
        layout, n = batch.engine.layout, batch.n
        self.device = dev
        self.type_of_depth = torch.tensor([layout.agg_type(k) for k in range(n + 1)],
                                          device=dev)
        self.embed_weight = t.embed.weight
        self.roles = Roles(dev, 1)
        self.margin = end_margin(n, batch.ahead)
        self.published = Published(batch.ahead + 1, self.control.state.numel(), dev)
        self.steps = 0
        self._masks: dict[tuple, torch.Tensor] = {}  # (indices, size) -> [size] bool
        # each slot's sampling group (-1: greedy, or free), as a bucket's cycle reads it
        self.group_ids: dict[tuple, int] = {}  # settings -> group
        self.group = torch.full((self.control.slots,), -1, dtype=torch.int64, device=dev)

    # --- what a cycle runs over -------------------------------------------------------------
    plain_steps: tuple[str, ...] = ()  # the drafter's methods a batched draft step stands for

    def join(self, slot: int, sampling) -> None:
        """Slot `slot`'s sampling group on the device (set-up, before its first cycle)."""
        gid = -1
        if not sampling.greedy:
            gid = self.group_ids.setdefault(settings(sampling), len(self.group_ids))
        self.group[slot].fill_(gid)

    def shape(self, cycles) -> tuple[int, bool]:
        """(k, bucketed): the cycle's ops run over the first k slots; bucketed, k is a bucket
        and every slot in it runs, free ones as bubbles (module docstring); else the stage
        and draft steps run over the members' slots only."""
        last = max(cycles, default=0) + 1
        if self.in_slot_caches(cycles, tuple(cycles), *self.plain_steps):
            return bucket_of(last, self.control.slots), True
        return last, False

    def key(self, members) -> tuple:
        """The key of the graph that runs a cycle of `members` (spd.runtime.cycle_graph
        .BatchGraphs): a bucket's (its size, whether a greedy sequence is in it, the sampling
        groups in it, the stop table's generation), else the members'."""
        cycles = {e.slot: e.cycle for e in members}
        k, bucketed = self.shape(cycles)
        if not bucketed:
            return ("members", *map(id, members))
        kinds = [c.seq.sampling for c in cycles.values()]
        gids = sorted({self.group_ids[settings(s)] for s in kinds if not s.greedy})
        return ("bucket", k, any(s.greedy for s in kinds), tuple(gids), self.control.tables)

    def groups(self, cycles, rows: dict[int, int], size: int, bucketed: bool) -> list[tuple]:
        """The sampling groups among `cycles` (by slot), each (a slot of it, its mask [size]
        bool over the rows, None where it is every row that matters: no greedy and no other
        group), in the order of their ids. rows: each slot's row among the `size`. Bucketed
        (rows: the slots themselves), a mask is read off each slot's group on the device, so
        the same ops serve any members; else made once a set of rows (`mask`)."""
        by: dict[tuple, list[int]] = defaultdict(list)
        for b, c in cycles.items():
            if not c.seq.sampling.greedy:
                by[settings(c.seq.sampling)].append(b)
        alone = len(by) == 1 and sum(map(len, by.values())) == len(cycles)
        out = []
        for key in sorted(by, key=self.group_ids.__getitem__):
            slots = by[key]
            if alone:
                mask = None
            elif bucketed:
                mask = self.group[:size] == self.group_ids[key]
            else:
                mask = self.mask(tuple(sorted(rows[b] for b in slots)), size)
            out.append((slots[0], mask))
        return out

    def bucket_groups(self, cycles, k: int, bucketed: bool) -> list[tuple] | None:
        """A bucketed cycle's sampling groups over its k slots (`groups`), made once for its
        draft step and its judge (their rows are the slots both); None when not bucketed (each
        makes its own over its rows)."""
        return self.groups(cycles, {b: b for b in cycles}, k, True) if bucketed else None

    def publish(self, members) -> None:
        """Every slot's state after this step, in one copy; a member that launches its first
        cycle now reads its row from this step on."""
        for e in members:
            if e.launched == 0:
                e.cycle.published = SlotReader(self, e.slot, self.steps)
        self.published.publish(self.steps, self.control.state.view(-1))
        self.steps += 1

    def mask(self, indices: tuple[int, ...], size: int) -> torch.Tensor:
        """[size] bool, true at `indices`: made once a set and size (from the device tensor of
        the indices, SlotSets': no Python value is copied)."""
        mask = self._masks.get((indices, size))
        if mask is None:
            if len(self._masks) >= 256:  # (as SlotSets: a few patterns a batch)
                self._masks.clear()
            at = self.batch.stages.slot_sets(indices)[0]
            mask = torch.zeros(size, dtype=torch.bool, device=self.device).index_fill_(0, at, True)
            self._masks[(indices, size)] = mask
        return mask

    @staticmethod
    def merge_group(ctl, mask: torch.Tensor, verdict, accepted) -> None:
        """A sampling group's judgement of every slot (verdict and accepted [k]) into ctl's
        at the group's slots (mask [k] bool): one select each."""
        torch.where(mask, verdict.view(-1), ctl.verdict, out=ctl.verdict)
        torch.where(mask, accepted.view(-1).to(ctl.accepted.dtype), ctl.accepted,
                    out=ctl.accepted)

    def in_slot_caches(self, cycles, run: tuple[int, ...], *steps: str) -> bool:
        """Whether every drafter of `run` is a plain PDM drafter (its methods `steps` are
        PDMDrafter's) drafting in the batch's slot cache of its slot, so one draft step over
        the batch computes what each would alone (one of its own, or one with its own draft
        step, drafts alone)."""
        k = self.batch.draft_caches[0]
        size = k.stride(0) * k.element_size()  # (slot b's view starts b * size in: no op)
        for b in run:
            d = cycles[b].seq.drafter
            if (any(getattr(type(d), s, None) is not getattr(PDMDrafter, s) for s in steps)
                    or d.cache is None or d.cache.k.data_ptr() != k.data_ptr() + b * size):
                return False
        return True



@dataclass
class SlotDrafts:
    """A chain batch's drafts this cycle, a row a slot up to the last decoding one: token [k]
    int64 target ids; p [k] float32 the PDM's confidence for the lookup's gate (None: no
    lookup); q [k, Vq] float32 the draft distributions of sampled rows (None: none samples)
    over the columns q_ids [Vq] int64 names."""
    token: torch.Tensor
    p: torch.Tensor | None
    q: torch.Tensor | None
    q_ids: torch.Tensor | None


class ChainBatch(FusedBatch):
    """The fused cycle of a BatchedSPD's chains (module docstring)."""
    plain_steps = ("draft", "draft_logits", "pick")

    def __init__(self, batch, lookup: int):
        super().__init__(batch)
        dev = self.device
        self.lookup = lookup
        self.trust = trust_tables(dev)[0] if lookup else None
        # stand-ins at the rows of slots with no draft this cycle (made once)
        self.no_token = torch.zeros((), dtype=torch.int64, device=dev)
        self.no_gate = torch.tensor(float("-inf"), device=dev)
        self._no_q: torch.Tensor | None = None
        self._window_rows: dict[tuple, tuple] = {}  # (slots, R) -> (rows' slots, window starts)

    def cycle(self, entries) -> None:
        """One cycle of `entries` (the Running sequences decoding): device work only. The ops
        run over the first k slots (`shape`: a bucket, or up to the last one decoding: slots
        are taken lowest first, so a batch with few sequences pays for few rows); what a graph
        records is the same work every cycle of its key."""
        b_ = self.batch
        cycles = {e.slot: e.cycle for e in entries}
        k, bucketed = self.shape(cycles)
        ctl = self.control.first(k)
        tokens, anchors, final = b_.tokens[:k], b_.anchors[:k], b_.final[:k]
        # (across ranks: the units out, the snaps' receives posted)
        b_.stages.begin(cycles, k if bucketed else None)
        sampled = [b for b, c in cycles.items() if not c.seq.sampling.greedy]
        groups = self.bucket_groups(cycles, k, bucketed)
        cycle_open(ctl.state, ctl.units, ctl.consts, tokens, anchors, self.type_of_depth,
                   ctl.plan, ctl.window, 0, ctl.draws if sampled else None)
        self.roles.fork()
        with self.roles.on(0):
            d = self._draft(ctl, cycles, bool(sampled), groups)
        greedy = any(c.seq.sampling.greedy for c in cycles.values())
        b_.stages.run(cycles, greedy, into=self.control.verdict, bucket=k if bucketed else None)
        self.roles.join(d.token, d.q, d.p)
        ring_ids = None
        if sampled:
            row = d.q[0]  # (a row's size: every row's)
            for b in sampled:  # (host only: the ring's size and each one's q columns)
                _, ring_ids = cycles[b].keep_q(Draft(None, row, None, d.q_ids))
            ctl = self.control.first(k)  # (the first sampled draft made the q ring)
        draft, p, q = d.token, d.p, d.q if sampled else None
        cycle_candidate(ctl.plan, ctl.lanes, draft, ctl.cand, p, self.trust, q, ring_ids,
                        *((ctl.q_ring, ctl.q_judged) if sampled else (None, None)),
                        *((final, ctl.judged_hidden) if sampled else (None, None)))
        verdict, accepted = ctl.verdict, None
        if sampled:
            verdict, accepted = self._judge(ctl, cycles, groups)
        cycle_commit(ctl.state, ctl.units, ctl.consts, ctl.plan, ctl.cand, ctl.lanes, tokens,
                     anchors[:, 0], self.embed_weight, ctl.stops, verdict.view(-1),
                     accepted.view(-1) if accepted is not None else None, self.margin)

    def _draft(self, ctl, cycles, sampled: bool, groups: list | None) -> SlotDrafts:
        """Every slot's draft up to the k-th (`SlotDrafts`; a slot that drafts nothing has
        stand-ins): the PDM over the decoding sequences' windows (bucketed: every slot's, a
        bubble's at its trash row) at once, in the batch's slot caches
        (PipelineDraftModule.batch_step: the weight reads shared, as the stages share theirs),
        then the picks over the rows: greedy the argmax, each sampling group (one temperature,
        top-k and top-p) a draw from its filtered distribution with each row's uniform, merged
        at the group's rows (the q of a sampled row is kept for the judge). The step's host
        time is shared among the sequences. groups: the bucket's (`bucket_groups`), or None:
        not bucketed."""
        b_, bucketed = self.batch, groups is not None
        k = ctl.plan.shape[0]
        run = tuple(range(k)) if bucketed else tuple(sorted(cycles))
        if not run:  # (across ranks a cycle may carry no sequence: bubbles only)
            return SlotDrafts(self._stand_ins(k, None)[0], None, None, None)
        if not bucketed and not self.in_slot_caches(cycles, run, *self.plain_steps):
            return self._draft_each(ctl, cycles, k, sampled)
        t0 = time.perf_counter()
        n, R, U = b_.n, b_.n + 1, len(run)
        idx = b_.stages.slot_sets(run)[0]  # (made once a set)
        plan, window, u = ctl.plan, ctl.window, ctl.draws[:, 0]
        pos, types = plan_window(plan, n)                           # [k, R] each
        # a finished or parked slot's window at its trash row (its prompt's rows untouched)
        pos = torch.where(plan[:, P_LIVE:P_LIVE + 1] == 1, pos, ctl.consts[:, TRASH:TRASH + 1])
        if U < k:  # (free slots among the first k: only the decoding ones' windows)
            plan, window, u, pos, types = (x.index_select(0, idx)
                                           for x in (plan, window, u, pos, types))
        m, d = window.shape[1], window.shape[3]
        pdm = b_.drafters[run[0]].pdm
        features = pdm.features(window.transpose(0, 1).reshape(m, U * R, d), types.reshape(-1))
        rows = self._window_rows.get((run, R))
        if rows is None:  # (each row's slot, and where each window starts: made once a set)
            if len(self._window_rows) >= 256:  # (as SlotSets: a few patterns a batch)
                self._window_rows.clear()
            rows = self._window_rows[(run, R)] = (idx.repeat_interleave(R),
                                                  torch.arange(U, device=self.device) * R)
        logits = pdm.batch_step(features, *b_.draft_caches, rows[0], pos.reshape(-1),
                                plan[:, P_LAST] + rows[1])                    # [U, Vd]
        cols = q = None
        if not cycles or any(c.seq.sampling.greedy for c in cycles.values()):
            cols = logits.argmax(-1)  # (bubbles only: argmax stand-ins)
        at = {b: r for r, b in enumerate(run)}
        for b, mask in groups if bucketed else self.groups(cycles, at, U, False):
            s = cycles[b].seq.sampling
            probs = filtered_probs(logits, s.temperature, s.top_k, s.top_p).float()  # [U, Vd]
            pick = sample_from_probs(probs, u)
            if mask is None:
                cols, q = pick, probs
                continue
            cols = pick if cols is None else torch.where(mask, pick, cols)
            q = torch.where(mask.view(-1, 1), probs,
                            self._stand_in_q(probs[0]) if q is None else q)
        d2t = pdm.draft_to_target
        token = d2t.index_select(0, cols)
        p = top_probability(logits) if self.lookup else None
        if U < k:  # (each decoding slot's row at its slot; the others' stand-ins)
            no_token, no_p = self._stand_ins(k, p)
            token = no_token.index_copy_(0, idx, token)
            p = None if p is None else no_p.index_copy_(0, idx, p)
            if q is not None:
                q = self._stand_in_q(q[0]).expand(k, -1).index_copy(0, idx, q)
        for c in cycles.values():
            c.draft_s += (time.perf_counter() - t0) / len(cycles)
        return SlotDrafts(token, p, q, d2t if sampled else None)

    def _stand_ins(self, k: int, p) -> tuple:
        """(draft tokens [k] of stand-ins, gate confidences [k] of -inf where `p` is given):
        the rows of slots that draft nothing (the gate passes -inf)."""
        return (self.no_token.expand(k).clone(),
                None if p is None else self.no_gate.expand(k).clone())

    def _draft_each(self, ctl, cycles, k: int, sampled: bool) -> SlotDrafts:
        """Each sequence's draft step on its own (its drafter's `draft`), stacked at the
        slots."""
        drafts = {}
        for b, c in cycles.items():
            t0 = time.perf_counter()
            drafts[b] = c.drafting.chain(ctl.plan[b:b + 1], ctl.window[b:b + 1], ctl.draws[b, 0])
            c.draft_s += time.perf_counter() - t0
        token = torch.stack([drafts[b].token.view(()) if b in drafts else self.no_token
                             for b in range(k)])
        p = None  # (a drafter without the gate's confidence: -inf, which the gate passes)
        if self.lookup and any(d.p is not None for d in drafts.values()):
            p = torch.stack([drafts[b].p.view(()).float() if b in drafts and drafts[b].p
                             is not None else self.no_gate for b in range(k)])
        q = q_ids = None
        if sampled:
            made = [d for d in drafts.values() if d.q is not None]
            q_ids = made[0].q_ids
            q = torch.stack([drafts[b].q if b in drafts and drafts[b].q is not None
                             else self._stand_in_q(made[0].q) for b in range(k)])
        return SlotDrafts(token, p, q, q_ids)

    def _stand_in_q(self, like: torch.Tensor) -> torch.Tensor:
        if self._no_q is None or self._no_q.shape != like.shape:  # (a distribution: see
            self._no_q = torch.ones_like(like).div_(like.numel())  # ChainControl.ring)
        return self._no_q

    def _judge(self, ctl, cycles, groups: list | None):
        """Rejection sampling of the sampled sequences -> (verdict, accepted) [k] for
        cycle_commit (ctl: the control's first k slots), over every slot's rows (a free or
        greedy slot's are judged and never read): the target's logits once, then one sampling
        a group (one temperature, top-k and top-p), merged at its slots
        (FusedBatch.merge_group; groups: the bucket's, or None: made here)."""
        if groups is None:
            groups = self.groups(cycles, {b: b for b in cycles}, ctl.verdict.shape[0], False)
        logits = self.batch.target.judge_logits(ctl.judged_hidden)
        args = (ctl.q_judged, ctl.cand[:, C_TOK], ctl.draws[:, 1:3])
        for b, mask in groups:
            got = cycles[b].reject(logits, *args)
            if mask is None:
                return got
            self.merge_group(ctl, mask, *got)
        return ctl.verdict, ctl.accepted
