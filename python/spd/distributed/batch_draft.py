"""Rank 0's side of an SPD batch session: several sequences through the distributed pipeline at
once (the session, its messages and pauses: spd.distributed.batch_stage; the protocol rank 0
shares with the pipeline baseline: spd.distributed.session). `DistributedBatch` has
BatchedSPD's join / step / leave (a join waits for the next pause, at most n + ahead + 1
cycles). With the draft on stage S, stage S runs here, inside rank 0's cycle (`LocalStage`)."""
from __future__ import annotations

import time

import torch

from spd.distributed.batch_stage import LiveStep
from spd.distributed.config import role_name
from spd.distributed.messages import SNAP_TAG, UNIT_TAG
from spd.distributed.session import SessionDriver
from spd.draft.drafters import slot_drafters
from spd.runtime.batch_spd import BatchedSPD, SlotSets, SlotStages
from spd.runtime.chain_batch import ChainBatch
from spd.runtime.control import ChainControl, TreeControl
from spd.runtime.cycle import Cycle
from spd.runtime.cycle_graph import BatchGraphs
from spd.runtime.driver import STOP
from spd.runtime.sequence import Sequence, SlotRows, slot_buffers
from spd.runtime.slot_stage import SlotStage
from spd.runtime.stopping import StopRule
from spd.runtime.tree_batch import TreeBatch
from spd.runtime.types import DecodeStats, SamplingParams


class BatchEntry:
    """A sequence of the batch: waiting for a slot (`slot` None), then decoding in one."""

    def __init__(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams,
                 rule: StopRule, on_token, stats: DecodeStats):
        self.ids, self.max_new, self.sampling = ids, max_new, sampling
        self.rule, self.on_token, self.stats = rule, on_token, stats
        self.slot: int | None = None
        self.seq: Sequence | None = None
        self.cycle: Cycle | None = None
        self.launched = self.nread = 0
        self.prefill_s = 0.0  # its prefill's seconds on rank 0, over its chunks
        self.joined_at: int | None = None  # the session's cycle it joined before
        self.done = False

    @property
    def out(self) -> list[int]:
        return [] if self.seq is None else self.seq.out


class LocalStage:
    """Stage S of a batch session in rank 0's process (--draft-on-stage S): its slot caches
    (SlotStage), its units from rank 0's own message (S = 0) or from stage S - 1 (`inbox`,
    received within each cycle for the next, every slot a bubble before the first), its
    output rows on to stage S + 1 (`outbox`), as a stage rank's (BatchStageCycles); its rows
    kept where each sequence keeps them (no snap), a greedy chain's verdicts at the last
    stage."""

    def __init__(self, batch: DistributedBatch, S: int):
        t, layout = batch.target, batch.engine.layout
        self.batch, self.S, self.n = batch, S, batch.n
        dev, d = t.device, t.hidden_size
        self.part = SlotStage(t, layout, S, batch.slots, batch.context)
        self.step = LiveStep(self.part, batch.fmt, batch.slots, batch.peeks, dev)
        size = batch.bfmt.message_bytes(d, t.dtype)
        self.inbox = self.outbox = None
        if S > 0:
            self.inbox = torch.zeros(size, dtype=torch.uint8, device=dev)
            batch.bfmt.split(self.inbox, d, t.dtype)[1].copy_(batch.dead)
        if S < self.n - 1:
            self.outbox = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.anchor_layers = [b - layout.stages[S].start - 1 for _, b in
                              layout.anchors_of_stage(S)]
        self.forward_s: list[float] = []
        self.prefill_s = 0.0

    def view(self, slot: int):
        """Slot `slot`'s rows as a one-sequence Stage (a joining prompt's prefill)."""
        return self.part.view(slot)

    def run(self, cycles: dict[int, Cycle], judge: bool, into: torch.Tensor | None,
            bucket: int | None = None) -> None:
        """This cycle's step over every slot's unit, its rows kept (the members', or
        bucketed every slot's below `bucket`), the units sent on and the next ones received
        (all waited for within the cycle)."""
        b, S = self.batch, self.S
        t, d = b.target, b.target.hidden_size
        if S == 0:
            ctrl, heads, x = b.ctrl, b.heads, None
        else:
            ctrl, heads, x = b.bfmt.split(self.inbox, d, t.dtype)
        t0 = time.perf_counter()
        got = self.step(heads, x)
        if self.outbox is not None:
            out_ctrl, out_heads, out_rows = b.bfmt.split(self.outbox, d, t.dtype)
            out_ctrl.copy_(ctrl)
            out_heads.copy_(heads)
        if got is not None:
            run, idx, outs = got
            W, out = b.width, outs[-1]
            if self.outbox is not None:
                out_rows.index_copy_(0, idx, out.view(len(run), W, -1))
            kept = [r for r, slot in enumerate(run) if (slot < bucket if bucket else
                                                         slot in cycles)]
            if kept:
                rows = (slice(None) if len(kept) == len(run) else
                        b.stages.slot_sets(tuple(kept))[0])
                idx_kept = idx if len(kept) == len(run) else idx.index_select(0, rows)
                anchors = [outs[i].view(len(run), W, -1)[rows] for i in self.anchor_layers]
                b.kept.keep(S, idx_kept, anchors, out.view(len(run), W, -1)[rows])
            if judge and into is not None and S == self.n - 1:
                none = b.stages.slot_sets(run)[1]
                into.index_copy_(0, idx, t.verify_greedy(out, none)[0])
        self.forward_s.append(time.perf_counter() - t0)
        sends = [] if self.outbox is None else [(self.outbox, S + 2, UNIT_TAG)]
        recvs = [] if self.inbox is None else [(self.inbox, S, UNIT_TAG)]
        for work in b.rt.exchange(sends, recvs):
            b.rt.order(work, S, "batch cycle unit")

    def stats(self, cycles: int, graph: dict) -> dict:
        """Its figures, as a stage rank reports them at the session's end."""
        return {"rank": self.S + 1, "role": role_name(self.S + 1), "cycles": cycles,
                "prefill_s": self.prefill_s, "forward_s": sum(self.forward_s), "graph": graph}


