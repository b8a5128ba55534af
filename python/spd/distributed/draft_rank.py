"""The draft rank (rank 0): drafting, verification and control, with its CUDA streams."""
from __future__ import annotations

import json
import time
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from enum import Enum
from typing import Callable, NamedTuple

import torch

from spd.distributed.config import SpeculationPolicy
from spd.distributed.device_cycle import RemoteCycleStages, per_cycle_messages
from spd.distributed.emulate import wrap_drafter
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import (
    HEADER_TAG,
    JUDGE_TAG,
    SNAP_TAG,
    STOP,
    UNIT,
    UNIT_BYTES,
    UNIT_TAG,
    VERDICT_SIZE,
    VERDICT_TAG,
    Ring,
    TreeUnitFormat,
    UnitMessage,
    snap_format,
)
from spd.distributed.stats import DistributedDecodeStats, breakdown
from spd.distributed.transport import Endpoint
from spd.errors import InternalError
from spd.runtime.device_loop import DeviceLoop, unsupported
from spd.runtime.engine import GenerationResult, SamplingParams, SPDEngine
from spd.runtime.sequence import SequenceDecode, StageRunner
from spd.runtime.tree import TreeDecode
from spd.runtime.verdict import Verdict


class DraftRankStreams:
    """Rank 0's CUDA streams: snaps are waited for and scattered into the anchor buffer on
    `recv`, the PDM drafts on `draft`, verification and bookkeeping stay on the default stream.
    Cross-stream order goes through wait_stream (recorded events), so the steady state never
    synchronises the device; the host waits only for the one value it needs (the verdict). With
    NCCL the receives themselves run on NCCL's streams and `work.wait()` orders `recv` after them.
    On a CPU every method is a no-op."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.recv = torch.cuda.Stream(device)
            self.draft = torch.cuda.Stream(device)

        # The verdict's way to the host (to_host): one pinned buffer and one event suffice, as
        # each verdict is read before the next one is copied.
        self.pinned = torch.empty(VERDICT_SIZE, dtype=torch.int64, pin_memory=self.cuda)
        self.copied = torch.cuda.Event() if self.cuda else None

    def to_host(self, verdict: torch.Tensor) -> HostVerdict:
        """verdict [2] int64, a received buffer whose receive has just been waited for on the
        `recv` stream (which that orders after NCCL's): on CUDA a non-blocking copy into pinned
        host memory on `recv` and an event after it, so reading it waits for that copy alone,
        not for the default stream's queue (a `.tolist()` of a device tensor waits for
        everything queued there, e.g. the next cycle's draft work). On a CPU: as it is."""
        if not self.cuda:
            return HostVerdict(verdict, None)
        with torch.cuda.stream(self.recv):
            self.pinned.copy_(verdict, non_blocking=True)
            self.copied.record(self.recv)
        return HostVerdict(self.pinned, self.copied)

    def receiving(self):
        return torch.cuda.stream(self.recv) if self.cuda else nullcontext()

    def drafting(self):
        if not self.cuda:
            return nullcontext()
        self.draft.wait_stream(self.recv)  # the features received so far
        self.draft.wait_stream(self.main)  # tokens entered, rollbacks
        return torch.cuda.stream(self.draft)

    def reusing(self) -> None:
        """Ring buffers are about to take receives again: `recv` first waits for the default
        stream's queue, which may still read their previous messages (the sampled judgement
        reads the last stage's snap there; every other received buffer is read on `recv`)."""
        if self.cuda:
            self.recv.wait_stream(self.main)

    def after_receive(self, *tensors) -> None:
        """The default stream is about to read these received buffers."""
        if self.cuda:
            self.main.wait_stream(self.recv)
            for x in tensors:
                x.record_stream(self.main)

    def after_draft(self, draft) -> None:
        """The default stream is about to use the draft (its token enters the pipeline)."""
        if self.cuda:
            self.main.wait_stream(self.draft)
            for x in (draft.token, draft.q):
                if isinstance(x, torch.Tensor):
                    x.record_stream(self.main)


class HostVerdict(NamedTuple):
    """The last stage's verdict on its way to the host (DraftRankStreams.to_host)."""
    values: torch.Tensor  # [target token, accepted] int64 in host memory (pinned on CUDA)
    ready: object         # the CUDA event after the copy into `values`; None on a CPU

    def read(self) -> Verdict:
        """The one host read of a judged cycle. Event.synchronize waits for the copy alone;
        CUDA's sync debug mode does not flag it (torch's CUDAEvent::synchronize calls no
        warn_or_error_on_sync: only stream and device synchronisation and blocking copies do)."""
        if self.ready is not None:
            self.ready.synchronize()
        token, ok = self.values.tolist()
        return Verdict(bool(ok), token)


class SnapState(Enum):
    POSTED = "posted"        # its receive is posted; the rows go into the anchor buffer
    DISCARD = "discard"      # a unit rank 0 dropped (rollback, optimistic send): receive, drop
    RECEIVED = "received"    # received (and stored, unless discarded): nothing left to do


@dataclass
class SnapRecv:
    """One stage's snap message of one unit that rank 0 has posted a receive for."""
    stage: int
    pos: int            # the first position its rows belong to
    buf: torch.Tensor   # (rows of the stage, positions, hidden): anchors, then the last output
    work: object        # the posted receive
    due: int = 0        # the cycle in which the stage computes it (taken once that cycle is over)
    state: SnapState = SnapState.POSTED
    idx: torch.Tensor | None = None  # a tree unit's: the buffer row of each of its rows [W]


@dataclass
class Unit:
    """A token rank 0 sent into the pipeline, until the last stage's message about it is taken."""
    pos: int
    snaps: list[SnapRecv]
    verdict: list | None  # greedy: [receive (None until posted), [token, accepted]]
    dropped: bool = False
    taken: bool = False   # left the stream (oldest): its verdict buffer may take another


def ring_depth(n: int) -> int:
    """The depth of rank 0's rings of unit buffers for n stages. A unit's buffers are in flight
    from its send in cycle c until: its message to stage 0 and its judge draft (epoch c + n) are
    flushed, at the first send of cycle c + n + 2 (flush_sends(before=cycle - 1)); stage s's snap
    is taken by take_due in cycle c + s + 2; its verdict (or last snap) leaves in `oldest` by
    cycle c + n + 1. That is at most n + 2 cycles of units, and a cycle sends at most two (an
    announced unit, then the correction that drops it)."""
    return 2 * (n + 2)


class UnitStream:
    """Rank 0's side of one generation's unit stream (spd.distributed.protocol): sending units,
    the receives posted for what the stages send back about them, rollbacks and the end."""

    def __init__(self, rt: Endpoint, dec: SequenceDecode, streams: DraftRankStreams):
        self.rt, self.dec, self.n = rt, dec, dec.n
        # a token tree's units (TreeUnitFormat): rank 0 judges them, greedy too (the last stage
        # sends its output rows in its snaps, as under sampling)
        width = getattr(dec, "width", 1)
        self.tree = TreeUnitFormat.of(dec.n, width) if width > 1 else None
        self.greedy, self.streams = dec.sampling.greedy and self.tree is None, streams
        self.device = dec.target.device
        n = self.n
        # Rows of stage s's snap per unit (protocol.snap_format)
        self.rows = [snap_format(dec.layout, s, greedy=self.greedy).rows for s in range(n)]
        self.units: deque[Unit] = deque()  # sent; the last stage's message not taken yet
        self.snaps: list[SnapRecv] = []    # posted, in order, not taken yet
        self.sent = 0
        self._pending: Unit | None = None  # greedy: its last-stage receives not posted yet
        self.folded = self.rt.backend == "gloo"  # one message per unit (protocol)
        depth = ring_depth(n)  # rings (protocol.Ring), so no unit allocates
        dev, d, dtype = self.device, dec.target.hidden_size, dec.target.dtype
        unit_bytes = UNIT_BYTES if self.tree is None else self.tree.meta_bytes
        self.unit_bytes = unit_bytes
        per_unit = 1 if self.tree is None else width  # rows a unit's snap holds per anchor
        self.outbox = Ring(lambda: UnitMessage(unit_bytes, dev, self.folded), depth,
                           "unit sends", lambda m, _: self.rt.sending(m.data)
                           or self.rt.sending(m.header))
        self.snap_rings = [
            Ring(lambda rows=rows: torch.empty(rows, per_unit, d, dtype=dtype, device=dev), depth,
                 f"stage {s}'s snap receives",
                 lambda _, item: item is not None and item.state is not SnapState.RECEIVED)
            if rows else None for s, rows in enumerate(self.rows)]
        self.verdicts = Ring(lambda: torch.empty(VERDICT_SIZE, dtype=torch.int64, device=dev),
                             depth,
                             "verdict receives", lambda _, u: u is not None and not u.taken)

    def _send_unit(self, unit: UnitMessage, epoch: int = 0) -> None:
        """A unit message to stage 0: one message when folded, else payload then header."""
        # On the stream that wrote the payload (NCCL sends wait for the current stream).
        self.rt.isend(unit.data, 1, UNIT_TAG, epoch)
        if not self.folded:
            self.rt.isend(unit.header, 1, HEADER_TAG, epoch)

    def _post_last(self) -> None:
        """Post the receives of the last stage's messages (snap, verdict) about the newest unit.
        Greedy, they wait until the judge draft that unit needs has been sent: under NCCL the
        messages of a pair of ranks match in the order both post them, whatever the tag, and the
        last stage receives the draft before it sends them."""
        u, self._pending = self._pending, None
        if u is None:
            return
        with self.streams.receiving():
            for item in u.snaps:
                if item.work is None:
                    item.work = self.rt.irecv(item.buf, item.stage + 1, SNAP_TAG)
            u.verdict[0] = self.rt.irecv(u.verdict[1], self.n, VERDICT_TAG)

    def send(self, cycle: int, pos: int, token, tree: tuple | None = None) -> None:
        """Unit: `token` (an int or a 0-d device tensor: no host read) at position `pos` enters
        stage 0 in cycle `cycle`; post the receives for what every stage sends about it. A tree
        unit: `tree` = (its int64 fields [ints] (TreeUnitFormat.pack), its rows' buffer rows
        [W] (padding: the trash row)), `token` unused."""
        rt, n = self.rt, self.n
        rt.flush_sends(before=cycle - 1)  # the stages posted those receives long ago
        unit = self.outbox.take()
        unit.set_header(UNIT, self.sent)  # host memory on every device (protocol)
        if tree is None:
            # the payload is device memory under NCCL: the position and an int token go in as
            # views of the decode's device table, not as Python values (a copy each)
            dec = self.dec
            unit.write_unit(dec.on_device(pos), token if isinstance(token, torch.Tensor)
                            else dec.on_device(token))
        else:
            unit.write_tree(tree[0])
        self._send_unit(unit, cycle)
        if self.sent and self.greedy:  # the draft the last stage judges after the unit before
            # waited for n cycles later: the last stage posts its receive two units ahead
            rt.isend(unit.data, n, JUDGE_TAG, cycle + n)
        self._post_last()  # the unit before's: after its judge draft (see _post_last)
        with self.streams.receiving():
            if not self.greedy:  # the default stream reads the last stage's snaps (judging)
                self.streams.reusing()
            u = Unit(pos, [], None)
            for s in range(n):
                if self.rows[s]:
                    later = self.greedy and s == n - 1  # posted by _post_last
                    item = SnapRecv(s, pos, None, None, due=cycle + s,
                                    idx=None if tree is None else tree[1])
                    item.buf = self.snap_rings[s].take(item)
                    if not later:
                        item.work = rt.irecv(item.buf, s + 1, SNAP_TAG)
                    u.snaps.append(item)
            if self.greedy:
                u.verdict = [None, self.verdicts.take(u)]
        snaps = u.snaps
        self.snaps += snaps
        self.units.append(u)
        if self.greedy:
            self._pending = self.units[-1]
        self.sent += 1

    def take(self, item: SnapRecv) -> None:
        """Wait for a snap message and keep its anchor rows (once; a discarded one is dropped)."""
        if item.state is SnapState.RECEIVED:
            return
        self.rt.wait(item.work, item.stage + 1, "anchor states")
        keep = item.state is SnapState.POSTED
        item.state = SnapState.RECEIVED
        if keep and item.idx is not None:
            self.dec.keep_rows(item.stage, item.pos, item.idx, item.buf)
        elif keep:
            self.dec.keep_anchors(item.stage, item.pos, item.buf)

    def take_due(self, cycle: int) -> None:
        """Take every snap its stage computed by the end of `cycle` (features for the draft)."""
        left = []
        with self.streams.receiving():
            for item in self.snaps:
                if item.due <= cycle and item.work is None:
                    self._post_last()  # not reached in a run: a successor was sent first
                if item.due <= cycle:
                    self.take(item)
                elif item.state is not SnapState.RECEIVED:
                    left.append(item)
        self.snaps = left

    def drop_from(self, pos: int) -> None:
        """A rollback to `pos`: units at positions >= pos are dropped (their messages still come)."""
        for u in self.units:
            if u.pos >= pos and not u.dropped:
                u.dropped = True
                for item in u.snaps:
                    if item.state is SnapState.POSTED:
                        item.state = SnapState.DISCARD

    def oldest(self) -> tuple[Unit, object]:
        """The oldest kept unit, once the last stage has sent its message about it: greedy, its
        verdict on the way to the host (HostVerdict: read it with .read()); sampling, its snap
        (with the output row). Dropped units before it are received and discarded."""
        while True:
            u = self.units.popleft()
            u.taken = True
            if u is self._pending:
                self._post_last()  # not reached in a run: a successor was sent first
            if u.verdict is not None:
                with self.streams.receiving():  # orders `recv` after the receive (NCCL)
                    self.rt.wait(u.verdict[0], self.n, "verdict")
                    if not u.dropped:
                        return u, self.streams.to_host(u.verdict[1])
            last = u.snaps[-1] if u.snaps and u.snaps[-1].stage == self.n - 1 else None
            if not u.dropped:
                with self.streams.receiving():
                    self.take(last)
                self.streams.after_receive(last.buf)
                return u, last

    def finish(self) -> None:
        """The end: the last stage gets the two drafts past the last unit it waits for, every
        posted receive completes (dropped), then stage 0 gets the stop (each stage passes it on)."""
        rt, n = self.rt, self.n
        if self.greedy:
            for _ in range(2):
                rt.isend(UnitMessage(UNIT_BYTES, self.device, self.folded).data, n, JUDGE_TAG)
                self._post_last()  # the last unit's, after the draft it is judged with
        with self.streams.receiving():
            self.drop_from(-1)
            for u in self.units:
                if u.verdict is not None:
                    rt.wait(u.verdict[0], n, "verdict")
            self.take_due(1 << 62)
        stop = UnitMessage(self.unit_bytes, self.device, self.folded)  # (not steady: no ring)
        stop.set_header(STOP, self.sent)
        self._send_unit(stop)
        self.units.clear()
        rt.flush_sends()


class RemoteStages(StageRunner):
    """The stages on their ranks, driven from rank 0 through its unit stream (SequenceDecode.run's
    runner). A token entering stage 0 is sent as a unit; anchor rows arrive as snaps, greedy
    verdicts from the last stage; a rollback drops the units past it (the correction carries the
    lower position down the pipeline). Speculative control: a full cycle's draft is sent before
    its verdict is read, as if accepted, so no stage waits on rank 0 in an accepted cycle."""

    def __init__(self, rt: Endpoint, dec: SequenceDecode, stream: UnitStream,
                 streams: DraftRankStreams, policy: SpeculationPolicy):
        self.rt, self.dec, self.stream, self.streams, self.policy = rt, dec, stream, streams, policy
        self.fault = rt.fault_here()
        self.spec = {"announced": 0, "redone": 0}
        self.cycle_s: list[float] = []
        self.verify_s: list[float] = []  # each cycle's verification and rollback on this rank
        self.cycle = 0                   # units entered now go in at the next one
        self._ahead: int | None = None   # the position this cycle's draft was sent to ahead
        self._t0 = self._judged0 = 0.0

    def _judging_s(self) -> float:
        phase = self.dec.stats.phase_s
        return phase.get("verify", 0.0) + phase.get("rollback", 0.0)

    def begin(self, cycle: int) -> None:
        self.cycle, self._t0, self._judged0 = cycle, time.perf_counter(), self._judging_s()
        if self.fault and cycle == self.fault["cycle"]:
            inject_fault(self.fault)

    def features(self, through: int) -> None:
        with self.dec.timer("wait_stage" if self.dec.post_step else "wait_snaps"):
            self.stream.take_due(through)

    def drafting(self):
        return self.streams.drafting()

    def drafted(self, draft) -> None:
        self.streams.after_draft(draft)

    def announce(self, cycle: int, position: int, draft) -> None:
        dec = self.dec
        if self.policy.speculate() and len(dec.out) + 1 < dec.max_new:
            with dec.timer("send"):
                self.stream.send(cycle + 1, position, draft.token)
            self.spec["announced"] += 1
            self._ahead = position

    def verdict(self, dec: SequenceDecode) -> Verdict:
        # The oldest unit has left the last stage: greedy, its verdict is the one value this
        # cycle reads on the host; sampling, rank 0 judges its output row.
        with dec.timer("wait_stage"):
            _, got = self.stream.oldest()
        if dec.sampling.greedy:
            with dec.timer("verify"):
                verdict = got.read()
        else:
            verdict = dec.judge(got.buf[-1])
        self.policy.record(verdict.accepted)
        return verdict

    def enter(self, position: int, token) -> None:
        if self._ahead is not None:  # this cycle's draft went ahead
            ahead, self._ahead = self._ahead, None
            if position == ahead:  # accepted: it is in the pipeline already
                return
            self.spec["redone"] += 1  # rejected: the correction follows the dropped unit
        with self.dec.timer("send"):
            self.stream.send(self.cycle + 1, position, token)

    def rollback(self, length: int) -> None:
        self.stream.drop_from(length)

    def end(self, cycle: int) -> None:
        self._ahead = None
        self.cycle_s.append(time.perf_counter() - self._t0)
        self.verify_s.append(self._judging_s() - self._judged0)


class RemoteTreeStages(RemoteStages):
    """RemoteStages for a token tree (spd.runtime.tree.TreeDecode): a unit carries a
    position's rows with their slots, keys and mask, and the commits decided since the unit
    before (protocol.TreeUnitFormat); rank 0 judges every position (the last stage's snap
    holds its output rows). A draft sent ahead of its verdict stays in the pipeline when the
    rows that enter are among its own (a dropped row is only unreachable)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.commits: list[tuple[int, int]] = []  # (position, slot) not sent yet
        self._ahead_lanes: set[int] = set()
        self._announce = None

    def _send(self, position: int, rows=None, token=None) -> None:
        dec, fmt = self.dec, self.stream.tree
        idx, prefix, keys, mask, tokens = dec.unit_input(position, rows, token)
        meta = fmt.pack(position, prefix, tokens, idx, keys, mask, self.commits, dec.trash)
        self.commits = []
        dev = dec.target.device
        pad = idx + [dec.trash] * (fmt.width - len(idx))
        with dec.timer("send"):
            self.stream.send(self.cycle + 1, position, None,
                             (torch.tensor(meta, dtype=torch.int64, device=dev),
                              torch.tensor(pad, dtype=torch.int64, device=dev)))

    def announce(self, cycle: int, position: int, draft) -> None:
        dec = self.dec
        if self.policy.speculate() and len(dec.out) + 1 < dec.max_new:
            self._send(position, dict(enumerate(draft)))
            self.spec["announced"] += 1
            self._ahead, self._ahead_lanes = position, set(range(len(draft)))

    def verdict(self, dec) -> Verdict:
        with dec.timer("wait_stage"):
            unit, got = self.stream.oldest()
        if unit.pos != dec.sched.start:
            raise InternalError("the last stage's unit is not the oldest position",
                                unit=unit.pos, oldest=dec.sched.start)
        row = dec.judging_row[unit.pos]
        verdict = dec.judge(got.buf[-1][row:row + 1])
        self.policy.record(verdict.accepted)
        return verdict

    def enter(self, position: int, token) -> None:
        dec = self.dec
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            rows = dec.rows.get(position) if token is None else None
            if position == ahead and rows is not None and set(rows) <= self._ahead_lanes:
                # its rows went ahead (the dropped ones are only unreachable): the unit in the
                # pipeline holds every lane of the draft, so the last stage's rows are in
                # that order, not in the order of the rows left
                dec.unit_lanes[position] = sorted(self._ahead_lanes)
                return
            self.spec["redone"] += 1
            self.stream.drop_from(ahead)
        if token is None:
            self._send(position)
        else:
            self._send(position, token=token)

    def commit_row(self, position: int, slot: int) -> None:
        if len(self.commits) >= self.stream.tree.commits:
            raise InternalError("more commits between two tree units than the format holds",
                                commits=len(self.commits) + 1)
        self.commits.append((position, slot))


class DistributedSPDEngine:
    """Rank 0's side of the distributed engine: `generate` has `SPDEngine.generate`'s contract."""

    def __init__(self, rt: Endpoint, engine: SPDEngine):
        self.rt = rt               # the draft rank's messages
        self.process = rt.rt       # its process's Runtime: failure handling, exit hooks
        self.engine = engine
        self.target = engine.target
        self.layout = engine.layout
        self.n = engine.n
        self._gen = 0

    def _request(self, payload: dict) -> int:
        self._gen += 1
        key = f"req/{self._gen}"
        self.rt.store.set(key, self.rt.signer.seal(key, payload))  # signed: it can stop the run
        return self._gen

    def shutdown(self) -> None:
        self._request({"op": "shutdown"})

    def _post_prefill_snaps(self, dec: SequenceDecode) -> list[SnapRecv]:
        """Post receives for every stage's prefill snap (protocol.snap_format, prefill)."""
        t, out = self.target, []
        for s in range(self.n):
            rows = snap_format(self.layout, s, greedy=dec.sampling.greedy, prefill=True).rows
            if rows:
                buf = torch.empty(rows, dec.prompt_len, t.hidden_size, dtype=t.dtype,
                                  device=t.device)
                out.append(SnapRecv(s, 0, buf, self.rt.irecv(buf, s + 1, SNAP_TAG)))
        return out

    def _device_loop(self, dec: SequenceDecode) -> bool:
        """Whether `dec` runs on the device loop (DistConfig.device_loop); a decode it does not
        run yet warns and runs on the unit protocol."""
        config = self.rt.config
        if not config.device_loop:
            return False
        why = unsupported(dec)
        if why is not None:
            warnings.warn(f"the distributed device loop does not run {why} yet: this decode "
                          "runs on the unit protocol", stacklevel=3)
        return why is None

    def _prefill(self, dec: SequenceDecode) -> torch.Tensor:
        """The prompt through every stage; rank 0 keeps every anchor -> the last row [1, d]."""
        snaps = self._post_prefill_snaps(dec)
        dec.anchors[0, :dec.prompt_len] = self.target.embed_tokens(dec.tokens[:dec.prompt_len])
        for item in snaps:
            self.rt.wait(item.work, item.stage + 1, "anchor states")
            dec.keep_anchors(item.stage, 0, item.buf)
        return snaps[-1].buf[-1][-1:]

    def _generate_on_device(self, dec: SequenceDecode, gen_id: int, rule) -> GenerationResult:
        """The decode as DeviceLoop cycles with the stage ranks in lock-step
        (spd.distributed.device_cycle); cycle times are the host's intervals between reads of
        the published state (on a GPU the device's pace once the host runs ahead)."""
        rt = self.rt
        t0 = time.perf_counter()
        dec.start(self._prefill(dec), t0, StageRunner())  # the first token goes in cycle 0
        loop = DeviceLoop(dec, RemoteCycleStages(rt, dec), rt.config.ahead)
        counted = dict(rt.messages)
        loop.run()
        rt.flush_sends()
        # the decode ends where the host read its end; the ranks' cycles to the end cycle after
        # it (DeviceLoop: n + ahead + 1) are the drain, before the next request can start
        dec.finish(loop.done_at)
        drain_ms = (time.perf_counter() - (loop.done_at or t0)) * 1e3
        stats = dec.stats
        stats.loop = "device"
        stage_stats = self._stage_stats(gen_id)
        cycle_s = [b - a for a, b in zip(loop.read_at, loop.read_at[1:])]
        zeros = [0.0] * len(cycle_s)
        stats.distributed = breakdown(rt, stats, cycle_s, zeros, stage_stats, zeros)
        stats.distributed.update(loop="device", ahead=loop.ahead, cycles_run=loop.cycles,
                                 drain_ms=drain_ms, graph=loop.graph.describe(),
                                 verify_on="rank 0", messages_per_cycle=per_cycle_messages(
                                     rt, counted, loop.cycles, stage_stats))
        return self.engine.build_result(dec.out, stats, rule)

    def _stage_stats(self, gen_id: int) -> list[dict]:
        rt = self.rt
        out = [json.loads(rt.store.get(f"stats/{gen_id}/{r}")) for r in range(1, rt.world)]
        for r in range(1, rt.world):
            rt.store.delete_key(f"stats/{gen_id}/{r}")
        return out

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None, *, stop=None,
                 stop_token_ids=None, cancel=None) -> GenerationResult:
        """`SPDEngine.generate`'s contract; `cancel` (an Event), once set, ends the decode at
        its next token as EOS would (the stages stay in step: the server's disconnects)."""
        rt, t, n = self.rt, self.target, self.n
        ids, max_new, rule = self.engine.prepare_request(prompt_ids, max_new_tokens, stop,
                                                         stop_token_ids)
        rule.cancel = cancel
        drafter = wrap_drafter(drafter or self.engine.drafter, rt.config)
        args = (t, self.layout, drafter, ids, max_new, sampling,
                DistributedDecodeStats(mode="spd", n=n), on_token, rule)
        width = self.engine.tree_width
        dec = TreeDecode(*args, width=width) if width > 1 else SequenceDecode(*args)
        # the protocol's greedy: the last stage judges (a tree's positions rank 0 judges)
        greedy = sampling.greedy and width == 1
        device_loop = self._device_loop(dec)
        gen_id = self._request({"op": "generate", "prompt_ids": ids.tolist(),
                                "prompt_len": dec.prompt_len, "capacity": dec.buffer_rows,
                                "greedy": greedy, "tree_width": width,
                                "device_loop": device_loop, "ahead": rt.config.ahead})
        if device_loop:
            return self._generate_on_device(dec, gen_id, rule)
        streams = DraftRankStreams(torch.device(t.device))
        staged_before = rt.host_staged
        stream = UnitStream(rt, dec, streams)
        policy = SpeculationPolicy(rt.config.speculative_control)
        stages = (RemoteTreeStages if width > 1 else RemoteStages)(rt, dec, stream, streams,
                                                                   policy)

        # Prefill: every stage runs the prompt; rank 0 gets every anchor and the last row.
        t0 = time.perf_counter()
        dec.start(self._prefill(dec), t0, stages)  # the first token enters: a unit
        dec.run()
        dec.finish()
        stream.finish()
        stats = dec.stats
        stage_stats = self._stage_stats(gen_id)
        stats.distributed = breakdown(rt, stats, stages.cycle_s, dec.draft_s, stage_stats,
                                      stages.verify_s)
        stats.distributed["speculative_control"] = dict(mode=policy.mode, **stages.spec)
        stats.distributed["units"] = stream.sent
        # greedy: the last stage judges (final norm + LM head there); sampling: rank 0 (q, p)
        stats.distributed["verify_on"] = "last stage" if greedy else "rank 0"
        stats.distributed["host_staged_receives"] = rt.host_staged - staged_before  # this one
        return self.engine.build_result(dec.out, stats, rule)
