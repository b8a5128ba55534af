"""A stage rank (rank s + 1): its layers, its KV cache, and its side of every cycle."""
from __future__ import annotations

import json
import time

import torch

from spd import env
from spd.distributed.config import DRAFT_RANK, role_name
from spd.distributed.emulate import make_stage
from spd.distributed.faults import inject_fault
from spd.distributed.messages import (
    PREFILL_TAG,
    SNAP_TAG,
    UNIT_TAG,
    snap_bytes,
    snap_format,
    snap_views,
)
from spd.distributed.transport import Endpoint, _td
from spd.errors import InternalError
from spd.model.partition import DepthLayout
from spd.model.target import Stage
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.driver import Published, drive, peek
from spd.runtime.unit import (
    END,
    LIVE,
    StageStep,
    UnitFormat,
    dead_unit,
    message_bytes,
    split_message,
)


class StageWorker:
    """Stage s = role s + 1: its layers and its KV cache, generation after generation.
    `sessions`: what serves a batch session's requests (spd.distributed.batch_stage's
    BatchSession, given by the rank's set-up: that module builds on this one)."""

    def __init__(self, rt: Endpoint, target, layout: DepthLayout, sessions=None):
        self.rt, self.target, self.layout = rt, target, layout
        self.sessions = sessions
        self.s = rt.rank - 1
        self.n = layout.n
        self.first = self.s == 0
        self.last = self.s == self.n - 1
        self.stage: Stage | None = None
        self.batch_caches = None  # a batch session's slot caches (batch_stage)
        self.prev, self.next = rt.rank - 1, rt.rank + 1

    def serve(self) -> None:
        gen = 0
        while True:
            gen += 1
            req = wait_request(self.rt, gen)
            if req["op"] == "shutdown":
                return
            if req["op"] == "batch":  # several sequences: requests until the session's end
                if self.sessions is None:
                    raise InternalError("a batch session on a stage rank set up without them")
                gen = self.sessions(self, req).serve(gen)
                continue
            self.run(gen, req)

    @torch.no_grad()
    def run(self, gen: int, req: dict) -> None:
        rt, t = self.rt, self.target
        cap = int(req["capacity"])
        if self.stage is None or self.stage.cache.capacity < cap:
            self.stage = make_stage(t, self.s, self.layout.stages[self.s], cap, rt.config)
        self.stage.cache.truncate(0)
        t0 = time.perf_counter()
        prefill(rt, self.stage, self.layout, req, keep=None)
        prefill_s = time.perf_counter() - t0
        cycles = StageCycles(self, req)
        counted = dict(rt.messages)
        t_dec = time.perf_counter()
        ran = cycles.run()
        rt.store.set(f"stats/{gen}/{rt.rank}", json.dumps(
            {"rank": rt.rank, "role": role_name(rt.rank),
             "layers": [self.stage.layer_ids.start, self.stage.layer_ids.stop],
             "prefill_s": prefill_s, "decode_s": time.perf_counter() - t_dec,
             "phase_s": {"forward": sum(cycles.forward_s)}, "forward_s": cycles.forward_s,
             "cycles": ran, "messages": messages_since(rt, counted),
             "graph": cycles.graph.describe()}))


def prefill(rt: Endpoint, stage: Stage, layout: DepthLayout, req: dict, keep) -> torch.Tensor:
    """Stage `stage.index`'s prefill of the prompt's rows from req["start"] (0 where absent: a
    chunk of a batch's prompt starts later): its rows in (stage 0: their ids, embedded), its
    layers, its snap to rank 0 (or, in rank 0's process, `keep`(snap rows [R, P, d])), its
    output on to the next stage -> the output [P, d] (P = req["prompt_len"], the rows)."""
    t, s = stage.target, stage.index
    if int(req.get("start", 0)) == 0:  # (a batch slot's last sequence: a hybrid's rings reset)
        stage.cache.truncate(0)
    if s == 0:
        h = t.embed_tokens(torch.tensor(req["prompt_ids"], dtype=torch.int64, device=t.device))
    else:
        h = torch.empty(int(req["prompt_len"]), t.hidden_size, dtype=t.dtype, device=t.device)
        rt.wait(rt.irecv(h, s, PREFILL_TAG), s, "prefill input")  # from role s: stage s - 1
    outs, _ = stage.run(h, int(req.get("start", 0)))
    fmt = snap_format(layout, s, output=True, anchors=bool(req.get("anchors", True)))
    first = stage.layer_ids.start
    rows = [outs[b - first - 1] for b in fmt.hidden] + ([outs[-1]] if fmt.with_output else [])
    if rows:
        snap = torch.stack(rows)
        if keep is not None:
            keep(snap)
        else:
            rt.isend(snap, DRAFT_RANK, SNAP_TAG)
    if s < layout.n - 1:
        rt.isend(outs[-1].contiguous(), s + 2, PREFILL_TAG)  # to role s + 2: stage s + 1
    rt.flush_sends()
    return outs[-1]


