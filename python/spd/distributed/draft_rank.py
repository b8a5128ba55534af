"""The draft rank (rank 0): drafting, verification and control, with its CUDA streams."""
from __future__ import annotations

import json
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable

import torch

from spd.distributed.config import SpeculationPolicy
from spd.distributed.emulate import wrap_drafter
from spd.distributed.faults import inject_fault
from spd.distributed.protocol import ControlMessage, Op, ctrl_tag, snap_tag
from spd.distributed.stats import DistributedDecodeStats, breakdown
from spd.distributed.transport import Runtime
from spd.runtime.engine import GenerationResult, SamplingParams, SPDEngine
from spd.runtime.schedule import PipelineSchedule
from spd.runtime.sequence import SequenceDecode, check_prompt


class DraftRankStreams:
    """Rank 0's CUDA streams: snaps are waited for and scattered into the anchor buffer on
    `recv`, the PDM drafts on `draft`, verification and bookkeeping stay on the default stream.
    Cross-stream order goes through wait_stream (recorded events), so the steady state never
    synchronises the device; the host waits only for the values it needs (the draft id for the
    control message, the verdict). With NCCL the receives themselves run on NCCL's streams and
    `work.wait()` orders `recv` after them. On a CPU every method is a no-op."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.recv = torch.cuda.Stream(device)
            self.draft = torch.cuda.Stream(device)

    def receiving(self):
        return torch.cuda.stream(self.recv) if self.cuda else nullcontext()

    def drafting(self):
        if not self.cuda:
            return nullcontext()
        self.draft.wait_stream(self.recv)  # the features received so far
        self.draft.wait_stream(self.main)  # tokens entered, rollbacks
        return torch.cuda.stream(self.draft)

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


class SnapState(Enum):
    POSTED = "posted"        # its receive is posted; the rows go into the anchor buffer
    DISCARD = "discard"      # work of a cycle announced ahead and then redone: receive, drop
    RECEIVED = "received"    # received (and stored, unless discarded): nothing left to do


@dataclass
class SnapRecv:
    """One stage's snap message of one cycle that rank 0 has posted a receive for."""
    stage: int
    pos: int            # the first position its rows belong to
    buf: torch.Tensor   # (rows of the stage, positions, hidden): anchors, then the last output
    work: object        # the posted receive
    state: SnapState = SnapState.POSTED


class DistributedSPDEngine:
    """Rank 0's side of the distributed engine: `generate` has `SPDEngine.generate`'s contract."""

    def __init__(self, rt: Runtime, engine: SPDEngine):
        self.rt = rt
        self.engine = engine
        self.target = engine.target
        self.layout = engine.layout
        self.n = engine.n
        self._gen = 0
        lay = self.layout
        # Rows of stage s's snap message: its anchors (slots), then (last stage) its output.
        self.snap_slots = [[j for j, _ in lay.anchors_of_stage(s)] for s in range(self.n)]
        self.snap_rows = [len(sl) + (1 if s == self.n - 1 else 0)
                          for s, sl in enumerate(self.snap_slots)]
        self._ctrl_seq = 0

    def _request(self, payload: dict) -> int:
        self._gen += 1
        key = f"req/{self._gen}"
        self.rt.store.set(key, self.rt.signer.seal(key, payload))  # signed: it can stop the run
        return self._gen

    def shutdown(self) -> None:
        self._request({"op": "shutdown"})

    def _send_ctrl(self, msg: ControlMessage) -> None:
        rt = self.rt
        rt.flush_sends(before=msg.cycle - 1)  # the stages posted those receives long ago
        self._ctrl_seq += 1
        for s in range(self.n):
            rt.isend(msg.to_tensor(), s + 1, ctrl_tag(self._ctrl_seq), msg.cycle)

    def _announce(self, cycle: int, sched: PipelineSchedule, truncate_to: int | None,
                  token: int) -> list[SnapRecv]:
        """Send cycle `cycle`'s control message for window `sched` and post receives for the
        snaps its work will send."""
        self._send_ctrl(ControlMessage(Op.CYCLE, cycle, sched.start, sched.count, truncate_to,
                                       token))
        return self._post_snaps(sorted(sched.stage_work()), cycle)

    def _post_snaps(self, work: list[tuple[int, int]], cycle: int,
                    rows: int = 1) -> list[SnapRecv]:
        """Post receives for the snaps of (stage, first position) pairs; rows per position."""
        t = self.target
        out = []
        for s, pos in work:
            if self.snap_rows[s]:
                buf = torch.empty(self.snap_rows[s], rows, t.hidden_size, dtype=t.dtype,
                                  device=t.device)
                out.append(SnapRecv(s, pos, buf, self.rt.irecv(buf, s + 1, snap_tag(cycle))))
        return out

    def _take_snap(self, item: SnapRecv, anchors) -> None:
        """Wait for a snap message and store its anchor rows (once; a discarded one is dropped)."""
        if item.state is SnapState.RECEIVED:
            return
        self.rt.wait(item.work, item.stage + 1, "anchor states")
        keep = item.state is SnapState.POSTED
        item.state = SnapState.RECEIVED
        if keep:
            rows = item.buf.shape[1]
            for i, j in enumerate(self.snap_slots[item.stage]):
                anchors[j, item.pos:item.pos + rows] = item.buf[i]

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        rt, t, n = self.rt, self.target, self.n
        ids, max_new = check_prompt(t, prompt_ids, max_new_tokens)
        drafter = wrap_drafter(drafter or self.engine.drafter, rt.config)
        dec = SequenceDecode(t, self.layout, drafter, ids, max_new, sampling,
                             DistributedDecodeStats(mode="spd", n=n), on_token)
        prompt_len = dec.prompt_len
        gen_id = self._request({"op": "generate", "prompt_ids": ids.tolist(),
                                "prompt_len": prompt_len, "capacity": dec.capacity})
        stats, timer, anchors = dec.stats, dec.timer, dec.anchors
        streams = DraftRankStreams(torch.device(t.device))
        staged_before = rt.host_staged
        fault = rt.config.fault if rt.config.fault and rt.config.fault["rank"] == rt.rank else None

        # Prefill: every stage runs the prompt; rank 0 gets every anchor and the last row.
        t0 = time.perf_counter()
        snaps = self._post_snaps([(s, 0) for s in range(n)], 0, rows=prompt_len)
        anchors[0, :prompt_len] = t.embed_tokens(ids)
        for item in snaps:
            self._take_snap(item, anchors)
        dec.start(snaps[-1].buf[-1][-1:], t0)
        pending: list[SnapRecv] = []  # last cycle's snaps still to receive (pre-step features)
        trunc: int | None = None  # the committed length every stage truncates to next cycle
        announced: list[SnapRecv] | None = None  # next cycle's, sent before its draft was judged
        policy = SpeculationPolicy(rt.config.speculative_control)
        spec = {"announced": 0, "redone": 0}
        cycle_s: list[float] = []
        verify_s: list[float] = []  # each cycle's verification and rollback on this rank
        judged = lambda: stats.phase_s.get("verify", 0.0) + stats.phase_s.get("rollback", 0.0)  # noqa: E731
        self._ctrl_seq = 0
        while not dec.done:
            tc, judged_before = time.perf_counter(), judged()
            stats.K += 1
            if fault and stats.K == fault["cycle"]:
                inject_fault(fault)
            sched = dec.sched
            if announced is None:
                token = int(dec.tokens[sched.newest])
                with timer("control_send"), streams.receiving():
                    current = self._announce(stats.K, sched, trunc, token)
                trunc = None
            else:  # announced last cycle on an optimistic accept, which held
                current, announced = announced, None
            with timer("wait_snaps"), streams.receiving():
                for item in pending:
                    self._take_snap(item, anchors)
            # 1. Draft the successor of the newest token from pre-step features, overlapping
            #    the stages' forwards of this cycle. (Post-step drafting, an ablation, waits for
            #    this cycle's snaps and sees every in-flight token one stage deeper.)
            if dec.post_step:
                with timer("wait_stage"), streams.receiving():
                    for item in current:
                        self._take_snap(item, anchors)  # marks them received
            with streams.drafting():
                draft = dec.draft(1 if dec.post_step else 0)
            streams.after_draft(draft)
            if not sched.full:  # filling: nothing leaves the pipeline this cycle
                dec.fill(draft)
                pending = current
            else:
                # 2. Speculative control: announce the next cycle as if the draft will be
                #    accepted, so the stages start it while this one is verified; verification
                #    and the control round trip leave the critical path. On a rejection the
                #    next cycle is announced again (the stages roll back and redo it).
                ahead = None
                if policy.speculate() and len(dec.out) + 1 < dec.max_new:
                    nxt = replace(sched)
                    nxt.accept()
                    token = int(draft.token)  # on the default stream, which waited for it
                    with timer("control_send"), streams.receiving():
                        ahead = self._announce(stats.K + 1, nxt, None, token)
                    spec["announced"] += 1
                # 3. The oldest token leaves the last stage; its row judges the next token.
                last = current[-1]
                assert last.stage == n - 1
                with timer("wait_stage"), streams.receiving():
                    self._take_snap(last, anchors)
                streams.after_receive(last.buf)
                pending = current[:-1]
                accepted, token = dec.judge(last.buf[-1])
                policy.record(accepted)
                # 4. On rejection every stage truncates at the start of the next cycle.
                rollback_to = dec.commit(accepted, token, draft)
                if rollback_to is not None:
                    trunc = rollback_to
                if ahead is not None:
                    if accepted and not dec.done:
                        announced = ahead
                    else:  # its snaps still arrive: receive and drop them
                        for item in ahead:
                            item.state = SnapState.DISCARD
                        pending += ahead
                        spec["redone"] += int(not dec.done)
            cycle_s.append(time.perf_counter() - tc)
            verify_s.append(judged() - judged_before)
        dec.finish()
        # Stop: every stage leaves its loop; drain what is still in flight.
        self._send_ctrl(ControlMessage.stop(stats.K + 1))
        with streams.receiving():
            for item in pending:
                self._take_snap(item, anchors)
        rt.flush_sends()
        stage_stats = [json.loads(rt.store.get(f"stats/{gen_id}/{r}"))
                       for r in range(1, rt.world)]
        for r in range(1, rt.world):
            rt.store.delete_key(f"stats/{gen_id}/{r}")
        stats.distributed = breakdown(rt, stats, cycle_s, dec.draft_s, stage_stats, verify_s)
        stats.distributed["speculative_control"] = dict(mode=policy.mode, **spec)
        stats.distributed["host_staged_receives"] = rt.host_staged - staged_before  # this one
        return GenerationResult(dec.out, stats, dec.stop.finish_reason)
