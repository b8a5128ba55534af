"""The token tree's control ops (spd_kernels.tree_control): each Triton kernel against its
reference, bit for bit, on every output and every tensor it writes (outputs poisoned first, with
different garbage for each backend), on batches of simulated decodes: B sequences in
lock-step through the reference ops, with random drafts (scores with ties and -inf children),
verdicts and budgets, so the states are the ones a decode makes; the kernels run on the first
cycles, then on each that takes a branch not checked yet, until every one was (filling,
accepting in flight with descendants kept or a branch that ends short, judging a gap,
rejecting, the end by a stop id or the budget, greedy and sampled rows together, finished and
free slots, the context lookup on and off with matches of several lengths, post-step
features, a committed newest position). Plus the argument checks, and a tree decode on the
kernels against one on the references.

On a CPU the kernels run in the Triton interpreter; on a GPU compiled (TRITON_DEVICE).
"""
from __future__ import annotations

import inspect

import pytest
import torch
from conftest import needs_triton

from spd.draft.lookup import TRUST
from spd_kernels import SPDInputError, dispatch
from spd_kernels.control import (
    COMMITTED,
    CONST,
    CYCLE,
    DONE,
    GREEDY,
    KEY,
    LOOKUP_JUDGED,
    MAX_NEW,
    NEWEST,
    STATE,
    TRASH,
    N,
    state_size,
)
from spd_kernels.philox import philox_uniform, seed_key
from spd_kernels.testing import TRITON_DEVICE
from spd_kernels.tree_control import (
    KID,
    T_COMMITTED,
    T_FULL,
    T_LENGTH,
    T_LIVE,
    T_NEWEST,
    judge_size,
    tplan_size,
    tree_children,
    tree_commit,
    tree_open,
    tree_unit,
    tree_unit_size,
)

P, M, D, V, T = 10, 2, 8, 5, 3  # prompt, anchors, their width, the vocabulary, stop ids
OPS = ("tree_open", "tree_children", "tree_commit")

pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend (about 30x slower on 2 cores)
    yield
    torch.set_num_threads(threads)


def _poison(x: torch.Tensor, which: int) -> torch.Tensor:
    """Garbage that differs between the two backends' outputs: an element neither writes
    differs, so equal outputs were written everywhere."""
    if x.dtype == torch.bool:
        return x.fill_(which == 0)
    return x.fill_((1e30 if x.is_floating_point() else -(2 ** 40)) * (1 + which))


def _copy(xs):
    return [[y.clone() for y in x] if isinstance(x, list) else None if x is None else x.clone()
            for x in xs]


def _assert_same(got, want, what):
    for i, (x, y) in enumerate(zip(got, want)):
        for xi, yi in zip(*((x, y) if isinstance(x, list) else ([x], [y]))):
            assert (xi is None and yi is None) or torch.equal(xi, yi), (what, i, xi, yi)


