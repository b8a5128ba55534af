"""The device loop across ranks: every rank runs the same fixed cycle, no host read in it.

spd.runtime.device_loop decides each cycle on the device; here its stage steps run on the stage
ranks, in lock-step (DistConfig.device_loop). Cycle c on every rank:

  rank 0      sends stage 0 its unit, then drafts (its own stream) beside receiving every
              stage's snap of cycle c; then the verdict and the commit, on the device
  stage s     receives its unit, runs its step, sends the next stage its output (the unit of
              stage s + 1's cycle c + 1) and rank 0 its snap

A stage never reads a message on the host to know what to run: every cycle runs the same work,
and a bubble (filling, after a rejection, past the end) is a row at a position no row reads
before a real one rewrites it. Rows in flight at a rejection run on as such bubbles: each one is
ahead of the correction, at a position the correction or a later token rewrites at every stage
before anything reads it there (rank 0's anchor rows included: a row's type reads only the
anchors of the stages it has passed). Messages, all on the data group, fixed sizes:

  rank 0 -> stage 0        int64 [position, token, end]                        CYCLE_UNIT_TAG
  stage s -> stage s + 1   int64 [position, end], then the output row [1, d]    CYCLE_UNIT_TAG
  stage s -> rank 0        int64 [position, token], then rows [R, d]: its
                           anchors in slot order, then (the last stage,
                           sampling) its output row; the last stage's token is
                           its greedy verdict (argmax), compared on rank 0      CYCLE_SNAP_TAG

A stage with no anchors sends no snap, but the last stage always does. At cycle 0 stages 1..n-1
have no input yet and run a bubble; in the last cycle no stage sends on (so every pair posts as
many sends as receives). `end` is the cycle number every rank stops at (DeviceLoop's END, 0
while unknown): rank 0 sets it on the device; each stage reads the one it received from pinned
memory `ahead` cycles late and forwards it. Under NCCL the host waits for nothing in a cycle
(Endpoint.order, flush_sends(host=False)); under gloo (the CPU) messages are host memory.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from spd.distributed.config import DRAFT_RANK
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import CYCLE_SNAP_TAG, CYCLE_UNIT_TAG, Ring, snap_format
from spd.errors import InternalError
from spd.runtime.device_loop import END
from spd.runtime.host_mirror import Published

if TYPE_CHECKING:
    from spd.distributed.transport import Endpoint
    from spd.runtime.device_loop import DeviceLoop
    from spd.runtime.sequence import SequenceDecode

HEAD = 16  # the int64 pair in front of a stage's unit and of a snap
DEPTH = 3  # ring depth: a buffer's send is flushed two cycles later (flush_sends(before=c - 1))


def _row_bytes(d: int, dtype: torch.dtype, rows: int = 1) -> int:
    return rows * d * torch.empty((), dtype=dtype).element_size()


def _head(buf: torch.Tensor) -> torch.Tensor:
    return buf[:HEAD].view(torch.int64)


def _rows(buf: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    return buf[HEAD:].view(dtype).view(-1, d)


class RemoteCycleStages:
    """Rank 0's side of the cycle (DeviceLoop's `stages`): the unit for stage 0 out, every
    stage's snap in; anchors into the decode's buffer at the positions the snaps name."""

    lockstep = True     # the stage ranks run exactly rank 0's cycles (DeviceLoop.run)
    capturable = False  # the NCCL calls are enqueued eagerly each cycle (no host wait in them)
    in_process = False  # the stages are other ranks: rank 0 needs the drafter's stream alone

    def __init__(self, rt: Endpoint, dec: SequenceDecode):
        t, n = dec.target, dec.n
        self.rt, self.dec, self.n = rt, dec, n
        d, dtype, dev = t.hidden_size, t.dtype, t.device
        self.greedy = dec.sampling.greedy
        self.formats = [snap_format(dec.layout, s, greedy=self.greedy) for s in range(n)]
        self.units = Ring(lambda: torch.zeros(3, dtype=torch.int64, device=dev), DEPTH,
                          "cycle units", lambda b, _: rt.sending(b))
        self.snaps = [Ring(lambda f=f: torch.zeros(HEAD + _row_bytes(d, dtype, f.rows),
                                                   dtype=torch.uint8, device=dev), 2,
                           f"stage {s}'s cycle snaps")
                      if f.rows or s == n - 1 else None for s, f in enumerate(self.formats)]
        self.fault = rt.fault_here()  # the test hook (DistConfig.fault)
        self.posted: list = []  # this cycle's snap receives: (stage, buffer, work)
        # the final states by position: the last stage's output rows (sampling: rank 0 judges)
        self.carry = torch.zeros(dec.buffer_rows, d, dtype=dtype, device=dev)

    def begin(self, loop: DeviceLoop, at: torch.Tensor) -> None:
        """Before the draft step of cycle `loop.launching`: stage 0's unit, the row at at[0]
        ([n] int64: the loop's own positions; the other stages run what the stage before ran
        last cycle), goes out, and the snaps' receives are posted."""
        rt, dec, c = self.rt, self.dec, loop.launching
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        rt.flush_sends(before=c - 1, host=False)
        unit = self.units.take()
        unit[:1].copy_(at[:1])
        unit[1:2].copy_(dec.tokens.index_select(0, at[:1]))
        unit[2:].copy_(loop.state[END:END + 1])
        rt.isend(unit, 1, CYCLE_UNIT_TAG, c)
        self.posted = [(s, buf, rt.irecv(buf, s + 1, CYCLE_SNAP_TAG))
                       for s, ring in enumerate(self.snaps) if ring is not None
                       for buf in (ring.take(),)]

    def run(self, loop: DeviceLoop, at: torch.Tensor):
        """After the draft step: every stage's snap in -> the greedy verdict (token [1],
        accepted [1]) or None (sampling: `carry` has the last stage's row)."""
        rt, dec, t = self.rt, self.dec, self.dec.target
        verdict = None
        for s, buf, work in self.posted:
            rt.order(work, s + 1, "cycle snap")
            head, rows = _head(buf), _rows(buf, t.hidden_size, t.dtype)
            pos = head[:1]
            for i, j in enumerate(self.formats[s].slots):
                dec.anchors[j].index_copy_(0, pos, rows[i:i + 1])
            if s == self.n - 1:
                if self.greedy:  # the last stage's argmax after its row judges the next token
                    token = head[1:2]
                    verdict = (token, token == dec.tokens.index_select(0, pos + 1))
                else:
                    self.carry.index_copy_(0, pos, rows[-1:])
        return verdict