class SessionStages:
    """The stage ranks as a batch's stages (BatchStages' interface): `begin` sends every slot's
    stage-0 unit (a free slot's: a bubble) in one message and posts the receives of every
    stage's snap; `run` runs the stage of this process (with the draft on a stage), waits for
    the snaps and keeps each sequence's rows where they live, a greedy chain's verdicts at
    their slots."""

    def __init__(self, batch: DistributedBatch):
        self.batch = batch
        self.slot_sets = SlotSets(batch.target.device)
        self.works: list = []

    def begin(self, cycles: dict[int, Cycle], bucket: int | None = None) -> None:
        b = self.batch
        if bucket:  # (every slot below it: a free or prefilling one's parked unit a bubble)
            b.heads[:bucket].copy_(b.control.units[:bucket, 0])
        for slot, c in ({} if bucket else cycles).items():
            b.heads[slot].copy_(c.units[0])
        local0 = b.local is not None and b.local.S == 0
        self.works = b.rt.exchange([] if local0 else [(b.msg, 1, UNIT_TAG)],
                                   [(buf, s + 1, SNAP_TAG) for s, buf in b.snaps.items()])

    def run(self, cycles: dict[int, Cycle], judge: bool, into: torch.Tensor | None = None,
            bucket: int | None = None) -> None:
        """The stages' rows of this cycle kept (the members', or bucketed every slot's below
        `bucket`); a greedy chain's verdicts (the last stage's argmax) at their slots of
        `into` [slots]."""
        b, rt = self.batch, self.batch.rt
        judge = judge and b.judge
        if b.local is not None:
            b.local.run(cycles, judge, into, bucket)
        for s, work in zip(b.snaps, self.works):
            rt.order(work, s + 1, "batch cycle snap")
        slots = tuple(range(bucket)) if bucket else tuple(sorted(cycles))
        if slots:
            idx = self.slot_sets(slots)[0]
            for s, (_, rows) in b.views.items():
                f = b.formats[s]
                got = rows[:bucket] if bucket else rows.index_select(0, idx)  # [R, F, W, d]
                b.kept.keep(s, idx, [got[:, i] for i in range(len(f.hidden))],
                            got[:, -1] if f.with_output else None)
        last = b.views.get(b.n - 1)
        if judge and into is not None and last is not None:
            into.copy_(last[0].view(-1))
        rt.flush_sends(host=False)


