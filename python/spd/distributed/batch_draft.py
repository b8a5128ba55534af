"""Rank 0's side of a batch session: several sequences through the distributed pipeline at once
(the session, its messages and pauses: spd.distributed.batch_stage). `DistributedBatch` has
BatchedSPD's join / step / leave (a join waits for the next pause, at most n + ahead + 1
cycles); `generate_batch` decodes a list of prompts with it. With the draft on stage S, stage S
runs here, inside rank 0's cycle (`LocalStage`)."""
from __future__ import annotations

import json
import time
from typing import Callable

import torch

from spd import env
from spd.distributed.batch_stage import (
    BatchFormat,
    LiveStep,
    batch_snap_bytes,
    batch_snap_views,
    session_formats,
)
from spd.distributed.config import role_name
from spd.distributed.faults import inject_fault
from spd.distributed.messages import SNAP_TAG, UNIT_TAG
from spd.draft.drafters import slot_drafters
from spd.errors import InternalError, SPDError
from spd.runtime.batch_spd import BatchedSPD, SlotSets, SlotStages
from spd.runtime.chain_batch import ChainBatch
from spd.runtime.control import ChainControl, TreeControl
from spd.runtime.cycle import Cycle, end_margin
from spd.runtime.cycle_graph import BatchGraphs
from spd.runtime.driver import STOP
from spd.runtime.sequence import Sequence, SlotRows, slot_buffers
from spd.runtime.slot_stage import SlotStage
from spd.runtime.slots import SlotPool, batch_request
from spd.runtime.stopping import StopRule
from spd.runtime.tree_batch import TreeBatch
from spd.runtime.types import DecodeStats, GenerationResult, SamplingParams
from spd.runtime.unit import UnitFormat, dead_unit


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