class _Decodes:
    """B sequences of n stages, W rows a position, in lock-step through the reference ops: a
    decode's control state without a model. The drafts, verdicts, stop ids and budgets are
    random (a short alphabet, so lookups match and ends come); a finished sequence stays a
    while (a finished slot), then its slot takes a new one; the last slot of four or more is
    a free slot as a batch allocates it (everything zero, finished)."""

    def __init__(self, n: int, W: int, B: int, seed: int, dev):
        self.n, self.W, self.B, self.dev = n, W, B, dev
        self.R, self.RW = n + 1, (n + 1) * W
        self.g = torch.Generator().manual_seed(seed)
        self.capacity = P + 14 + n + 2
        self.C = self.capacity + self.RW + 1
        i64 = dict(dtype=torch.int64, device=dev)
        self.state = torch.zeros(B, state_size(n), **i64)
        self.state[:, DONE] = 1
        self.units = torch.zeros(B, n, tree_unit_size(n, W), **i64)
        self.consts = torch.zeros(B, len(CONST), **i64)
        self.stops = torch.full((B, T), -1, **i64)
        R = self.R
        self.lanes = [torch.zeros(B, R, W, **i64), torch.zeros(B, R, W, **i64),
                      torch.zeros(B, R, W, device=dev),
                      torch.zeros(B, R, W, dtype=torch.bool, device=dev),
                      torch.zeros(B, R, W, dtype=torch.bool, device=dev),
                      torch.zeros(B, R, W, R, **i64), torch.full((B, R), -1, **i64),
                      torch.zeros(B, R, **i64)]
        self.tokens = torch.zeros(B, self.C, **i64)
        self.anchors = torch.zeros(B, M, self.C, D, device=dev)
        self.tod = torch.tensor([3, 2, 1, 0, 1, 2][:n + 1], device=dev)
        self.weight = torch.randn(V, D, generator=self.g).to(dev)
        # the gate's table: the runtime's, or one that trusts long matches outright
        trust = list(TRUST)
        if seed % 2:
            trust[4:] = [1.0] * (len(trust) - 4)
        self.trust = torch.tensor(trust, device=dev)
        self.log_trust = self.trust.log()
        self.free = B >= 4
        self.finished_for = [0] * B
        for b in range(B - self.free):
            self.begin(b)

    backends = ("triton", "reference")  # (the reference alone: a cycle not checked)
    MUTABLE = ("state", "units", "consts", "stops", "lanes", "tokens", "anchors",
               "finished_for")

    def snapshot(self):
        return ({k: _copy([getattr(self, k)])[0] if k != "finished_for" else
                 list(self.finished_for) for k in self.MUTABLE}, self.g.get_state())

    def restore(self, snap) -> None:
        fields, rng = snap
        for k, v in fields.items():
            setattr(self, k, list(v) if k == "finished_for" else _copy([v])[0])
        self.g.set_state(rng)

    def ints(self, lo, hi, *shape):
        x = torch.randint(lo, hi, shape or (1,), generator=self.g)
        return x.to(self.dev) if shape else int(x)

    def rand(self, *shape):
        return torch.rand(shape, generator=self.g).to(self.dev)

    def begin(self, b: int) -> None:
        """Slot b takes a new sequence, as spd.runtime.control's take and Cycle.begin leave it:
        the first token at P committed, the only unit in flight stage 0's."""
        n, W, dev = self.n, self.W, self.dev
        kind = self.ints(0, 3)
        prompt = self.ints(0, V if kind == 0 else 3, P)
        if kind == 2:
            prompt = torch.arange(P, device=dev) % self.ints(2, 4)
        for t in (self.state, self.units, self.tokens, self.anchors, *self.lanes):
            t[b].zero_()
        self.lanes[6][b].fill_(-1)
        self.tokens[b, :P] = prompt
        first = self.ints(0, V)
        self.tokens[b, P] = first
        self.anchors[b] = torch.randn(M, self.C, D, generator=self.g).to(dev)
        self.state[b, COMMITTED], self.state[b, NEWEST] = P + 1, P
        key = seed_key((b + 1) * 0x9E3779B97F4A7C15 % 2**64)  # (all 64 bits: a draw's key)
        self.consts[b] = torch.tensor([self.C - 1, self.ints(3, 15), self.ints(0, 3),
                                       self.ints(0, 2), key])
        self.stops[b] = torch.where(self.rand(T) < 0.3, self.ints(0, V, T), -1)
        one = lambda v: torch.tensor(v, device=dev)  # noqa: E731
        trash = one(self.C - 1)
        tok = torch.full((W,), first, device=dev)
        lane0 = torch.arange(W, device=dev) == 0
        for s in range(n):
            self.units[b, s] = tree_unit(one(P + s), one(0), one(s == 0), one(s == 0), tok,
                                         lane0 & (s == 0), one(P + (s > 0)), trash, trash,
                                         trash, self.capacity, n)
        r = P % self.R
        self.lanes[0][b, r] = first
        self.lanes[3][b, r] = lane0
        self.lanes[6][b, r] = 0
        self.lanes[7][b, r] = 1
        self.finished_for[b] = 0

    # --- the three ops, on the kernels and on the references ----------------------------------
    def open(self, extra: int):
        args = (self.state, self.units, self.consts, self.lanes, self.tokens, self.anchors,
                self.tod)
        before = _copy(args)
        out = []
        for which, backend in enumerate(self.backends):
            B, RW = self.B, self.RW
            tplan = _poison(torch.empty(B, tplan_size(self.n, self.W), dtype=torch.int64,
                                        device=self.dev), which)
            mask = _poison(torch.empty(B, RW, RW, dtype=torch.bool, device=self.dev), which)
            window = _poison(torch.empty(B, M, RW, D, device=self.dev), which)
            draws = _poison(torch.empty(B, self.W + 2, device=self.dev), which)
            tree_open(*args, tplan, mask, window, extra, draws, backend=backend)
            _assert_same(args, before, f"tree_open's inputs ({backend})")
            out.append([tplan, mask, draws, window])
        got, want = out[0], out[-1]
        at = self.state[:, CYCLE:CYCLE + 1] * (self.W + 2) + torch.arange(self.W + 2,
                                                                          device=self.dev)
        assert torch.equal(want[2], philox_uniform(self.consts[:, KEY], at))
        if extra:  # post-step features: no window written
            assert (got[3] == 1e30).all() and (want[3] == 1e30 * len(out)).all()
            got, want = got[:3], want[:3]
        _assert_same(got, want, "tree_open")
        return out[-1][:2]

    def children(self, tplan, with_final: bool):
        B, W, dev = self.B, self.W, self.dev
        k = self.ints(1, W + 1)  # the children a leaf offers
        # each leaf's children, their log-probabilities descending, in steps of 0.5 (ties
        # within a leaf and across leaves), now and then one of zero probability (-inf); an
        # unsure leaf's lose to the others' (a branch ends)
        steps = self.ints(0, 3, B, W, k).float() * 0.5
        top = -steps.cumsum(-1) - 4.0 * (self.rand(B, W, 1) < 0.3)  # (some leaves unsure)
        top[..., -1] = torch.where(self.rand(B, W) < 0.15, float("-inf"), top[..., -1])
        ids = torch.stack([torch.stack([torch.randperm(V, generator=self.g)[:k]
                                        for _ in range(W)]) for _ in range(B)]).to(dev)
        ids = torch.where(self.rand(B, W, 1) < 0.2, self.ints(0, V, B, W, k), ids)  # repeats
        pmax = self.rand(B, W) * 0.6
        final = torch.randn(B, self.C, D, generator=self.g).to(dev) if with_final else None
        args = (tplan, self.lanes, top, ids, pmax, self.trust, self.log_trust)
        before = _copy(args)
        out = []
        for which, backend in enumerate(self.backends):
            kids = _poison(torch.empty(B, W, len(KID) + self.R, dtype=torch.int64,
                                       device=dev), which)
            kid_score = _poison(torch.empty(B, W, device=dev), which)
            judge = _poison(torch.empty(B, judge_size(W), dtype=torch.int64, device=dev),
                            which)
            hidden = _poison(torch.empty(B, D, device=dev), which) if with_final else None
            tree_children(*args, kids, kid_score, judge, final, hidden, backend=backend)
            _assert_same(args, before, f"tree_children's inputs ({backend})")
            out.append([kids, kid_score, judge] + ([hidden] if with_final else []))
        _assert_same(out[0], out[-1], "tree_children")
        return out[-1][:3]

    def verdicts(self, judge, sampled_args: bool):
        """A verdict for each sequence: a live candidate's token (an acceptance) or another
        token (a rejection); a sampled sequence's accepted candidate by its index (-1: none)."""
        B, W = self.B, self.W
        cands = judge[:, 1 + 3 * W:1 + 4 * W].tolist()
        verdict, accepted = [], []
        for b in range(B):
            live = [i for i, c in enumerate(cands[b]) if c >= 0]
            i = -1
            if live and self.rand(1) < 0.65:  # (the last live one often: its branch is short)
                i = live[-1] if self.rand(1) < 0.4 else live[self.ints(0, len(live))]
            verdict.append(cands[b][i] if i >= 0 else self.ints(0, V))
            accepted.append(i)
        verdict = torch.tensor(verdict, device=self.dev)
        accepted = torch.tensor(accepted, device=self.dev) if sampled_args else None
        return verdict, accepted

    def commit(self, tplan, kids, kid_score, judge, verdict, accepted):
        done = [self.state, self.units, self.lanes, self.tokens, self.anchors]
        read = [self.consts, tplan, kids, kid_score, judge, self.weight, self.stops, verdict,
                verdict if accepted is None else accepted]
        before = _copy(read)
        out = []
        for backend in self.backends:
            st, units, lanes, tokens, anchors = _copy(done)
            tree_commit(st, units, self.consts, tplan, kids, kid_score, judge, lanes, tokens,
                        anchors, self.weight, self.stops, verdict, accepted, 7,
                        backend=backend)
            _assert_same(read, before, f"tree_commit's inputs ({backend})")
            if torch.device(self.dev).type != "cpu":
                # (a GPU's index_copy_ writes repeated indices in no set order: which dead row
                # the reference leaves in the trash row is not the kernel's to match)
                at, trash = torch.arange(self.B, device=self.dev), self.consts[:, TRASH]
                tokens[at, trash] = 0
                anchors[at, :, trash] = 0
            out.append([st, units, lanes, tokens, anchors])
        _assert_same(out[0], out[-1], "tree_commit")
        return out[-1]

    # --- a cycle ------------------------------------------------------------------------------
    def cycle(self, seen: set) -> None:
        S = len(STATE)
        extra = int(self.rand(1) < 0.3)
        tplan, mask = self.open(extra)
        kids, kid_score, judge = self.children(tplan, bool(self.rand(1) < 0.7))
        sampled_args = bool(self.rand(1) < 0.75)
        verdict, accepted = self.verdicts(judge, sampled_args)
        before = self.state.clone()
        st, units, lanes, tokens, anchors = self.commit(tplan, kids, kid_score, judge, verdict,
                                                        accepted)
        # which branches each sequence took
        seen.add(("extra", extra))
        kinds = {c == 1 for c, d in zip(self.consts[:, GREEDY].tolist(),
                                        before[:, DONE].tolist()) if not d}
        if accepted is not None and len(kinds) == 2:
            seen.add("greedy and sampled in one batch")
        for b in range(self.B):
            p, j = tplan[b].tolist(), judge[b].tolist()
            committed, newest = p[T_COMMITTED], p[T_NEWEST]
            live, full = p[T_LIVE] == 1, p[T_FULL] == 1 and p[T_LIVE] == 1
            ok = st[b, S + 2 * j[0] + 1] > before[b, S + 2 * j[0] + 1]
            in_flight, after = committed <= newest, int(st[b, NEWEST])
            c = self.consts[b].tolist()
            if not live:
                seen.add("finished or free")
                continue
            seen.add(("greedy", c[GREEDY] == 1 or accepted is None))
            seen.add(("lookup length", p[T_LENGTH]))
            if newest == committed - 1:
                seen.add("committed newest")
            if not full:
                seen.add("filling")
            elif not ok:
                seen.add("rejected")
            elif not in_flight:
                seen.add("accepted at a gap")
            else:
                seen.add("accepted in flight")
                if newest > committed and after > committed:
                    seen.add("accepted, descendants kept")
                if after < newest:
                    seen.add("accepted, the branch ends short")
            if st[b, LOOKUP_JUDGED] > before[b, LOOKUP_JUDGED]:
                seen.add("lookup judged")
            if st[b, DONE] and not before[b, DONE]:
                stop = int(verdict[b]) in self.stops[b].tolist()
                seen.add("ended by a stop id" if stop else "ended by the budget")
                assert stop or int(st[b, N]) + 1 >= c[MAX_NEW]
        self.state, self.units, self.lanes, self.tokens, self.anchors = (st, units, lanes, tokens,
                                                                         anchors)
        for b in range(self.B - self.free):  # a finished sequence's slot takes a new one
            if self.state[b, DONE]:
                self.finished_for[b] += 1
                if self.finished_for[b] > 1 and self.rand(1) < 0.5:
                    self.begin(b)