class DistributedBatch(SessionDriver):
    """Rank 0's side of an SPD batch session on the stage ranks of `deng` (a
    DistributedSPDEngine): up to `slots` sequences of at most `context` rows each (the protocol:
    spd.distributed.session). `step` runs one cycle of every slot (or, while paused, the joins)
    and reads each sequence's state `ahead` cycles behind.
    greedy / sampled: whether greedy and sampled sequences may join (what the last stage sends:
    a greedy chain's argmax, the output rows). prefill_chunk: a joining prompt goes through the
    ranks that many rows a pause, the others decoding between pauses (None: all at once).
    A hybrid target's chains batch too (SlotStage keeps each slot's state rings)."""

    def __init__(self, deng, slots: int, context: int, *, greedy: bool = True,
                 sampled: bool = True, prefill_chunk: int | None = None):
        eng = deng.engine
        width = eng.tree_width
        super().__init__(deng, slots, context, prefill_chunk, greedy=greedy, sampled=sampled,
                         width=width, judge=greedy and width == 1,
                         output=sampled or width > 1)
        t, n, rt = self.target, self.n, self.rt
        dev, d = t.device, t.hidden_size
        S = rt.config.draft_on_stage
        lookup = eng.drafter.lookup
        self.drafters, self.draft_caches = slot_drafters(eng.pdm, slots, context, lookup)
        self.tokens, self.anchors, self.final = slot_buffers(t, eng.layout, context, slots)
        self.stages = SessionStages(self)
        self.local = None if S is None else LocalStage(self, S)
        # the control: three ops over every slot (ChainBatch, TreeBatch)
        m = self.anchors.shape[1]
        if self.width == 1:
            self.control = ChainControl(slots, n, m, d, dev, t.dtype)
            self.fused = ChainBatch(self, lookup)
        else:
            self.control = TreeControl(slots, n, self.width, m, d, dev, t.dtype)
            self.fused = TreeBatch(self, lookup)
        # a free slot's units: the bubble its message carries (Control.park)
        self.control.park_all(context - 1, self.dead)
        self.kept = SlotRows(eng.layout, self.control.unit_rows(), self.anchors, self.final)
        self.graphs = BatchGraphs(t.device, "batched distributed cycle",
                                   capturable=rt.backend == "nccl", messages=rt.messages,
                                   thread_local=True)
        self._open()

    @classmethod
    def rows_for(cls, engine, prompt_len: int, max_new: int) -> int:
        return BatchedSPD.rows_needed(prompt_len, max_new, engine.n, engine.tree_width)

    # --- sequences ---------------------------------------------------------------------------
    def _entry(self, ids, max_new, sampling, rule, on_token) -> BatchEntry:
        return BatchEntry(ids, max_new, sampling, rule, on_token,
                          DecodeStats(mode="spd", n=self.n))

    def _vacate(self, entry: BatchEntry, b: int, prefilled: bool, unused: bool) -> None:
        self.control.free(b)
        self.control.park(b, self.dead)
        if prefilled:
            entry.cycle.cycles = entry.launched
            entry.cycle.finish()
        entry.seq.finish()

    def _seat(self, entry: BatchEntry, b: int) -> None:
        entry.seq = Sequence(self.target, self.engine.layout, self.drafters[b], entry.ids,
                             entry.max_new, entry.sampling, entry.stats, entry.on_token,
                             entry.rule, width=self.width,
                             buffers=(self.tokens[b], self.anchors[b], self.final[b]))
        entry.cycle = Cycle(entry.seq, SlotStages(self.peeks), ahead=self.ahead,
                            control=self.control, slot=b)
        self.control.park(b, self.dead)  # (bubbles until its cycle begins)
        self.fused.join(b, entry.sampling)

    def _prefill(self, entry: BatchEntry, req: dict) -> torch.Tensor | None:
        t0 = time.perf_counter()
        local = None if self.local is None else self.local.view(entry.slot)
        last = self.deng._prefill(entry.seq, req, local)
        if local is not None:
            self.local.prefill_s += time.perf_counter() - t0
        return last

    def _start(self, entry: BatchEntry, last: torch.Tensor) -> bool:
        entry.seq.start(last, time.perf_counter() - entry.prefill_s)  # its first token
        entry.cycle.begin()
        return entry.seq.done

    # --- cycles ------------------------------------------------------------------------------
    def _cycle(self, members: tuple[BatchEntry, ...]) -> None:
        """One cycle of the session (device work and its messages: what a graph replays),
        the control once over every slot (ChainBatch, TreeBatch)."""
        self.fused.cycle(members)

    def _read(self, e: BatchEntry, upto: int) -> bool:
        """Reads e's cycles until `upto` are unread -> whether it ended (and left)."""
        while not e.done and e.launched - e.nread > upto:
            got = e.cycle.read(e.nread)
            e.nread += 1
            if got == STOP:
                self.leave(e)
                return True
        return False

    def _cycle_step(self) -> list[BatchEntry]:
        """One cycle of every slot, the cycles `ahead` behind read, and at the pause every
        cycle read."""
        ended = []
        for e in self.decoding():  # (a callback that raised in the last step's reads: the
            if self._read(e, self.ahead):  # cycles it left unread, before their slots are reused)
                ended.append(e)
        members = tuple(self.decoding())
        for b in self.prefilling:  # parked again before each cycle it sits out: a commit
            self.control.park(b, self.dead)  # moves its units on to row 1 (BatchedSPD's)
        self.graphs.launch(self.fused.key(members), members, self._cycle)
        at_pause = self._launched()
        self.fused.publish(members)  # (every slot's state in one copy)
        for e in members:
            e.launched += 1
        for e in members:  # each read `ahead` behind; at the pause, every cycle
            if self._read(e, 0 if at_pause else self.ahead):
                ended.append(e)
        return ended

    def _local_stats(self) -> dict:
        return self.local.stats(self.launched, self.graphs.describe())

    def _graph(self) -> dict:
        return self.graphs.describe()

    def close(self) -> None:
        if not self.closed:
            super().close()
            self.graphs.close()


__all__ = ["BatchEntry", "DistributedBatch"]
