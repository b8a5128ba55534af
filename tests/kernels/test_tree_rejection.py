"""tree_rejection_sample: several deterministic candidates (siblings in a draft tree) checked in
order, each as a point-mass draft against the target's residual; the output must be distributed
exactly as p = filtered_probs(logits, temperature, top_k, top_p).

Against a float64 simulation of the sequential procedure written here, on hand-made edge cases,
statistically (chi-square against p; significance 1e-3 per case with fixed seeds, so a run is
deterministic), and the Triton kernel against the reference; the batched form ([B, V] rows, one
launch) against the 1-D call on each row.
"""
import math

import pytest
import torch
from conftest import needs_triton

from spd_kernels import SPDInputError, dispatch, tree_rejection_sample
from spd_kernels.sampling import filtered_probs, sample_from_probs
from spd_kernels.testing import TRITON_DEVICE, chi2_pvalue, poisoned_outputs
from spd_kernels.verify.tree import tree_rejection_sample_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1


def simulate(p: torch.Tensor, candidates: list[int], u: list[float]) -> tuple[int, int]:
    """The sequential procedure in float64: r_0 = p; accept c_i iff u_i < r_i(c_i); on rejection
    r_{i+1} = r_i without c_i, renormalised; if none is accepted, the inverse-CDF draw at u_k
    (first index whose running mass exceeds u_k * total). Returns (token, accepted index)."""
    r = p.double().clone()
    r /= r.sum()
    for i, c in enumerate(candidates):
        if c == -1:
            continue
        if u[i] < float(r[c]):
            return c, i
        r[c] = 0.0
        if float(r.sum()) > 0:
            r /= r.sum()
    cdf = r.cumsum(0)
    goal = u[len(candidates)] * float(cdf[-1])
    hits = ((cdf > goal) & (r > 0)).nonzero()
    return int(hits[0]) if len(hits) else int((r > 0).nonzero()[-1]), -1


def call(logits, candidates, u, temperature=1.0, top_k=0, top_p=1.0, backend=None):
    tok, acc = tree_rejection_sample(logits, torch.tensor(candidates, dtype=torch.int64),
                                     torch.tensor(u, dtype=torch.float32), temperature, top_k,
                                     top_p, backend=backend)
    assert tok.shape == (1,) and acc.shape == (1,)
    assert tok.dtype == torch.int64 and acc.dtype == torch.int64
    return int(tok), int(acc)


# --- exact small cases ---------------------------------------------------------------------------

LOGITS4 = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()  # p = (0.1, 0.2, 0.3, 0.4) at temperature 1


@pytest.mark.parametrize("u,want", [
    ([0.39, 0.0, 0.5], (3, 0)),       # u0 < p(3) = 0.4
    ([0.41, 0.49, 0.5], (2, 1)),      # then r_1(2) = 0.3 / 0.6 = 0.5
    ([0.41, 0.51, 0.30], (0, -1)),    # residual {0: 1/3, 1: 2/3}: u2 < 1/3 gives 0
    ([0.41, 0.51, 0.34], (1, -1)),
    ([0.0, BELOW_ONE, 0.0], (3, 0)),  # u = 0 accepts any candidate with mass
    ([BELOW_ONE, BELOW_ONE, BELOW_ONE], (1, -1)),
])
def test_hand_computed(u, want):
    assert call(LOGITS4, [3, 2], u) == want


