"""A stage rank (rank s + 1): its layers, its KV cache and the cycle loop of stage s."""
from __future__ import annotations

import json
import time
from typing import NamedTuple

import torch

from spd.distributed.config import DRAFT_RANK, role_of
from spd.distributed.emulate import make_stage
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import ControlMessage, Op, ctrl_tag, hidden_tag, snap_tag
from spd.distributed.transport import Runtime, _td
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.model.target import Stage
from spd.runtime.sequence import PhaseTimer


class InputRecv(NamedTuple):
    """The previous stage's output, a receive posted one cycle before this stage needs it."""
    work: object
    buf: torch.Tensor


class StageWorker:
    """Stage s = rank s + 1: its layers, its KV cache, and the cycle loop of one stage."""

    def __init__(self, rt: Runtime, target, layout: DepthLayout):
        self.rt, self.target, self.layout = rt, target, layout
        self.s = rt.rank - 1
        self.n = layout.n
        self.first = self.s == 0
        self.last = self.s == self.n - 1
        self.snap_idx = [b for _, b in layout.anchors_of_stage(self.s)]
        self.stage: Stage | None = None
        self.prev, self.next = rt.rank - 1, rt.rank + 1

    def serve(self) -> None:
        gen = 0
        while True:
            gen += 1
            req = wait_request(self.rt, gen)
            if req["op"] == "shutdown":
                return
            self.run(gen, req)

    def _forward(self, h: torch.Tensor, pos: int):
        snaps: dict[int, torch.Tensor] = {}
        want = set(self.snap_idx)

        def record(idx, x):
            if idx in want:
                snaps[idx] = x
        out = self.stage.forward(h, pos, record)
        rows = [snaps[b] for b in self.snap_idx] + ([out] if self.last else [])
        return out, (torch.stack(rows).contiguous() if rows else None)

    def _send(self, out, snap, cycle: int) -> None:
        if snap is not None:
            self.rt.isend(snap, DRAFT_RANK, snap_tag(cycle), cycle)
        if not self.last:
            self.rt.isend(out.contiguous(), self.next, hidden_tag(cycle), cycle)

    @torch.no_grad()
    def run(self, gen: int, req: dict) -> None:
        rt, t = self.rt, self.target
        phases: dict[str, float] = {}
        timer = PhaseTimer(phases)
        cap = int(req["capacity"])
        if self.stage is None or self.stage.cache.capacity < cap:
            self.stage = make_stage(t, self.s, self.layout.stages[self.s], cap, rt.config)
        self.stage.cache.truncate(0)
        d, dev = t.hidden_size, t.device
        ctrl = ControlMessage.buffer()
        seq = 1  # control messages alternate tags by their sequence number (a cycle may be redone)
        ctrl_work = rt.irecv(ctrl, DRAFT_RANK, ctrl_tag(seq))
        # Prefill: the whole prompt through this stage as one chunk.
        t0 = time.perf_counter()
        if self.first:
            h = t.embed_tokens(torch.tensor(req["prompt_ids"], dtype=torch.int64, device=dev))
        else:
            h = torch.empty(int(req["prompt_len"]), d, dtype=t.dtype, device=dev)
            rt.wait(rt.irecv(h, self.prev, hidden_tag(0)), self.prev, "prefill input")
        out, snap = self._forward(h, 0)
        self._send(out, snap, 0)
        rt.flush_sends()
        prefill_s = time.perf_counter() - t0
        fwd: list[float] = []  # per cycle (of a redone cycle, the attempt that counted)
        wasted = 0.0
        last_cycle = 0
        pending: InputRecv | None = None  # the previous stage's output of the last cycle
        fault = rt.config.fault if rt.config.fault and rt.config.fault["rank"] == rt.rank else None
        t_dec = time.perf_counter()
        while True:
            with timer("wait_ctrl"):
                rt.wait(ctrl_work, DRAFT_RANK, "control message")
            msg = ControlMessage.from_tensor(ctrl)
            if msg.op is Op.STOP:
                break
            cycle = msg.cycle
            ctrl = ControlMessage.buffer()  # the next one, posted ahead
            seq += 1
            ctrl_work = rt.irecv(ctrl, DRAFT_RANK, ctrl_tag(seq))
            redo = cycle == last_cycle  # rank 0 announced this cycle on an optimistic accept
            last_cycle = cycle          # and the draft was rejected: the same cycle, redone
            if fault and cycle == fault["cycle"]:
                inject_fault(fault)
            incoming = None  # the previous stage works this cycle: its output is ours next cycle
            if not self.first and msg.works(self.s - 1):
                buf = torch.empty(1, d, dtype=t.dtype, device=dev)
                incoming = InputRecv(rt.irecv(buf, self.prev, hidden_tag(cycle)), buf)
            if msg.truncate_to is not None:
                with timer("rollback"):
                    self.stage.cache.truncate(msg.truncate_to)
            if msg.works(self.s):
                pos = msg.position(self.s)
                if self.first:
                    h = t.embed_tokens(torch.tensor([msg.token], dtype=torch.int64, device=dev))
                else:
                    if pending is None:
                        raise SPDError(f"internal: stage {self.s} has work at cycle {cycle} but "
                                       "no input was announced")
                    with timer("wait_input"):
                        rt.wait(pending.work, self.prev, "hidden state")
                    h = pending.buf
                tf = time.perf_counter()
                out, snap = self._forward(h, pos)
                took = time.perf_counter() - tf
                with timer("send"):
                    self._send(out, snap, cycle)
            else:
                took = 0.0
                if pending is not None:  # dropped by a rollback: receive it and discard it
                    with timer("wait_input"):
                        rt.wait(pending.work, self.prev, "hidden state")
            if redo:  # the first attempt's forward was wasted work
                wasted += fwd[-1]
                fwd[-1] = took
            else:
                fwd.append(took)
            pending = incoming
            with timer("send"):
                rt.flush_sends(before=cycle)
        decode_s = time.perf_counter() - t_dec
        if pending is not None:
            rt.wait(pending.work, self.prev, "hidden state")
        rt.flush_sends()
        phases["forward"] = sum(fwd)
        phases["forward_redone"] = wasted
        rt.store.set(f"stats/{gen}/{rt.rank}", json.dumps(
            {"rank": rt.rank, "role": role_of(rt.rank),
             "layers": [self.stage.layer_ids.start, self.stage.layer_ids.stop],
             "prefill_s": prefill_s, "decode_s": decode_s, "phase_s": phases, "forward_s": fwd}))


def wait_request(rt: Runtime, gen: int) -> dict:
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
