"""Rank 0: the drafter, the judge and the cycle's control (spd.runtime.cycle), with the stages on
their ranks; with --draft-on-stage S, stage S runs in this process too, inside the same cycle."""
from __future__ import annotations

import json
import time
from typing import Callable

import torch

from spd import env
from spd.distributed.config import DRAFT_RANK, role_name
from spd.distributed.emulate import make_stage, wrap_drafter
from spd.distributed.faults import inject_fault
from spd.distributed.messages import (
    SNAP_TAG,
    UNIT_TAG,
    snap_bytes,
    snap_format,
    snap_views,
)
from spd.distributed.stage_rank import messages_since, prefill
from spd.distributed.stats import DistributedDecodeStats, breakdown
from spd.distributed.transport import Endpoint
from spd.errors import SPDError
from spd.model.target import Stage
from spd.runtime.cycle import Cycle
from spd.runtime.driver import peek
from spd.runtime.engine import GenerationResult, SamplingParams, SPDEngine
from spd.runtime.sequence import Sequence
from spd.runtime.unit import LIVE, StageStep, UnitFormat, message_bytes, split_message


class RemoteStages:
    """Rank 0's side of a cycle (the cycle's `stages`): stage 0's unit out and every stage's snap
    in, as one group of messages (Endpoint.exchange), the snaps' rows kept where their rows live
    (Cycle.keep). With the draft on stage S, stage S runs here, on a stream of its own, then its
    unit goes on to stage S + 1 and the next one comes in from stage S - 1 (a second group).
    Every message is waited for within the cycle, so each cycle is the same work (under NCCL one
    CUDA graph with its messages), but the last with a local stage, which sends nothing on."""

    lockstep = True  # the stage ranks run exactly rank 0's cycles

    def __init__(self, rt: Endpoint, seq: Sequence, local: Stage | None):
        t, n, W = seq.target, seq.n, seq.width
        self.rt, self.seq, self.n, self.W = rt, seq, n, W
        self.d, self.dtype, dev = t.hidden_size, t.dtype, t.device
        chain_greedy = seq.sampling.greedy and W == 1
        self.fmt = UnitFormat(n, W)
        self.formats = [snap_format(seq.layout, s, output=not chain_greedy) for s in range(n)]
        self.local = [] if local is None else [local.index]
        self.snaps = {s: torch.zeros(snap_bytes(f, W, self.d, self.dtype), dtype=torch.uint8,
                                     device=dev)
                      for s, f in enumerate(self.formats)
                      if s not in self.local and (f.rows or s == n - 1)}
        self.verdict = torch.zeros(1, dtype=torch.int64, device=dev)
        self.step = None
        if local is not None:
            S = local.index
            self.step = StageStep(local, seq.layout, self.fmt, chain_greedy and S == n - 1)
            size = message_bytes(self.fmt, self.d, self.dtype)
            self.inbox = torch.zeros(size, dtype=torch.uint8, device=dev)
            self.outbox = torch.zeros(size, dtype=torch.uint8, device=dev)
        self.replayable = True
        self.capturable = rt.backend == "nccl"
        self.messages = rt.messages
        self.peek = seq.device.type == "cpu" and not env.replay_check_enabled()
        self.fault = rt.fault_here()  # the test hook (DistConfig.fault)
        self.posted: list = []
        self.last = False  # this cycle is the last (a local stage sends nothing on)
        self.forward_s: list[float] = []  # the local stage's host time per cycle

    def begin(self, cycle: Cycle) -> None:
        c = cycle.launching
        if self.fault and c == self.fault["cycle"]:
            inject_fault(self.fault)
        sends = [] if 0 in self.local else [(cycle.units[0], 1, UNIT_TAG)]
        recvs = [(buf, s + 1, SNAP_TAG) for s, buf in self.snaps.items()]
        works = self.rt.exchange(sends, recvs)
        self.posted = [(s, buf, work) for (s, buf), work in zip(self.snaps.items(), works)]

    def run(self, cycle: Cycle) -> torch.Tensor:
        rt, n = self.rt, self.n
        for S in self.local:
            self._run_local(cycle, S)
        for s, buf, work in self.posted:
            rt.order(work, s + 1, "cycle snap")
            token, rows = snap_views(buf, self.W, self.d, self.dtype)
            fmt = self.formats[s]
            cycle.keep(s, rows[:len(fmt.hidden)], rows[-1] if fmt.with_output else None)
            if s == n - 1:
                self.verdict.copy_(token)
        rt.flush_sends(host=False)
        return self.verdict

    def _run_local(self, cycle: Cycle, S: int) -> None:
        head = cycle.units[S]
        x = None if S == 0 else split_message(self.inbox, self.fmt, self.d, self.dtype)[1]
        out_head, out_rows = split_message(self.outbox, self.fmt, self.d, self.dtype)
        out_head.copy_(head)
        t0 = time.perf_counter()
        with cycle.roles.on(1):  # the stage step, then its messages after it on its stream
            if self.peek and not peek(head[LIVE])[0]:
                self.step.skip(head)
            else:
                anchors, out, token = self.step.run(head, x)
                out_rows.copy_(out)
                cycle.keep(S, anchors, out)
                if token is not None:
                    self.verdict.copy_(token)
            self.forward_s.append(time.perf_counter() - t0)
            if self.last:
                return
            sends = [(self.outbox, S + 2, UNIT_TAG)] if S < self.n - 1 else []
            recvs = [(self.inbox, S, UNIT_TAG)] if S > 0 else []
            for work in self.rt.exchange(sends, recvs):
                self.rt.order(work, S, "cycle unit")


