"""Several sequences through the distributed pipeline at once (issue 54): a batch session.

Rank 0 holds a slot per sequence (its Sequence, drafter and Cycle, as spd.runtime.batch_spd),
each stage rank its layers' KV rows for every slot ([slots, layers, kv_heads, context,
head_dim]). A session's cycle is one cycle of every slot, in lock-step across the ranks:

  messages  A unit message carries all B slots' units: the control field (the pause cycle, 0
            while none is set), B unit headers [B, H] (spd.runtime.unit), then B x W rows
            (rank 0 -> stage 0: the control field and the headers only). A snap is B snaps:
            each slot's greedy verdict [B] int64, then rows [B, R, W, d] (spd.distributed.messages'
            rows, a slot after the other). Sizes are fixed for the session: a free slot sends a
            dead unit at its trash row (a bubble: a CPU skips its stage step, as it skips any
            dead unit; a GPU runs it, at rows nothing reads), so the stage ranks never know which
            slots are in use.
  pause     Joins need every rank between cycles. Rank 0 sets the pause cycle P = L + n + ahead
            + 1 (L: the next cycle it launches, whose message first carries P), which reaches
            every stage before it launches cycle P - 1, so every rank runs exactly the cycles
            before P, with every message of each (units in flight stay in the stage ranks'
            inboxes; stage 0 alone does not receive in cycle P - 1: it receives rank 0's cycle-P
            message when the cycles resume). Rank 0 pauses when sequences wait and a slot is
            free, or when nothing runs.
  control   Between cycles every rank reads the next control request from the store:
            {"op": "joins", "joins": [{slot, prompt_ids, prompt_len}], "run": bool} (each
            joiner's prompt through the ranks into its slot's rows, then, with "run", the cycles
            from where they paused up to the next pause), or {"op": "end"} (the session ends;
            each stage rank writes its figures to the store).
  slots     A sequence that ends or leaves turns its slot's units dead at once, from rank 0's
            side (trash-row bubbles from the next cycle). A slot is joined again only once every
            unit in flight for it is such a bubble (it was freed n - 1 cycles before the pause
            or more): a unit of the old sequence could otherwise write K/V rows of the new
            prompt. So a sequence joins n + ahead + 1 cycles after a slot is free (the pause
            after, where its slot was freed after that pause was set).

This module: the messages' layout and the stage ranks' side (it imports nothing of rank 0's);
rank 0's: spd.distributed.session (the protocol), batch_draft (SPD's DistributedBatch),
batch_pipeline (the pipeline without speculation, DistributedPipeline).

With the draft on stage S (--draft-on-stage), rank 0's process runs stage S inside its cycle
(batch_draft.LocalStage): it takes its units from rank 0's own message (S = 0) or from stage
S - 1, sends them on to stage S + 1 as a stage rank would, and keeps its rows where they live
(no snap): the stage ranks cannot tell.

Each sequence's output is its decode alone: the same N, K and judged/accepted drafts, greedy
equal to AR, seeded sampling equal to alone. Chains and token trees (W rows a unit), dense
targets; not under emulated compute.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from spd import env
from spd.distributed.config import DRAFT_RANK
from spd.distributed.faults import inject_fault
from spd.distributed.messages import SNAP_TAG, UNIT_TAG, snap_format
from spd.distributed.stage_rank import prefill, wait_request
from spd.errors import InternalError
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.driver import Published, peek
from spd.runtime.slot_stage import SlotStage
from spd.runtime.unit import LIVE, UnitFormat, dead_unit

CTRL = 1  # int64 fields in front of a batch unit message: the pause cycle (0: none set)


# --- messages ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchFormat:
    """A batch unit message of `slots` units of format `unit`."""
    unit: UnitFormat
    slots: int

    @property
    def ints(self) -> int:
        """The int64 fields: the control field, then every slot's header."""
        return CTRL + self.slots * self.unit.size

    def message_bytes(self, d: int, dtype: torch.dtype) -> int:
        return self.ints * 8 + self.slots * self.unit.row_bytes(d, dtype)

    def split(self, buf: torch.Tensor, d: int, dtype: torch.dtype):
        """A message -> (control [CTRL], headers [B, H], rows [B, W, d], or None for the int64
        message rank 0 sends stage 0)."""
        B, H, W = self.slots, self.unit.size, self.unit.width
        if buf.dtype == torch.int64:
            return buf[:CTRL], buf[CTRL:].view(B, H), None
        ints = buf[:self.ints * 8].view(torch.int64)
        return ints[:CTRL], ints[CTRL:].view(B, H), buf[self.ints * 8:].view(dtype).view(B, W, d)


def batch_snap_bytes(rows: int, slots: int, width: int, d: int, dtype: torch.dtype) -> int:
    return 8 * slots + slots * rows * width * d * torch.empty((), dtype=dtype).element_size()


def batch_snap_views(buf: torch.Tensor, slots: int, width: int, d: int, dtype: torch.dtype):
    """A batch snap (uint8) -> (each slot's argmax [B] int64, rows [B, R, W, d])."""
    return (buf[:8 * slots].view(torch.int64),
            buf[8 * slots:].view(dtype).view(slots, -1, width, d))


