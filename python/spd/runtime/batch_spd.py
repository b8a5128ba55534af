"""Speculative pipeline decoding of several sequences through one pipeline (one process).

Terms (docs/batching.md):
  slot     one of `slots` places a sequence decodes in: its rows of every stage's batched KV
           cache ([slots, layers, kv_heads, context, head_dim] a stage), its own drafter (its
           PDM cache) and its own `Cycle` (state, units, lanes, sampling generator).
  cycle    of the batch: every running sequence's cycle opened (its pre-step draft), each
           stage's step run once over one row per sequence (`batch_stage_step`: the weight reads
           shared), every cycle closed (judged and committed), then each one's state read. A
           sequence's speculation is its own: a rejection refills only its pipeline.

A sequence joins between cycles (its prompt's prefill into its slot through that slot's views of
the stages, then its first token) and leaves at its end or when told, freeing its slot. So far:
token chains (tree width 1), dense targets, one process, eager cycles; each sequence's control
and draft step are its own (their fusion over the batch is issue 55's).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from spd import env
from spd.draft.drafters import PDMDrafter
from spd.errors import InternalError, SPDError
from spd.model.target import Stage
from spd.runtime.cycle import Cycle
from spd.runtime.driver import peek
from spd.runtime.sequence import Sequence
from spd.runtime.slots import SlotPool
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.unit import FIXED, LIVE, POS
from spd_kernels import verify_greedy
from spd_kernels.stage import batch_stage_step


class SlotStages:
    """A slot's stages as its Cycle sees them: in this process, run by the batch
    (BatchStages.run) over every slot at once, never by the cycle itself."""

    lockstep = False
    replayable = capturable = True
    messages = None
    peek = False

    def __init__(self, n: int):
        self.local = list(range(n))

    def begin(self, cycle) -> None:
        pass  # (the batch hands each stage its rows)

    def run(self, cycle):
        raise InternalError("a batch slot's stages run over the whole batch")


class BatchStages:
    """The n stages over `slots` sequences: each stage's weights once, its KV cache
    [slots, layers, kv_heads, context, head_dim], and each slot's stage outputs of the last
    cycle (`outbox` [slots, n, d]: stage s + 1's rows this cycle)."""

    def __init__(self, target, layout, slots: int, context: int):
        t, n = target, layout.n
        self.target, self.layout, self.n, self.context = t, layout, n, context
        self.weights = [t.stage_weights(r) for r in layout.stages]
        self.k = [torch.zeros(slots, len(r), t.num_kv_heads, context, t.head_dim,
                              dtype=t.dtype, device=t.device) for r in layout.stages]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.anchor_layers = [[b - layout.stages[s].start - 1 for _, b in
                               layout.anchors_of_stage(s)] for s in range(n)]
        self.cos, self.sin = t.rope(0, context)
        self.outbox = torch.zeros(slots, n, t.hidden_size, dtype=t.dtype, device=t.device)
        self._slot_stages: dict[int, list[Stage]] = {}
        self._index: dict[tuple, tuple] = {}
        self._stand_in = torch.full((1,), -1, dtype=torch.int64, device=t.device)
        self.cpu = t.device.type == "cpu"

    def slot_stages(self, slot: int) -> list[Stage]:
        """Slot `slot`'s stages (views of the batched caches), for its prompt's prefill."""
        if slot not in self._slot_stages:
            self._slot_stages[slot] = [
                Stage(self.target, s, r, self.context, cuda_graphs=False, max_rollback=self.n,
                      buffers=(self.k[s][slot], self.v[s][slot]))
                for s, r in enumerate(self.layout.stages)]
        return self._slot_stages[slot]

    def _slot_index(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the slots [R], no drafts [R] of -1: what verify_greedy compares with) on the
        device, made once per set of slots: no tensor of a Python value in a steady cycle."""
        got = self._index.get(slots)
        if got is None:
            if len(self._index) >= 256:  # (on a CPU, the live rows' sets: a few patterns)
                self._index.clear()
            dev = torch.device(self.target.device)
            # (on a GPU from pinned memory, without blocking: the host copy stays cached
            # beside it, alive until the copy has run)
            host = torch.tensor(slots, pin_memory=dev.type == "cuda")
            got = self._index[slots] = (host.to(dev, non_blocking=True),
                                        torch.full((len(slots),), -1, dtype=torch.int64,
                                                   device=dev), host)
        return got[:2]

    def run(self, cycles: dict[int, Cycle], judge: bool) -> dict[int, torch.Tensor]:
        """Every stage's step over one row per slot (cycles: each slot's Cycle, opened); their
        rows land where each sequence keeps them (Cycle.keep) -> each slot's verdict [1] (with
        `judge`, a greedy chain: the last stage's argmax; else a stand-in). Stage s reads what
        stage s - 1 made last cycle (`outbox`), so the stages run last to first. On a CPU, where
        reading is free, a stage runs only its live units' rows (`peek`, as LocalStages)."""
        t, n = self.target, self.n
        slots = sorted(cycles)
        units = torch.stack([cycles[b].units for b in slots])       # [R, n, H]
        # a CPU runs a stage only for its live units (reading is free there); a GPU, and the
        # replay check, run every row every cycle: the same work (docs/cycle.md)
        looks = self.cpu and not env.replay_check_enabled()
        live = peek(units[:, :, LIVE]) if looks else None
        verdicts = dict.fromkeys(slots, self._stand_in)
        for s in reversed(range(n)):
            rows = [r for r in range(len(slots)) if live is None or live[r * n + s]]
            if not rows:
                continue
            run = tuple(slots[r] for r in rows)
            idx, none = self._slot_index(run)
            heads = units[:, s] if len(rows) == len(slots) else units[rows, s]  # [R', H]
            x = t.embed_tokens(heads[:, FIXED]) if s == 0 else self.outbox[idx, s - 1]
            outs = batch_stage_step(x, self.weights[s], self.k[s], self.v[s], idx,
                                    heads[:, POS], self.cos, self.sin)
            out = outs[-1]
            for r, b in enumerate(run):
                cycles[b].keep(s, [outs[i][r:r + 1] for i in self.anchor_layers[s]],
                               out[r:r + 1])
            self.outbox[idx, s] = out
            if s == n - 1 and judge:
                verdict = verify_greedy(out, t.norm.weight, t.rms_eps, t.lm_head.weight, none,
                                        t.norm_offset)[0]
                verdicts.update({b: verdict[r:r + 1] for r, b in enumerate(run)})
        return verdicts


