"""One sequence's speculative pipeline decode: the cycle, written once.

`SequenceDecode` owns everything about one sequence's decode that does not depend on where the
stages run: the token and anchor buffers, the `PipelineSchedule`, the drafts awaiting
judgement, the generator, the counts (K and N) and the output. `SequenceDecode.run` is the one
decode loop. A `StageRunner` supplies what does depend on where the stages run: the single-
process engine runs them in turn (`spd.runtime.engine.LocalStages`), rank 0 of the distributed
runtime sends units to stage ranks (`spd.distributed.draft_rank.RemoteStages`). A cycle (README,
"How a cycle works"):

    draft = self.draft(0)                    # pre-step features, while the stages run
    stages.advance(...)                      # every in-flight token runs its next stage
    if not full:  self.fill(draft)           # filling: the draft enters at depth 0
    else:         self.commit(stages.verdict(self), draft)   # accept: it enters; reject: roll
                                             # back, the correction enters alone

The generator's draws happen in this order (prefill pick, then per cycle three uniforms: the
draft's and the verifier's two, drawn whether or not the cycle judges), so seeded sampling gives
the same tokens whichever runner runs, the device loop (spd.runtime.device_loop) included. The
generator lives on the target's device (Philox on a GPU), so the draws are device work there too.

No cycle reads a device value on the host but the verdict, and none makes a tensor from a Python
value (on a GPU a copy from pageable memory that holds the host): an int the cycle puts on the
device (a token id, a position) is a view of the table `ints`, and the drafter's row types are
tables made before the first cycle (tests/runtime/test_host_copies.py counts both directions).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from spd.draft.drafters import Draft
from spd.draft.lookup import NgramLookup
from spd.errors import InternalError
from spd.runtime.host_mirror import HostMirror
from spd.runtime.schedule import PipelineSchedule
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.verdict import Verdict, pick, verify

if TYPE_CHECKING:
    from spd.model.partition import DepthLayout
    from spd.model.target import TargetModel


class PhaseTimer:
    """Accumulates wall time per phase: `with timer("verify"): ...`."""

    def __init__(self, sink: dict):
        self.sink = sink

    def __call__(self, phase: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.sink[phase] = timer.sink.get(phase, 0.0) + time.perf_counter() - self.t0
        return _Ctx()


class StageRunner:
    """Where the target's stages run for one sequence: what `SequenceDecode.run` asks of them,
    in cycle order. The defaults do nothing (a runner overrides what it needs).

      begin(cycle)            a cycle starts (K counts it already)
      features(through)       the anchor rows of every stage step of cycles <= `through` must
                              be in `dec.anchors` now (a draft reads them)
      drafting()              context around the draft (where it runs)
      drafted(draft)          the draft is made (its tensors may now be used elsewhere)
      advance(cycle, work, judge)   every (stage, position) of `work` runs its next stage;
                              `judge`: the last stage also judges the next token (greedy, full)
      announce(cycle, position, draft)   the window is full: before the verdict is known, the
                              draft may enter at `position` as if accepted (speculative control)
      verdict(dec) -> Verdict the judgement of the token after the one that left the last stage
      enter(position, token)  a token entered stage 0 (after `dec.tokens` got it)
      rollback(length)        every target cache drops the positions >= length
      commit_row(position, slot)   a token tree's accepted row moves from its slot to its
                              position (spd.runtime.tree)
      drop_rows(slots)        a token tree's rows in these slots were dropped (no row reads
                              them again: a debug run poisons them)
      end(cycle)              the cycle is over
    """

    def begin(self, cycle: int) -> None:
        pass

    def features(self, through: int) -> None:
        pass

    def drafting(self):
        return nullcontext()

    def drafted(self, draft: Draft) -> None:
        pass

    def advance(self, cycle: int, work: list[tuple[int, int]], judge: bool) -> None:
        pass

    def announce(self, cycle: int, position: int, draft: Draft) -> None:
        pass

    def verdict(self, dec: SequenceDecode) -> Verdict:
        raise NotImplementedError

    def enter(self, position: int, token) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def commit_row(self, position: int, slot: int) -> None:
        pass

    def drop_rows(self, slots: list[int]) -> None:
        pass

    def end(self, cycle: int) -> None:
        pass


@dataclass
class PendingDraft:
    """What is kept about a drafted position until it is judged."""
    fill: int                                  # tokens in flight when drafted: its draft position
    q: torch.Tensor | None                     # the draft distribution that proposed it (sampling)
    q_ids: torch.Tensor | None = None          # q's columns as target ids (None: every id)
    from_lookup: bool = False                  # the lookup proposed a token: whether it was
    #                                            used is in SequenceDecode.lookup_used


class SequenceDecode:
    """One sequence's SPD decode. Construct it after `check_prompt`; prefill the prompt through
    the stages (their anchor rows into `anchors[:, :prompt_len]`, `keep_anchors`), `start` with
    the StageRunner, `run`, then `finish`."""

    def __init__(self, target: TargetModel, layout: DepthLayout, drafter, ids: torch.Tensor,
                 max_new: int, sampling: SamplingParams, stats: DecodeStats,
                 on_token: Callable[[int], None] | None = None, stop: StopRule | None = None):
        t, n = target, layout.n
        self.target, self.layout, self.n = target, layout, n
        self.drafter, self.sampling, self.stats, self.on_token = drafter, sampling, stats, on_token
        self.max_new = max_new
        # where the decode ends besides max_new (default: the model's EOS ids)
        self.stop = stop if stop is not None else StopRule(t.eos_token_ids)
        self.prompt_len = ids.numel()
        self.capacity = self.prompt_len + max_new + n + 2
        # rows of the per-position buffers (and of every cache): the positions, then a tree's
        # slots (spd.runtime.tree; none for the chain)
        self.buffer_rows = self.capacity + self.tree_slots()
        drafter.begin(self.buffer_rows, t.vocab_size)
        # Per position: the token and its anchor hidden states (slot 0: the embedding).
        self.tokens = torch.zeros(self.buffer_rows, dtype=torch.int64, device=t.device)
        self.tokens[:self.prompt_len] = ids
        self.host_tokens = HostMirror(self.tokens)  # the context lookup reads drafts from here
        self.anchors = torch.zeros(len(layout.anchors), self.buffer_rows, t.hidden_size,
                                   device=t.device, dtype=t.dtype)
        # The anchor slots each stage produces (layout.anchors_of_stage), in slot order.
        self.stage_slots = [[j for j, _ in layout.anchors_of_stage(s)] for s in range(n)]
        # Drafted positions not judged yet (dropped together on a rejection).
        self.pending: dict[int, PendingDraft] = {}
        # Context lookup (spd.draft.lookup), when the drafter asks for it: committed tokens are
        # indexed as they are emitted.
        min_len = getattr(drafter, "lookup", 0)
        self.lookup = NgramLookup(min_len) if min_len else None
        if self.lookup is not None:
            self.lookup.extend(ids.tolist())
            # per drafted position: whether the gate used the lookup's token (on the device)
            self.lookup_used = HostMirror(torch.zeros(self.capacity, dtype=torch.bool,
                                                      device=t.device))
        # Every int the cycle puts on the device (a token id, a position) is a view of this
        # table [max(vocab, rows)] int64 (`on_device`): no tensor is made from a Python value.
        self.ints = torch.arange(max(t.vocab_size, self.buffer_rows), device=t.device)
        self.type_of_depth = torch.tensor([layout.agg_type(k) for k in range(n + 1)],
                                          device=t.device)
        # Aggregation types of the draft rows [R], per staircase (rows below the window, tokens
        # in flight, extra depth): every shape the schedule drafts, made here in one copy.
        self._row_types = self._staircase_types()
        self.sched = PipelineSchedule(n)
        # Post-step drafting (an ablation) waits for the stages: features one stage deeper.
        self.post_step = getattr(drafter, "post_step", False)
        self.timer = PhaseTimer(stats.phase_s)
        self.gen = torch.Generator(t.device).manual_seed(sampling.seed)
        # this cycle's draws (draft): the draft's, the verifier's
        self.uniforms = torch.zeros(3, device=t.device)
        self.draft_s: list[float] = []   # wall time of each draft call (per-cycle breakdowns)
        self.out: list[int] = []
        self.done = False
        self.stages = StageRunner()      # where the stages run (given to `start`)
        self._decode_t0 = 0.0

    def tree_slots(self) -> int:
        """Rows past the positions that a token tree keeps its uncommitted rows in (0: a chain)."""
        return 0

    def work_rows(self, work: list[tuple[int, int]]) -> int:
        """Rows the stages compute for `work` (a chain: one per in-flight position)."""
        return len(work)

    def on_device(self, value: int) -> torch.Tensor:
        """`value` (a token id or a position) as a 0-d int64 tensor on the device: a view of
        `ints`, so nothing is copied there."""
        if not 0 <= value < self.ints.shape[0]:  # a negative index would wrap silently
            raise InternalError("an int outside the device table", value=value,
                                table=self.ints.shape[0])
        return self.ints[value]

    def _staircase_types(self) -> dict[tuple[int, int, int], torch.Tensor]:
        """{(below, count, extra): the aggregation types [below + count] of draft rows}: `below`
        rows under the window (depth n), then `count` in flight (depths count-1 .. 0, `extra`
        deeper, at most n). The schedule drafts from at most one row under the window (it keeps
        the rows before the oldest in-flight token), for pre- and post-step features: 4n
        shapes, views of one tensor made with one copy, before any cycle."""
        n, keys, flat = self.n, [], []
        for extra in (0, 1):
            for below in (0, 1):
                for count in range(1, n + 1):
                    keys.append(((below, count, extra), len(flat), below + count))
                    flat += [n] * below + [min(n, d + extra) for d in range(count - 1, -1, -1)]
        types = self.type_of_depth[torch.tensor(flat, device=self.target.device)]
        return {key: types[at:at + size] for key, at, size in keys}

    # --- set-up ---------------------------------------------------------------------------------
    def keep_anchors(self, stage: int, position: int, rows) -> None:
        """Stage `stage`'s anchor rows for positions position.. (rows[i]: [T, d], the i-th
        anchor that stage produces, in slot order) into `anchors`."""
        for i, j in enumerate(self.stage_slots[stage]):
            r = rows[i]
            self.anchors[j, position:position + r.shape[0]] = r

    def start(self, last_hidden: torch.Tensor, prefill_t0: float, stages: StageRunner) -> None:
        """After the prompt's prefill: `last_hidden` [1, d] is the last prompt row's final state.
        The target picks the first token, the drafter caches the prompt's depth-n features, and
        the first token enters `stages` alone. The decode clock starts here."""
        t, n, P = self.target, self.n, self.prompt_len
        self.stages = stages
        first = pick(t.logits(last_hidden)[0], self.sampling, self.gen)
        self.drafter.prefill(self.anchors[:, :P], self.type_of_depth[n].repeat(P))
        self.stats.prefill_s = time.perf_counter() - prefill_t0
        self._emit(first)
        self.sched.seed(P, drafter_valid=P)
        self.enter(P, first)
        self._decode_t0 = time.perf_counter()

    def finish(self, at: float | None = None) -> None:
        """Stop the decode clock (now, or at the perf_counter time `at`)."""
        self.stats.decode_s = (time.perf_counter() if at is None else at) - self._decode_t0
        self.stats.new_tokens = len(self.out)

    # --- the cycle ------------------------------------------------------------------------------
    def run(self) -> None:
        """Decode cycles (on the stages `start` was given) until the stop rule or the budget
        ends the sequence."""
        stages, sched = self.stages, self.sched
        while not self.done:
            self.stats.K += 1
            cycle = self.stats.K
            stages.begin(cycle)
            # 1. Draft the successor of the newest token from pre-step features (those of the
            #    stage steps up to last cycle), beside 2. every in-flight token's next stage.
            #    Post-step drafting (an ablation) waits for this cycle's steps.
            if not self.post_step:
                draft = self.draft(0)
            work = sched.stage_work()
            self.stats.stage_rows += self.work_rows(work)
            stages.advance(cycle, work, self.sampling.greedy and sched.full)
            if self.post_step:
                draft = self.draft(1)
            if not sched.full:  # filling: nothing leaves the pipeline this cycle
                self.fill(draft)
            else:
                # 3. The oldest token left the last stage; its state judges the next one.
                # 4. Accept: the draft enters. Reject: roll back, the correction enters alone.
                stages.announce(cycle, sched.newest + 1, draft)
                self.commit(stages.verdict(self), draft)
            stages.end(cycle)

    def enter(self, position: int, token) -> None:
        """`token` (an int, or a 0-d device tensor: no host sync) enters stage 0 at depth 0: only
        its embedding (anchor 0) exists. An int (the first token, a correction) enters as a view
        of `ints`, on every runner: no Python value is copied to the device."""
        if not isinstance(token, torch.Tensor):
            token = self.on_device(token)
        self.tokens[position] = token
        self.host_tokens.wrote(position, position + 1)
        self.anchors[0, position] = self.target.embed_tokens(
            self.tokens[position:position + 1])[0]
        self.stages.enter(position, token)

    def draft(self, extra_depth: int) -> Draft:
        """The drafter's guess for the successor of the newest in-flight token, from features
        `extra_depth` stages deeper than the schedule's depths (0: pre-step, 1: post-step)."""
        sched = self.sched
        # the anchor rows of this cycle's stage steps (post-step) or up to the last one's
        self.stages.features(self.stats.K - 1 + extra_depth)
        t0 = time.perf_counter()
        with self.stages.drafting(), self.timer("draft"):
            rows = sched.draft_rows()
            key = (sched.start - rows.start, sched.count, extra_depth)
            types = self._row_types.get(key)
            if types is None:  # more rows under the window than the schedule keeps
                types = self._row_types[key] = self._deeper_types(*key)
            # a cycle's uniforms, drawn every cycle whether or not it judges (so the device
            # loop, which cannot skip a draw, draws the same): the draft's, the verifier's two
            u = self.uniforms = torch.rand(3, generator=self.gen, device=self.gen.device)
            draft = self.drafter.draft(self.anchors[:, rows.start:rows.stop], types, rows.start,
                                       sched.newest + 1, self.sampling, u[0])
            from_lookup = False
            if self.lookup is not None:
                draft, from_lookup = self._lookup(sched.newest + 1, draft)
            self.pending[sched.newest + 1] = PendingDraft(sched.count, draft.q, draft.q_ids,
                                                          from_lookup)
            self.stats.draft_calls += 1
            sched.after_draft()
        self.draft_s.append(time.perf_counter() - t0)
        self.stages.drafted(draft)
        return draft

    def _deeper_types(self, below: int, count: int, extra: int) -> torch.Tensor:
        """The row types of a staircase `_staircase_types` has no table for: `below` rows of
        depth n before the in-flight ones, from device tensors alone (no copy)."""
        if below < 0 or count < 1 or (0, count, extra) not in self._row_types:
            raise InternalError("a staircase the schedule cannot draft", below=below,
                                count=count, extra=extra)
        return torch.cat([self.type_of_depth[self.n:].expand(below),
                          self._row_types[0, count, extra]])

    def _lookup(self, position: int, draft: Draft) -> tuple[Draft, bool | torch.Tensor]:
        """The context lookup's token for `position` in place of the drafter's, when the text
        so far ends with a match the gate trusts more than the drafter (spd.draft.lookup), and
        whether it was used. Under sampling q is one-hot on the lookup's token, so rejection
        sampling stays exact."""
        # The in-flight tokens past the committed ones, from the host mirror: they were drafted
        # a cycle or more ago, so reading them waits for nothing on the device.
        in_flight = self.host_tokens.read(len(self.lookup), position)
        found = self.lookup.propose(self.lookup.context(in_flight))
        if found is None:
            return draft, False
        token, match_len = found
        q, q_ids = None, None
        if not self.sampling.greedy:
            q, q_ids, draft = self._one_hot(token, draft)
        trust = self.lookup.trust(match_len)
        used = self.lookup_used.buf[position:position + 1]
        if draft.p is None or trust >= 1.0:  # a drafter without a confidence: the match wins
            used.fill_(True)  # in place: the value rides in the fill's arguments, no copy
            self.lookup_used.wrote(position, position + 1)
            return Draft(self.on_device(token), q, q_ids=q_ids), True
        # Gate on the device (the PDM's token and confidence stay there: no host sync); the
        # choice reaches the host through a mirror by the time the draft is judged (stats).
        use = draft.p < trust
        used.copy_(use.view(1))
        self.lookup_used.wrote(position, position + 1)
        return Draft(torch.where(use, self.on_device(token), draft.token),
                     None if q is None else torch.where(use, q, draft.q), q_ids=q_ids), True

    def _one_hot(self, token: int, draft: Draft):
        """(q, q_ids, draft) for the lookup's proposal of `token` under sampling: q one-hot on
        it, over the drafter's columns when the token is one of them (q_ids its map, the
        verifier maps it), else over every target id, the drafter's q scattered there too
        (the rare token outside the draft vocabulary)."""
        column_of = getattr(self.drafter, "draft_column", None)
        column = column_of(token) if column_of is not None and draft.q_ids is not None else None
        if column is not None:
            return self._one_hot_at(column, draft.q.shape[0]), draft.q_ids, draft
        q = self._one_hot_at(token, self.target.vocab_size)
        if draft.q is not None and draft.q_ids is not None:
            full = torch.zeros_like(q).index_copy_(0, draft.q_ids, draft.q)
            draft = Draft(draft.token, full, draft.p)
        return q, None, draft

    def _one_hot_at(self, index: int, size: int) -> torch.Tensor:
        """float32 [size], 1 at `index` and 0 elsewhere, compared on the device (`q[index] = 1`
        would copy a Python value there)."""
        return (self.ints[:size] == self.on_device(index)).to(torch.float32)

    def fill(self, draft: Draft) -> None:
        """Filling cycle: nothing left the pipeline, the draft enters at depth 0."""
        self.sched.refill()
        self.enter(self.sched.newest, draft.token)

    def judge(self, hidden: torch.Tensor) -> Verdict:
        """Rejection sampling (or the greedy argmax) of the next in-flight token, judged by the
        final state `hidden` [1, d] of the one that left the last stage."""
        with self.timer("verify"):
            judged = self.sched.judged
            pending = self.pending[judged]
            return verify(self.target, hidden, self.tokens[judged:judged + 1], pending.q,
                          self.sampling, self.uniforms[1:], pending.q_ids)

    def commit(self, verdict: Verdict, draft: Draft) -> None:
        """Commit the judged token. Accept: this cycle's draft enters stage 0 next. Reject: the
        in-flight tokens and the draft are dropped, every target cache rolls back to the
        committed length, and the correction enters alone."""
        judged = self.sched.judged
        pending = self.pending.pop(judged)  # every judged token was drafted
        used = pending.from_lookup and self.lookup_used.read(judged, judged + 1)[0]
        self.stats.count_draft(pending.fill, verdict.accepted, used)
        self.stats.N += 1
        self._emit(verdict.token)
        if verdict.accepted:
            self.sched.accept()
            if not self.done:
                self.enter(self.sched.newest, draft.token)
            return
        with self.timer("rollback"):
            self.sched.reject()
            self.pending.clear()
            self.stages.rollback(judged)
        if not self.done:
            self.enter(judged, verdict.token)

    def _emit(self, token: int) -> None:
        self.out.append(token)
        if self.lookup is not None:
            self.lookup.append(token)
        self.done = self.stop.feed(token) or len(self.out) >= self.max_new
        if self.on_token:
            self.on_token(token)