BRANCHES = {"filling", "rejected", "accepted in flight", "accepted at a gap",
            "ended by a stop id", "ended by the budget", "finished or free", "committed newest",
            "lookup judged", ("greedy", True), ("greedy", False),
            "greedy and sampled in one batch", ("extra", 0), ("extra", 1)}
DEEP = {"accepted, descendants kept", "accepted, the branch ends short"}  # (n >= 3: with n = 2
# the judged position is the only one in flight)


@pytest.mark.parametrize("n, W, B", [(2, 2, 5), (3, 3, 4), (4, 4, 3), (2, 4, 4), (4, 2, 5),
                                     (3, 2, 3)])
def test_kernels_match_the_references_over_simulated_decodes(n, W, B):
    """Cycles of B simulated decodes: the first ones checked (the kernels against the
    references), then each that takes a branch not checked yet (found by running the cycle on
    the references first), until every branch was checked."""
    decodes = _Decodes(n, W, B, seed=10 * n + W, dev=TRITON_DEVICE)
    want = BRANCHES | (DEEP if n >= 3 else set())
    checked: set = set()

    def lengths():
        return {x[1] for x in checked if isinstance(x, tuple) and x[0] == "lookup length"}
    for cycle in range(100):
        if cycle >= 4:
            snap = decodes.snapshot()
            decodes.backends, seen = ("reference",), set()
            decodes.cycle(seen)
            if seen <= checked:
                continue
            decodes.restore(snap)
        decodes.backends = ("triton", "reference")
        decodes.cycle(checked)
        if want <= checked and len(lengths()) >= 4:
            break
    assert want <= checked, want - checked
    assert 0 in lengths() and len(lengths()) >= 4, lengths()


