"""The decode cycle, written once: every feature, every runtime, decided on the device.

README, "How a cycle works", as fixed-shape device work whose outcome is data:

  state   `Cycle.state` int64: committed positions, the newest in flight, done, the counts K, N
          and stage rows, this cycle's committed token, the cycle number, the end cycle, the
          lookup's counts, then the judged and accepted drafts by draft position [n + 1, 2];
          `units` [n, H]: the unit each stage runs this cycle (spd.runtime.unit); the lanes of
          the positions in flight (spd.runtime.drafting.Lanes). The buffers are the
          sequence's (spd.runtime.sequence).
  cycle   1. the drafter drafts the children of the newest position from the window's pre-step
             features (spd.runtime.drafting), beside
          2. every stage running its unit (`stages`: in this process, each on a stream of its
             own, or on the stage ranks: spd.distributed.pipeline); their anchor rows and
             outputs land where each row lives (`keep`);
          3. the position after the one that left the last stage is judged: greedy, the target's
             argmax among its live rows; sampling, rejection sampling (a chain) or the tree's
             recursive rejection against point masses;
          4. accept: the rows not descending from the accepted one are dropped, and the
             children enter (unless the accepted branch ends before the newest position: then
             nothing enters, a gap); reject: the correction enters alone. A rollback is only the
             lower position of the unit that enters: every cache takes its length from it.
          Post-step drafting (an ablation) drafts after step 2, one stage deeper.
  graph   on a GPU (spd.runtime.cycle_graph) the first cycle runs eagerly, the second is
          captured as one CUDA graph, every later cycle is one replay; SPD_REPLAY_CHECK=1
          checks on any device that every steady cycle is the same work.
  host    `run` drives the cycles (spd.runtime.driver): the committed token of each cycle for
          streaming and stop strings, and whether the decode ended. Cycles past the end change
          nothing (`done` gates every update). On a CPU, where reading is free, a cycle looks
          at its units before the stages run and skips the dead ones (`Pipeline.peek`).

Draws: a sampled decode takes W + 2 uniforms every cycle (the draft's, then the verifier's:
two for a chain, W + 1 for a tree), judged or not, in every runtime: Philox of its seed at
cycle * (W + 2) + j (spd_kernels.philox), drawn by the op that opens the cycle, so that a
sequence draws the same alone and in any batch, with no generator a graph must track. A greedy
one draws none.

The control is three ops over a batch: a chain's spd_kernels.control (cycle_open lays the
cycle out, cycle_candidate picks what enters and what is judged, cycle_commit judges and
commits), a token tree's spd_kernels.tree_control (tree_open, tree_children after the draft
step's top children, tree_commit). Between them only the judge runs: the target's logits of the
judged row and a verdict (a greedy chain's comes from its last stage). A sequence's rows are
its slot's of a ChainControl or TreeControl (spd.runtime.control), a batch of one when it
decodes alone.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from spd.draft.lookup import trust_tables
from spd.errors import InternalError
from spd.runtime.control import ChainControl, Control, TreeControl
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.drafting import Drafting, Lanes
from spd.runtime.driver import STOP, Published, drive, peek
from spd.runtime.unit import UnitFormat
from spd.runtime.verdict import vocab_ids
from spd_kernels import rejection_sample_logits, tree_rejection_sample
from spd_kernels.control import (
    C_TOK,
    COMMITTED,
    CYCLE,
    DONE,
    EMITTED,
    END_CYCLE,
    LOOKUP_ACCEPTED,
    LOOKUP_JUDGED,
    NEWEST,
    STAGE_ROWS,
    TOKEN,
    K,
    N,
    cycle_candidate,
    cycle_commit,
    cycle_open,
)
from spd_kernels.control import STATE as FIELDS
from spd_kernels.tree_control import judge_fields, tree_children, tree_commit, tree_open, tree_unit

DEFAULT_AHEAD = 2


def end_margin(n: int, ahead: int) -> int:
    """The cycles from the one that ends a decode to the end cycle every rank stops at: n +
    ahead + 1 (Cycle's docstring)."""
    return n + ahead + 1


class Roles:
    """The cycle's roles (0: the drafter, i + 1: the i-th stage of this process), each on its own
    CUDA stream, forked from the current stream at a cycle's start and joined before its
    verdict: hand-offs by events, so a captured cycle is one graph with a branch per role. On a
    CPU every method does nothing."""

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


class Cycle:
    """Runs a sequence's cycles on the device with `stages` (spd.runtime.engine.LocalStages,
    or the stage ranks: spd.distributed.draft_rank.RemoteStages), launching up to `ahead`
    cycles past the one the host reads.

    With peers in lock-step (`stages.lockstep`), the end is a cycle number, END: set on the
    device in the cycle that ends the decode (or by the host at a stop string or a cancel,
    `_stop_at`) to `margin` = n + ahead + 1 cycles past the next one, it travels with the
    units from the next cycle on, and every rank launches exactly the cycles before it (stage s
    learns it s cycles after stage 0, and reads it `ahead` cycles after that: it knows the end
    before it launches the last cycle, which sends nothing on)."""

    def __init__(self, seq, stages, ahead: int = DEFAULT_AHEAD,
                 control: Control | None = None, slot: int = 0):
        """control: a batch's ChainControl (a chain) or TreeControl (a token tree) whose slot
        `slot` this sequence's rows are (None: a batch of one of its own)."""
        if ahead < 0:
            raise InternalError("a negative number of cycles ahead", ahead=ahead)
        n, W, dev = seq.n, seq.width, seq.device
        self.seq, self.stages, self.n, self.W, self.ahead = seq, stages, n, W, ahead
        self.tree, self.R = W > 1, n + 1
        self.margin = end_margin(n, ahead)
        self.fmt = UnitFormat(n, W)
        self.launching = 0  # the cycle being launched
        if control is None:
            m, _, d = seq.anchors.shape
            control = (TreeControl(1, n, W, m, d, dev, seq.anchors.dtype) if self.tree
                       else ChainControl(1, n, m, d, dev, seq.anchors.dtype))
        self.ctl, self.at = control, slice(slot, slot + 1)
        control.take(slot, seq)
        rows = control.rows(slot)
        self.state, self.units = rows["state"], rows["units"]
        self.rows = rows["rows"]  # [n, W]: where each stage's unit rows land (the open writes)
        self.lanes = Lanes(n, W, rows["lanes"])
        self.by_position = self.state[len(FIELDS):].view(n + 1, 2)
        self.drafting = Drafting(seq)
        self.q_ids: torch.Tensor | None = None  # a sampled chain's q columns' target ids
        # the context lookup's trust by match length, and its logs (a tree's children take
        # them whether it looks up or not)
        self.trust, self.log_trust = (trust_tables(dev) if seq.lookup_min or self.tree
                                      else (None, None))
        self.no_draft = torch.zeros(1, dtype=torch.int64, device=dev)  # greedy tree's judge
        self.embed_weight = seq.target.embed.weight
        if not isinstance(seq.target.embed, torch.nn.Embedding):
            raise InternalError("the cycle embeds entering tokens as rows of an nn.Embedding",
                                embedding=type(seq.target.embed).__name__)
        self.published = Published(ahead + 1, self.state.numel(), dev)
        self.roles = Roles(dev, 1 + len(stages.local))
        # a CPU skips a finished decode's cycles (no peers wait for them)
        self.skip_done = stages.peek and not stages.lockstep
        self.graph = CycleGraph(self.cycle, dev, "decode cycle", replayable=stages.replayable,
                                capturable=stages.capturable, messages=stages.messages,
                                thread_local=stages.lockstep)
        self.cycles = 0
        self.counted: list[int] | None = None  # the counts of the last cycle read
        self.draft_s = 0.0  # the draft step's host time (a CPU's: where it runs as called)
        self.read_at: list[float] = []  # when the host read each cycle's state
        self.done_at: float | None = None  # when the host read the cycle that ended the decode

    # --- units ---------------------------------------------------------------------------------
    def _first_unit(self, pos, live, tok, alive, prefix) -> torch.Tensor:
        """A unit header [H] (spd.runtime.unit) of `begin`: at pos, live or not, committed (the
        first token at its position), rows tok and alive [W], the committed prefix (0-d each
        but tok and alive); it carries no commit."""
        trash = torch.tensor(self.seq.trash, device=self.seq.device)
        end = self.state[END_CYCLE]
        if self.tree:
            return tree_unit(pos, end, live, live, tok, alive, prefix, trash, trash, trash,
                             self.seq.capacity, self.n)
        return torch.stack([pos, end, live.long(), prefix, trash, trash, tok[0]])

    def keep(self, s: int, anchors, out: torch.Tensor) -> None:
        """Stage s's rows this cycle (anchors: its anchor rows, each [W, d], in slot order; out:
        its output [W, d], or None where nothing reads it) where its unit's rows live
        (`rows`)."""
        seq, at = self.seq, self.rows[s]
        for i, j in enumerate(seq.stage_slots[s]):
            seq.anchors[j].index_copy_(0, at, anchors[i])
        if s == self.n - 1 and out is not None:
            seq.final.index_copy_(0, at, out)

    # --- the cycle -------------------------------------------------------------------------------
    def begin(self) -> None:
        """After `Sequence.start`: the first token is the only unit in flight (stage 0's);
        stage s > 0 runs a dead unit at P + s in cycle 0 (rewritten before anything reads it)."""
        seq, st, dev, W = self.seq, self.state, self.seq.device, self.W
        P = seq.prompt_len
        st[COMMITTED].fill_(P + 1)
        st[NEWEST].fill_(P)
        st[DONE].fill_(int(seq.done))
        st[CYCLE].fill_(0)  # (a batch's commits counted its slot's cycles while it prefilled)
        one = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731 (set-up)
        first = seq.tokens[P:P + 1].expand(W)
        lane0 = torch.arange(W, device=dev) == 0
        self.units[0] = self._first_unit(one(P), one(1).bool(), first, lane0, one(P))
        for s in range(1, self.n):
            self.units[s] = self._first_unit(one(P + s), one(0).bool(), first, lane0 & False,
                                             one(P + 1))
        self.lanes.write(one(P), first, lane0, lane0 & False, one(1),
                         (torch.zeros_like(first), torch.zeros(W, device=dev), one(0),
                          torch.zeros(W, self.R, dtype=torch.int64, device=dev))
                         if self.tree else None)

    def cycle(self) -> None:
        """One decode cycle (module docstring)."""
        opened = self.open()
        if opened is not None:
            self.close(opened, self.stages.run(self))

    def open(self):
        """The cycle up to its stage steps (with the drafter's pre-step draft): what `close`
        needs after them, or None for a finished decode's cycle that a CPU skips. A batch of
        sequences (spd.runtime.batch_spd) opens each, runs every stage once over all of them,
        and closes each."""
        if self.skip_done and peek(self.state[DONE])[0]:
            self.state[EMITTED].fill_(0)
            return None
        return self._open_tree() if self.tree else self._open_chain()

    def draws(self) -> torch.Tensor | None:
        """Where the open writes this cycle's uniforms: the slot's row [1, W + 2] (module
        docstring); None for a greedy decode, which draws none (its row stays zero)."""
        return None if self.seq.sampling.greedy else self.ctl.draws[self.at]

    def _open_chain(self):
        seq, ctl, at = self.seq, self.ctl, self.at
        cycle_open(ctl.state[at], ctl.units[at], ctl.consts[at], seq.tokens.view(1, -1),
                   seq.anchors.unsqueeze(0), seq.type_of_depth, ctl.plan[at], ctl.window[at],
                   int(seq.post_step), self.draws())
        u = ctl.draws[at.start]
        self.stages.begin(self)
        self.roles.fork()
        draft = None
        if not seq.post_step:
            t0 = time.perf_counter()
            with self.roles.on(0):
                draft = self.drafting.chain(ctl.plan[at], ctl.window[at], u[0])
            self.draft_s += time.perf_counter() - t0
        return draft, u

    def _close_chain(self, opened, verdict: torch.Tensor) -> None:
        """A chain's cycle after its stage steps: the candidate, the judgement, the commit."""
        draft, u = opened
        seq, s, ctl, at = self.seq, self.seq.sampling, self.ctl, self.at
        self.roles.join(*(() if draft is None else (draft.token, draft.q, draft.p)), verdict)
        if seq.post_step:  # features one stage deeper: after this cycle's steps
            t0 = time.perf_counter()
            draft = self.drafting.chain(ctl.plan[at], None, u[0])
            self.draft_s += time.perf_counter() - t0
        q, ring_ids = self.keep_q(draft)
        cycle_candidate(ctl.plan[at], [t[at] for t in ctl.lanes], draft.token.view(1),
                        ctl.cand[at], None if draft.p is None else draft.p.view(1), self.trust,
                        None if q is None else q.view(1, -1), ring_ids,
                        *((None, None) if q is None else (ctl.q_ring[at], ctl.q_judged[at])),
                        *((None, None) if s.greedy else (seq.final.unsqueeze(0),
                                                         ctl.judged_hidden[at])))
        accepted = None
        if not s.greedy:
            verdict, accepted = self.judge_sampled(ctl.judged_hidden[at], ctl.q_judged[at],
                                                   ctl.cand[at, C_TOK], u[1:3].view(1, 2))
        cycle_commit(ctl.state[at], ctl.units[at], ctl.consts[at], ctl.plan[at], ctl.cand[at],
                     [t[at] for t in ctl.lanes], seq.tokens.view(1, -1),
                     seq.anchors[0].unsqueeze(0), self.embed_weight, ctl.stops[at],
                     verdict.view(1), accepted, self.margin)

    def keep_q(self, draft):
        """(q, the target ids of its columns for the ring, or None) of a sampled chain's draft;
        the first one fixes the ring's size: every target id with the context lookup (its
        one-hot proposals), else the drafter's columns."""
        if draft.q is None:
            return None, None
        seq = self.seq
        ring_ids = draft.q_ids if seq.lookup_min else None
        self.ctl.ring(seq.target.vocab_size if ring_ids is not None else draft.q.numel())
        if self.q_ids is None and not seq.lookup_min:
            self.q_ids = draft.q_ids
        return draft.q, ring_ids

    def judge_sampled(self, hidden, q, cand, u):
        """Rejection sampling of rows: hidden [R, d] the final rows before the judged
        positions, q [R, Vr] their draft distributions, cand [R] the candidates, u [R, 2] the
        draws -> (the committed tokens [R], accepted [R])."""
        return self.reject(self.seq.target.judge_logits(hidden), q, cand, u)

    def reject(self, logits, q, cand, u):
        """`judge_sampled` from the target's logits [R, V] of the judged rows, with this
        sequence's sampling."""
        s = self.seq.sampling
        ids = self.q_ids if self.q_ids is not None else vocab_ids(logits.shape[-1],
                                                                  logits.device)
        return rejection_sample_logits(logits, q, ids, cand, u, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p)

    def close(self, opened, verdict: torch.Tensor) -> None:
        """The cycle after its stage steps (`verdict`: a greedy chain's argmax of the last
        stage): the roles joined, a post-step draft, the judgement and the commit."""
        if self.tree:
            return self._close_tree(opened, verdict)
        return self._close_chain(opened, verdict)

    # --- a token tree ----------------------------------------------------------------------------
    def _open_tree(self):
        seq, ctl, at = self.seq, self.ctl, self.at
        tree_open(ctl.state[at], ctl.units[at], ctl.consts[at], [t[at] for t in ctl.lanes],
                  seq.tokens.view(1, -1), seq.anchors.unsqueeze(0), seq.type_of_depth,
                  ctl.tplan[at], ctl.mask[at], ctl.window[at], int(seq.post_step), self.draws())
        u = ctl.draws[at.start]
        self.stages.begin(self)
        self.roles.fork()
        ctl.tops(seq.drafter.tree_top_k(self.W))
        if not seq.post_step:
            t0 = time.perf_counter()
            with self.roles.on(0):
                self.drafting.tree(ctl.tplan[at], ctl.mask[at], ctl.window[at],
                                   ctl.top_rows(self.at.start))
            self.draft_s += time.perf_counter() - t0
        return u

    def _close_tree(self, opened, verdict: torch.Tensor) -> None:
        """A token tree's cycle after its stage steps: the children and the judged
        candidates, the judgement, the commit."""
        u = opened
        seq, ctl, at = self.seq, self.ctl, self.at
        self.roles.join(verdict)
        if seq.post_step:  # features one stage deeper: after this cycle's steps
            t0 = time.perf_counter()
            self.drafting.tree(ctl.tplan[at], ctl.mask[at], None, ctl.top_rows(at.start))
            self.draft_s += time.perf_counter() - t0
        lanes = [t[at] for t in ctl.lanes]
        tree_children(ctl.tplan[at], lanes, ctl.top[at], ctl.top_ids[at], ctl.pmax[at],
                      self.trust, self.log_trust, ctl.kids[at], ctl.kid_score[at],
                      ctl.judge[at], seq.final.unsqueeze(0), ctl.judged_hidden[at])
        verdict, accepted = self._judge_tree(u)
        tree_commit(ctl.state[at], ctl.units[at], ctl.consts[at], ctl.tplan[at], ctl.kids[at],
                    ctl.kid_score[at], ctl.judge[at], lanes, seq.tokens.view(1, -1),
                    seq.anchors.unsqueeze(0), self.embed_weight, ctl.stops[at], verdict,
                    accepted, margin=self.margin)

    def _judge_tree(self, u):
        """(the target's token [1], the accepted candidate's index [1] or None: greedy) for
        the judged position, from the final row before it (tree_children copied it)."""
        s, t = self.seq.sampling, self.seq.target
        hidden = self.ctl.judged_hidden[self.at]                            # [1, d]
        if s.greedy:
            token, _ = t.verify_greedy(hidden, self.no_draft)
            return token, None
        cands = judge_fields(self.ctl.judge[self.at], self.W)["cands"]      # [1, W]
        return tree_rejection_sample(t.judge_logits(hidden), cands, u[1:].view(1, -1),
                                     s.temperature, s.top_k, s.top_p)

    # --- the host's side -------------------------------------------------------------------------
    def launch(self, cycle: int, end: int | None = None) -> None:
        """Cycle number `cycle` (from 0): a replay of the captured cycle where there is one. The
        last cycle before the end (`end`, once known) sends nothing on from a stage of this
        process: it runs eagerly."""
        self.launching = cycle
        last = self.stages.lockstep and end is not None and cycle == end - 1
        self.stages.last = last
        if last and self.stages.local:
            self.cycle()
        else:
            self.graph.launch()
        self.published.publish(cycle, self.state)

    def _stop_at(self, cycle: int) -> None:
        """The host ends the decode (the first token ended it, a stop string, a cancel) before
        launching `cycle`: the cycles from there change nothing, and unless the device has set
        the end already, it is `margin` cycles past the next one (the units made in `cycle`
        carry it)."""
        st = self.state
        st[DONE].fill_(1)
        st[END_CYCLE] = torch.where(st[END_CYCLE] == 0, cycle + 1 + self.margin, st[END_CYCLE])

    def run(self) -> None:
        """Cycles until the device or the host (a stop string, a cancel) ends the decode; with
        peers in lock-step, then on to the end cycle."""
        seq, lockstep = self.seq, self.stages.lockstep
        self.begin()
        if seq.done:
            self.done_at = time.perf_counter()
            if not lockstep:
                return
            self._stop_at(0)  # the first token ended it: the peers still run to the end
        self.cycles = drive(self.launch, self.read, self.ahead)
        self.finish()

    def read(self, c: int):
        """What cycle c published, to the host: its committed token emitted (stop strings, the
        callback), the end checked -> `drive`'s answer (STOP, the end cycle, or None)."""
        seq, lockstep = self.seq, self.stages.lockstep
        got = self.published.read(c)
        self.read_at.append(time.perf_counter())
        if not seq.done:
            self.counted = got
            if got[EMITTED]:
                seq.emit(got[TOKEN])
            if got[DONE] and not seq.done:
                raise InternalError("the device ended the decode where the host's stop "
                                    "rule did not", token=got[TOKEN], emitted=len(seq.out))
            if seq.done:
                self.done_at = time.perf_counter()
                if lockstep and not got[DONE]:
                    self._stop_at(c + 1 + self.ahead)
        if not lockstep:
            return STOP if seq.done else None
        return got[END_CYCLE] or None

    def finish(self) -> None:
        """The last read cycle's counts into the sequence's stats."""
        if self.counted is not None:
            self._count(self.counted)

    def _count(self, got: list[int]) -> None:
        """The last read cycle's counts into the sequence's stats."""
        stats = self.seq.stats
        if self.seq.device.type == "cpu":  # (on a GPU a replay runs it: not timed apart)
            stats.phase_s["draft"] = self.draft_s
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

