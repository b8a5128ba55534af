"""The chain's decode cycle with its control on the device: no host read in a steady cycle.

`SequenceDecode.run` decides every cycle on the host: it reads the verdict, then branches. Here
the same cycle (README, "How a cycle works") is fixed-shape device work whose outcome is data:

  state   int64 [FIELDS + 2 (n + 1)] on the device: the schedule (start, count), done, the
          counts K, N and stage rows, this cycle's committed token, the judged and accepted
          drafts by draft position. The buffers are the decode's own (SequenceDecode).
  cycle   1. the drafter reads the n + 1 rows that end at the newest token: a fixed window (the
             rows under the in-flight ones are committed, with depth-n features, and recompute
             to what the cache holds), so its shape never changes;
          2. every stage runs one row: its in-flight token, or a *bubble* at the position past
             the newest (filling, or after a rejection). A bubble's rows are never read: every
             row it writes is rewritten by the token that enters there before anything reads it;
          3. the last stage judges the token after the one that left it (used when full);
          4. accept, reject or fill: the entering token, its position and the new schedule are
             selections by the verdict. A rollback is only the lower position: each cache takes
             its length from the position of the row it writes.
          Steps 1 and 2 touch disjoint buffers (the drafter reads a copy of its window), so on
          a GPU each role runs on its own stream (`Roles`): the in-process transport of one
          GPU, the cycle as long as its slowest role plus the commit.
  graph   on a GPU (spd.runtime.cycle_graph), the first cycle runs eagerly (it warms every
          kernel up), the second is captured as one CUDA graph, and every cycle from then on
          is one replay: the steps' own graphs step aside during that capture, which records
          their eager steps. A capture that fails warns once and the cycles run eagerly:
          slower, never wrong. SPD_REPLAY_CHECK=1 checks on any device that every steady
          cycle is the same work as the one captured.
  host    launches cycles up to `ahead` ahead of the last one it has read, and reads each
          cycle's state from pinned memory behind an event (on a CPU, a plain copy): the
          committed token for streaming and stop strings, and whether the decode ended. Cycles
          launched past the end change nothing (`done` gates every update); tokens past a stop
          string are never emitted.

Greedy and seeded sampling give the tokens, N, K and judged/accepted drafts of `SequenceDecode.run`
with drafters that read no features (ReferenceDrafter), and the target's tokens with the PDM
(whose window recomputes committed rows, equal up to the kernels' rounding). What runs on the
host loop instead (`unsupported`): token trees, post-step features, hybrid
targets (their recurrent states roll back explicitly), prompts shorter than n.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from spd.draft.drafters import Draft
from spd.draft.lookup import TRUST, propose_on_device
from spd.errors import InternalError
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.host_mirror import Published
from spd.runtime.verdict import judge_on_device

if TYPE_CHECKING:
    from spd.runtime.sequence import SequenceDecode, StageRunner

# the fields of the state vector, in order (then by_position [n + 1, 2]: judged, accepted)
FIELDS = ("start", "count", "done", "K", "N", "stage_rows", "emitted", "token", "cycle", "end",
          "lookup_judged", "lookup_accepted")
(START, COUNT, DONE, K, N, STAGE_ROWS, EMITTED, TOKEN, CYCLE, END, LOOKUP_JUDGED,
 LOOKUP_ACCEPTED) = range(len(FIELDS))
DEFAULT_AHEAD = 2


def unsupported(dec: SequenceDecode) -> str | None:
    """Why `dec` cannot run on the device loop (it runs on the host loop), or None."""
    if getattr(dec, "width", 1) > 1:
        return "token trees"
    if dec.post_step:
        return "post-step drafting"
    if dec.target.hybrid:
        return "hybrid targets"
    if dec.prompt_len < dec.n:
        return f"prompts shorter than n = {dec.n} tokens"
    if not getattr(dec.drafter, "device_loop", False):
        return f"the drafter {type(dec.drafter).__name__}"
    return None


class Roles:
    """The cycle's roles (0: the drafter, s + 1: stage s), each on its own CUDA stream of this
    process, forked from the current stream at a cycle's start and joined before its verdict:
    hand-offs by events (wait_stream), so a captured cycle is one graph with n + 1 branches.
    On a CPU every method does nothing."""

    def __init__(self, device: torch.device, count: int):
        self.cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) for _ in range(count)] if self.cuda else []

    def fork(self) -> None:
        if self.cuda:
            main = torch.cuda.current_stream()
            for stream in self.streams:
                stream.wait_stream(main)

    def on(self, role: int):
        return torch.cuda.stream(self.streams[role]) if self.cuda else nullcontext()

    def join(self, *made) -> None:
        """The current stream waits for every role; `made`: tensors a role made that it reads
        (so the allocator keeps them until it has)."""
        if self.cuda:
            main = torch.cuda.current_stream()
            for stream in self.streams:
                main.wait_stream(stream)
            for x in made:
                if isinstance(x, torch.Tensor):
                    x.record_stream(main)


class LocalCycleStages:
    """The stages of this process (the engine's LocalStages: its `stages`, `carry` and
    `anchor_layers`), each run on role s + 1's stream: DeviceLoop's in-process transport."""

    lockstep = False  # the host stops launching when it reads the end (no peers to keep in step)
    replayable = capturable = True  # the whole cycle is one CUDA graph on a GPU (CycleGraph)
    messages = None  # no peers
    in_process = True  # each stage runs on a stream of its own (DeviceLoop.roles)

    def __init__(self, runner: StageRunner):
        self.runner, self.carry = runner, runner.carry

    def begin(self, loop: DeviceLoop, at: torch.Tensor) -> None:
        """Before the draft step: nothing to start (`run` runs the stages)."""

    def run(self, loop: DeviceLoop, at: torch.Tensor):
        """Stage s runs its row at position at[s] ([n] int64) -> the greedy verdict (the last
        stage judges the token after its row: token [1], accepted [1]), or None (sampling)."""
        verdict = None
        for s in range(loop.n):
            with loop.roles.on(s + 1):
                got = self._stage(loop.dec, s, at[s:s + 1])
            verdict = got if got is not None else verdict
        return verdict

    def _stage(self, dec: SequenceDecode, s: int, p: torch.Tensor):
        """Stage s's step of the row at position p [1]: its anchors and output kept."""
        runner = self.runner
        last_greedy = dec.sampling.greedy and s == dec.n - 1
        x = (dec.anchors[0] if s == 0 else runner.carry).index_select(0, p)
        judge = dec.tokens.index_select(0, p + 1) if last_greedy else None
        outs, verdict = runner.stages[s].run(x, p, judge)
        for i, j in enumerate(dec.stage_slots[s]):
            dec.anchors[j].index_copy_(0, p, outs[runner.anchor_layers[s][i]])
        runner.carry.index_copy_(0, p, outs[-1])
        return verdict