class DistributedBatch(SlotPool):
    """Rank 0's side of a batch session on the stage ranks of `deng` (a DistributedSPDEngine):
    up to `slots` sequences of at most `context` rows each (module docstring). `join` queues a
    sequence (it takes a slot at the next pause), `step` runs one cycle of every slot (or, while
    paused, the joins) and reads each sequence's state `ahead` cycles behind, `leave` frees a
    slot at once, `close` ends the session (the stage ranks wait for the next request).
    greedy / sampled: whether greedy and sampled sequences may join (what the last stage sends:
    a greedy chain's argmax, the output rows). prefill_chunk: a joining prompt goes through the
    ranks that many rows a pause, the others decoding between pauses (None: all at once).
    A hybrid target's chains batch too (SlotStage keeps each slot's state rings)."""

    def __init__(self, deng, slots: int, context: int, *, greedy: bool = True,
                 sampled: bool = True, prefill_chunk: int | None = None):
        if getattr(deng, "session", None) is not None:
            raise SPDError("a batch session is open on these ranks: close it first")
        super().__init__(deng.target, slots, context, prefill_chunk)
        rt, eng = deng.rt, deng.engine
        if eng.n < 2:
            raise SPDError("batched SPD needs n >= 2 stages")
        self.deng, self.rt, self.engine = deng, rt, eng
        t, n = deng.target, eng.n
        self.n, self.ahead, self.width = n, int(rt.config.ahead), eng.tree_width
        self.margin = end_margin(n, self.ahead)
        self.greedy, self.sampled = greedy, sampled
        self.judge = greedy and self.width == 1
        output = sampled or self.width > 1
        self.formats = session_formats(eng.layout, output)
        self.fmt = UnitFormat(n, self.width)
        self.bfmt = BatchFormat(self.fmt, slots)
        dev, d = t.device, t.hidden_size
        self.msg = torch.zeros(self.bfmt.ints, dtype=torch.int64, device=dev)
        self.ctrl, self.heads, _ = self.bfmt.split(self.msg, d, t.dtype)
        self.dead = dead_unit(self.fmt, context - 1, context - 1).to(dev)
        self.heads.copy_(self.dead)
        S = rt.config.draft_on_stage  # (stage S runs here: no snap of it travels)
        self.snaps = {s: torch.zeros(batch_snap_bytes(f.rows, slots, self.width, d, t.dtype),
                                     dtype=torch.uint8, device=dev)
                      for s, f in enumerate(self.formats) if (f.rows or s == n - 1) and s != S}
        self.views = {s: batch_snap_views(buf, slots, self.width, d, t.dtype)
                      for s, buf in self.snaps.items()}
        lookup = eng.drafter.lookup
        self.drafters, self.draft_caches = slot_drafters(eng.pdm, slots, context, lookup)
        self.tokens, self.anchors, self.final = slot_buffers(t, eng.layout, context, slots)
        self.peeks = torch.device(dev).type == "cpu" and not env.replay_check_enabled()
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
        self.waiting: list[BatchEntry] = []
        self.freed_at = [-n] * slots  # the first cycle each slot's bubbles went out in
        self.launched = 0             # the session's cycles launched
        self.pause_at: int | None = None
        self.paused = True            # every rank between cycles (before the first, too)
        self.closed = False
        self.pauses = 0
        self.graphs = BatchGraphs(t.device, "batched distributed cycle",
                                   capturable=rt.backend == "nccl", messages=rt.messages,
                                   thread_local=True)
        self.stage_stats: list[dict] = []
        self.fault = rt.fault_here()  # the test hook (DistConfig.fault)
        deng.session = self
        deng._request({"op": "batch", "slots": slots, "context": context,
                       "tree_width": self.width, "judge": self.judge, "output": output,
                       "ahead": self.ahead})

    def needs(self, prompt_len: int, max_new: int) -> int:
        return BatchedSPD.rows_needed(prompt_len, max_new, self.n, self.width)

    # --- sequences ---------------------------------------------------------------------------
    def join(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams, rule: StopRule,
             on_token: Callable[[int], None] | None = None) -> BatchEntry:
        """Queue `ids` [P]: it takes a free slot at the next pause (its prefill through the
        ranks and its first token, emitted then) and decodes from there."""
        if self.closed:
            raise InternalError("a join after the batch session ended")
        self.check_fits(ids.numel(), max_new)
        if not (self.greedy if sampling.greedy else self.sampled):
            raise SPDError(f"this batch session takes {'greedy' if self.greedy else 'sampled'} "
                           "sequences only")
        entry = BatchEntry(ids, max_new, sampling, rule, on_token,
                           DecodeStats(mode="spd", n=self.n))
        self.waiting.append(entry)
        return entry

    def leave(self, entry: BatchEntry, *, unused: bool = False) -> None:
        """The sequence stops now (ended, or its client left): its slot sends bubbles from the
        next cycle (`unused`: it ran no cycle, its slot is as it was)."""
        if entry.slot is None:
            if entry in self.waiting:
                self.waiting.remove(entry)
                entry.done = True
            return
        b = entry.slot
        prefilled = b not in self.prefilling
        if not self.release(entry):
            return
        self.heads[b].copy_(self.dead)
        self.control.free(b)
        self.control.park(b, self.dead)
        if not unused and prefilled:
            self.freed_at[b] = self.launched
        if prefilled:
            entry.cycle.cycles = entry.launched
            entry.cycle.finish()
        entry.seq.finish()

    def _usable(self) -> list[int]:
        """The free slots whose every unit in flight is a bubble (freed n - 1 cycles ago)."""
        return sorted(b for b in self.free if self.freed_at[b] <= self.launched - (self.n - 1))

    def _place(self, entry: BatchEntry, b: int) -> None:
        self.free.remove(b)
        entry.slot, entry.joined_at = b, self.launched
        entry.seq = Sequence(self.target, self.engine.layout, self.drafters[b], entry.ids,
                             entry.max_new, entry.sampling, entry.stats, entry.on_token,
                             entry.rule, width=self.width,
                             buffers=(self.tokens[b], self.anchors[b], self.final[b]))
        entry.cycle = Cycle(entry.seq, SlotStages(self.peeks), ahead=self.ahead,
                            control=self.control, slot=b)
        self.control.park(b, self.dead)  # (bubbles until its cycle begins)
        self.fused.join(b, entry.sampling)
        self.running[b] = entry
        self.prefilling[b] = 0  # (the next prompt row its prefill sends)

    def _resume(self) -> list[BatchEntry]:
        """While paused: the joins the free slots allow and a chunk of each prompt being
        prefilled (through the ranks into its slot: `prefill_chunk` rows a pause, all at once
        when None), then the cycles, when anything decodes -> the sequences that ended at
        their first token. A prompt whose last chunk is in starts decoding."""
        ended = []
        while self.paused:
            usable = self._usable()
            while self.waiting and usable:
                self._place(self.waiting.pop(0), usable.pop(0))
            parts = self._chunks()
            decoding = bool(self.decoding())
            if not parts and not decoding:
                if not (self.waiting and self.free):
                    return ended  # idle: the stage ranks wait for the next request
                # the free slots still have units in flight: bubbles until they have not
                self.deng._request({"op": "joins", "run": True, "cycle": self.launched,
                                    "joins": []})
                self._unpause()
                return ended
            self.deng._request({"op": "joins", "run": decoding, "cycle": self.launched,
                                "joins": [self._chunk_request(e, a, b) for e, a, b in parts]})
            lasts = []
            for e, a, b in parts:  # (the messages first: a callback that raises leaves them
                t0 = time.perf_counter()  # paired)
                local = None if self.local is None else self.local.view(e.slot)
                lasts.append(self.deng._prefill(e.seq, self._chunk_request(e, a, b), local))
                e.prefill_s += time.perf_counter() - t0
                if local is not None:
                    self.local.prefill_s += time.perf_counter() - t0
                self.prefilling[e.slot] = b
            if decoding:
                self._unpause()  # (the stage ranks run the cycles from here)
            starts = [(e, last) for (e, _, b), last in zip(parts, lasts)
                      if b == e.ids.numel()]
            for i, (e, last) in enumerate(starts):
                del self.prefilling[e.slot]
                try:
                    e.seq.start(last, time.perf_counter() - e.prefill_s)  # its first token
                    e.cycle.begin()
                except BaseException:
                    for f, _ in starts[i:]:
                        self.prefilling.pop(f.slot, None)
                        self.leave(f, unused=True)
                    raise
                if e.seq.done:
                    self.leave(e, unused=True)
                    ended.append(e)
            if not decoding and self.decoding():
                self.deng._request({"op": "joins", "run": True, "cycle": self.launched,
                                    "joins": []})
                self._unpause()
        return ended

    def _chunks(self) -> list[tuple[BatchEntry, int, int]]:
        """(entry, a, b): the rows a..b of each prompt being prefilled that go in at this
        pause."""
        out = []
        for slot, a in sorted(self.prefilling.items()):
            e = self.running[slot]
            P = e.ids.numel()
            out.append((e, a, P if self.prefill_chunk is None else min(P, a + self.prefill_chunk)))
        return out

    @staticmethod
    def _chunk_request(e: BatchEntry, a: int, b: int) -> dict:
        return {"slot": e.slot, "prompt_ids": e.ids[a:b].tolist(), "prompt_len": b - a,
                "start": a}

    def _unpause(self) -> None:
        self.paused, self.pause_at = False, None
        self.ctrl.fill_(0)

    def _want_pause(self) -> bool:
        return (self.closed or not self.decoding() or bool(self.waiting and self.free)
                or bool(self.prefilling))

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

    @torch.no_grad()
    def step(self) -> list[BatchEntry]:
        """While paused, the joins (and the cycles resume when anything decodes); else one
        cycle of every slot, the cycles `ahead` behind read, and at the pause every cycle
        read -> the sequences that ended in this step."""
        ended: list[BatchEntry] = []
        if self.paused:
            ended += self._resume()
            if self.paused:
                return ended
        for e in self.decoding():  # (a callback that raised in the last step's reads: the
            if self._read(e, self.ahead):  # cycles it left unread, before their slots are reused)
                ended.append(e)
        members = tuple(self.decoding())
        if self.fault and self.launched == self.fault["cycle"]:
            inject_fault(self.fault)
        self.graphs.launch(self.fused.key(members), members, self._cycle)
        self.launched += 1
        self.fused.publish(members)  # (every slot's state in one copy)
        for e in members:
            e.launched += 1
        at_pause = self.launched == self.pause_at
        if at_pause:  # (before any callback: one that raises leaves the session in step)
            self.paused = True
            self.pauses += 1
        for e in members:  # each read `ahead` behind; at the pause, every cycle
            if self._read(e, 0 if at_pause else self.ahead):
                ended.append(e)
        if not self.paused and self.pause_at is None and self._want_pause():
            self.pause_at = self.launched + self.margin
            self.ctrl.fill_(self.pause_at)
        return ended

    def close(self) -> None:
        """Ends the session: every sequence left, the cycles run to a pause, the stage ranks'
        figures read; they wait for the next request."""
        if self.closed:
            return
        for entry in list(self.waiting) + list(self.running.values()):
            self.leave(entry)
        self.closed = True
        while not self.paused:
            self.step()
        gen = self.deng._request({"op": "end"})
        self.deng.session = None
        rt, out = self.rt, []
        for r in range(1, rt.world):
            if self.local is not None and r == self.local.S + 1:  # (this process's stage)
                out.append(self.local.stats(self.launched, self.graphs.describe()))
                continue
            key = f"stats/{gen}/{r}"
            out.append(json.loads(rt.store.get(key)))
            rt.store.delete_key(key)
        self.stage_stats = out
        self.graphs.close()

    def describe(self) -> dict:
        """The session: cycles, pauses, rank 0's cycle graphs, each stage rank's figures."""
        return {"slots": self.slots, "cycles": self.launched, "pauses": self.pauses,
                "graph": self.graphs.describe(), "ranks": self.stage_stats}


