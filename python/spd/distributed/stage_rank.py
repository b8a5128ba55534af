"""A stage rank (rank s + 1): its layers, its KV cache and the cycle loop of stage s."""
from __future__ import annotations

import json
import time

import torch

from spd.distributed.config import DRAFT_RANK, role_name
from spd.distributed.device_cycle import StageCycles, messages_since
from spd.distributed.emulate import make_stage
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import (
    HEADER_TAG,
    JUDGE_TAG,
    PREFILL_TAG,
    SNAP_TAG,
    STOP,
    UNIT,
    UNIT_BYTES,
    UNIT_TAG,
    VERDICT_SIZE,
    VERDICT_TAG,
    Ring,
    SnapFormat,
    TreeUnitFormat,
    UnitMessage,
    row_bytes,
    snap_format,
)
from spd.distributed.transport import Endpoint, _td
from spd.errors import InternalError
from spd.model.partition import DepthLayout
from spd.model.target import Stage
from spd.runtime.sequence import PhaseTimer


class StageWorker:
    """Stage s = role s + 1: its layers, its KV cache, and the unit loop of one stage."""

    def __init__(self, rt: Endpoint, target, layout: DepthLayout):
        self.rt, self.target, self.layout = rt, target, layout
        self.s = rt.rank - 1
        self.n = layout.n
        self.first = self.s == 0
        self.last = self.s == self.n - 1
        self.stage: Stage | None = None
        self.prev, self.next = rt.rank - 1, rt.rank + 1
        self.source = DRAFT_RANK if self.first else self.prev  # where its units come from

    def serve(self) -> None:
        gen = 0
        while True:
            gen += 1
            req = wait_request(self.rt, gen)
            if req["op"] == "shutdown":
                return
            self.run(gen, req)

    def _snap(self, fmt: SnapFormat, outs: list[torch.Tensor], into: Ring | None = None):
        """This stage's snap for rank 0 (protocol.SnapFormat) from its layers' outputs [T, d]
        each: [rows, T, d], stacked into the next buffer of `into` when given (decode: T = 1)."""
        first = self.stage.layer_ids.start
        rows = [outs[b - first - 1] for b in fmt.hidden] + ([outs[-1]] if fmt.with_output else [])
        if not rows:
            return None
        return torch.stack(rows) if into is None else torch.stack(rows, out=into.take())

    def _forward_unit(self, h: torch.Tensor, pos: torch.Tensor, draft: torch.Tensor | None):
        """One unit: row h [1, d] at position pos [1] int64, both where the data arrived (no host
        read: Stage.run at a device position). draft [1] (last stage, greedy): also judge it.
        -> (every layer's output [1, d], verdict (token [1], ok [1]) or None)."""
        return self.stage.run(h, pos, draft)

    def _forward_tree_unit(self, fmt: TreeUnitFormat, h: torch.Tensor, meta: torch.Tensor):
        """A tree unit: its commits into this stage's cache, then its rows h [W, d] (all on the
        device) -> every layer's output [W, d]."""
        f = fmt.fields(meta)
        self.stage.commit_rows(f["commit_pos"], f["commit_slot"])
        return self.stage.tree_run(h, f["position"], f["slots"], f["prefix_len"], f["keys"],
                                   f["mask"])

    @torch.no_grad()
    def run(self, gen: int, req: dict) -> None:
        rt, t = self.rt, self.target
        phases: dict[str, float] = {}
        timer = PhaseTimer(phases)
        cap = int(req["capacity"])
        greedy = bool(req.get("greedy", False))
        width = int(req.get("tree_width", 1))
        # a token tree's units (protocol.TreeUnitFormat): W rows each, rank 0 judges
        tree = TreeUnitFormat.of(self.n, width) if width > 1 else None
        if self.stage is None or self.stage.cache.capacity < cap:
            self.stage = make_stage(t, self.s, self.layout.stages[self.s], cap, rt.config)
        self.stage.cache.truncate(0)
        d, dev = t.hidden_size, t.device
        # Prefill: the whole prompt through this stage as one chunk.
        t0 = time.perf_counter()
        if self.first:
            h = t.embed_tokens(torch.tensor(req["prompt_ids"], dtype=torch.int64, device=dev))
        else:
            h = torch.empty(int(req["prompt_len"]), d, dtype=t.dtype, device=dev)
            rt.wait(rt.irecv(h, self.prev, PREFILL_TAG), self.prev, "prefill input")
        outs, _ = self.stage.run(h, 0)
        snap = self._snap(snap_format(self.layout, self.s, greedy=greedy, prefill=True), outs)
        if snap is not None:
            rt.isend(snap, DRAFT_RANK, SNAP_TAG)
        if not self.last:
            rt.isend(outs[-1].contiguous(), self.next, PREFILL_TAG)
        rt.flush_sends()
        prefill_s = time.perf_counter() - t0
        if req.get("device_loop"):  # every cycle the same fixed work (spd.distributed.device_cycle)
            cycles = StageCycles(self, req)
            counted = dict(rt.messages)
            t_dec = time.perf_counter()
            ran = cycles.run()
            self._report(gen, prefill_s, time.perf_counter() - t_dec, phases, cycles.forward_s,
                         cycles=ran, messages=messages_since(rt, counted),
                         graph=cycles.graph.describe())
            return
        # Decode: one unit message (protocol) per unit from its source (stage 0: rank 0).
        # gloo: one message per unit (header and payload folded), its receive posted a unit
        # ahead (gloo matches per tag). NCCL: the header on gloo, the payload on NCCL, which
        # matches a pair's messages in posting order whatever the tag, and where a pending
        # receive holds up the pair's later sends (this stage's snaps to rank 0): there a
        # payload receive is posted once its header is in, the judge draft's when it is needed
        # (no host wait: the header is host data).
        folded = rt.backend == "gloo"
        src = self.source
        in_bytes = UNIT_BYTES if self.first else row_bytes(d, t.dtype)
        out_bytes = row_bytes(d, t.dtype)
        if tree is not None:
            in_bytes = tree.meta_bytes if self.first else tree.row_bytes(d, t.dtype)
            out_bytes = tree.row_bytes(d, t.dtype)
        per_unit = 1 if tree is None else width

        # Rings (protocol.Ring), so no unit allocates. Receives: the unit in hand and the next
        # one posted (ahead, or once its header is in): 2 (the judge draft's likewise). Sends:
        # this unit's, and the unit before's, flushed only after this unit's are posted
        # (flush_sends(before=unit)): 2. Each ring checks its buffer is free when it comes round.
        sent = lambda m, _: rt.sending(m.data) or rt.sending(m.header)  # noqa: E731
        inbox = Ring(lambda: UnitMessage(in_bytes, dev, folded), 2, "unit receives",
                     lambda m, _: m.busy)
        outbox = Ring(lambda: UnitMessage(out_bytes, dev, folded), 2, "unit sends", sent)
        fmt = snap_format(self.layout, self.s, greedy=greedy)
        snap_ring = Ring(lambda: torch.empty(fmt.rows, per_unit, d, dtype=t.dtype, device=dev), 2,
                         "snap sends", lambda b, _: rt.sending(b))
        verdict_ring = Ring(lambda: torch.empty(VERDICT_SIZE, dtype=torch.int64, device=dev), 2,
                            "verdict sends", lambda b, _: rt.sending(b))
        judges = Ring(lambda: UnitMessage(UNIT_BYTES, dev, folded), 2, "judge receives",
                      lambda m, _: m.busy)

        def post():  # the next unit's message: all of it when folded, else its header
            msg = inbox.take()
            msg.busy = True
            return msg, rt.irecv(msg.data if folded else msg.header, src,
                                 UNIT_TAG if folded else HEADER_TAG)
        msg, hwork = post()

        def send_unit(op: int, seq: int, position=None, row=None, epoch: int = 0):
            out = outbox.take()
            out.set_header(op, seq)
            if row is not None and tree is not None:
                out.write_tree(position, row)  # a tree unit: its fields, then its rows
            elif row is not None:
                out.write_row(position, row)
            rt.isend(out.data, self.next, UNIT_TAG, epoch)
            if not folded:
                rt.isend(out.header, self.next, HEADER_TAG, epoch)

        def next_judge():
            m = judges.take()
            m.busy = True
            return m
        judge_msg = next_judge() if self.last and greedy else None
        post_judge = lambda: rt.irecv(judge_msg.data, DRAFT_RANK, JUDGE_TAG)  # noqa: E731
        judge = post_judge() if judge_msg is not None and folded else None
        fwd: list[float] = []
        fault = rt.fault_here()
        t_dec = time.perf_counter()
        while True:
            unit = len(fwd)
            with timer("wait_input"):
                rt.wait(hwork, src, "unit message" if folded else "unit header")
                op, seq = msg.header.tolist()  # host memory (protocol): no device wait
                if not folded:
                    rt.wait(rt.irecv(msg.payload, src, UNIT_TAG), src, "unit")  # on a GPU:
                    # orders this stream after the payload
            if op == STOP:
                break
            if op != UNIT or seq != unit:
                raise InternalError("a unit header out of step", stage=self.s, header=[op, seq],
                                    source_rank=src, expected_unit=unit)
            msg.landed()
            cur = msg
            msg, hwork = post()  # the next unit's, posted before this one runs
            if fault and unit + 1 == fault["cycle"]:
                inject_fault(fault)
            if tree is not None:
                pos, h = cur.tree(tree, 0 if self.first else d, t.dtype)  # pos: the fields
                if self.first:
                    h = t.embed_tokens(tree.fields(pos)["tokens"])
            elif self.first:
                pos, token = cur.unit()
                h = t.embed_tokens(token)
            else:
                pos, h = cur.row(d, t.dtype)
            draft = None
            if judge_msg is not None:  # the draft after this unit: the next unit's token
                with timer("wait_input"):
                    rt.wait(judge if judge is not None else post_judge(), DRAFT_RANK,
                            "draft to judge")
                judge_msg.landed()
                judged, draft = judge_msg, judge_msg.unit()[1]
                judge_msg = next_judge()
                judge = post_judge() if folded else None
            tf = time.perf_counter()
            if tree is not None:
                outs, verdict = self._forward_tree_unit(tree, h, pos), None
            else:
                outs, verdict = self._forward_unit(h, pos, draft)
            fwd.append(time.perf_counter() - tf)
            with timer("send"):
                snap = self._snap(fmt, outs, snap_ring)
                if snap is not None:
                    rt.isend(snap, DRAFT_RANK, SNAP_TAG, unit)
                if verdict is not None:
                    token, ok = verdict
                    both = verdict_ring.take()
                    both[:1].copy_(token.view(1))
                    both[1:].copy_(ok.view(1))
                    rt.isend(both, DRAFT_RANK, VERDICT_TAG, unit)
                if not self.last:
                    send_unit(UNIT, unit, pos, outs[-1], unit)
                rt.flush_sends(before=unit)
            cur.busy = False  # its data is copied out (or queued to be, on this stream)
            if draft is not None:
                judged.busy = False
        decode_s = time.perf_counter() - t_dec
        if not self.last:  # pass the stop on (protocol)
            send_unit(STOP, len(fwd))
        if judge_msg is not None:  # rank 0 sent one draft past the last unit: receive it
            rt.wait(judge if judge is not None else post_judge(), DRAFT_RANK,
                    "draft to judge")
        rt.flush_sends()
        self._report(gen, prefill_s, decode_s, phases, fwd)

    def _report(self, gen: int, prefill_s: float, decode_s: float, phases: dict,
                fwd: list[float], **extra) -> None:
        """This rank's stats of generation `gen`, for rank 0 (the store)."""
        rt = self.rt
        phases["forward"] = sum(fwd)
        rt.store.set(f"stats/{gen}/{rt.rank}", json.dumps(
            {"rank": rt.rank, "role": role_name(rt.rank),
             "layers": [self.stage.layer_ids.start, self.stage.layer_ids.stop],
             "prefill_s": prefill_s, "decode_s": decode_s, "phase_s": phases, "forward_s": fwd,
             **extra}))


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