class StageCycles:
    """A stage rank's side of the cycle, for one generation after its prefill. `worker`: the
    rank's spd.distributed.stage_rank.StageWorker (its stage, target, layout and endpoint)."""

    def __init__(self, worker, req: dict):
        self.w, self.rt = worker, worker.rt
        t, s = worker.target, worker.s
        self.d, self.dtype, dev = t.hidden_size, t.dtype, t.device
        self.ahead = int(req["ahead"])
        greedy = bool(req.get("greedy", False))
        self.fmt = snap_format(worker.layout, s, greedy=greedy)
        first = worker.stage.layer_ids.start
        self.hidden = [b - first - 1 for b in self.fmt.hidden]  # layer outputs sent as anchors
        self.snapping = bool(self.fmt.rows) or worker.last
        rt, row = self.rt, _row_bytes(self.d, self.dtype)
        # rank 0's units are int64 [3] (the in-process mailbox matches shapes, not bytes)
        self.inbox = Ring(lambda: torch.zeros(3, dtype=torch.int64, device=dev) if worker.first
                          else torch.zeros(HEAD + row, dtype=torch.uint8, device=dev), 2,
                          "cycle unit receives")
        sent = lambda b, _: rt.sending(b)  # noqa: E731
        self.outbox = Ring(lambda: torch.zeros(HEAD + row, dtype=torch.uint8, device=dev),
                           DEPTH, "cycle unit sends", sent)
        self.snaps = Ring(lambda: torch.zeros(HEAD + _row_bytes(self.d, self.dtype,
                                                                 self.fmt.rows),
                                              dtype=torch.uint8, device=dev), DEPTH,
                          "cycle snap sends", sent)
        # greedy, the last stage's verdict is its argmax: the draft it is given is a dummy
        self.judge = (torch.zeros(1, dtype=torch.int64, device=dev)
                      if greedy and worker.last else None)
        # cycle 0 of stages 1..: a bubble row past the first token's position
        self.bubble = torch.tensor([int(req["prompt_len"]) + s, 0], dtype=torch.int64,
                                   device=dev)
        self.bubble_row = torch.zeros(1, self.d, dtype=self.dtype, device=dev)
        self.ends = Published(self.ahead + 1, 1, dev)  # each cycle's `end`, for the host
        self.forward_s: list[float] = []
        self.fault = rt.fault_here()

    def cycle(self, c: int, last: bool) -> torch.Tensor:
        """Cycle c (`last`: the final one, which sends no unit on) -> the `end` it received [1]."""
        w, rt = self.w, self.rt
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        if w.first:
            buf = self.inbox.take()
            rt.order(rt.irecv(buf, DRAFT_RANK, CYCLE_UNIT_TAG), DRAFT_RANK, "cycle unit")
            pos, end = buf[:1], buf[2:3]
            x = w.target.embed_tokens(buf[1:2])
        elif c == 0:
            pos, end, x = self.bubble[:1], self.bubble[1:], self.bubble_row
        else:
            buf = self.inbox.take()
            rt.order(rt.irecv(buf, w.prev, CYCLE_UNIT_TAG), w.prev, "cycle unit")
            head = _head(buf)
            pos, end, x = head[:1], head[1:2], _rows(buf, self.d, self.dtype)
        rt.flush_sends(before=c - 1, host=False)
        t0 = time.perf_counter()
        outs, verdict = w.stage.run(x, pos, self.judge)
        self.forward_s.append(time.perf_counter() - t0)
        if self.snapping:
            snap = self.snaps.take()
            head = _head(snap)
            head[:1].copy_(pos)
            if verdict is not None:
                head[1:2].copy_(verdict[0].view(1))
            rows = _rows(snap, self.d, self.dtype)
            for i, k in enumerate(self.hidden):
                rows[i:i + 1].copy_(outs[k])
            if self.fmt.with_output:
                rows[-1:].copy_(outs[-1])
            rt.isend(snap, DRAFT_RANK, CYCLE_SNAP_TAG, c)
        if not w.last and not last:
            out = self.outbox.take()
            head = _head(out)
            head[:1].copy_(pos)
            head[1:2].copy_(end)
            _rows(out, self.d, self.dtype).copy_(outs[-1])
            rt.isend(out, w.next, CYCLE_UNIT_TAG, c)
        return end

    def run(self) -> int:
        """Cycles up to the end cycle, reading each one's `end` `ahead` cycles late -> cycles."""
        launched = read = 0
        end: int | None = None
        while end is None or launched < end:
            while (end is not None or launched <= read + self.ahead) and \
                    (end is None or launched < end):
                self.ends.publish(launched, self.cycle(launched, end is not None
                                                       and launched == end - 1))
                launched += 1
            if end is None:
                got = self.ends.read(read)[0]
                read += 1
                if got and launched >= got:  # a cycle past the end is posted: peers desync
                    raise InternalError("a stage learnt the end cycle too late", stage=self.w.s,
                                        end=got, launched=launched)
                end = got or None
        self.rt.flush_sends()
        return launched


def per_cycle_messages(rt: Endpoint, before: dict, cycles: int,
                       stage_stats: list[dict]) -> dict[str, dict[str, float]]:
    """Messages each role posted per cycle of the decode loop, by direction and group
    ("send/data", "recv/control", ...): rank 0's since `before` (Endpoint.messages), each
    stage rank's from its stats."""
    out = {"0": {k: v / cycles for k, v in messages_since(rt, before).items() if v}}
    for st in stage_stats:
        out[str(st["rank"])] = {k: v / st["cycles"] for k, v in st["messages"].items() if v}
    return out


def messages_since(rt: Endpoint, before: dict) -> dict[str, int]:
    """Messages `rt` posted since `before` (a copy of Endpoint.messages), keyed "send/data"."""
    return {f"{a}/{b}": rt.messages[a, b] - before.get((a, b), 0) for a, b in rt.messages}