# --- several prompts ---------------------------------------------------------------------------
def generate_batch(deng, prompts, max_new_tokens: int = 64,
                   sampling: SamplingParams | list = SamplingParams(),
                   on_token: Callable[[int, int], None] | None = None, *, stop=None,
                   stop_token_ids=None, max_batch: int | None = None,
                   describe: dict | None = None,
                   prefill_chunk: int | None = None) -> list[GenerationResult]:
    """`prompts` through the stage ranks together, up to `max_batch` at once (default: all, at
    most 8): SPDEngine.generate's contract for several prompts (one result each, in order;
    on_token(i, id) names the prompt). `describe` (a dict) gets the session's figures;
    prefill_chunk: DistributedBatch's."""
    eng = deng.engine
    prompts, sampling, max_batch = batch_request(prompts, sampling, max_batch)
    requests = [eng.prepare_request(p, max_new_tokens, stop, stop_token_ids) for p in prompts]
    if not requests:
        return []
    context = max(BatchedSPD.rows_needed(ids.numel(), m, eng.n, eng.tree_width)
                  for ids, m, _ in requests)
    batch = DistributedBatch(deng, max_batch, context,
                             greedy=any(s.greedy for s in sampling),
                             sampled=not all(s.greedy for s in sampling),
                             prefill_chunk=prefill_chunk)
    try:
        entries = []
        for i, (ids, max_new, rule) in enumerate(requests):
            tick = None if on_token is None else (lambda tok, i=i: on_token(i, tok))
            entries.append(batch.join(ids, max_new, sampling[i], rule, tick))
        while batch.running or batch.waiting:
            batch.step()
    finally:  # (an error: the ranks still end the session in step)
        batch.close()
    if describe is not None:
        describe.update(batch.describe())
    return [eng.build_result(e.out, e.stats, rule) for e, (_, _, rule) in zip(entries, requests)]


__all__ = ["BatchEntry", "DistributedBatch", "generate_batch"]