# --- the argument checks ---------------------------------------------------------------------

def _args(n=2, W=2, B=2, dev="cpu"):
    d = _Decodes(n, W, B, 0, dev)
    RW = d.RW
    i64 = dict(dtype=torch.int64, device=dev)
    open_args = dict(state=d.state, units=d.units, consts=d.consts, lanes=d.lanes,
                     tokens=d.tokens, anchors=d.anchors, type_of_depth=d.tod,
                     tplan=torch.zeros(B, tplan_size(n, W), **i64),
                     mask=torch.zeros(B, RW, RW, dtype=torch.bool, device=dev),
                     window=torch.zeros(B, M, RW, D, device=dev),
                     draws=torch.zeros(B, W + 2, device=dev))
    out = dict(kids=torch.zeros(B, W, len(KID) + n + 1, **i64),
               kid_score=torch.zeros(B, W, device=dev),
               judge=torch.zeros(B, judge_size(W), **i64))
    children_args = dict(tplan=open_args["tplan"], lanes=d.lanes,
                         top=torch.zeros(B, W, W, device=dev),
                         top_ids=torch.zeros(B, W, W, **i64), pmax=torch.zeros(B, W, device=dev),
                         trust=d.trust, log_trust=d.log_trust, **out)
    commit_args = dict(state=d.state, units=d.units, consts=d.consts, tplan=open_args["tplan"],
                       **out, lanes=d.lanes, tokens=d.tokens, anchors=d.anchors,
                       embed_weight=d.weight, stop_ids=d.stops,
                       verdict=torch.zeros(B, **i64), accepted=torch.zeros(B, **i64),
                       margin=7)
    return open_args, children_args, commit_args