class StageCycles:
    """A stage rank's side of the cycles of one generation, after its prefill. Cycle c runs the
    unit in `inbox` (received in cycle c - 1; before cycle 0 from rank 0 at stage 0, a dead unit
    elsewhere), sends rank 0 its snap and the next stage the unit with its output rows, and
    receives cycle c + 1's unit into `inbox`, all waited for within the cycle: so every cycle
    but the last (which sends no unit on and receives none) is the same work, which a CUDA graph
    replays with its messages under NCCL (spd.runtime.cycle_graph). On a CPU a dead unit (a
    bubble where nothing entered) skips its stage step (`peek`)."""

    def __init__(self, worker: StageWorker, req: dict):
        self.w, self.rt = worker, worker.rt
        t, s, n = worker.target, worker.s, worker.n
        self.d, self.dtype, dev = t.hidden_size, t.dtype, t.device
        self.ahead = int(req["ahead"])
        width = int(req.get("tree_width", 1))
        chain_greedy = bool(req.get("greedy", False)) and width == 1
        self.fmt = fmt = UnitFormat(n, width)
        self.step = StageStep(worker.stage, worker.layout, fmt, chain_greedy and worker.last)
        self.snapf = snap_format(worker.layout, s, output=not chain_greedy)
        self.inbox = (torch.zeros(fmt.size, dtype=torch.int64, device=dev) if worker.first
                      else torch.zeros(message_bytes(fmt, self.d, self.dtype), dtype=torch.uint8,
                                       device=dev))
        self.outbox = torch.zeros(message_bytes(fmt, self.d, self.dtype), dtype=torch.uint8,
                                  device=dev)
        self.snap = None
        if self.snapf.rows or worker.last:
            self.snap = torch.zeros(snap_bytes(self.snapf, width, self.d, self.dtype),
                                    dtype=torch.uint8, device=dev)
        if not worker.first:  # cycle 0's unit: a dead one past the first token's position
            head = split_message(self.inbox, fmt, self.d, self.dtype)[0]
            head.copy_(dead_unit(fmt, int(req["prompt_len"]) + s, int(req["capacity"]) - 1))
        # the `end` cycle c received: in the header it sends on (copied from the one it ran)
        self.end = split_message(self.outbox, fmt, self.d, self.dtype)[0][END:END + 1]
        self.ends = Published(self.ahead + 1, 1, dev)  # each cycle's `end`, for the host
        self.peek = torch.device(dev).type == "cpu" and not env.replay_check_enabled()
        self.graph = CycleGraph(lambda: self.cycle(last=False), dev, f"stage {s}'s cycle",
                                capturable=self.rt.backend == "nccl",
                                messages=self.rt.messages, thread_local=True)
        self.forward_s: list[float] = []  # per cycle, the host's time in the step or a replay
        self.step_s = 0.0
        self.fault = self.rt.fault_here()

    def cycle(self, last: bool) -> None:
        """One cycle (`last`: the final one, which sends no unit on and receives none)."""
        w, rt = self.w, self.rt
        if w.first:
            head, x = self.inbox, None
        else:
            head, x = split_message(self.inbox, self.fmt, self.d, self.dtype)
        out_head, out_rows = split_message(self.outbox, self.fmt, self.d, self.dtype)
        out_head.copy_(head)
        t0 = time.perf_counter()
        if self.peek and not peek(head[LIVE])[0]:
            self.step.skip(head)
        else:
            anchors, out, token = self.step.run(head, x)
            out_rows.copy_(out)
            if self.snap is not None:
                tok, rows = snap_views(self.snap, self.fmt.width, self.d, self.dtype)
                if token is not None:
                    tok.copy_(token)
                for i, a in enumerate(anchors):
                    rows[i].copy_(a)
                if self.snapf.with_output:
                    rows[-1].copy_(out)
        self.step_s = time.perf_counter() - t0
        sends = [] if self.snap is None else [(self.snap, DRAFT_RANK, SNAP_TAG)]
        if not w.last and not last:
            sends.append((self.outbox, w.next, UNIT_TAG))
        recvs = [] if last else [(self.inbox, DRAFT_RANK if w.first else w.prev, UNIT_TAG)]
        for work in rt.exchange(sends, recvs):
            rt.order(work, recvs[0][1], "cycle unit")
        rt.flush_sends(host=False)

    def launch(self, c: int, end: int | None) -> None:
        """Cycle c, then its `end` published for the host."""
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        t0, replays = time.perf_counter(), self.graph.replays
        if end is not None and c == end - 1:
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
            for work in rt.exchange([], [(self.inbox, DRAFT_RANK, UNIT_TAG)]):
                rt.order(work, DRAFT_RANK, "cycle unit")
        launched = drive(self.launch, lambda c: self.ends.read(c)[0] or None, self.ahead)
        rt.flush_sends()
        return launched


def messages_since(rt: Endpoint, before: dict) -> dict[str, int]:
    """Messages `rt` posted since `before` (a copy of Endpoint.messages), keyed "send/data"."""
    return {f"{a}/{b}": rt.messages[a, b] - before.get((a, b), 0) for a, b in rt.messages}


def wait_request(rt: Endpoint, gen: int) -> dict:
    """Idle stage ranks wait here (the store, no communication timeout); faults end the process
    through the watchdog. A request not signed with the run's secret is ignored (logged once)
    until rank 0's own replaces it."""
    key = f"req/{gen}"
    while True:
        try:
            rt.store.wait([key], _td(3600))
            req = rt.signer.open(key, rt.store.get(key))
            if req is not None:
                return req
            time.sleep(0.1)  # a forged request: poll until rank 0 writes the real one
        except Exception as exc:  # store wait timed out after an hour idle: keep waiting
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise
