"""Tree drafting inside the pipeline (`--tree-width W`): up to W candidate rows per position.

Terms.
  row        one candidate token at one position, with its parent row at the position before
             (the committed token there, or one of that position's candidates).
  lane       a row's index among its position's rows (0..W-1); with the position it names the
             row's tree slot.
  tree slot  where an uncommitted row keeps its per-row state (token, anchor rows, the hidden
             state it carries between stages, every stage's K/V): capacity + (position mod
             (n + 1)) * W + lane, past the per-position buffers. In-flight positions span at
             most n + 1 consecutive positions, so no two live rows share a slot.
  committed  a position whose token is final (the prompt, the emitted tokens); its one row
             lives at the position. When a row is accepted its state is copied from its slot to
             its position (one row per buffer, never the prefix), and every later row reads it
             as prefix.
  tree mask  a row attends to the committed prefix, its uncommitted ancestors and itself
             (spd_kernels.tree_attention), never to another branch: a pruned row needs no
             clean-up, its slot is simply reused.

One cycle (SequenceDecode.run, the chain's loop; W = 1 runs the chain itself):
  1. the PDM recomputes every in-flight row, each from its own branch's anchor rows under the
     tree mask, and gives a distribution at each live leaf (the rows of the newest position);
     the W most probable children by cumulative draft probability (with the context lookup's
     candidate for the most probable leaf) become the next position's rows;
  2. every in-flight position's rows run the stage equal to its depth: at most W rows a stage;
  3. the oldest position leaves the last stage and its final state judges the next position's
     rows. Greedy: the row equal to the target's argmax is accepted. Sampling: the rows are
     checked in order against point masses (spd_kernels.tree_rejection_sample), so the
     committed token follows the target's distribution exactly;
  4. accepted: every row not descending from it is dropped. If its subtree stops before the
     newest position, the positions past it are dropped too and the pipeline has a gap (the
     depths are then no staircase: TreeSchedule). Rejected: the correction enters alone, as in
     the chain.

The host keeps the tree's shape (tokens, parents, scores: a few ints a cycle, read once after
the draft); every row's tensors stay on the device. So, unlike the chain (W = 1), whose cycle
makes no tensor from a Python value, a tree's cycle builds its small index tensors (slots,
keys, masks, the rows' tokens) from those Python lists, a host-to-device copy each (on a GPU,
from pageable memory: the host waits for it). That makes the tree the slower path per cycle;
tests/runtime/test_host_copies.py checks the chain only.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from spd.errors import SPDError
from spd.runtime.sequence import SequenceDecode
from spd_kernels import filtered_probs, tree_rejection_sample


@dataclass
class TreeSchedule:
    """The pipeline's bookkeeping when positions may leave gaps: in-flight positions
    start..newest (consecutive) with strictly decreasing depths, oldest first. A chain keeps
    them a staircase (depth = newest - position) and then this is spd.runtime.schedule's
    PipelineSchedule; a tree's accepted branch may end early, and the next position enters at
    depth 0 behind a gap."""
    n: int
    start: int = 0
    depths: list[int] = field(default_factory=list)
    draft_from: int = 0  # drafter cache rows valid below this position

    def seed(self, position: int, drafter_valid: int) -> None:
        self.start, self.depths, self.draft_from = position, [0], drafter_valid

    @property
    def count(self) -> int:
        return len(self.depths)

    @property
    def newest(self) -> int:
        return self.start + len(self.depths) - 1

    @property
    def positions(self) -> range:
        return range(self.start, self.newest + 1)

    def depth(self, position: int) -> int:
        if position < self.start:
            return self.n
        if position > self.newest:
            raise ValueError(f"position {position} is not in the pipeline yet")
        return self.depths[position - self.start]

    def draft_rows(self) -> range:
        return range(self.draft_from, self.newest + 1)

    def after_draft(self) -> None:
        self.draft_from = self.start

    def stage_work(self) -> list[tuple[int, int]]:
        return [(d, self.start + i) for i, d in enumerate(self.depths)]

    @property
    def full(self) -> bool:
        """The oldest position leaves the last stage this cycle (so the next one is judged)."""
        return self.depths[0] == self.n - 1

    @property
    def judged(self) -> int:
        return self.start + 1

    def _stepped(self) -> None:
        self.depths = [d + 1 for d in self.depths]

    def fill(self) -> None:
        assert not self.full
        self._stepped()
        self.depths.append(0)

    def accept(self, keep_through: int, entered: bool) -> None:
        """The judged position was accepted; positions past `keep_through` have no live row
        left; `entered`: this cycle's draft enters at depth 0."""
        assert self.full
        self._stepped()
        self.depths.pop(0)
        self.start += 1
        del self.depths[keep_through - self.start + 1:]
        if entered:
            self.depths.append(0)

    def reject(self) -> None:
        """The correction at start + 1 becomes the only in-flight position, at depth 0."""
        assert self.full
        self.start += 1
        self.depths = [0]
        self.draft_from = min(self.draft_from, self.start)


