"""The pipeline without speculation across ranks, batched over requests: the baseline SPD is
compared with on the same n stage ranks (issue 54; the one-process path:
spd.runtime.batch_pipeline; `spd serve --distributed --mode pipeline`).

It runs as a batch session (spd.distributed.session, batch_stage): every cycle each stage rank
runs one unit per slot, a free slot's a bubble, as in an SPD session, and cannot tell the two
apart. Rank 0 drafts nothing. A sequence's token enters stage 0 in the cycles of its phase
(cycle mod n: the phase with the fewest sequences when it started, as in the one-process path),
moves one stage a cycle, and in cycle c + n - 1 the last stage sends rank 0 its argmax (a
greedy sequence) or its output row (a sampled one: `pick` with the sequence's generator, as
spd.runtime.batch_ar draws); the next token enters stage 0 in cycle c + n. So each sequence
gets one token every n cycles and up to n phases of sequences keep the n stages busy. No anchor
rows travel (the session's `anchors` off), neither in the cycles nor in the prefills.

Rank 0 decides on the host: it waits for each cycle's last-stage snap and builds the next
message from it (one host read a cycle, as a pipeline-parallel server's scheduler reads each
step's tokens). Rank 0's device work is the head for sampled rows; the stage ranks' side is an
SPD session's (one CUDA graph a cycle under NCCL). The output is AR's token for token.
"""
from __future__ import annotations

import time

import torch

from spd.distributed.messages import SNAP_TAG, UNIT_TAG
from spd.distributed.session import SessionDriver
from spd.errors import SPDError
from spd.runtime.batch_ar import emit_token
from spd.runtime.batch_pipeline import MODE, least_used_phase
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.unit import FIXED, LIVE, POS, PREFIX
from spd.runtime.verdict import pick


class PipeEntry:
    """A sequence of the session: waiting for a slot (`slot` None), then decoding in one.
    `position` rows of its slot are written in every stage once its token in flight is out;
    `token` (the last one chosen) enters stage 0 at `position`."""

    def __init__(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams,
                 rule: StopRule, on_token, stats: DecodeStats):
        self.ids, self.max_new, self.sampling = ids, max_new, sampling
        self.rule, self.on_token, self.stats = rule, on_token, stats
        self.slot: int | None = None
        self.joined_at: int | None = None
        self.done = False
        self.prefill_s = 0.0
        self.out: list[int] = []
        self.token, self.position, self.phase = -1, ids.numel(), 0
        self.gen: torch.Generator | None = None
        self.entered: int | None = None  # the cycle its token in flight entered stage 0
        self.cycles = 0                  # stage steps its tokens took (K)
        self.t0 = 0.0                    # when its decode started (after its prefill)