def test_candidates_outside_the_support_are_rejected_and_leave_the_residual():
    # top_k = 2 keeps {3: 4/7, 2: 3/7}; 0 and 1 have no mass
    assert call(LOGITS4, [0, 3], [0.0, 0.57, 0.5], top_k=2) == (3, 1)  # r_1(3) = 4/7 ~ 0.5714
    assert call(LOGITS4, [0, 3], [0.0, 0.58, 0.5], top_k=2) == (2, -1)
    assert call(LOGITS4, [1, 0], [0.0, 0.0, 0.1], top_k=2) == (2, -1)  # residual = p
    assert call(LOGITS4, [1, 0], [0.0, 0.0, 0.5], top_k=2) == (3, -1)
    # top_p = 0.5 keeps {3, 2} as well (0.4 < 0.5, then 0.7 reaches it)
    assert call(LOGITS4, [1, 2], [0.0, 0.42, 0.0], top_p=0.5) == (2, 1)  # 0.42 < 3/7
    # a token of probability 0 at temperature 1 (logit -inf): never accepted
    lg = torch.tensor([0.0, float("-inf"), 0.0])
    assert call(lg, [1], [0.0, 0.7]) == (2, -1)


@pytest.mark.parametrize("order", [[3, 2], [2, 3], [2, 0, 3, -1, 1]])
def test_all_mass_on_candidates_accepts_the_last_with_mass(order):
    last = max(i for i, c in enumerate(order) if c in (2, 3))
    for u0 in (0.0, 0.6, 0.99, BELOW_ONE):
        u = [u0] * len(order) + [0.5]
        tok, acc = call(LOGITS4, order, u, top_k=2)
        assert acc >= 0 and tok == order[acc]  # never the residual draw
        assert u0 < 0.42 or acc == last      # rejected up to the last one, taken whatever u
    u = [BELOW_ONE] * len(order) + [BELOW_ONE]
    assert call(LOGITS4, order, u, top_k=2) == (order[last], last)


def test_padding_and_no_candidates_sample_from_p():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(20, generator=g) * 2
    p = filtered_probs(logits, 0.8, 0, 0.9)
    for uk in (0.0, 0.3, 0.77, BELOW_ONE):
        want = int(sample_from_probs(p, torch.tensor(uk)))
        assert call(logits, [], [uk], 0.8, 0, 0.9) == (want, -1)
        assert call(logits, [-1, -1], [0.0, 0.0, uk], 0.8, 0, 0.9) == (want, -1)
    # the uniform of a padding entry is never read
    a = call(logits, [5, -1, 7], [0.9, 0.0, 0.4, 0.3], 0.8, 0, 0.9)
    b = call(logits, [5, -1, 7], [0.9, 0.95, 0.4, 0.3], 0.8, 0, 0.9)
    assert a == b


def test_residual_draw_ties_follow_sample_from_probs():
    logits = torch.zeros(8)  # every token ties: p = 1/8 each
    logits[6] = float("-inf")
    cand = [0, 3, 5]
    p = filtered_probs(logits, 1.0)
    rest = p.clone()
    rest[cand] = 0.0
    for uk in (0.0, 0.25, 0.5, 0.75, 0.999, BELOW_ONE, 1 / 3, 2 / 3):
        want = int(sample_from_probs(rest, torch.tensor(uk, dtype=torch.float32)))
        got = call(logits, cand, [BELOW_ONE] * 3 + [uk])
        assert got == (want, -1), uk
        assert want not in cand and want != 6


def test_float64_uniforms_are_read_as_float32_below_one():
    u = torch.tensor([1.0 - 1e-12, 1.0 - 1e-12], dtype=torch.float64)  # float32 rounds it to 1
    tok, acc = tree_rejection_sample(LOGITS4, torch.tensor([0]), u)
    assert (int(tok), int(acc)) == (3, -1)  # the last token with mass, as u just below 1 draws


