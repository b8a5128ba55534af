"""Speculative pipeline decoding of several sequences through one pipeline (one process).

Terms (docs/batching.md):
  slot     one of `slots` places a sequence decodes in: its rows of every stage's batched KV
           cache ([slots, layers, kv_heads, context, head_dim] a stage), its own drafter (its
           PDM cache) and its own `Cycle` (state, units, lanes, sampling generator).
  cycle    of the batch: the control's open once over every slot, each sequence's draft
           step, each stage's step run once over one unit per sequence (`batch_stage_step`:
           the weight reads shared), the control's judgement and commit once over every slot
           (spd.runtime.chain_batch, spd.runtime.tree_batch), then every slot's state read in
           one copy. A sequence's speculation is its own: a rejection refills only its
           pipeline.

A sequence joins between cycles (its prompt's prefill into its slot through that slot's views of
the stages, at once or a chunk a step, then its first token) and leaves at its end or when told,
freeing its slot. Token chains and trees (W rows a unit: `batch_tree_stage_step`), dense
targets (a hybrid target's chains too), one process; each sequence's draft step is its own.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from spd import env
from spd.draft.drafters import slot_drafters
from spd.errors import InternalError, SPDError
from spd.model.target import Stage
from spd.runtime.chain_batch import ChainBatch
from spd.runtime.control import ChainControl, TreeControl
from spd.runtime.cycle import DEFAULT_AHEAD, Cycle
from spd.runtime.cycle_graph import BatchGraphs
from spd.runtime.driver import STOP, peek
from spd.runtime.sequence import Sequence, SlotRows, slot_buffers
from spd.runtime.slot_stage import SlotStage
from spd.runtime.slots import SlotPool, chunks
from spd.runtime.stopping import StopRule
from spd.runtime.tree_batch import TreeBatch
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.unit import CPOS, CSLOT, LIVE, UnitFormat, dead_unit


class SlotStages:
    """A slot's stages as its Cycle sees them: run by the batch over every slot at once (in
    this process BatchStages.run; across ranks spd.distributed.batch_draft), never by the
    Cycle itself, and not in lock-step of their own (the batch keeps the ranks in step)."""

    lockstep = False
    replayable = capturable = True
    messages = None
    local: list = []  # (the stage steps run outside the slot's cycle: no stream of their own)

    def __init__(self, peek: bool):
        self.peek = peek  # a CPU skips a finished sequence's cycles (Cycle.open)

    def begin(self, cycle) -> None:
        pass  # (the batch hands each stage its rows)

    def run(self, cycle):
        raise InternalError("a batch slot's stages run over the whole batch")


class SlotSets:
    """Sets of slots as device tensors, each made once: (the slots [R], no drafts [R] of -1:
    what verify_greedy compares with). A steady cycle makes no tensor of a Python value."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.made: dict[tuple, tuple] = {}

    def __call__(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        got = self.made.get(slots)
        if got is None:
            if len(self.made) >= 256:  # (on a CPU, the live rows' sets: a few patterns)
                self.made.clear()
            # (on a GPU from pinned memory, without blocking: the host copy stays cached
            # beside it, alive until the copy has run)
            host = torch.tensor(slots, pin_memory=self.device.type == "cuda")
            got = self.made[slots] = (host.to(self.device, non_blocking=True),
                                      torch.full((len(slots),), -1, dtype=torch.int64,
                                                 device=self.device), host)
        return got[:2]


class BatchStages:
    """The n stages over `slots` sequences of units of `width` rows (1: a chain; W: a token
    tree's): each a SlotStage (its weights once, its KV cache [slots, layers, kv_heads,
    context, head_dim]), and each slot's stage outputs of the last cycle (`outbox`
    [slots, n, W, d]: stage s + 1's rows this cycle). `attach` gives it the batch's control
    and sequence buffers: the units it runs and where their rows are kept."""

    def __init__(self, target, layout, slots: int, context: int, width: int = 1):
        t, n = target, layout.n
        self.target, self.layout, self.n, self.context = t, layout, n, context
        self.fmt = UnitFormat(n, width)
        self.parts = [SlotStage(t, layout, s, slots, context) for s in range(n)]
        self.k, self.v = [p.k for p in self.parts], [p.v for p in self.parts]
        self.anchor_layers = [[b - layout.stages[s].start - 1 for _, b in
                               layout.anchors_of_stage(s)] for s in range(n)]
        self.outbox = torch.zeros(slots, n, width, t.hidden_size, dtype=t.dtype,
                                  device=t.device)
        self.slot_sets = SlotSets(t.device)
        self.cpu = t.device.type == "cpu"
        self.units: torch.Tensor | None = None  # the control's [slots, n, H]
        self.kept: SlotRows | None = None

    def attach(self, units: torch.Tensor, kept: SlotRows) -> None:
        """The batch's control units [slots, n, H] and where its rows are kept."""
        self.units, self.kept = units, kept

    def slot_stages(self, slot: int) -> list[Stage]:
        """Slot `slot`'s stages (views of the batched caches), for its prompt's prefill."""
        return [p.view(slot) for p in self.parts]

    def begin(self, cycles: dict[int, Cycle], bucket: int | None = None) -> None:
        pass  # (in one process nothing travels before the stage steps)

    def run(self, cycles: dict[int, Cycle], judge: bool, into: torch.Tensor | None = None,
            bucket: int | None = None) -> None:
        """Every stage's step over one unit per slot of `cycles` (each slot's Cycle, opened;
        `bucket`: every slot below it, a free one's parked unit a bubble); their rows land
        where each sequence keeps them (`keep`); with `judge` (a greedy chain) the last
        stage's argmax lands at each slot of `into` [slots]. Stage s reads what stage s - 1
        made last cycle (`outbox`), so the stages run last to first. On a CPU, where reading
        is free, a stage runs only its live units' rows (`peek`, as LocalStages)."""
        t, n, W = self.target, self.n, self.fmt.width
        slots = list(range(bucket)) if bucket else sorted(cycles)
        if not slots:
            return
        if bucket:
            units = self.units[:bucket]                                  # [R, n, H]
        else:
            units = self.units.index_select(0, self.slot_sets(tuple(slots))[0])
        # a CPU runs a stage only for its live units (reading is free there); a GPU, and the
        # replay check, run every row every cycle: the same work (docs/cycle.md)
        looks = self.cpu and not env.replay_check_enabled()
        # (live, commit position, commit slot) of each unit, read at once
        seen = peek(units[:, :, LIVE:CSLOT + 1].contiguous()) if looks else None
        width = CSLOT + 1 - LIVE
        for s in reversed(range(n)):
            part = self.parts[s]
            at = [(r * n + s) * width for r in range(len(slots))]
            rows = [r for r in range(len(slots)) if seen is None or seen[at[r]]]
            if self.fmt.tree:  # a dead unit skipped still carries its commit (StageStep.skip)
                for r in set(range(len(slots))) - set(rows):  # (one onto itself: nothing)
                    if seen[at[r] + CPOS - LIVE] != seen[at[r] + CSLOT - LIVE]:
                        part.commit(slots[r], units[r, s])
            if not rows:
                continue
            run = tuple(slots[r] for r in rows)
            idx, none = self.slot_sets(run)
            heads = units[:, s] if len(rows) == len(slots) else units[rows, s]  # [R', H]
            outs = part.run(self.fmt, run, idx, heads,
                            None if s == 0 else self.outbox[idx, s - 1])
            out = outs[-1]
            self.kept.keep(s, idx, [outs[i] for i in self.anchor_layers[s]], out)
            self.outbox[idx, s] = out.view(len(run), W, -1)
            if s == n - 1 and judge:
                into.index_copy_(0, idx, t.verify_greedy(out, none)[0])


class Running:
    """A sequence in a slot: its Sequence and Cycle, the cycles launched and those read."""

    def __init__(self, slot: int, seq: Sequence, cycle: Cycle, parked: torch.Tensor):
        self.slot, self.seq, self.cycle = slot, seq, cycle
        self.parked = parked  # its units while it prefills and after it left (Control.park)
        self.launched = self.nread = 0
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
    allocated once: every stage's KV rows for `slots` x `context`, a drafter cache a slot.

    A step launches one cycle of every decoding sequence (`_cycle`: device work only) and
    reads each sequence's published state `ahead` cycles behind (spd.runtime.driver), so on a
    GPU the host never waits for the cycle it launched. The cycle is one CUDA graph a
    batch-size bucket (BatchGraphs keyed by FusedBatch.key): it runs every slot below the
    bucket, free ones parked as bubbles, so a join or a leave inside a bucket replays the same
    graph (docs/batching.md, 5). SPD_REPLAY_CHECK checks on any device that its steady cycles
    replay. A hybrid target's chains batch too (each slot its own DeltaNet state rings:
    SlotStage; a bubble writes none of them), bucketed alike."""

    def __init__(self, engine, slots: int, context: int, ahead: int = DEFAULT_AHEAD,
                 prefill_chunk: int | None = None):
        if engine.n < 2:
            raise SPDError("batched SPD needs n >= 2 stages")
        super().__init__(engine.target, slots, context, prefill_chunk)
        self.engine, self.n, self.ahead = engine, engine.n, ahead
        self.width = engine.tree_width
        self.stages = BatchStages(engine.target, engine.layout, slots, context, self.width)
        lookup = engine.drafter.lookup
        # a drafter a slot, their caches one pair of tensors (the chains' draft step batched)
        self.drafters, self.draft_caches = slot_drafters(engine.pdm, slots, context, lookup)
        # every slot's sequence buffers (tokens, anchors, final) for its `context` rows, once
        t = engine.target
        self.tokens, self.anchors, self.final = slot_buffers(t, engine.layout, context, slots)
        self.graphs = BatchGraphs(t.device, "batched decode cycle")
        # the control: three ops over every slot (ChainBatch, TreeBatch)
        m, d = self.anchors.shape[1], t.hidden_size
        if self.width == 1:
            self.control = ChainControl(slots, self.n, m, d, t.device, t.dtype)
            self.fused = ChainBatch(self, lookup)
        else:
            self.control = TreeControl(slots, self.n, self.width, m, d, t.device, t.dtype)
            self.fused = TreeBatch(self, lookup)
        self.stages.attach(self.control.units,
                           SlotRows(engine.layout, self.control.unit_rows(), self.anchors,
                                    self.final))
        self.control.park_all(context - 1, self._parked(context - 1))

    @staticmethod
    def rows_needed(prompt_len: int, max_new: int, n: int, width: int = 1) -> int:
        """A slot's rows for such a sequence (Sequence's: the rows in flight, a token tree's
        rows of width `width`, then trash)."""
        return prompt_len + max_new + n + 3 + ((n + 1) * width if width > 1 else 0)

    def needs(self, prompt_len: int, max_new: int) -> int:
        return self.rows_needed(prompt_len, max_new, self.n, self.width)

    @torch.no_grad()
    def join(self, ids: torch.Tensor, max_new: int, sampling: SamplingParams, rule: StopRule,
             on_token: Callable[[int], None] | None = None) -> Running:
        """`ids` [P] into a free slot: its prefill (at once, or a chunk a step) and its first
        token (emitted); it decodes from the step its prefill ends in, unless that token ended it."""
        slot = self.claim(ids.numel(), max_new)
        seq = Sequence(self.target, self.engine.layout, self.drafters[slot], ids, max_new,
                       sampling, DecodeStats(mode="spd", n=self.n), on_token, rule,
                       width=self.width, buffers=(self.tokens[slot], self.anchors[slot],
                                                  self.final[slot]))
        peeks = self.stages.cpu and not env.replay_check_enabled()
        entry = Running(slot, seq, Cycle(seq, SlotStages(peeks), ahead=self.ahead,
                                         control=self.control, slot=slot),
                        self._parked(seq.trash))
        self.control.park(slot, entry.parked)  # (a bubble until its cycle begins)
        self.fused.join(slot, sampling)
        self.admit(entry, self._prefill(entry, ids))
        return entry

    def _parked(self, trash: int) -> torch.Tensor:
        """A parked slot's unit [H] on the device: dead, at its trash row (set-up)."""
        return dead_unit(self.stages.fmt, trash, trash).to(self.target.device)

    def _prefill(self, entry: Running, ids: torch.Tensor):
        """The prompt into the slot's stages a chunk per `next`, then the first token."""
        seq, stages = entry.seq, self.stages.slot_stages(entry.slot)
        for st in stages:  # (the slot's last sequence's rows: a hybrid's rings start empty)
            st.cache.truncate(0)
        spent = 0.0
        for a, b in chunks(ids.numel(), self.prefill_chunk):
            if a:
                # parked again before each cycle it sits out: a commit moves a finished
                # slot's units on from its state's newest position (0 since Control.take), so
                # its bubble would run at row 1, over its prompt's rows written already
                self.control.park(entry.slot, entry.parked)
                yield
            t0 = time.perf_counter()
            last = self.engine._prefill(stages, ids[a:b], seq, start=a)[-1:]
            spent += time.perf_counter() - t0
        seq.start(last, time.perf_counter() - spent)
        entry.cycle.begin()
        self.stages.outbox[entry.slot].zero_()
        if seq.done:
            self.leave(entry)

    def leave(self, entry: Running) -> None:
        """The sequence stops now (ended, or its client left): its slot is free."""
        prefilled = entry.slot not in self.prefilling
        if not self.release(entry):
            return
        self.control.free(entry.slot)
        self.control.park(entry.slot, entry.parked)  # (its units in flight: bubbles)
        if prefilled:
            entry.cycle.cycles = entry.launched
            entry.cycle.finish()
        entry.seq.finish()

    def _cycle(self, entries: tuple[Running, ...]) -> None:
        """One cycle of `entries` (device work: what a graph replays), the control once over
        every slot (ChainBatch, TreeBatch)."""
        self.fused.cycle(entries)

    def describe(self) -> dict:
        """How the batch's cycles ran: graphs made and captured, replays, checked cycles."""
        return self.graphs.describe()

    def launch_cycle(self, members: tuple[Running, ...]) -> None:
        """One cycle of `members` through their graph, and its state published: every slot's
        control rows in one copy, before any is read, as a reader may raise."""
        self.graphs.launch(self.fused.key(members), members, self._cycle)
        self.fused.publish(members)
        for e in members:
            e.launched += 1

    @torch.no_grad()
    def step(self) -> list[Running]:
        """A chunk of each prefill under way, then one cycle of every decoding sequence, and
        the cycles `ahead` behind read -> the sequences that ended (left) in this step."""
        self.advance_prefills()
        members = tuple(self.decoding())
        if not members:
            return []
        self.launch_cycle(members)
        ended = []
        for e in members:
            while not e.done and e.launched - e.nread > self.ahead:
                got = e.cycle.read(e.nread)
                e.nread += 1
                if got == STOP:
                    self.leave(e)
                    ended.append(e)
        return ended