def _lanes_with(lanes, i, x):
    return [x if k == i else t for k, t in enumerate(lanes)]


BAD = [  # (op, argument, the bad value made from the good ones, what the error says)
    ("open", "state", lambda a: a["state"][:, :-1], "state must be"),
    ("open", "units", lambda a: a["units"][:, :, :-1], "units must be"),
    ("open", "consts", lambda a: a["consts"][:, :2], rf"consts must be \[2, {len(CONST)}\]"),
    ("open", "lanes", lambda a: a["lanes"][:-1], "lanes must be"),
    ("open", "draws", lambda a: a["draws"].double(), "draws"),
    ("open", "draws", lambda a: a["draws"][:1], "draws must have the batch's 2"),
    ("open", "lanes", lambda a: _lanes_with(a["lanes"], 2, a["lanes"][2].double()),
     "lanes.score"),
    ("open", "lanes", lambda a: _lanes_with(a["lanes"], 5, a["lanes"][5][..., :-1]),
     "lanes.anc"),
    ("open", "tokens", lambda a: a["tokens"].int(), "tokens"),
    ("open", "anchors", lambda a: a["anchors"][:, :, :-1], "anchors"),
    ("open", "type_of_depth", lambda a: a["type_of_depth"][:-1], "type_of_depth"),
    ("open", "tplan", lambda a: a["tplan"][:, :-1], "tplan must be"),
    ("open", "mask", lambda a: a["mask"].long(), "mask"),
    ("open", "window", lambda a: a["window"][:, :, :-1], "window must be"),
    ("children", "top", lambda a: torch.zeros(2, 2, 3), "top must be"),
    ("children", "top_ids", lambda a: a["top_ids"][..., :1], "top_ids must be"),
    ("children", "pmax", lambda a: a["pmax"][:, :1], "pmax must be"),
    ("children", "trust", lambda a: a["trust"][:-1], "trust must be"),
    ("children", "log_trust", lambda a: a["log_trust"].double(), "log_trust"),
    ("children", "kids", lambda a: a["kids"][..., :-1], "kids must be"),
    ("children", "kid_score", lambda a: a["kid_score"][:, :1], "kid_score must be"),
    ("children", "judge", lambda a: a["judge"][:, :-1], "judge must be"),
    ("children", "final", lambda a: torch.zeros(2, 5, D), "go together"),
    ("commit", "embed_weight", lambda a: a["embed_weight"].double(), "embed_weight"),
    ("commit", "stop_ids", lambda a: a["stop_ids"].float(), "stop_ids"),
    ("commit", "verdict", lambda a: a["verdict"].view(2, 1), "verdict"),
    ("commit", "accepted", lambda a: a["accepted"].bool(), "accepted"),
    ("commit", "margin", lambda a: 0, "margin"),
]