def session_kind(mode: str):
    """The batch session class of `mode`: "spd", or "pipeline" (without speculation)."""
    if mode == "spd":
        from spd.distributed.batch_draft import DistributedBatch
        return DistributedBatch
    if mode == "pipeline":
        from spd.distributed.batch_pipeline import DistributedPipeline
        return DistributedPipeline
    raise SPDError(f"a batch session's mode is 'spd' or 'pipeline', got {mode!r}")


class DistributedSPDEngine:
    """Rank 0's side of the distributed engine: `generate` has `SPDEngine.generate`'s contract."""

    def __init__(self, rt: Endpoint, engine: SPDEngine):
        self.rt = rt               # the draft rank's messages
        self.process = rt.rt       # its process's Runtime: failure handling, exit hooks
        self.engine = engine
        self.target = engine.target
        self.layout = engine.layout
        self.n = engine.n
        self.stage: Stage | None = None  # stage S's, with the draft on it
        self.session = None  # an open batch session (spd.distributed.batch_draft)
        self._gen = 0

    def _request(self, payload: dict) -> int:
        self._gen += 1
        key = f"req/{self._gen}"
        self.rt.store.set(key, self.rt.signer.seal(key, payload))  # signed: it can stop the run
        return self._gen

    def shutdown(self) -> None:
        if self.session is not None:  # (a batch session left open: its ranks in step first)
            self.session.close()
        self._request({"op": "shutdown"})

    def _local_stage(self, capacity: int) -> Stage | None:
        """Stage S's, where the draft runs on it (a cache of `capacity` rows), else None."""
        S = self.rt.config.draft_on_stage
        if S is None:
            return None
        if self.stage is None or self.stage.cache.capacity < capacity:
            self.stage = make_stage(self.target, S, self.layout.stages[S], capacity,
                                    self.rt.config)
        self.stage.cache.truncate(0)
        return self.stage

    def _prefill(self, seq: Sequence, req: dict, local: Stage | None) -> torch.Tensor | None:
        """The prompt's rows req["start"].. (0 where absent), req["prompt_len"] of them, through
        every stage; rank 0 keeps every anchor -> the last row's final state [1, d] (None when
        the rows end before the prompt does: a chunk of a batch's prompt)."""
        rt, t = self.rt, self.target
        a = int(req.get("start", 0))
        b = a + int(req["prompt_len"])
        posted = []
        for s in range(self.n):
            fmt = snap_format(self.layout, s, output=True)
            if fmt.rows and (local is None or s != local.index):
                buf = torch.empty(fmt.rows, b - a, t.hidden_size, dtype=t.dtype,
                                  device=t.device)
                posted.append((s, buf, rt.irecv(buf, s + 1, SNAP_TAG)))
        seq.anchors[0, a:b] = t.embed_tokens(seq.tokens[a:b])
        last = None
        if local is not None:
            def keep(rows):
                seq.keep_anchors(local.index, a, rows)
            out = prefill(rt, local, self.layout, req, keep)
            last = out[-1:] if local.index == self.n - 1 else None
        for s, buf, work in posted:
            rt.wait(work, s + 1, "anchor states")
            seq.keep_anchors(s, a, buf)
            if s == self.n - 1:
                last = buf[-1][-1:]
        return last if b == seq.prompt_len else None

    def _stage_stats(self, gen_id: int, stages: RemoteStages, cycle: Cycle) -> list[dict]:
        """Every stage's stats, in stage order: the stage ranks' (the store), and the one in
        this process, with the draft on it."""
        rt, out = self.rt, []
        for r in range(1, rt.world):
            if r - 1 in stages.local:
                st = self.stage
                out.append({"rank": r, "role": role_name(r),
                            "layers": [st.layer_ids.start, st.layer_ids.stop],
                            "prefill_s": 0.0, "forward_s": stages.forward_s,
                            "phase_s": {"forward": sum(stages.forward_s)},
                            "cycles": cycle.cycles, "messages": {},
                            "graph": cycle.graph.describe()})
                continue
            out.append(json.loads(rt.store.get(f"stats/{gen_id}/{r}")))
            rt.store.delete_key(f"stats/{gen_id}/{r}")
        return out

    def batch(self, slots: int, context: int, *, greedy: bool = True, sampled: bool = True,
              prefill_chunk: int | None = None, mode: str = "spd"):
        """A batch session on the stage ranks: up to `slots` sequences of `context` rows at
        once (join, step, leave, close): SPD's (spd.distributed.batch_draft.DistributedBatch),
        or with mode "pipeline" the pipeline without speculation
        (spd.distributed.batch_pipeline.DistributedPipeline)."""
        return session_kind(mode)(self, slots, context, greedy=greedy, sampled=sampled,
                                  prefill_chunk=prefill_chunk)

    @torch.no_grad()
    def generate_batch(self, prompts, max_new_tokens: int = 64,
                       sampling: SamplingParams = SamplingParams(),
                       on_token: Callable[[int, int], None] | None = None, *, stop=None,
                       stop_token_ids=None, max_batch: int | None = None,
                       describe: dict | None = None, prefill_chunk: int | None = None,
                       mode: str = "spd") -> list[GenerationResult]:
        """Several prompts through the ranks together: SPDEngine.generate's contract for a list
        of prompts, in a session of `mode` (`batch`)."""
        from spd.distributed.session import run_session
        return run_session(self, session_kind(mode), prompts, max_new_tokens, sampling,
                           on_token, stop=stop, stop_token_ids=stop_token_ids,
                           max_batch=max_batch, describe=describe, prefill_chunk=prefill_chunk)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None, *, stop=None,
                 stop_token_ids=None, cancel=None) -> GenerationResult:
        """`SPDEngine.generate`'s contract; `cancel` (an Event), once set, ends the decode at
        its next token as EOS would (the stages stay in step: the server's disconnects)."""
        rt, t, n = self.rt, self.target, self.n
        if self.session is not None:
            raise SPDError("a batch session is open on these ranks: close it first")
        ids, max_new, rule = self.engine.prepare_request(prompt_ids, max_new_tokens, stop,
                                                         stop_token_ids)
        rule.cancel = cancel
        drafter = wrap_drafter(drafter or self.engine.drafter, rt.config)
        width = self.engine.tree_width
        seq = Sequence(t, self.layout, drafter, ids, max_new, sampling,
                       DistributedDecodeStats(mode="spd", n=n), on_token, rule, width)
        req = {"op": "generate", "prompt_ids": ids.tolist(), "prompt_len": seq.prompt_len,
               "capacity": seq.buffer_rows, "greedy": sampling.greedy, "tree_width": width,
               "ahead": rt.config.ahead}
        gen_id = self._request(req)
        staged_before = rt.host_staged
        local = self._local_stage(seq.buffer_rows)
        t0 = time.perf_counter()
        seq.start(self._prefill(seq, req, local), t0)
        stages = RemoteStages(rt, seq, local)
        cycle = Cycle(seq, stages, rt.config.ahead)
        counted = dict(rt.messages)
        cycle.run()
        rt.flush_sends()
        # the decode ends where the host read its end; the ranks' cycles to the end cycle after
        # it (n + ahead + 1) are the drain, before the next request can start
        seq.finish(cycle.done_at)
        drain_ms = (time.perf_counter() - (cycle.done_at or t0)) * 1e3
        stats = seq.stats
        stage_stats = self._stage_stats(gen_id, stages, cycle)
        cycle_s = [b - a for a, b in zip(cycle.read_at, cycle.read_at[1:])]
        zeros = [0.0] * len(cycle_s)
        stats.distributed = breakdown(rt, stats, cycle_s, zeros, stage_stats, zeros)
        per_cycle = {"0": {k: v / cycle.cycles for k, v in messages_since(rt, counted).items()
                           if v}}
        for st in stage_stats:
            if not st["messages"]:  # (a stage of rank 0's process: counted with it)
                continue
            per_cycle[str(st["rank"])] = {k: v / st["cycles"] for k, v in st["messages"].items()
                                          if v}
        stats.distributed.update(ahead=cycle.ahead, cycles_run=cycle.cycles, drain_ms=drain_ms,
                                 host_staged_receives=rt.host_staged - staged_before,
                                 graph=cycle.graph.describe(), messages_per_cycle=per_cycle,
                                 verify_on="last stage" if sampling.greedy and width == 1
                                 else "rank 0")
        return self.engine.build_result(seq.out, stats, rule)


__all__ = ["DRAFT_RANK", "DistributedSPDEngine", "RemoteStages"]
