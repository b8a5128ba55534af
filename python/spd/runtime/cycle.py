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

Draws: a sampled decode's generator gives W + 2 uniforms every cycle (the draft's, then the
verifier's: two for a chain, W + 1 for a tree), judged or not, in every runtime; a greedy one
reads none and draws none.

A chain's control is three ops over a batch (spd_kernels.control: cycle_open lays the cycle
out, cycle_candidate picks what enters and what is judged, cycle_commit judges and commits);
its rows are its slot's of a ChainControl (spd.runtime.control), a batch of one when it decodes
alone. A token tree's control is still the torch code here.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from spd.draft.lookup import TRUST
from spd.errors import InternalError
from spd.runtime.control import ChainControl
from spd.runtime.cycle_graph import CycleGraph
from spd.runtime.drafting import Drafting, Lanes
from spd.runtime.driver import STOP, Published, drive, peek
from spd.runtime.unit import LIVE, POS, UnitFormat
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
                 control: ChainControl | None = None, slot: int = 0):
        """control: a batch's ChainControl whose slot `slot` this chain's rows are (None: a
        batch of one of its own). A token tree keeps its control state here."""
        if ahead < 0:
            raise InternalError("a negative number of cycles ahead", ahead=ahead)
        n, W, dev = seq.n, seq.width, seq.device
        self.seq, self.stages, self.n, self.W, self.ahead = seq, stages, n, W, ahead
        self.tree, self.R = W > 1, n + 1
        self.margin = end_margin(n, ahead)
        self.fmt = UnitFormat(n, W)
        self.launching = 0  # the cycle being launched
        self.ctl, self.at = None, slice(slot, slot + 1)
        if self.tree:
            self.state = torch.zeros(len(FIELDS) + 2 * (n + 1), dtype=torch.int64, device=dev)
            self.units = torch.zeros(n, self.fmt.size, dtype=torch.int64, device=dev)
            self.lanes = Lanes(n, W, dev)
        else:
            if control is None:
                m, _, d = seq.anchors.shape
                control = ChainControl(1, n, m, d, dev, seq.anchors.dtype)
            self.ctl = control
            control.take(slot, seq)
            rows = control.rows(slot)
            self.state, self.units = rows["state"], rows["units"]
            self.lanes = Lanes(n, W, dev, chain=rows["lanes"])
        self.by_position = self.state[len(FIELDS):].view(n + 1, 2)
        self.drafting = Drafting(seq, self.lanes)
        self.lane_ids = torch.arange(W, device=dev)
        self.first_lane = self.lane_ids == 0
        self.earlier = self.lane_ids.view(1, -1) < self.lane_ids.view(-1, 1)  # [i, j]: j < i
        self.key_back = torch.arange(n, device=dev)  # a unit's keys: k positions back
        self.steps = torch.arange(1, n, device=dev)  # the positions after a judged one
        self.steps_back = self.steps.view(-1, 1, 1).expand(n - 1, W, 1).contiguous()
        self.stop_ids = torch.tensor(sorted(seq.stop.stop_ids) or [-1], dtype=torch.int64,
                                     device=dev)
        self.q_ids: torch.Tensor | None = None  # a sampled chain's q columns' target ids
        # (the draws of a greedy decode are never read: it takes none)
        self.no_draws = (torch.zeros(W + 2, device=dev) if seq.sampling.greedy else None)
        self.rows = torch.zeros(n, W, dtype=torch.int64, device=dev)  # where unit rows land
        self.trash = torch.tensor(seq.trash, device=dev)  # (made once: no Python value a cycle)
        if not self.tree:
            self._chain_buffers(rows["rows"])
        self.published = Published(ahead + 1, self.state.numel(), dev)
        self.roles = Roles(dev, 1 + len(stages.local))
        # a CPU skips a finished decode's cycles (no peers wait for them)
        self.skip_done = stages.peek and not stages.lockstep
        self.graph = CycleGraph(self.cycle, dev, "decode cycle", replayable=stages.replayable,
                                capturable=stages.capturable,
                                generators=(seq.gen,) if dev.type == "cuda" else (),
                                messages=stages.messages, thread_local=stages.lockstep)
        self.cycles = 0
        self.counted: list[int] | None = None  # the counts of the last cycle read
        self.draft_s = 0.0  # the draft step's host time (a CPU's: where it runs as called)
        self.read_at: list[float] = []  # when the host read each cycle's state
        self.done_at: float | None = None  # when the host read the cycle that ended the decode

    def _chain_buffers(self, rows: torch.Tensor) -> None:
        """A chain's control runs as spd_kernels.control's ops over its slot of the control's
        batch (`self.ctl`, rows `self.at`); rows [n, 1]: where its units' rows land."""
        seq, dev = self.seq, self.seq.device
        self.rows = rows
        self.trust = torch.tensor(TRUST, device=dev) if seq.lookup_min else None
        self.embed_weight = seq.target.embed.weight
        if not isinstance(seq.target.embed, torch.nn.Embedding):
            raise InternalError("the cycle embeds entering tokens as rows of an nn.Embedding",
                                embedding=type(seq.target.embed).__name__)

    # --- units -----------------------------------------------------------------------------------
    def slot(self, position: torch.Tensor, lane) -> torch.Tensor:
        """The buffer row (and K/V slot) of an uncommitted tree row."""
        return self.seq.capacity + (position % self.R) * self.W + lane

    def make_unit(self, pos, live, committed_unit, tok, alive, prefix, cpos, cslot,
                  anc=None) -> torch.Tensor:
        """A unit header [H] (spd.runtime.unit) of device values: its position (0-d), whether
        it is live and committed (one row at its position: the first token, a correction),
        the rows' tokens and liveness [W], the committed prefix (0-d), the commit it carries
        (0-d each) and, for a tree's children, anc [W, n]: each row's lane k positions back."""
        seq = self.seq
        trash = seq.trash
        end = self.state[END_CYCLE:END_CYCLE + 1]
        head = [pos.view(1), end, live.view(1).to(torch.int64), prefix.view(1), cpos.view(1),
                cslot.view(1), tok.view(-1)]
        if self.tree:
            at_pos = committed_unit & self.first_lane
            slots = torch.where(alive, torch.where(at_pos, pos, self.slot(pos, self.lane_ids)),
                                trash)
            back = pos - self.key_back                                   # [n]
            valid = (back >= prefix) & ~committed_unit
            keys = torch.where(valid.view(-1, 1), self.slot(back.view(-1, 1), self.lane_ids),
                               trash)
            keys = torch.where((self.key_back == 0).view(-1, 1) & at_pos, pos, keys)
            own = (self.key_back == 0).view(1, -1, 1) & (self.lane_ids.view(-1, 1, 1)
                                                         == self.lane_ids.view(1, 1, -1))
            mask = own
            if anc is not None:
                mask = mask | (valid.view(1, -1, 1)
                               & (anc.view(self.W, self.n, 1) == self.lane_ids))
            mask = mask & alive.view(-1, 1, 1)
            head += [slots, keys.view(-1), mask.view(-1).to(torch.int64)]
        return torch.cat(head)

    def unit_rows(self, units: torch.Tensor, live: torch.Tensor,
                  committed: torch.Tensor) -> torch.Tensor:
        """[n, W] where each stage's unit rows keep what the stages make of them: a live row's
        buffer row (a tree row committed since its unit was sent: its position), else trash."""
        pos, trash = units[:, POS], self.seq.trash
        if not self.tree:
            return torch.where(live, pos, trash).view(self.n, 1)
        r = pos % self.R
        alive = self.lanes.alive.index_select(0, r) & live.view(-1, 1)
        at_pos = ((pos < committed).view(-1, 1)
                  & (self.lane_ids == self.lanes.clane.index_select(0, r).view(-1, 1)))
        slot = self.slot(pos.view(-1, 1), self.lane_ids)
        return torch.where(alive, torch.where(at_pos, pos.view(-1, 1), slot), trash)

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
        seq, st, dev = self.seq, self.state, self.seq.device
        P = seq.prompt_len
        st[COMMITTED].fill_(P + 1)
        st[NEWEST].fill_(P)
        st[DONE].fill_(int(seq.done))
        one = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731 (set-up)
        first = seq.tokens[P:P + 1].expand(self.W)
        trash = one(seq.trash)
        self.units[0] = self.make_unit(one(P), one(1).bool(), one(1).bool(), first,
                                       self.first_lane, one(P), trash, trash)
        for s in range(1, self.n):
            self.units[s] = self.make_unit(one(P + s), one(0).bool(), one(0).bool(), first,
                                           self.first_lane & False, one(P + 1), trash, trash)
        self.lanes.write(one(P), first, self.first_lane, self.first_lane & False, one(1),
                         (torch.zeros_like(first), torch.zeros(self.W, device=dev), one(0),
                          torch.zeros(self.W, self.R, dtype=torch.int64, device=dev))
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
        seq, n, st = self.seq, self.n, self.state
        if self.skip_done and peek(st[DONE])[0]:
            st[EMITTED].fill_(0)
            return None
        if not self.tree:
            return self._open_chain()
        live = st[DONE] == 0
        committed, newest = st[COMMITTED].clone(), st[NEWEST].clone()
        start = committed - 1
        final = start - st[EMITTED]  # the last cycle's start (drafting: the window)
        u = self.draws()
        ulive = (self.units[:, LIVE] == 1) & live
        occ = torch.where(ulive, self.units[:, POS], -1)   # the position at each depth
        full = occ[n - 1] >= 0
        self.rows = self.unit_rows(self.units, ulive, committed)
        self.stages.begin(self)
        self.roles.fork()
        children = None
        t0 = time.perf_counter()
        if not seq.post_step:
            with self.roles.on(0):
                children = self.drafting.draft(newest, start, final, occ, 0, committed)
            self.draft_s += time.perf_counter() - t0
        return children, u, live, committed, newest, start, final, occ, full

    def draws(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """This cycle's uniforms [W + 2] from the decode's generator (module docstring), into
        `out` where given (a batch's row); a greedy decode reads none, and draws none."""
        seq = self.seq
        if self.no_draws is not None:
            return self.no_draws
        return torch.rand(self.W + 2, generator=seq.gen, device=seq.device, out=out)

    def _open_chain(self):
        seq, ctl, at = self.seq, self.ctl, self.at
        u = self.draws()
        cycle_open(ctl.state[at], ctl.units[at], ctl.consts[at], seq.tokens.view(1, -1),
                   seq.anchors.unsqueeze(0), seq.type_of_depth, ctl.plan[at], ctl.window[at],
                   int(seq.post_step))
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
        s = self.seq.sampling
        logits = self.seq.target.judge_logits(hidden)  # [R, V]
        ids = self.q_ids if self.q_ids is not None else vocab_ids(logits.shape[-1],
                                                                  logits.device)
        return rejection_sample_logits(logits, q, ids, cand, u, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p)

    def close(self, opened, verdict: torch.Tensor) -> None:
        """The cycle after its stage steps (`verdict`: a greedy chain's argmax of the last
        stage): the roles joined, a post-step draft, the judgement and the commit."""
        if not self.tree:
            return self._close_chain(opened, verdict)
        children, u, live, committed, newest, start, final, occ, full = opened
        seq = self.seq
        made = () if children is None else (children.tok, children.q, children.score)
        self.roles.join(*made, verdict)
        if seq.post_step:  # features one stage deeper: after this cycle's steps
            t0 = time.perf_counter()
            children = self.drafting.draft(newest, start, final, occ, 1, committed)
            self.draft_s += time.perf_counter() - t0
        self._commit(children, u, live, committed, newest, full)

    def _judge(self, c_tok, c_alive, start, u):
        """A token tree's (committed token, accepted, lane) of the judged position's candidates
        c_tok [W] (live where c_alive), from the final state of `start`."""
        seq, s = self.seq, self.seq.sampling
        logits = seq.target.logits(seq.final.index_select(0, start.view(1)))  # [1, V]
        if s.greedy:
            target = logits[0].argmax()
            match = c_alive & (c_tok == target)
            return target, match.any(), match.to(torch.int64).argmax()
        # live rows first, in lane order (the order of their scores); a judged position's rows
        # share one parent, so their tokens differ, but a cycle that judges nothing (filling,
        # past the end) may see stale rows: a repeated token is padding there
        order = torch.sort((~c_alive).to(torch.int64), stable=True).indices
        tok, live = c_tok.index_select(0, order), c_alive.index_select(0, order)
        seen = ((tok.view(-1, 1) == tok.view(1, -1)) & live.view(1, -1) & self.earlier).any(1)
        cands = torch.where(live & ~seen, tok, -1)
        tok, which = tree_rejection_sample(logits[0], cands, u[1:], s.temperature, s.top_k,
                                           s.top_p)
        return tok.view(()), (which >= 0).view(()), order.index_select(0, which.clamp(min=0))

    def _commit(self, ch, u, live, committed, newest, full) -> None:
        """A token tree's judgement and commit, and the next cycle's layout: the unit that
        enters stage 0, the lanes, the counts and the state (a chain's: cycle_commit)."""
        seq, L, st, n, W = self.seq, self.lanes, self.state, self.n, self.W
        trash = seq.trash
        start, j = committed - 1, committed
        rj = (j % self.R).view(1)
        count = newest - start + 1
        # 3. the judged position's candidates: its rows in flight, or after a gap this cycle's
        #    children (known before they enter)
        in_flight = j <= newest
        c_tok = torch.where(in_flight, L.tok.index_select(0, rj).view(W), ch.tok)
        c_alive = torch.where(in_flight, L.alive.index_select(0, rj).view(W), ch.alive)
        c_look = torch.where(in_flight, L.look.index_select(0, rj).view(W), ch.look)
        fill = torch.where(in_flight, L.fill.index_select(0, rj).view(()), count)
        token, ok, lane = self._judge(c_tok, c_alive, start, u)
        full = full & live
        ok = ok & full
        rejected = full & ~ok
        acc_in, acc_gap = ok & in_flight, ok & ~in_flight
        made = st[N] + full
        ended = full & ((token == self.stop_ids).any() | (made + 1 >= seq.max_new))
        going = live & ~ended
        # 4. what survives an accepted row: its descendants, up to `keep`
        chosen = self.lane_ids == lane
        L.alive.index_copy_(0, rj, torch.where(acc_in, chosen, L.alive.index_select(0, rj)
                                               .view(W)).view(1, W))
        L.clane.index_copy_(0, rj, torch.where(acc_in, lane, L.clane.index_select(0, rj)
                                               .view(())).view(1))
        # the rows at j + 1 .. j + n - 1 whose ancestor at j is the accepted row live on
        later = j + self.steps
        rl = later % self.R
        descends = L.anc.index_select(0, rl).gather(2, self.steps_back).view(n - 1, W) == lane
        kept = L.alive.index_select(0, rl) & descends & (later <= newest).view(-1, 1)
        L.alive.index_copy_(0, rl, torch.where(acc_in, kept, L.alive.index_select(0, rl)))
        keep = torch.where(acc_in, torch.where(kept.any(1), later, j).amax(), newest)
        leaf = torch.where(newest == j, chosen, kept.index_select(
            0, (newest - j - 1).clamp(min=0).view(1)).view(W))
        child_ok = ch.alive & torch.where(acc_in, leaf.index_select(0, ch.par), True)
        draft_in = going & (~full | (acc_in & (keep == newest))) & child_ok.any()
        commit_in = going & (rejected | acc_gap)
        enters = draft_in | commit_in
        new_newest = torch.where(draft_in, newest + 1,
                                 torch.where(commit_in, j, torch.where(acc_in, keep, newest)))
        enter = torch.where(commit_in, j, torch.where(draft_in, newest + 1, new_newest + 1))
        e_tok = torch.where(commit_in, torch.where(self.first_lane, token, 0), ch.tok)
        e_alive = torch.where(commit_in, self.first_lane, child_ok) & enters
        L.write(enter, e_tok, e_alive, ch.look & ~commit_in, count,
                (ch.par, torch.where(commit_in, 0.0, ch.score), torch.where(commit_in, 0, -1),
                 torch.where(commit_in, 0, ch.anc)))
        # the buffers: the committed token at its position, the entering rows' tokens and
        # embeddings where they live; the accepted row moves to its position
        seq.tokens.index_copy_(0, torch.where(full, j, trash).view(1), token.view(1))
        e_rows = torch.where(e_alive, torch.where(commit_in & self.first_lane, enter,
                                                  self.slot(enter, self.lane_ids)), trash)
        src = self.slot(j, lane).view(1)
        seq.anchors.index_copy_(1, torch.where(acc_in, j, trash).view(1),
                                seq.anchors.index_select(1, src))
        seq.tokens.index_copy_(0, e_rows, e_tok)
        seq.anchors[0].index_copy_(0, e_rows, seq.target.embed_tokens(e_tok))
        # the counts: the judged draft by draft position, the lookup's, N, K, the stage rows
        self.by_position.index_add_(0, fill.view(1),
                                    torch.stack([full, ok]).view(1, 2).to(torch.int64))
        if seq.lookup_min:
            looked = torch.where(ok, c_look.index_select(0, lane.view(1)).view(()),
                                 (c_look & c_alive).any()) & full
            st[LOOKUP_JUDGED] += looked
            st[LOOKUP_ACCEPTED] += looked & ok
        done = ~live | ended
        cycle = st[CYCLE] + 1
        end = torch.where((st[END_CYCLE] == 0) & ended, cycle + self.margin, st[END_CYCLE])
        rows = st[STAGE_ROWS] + torch.where(live, (self.rows != trash).sum(), 0)
        st[:LOOKUP_JUDGED].copy_(torch.stack([  # (FIELDS' order)
            committed + full, new_newest, done.long(), st[K] + live, made, rows, full.long(),
            token, cycle, end]))
        # the next cycle's units: the one entering stage 0, then each stage's moved one on
        # (those past the last surviving position, or all after a rejection, die)
        prefix = torch.where(commit_in, j, committed + full)
        cpos = torch.where(acc_in, j, trash)
        cslot = torch.where(acc_in, self.slot(j, lane), trash)
        head = self.make_unit(enter, enters, commit_in, e_tok, e_alive, prefix, cpos, cslot,
                              ch.anc[:, :n])
        bound = torch.where(rejected, -1, torch.where(acc_in, keep, newest))
        moved = self.units[:-1].clone()
        moved[:, LIVE] = ((moved[:, LIVE] == 1) & (moved[:, POS] <= bound) & ~done).to(
            torch.int64)
        self.units.copy_(torch.cat([head.view(1, -1), moved]))

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