@pytest.mark.parametrize("seed", range(6))
def test_matches_the_float64_simulation(seed):
    g = torch.Generator().manual_seed(seed)
    V = int(torch.randint(6, 40, (1,), generator=g))
    logits = torch.randn(V, generator=g) * 2
    temperature, top_k, top_p = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8),
                                 (0.9, 8, 0.7), (1.3, 3, 1.0), (0.5, 0, 0.95)][seed]
    p = filtered_probs(logits, temperature, top_k, top_p)
    for _ in range(40):
        k = int(torch.randint(0, 5, (1,), generator=g))
        perm = torch.randperm(V, generator=g)
        if seed % 2:  # the two likeliest first: often accepted
            top = p.topk(2).indices
            perm = torch.cat([top, perm[~torch.isin(perm, top)]])
        cand = perm[:k]
        cand[torch.rand(k, generator=g) < 0.2] = -1
        cand = cand.tolist()
        u = torch.rand(k + 1, generator=g).tolist()
        assert call(logits, cand, u, temperature, top_k, top_p) == simulate(p, cand, u), cand


# --- statistics ------------------------------------------------------------------------------------

def draws(logits, cand, n, temperature, top_k, top_p, seed):
    """n outputs of the reference for fresh uniforms (vmapped over them)."""
    u = torch.rand(n, len(cand) + 1, generator=torch.Generator().manual_seed(seed))
    c = torch.tensor(cand, dtype=torch.int64)
    tok, acc = torch.vmap(lambda uu: tree_rejection_sample_reference(
        logits, c, uu, temperature, top_k, top_p))(u)
    return tok[:, 0], acc[:, 0]


# (V, temperature, top_k, top_p, candidates): ranks into p's order ("r0" the likeliest), "x"
# a token outside the support, -1 padding
STAT_CASES = [
    (12, 1.0, 0, 1.0, ["r0"]),
    (30, 0.7, 8, 1.0, ["x", "r0", "r2"]),
    (50, 1.0, 0, 0.8, [-1, "x", "r1", "r0"]),
    (20, 0.7, 3, 1.0, ["r2", "r0", "x", "r1"]),   # all of p's mass on candidates
    (40, 1.0, 6, 0.9, ["r4", "r2"]),
    (25, 0.7, 0, 1.0, []),
    (16, 1.0, 4, 0.6, ["r1", -1]),
]


@pytest.mark.parametrize("case", range(len(STAT_CASES)))
def test_output_is_distributed_as_p(case):
    V, temperature, top_k, top_p, spec = STAT_CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    logits = torch.randn(V, generator=g) * 2
    p = filtered_probs(logits, temperature, top_k, top_p)
    order = torch.sort(p, descending=True, stable=True).indices
    outside = (p == 0).nonzero()[:, 0]
    cand = [s if s == -1 else int(outside[0]) if s == "x" else int(order[int(s[1:])])
            for s in spec]
    assert all(c == -1 or (s == "x") == (p[c] == 0) for c, s in zip(cand, spec))
    n = 20000
    tok, acc = draws(logits, cand, n, temperature, top_k, top_p, seed=case)
    counts = torch.bincount(tok, minlength=V)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts[p > 0], p[p > 0]) > 1e-3
    # accepted i <=> the token is c_i; the residual never gives a candidate
    c = torch.tensor(cand + [-2], dtype=torch.int64)
    assert torch.equal(tok[acc >= 0], c[acc[acc >= 0]])
    assert not torch.isin(tok[acc < 0], c).any()
    # acceptance rate = sum of p over the candidates
    real = [x for x in cand if x != -1]
    expect = float(p[real].sum()) if real else 0.0
    rate = float((acc >= 0).float().mean())
    assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n) + 1e-6
    if expect > 1 - 1e-6:
        assert (acc >= 0).all()


# --- bad input -------------------------------------------------------------------------------------