class DeviceLoop:
    """Runs `dec`'s decode cycles on the device with `stages` (LocalCycleStages, or the stage
    ranks: spd.distributed.device_cycle), launching up to `ahead` cycles past the one the host
    reads (0: it reads each cycle before the next one starts).

    With peers in lock-step (`stages.lockstep`: every rank runs the same cycles, as point-to-
    point messages must pair), the end is a cycle number, END: set on the device in the cycle
    that ends the decode (or by the host at a stop string or cancel, `_stop_at`) to a cycle
    `margin` past it, it travels with the units, and every rank launches exactly the cycles
    before it. `margin` = n + ahead + 1 covers the latest rank: stage s learns END s cycles
    after stage 0, and reads it `ahead` cycles after that."""

    def __init__(self, dec: SequenceDecode, stages, ahead: int = DEFAULT_AHEAD):
        why = unsupported(dec)
        if why is not None:
            raise InternalError("the device loop was given a decode it cannot run", why=why)
        if ahead < 0:
            raise InternalError("a negative number of cycles ahead", ahead=ahead)
        n, dev = dec.n, dec.target.device
        self.dec, self.stages, self.n, self.ahead = dec, stages, n, ahead
        self.margin = n + ahead + 1
        self.launching = 0  # the number of the cycle being launched (the units' epochs)
        self.state = torch.zeros(len(FIELDS) + 2 * (n + 1), dtype=torch.int64, device=dev)
        self.by_position = self.state[len(FIELDS):].view(n + 1, 2)
        self.offsets = torch.arange(-n, 1, device=dev)  # the drafter's window, newest last
        self.stage_ids = torch.arange(n, device=dev)
        # per position: the tokens in flight when it was drafted (its draft position)
        self.fill_at = torch.zeros(dec.buffer_rows, dtype=torch.int64, device=dev)
        # the draft distributions awaiting judgement, by position mod n + 1 (sampling)
        self.q_ring: torch.Tensor | None = None
        self.q_ids: torch.Tensor | None = None
        # the context lookup (spd.draft.lookup), on the device: its gate's trust by match
        # length, and per position whether the draft used its token
        self.lookup_min = dec.lookup.min_len if dec.lookup is not None else 0
        if self.lookup_min:
            self.trust = torch.tensor(TRUST, device=dev)
            self.used_at = torch.zeros(dec.buffer_rows, dtype=torch.bool, device=dev)
        self.stop_ids = torch.tensor(sorted(dec.stop.stop_ids) or [-1], dtype=torch.int64,
                                     device=dev)
        # the decode's own generator, on its device: the host loop's draws, in its order
        self.gen = dec.gen
        self.published = Published(ahead + 1, self.state.numel(), dev)  # what the host reads
        # the drafter's stream, and each stage's when the stages run in this process
        self.roles = Roles(dev, 1 + (n if stages.in_process else 0))
        # the cycle: one CUDA graph's replays on a GPU from the second cycle on
        self.graph = CycleGraph(self.cycle, dev, "decode cycle", replayable=stages.replayable,
                                capturable=stages.capturable,
                                generators=(self.gen,) if dev.type == "cuda" else (),
                                messages=stages.messages, thread_local=stages.lockstep)
        self.cycles = 0  # launched, when `run` returns
        self.read_at: list[float] = []  # when the host read each cycle's state
        self.done_at: float | None = None  # when the host read the cycle that ended the decode

    # --- the cycle -----------------------------------------------------------------------------
    def cycle(self) -> None:
        """One decode cycle, every branch a selection on the device (module docstring)."""
        dec, n, st = self.dec, self.n, self.state
        t = dec.target
        start, count = st[START].clone(), st[COUNT].clone()
        live = st[DONE] == 0
        newest = start + count - 1
        u = torch.rand(3, generator=self.gen, device=st.device)
        # 1. Draft the successor of the newest token from the window's pre-step features (a
        #    copy, taken before this cycle's stage steps write there), beside 2. every stage
        #    running its in-flight token, or a bubble past the newest: each role on its own
        #    stream on a GPU, joined before the verdict.
        rows = newest + self.offsets
        depth = torch.where(rows < start, n, newest - rows)
        window, types = dec.anchors.index_select(1, rows), dec.type_of_depth[depth]
        real = (self.stage_ids < count) & live
        at = torch.where(real, newest - self.stage_ids, newest + 1)
        self.stages.begin(self, at)  # (the stage ranks': their units out first)
        self.roles.fork()
        with self.roles.on(0):
            draft = dec.drafter.draft(window, types, rows[:1], newest + 1, dec.sampling, u[0])
        verdict = self.stages.run(self, at)
        self.roles.join(draft.token, draft.q, draft.p, *(verdict or ()))
        if self.lookup_min:
            draft = self._lookup(newest, draft)
        self.fill_at.index_copy_(0, (newest + 1).view(1), count.view(1))
        if draft.q is not None:
            self._keep_q(newest + 1, draft)
        # 3. Judge the token after the one that left the last stage (used when full).
        full = (count == n) & live
        judged = (start + 1).view(1)
        drafted = dec.tokens.index_select(0, judged)  # the judged position's draft [1]
        if verdict is None:  # sampling: rejection sampling here
            q = self.q_ring.index_select(0, judged % (n + 1))
            verdict = judge_on_device(t, self.stages.carry.index_select(0, start.view(1)),
                                      drafted, q, dec.sampling, u[1:], self.q_ids)
        token, ok = verdict[0].view(()), verdict[1].view(()) & full
        # 4. Commit; accept: the draft enters; reject: the correction enters alone, at the
        #    judged position (the caches' lengths follow); filling: the draft enters.
        committed = torch.where(ok, drafted.view(()), token)
        rejected = full & ~ok
        enter_at = torch.where(rejected, judged.view(()), newest + 1)
        enters = torch.where(rejected, committed, draft.token)
        dec.tokens.index_copy_(0, enter_at.view(1), enters.view(1))
        dec.anchors[0].index_copy_(0, enter_at.view(1), t.embed_tokens(enters.view(1)))
        self.by_position.index_add_(0, self.fill_at.index_select(0, judged),
                                    torch.stack([full, ok]).view(1, 2).to(torch.int64))
        if self.lookup_min:  # the judged draft came from the lookup
            used = self.used_at.index_select(0, judged).view(()) & full
            st[LOOKUP_JUDGED] += used
            st[LOOKUP_ACCEPTED] += used & ok
        made = st[N] + full
        ended = full & ((committed == self.stop_ids).any() | (made + 1 >= dec.max_new))
        st[START] = start + full
        st[COUNT] = torch.where(rejected, 1, torch.where(full | ~live, count, count + 1))
        st[DONE] = (~live | ended).to(torch.int64)
        st[K] += live
        st[N] = made
        st[STAGE_ROWS] += torch.where(live, count, 0)
        st[EMITTED] = full.to(torch.int64)
        st[TOKEN] = committed
        st[CYCLE] += 1
        st[END] = torch.where((st[END] == 0) & ended, st[CYCLE] + self.margin, st[END])

    def _lookup(self, newest: torch.Tensor, draft: Draft) -> Draft:
        """The draft for newest + 1 with the context lookup's token in place of the drafter's
        where the gate trusts it more (SequenceDecode._lookup, as selections); under sampling
        q is one-hot on it."""
        dec = self.dec
        committed = self.state[N] + dec.prompt_len + 1  # the first token, then N committed
        token, length = propose_on_device(dec.tokens, committed, newest, self.lookup_min)
        use = length > 0
        if draft.p is not None:
            use = use & (draft.p < self.trust.index_select(0, length.view(1)).view(()))
        q = draft.q
        if q is not None:  # over the target's vocabulary, one shape every cycle (the token may
            # be outside the drafter's columns); the verifier scatters columns there anyway
            vocab = dec.target.vocab_size
            if draft.q_ids is not None:
                q = torch.zeros(vocab, dtype=q.dtype, device=q.device).index_copy_(
                    0, draft.q_ids, q)
            q = torch.where(use, (dec.ints[:vocab] == token).to(q.dtype), q)
        self.used_at.index_copy_(0, (newest + 1).view(1), use.view(1))
        return Draft(torch.where(use, token, draft.token), q)

    def _keep_q(self, position: torch.Tensor, draft) -> None:
        if self.q_ring is None:  # the first draft fixes q's size (one allocation)
            self.q_ring = torch.zeros(self.n + 1, draft.q.numel(), dtype=torch.float32,
                                      device=draft.q.device)
            self.q_ids = draft.q_ids
        self.q_ring.index_copy_(0, position.view(1) % (self.n + 1), draft.q.view(1, -1))

    def launch(self, cycle: int) -> None:
        """Cycle number `cycle` (from 0): a replay of the captured cycle where there is one."""
        self.launching = cycle
        self.graph.launch()

    @property
    def replays(self) -> int:
        return self.graph.replays

    @property
    def graph_failed(self) -> str | None:
        """Why the cycles run eagerly ("off": graphs are off, or not a GPU), or None."""
        return self.graph.failed

    # --- the host's side -----------------------------------------------------------------------
    def _publish(self, cycle: int) -> None:
        """Cycle `cycle`'s state into its pinned slot, behind the cycle's work."""
        self.published.publish(cycle, self.state)

    def _read(self, cycle: int) -> list[int]:
        """Cycle `cycle`'s published state, waiting for its copy alone (not a stream sync)."""
        return self.published.read(cycle)

    def start(self) -> None:
        """After `SequenceDecode.start`: the schedule's first state."""
        # fills: the values ride in the kernels' arguments (no copy, no sync)
        self.state[START].fill_(self.dec.sched.start)
        self.state[COUNT].fill_(self.dec.sched.count)

    def _stop_at(self, cycle: int) -> None:
        """The host ends the decode (the first token ended it, a stop string, a cancel) before
        launching `cycle`: the cycles from there change nothing, and unless the device has
        set the end already, it is `margin` cycles after this one (class docstring)."""
        st = self.state
        st[DONE].fill_(1)
        st[END] = torch.where(st[END] == 0, cycle + self.margin, st[END])

    def run(self) -> None:
        """Cycles until the device or the host (a stop string, a cancel) ends the decode; with
        peers in lock-step, then on to the end cycle without reading for the decode."""
        dec, lockstep = self.dec, self.stages.lockstep
        self.start()
        if dec.done:
            self.done_at = time.perf_counter()
        if dec.done and lockstep:  # the first token ended it: the peers still run to the end
            self._stop_at(0)
        launched = read = 0
        end: int | None = None
        counted: list[int] | None = None  # the last cycle read for the decode
        while (end is None or launched < end) and (lockstep or not dec.done):
            while launched <= read + self.ahead and (end is None or launched < end):
                self.launch(launched)
                self._publish(launched)
                launched += 1
            got = self._read(read)
            self.read_at.append(time.perf_counter())
            read += 1
            if lockstep and got[END]:
                end = got[END]
            if dec.done:
                continue
            counted = got
            if got[EMITTED]:
                dec._emit(got[TOKEN])
            if got[DONE] and not dec.done:
                raise InternalError("the device loop ended where the host's stop rule did "
                                    "not", token=got[TOKEN], emitted=len(dec.out))
            if dec.done:
                self.done_at = time.perf_counter()
                if lockstep and not got[DONE]:
                    self._stop_at(launched)
        self.cycles = launched
        if counted is not None:
            self._count(counted)

    def _count(self, got: list[int]) -> None:
        """The last read cycle's counts into the decode's stats."""
        stats = self.dec.stats
        stats.K, stats.N, stats.stage_rows = got[K], got[N], got[STAGE_ROWS]
        stats.draft_calls = got[K]
        stats.lookup_judged, stats.lookup_accepted = got[LOOKUP_JUDGED], got[LOOKUP_ACCEPTED]
        by = got[len(FIELDS):]
        for fill in range(self.n + 1):
            judged, accepted = by[2 * fill], by[2 * fill + 1]
            if judged:
                stats.by_position[fill] = [judged, accepted]
            stats.drafts_judged += judged
            stats.drafts_accepted += accepted
