"""The device loop across ranks: every rank runs the same fixed cycle, no host read in it.

spd.runtime.device_loop decides each cycle on the device; here its stage steps run on the stage
ranks, in lock-step (DistConfig.device_loop). Cycle c on every rank:

  rank 0      sends stage 0 its unit, then drafts (its own stream) beside receiving every
              stage's snap of cycle c; then the verdict and the commit, on the device
  stage s     runs its unit (received in cycle c - 1), sends the next stage its output (the
              unit of stage s + 1's cycle c + 1) and rank 0 its snap, and receives its unit of
              cycle c + 1

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
memory `ahead` cycles late and forwards it.

A rank posts its cycle's messages together (Endpoint.exchange: one NCCL group, so a receive
never waits behind this rank's own sends) and waits for them within the cycle, on the stream
under NCCL (Endpoint.order, flush_sends(host=False): the host waits for nothing). So every
cycle but a stage's last, which sends nothing on, is the same work on the same buffers: under
NCCL one CUDA graph replays it, messages included (spd.runtime.cycle_graph; SPD_REPLAY_CHECK
checks this on the CPU). Under gloo (the CPU) messages are host memory and run eagerly.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from spd.distributed.config import DRAFT_RANK
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import CYCLE_SNAP_TAG, CYCLE_UNIT_TAG, snap_format
from spd.errors import InternalError
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.device_loop import END
from spd.runtime.host_mirror import Published

if TYPE_CHECKING:
    from spd.distributed.transport import Endpoint
    from spd.runtime.device_loop import DeviceLoop
    from spd.runtime.sequence import SequenceDecode

HEAD = 16  # the int64 pair in front of a stage's unit and of a snap


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
    in_process = False  # the stages are other ranks: rank 0 needs the drafter's stream alone

    def __init__(self, rt: Endpoint, dec: SequenceDecode):
        t, n = dec.target, dec.n
        self.rt, self.dec, self.n = rt, dec, n
        d, dtype, dev = t.hidden_size, t.dtype, t.device
        self.greedy = dec.sampling.greedy
        self.formats = [snap_format(dec.layout, s, greedy=self.greedy) for s in range(n)]
        # one buffer each: every message of a cycle is waited for within it
        self.unit = torch.zeros(3, dtype=torch.int64, device=dev)
        self.snaps = [torch.zeros(HEAD + _row_bytes(d, dtype, f.rows), dtype=torch.uint8,
                                  device=dev) if f.rows or s == n - 1 else None
                      for s, f in enumerate(self.formats)]
        # a graph replays the cycle where the stages are other processes (not the mailbox of a
        # draft-on-stage process) and their messages can be recorded (NCCL)
        self.replayable = rt.mailbox is None
        self.capturable = rt.backend == "nccl"
        self.messages = rt.messages
        self.fault = rt.fault_here()  # the test hook (DistConfig.fault)
        self.posted: list = []  # this cycle's snap receives: (stage, buffer, work)
        # the final states by position: the last stage's output rows (sampling: rank 0 judges)
        self.carry = torch.zeros(dec.buffer_rows, d, dtype=dtype, device=dev)

    def begin(self, loop: DeviceLoop, at: torch.Tensor) -> None:
        """Before the draft step of cycle `loop.launching`: stage 0's unit, the row at at[0]
        ([n] int64: the loop's own positions; the other stages run what the stage before ran
        last cycle), goes out with the snaps' receives."""
        rt, dec, c, unit = self.rt, self.dec, loop.launching, self.unit
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        unit[:1].copy_(at[:1])
        unit[1:2].copy_(dec.tokens.index_select(0, at[:1]))
        unit[2:].copy_(loop.state[END:END + 1])
        snapping = [(s, buf) for s, buf in enumerate(self.snaps) if buf is not None]
        works = rt.exchange([(unit, 1, CYCLE_UNIT_TAG)],
                            [(buf, s + 1, CYCLE_SNAP_TAG) for s, buf in snapping], c)
        self.posted = [(s, buf, work) for (s, buf), work in zip(snapping, works)]

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
        rt.flush_sends(host=False)  # the unit is in (stage 0's snap came after it)
        return verdict