class DistributedPipeline(SessionDriver):
    """Rank 0's side of the pipeline without speculation on the stage ranks of `deng` (a
    DistributedSPDEngine): up to `slots` sequences of at most `context` rows each (module
    docstring; join / step / leave / close as DistributedBatch's). greedy / sampled: whether
    greedy and sampled sequences may join (what the last stage sends: its argmax, its output
    rows)."""

    def __init__(self, deng, slots: int, context: int, *, greedy: bool = True,
                 sampled: bool = True, prefill_chunk: int | None = None):
        if deng.rt.config.draft_on_stage is not None:
            raise SPDError("the pipeline without speculation runs on the n stage ranks with "
                           "rank 0 apart: drop --draft-on-stage")
        super().__init__(deng, slots, context, prefill_chunk, greedy=greedy, sampled=sampled,
                         width=1, judge=greedy, output=sampled, anchors=False)
        self.argmax, self.rows = self.views[self.n - 1]  # [B] int64, [B, R, 1, d]
        self._open()

    @classmethod
    def rows_for(cls, engine, prompt_len: int, max_new: int) -> int:
        """A slot's rows for such a sequence: AR's (the last new token is never fed back),
        then the trash row its bubbles write."""
        return prompt_len + max_new

    # --- sequences ---------------------------------------------------------------------------
    def _entry(self, ids, max_new, sampling, rule, on_token) -> PipeEntry:
        return PipeEntry(ids, max_new, sampling, rule, on_token, DecodeStats(mode=MODE, n=self.n))

    def _seat(self, entry: PipeEntry, b: int) -> None:
        entry.gen = torch.Generator(self.target.device).manual_seed(entry.sampling.seed)

    def _prefill(self, entry: PipeEntry, req: dict) -> torch.Tensor | None:
        """The last stage's output rows of the chunk (its snap: no anchors)."""
        rt, t, last = self.rt, self.target, self.n
        a = int(req["start"])
        b = a + int(req["prompt_len"])
        buf = torch.empty(1, b - a, t.hidden_size, dtype=t.dtype, device=t.device)
        rt.wait(rt.irecv(buf, last, SNAP_TAG), last, "prefill output")
        return buf[0, -1:] if b == entry.ids.numel() else None

    def _start(self, entry: PipeEntry, last: torch.Tensor) -> bool:
        t0 = time.perf_counter()
        first = pick(self.target.logits(last)[0], entry.sampling, entry.gen)
        entry.stats.prefill_s = entry.prefill_s + time.perf_counter() - t0
        entry.t0 = time.perf_counter()
        entry.phase = self._phase(entry)
        return emit_token(entry, first)

    def _phase(self, entry: PipeEntry) -> int:
        """The phase with the fewest other sequences (of those, the soonest to enter)."""
        return least_used_phase((q.phase for q in self.decoding() if q is not entry), self.n,
                                self.launched)

    def _vacate(self, entry: PipeEntry, b: int, prefilled: bool, unused: bool) -> None:
        if entry.entered is not None:  # (its token in flight is dropped)
            entry.cycles += self.launched - entry.entered
            entry.entered = None
        st = entry.stats
        st.decode_s = time.perf_counter() - entry.t0 if entry.t0 else 0.0
        st.new_tokens, st.N = len(entry.out), max(len(entry.out) - 1, 0)
        st.K = st.stage_rows = entry.cycles

    # --- cycles ------------------------------------------------------------------------------
    def _cycle_step(self) -> list[PipeEntry]:
        """The tokens of this cycle's phase into stage 0, the other slots' units bubbles; the
        tokens out of the last stage (entered n - 1 cycles ago) chosen and emitted."""
        c, n, rt, dev = self.launched, self.n, self.rt, self.target.device
        decoding = self.decoding()
        entering = [e for e in decoding if e.entered is None and e.phase == c % n]
        self.heads.copy_(self.dead)
        if entering:
            idx = torch.tensor([e.slot for e in entering], device=dev)
            at = torch.tensor([e.position for e in entering], device=dev)
            self.heads[idx, POS] = at
            self.heads[idx, PREFIX] = at
            self.heads[idx, LIVE] = 1
            self.heads[idx, FIXED] = torch.tensor([e.token for e in entering], device=dev)
            for e in entering:
                e.entered = c
        for work in rt.exchange([(self.msg, 1, UNIT_TAG)],
                                [(self.snaps[n - 1], n, SNAP_TAG)]):
            rt.order(work, n, "batch cycle snap")
        rt.flush_sends(host=False)
        self._launched()
        out = [e for e in decoding if e.entered == c - (n - 1) and not e.done]
        if not out:
            return []
        greedy = (self.argmax.tolist()  # (the cycle's host read)
                  if any(e.sampling.greedy for e in out) else None)
        ended = []
        for e in out:
            e.entered = None
            e.cycles += n
            e.position += 1
            tok = (greedy[e.slot] if e.sampling.greedy else
                   pick(self.target.logits(self.rows[e.slot, -1])[0], e.sampling, e.gen))
            if emit_token(e, tok):
                self.leave(e)
                ended.append(e)
        return ended


__all__ = ["DistributedPipeline", "PipeEntry"]
