"""A plain reference decoder: README's cycle (steps 1-4) with host branches, the oracle of the
device-decided cycle (spd.runtime.cycle) for seeded sampling and for N, K and the judged and
accepted drafts.

It keeps the schedule on the host (the positions in flight and their depths, each position's
rows as Python objects) and branches on every verdict; it runs live rows only. Only the numbers
come from the product's primitives (stage steps, the drafter, the verifiers), called with the
shapes the product uses, so that equal decisions give equal numbers: the drafter's window (the
n + 1 positions from max(newest - n, the last cycle's oldest in flight), W lanes each), where a
tree row keeps its state (slot capacity + (position mod (n + 1)) * W + lane; committed rows at
their position), a tree unit's n * W keys, and the draws (W + 2 uniforms every cycle: the
draft's, then the verifier's).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spd.draft.lookup import TRUST, NgramLookup
from spd.model.target import Stage
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats
from spd.runtime.verdict import pick, vocab_ids
from spd_kernels import filtered_probs, rejection_sample_logits, tree_rejection_sample
from spd_kernels.philox import philox_uniform, seed_key


@dataclass
class Row:
    token: int
    parent: int = 0         # its parent's lane at the position before (committed: lane 0)
    score: float = 0.0      # cumulative draft log-probability, as the product's float32
    lookup: bool = False


@dataclass
class Unit:
    """The rows of one position as they entered stage 0 (a token tree's unit: spd.runtime.unit)."""
    position: int
    tokens: list[int]
    entered: int                       # the cycle it entered in
    committed: bool                    # one committed row at its position
    slots: list[int] = field(default_factory=list)
    prefix: int = 0
    keys: list[int] = field(default_factory=list)
    mask: list[list[bool]] = field(default_factory=list)
    committed_lane: int | None = None  # its committed row, once committed


class ReferenceDecoder:
    """Decodes one sequence on `engine`'s target, layout and drafter, in stages of its own."""

    def __init__(self, engine, width: int | None = None):
        self.t, self.layout, self.n = engine.target, engine.layout, engine.n
        self.engine = engine
        self.W = engine.tree_width if width is None else width

    # --- set-up ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt: list[int], max_new: int, sampling, drafter=None,
                 stop_token_ids=None):
        t, n, W = self.t, self.n, self.W
        self.drafter = drafter or self.engine.drafter
        self.sampling, self.max_new = sampling, max_new
        self.stop = StopRule(t.eos_token_ids, stop_token_ids)
        P = len(prompt)
        self.capacity = P + max_new + n + 2
        rows = self.capacity + ((n + 1) * W if W > 1 else 0) + 1
        self.trash = rows - 1
        self.drafter.begin(rows, t.vocab_size)
        dev = t.device
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.tokens[:P] = torch.tensor(prompt)
        self.anchors = torch.zeros(len(self.layout.anchors), rows, t.hidden_size, device=dev,
                                   dtype=t.dtype)
        self.final = torch.zeros(rows, t.hidden_size, device=dev, dtype=t.dtype)
        self.types = [self.layout.agg_type(k) for k in range(n + 1)]
        self.stages = [Stage(t, s, r, rows, max_rollback=n) for s, r in
                       enumerate(self.layout.stages)]
        self.gen = torch.Generator(dev).manual_seed(sampling.seed)
        self.key = torch.tensor([seed_key(sampling.seed)])
        self.stats = DecodeStats(mode="reference", n=n, tree_width=W)
        self.lookup = (NgramLookup(self.drafter.lookup) if getattr(self.drafter, "lookup", 0)
                       else None)
        self.post_step = getattr(self.drafter, "post_step", False)
        # prefill: the prompt through every stage; the first token is the target's own pick
        h = t.embed_tokens(self.tokens[:P])
        self.anchors[0, :P] = h
        for s, st in enumerate(self.stages):
            outs, _ = st.run(h, 0)
            self._keep(s, list(range(P)), outs)
            h = outs[-1]
        first = pick(t.logits(h[-1:])[0], sampling, self.gen)
        self.drafter.prefill(self.anchors[:, :P], torch.full((P,), self.types[n], device=dev))
        self.committed = list(prompt)
        if self.lookup is not None:
            self.lookup.extend(prompt)
        self.out: list[int] = []
        self.depth: dict[int, int] = {}          # in-flight position -> its depth
        self.rows: dict[int, list[Row | None]] = {}  # uncommitted in-flight position -> lanes
        self.units: dict[int, Unit] = {}
        self.carry: dict[int, torch.Tensor] = {}
        self.fill: dict[int, int] = {}           # drafted position -> its draft position
        self.q: dict[int, torch.Tensor] = {}     # a sampled chain's draft distributions
        self.q_ids = None
        self.commits: list[tuple[int, int, int]] = []  # (its carrier's cycle, position, slot)
        self.applied = [0] * n                   # per stage: the commits it has made
        self.cycle = 0                           # cycles run
        self.last_start = P                      # the last cycle's oldest in flight
        if self._emit(first):
            return self.out, self.stats
        self._enter_committed(P, first)
        while True:
            if self._step():
                return self.out, self.stats

    # --- one cycle -------------------------------------------------------------------------------
    def _step(self) -> bool:
        n, W = self.n, self.W
        self.stats.K += 1
        self.cycle += 1  # (units entering now run from the next cycle on)
        # the cycle's uniforms: Philox of the seed, counted by the cycle (spd_kernels.philox)
        at = (self.cycle - 1) * (W + 2) + torch.arange(W + 2)
        u = philox_uniform(self.key, at.view(1, -1))[0].to(self.gen.device)
        start, newest = min(self.depth), max(self.depth)
        count = newest - start + 1
        # 1. the draft of newest + 1 from pre-step features, beside 2. every stage
        children = None if self.post_step else self._draft(start, newest, 0, u[0])
        verdict = None
        for p in sorted(self.depth, key=lambda p: self.depth[p]):
            token = self._run(self.depth[p], p)
            verdict = token if token is not None else verdict
        self.stats.stage_rows += sum(self._live_rows(p) for p in self.depth)
        if self.post_step:
            children = self._draft(start, newest, 1, u[0])
        full = self.depth[start] == n - 1
        self.last_start = start
        for p in self.depth:
            self.depth[p] += 1
        if not full:  # filling: the children enter
            self._enter_children(newest + 1, children, count)
            return False
        del self.depth[start]
        # 3. the position after the one that left the last stage is judged
        j = start + 1
        in_flight = j in self.depth
        cands = self.rows[j] if in_flight else children
        token, accepted, lane = self._judge(cands, start, j, verdict, u)
        fill = self.fill.get(j, count)
        self.stats.by_position.setdefault(fill, [0, 0])
        self.stats.by_position[fill][0] += 1
        self.stats.by_position[fill][1] += int(accepted)
        self.stats.drafts_judged += 1
        self.stats.drafts_accepted += int(accepted)
        looked = (cands[lane].lookup if accepted else
                  any(r is not None and r.lookup for r in cands))
        if self.lookup is not None and looked:
            self.stats.lookup_judged += 1
            self.stats.lookup_accepted += int(accepted)
        self.stats.N += 1
        if self._emit(token):
            return True
        # 4. accept: keep the accepted row's descendants; reject: the correction enters alone
        if accepted and in_flight:
            keep = self._accept(j, lane)
            if keep == newest:  # the children of the rows left at the newest position enter
                leaves = {lane} if newest == j else {
                    i for i, r in enumerate(self.rows[newest]) if r is not None}
                kept = [r if r is not None and r.parent in leaves else None for r in children]
                if any(kept):
                    self._enter_children(newest + 1, kept, count)
            return False
        for p in [p for p in self.depth if p > start]:
            self._drop(p)
        self._enter_committed(j, token)
        return False

    # --- the stages ------------------------------------------------------------------------------
    def _run(self, s: int, p: int):
        """Stage s runs the unit of position p (its commits first) -> a greedy chain's argmax
        at the last stage, else None."""
        unit, st, t = self.units[p], self.stages[s], self.t
        while self.applied[s] < len(self.commits) and \
                self.commits[self.applied[s]][0] <= unit.entered:  # carried by it or before
            _, pos, slot = self.commits[self.applied[s]]
            st.commit_rows(torch.tensor([pos]), torch.tensor([slot]))
            self.applied[s] += 1
        x = t.embed_tokens(torch.tensor(unit.tokens)) if s == 0 else self.carry[p]
        pos = torch.tensor([p])
        judge = None
        if self.W == 1 and self.sampling.greedy and s == self.n - 1:
            judge = torch.zeros(1, dtype=torch.int64)
        if self.W == 1:
            outs, v = st.run(x, pos, judge)
        else:
            outs = st.tree_run(x, pos, torch.tensor(unit.slots), torch.tensor([unit.prefix]),
                               torch.tensor(unit.keys),
                               torch.tensor(unit.mask).view(self.W, -1))
            v = None
        self.carry[p] = outs[-1]
        where = self._where(p)
        first = st.layer_ids.start
        for j, b in self.layout.anchors_of_stage(s):
            self._put(self.anchors[j], where, outs[b - first - 1])
        if s == self.n - 1:
            self._put(self.final, where, outs[-1])
        return None if v is None else v[0]

    def _where(self, p: int) -> list[int | None]:
        """Where each row of p's unit keeps what a stage makes of it now (None: dead)."""
        if self.W == 1:
            return [p]
        if p not in self.rows:  # committed since it entered, or a committed unit
            lane = self.units[p].committed_lane
            return [p if lane == i else None for i in range(self.W)]
        return [self._slot(p, i) if r is not None else None for i, r in enumerate(self.rows[p])]

    def _put(self, buf, where, rows):
        for i, at in enumerate(where):
            if at is not None:
                buf[at] = rows[i]

    def _keep(self, s: int, positions: list[int], outs) -> None:
        first = self.stages[s].layer_ids.start
        for j, b in self.layout.anchors_of_stage(s):
            self.anchors[j, positions] = outs[b - first - 1]

    def _live_rows(self, p: int) -> int:
        return 1 if p not in self.rows else sum(r is not None for r in self.rows[p])

    # --- the draft -------------------------------------------------------------------------------
    def _window(self, start: int, newest: int, extra: int):
        n = self.n
        w0 = max(newest - n, self.last_start)  # the rows below are final in the drafter's cache
        pos = list(range(w0, w0 + n + 1))
        depth = [n if q < start else self.depth.get(q, 0) for q in pos]
        types = [self.types[min(d + extra, n)] for d in depth]
        return w0, pos, types

    def _draft(self, start, newest, extra, uniform):
        w0, pos, types = self._window(start, newest, extra)
        dev = self.t.device
        if self.W > 1:
            return self._tree_children(start, newest, w0, pos, types)
        d = self.drafter.draft(self.anchors[:, pos], torch.tensor(types, device=dev),
                               torch.tensor([w0]), torch.tensor(newest + 1),
                               self.sampling, uniform, torch.tensor([newest - w0]))
        token, q, used = int(d.token), d.q, False
        if self.lookup is not None:
            in_flight = [self.units[p].tokens[0] for p in range(start + 1, newest + 1)]
            found = self.lookup.propose(self.lookup.context(in_flight))
            if found is not None:
                used = d.p is None or float(d.p) < float(torch.tensor(TRUST)[found[1]])
                if q is not None:
                    vocab = self.t.vocab_size
                    if d.q_ids is not None:
                        q = torch.zeros(vocab).index_copy_(0, d.q_ids, q)
                    if used:
                        q = (vocab_ids(vocab, dev) == found[0]).float()
                if used:
                    token = found[0]
            elif q is not None:  # the product's q has one shape: over every target id
                vocab = self.t.vocab_size
                if d.q_ids is not None:
                    q = torch.zeros(vocab).index_copy_(0, d.q_ids, q)
        self.q[newest + 1] = q
        self.q_ids = None if self.lookup is not None else d.q_ids
        return [Row(token, 0, 0.0, used)]

    def _ancestor(self, q: int, lane: int, at: int, start: int) -> int:
        """The lane of the ancestor at position `at` of row (q, lane) (committed: 0)."""
        while q > at:
            if q <= start:
                return 0
            lane, q = self.rows[q][lane].parent, q - 1
        return 0 if at <= start else lane

    def _tree_children(self, start, newest, w0, pos, types):
        n, W = self.n, self.W
        live = [[q <= newest and (ln == 0 if q <= start else self.rows[q][ln] is not None)
                 for ln in range(W)] for q in pos]
        R = (n + 1) * W
        mask = torch.eye(R, dtype=torch.bool)
        for k, q in enumerate(pos):
            for ln in range(W):
                if not live[k][ln]:
                    continue
                for k2 in range(k + 1):
                    a = self._ancestor(q, ln, pos[k2], start)
                    if live[k2][a]:
                        mask[k * W + ln, k2 * W + a] = True
        buf, slots = [], []
        for k, q in enumerate(pos):
            for ln in range(W):
                if not live[k][ln]:
                    buf.append(self.trash)
                    slots.append(self.trash)
                elif q <= start:
                    buf.append(q)
                    slots.append(q)
                else:
                    buf.append(self._slot(q, ln))
                    slots.append(self.capacity + k * W + ln)
        last = newest - w0
        leaves = torch.tensor([last * W + ln for ln in range(W)])
        logits = self.drafter.tree_logits(
            self.anchors[:, buf], torch.tensor(types).repeat_interleave(W),
            torch.tensor(pos).repeat_interleave(W), torch.tensor(slots), torch.tensor([w0]),
            mask, leaves)
        s = self.sampling
        logp = (torch.log_softmax(logits.float(), -1) if s.greedy else
                filtered_probs(logits, s.temperature, s.top_k, s.top_p).log())
        top, cols = logp.topk(min(W, logp.shape[-1]), dim=-1)
        ids = self.drafter.pdm.draft_to_target[cols]
        leaves = self.rows[newest] if newest > start else [Row(0)] + [None] * (W - 1)
        base = torch.tensor([r.score if r is not None else float("-inf") for r in leaves])
        scores = (base.view(W, 1) + top).reshape(-1)
        look = None
        best = int(base.argmax())
        if self.lookup is not None:
            branch = [self._branch_token(q, best, newest, start) for q in
                      range(start + 1, newest + 1)]
            found = self.lookup.propose(self.lookup.context(branch))
            if found is not None:
                trust = torch.tensor(TRUST)[found[1]]
                if float(trust) >= 1.0 or float(logp[best].max().exp()) < float(trust):
                    look = Row(found[0], best, float(base[best] + trust.log()), True)
        all_scores = [look.score if look else float("-inf")]
        rows = [look]
        for i in range(W):
            for r in range(top.shape[1]):
                tok = int(ids[i, r])
                dup = look is not None and best == i and tok == look.token
                dead = dup or leaves[i] is None
                sc = float("-inf") if dead else float(scores[i * top.shape[1] + r])
                all_scores.append(sc)
                rows.append(Row(tok, i, sc))
        order = torch.sort(torch.tensor(all_scores), descending=True, stable=True).indices[:W]
        return [rows[i] if all_scores[i] > float("-inf") else None for i in order.tolist()]

    def _branch_token(self, q: int, best: int, newest: int, start: int) -> int:
        return self.rows[q][self._ancestor(newest, best, q, start)].token

    # --- the judgement ---------------------------------------------------------------------------
    def _judge(self, cands, start, j, verdict, u):
        s, W = self.sampling, self.W
        if s.greedy and W == 1:
            target = int(verdict)
        else:
            logits = self.t.logits(self.final[start:start + 1])
            if s.greedy:
                target = int(logits[0].argmax())
        if s.greedy:
            lane = next((i for i, r in enumerate(cands) if r is not None and r.token == target),
                        None)
            return target, lane is not None, lane or 0
        if W == 1:
            q = self.q.pop(j)
            ids = (vocab_ids(logits.shape[-1], logits.device) if self.q_ids is None
                   else self.q_ids)
            tok, ok = rejection_sample_logits(logits, q.view(1, -1), ids,
                                              torch.tensor([cands[0].token]), u[1:3].view(1, 2),
                                              temperature=s.temperature, top_k=s.top_k,
                                              top_p=s.top_p)
            return int(tok), bool(ok), 0
        lanes = [i for i, r in enumerate(cands) if r is not None]
        tokens = [cands[i].token for i in lanes] + [-1] * (W - len(lanes))
        tok, which = tree_rejection_sample(logits[0], torch.tensor(tokens), u[1:],
                                           s.temperature, s.top_k, s.top_p)
        which = int(which)
        return int(tok), which >= 0, lanes[which] if which >= 0 else 0

    def _accept(self, j: int, lane: int) -> int:
        """Row `lane` at j is committed; every row not descending from it is dropped -> the
        last position keeping a row."""
        if self.W > 1:  # the unit that enters next carries it
            self.commits.append((self.cycle, j, self._slot(j, lane)))
            self.tokens[j] = self.rows[j][lane].token
            self.anchors[:, j] = self.anchors[:, self._slot(j, lane)]
            self.units[j].committed_lane = lane
        del self.rows[j]
        alive, keep = {lane}, j
        for p in sorted(q for q in self.depth if q > j):
            kept = [r if r is not None and r.parent in alive else None for r in self.rows[p]]
            alive = {i for i, r in enumerate(kept) if r is not None}
            if not alive:
                for q in [q for q in self.depth if q >= p]:
                    self._drop(q)
                break
            self.rows[p] = kept
            keep = p
        return keep

    def _drop(self, p: int) -> None:
        del self.depth[p]
        self.rows.pop(p, None)
        self.fill.pop(p, None)

    # --- entering --------------------------------------------------------------------------------
    def _slot(self, p: int, lane: int) -> int:
        return self.capacity + (p % (self.n + 1)) * self.W + lane

    def _enter_committed(self, p: int, token: int) -> None:
        W = self.W
        unit = Unit(p, [token] + [0] * (W - 1), self.cycle, True, committed_lane=0)
        self.tokens[p] = token
        if W > 1:
            unit.slots = [p] + [self.trash] * (W - 1)
            unit.prefix = p
            unit.keys = [p] + [self.trash] * (self.n * W - 1)
            unit.mask = [[i == 0 and k == 0 for k in range(self.n * W)] for i in range(W)]
        self._enter(p, unit)

    def _enter_children(self, p: int, children: list[Row | None], count: int) -> None:
        n, W = self.n, self.W
        committed = len(self.committed)
        unit = Unit(p, [r.token if r is not None else 0 for r in children], self.cycle, False)
        self.fill[p] = count
        self.rows[p] = list(children)
        if W == 1:
            self.tokens[p] = children[0].token
        else:
            unit.prefix = committed
            unit.slots = [self._slot(p, i) if r is not None else self.trash
                          for i, r in enumerate(children)]
            unit.keys = [self._slot(p - k, ln) if p - k >= committed else self.trash
                         for k in range(n) for ln in range(W)]
            unit.mask = [[r is not None and (ln == i if k == 0 else
                          p - k >= committed and self._ancestor(p, i, p - k, committed - 1) == ln)
                          for k in range(n) for ln in range(W)] for i, r in enumerate(children)]
            for i, r in enumerate(children):
                if r is not None:
                    self.tokens[self._slot(p, i)] = r.token
        self._enter(p, unit)

    def _enter(self, p: int, unit: Unit) -> None:
        self.units[p] = unit
        self.depth[p] = 0
        where = [p] if self.W == 1 else [u for u in unit.slots]
        emb = self.t.embed_tokens(torch.tensor(unit.tokens))
        for i, at in enumerate(where):
            if at != self.trash:
                self.anchors[0, at] = emb[i]

    def _emit(self, token: int) -> bool:
        self.out.append(token)
        self.committed.append(token)
        if self.lookup is not None:
            self.lookup.append(token)
        return self.stop.feed(token) or len(self.out) >= self.max_new
