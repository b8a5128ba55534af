"""The pipeline without speculation, batched over requests: the baseline SPD is compared with on
the same n stages (issue 54, docs/batching.md; the evaluation grid's method "pp").

The target's layers are cut into the engine's n stages, each with its KV cache
[slots, layers of the stage, kv_heads, context, head_dim] (allocated once). A sequence's current
token enters stage 0, moves one stage a cycle, and after the last stage its next token is chosen
(greedy: the fused norm + head + argmax; sampling: `pick` with its own generator, as
spd.runtime.batch_ar draws) and enters stage 0 the cycle after. So each sequence gets one token
every n cycles, and sequences that joined at different cycles keep the stages busy with
different requests: every stage runs once a cycle (`batch_stage_step`) over the rows of the
sequences whose token is at its depth. A sequence's token enters stage 0 only in the cycles of
its phase (cycle mod n), the phase with the fewest sequences when it joined: so requests that
arrive together (a burst) still spread over the n stages, as a pipeline-parallel server's
micro-batches do, and a sequence waits at most n - 1 cycles for its phase, once.

A `step` is one cycle. Stage s reads the hidden states stage s - 1 wrote last cycle (`outbox`
[slots, d]), so the stages run last to first; in this process they run one after another, where
n devices would run them at once (this path's tokens/s here is not what n devices give). The
output is AR's token for token: the same layers on the same rows, chosen as BatchedAR chooses.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from spd.runtime import batch_ar as ar
from spd.runtime.slot_stage import SlotStage
from spd.runtime.slots import chunks
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.verdict import pick

MODE = "pp"  # its DecodeStats mode: the evaluation's name for this method (spd.evaluation.methods)


@dataclass
class Running(ar.Running):
    """One sequence in a slot (batch_ar.Running): `position` rows of its slot are written in
    every stage up to its token's depth; `token` is at stage `depth` in the next cycle."""
    depth: int = 0
    phase: int = 0             # its token enters stage 0 in the cycles c with c mod n == phase
    cycles: int = 0            # cycles its token was in a stage (K)


def least_used_phase(phases, n: int, cycle: int) -> int:
    """The phase (cycle mod n) fewest of `phases` (the other sequences') use, of those the
    soonest to come after `cycle`."""
    count = [0] * n
    for p in phases:
        count[p] += 1
    return min(range(n), key=lambda p: (count[p], (p - cycle) % n))


class BatchedPipeline(ar.TokenBatch):
    """Up to `slots` sequences of at most `context` rows each (prompt and new tokens) through the
    engine's n stages (its layout), without drafts: a SlotStage a stage (a hybrid target's: each
    slot's cache and state rings). KV memory is allocated once: every stage's rows for `slots`
    x `context`, as BatchedAR's in all, and an outbox of `slots` hidden states."""

    def __init__(self, engine, slots: int, context: int, prefill_chunk: int | None = None):
        super().__init__(engine.target, slots, context, prefill_chunk)
        t, layout = engine.target, engine.layout
        self.n, self.layout = layout.n, layout
        # each stage over the slots (its KV rows; a hybrid's, each slot's cache and rings)
        self.parts = [SlotStage(t, layout, s, slots, context) for s in range(self.n)]
        self.outbox = torch.zeros(slots, t.hidden_size, dtype=t.dtype, device=t.device)
        self.cycle = 0

    @property
    def bytes_per_slot(self) -> int:
        return sum(p.bytes_per_slot for p in self.parts)

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int = 1) -> int:
        """A slot's rows for such a sequence (AR's: the last new token is never fed back, and
        a token in flight holds one row of the stages it has passed)."""
        return prompt_len + max_new - 1

    @torch.no_grad()
    def join(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams, rule: StopRule,
             on_token: Callable[[int], None] | None = None) -> Running:
        """`ids` [P] into a free slot: its prefill stage by stage (at once, or a chunk a step:
        `prefill_chunk`) and its first token (emitted), which enters stage 0 in the next
        cycle unless it ended the sequence."""
        seq = self._running(ids, max_new, sampling, rule, on_token,
                            DecodeStats(mode=MODE, n=self.n), Running)
        seq.phase = self._phase()
        self.admit(seq, self._prefill(seq, ids))
        return seq

    def _phase(self) -> int:
        """The phase with the fewest sequences (of those, the soonest to enter stage 0)."""
        return least_used_phase((q.phase for q in self.running.values()), self.n, self.cycle)

    def _prefill(self, seq: Running, ids: torch.Tensor):
        """The prompt into the slot's stages a chunk per `next`, then the first token."""
        t = self.target
        spent = 0.0
        for a, b in chunks(ids.numel(), self.prefill_chunk):
            if a:
                yield
            t0 = time.perf_counter()
            h = t.embed_tokens(ids[a:b])
            for part in self.parts:
                h = part.prefill(seq.slot, h, a)[-1]
            spent += time.perf_counter() - t0
        t0 = time.perf_counter()
        first = pick(t.logits(h[-1:])[0], seq.sampling, seq.gen)
        seq.stats.prefill_s = spent + time.perf_counter() - t0
        seq.t0 = time.perf_counter()
        self._emit(seq, first)

    def leave(self, seq: Running) -> None:
        """The sequence stops now (ended, or its client left): its slot is free (a token it had
        in flight is dropped; its rows are overwritten by the slot's next sequence)."""
        if self._ended(seq):
            seq.stats.K = seq.stats.stage_rows = seq.cycles

    @torch.no_grad()
    def step(self) -> list[Running]:
        """A chunk of each prefill under way, then one cycle: each stage once over the
        sequences whose token is at its depth (last stage first) -> the sequences that ended
        in it."""
        self.advance_prefills()
        t, dev = self.target, self.target.device
        at: dict[int, list[Running]] = {}
        for seq in self.decoding():  # where each token is as the cycle starts (by slot)
            if seq.depth or seq.phase == self.cycle % self.n:  # (else: waits for its phase)
                at.setdefault(seq.depth, []).append(seq)
        self.cycle += 1
        ended = []
        for s in reversed(range(self.n)):
            seqs = at.get(s)
            if not seqs:
                continue
            slots = torch.tensor([q.slot for q in seqs], device=dev)
            positions = torch.tensor([q.position for q in seqs], device=dev)
            x = (t.embed_tokens(torch.tensor([q.token for q in seqs], device=dev)) if s == 0
                 else self.outbox.index_select(0, slots))
            h = self.parts[s].rows_step(x, tuple(q.slot for q in seqs), slots, positions)[-1]
            for q in seqs:
                q.cycles += 1
            if s < self.n - 1:
                self.outbox[slots] = h
                for q in seqs:
                    q.depth = s + 1
                continue
            for q, tok in zip(seqs, self._choose(seqs, h)):
                q.position += 1
                q.depth = 0
                self._emit(q, tok)
                if q.done:
                    ended.append(q)
        return ended