@dataclass
class Row:
    """One uncommitted candidate: its token, its parent's lane at the position before (None:
    the committed row there), its cumulative draft log-probability, and whether the context
    lookup proposed it."""
    token: int
    parent: int | None
    score: float
    lookup: bool = False


class TreeVerdict(NamedTuple):
    """The judgement of a position's rows: accepted (the lane of the accepted row) or not, and
    the committed token."""
    accepted: bool
    token: int
    lane: int | None = None


def check_tree_width(width) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 16:
        raise SPDError(f"tree width must be an integer in [1, 16] (1: a chain), got {width!r}")
    return width


class TreeDecode(SequenceDecode):
    """SequenceDecode with up to `width` candidate rows per in-flight position (module
    docstring). The drafter must be a PDMDrafter (pre-step features)."""

    def __init__(self, *args, width: int, **kwargs):
        self.width = check_tree_width(width)
        super().__init__(*args, **kwargs)
        if getattr(self.drafter, "tree_logits", None) is None or self.post_step:
            raise SPDError("tree drafting needs the PDM drafter with pre-step features")
        self.sched = TreeSchedule(self.n)
        self.stats.tree_width = self.width
        self.rows: dict[int, dict[int, Row]] = {}   # uncommitted in-flight position -> lanes
        self.fill_at: dict[int, int] = {}           # position -> positions in flight at draft
        self._draft: list[Row] = []                 # this cycle's draft (TreeDecode.candidates)
        # per entered position: the lanes of its rows in the order they entered (a committed
        # one: [None]), and once committed, which of those rows is the committed one
        self.unit_lanes: dict[int, list[int | None]] = {}
        self.judging_row: dict[int, int] = {}

    def tree_slots(self) -> int:
        # (n + 1) * W slots, then one trash slot (a distributed unit's padding rows write there)
        return (self.n + 1) * self.width + 1

    @property
    def trash(self) -> int:
        return self.buffer_rows - 1

    # --- where a row lives ------------------------------------------------------------------
    @property
    def committed(self) -> int:
        """Committed positions: the prompt and every emitted token."""
        return self.prompt_len + len(self.out)

    def slot(self, position: int, lane: int) -> int:
        return self.capacity + (position % (self.n + 1)) * self.width + lane

    def lanes(self, position: int) -> list[tuple[int | None, int]]:
        """[(lane, buffer row)] of a position's live rows (a committed one: [(None, position)])."""
        if position < self.committed:
            return [(None, position)]
        return [(lane, self.slot(position, lane)) for lane in sorted(self.rows[position])]

    def branch(self, position: int, lane: int | None) -> list[int]:
        """Buffer rows of the uncommitted ancestors of a row and of the row itself."""
        out = []
        while lane is not None and position >= self.committed:
            out.append(self.slot(position, lane))
            lane = self.rows[position][lane].parent
            position -= 1
        return out

    def path_tokens(self, position: int, lane: int | None) -> list[int]:
        """The uncommitted tokens of a row's branch, oldest first, the row's own last."""
        out = []
        while lane is not None and position >= self.committed:
            row = self.rows[position][lane]
            out.append(row.token)
            lane, position = row.parent, position - 1
        return out[::-1]

    def work_rows(self, work: list[tuple[int, int]]) -> int:
        return sum(len(self.lanes(p)) for _, p in work)

    def stage_input(self, position: int):
        """What a stage needs to run a position's rows: (buffer rows [R], prefix_len,
        tree_slots [M], tree_mask [R, M] bool) (spd_kernels.tree_stage_step)."""
        return self.unit_input(position)[:4]

    def unit_input(self, position: int, rows: dict[int, Row] | None = None, token=None):
        """stage_input's tuple and the rows' tokens, for the rows that entered at `position`
        (a committed one: its `token`), or for `rows` (by lane) about to enter there (a draft
        a runner sends ahead of its verdict): what a distributed unit carries."""
        if rows is None and position < self.committed:  # one row, read through the prefix
            return [position], position + 1, [], [[]], [token]
        rows = self.rows[position] if rows is None else rows
        lanes = sorted(rows)
        idx = [self.slot(position, lane) for lane in lanes]
        branches = [[own] + self.branch(position - 1, rows[lane].parent)
                    for own, lane in zip(idx, lanes)]
        keys = list(dict.fromkeys(b for br in branches for b in br))
        mask = [[k in br for k in keys] for br in branches]
        return idx, self.committed, keys, mask, [rows[lane].token for lane in lanes]

    def keep_rows(self, stage: int, position: int, idx: torch.Tensor,
                  rows: torch.Tensor) -> None:
        """Stage `stage`'s anchor rows of the unit at `position` (rows [anchors, R, d], in the
        unit's row order) into the buffer rows idx [R] (a distributed snap). A snap can arrive
        after its position was committed (the judged position is still two stages from the
        end when its verdict comes): the committed row's anchors then go to the position too,
        where the drafter reads them (commit copied only what had arrived)."""
        row = self.judging_row.get(position)
        late = row is not None and self.unit_lanes[position] != [None]
        for i, j in enumerate(self.stage_slots[stage]):
            self.anchors[j, idx] = rows[i]
            if late:
                self.anchors[j, position] = rows[i, row]

    # --- the cycle ----------------------------------------------------------------------------
    def draft(self, extra_depth: int) -> list[Row]:
        """The next position's rows: the W most probable children of the live leaves."""
        sched, t = self.sched, self.target
        # the anchor rows of every stage step up to the last cycle's (a runner elsewhere)
        self.stages.features(self.stats.K - 1 + extra_depth)
        t0 = time.perf_counter()
        with self.stages.drafting(), self.timer("draft"):
            rows = []                                 # (position, lane) of each PDM row
            for p in sched.draft_rows():
                rows.extend((p, lane) for lane, _ in self.lanes(p))
            index = {r: i for i, r in enumerate(rows)}
            buf = [p if lane is None else self.slot(p, lane) for p, lane in rows]
            # the PDM's own cache: committed rows at their positions, the others in the slots
            # past its capacity (rewritten every cycle)
            slots = [p if lane is None else self.capacity + i for i, (p, lane) in enumerate(rows)]
            mask = torch.zeros(len(rows), len(rows), dtype=torch.bool)
            for i, (p, lane) in enumerate(rows):
                mask[i, i] = True
                for j in range(i):
                    q, lq = rows[j]
                    if q < p and (lq is None or lq == self._ancestor_lane(p, lane, q)):
                        mask[i, j] = True
            depths = [sched.depth(p) for p, _ in rows]
            dev = t.device
            types = self.type_of_depth[torch.tensor(depths, device=dev)]
            leaves = [(lane, index[(sched.newest, lane)]) for lane, _ in
                      self.lanes(sched.newest)]
            logits = self.drafter.tree_logits(
                self.anchors[:, torch.tensor(buf, device=dev)], types,
                [p for p, _ in rows], torch.tensor(slots, device=dev), sched.draft_from,
                mask.to(dev), torch.tensor([i for _, i in leaves], device=dev))
            # the chain's draw per draft, kept in step
            torch.rand((), generator=self.gen, device=self.gen.device)
            children = self._children([lane for lane, _ in leaves], logits)
            self._draft = children
            self.fill_at[sched.newest + 1] = sched.count
            self.stats.draft_calls += 1
            sched.after_draft()
        self.draft_s.append(time.perf_counter() - t0)
        return children

    def _ancestor_lane(self, position: int, lane: int | None, at: int) -> int | None:
        """The lane of a row's ancestor at position `at` (< position; None: committed)."""
        while position > at and lane is not None and position >= self.committed:
            lane = self.rows[position][lane].parent
            position -= 1
        return lane if at >= self.committed else None

    def _children(self, leaves: list[int | None], logits: torch.Tensor) -> list[Row]:
        """The W most probable (leaf, token) pairs by cumulative draft log-probability; the
        context lookup's token for the most probable leaf competes with the log of its trust
        (the chain's gate: it wins where the PDM's top probability is below the trust)."""
        W, newest, s = self.width, self.sched.newest, self.sampling
        if s.greedy:
            logp = torch.log_softmax(logits.float(), dim=-1)
        else:
            logp = torch.stack([filtered_probs(row, s.temperature, s.top_k, s.top_p)
                                for row in logits]).log()
        top, cols = logp.topk(min(W, logp.shape[-1]), dim=-1)
        per = top.shape[1]  # candidates per leaf
        d2t = self.drafter.pdm.draft_to_target
        ids = d2t[cols.reshape(-1)].view(cols.shape)
        # one host read of the tree's shape per cycle (a few numbers per leaf)
        k = len(leaves)
        host = torch.cat([top.reshape(-1), ids.reshape(-1).to(top.dtype),
                          logp.amax(-1)]).tolist()
        m = k * per
        vals, ids_h, pmax = host[:m], [int(x) for x in host[m:2 * m]], host[2 * m:]
        base = [0.0 if lane is None else self.rows[newest][lane].score for lane in leaves]
        cands: list[Row] = []
        if self.lookup is not None:
            best = max(range(k), key=lambda i: base[i])
            found = self.lookup.propose(self.lookup.context(
                self.path_tokens(newest, leaves[best])))
            if found is not None:
                token, match_len = found
                trust = self.lookup.trust(match_len)
                if trust >= 1.0 or math.exp(pmax[best]) < trust:
                    cands.append(Row(token, leaves[best], base[best] + math.log(trust), True))
        for i, lane in enumerate(leaves):
            for j in range(per):
                v = vals[i * per + j]
                if v == float("-inf"):
                    continue
                row = Row(ids_h[i * per + j], lane, base[i] + v)
                if any(c.parent == lane and c.token == row.token for c in cands):
                    continue  # the lookup proposed it already (at its trust)
                cands.append(row)
        order = sorted(range(len(cands)), key=lambda i: -cands[i].score)  # stable on ties
        return [cands[i] for i in order[:W]]

    def _enter_rows(self, position: int, rows: dict[int, Row]) -> None:
        """Rows (by lane) enter stage 0 at `position` (depth 0): their tokens and embeddings in
        their slots."""
        self.rows[position] = rows
        self.unit_lanes[position] = sorted(rows)
        slots = torch.tensor([self.slot(position, lane) for lane in sorted(rows)],
                             device=self.target.device)
        tokens = torch.tensor([rows[lane].token for lane in sorted(rows)],
                              device=self.target.device)
        self.tokens[slots] = tokens
        self.anchors[0, slots] = self.target.embed_tokens(tokens)
        self.stages.enter(position, None)

    def _enter_committed(self, position: int, token: int) -> None:
        self.unit_lanes[position] = [None]
        self.judging_row[position] = 0
        self.tokens[position] = token
        self.anchors[0, position] = self.target.embed_tokens(self.tokens[position:position + 1])[0]
        self.stages.enter(position, token)

    def enter(self, position: int, token) -> None:
        self._enter_committed(position, token)  # start: the first token, committed

    def fill(self, draft: list[Row]) -> None:
        self.sched.fill()
        self._enter_rows(self.sched.newest, dict(enumerate(draft)))

    def judge(self, hidden: torch.Tensor) -> TreeVerdict:
        """The verdict on the judged position's rows, from the final state `hidden` [1, d] of
        the position before it."""
        with self.timer("verify"):
            judged = self.sched.judged
            lanes = sorted(self.candidates(judged).items(), key=lambda kv: -kv[1].score)
            logits = self.target.logits(hidden)[0]
            s = self.sampling
            if s.greedy:
                token = int(logits.argmax())
                lane = next((lane for lane, r in lanes if r.token == token), None)
                return TreeVerdict(lane is not None, token, lane)
            cands = torch.full((self.width,), -1, dtype=torch.int64)
            cands[:len(lanes)] = torch.tensor([r.token for _, r in lanes], dtype=torch.int64)
            u = torch.rand(self.width + 1, generator=self.gen, device=self.gen.device)
            dev = logits.device
            token, which = tree_rejection_sample(logits, cands.to(dev), u.to(dev),
                                                 s.temperature, s.top_k, s.top_p)
            token, which = torch.cat([token, which]).tolist()
            if which < 0:
                return TreeVerdict(False, token)
            return TreeVerdict(True, token, lanes[which][0])

    def _slots_of(self, rows: dict[int, dict[int, Row]]) -> list[int]:
        return [self.slot(p, lane) for p, lanes in rows.items() for lane in lanes]

    def candidates(self, position: int) -> dict[int, Row]:
        """The rows judged at `position`: its in-flight rows, or, after a gap, this cycle's draft
        (the position's rows have not entered yet: the target's token is known first)."""
        if position in self.rows:
            return self.rows[position]
        if position == self.sched.newest + 1:
            return dict(enumerate(self._draft))
        return {}

    def commit(self, verdict: TreeVerdict, draft: list[Row]) -> None:
        sched, judged = self.sched, self.sched.judged
        fill = self.fill_at.pop(judged, None)
        if fill is not None:  # the position had candidates
            cands = self.candidates(judged)
            row = cands[verdict.lane] if verdict.accepted else None
            lookup = row.lookup if row is not None else any(r.lookup for r in cands.values())
            self.stats.count_draft(fill, verdict.accepted, lookup)
        self.stats.N += 1
        self._emit(verdict.token)
        if not verdict.accepted or judged not in self.rows:
            # rejected, or accepted among rows that never entered (after a gap): the committed
            # token enters alone
            with self.timer("rollback"):
                self.stages.drop_rows(self._slots_of(self.rows))
                sched.reject()
                self.rows.clear()
                self.fill_at.clear()
                self.stages.rollback(judged)
            if not self.done:
                self._enter_committed(judged, verdict.token)
            return
        with self.timer("rollback"):
            slot = self.slot(judged, verdict.lane)
            self.tokens[judged] = self.tokens[slot]
            self.anchors[:, judged] = self.anchors[:, slot]
            self.stages.commit_row(judged, slot)
            dropped = {judged: self.rows.pop(judged)}
            newest = sched.newest
            alive, keep = {verdict.lane}, judged
            for p in range(judged + 1, newest + 1):
                kept = {lane: r for lane, r in self.rows[p].items() if r.parent in alive}
                dropped[p] = {lane: r for lane, r in self.rows[p].items() if lane not in kept}
                if not kept:
                    break
                # the first uncommitted position's parents are committed now
                self.rows[p] = kept if p > judged + 1 else {
                    lane: Row(r.token, None, r.score, r.lookup) for lane, r in kept.items()}
                alive, keep = set(kept), p
            for p in range(keep + 1, newest + 1):
                dropped[p] = self.rows.pop(p, {})
                self.fill_at.pop(p, None)
            self.stages.drop_rows(self._slots_of(dropped))
            # this cycle's draft keeps its lanes (a runner may have sent it ahead, as is)
            entered = ({lane: r for lane, r in enumerate(draft) if r.parent in alive}
                       if keep == newest else {})
            self.judging_row[judged] = self.unit_lanes[judged].index(verdict.lane)
            if not entered:  # positions past `keep`, this draft's included, are gone
                self.fill_at.pop(newest + 1, None)
                self.stages.rollback(keep + 1)
            sched.accept(keep, bool(entered))
        if entered and not self.done:
            if keep == judged:  # the children's parent is committed now
                entered = {lane: Row(r.token, None, r.score, r.lookup)
                           for lane, r in entered.items()}
            self._enter_rows(sched.newest, entered)