@pytest.mark.parametrize("change,msg", [
    (dict(logits=torch.randn(1, 1, 6)), r"target_logits must have 1 dimension \[V\] or 2"),
    (dict(logits=torch.randn(1, 6)), "candidates must have 2 dimensions"),  # batched: [B, k]
    (dict(logits=torch.arange(6)), "target_logits must be a floating-point"),
    (dict(logits=torch.randn(0), cand=torch.tensor([], dtype=torch.int64), u=torch.rand(1)),
     "target_logits is empty"),
    (dict(cand=torch.tensor([1.0, 2.0])), "candidates must be an int32 or int64"),
    (dict(cand=torch.tensor([[1, 2]])), "candidates must have 1 dimensions"),
    (dict(cand=torch.tensor([1, 6])), r"candidates must be target ids in \[0, 6\) or -1"),
    (dict(cand=torch.tensor([-2, 1])), r"candidates must be target ids in \[0, 6\) or -1"),
    (dict(cand=torch.tensor([3, 3])), "candidates must be distinct"),
    (dict(cand=torch.tensor([-1, -1])), None),  # padding may repeat
    (dict(cand=torch.tensor([1, 2], device="meta")), "candidates is on meta"),
    (dict(u=torch.rand(2)), r"uniforms must hold k \+ 1 = 3 values"),
    (dict(u=torch.rand(4)), r"uniforms must hold k \+ 1 = 3 values"),
    (dict(u=torch.tensor([0, 0, 0])), "uniforms must be a floating-point"),
    (dict(u=torch.tensor([0.5, 1.0, 0.2])), r"uniforms must lie in \[0, 1\)"),
    (dict(u=torch.tensor([0.5, -0.1, 0.2])), r"uniforms must lie in \[0, 1\)"),
    (dict(u=torch.tensor([0.5, float("nan"), 0.2])), r"uniforms must lie in \[0, 1\)"),
    (dict(u=torch.rand(3, device="meta")), "uniforms is on meta"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(temperature=-1.0), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be an integer"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
])
def test_bad_input_names_the_argument(change, msg):
    args = dict(logits=torch.randn(6), cand=torch.tensor([1, 2]), u=torch.rand(3),
                temperature=1.0, top_k=0, top_p=1.0)
    args.update(change)
    run = lambda: tree_rejection_sample(args["logits"], args["cand"], args["u"],
                                        args["temperature"], args["top_k"], args["top_p"])
    if msg is None:
        run()
        return
    with pytest.raises(SPDInputError, match=msg):
        run()


def test_int32_candidates_are_taken():
    u = torch.tensor([0.41, 0.49, 0.5])
    a = tree_rejection_sample(LOGITS4, torch.tensor([3, 2], dtype=torch.int32), u)
    assert (int(a[0]), int(a[1])) == (2, 1)


# --- the batched form: [B, V], [B, k], [B, k + 1] -> [B], [B] -------------------------------------

def batch_case(B, V, k, seed, device="cpu"):
    """Logits [B, V] (a row slice of a wider tensor), candidates [B, k]: distinct ids per row
    (even rows: the likeliest tokens, shuffled, so often accepted), some -1, row 1 all padding;
    uniforms [B, k + 1], row 2 rejecting all it can."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V + 5, generator=g) * 3)[:, :V]
    order = logits.argsort(dim=1, descending=True)
    cand = torch.stack([order[b, torch.randperm(k + 1, generator=g)[:k]] if b % 2 == 0
                        else torch.randperm(V, generator=g)[:k] for b in range(B)])
    cand[torch.rand(B, k, generator=g) < 0.25] = -1
    if B > 1:
        cand[1] = -1
    u = torch.rand(B, k + 1, generator=g)
    if B > 2:
        u[2, :k] = BELOW_ONE
    return logits.to(device), cand.to(device), u.to(device)


BATCH_PARAMS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.9, 0, 0.8)]


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("B,V,k", [(1, 30, 3), (3, 50, 4), (5, 24, 1), (3, 17, 0)])
def test_batched_equals_the_rows(backend, B, V, k):
    device = "cpu" if backend == "reference" else TRITON_DEVICE
    for i, (temperature, top_k, top_p) in enumerate(BATCH_PARAMS):
        logits, cand, u = batch_case(B, V, k, seed=10 * B + k + i, device=device)
        with poisoned_outputs("ab"[i % 2]):
            tok, acc = tree_rejection_sample(logits, cand, u, temperature, top_k, top_p,
                                             backend=backend)
        assert tok.shape == (B,) and acc.shape == (B,)
        assert tok.dtype == torch.int64 and acc.dtype == torch.int64
        rows = [tree_rejection_sample(logits[b], cand[b], u[b], temperature, top_k, top_p,
                                      backend=backend) for b in range(B)]
        assert torch.equal(tok, torch.cat([t for t, _ in rows])), (tok, rows)
        assert torch.equal(acc, torch.cat([a for _, a in rows])), (acc, rows)
        if backend == "triton":
            ref = tree_rejection_sample_reference(logits, cand, u, temperature, top_k, top_p)
            assert torch.equal(tok, ref[0]) and torch.equal(acc, ref[1])


@needs_triton
def test_batched_triton_takes_half_logits_int32_candidates_float64_uniforms():
    logits, cand, u = batch_case(3, 40, 3, seed=4, device=TRITON_DEVICE)
    logits, cand, u = logits.half(), cand.int(), u.double()
    tok, acc = tree_rejection_sample(logits, cand, u, 0.8, 0, 0.9, backend="triton")
    ref = tree_rejection_sample(logits, cand, u, 0.8, 0, 0.9, backend="reference")
    assert torch.equal(tok, ref[0]) and torch.equal(acc, ref[1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_batched_empty_batch(backend):
    device = "cpu" if backend == "reference" else TRITON_DEVICE
    logits, cand, u = torch.randn(0, 6), torch.zeros(0, 2, dtype=torch.int64), torch.rand(0, 3)
    tok, acc = tree_rejection_sample(logits.to(device), cand.to(device), u.to(device),
                                     backend=backend)
    assert tok.shape == (0,) and acc.shape == (0,) and tok.dtype == acc.dtype == torch.int64


@pytest.mark.parametrize("change,msg", [
    (dict(cand=torch.tensor([[1, 2], [3, 4], [0, 5]])), "candidates must have B = 2 rows"),
    (dict(cand=torch.tensor([1, 2])), "candidates must have 2 dimensions"),
    (dict(u=torch.rand(3, 3)), "uniforms must have B = 2 rows"),
    (dict(u=torch.rand(1, 3)), "uniforms must have B = 2 rows"),
    (dict(u=torch.rand(3)), "uniforms must have 2 dimensions"),
    (dict(u=torch.rand(2, 4)), r"uniforms must hold k \+ 1 = 3 values"),
    (dict(u=torch.tensor([[0.5, 0.1, 0.2], [0.3, 1.0, 0.2]])), r"uniforms must lie in \[0, 1\)"),
    (dict(logits=torch.randn(2, 0)), "target_logits is empty"),
    (dict(cand=torch.tensor([[1, 2], [0, 6]])),
     r"candidates must be target ids in \[0, 6\) or -1 \(padding\) \(row 1\)"),
    (dict(cand=torch.tensor([[-2, 1], [0, 3]])), r"target ids in \[0, 6\).* \(row 0\)"),
    (dict(cand=torch.tensor([[1, 2], [4, 4]])), r"candidates must be distinct .*\(row 1\)"),
    (dict(cand=torch.tensor([[1, 2], [1, 2]])), None),     # a repeat across rows is fine
    (dict(cand=torch.tensor([[-1, -1], [5, -1]])), None),  # padding may repeat
    (dict(cand=torch.tensor([[1, 2], [3, 4]], device="meta")), "candidates is on meta"),
])
def test_batched_bad_shapes_name_the_argument(change, msg):
    args = dict(logits=torch.randn(2, 6), cand=torch.tensor([[1, 2], [3, -1]]),
                u=torch.rand(2, 3))
    args.update(change)
    run = lambda: tree_rejection_sample(args["logits"], args["cand"], args["u"])
    if msg is None:
        tok, acc = run()
        assert tok.shape == (2,) and acc.shape == (2,)
        return
    with pytest.raises(SPDInputError, match=msg):
        run()


def test_batched_library_op():
    logits, cand, u = batch_case(3, 20, 2, seed=9)
    a = torch.ops.spd.tree_rejection_sample(logits, cand, u, 0.8, 5, 0.9)
    b = tree_rejection_sample_reference(logits, cand, u, 0.8, 5, 0.9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[0].shape == (3,)
    torch.library.opcheck(torch.ops.spd.tree_rejection_sample.default,
                          (logits, cand, u, 0.8, 5, 0.9))


# --- torch.library -------------------------------------------------------------------------------

def test_library_op():
    g = torch.Generator().manual_seed(7)
    logits, cand, u = torch.randn(30, generator=g), torch.tensor([4, -1, 9]), torch.rand(4)
    assert "reference" in dispatch.available("tree_rejection_sample", torch.device("cpu"))
    a = torch.ops.spd.tree_rejection_sample(logits, cand, u, 0.8, 5, 0.9)
    b = tree_rejection_sample_reference(logits, cand, u, 0.8, 5, 0.9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    d = torch.ops.spd.tree_rejection_sample(logits, cand, u)  # defaults: T = 1, no filtering
    e = tree_rejection_sample(logits, cand, u)
    assert torch.equal(d[0], e[0]) and torch.equal(d[1], e[1])
    torch.library.opcheck(torch.ops.spd.tree_rejection_sample.default,
                          (logits, cand, u, 0.8, 5, 0.9))


def test_compiled_fullgraph():
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(8)
    logits, cand, u = torch.randn(24, generator=g), torch.tensor([2, 11]), torch.rand(3)
    fn = lambda lg, c, uu: tree_rejection_sample(lg, c, uu, temperature=0.7, top_k=6)
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(logits, cand, u)
    ref = fn(logits, cand, u)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


# --- Triton ----------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("V,temperature,top_k,top_p", [
    (12, 1.0, 0, 1.0), (50, 0.7, 5, 1.0), (50, 1.0, 0, 0.8), (300, 0.9, 20, 0.6)])
def test_triton_matches_reference(V, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(V + top_k)
    logits = (torch.randn(V, generator=g) * 3).to(TRITON_DEVICE)
    p = filtered_probs(logits, temperature, top_k, top_p).cpu()
    order = torch.sort(p, descending=True, stable=True).indices.tolist()
    outside = (p == 0).nonzero()[:, 0].tolist()
    sets = [[], [-1], [order[0]], order[:3], ([outside[0]] if outside else []) + order[1:3] + [-1]]
    if top_k:  # every token with mass is a candidate
        sets.append(order[:top_k][::-1])
    for cand in sets:
        c = torch.tensor(cand, dtype=torch.int64, device=TRITON_DEVICE)
        for trial in range(3):
            u = torch.rand(len(cand) + 1, generator=g).to(TRITON_DEVICE)
            if trial == 2:
                u[:-1] = BELOW_ONE  # reject as much as possible: the residual walk
            ref = tree_rejection_sample_reference(logits, c, u, temperature, top_k, top_p)
            with poisoned_outputs("ab"[trial % 2]):
                out = tree_rejection_sample(logits, c, u, temperature, top_k, top_p,
                                            backend="triton")
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), (cand, out, ref)


@needs_triton
def test_triton_takes_half_logits_and_int32_candidates():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(40, generator=g) * 2).half().to(TRITON_DEVICE)
    c = torch.tensor([5, 17, -1], dtype=torch.int32, device=TRITON_DEVICE)
    for _ in range(3):
        u = torch.rand(4, generator=g).to(TRITON_DEVICE)
        ref = tree_rejection_sample_reference(logits, c, u, 0.8, 0, 0.9)
        out = tree_rejection_sample(logits, c, u, 0.8, 0, 0.9, backend="triton")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