@pytest.mark.parametrize("op, name, bad, msg", BAD, ids=[f"{o}-{m}" for o, m, _, _ in BAD])
def test_checks_name_what_is_wrong(op, name, bad, msg):
    args = dict(zip(("open", "children", "commit"), _args()))[op]
    fn = {"open": tree_open, "children": tree_children, "commit": tree_commit}[op]
    args[name] = bad(args)
    with pytest.raises(SPDInputError, match=msg):
        fn(**args)


def test_a_forced_kernel_says_which_layout_it_does_not_take():
    args = _args(dev=TRITON_DEVICE)[0]
    args["mask"] = torch.zeros(2, 6, 12, dtype=torch.bool, device=TRITON_DEVICE)[:, :, ::2]
    with pytest.raises(dispatch.SPDBackendError, match="mask"):
        tree_open(**args, backend="triton")


# --- the runtime on the kernels (what a GPU runs), against the runtime on the references -------

def _record(backend: str, record: list, monkeypatch) -> None:
    """Each of the three ops' `backend` kernel appends what it wrote to `record`, call by
    call."""
    from spd_kernels.opdef import SPECS
    for op in OPS:
        impl = dispatch._impl(op, backend)
        names = list(inspect.signature(impl.fn).parameters)
        written = [names.index(x) for x in SPECS[op].mutates]

        def fn(*args, _fn=impl.fn, _op=op, _at=written):
            _fn(*args)
            record.append((_op, _copy([args[i] for i in _at])))
        monkeypatch.setattr(impl, "fn", fn)


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="compares CPU decodes (the interpreter)")
def test_tree_decodes_on_the_kernels_equal_those_on_the_references(monkeypatch):
    """A tree decode (greedy with the context lookup on a prompt that repeats; sampled) on the
    kernels and on the references: the same tokens, N, K, judged and accepted drafts by
    position and the lookup's counts, and every op's writes the same, call by call."""
    from conftest import make_tiny_target

    from spd import SamplingParams, SPDEngine
    from spd_kernels import use_backend
    runs = ((2, [3, 1, 4, 1, 5, 9, 2, 6] * 2, SamplingParams()),
            (0, [2, 7, 1, 8, 2, 8], SamplingParams(temperature=0.9, seed=4)))
    engines = [SPDEngine(make_tiny_target(seed=3, vocab=32, layers=4), n_stages=3,
                         anchors=[0, 2, 3], tree_width=3, lookup=lookup, warn_untrained=False)
               for lookup, _, _ in runs]
    calls, results = {}, {}
    for backend in ("reference", "triton"):
        calls[backend], results[backend] = [], []
        _record(backend, calls[backend], monkeypatch)
        with use_backend(**dict.fromkeys(OPS, backend)):
            for engine, (_, prompt, sampling) in zip(engines, runs):
                r = engine.generate(prompt, 12, sampling)
                results[backend].append((r.token_ids, r.stats.N, r.stats.K,
                                         dict(r.stats.by_position), r.stats.lookup_judged,
                                         r.stats.lookup_accepted))
        monkeypatch.undo()
    assert results["triton"] == results["reference"]
    assert results["reference"][0][4] > 0  # (the lookup's proposals were judged)
    assert [c[0] for c in calls["triton"]] == [c[0] for c in calls["reference"]]
    for i, ((op, x), (_, y)) in enumerate(zip(calls["triton"], calls["reference"])):
        _assert_same(x, y, (op, i))