class StageCycles:
    """A stage rank's side of the cycle, for one generation after its prefill. `worker`: the
    rank's spd.distributed.stage_rank.StageWorker (its stage, target, layout and endpoint).

    Cycle c runs the unit in `inbox` (received in cycle c - 1; before cycle 0 from rank 0 at
    stage 0, a bubble elsewhere), sends its snap and output, and receives cycle c + 1's unit
    into `inbox`, all waited for within the cycle: so every cycle but the last (which sends no
    output on and receives nothing) is the same work, which a CUDA graph replays (CycleGraph)."""

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
        row = _row_bytes(self.d, self.dtype)
        # rank 0's units are int64 [3] (the in-process mailbox matches shapes, not bytes)
        self.inbox = (torch.zeros(3, dtype=torch.int64, device=dev) if worker.first
                      else torch.zeros(HEAD + row, dtype=torch.uint8, device=dev))
        self.outbox = torch.zeros(HEAD + row, dtype=torch.uint8, device=dev)
        self.snap = torch.zeros(HEAD + _row_bytes(self.d, self.dtype, self.fmt.rows),
                                dtype=torch.uint8, device=dev)
        # greedy, the last stage's verdict is its argmax: the draft it is given is a dummy
        self.judge = (torch.zeros(1, dtype=torch.int64, device=dev)
                      if greedy and worker.last else None)
        if not worker.first:  # cycle 0's unit: a bubble row past the first token's position
            _head(self.inbox)[:1].fill_(int(req["prompt_len"]) + s)
        self.end = torch.zeros(1, dtype=torch.int64, device=dev)  # the `end` cycle c received
        self.ends = Published(self.ahead + 1, 1, dev)  # each cycle's `end`, for the host
        self.graph = CycleGraph(lambda: self.cycle(last=False), dev, f"stage {s}'s cycle",
                                replayable=self.rt.mailbox is None,
                                capturable=self.rt.backend == "nccl",
                                messages=self.rt.messages, thread_local=True)
        # per cycle, the host's time in the stage step (eager), or to launch the replay
        self.forward_s: list[float] = []
        self.step_s = 0.0
        self.fault = self.rt.fault_here()

    def cycle(self, last: bool) -> None:
        """One cycle (`last`: the final one, which sends no unit on and receives none)."""
        w, rt, inbox = self.w, self.rt, self.inbox
        if w.first:
            pos, end = inbox[:1], inbox[2:3]
            x = w.target.embed_tokens(inbox[1:2])
        else:
            head = _head(inbox)
            pos, end, x = head[:1], head[1:2], _rows(inbox, self.d, self.dtype)
        self.end.copy_(end)
        t0 = time.perf_counter()
        outs, verdict = w.stage.run(x, pos, self.judge)
        self.step_s = time.perf_counter() - t0
        sends = []
        if self.snapping:
            head = _head(self.snap)
            head[:1].copy_(pos)
            if verdict is not None:
                head[1:2].copy_(verdict[0].view(1))
            rows = _rows(self.snap, self.d, self.dtype)
            for i, k in enumerate(self.hidden):
                rows[i:i + 1].copy_(outs[k])
            if self.fmt.with_output:
                rows[-1:].copy_(outs[-1])
            sends.append((self.snap, DRAFT_RANK, CYCLE_SNAP_TAG))
        if not w.last and not last:
            head = _head(self.outbox)
            head[:1].copy_(pos)
            head[1:2].copy_(end)
            _rows(self.outbox, self.d, self.dtype).copy_(outs[-1])
            sends.append((self.outbox, w.next, CYCLE_UNIT_TAG))
        recvs = [] if last else [(inbox, DRAFT_RANK if w.first else w.prev, CYCLE_UNIT_TAG)]
        for work in rt.exchange(sends, recvs):
            rt.order(work, recvs[0][1], "cycle unit")
        rt.flush_sends(host=False)

    def launch(self, c: int, last: bool) -> None:
        """Cycle c, then its `end` published for the host."""
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        t0, replays = time.perf_counter(), self.graph.replays
        if last:
            self.cycle(last=True)
        else:
            self.graph.launch()
        # the stage step's host time; a replay's launch where the cycle is a graph
        replayed = self.graph.replays > replays
        self.forward_s.append(time.perf_counter() - t0 if replayed else self.step_s)
        self.ends.publish(c, self.end)

    def run(self) -> int:
        """Cycles up to the end cycle, reading each one's `end` `ahead` cycles late -> cycles."""
        rt = self.rt
        if self.w.first:  # cycle 0's unit
            for work in rt.exchange([], [(self.inbox, DRAFT_RANK, CYCLE_UNIT_TAG)]):
                rt.order(work, DRAFT_RANK, "cycle unit")
        launched = read = 0
        end: int | None = None
        while end is None or launched < end:
            while (end is not None or launched <= read + self.ahead) and \
                    (end is None or launched < end):
                self.launch(launched, end is not None and launched == end - 1)
                launched += 1
            if end is None:
                got = self.ends.read(read)[0]
                read += 1
                if got and launched >= got:  # a cycle past the end is posted: peers desync
                    raise InternalError("a stage learnt the end cycle too late", stage=self.w.s,
                                        end=got, launched=launched)
                end = got or None
        rt.flush_sends()
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