class Running:
    """A sequence in a slot: its Sequence and Cycle, and the cycles it has run."""

    def __init__(self, slot: int, seq: Sequence, cycle: Cycle):
        self.slot, self.seq, self.cycle = slot, seq, cycle
        self.cycles = 0
        self.done = False

    @property
    def out(self) -> list[int]:
        return self.seq.out

    @property
    def stats(self) -> DecodeStats:
        return self.seq.stats

    @property
    def rule(self) -> StopRule:
        return self.seq.stop


class BatchedSPD(SlotPool):
    """Up to `slots` sequences of the engine's target through its n stages at once, each slot
    holding `context` rows (prompt, new tokens and the n + 2 rows in flight). Its memory is
    allocated once: every stage's KV rows for `slots` x `context`, a drafter cache a slot."""

    def __init__(self, engine, slots: int, context: int):
        if engine.n < 2:
            raise SPDError("batched SPD needs n >= 2 stages")
        if engine.tree_width > 1:
            raise SPDError("several sequences at once with token trees (tree width > 1) are "
                           "not supported yet: use tree width 1")
        super().__init__(engine.target, slots, context)
        self.engine, self.n = engine, engine.n
        self.stages = BatchStages(engine.target, engine.layout, slots, context)
        lookup = engine.drafter.lookup
        self.drafters = [PDMDrafter(engine.pdm, lookup=lookup) for _ in range(slots)]

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int) -> int:
        """A slot's rows for such a sequence (Sequence's: the rows in flight, then trash)."""
        return prompt_len + max_new + n + 3

    @torch.no_grad()
    def join(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams, rule: StopRule,
             on_token: Callable[[int], None] | None = None) -> Running:
        """Prefill `ids` [P] into a free slot and choose the first token (emitted); the sequence
        runs from the next cycle unless that token ended it."""
        slot = self.claim(ids.numel(), max_new)
        seq = Sequence(self.target, self.engine.layout, self.drafters[slot], ids, max_new,
                       sampling, DecodeStats(mode="spd", n=self.n), on_token, rule)
        t0 = time.perf_counter()
        seq.start(self.engine._prefill(self.stages.slot_stages(slot), ids, seq)[-1:], t0)
        cycle = Cycle(seq, SlotStages(self.n), ahead=0)
        cycle.begin()
        self.stages.outbox[slot].zero_()
        entry = Running(slot, seq, cycle)
        self.running[slot] = entry
        if seq.done:
            self.leave(entry)
        return entry

    def leave(self, entry: Running) -> None:
        """The sequence stops now (ended, or its client left): its slot is free."""
        if not self.release(entry):
            return
        entry.cycle.cycles = entry.cycles
        entry.cycle.finish()
        entry.seq.finish()

    @torch.no_grad()
    def step(self) -> list[Running]:
        """One cycle of every running sequence -> those that ended in it."""
        if not self.running:
            return []
        entries = dict(self.running)
        opened = {b: e.cycle.open() for b, e in entries.items()}
        verdicts = self.stages.run({b: e.cycle for b, e in entries.items()},
                                   judge=any(e.seq.sampling.greedy for e in entries.values()))
        ended = []
        for b, e in entries.items():
            e.cycle.close(opened[b], verdicts[b])
            e.cycle.published.publish(e.cycles, e.cycle.state)
            e.cycle.read(e.cycles)
            e.cycles += 1
            if e.seq.done:
                self.leave(e)
                ended.append(e)
        return ended