def session_formats(layout, output: bool, anchors: bool = True) -> list:
    """Each stage's snap format in a session (`output`: the last stage sends its output rows:
    a session with sampled sequences or token trees; `anchors`: the stages send their anchor
    rows, for a drafter)."""
    return [snap_format(layout, s, output=output, anchors=anchors) for s in range(layout.n)]


# --- a stage rank's side -----------------------------------------------------------------------
class LiveStep:
    """A stage's step over the units of a batch message (every slot's): on a CPU the live ones
    alone (a dead unit of a token tree still commits, as StageStep.skip), elsewhere every one
    (the same work every cycle)."""

    def __init__(self, caches: SlotStage, fmt: UnitFormat, slots: int, peeks: bool, device):
        self.caches, self.fmt, self.B, self.peeks = caches, fmt, slots, peeks
        self.all = torch.arange(slots, device=device)
        self._index: dict[tuple, torch.Tensor] = {}

    def _slots(self, run: tuple[int, ...]) -> torch.Tensor:
        if len(run) == self.B:
            return self.all
        got = self._index.get(run)
        if got is None:
            if len(self._index) >= 256:
                self._index.clear()
            got = self._index[run] = torch.tensor(run, device=self.all.device)
        return got

    def __call__(self, heads: torch.Tensor, x: torch.Tensor | None):
        """heads [B, H], x [B, W, d] (None: stage 0) -> (the slots run: a tuple, and [R] on the
        device; their rows' layer outputs, each [R * W, d]) or None where none runs."""
        f, c = self.fmt, self.caches
        live = peek(heads[:, LIVE]) if self.peeks else None
        run = tuple(b for b in range(self.B) if live is None or live[b])
        if f.tree:  # a dead unit skipped still carries its commit (StageStep.skip)
            for b in sorted(set(range(self.B)) - set(run)):
                c.commit(b, heads[b])
        if not run:
            return None
        idx = self._slots(run)
        if len(run) < self.B:
            heads = heads.index_select(0, idx)
            x = None if x is None else x.index_select(0, idx)
        return run, idx, c.run(f, run, idx, heads, x)


class BatchSession:
    """A stage rank's side of a batch session (module docstring): its slot caches (kept by the
    worker for the next session when big enough), the control requests, the cycles."""

    def __init__(self, worker, req: dict):
        self.w, self.rt = worker, worker.rt
        B, context = int(req["slots"]), int(req["context"])
        caches = getattr(worker, "batch_caches", None)
        if caches is None or not caches.fits(B, context):
            worker.batch_caches = None  # (freed before the new ones are made)
            caches = worker.batch_caches = SlotStage(worker.target, worker.layout, worker.s,
                                                     B, context)
        self.caches = caches
        self.cycles = BatchStageCycles(worker, caches, req)
        self.at = 0  # the next cycle
        self.prefill_s = 0.0

    def serve(self, gen: int) -> int:
        """Control requests after the session's (gen) until its end -> the last gen read."""
        rt, w = self.rt, self.w
        while True:
            gen += 1
            req = wait_request(rt, gen)
            op = req["op"]
            if op == "end":
                c = self.cycles
                rt.store.set(f"stats/{gen}/{rt.rank}", json.dumps(
                    {"rank": rt.rank, "cycles": self.at, "prefill_s": self.prefill_s,
                     "forward_s": sum(c.forward_s), "graph": c.graph.describe()}))
                return gen
            if op != "joins":
                raise InternalError("an unknown request in a batch session", op=op)
            t0 = time.perf_counter()
            for j in req["joins"]:
                prefill(rt, self.caches.view(int(j["slot"])), w.layout, j, keep=None)
            self.prefill_s += time.perf_counter() - t0
            if req["run"]:
                if int(req["cycle"]) != self.at:
                    raise InternalError("rank 0 and a stage rank disagree on the cycle",
                                        rank0=req["cycle"], here=self.at)
                self.at = self.cycles.run(self.at)


