"""Autoregressive decoding of several sequences at once: continuous batching over slot caches.

The baseline for several sequences in one engine (issue 54, docs/batching.md): `slots` sequences
decode together, each in its own slot of one batched KV cache. A sequence joins between steps
(`join`: its prompt's prefill into its slot, on its own, and its first token), every `step` runs
one row per live sequence through `batch_stage_step` (the weight reads shared by all of them),
and a sequence leaves at its end (EOS, a stop id or string, its budget) or when told to
(`leave`), freeing its slot for the next. Each keeps its own sampling generator, stop rule and
budget, so its tokens are what it would get alone, up to rounding: on the CPU the products over
B rows round differently from one row's (docs/batching.md), which can move a near tie.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from spd.model.partition import DepthLayout
from spd.model.target import TargetModel
from spd.runtime.slot_stage import SlotStage
from spd.runtime.slots import SlotPool, chunks
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.verdict import pick


@dataclass
class Running:
    """One sequence in a slot: `position` rows of its slot are written, `token` (the last one
    chosen) goes in at `position` in the next step."""
    slot: int
    position: int
    token: int
    max_new: int
    sampling: SamplingParams
    gen: torch.Generator
    rule: StopRule
    on_token: Callable[[int], None] | None
    stats: DecodeStats
    out: list[int] = field(default_factory=list)
    done: bool = False
    t0: float = 0.0            # when its decode started (after its prefill)


def emit_token(seq, token: int) -> bool:
    """`token` is `seq`'s next (kept, told to its callback) -> whether it ends the sequence
    (its stop rule or its budget)."""
    seq.out.append(token)
    seq.token = token
    ended = seq.rule.feed(token) or len(seq.out) >= seq.max_new
    if seq.on_token:
        seq.on_token(token)
    return ended


class TokenBatch(SlotPool):
    """What the batches without speculation share (AR here, the pipeline in
    spd.runtime.batch_pipeline): a sequence's tokens are chosen one at a time from its last
    hidden state, as the one-sequence decode chooses, and emitted as they come."""

    def _running(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams,
                 rule: StopRule, on_token, stats: DecodeStats, kind=None):
        """A sequence for a free slot (`kind`: its Running class)."""
        slot = self.claim(ids.numel(), max_new)
        gen = torch.Generator(self.target.device).manual_seed(sampling.seed)
        return (kind or Running)(slot, ids.numel(), -1, max_new, sampling, gen, rule, on_token,
                                 stats)

    def _ended(self, seq: Running) -> bool:
        """`seq` leaves its slot (False: it had left); its clock stopped, its counts."""
        if not self.release(seq):
            return False
        st = seq.stats
        st.decode_s = time.perf_counter() - seq.t0 if seq.t0 else 0.0  # (0: left in prefill)
        st.new_tokens, st.N = len(seq.out), len(seq.out) - 1
        return True

    def _emit(self, seq: Running, token: int) -> None:
        if emit_token(seq, token):
            self.leave(seq)

    def _choose(self, seqs: list[Running], h: torch.Tensor) -> list[int]:
        """The next token of each of `seqs` from its row of `h` [R, d]: greedy rows through
        the fused norm + head + argmax, sampled ones through `pick` with their generators."""
        t, dev = self.target, h.device
        chosen: list[int | None] = [None] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
        if greedy:
            rows = torch.tensor(greedy, device=dev)
            none = torch.full((len(greedy),), -1, dtype=torch.int64, device=dev)
            picked = t.verify_greedy(h.index_select(0, rows), none)[0]
            for i, tok in zip(greedy, picked.tolist()):
                chosen[i] = tok
        for i, s in enumerate(seqs):
            if chosen[i] is None:
                chosen[i] = pick(t.logits(h[i:i + 1])[0], s.sampling, s.gen)
        return chosen


class BatchedAR(TokenBatch):
    """Up to `slots` sequences of at most `context` rows each (prompt and new tokens), every
    layer as one stage over the slots (SlotStage: a dense target's slot caches, a hybrid's
    cache and state rings a slot). KV memory is allocated once: slots x layers x 2 x kv_heads
    x context x head_dim elements."""

    def __init__(self, target: TargetModel, slots: int, context: int,
                 prefill_chunk: int | None = None):
        super().__init__(target, slots, context, prefill_chunk)
        # every layer as one stage (AR rolls nothing back: a layout of one stage)
        self.part = SlotStage(target, DepthLayout.build(target.num_layers, 1), 0, slots,
                              context)
        self.k, self.v = self.part.k, self.part.v  # (None on a hybrid target)

    @property
    def bytes_per_slot(self) -> int:
        return self.part.bytes_per_slot

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int = 1) -> int:
        """A slot's rows for such a sequence (the last new token is never fed back; n: the
        stages, which AR does not keep rows in flight for)."""
        return prompt_len + max_new - 1

    @torch.no_grad()
    def join(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams, rule: StopRule,
             on_token: Callable[[int], None] | None = None) -> Running:
        """`ids` [P] into a free slot: its prefill (at once, or a chunk a step) and its first
        token (emitted); it decodes from the step its prefill ends in, unless that token ended
        it."""
        seq = self._running(ids, max_new, sampling, rule, on_token, DecodeStats(mode="ar", n=1))
        self.admit(seq, self._prefill(seq, ids))
        return seq

    def _prefill(self, seq: Running, ids: torch.Tensor):
        """The prompt into the slot a chunk per `next`, then the first token."""
        t = self.target
        for a, b in chunks(ids.numel(), self.prefill_chunk):
            if a:
                yield
            t0 = time.perf_counter()
            h = self.part.prefill(seq.slot, t.embed_tokens(ids[a:b]), a)[-1]
            seq.stats.prefill_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        first = pick(t.logits(h[-1:])[0], seq.sampling, seq.gen)
        seq.stats.prefill_s += time.perf_counter() - t0
        seq.t0 = time.perf_counter()
        self._emit(seq, first)

    def leave(self, seq: Running) -> None:
        """The sequence stops now (ended, or its client left): its slot is free."""
        if self._ended(seq):
            seq.stats.K = seq.stats.N

    @torch.no_grad()
    def step(self) -> list[Running]:
        """One token for every running sequence -> the sequences that ended in it."""
        self.advance_prefills()
        seqs = self.decoding()
        if not seqs:
            return []
        t = self.target
        dev = t.device
        tokens = torch.tensor([s.token for s in seqs], device=dev)
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        positions = torch.tensor([s.position for s in seqs], device=dev)
        h = self.part.rows_step(t.embed_tokens(tokens), tuple(s.slot for s in seqs), slots,
                                positions)[-1]
        chosen = self._choose(seqs, h)
        ended = []
        for s, tok in zip(seqs, chosen):
            s.position += 1
            self._emit(s, tok)
            if s.done:
                ended.append(s)
        return ended