class BatchStageCycles:
    """A stage rank's batch cycles: cycle c runs the message in `inbox` (every slot's unit;
    on a CPU the live ones alone), sends rank 0 its snap and the next stage the units with
    their output rows, and receives cycle c + 1's message, all waited for within the cycle:
    every cycle is the same work (one CUDA graph under NCCL), but stage 0's last before a
    pause, which receives nothing."""

    def __init__(self, worker, caches: SlotStage, req: dict):
        self.w, self.rt, self.caches = worker, worker.rt, caches
        t, s, n = worker.target, worker.s, worker.n
        self.t, self.s, self.n = t, s, n
        self.d, self.dtype, dev = t.hidden_size, t.dtype, t.device
        self.B, context = int(req["slots"]), int(req["context"])
        self.ahead = int(req["ahead"])
        W = int(req["tree_width"])
        self.fmt = UnitFormat(n, W)
        self.bfmt = BatchFormat(self.fmt, self.B)
        self.judge = bool(req["judge"]) and W == 1 and worker.last
        self.snapf = session_formats(worker.layout, bool(req["output"]),
                                     bool(req.get("anchors", True)))[s]
        self.anchor_layers = [b - caches.layers.start - 1 for b in self.snapf.hidden]
        size = self.bfmt.message_bytes(self.d, self.dtype)
        self.inbox = (torch.zeros(self.bfmt.ints, dtype=torch.int64, device=dev) if worker.first
                      else torch.zeros(size, dtype=torch.uint8, device=dev))
        self.outbox = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.snap = None
        if self.snapf.rows or worker.last:
            self.snap = torch.zeros(batch_snap_bytes(self.snapf.rows, self.B, W, self.d,
                                                     self.dtype), dtype=torch.uint8, device=dev)
        # before the first cycle: every slot a bubble at its trash row (a free slot's unit)
        self.dead = dead_unit(self.fmt, context - 1, context - 1).to(dev)
        if not worker.first:
            self.bfmt.split(self.inbox, self.d, self.dtype)[1].copy_(self.dead)
        self._none: dict[int, torch.Tensor] = {}
        self.pause = torch.zeros(1, dtype=torch.int64, device=dev)  # the cycle's pause field
        self.pauses = Published(self.ahead + 1, 1, dev)
        self.step = LiveStep(caches, self.fmt, self.B, torch.device(dev).type == "cpu"
                             and not env.replay_check_enabled(), dev)
        self.graph = CycleGraph(lambda: self.cycle(last=False), dev,
                                f"stage {s}'s batch cycle", capturable=self.rt.backend == "nccl",
                                messages=self.rt.messages, thread_local=True)
        self.forward_s: list[float] = []
        self.fault = self.rt.fault_here()  # the test hook (DistConfig.fault)

    def cycle(self, last: bool) -> None:
        """One cycle (`last`: stage 0's last before a pause, which receives nothing)."""
        w, rt, t = self.w, self.rt, self.t
        ctrl, heads, x = self.bfmt.split(self.inbox, self.d, self.dtype)
        self.pause.copy_(ctrl)
        out_ctrl, out_heads, out_rows = self.bfmt.split(self.outbox, self.d, self.dtype)
        out_ctrl.copy_(ctrl)
        out_heads.copy_(heads)
        t0 = time.perf_counter()
        got = self.step(heads, x)
        if got is not None:
            _, idx, outs = got
            W, R = self.fmt.width, idx.numel()
            out = outs[-1]
            out_rows.index_copy_(0, idx, out.view(R, W, -1))
            if self.snap is not None:
                tok, rows = batch_snap_views(self.snap, self.B, W, self.d, self.dtype)
                for i, layer in enumerate(self.anchor_layers):
                    rows[:, i].index_copy_(0, idx, outs[layer].view(R, W, -1))
                if self.snapf.with_output:
                    rows[:, -1].index_copy_(0, idx, out.view(R, W, -1))
                if self.judge:
                    none = self._none.get(R)
                    if none is None:  # (made once per row count: no Python value a cycle)
                        none = self._none[R] = torch.full((R,), -1, dtype=torch.int64,
                                                          device=out.device)
                    verdict = t.verify_greedy(out, none)[0]
                    tok.index_copy_(0, idx, verdict)
        self.forward_s.append(time.perf_counter() - t0)
        sends = [] if self.snap is None else [(self.snap, DRAFT_RANK, SNAP_TAG)]
        if not w.last:
            sends.append((self.outbox, w.next, UNIT_TAG))
        recvs = [] if last else [(self.inbox, DRAFT_RANK if w.first else w.prev, UNIT_TAG)]
        for work in rt.exchange(sends, recvs):
            rt.order(work, recvs[0][1], "batch cycle unit")
        rt.flush_sends(host=False)

    def launch(self, c: int, pause: int | None) -> None:
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        if self.w.first and pause is not None and c == pause - 1:
            self.cycle(last=True)
        else:
            self.graph.launch()
        self.pauses.publish(c, self.pause)

    def run(self, start: int) -> int:
        """The cycles from `start` up to the pause (a pause field > start, read `ahead` cycles
        late, as spd.runtime.driver.drive reads the end) -> the pause cycle."""
        rt = self.rt
        if self.w.first:  # the resumed cycle's message
            for work in rt.exchange([], [(self.inbox, DRAFT_RANK, UNIT_TAG)]):
                rt.order(work, DRAFT_RANK, "batch cycle unit")
        launched = nread = start
        pause: int | None = None
        while pause is None or launched < pause:
            limit = pause if pause is not None else nread + self.ahead + 1
            while launched < limit:
                self.launch(launched, pause)
                launched += 1
            if pause is not None:
                break
            got = self.pauses.read(nread)[0]
            nread += 1
            if got > start:
                if launched >= got:
                    raise InternalError("the pause cycle was read too late", pause=got,
                                        launched=launched)
                pause = got
        rt.flush_sends()
        return launched


__all__ = ["BatchFormat", "BatchSession", "BatchStageCycles", "LiveStep", "batch_snap_bytes",
           "batch_snap_views", "session_formats"]
