"""The sort-free top-k / top-p thresholds of the one-program Triton kernels (`_logits_stats` in
spd_kernels/verify/triton_rejection.py, which rejection_sample_logits and tree_rejection_sample
share): a pivot search over the keys, NPIV pivots a pass. The kept set the kernel finds must be
exactly the reference's (spd_kernels.sampling.filtered_probs: a stable sort, the first k tokens,
then the shortest prefix reaching top_p with the lower ids of a tie group first) on random rows,
ties at both cuts, duplicated maxima, -inf, NaN and +inf rows, k >= V, p = 1, tiny p and several
temperatures; its normaliser within fp32 rounding of the kept mass; and its passes over the row
within the bound the search guarantees."""
import pytest
import torch
from conftest import needs_triton

from spd_kernels._triton import HAS_TRITON, tl, triton
from spd_kernels.sampling import filtered_probs, top_p_float32
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs
from spd_kernels.verify import (
    rejection_sample_logits_reference,
    target_to_draft_map,
    triton_rejection,
)
from spd_kernels.verify.tree import tree_rejection_sample_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

INF, NAN = float("inf"), float("nan")
# stats pass + top-k search + its tie pass + top-p search + its tie pass
MAX_PASSES = 1 + triton_rejection.TOP_K_PASSES + 1 + triton_rejection.TOP_P_PASSES + 1

if HAS_TRITON:

    @triton.jit
    def _stats_probe_kernel(x_ptr, stride_x, out_i_ptr, out_f_ptr, V, temperature, top_k, top_p,
                            TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK: tl.constexpr):
        """Row r's (amax, ck, ci, passes) into out_i [R, 4], (mx, z) into out_f [R, 2]."""
        r = tl.program_id(0).to(tl.int64)
        mx, amax, ck, ci, z, npass = triton_rejection._logits_stats_passes(
            x_ptr + r * stride_x, V, temperature, top_k, top_p, False, TOP_K, TOP_P, BLOCK)
        tl.store(out_i_ptr + 4 * r, amax)
        tl.store(out_i_ptr + 4 * r + 1, ck)
        tl.store(out_i_ptr + 4 * r + 2, ci)
        tl.store(out_i_ptr + 4 * r + 3, npass)
        tl.store(out_f_ptr + 2 * r, mx)
        tl.store(out_f_ptr + 2 * r + 1, z)


def kernel_stats(logits, temperature, top_k, top_p):
    """logits [R, V] -> amax, ck, ci, passes [R] (int32) and mx, z [R] (fp32) from the kernel,
    outputs poisoned first."""
    R, V = logits.shape
    block, warps = triton_rejection._rejection_block(V)
    with poisoned_outputs():
        out_i = torch.empty(R, 4, dtype=torch.int32, device=logits.device)
        out_f = torch.empty(R, 2, dtype=torch.float32, device=logits.device)
    out_i.fill_(-7)
    out_f.fill_(NAN)
    _stats_probe_kernel[(R,)](logits, logits.stride(0), out_i, out_f, V, float(temperature),
                              int(top_k), top_p_float32(top_p), TOP_K=0 < top_k < V,
                              TOP_P=top_p < 1.0, BLOCK=block, num_warps=warps)
    out_i, out_f = out_i.cpu(), out_f.cpu()
    return (*out_i.unbind(1), *out_f.unbind(1))


def keys(x):
    """The kernels' monotone int32 key of each fp32 value."""
    bits = x.view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def check_kept_set(logits, temperature, top_k, top_p):
    """The kernel's kept set and argmax equal the reference's on every row; z within rounding
    of the kept mass; the passes within the bound. Returns the passes [R]."""
    logits = logits.to(TRITON_DEVICE)
    amax, ck, ci, npass, mx, z = kernel_stats(logits, temperature, top_k, top_p)
    x = logits.float().cpu() / temperature
    ref = filtered_probs(logits.cpu(), temperature, top_k, top_p)
    ids = torch.arange(x.shape[1])
    for r in range(x.shape[0]):
        where = (temperature, top_k, top_p, r)
        assert 1 <= int(npass[r]) <= MAX_PASSES, where
        row_amax = int(x[r].argmax())
        if not torch.isfinite(x[r, row_amax]):  # NaN / inf row: one-hot at the argmax
            assert float(z[r]) == 0.0 and int(amax[r]) == row_amax, where
            assert int(npass[r]) == 1, where  # no search on a degenerate row
            continue
        assert int(amax[r]) == row_amax and float(mx[r]) == float(x[r].max()), where
        k = keys(x[r])
        kept = (k > ck[r]) | ((k == ck[r]) & (ids <= ci[r])) if (
            0 < top_k < x.shape[1] or top_p < 1.0) else torch.ones_like(k, dtype=torch.bool)
        # tokens whose weight exp(x - max) is 0 (-inf, underflow) carry no mass either way
        kept &= torch.exp(x[r] - x[r].max()) > 0
        assert torch.equal(kept, ref[r] > 0), (where, kept.nonzero().flatten(),
                                                (ref[r] > 0).nonzero().flatten())
        mass = torch.exp(x[r].double() - x[r].max().double())[kept].sum().item()
        assert float(z[r]) == pytest.approx(mass, rel=2e-5), where
    return npass


def random_rows(R, V, seed, ties=False, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * scale
    if ties:
        x = (x * 2).round() / 2  # many equal logits: tie groups at every cut
    return x


FILTERS = [(0, 0.9), (5, 1.0), (1, 1.0), (20, 0.5), (7, 0.9), (0, 0.05), (0, 1e-12),
           (50, 0.95), (3, 0.999)]


@needs_triton
@pytest.mark.parametrize("V,ties,temperature", [(37, False, 1.0), (37, True, 0.7),
                                                (300, True, 1.3), (1000, False, 0.7),
                                                (1000, True, 1.0)])
def test_kept_set_equals_the_reference(V, ties, temperature):
    logits = random_rows(4, V, seed=V + int(ties), ties=ties)
    logits[1, 3] = logits[1, 7] = logits[1].max() + 0.5  # duplicated maxima
    logits[2, ::5] = -INF
    for top_k, top_p in FILTERS:
        check_kept_set(logits, temperature, top_k, top_p)


def test_pass_bounds_hold_for_the_widest_key_interval():
    """The search's pass counts cover a 2^32-key interval by the key-spaced half of the pivots
    alone: under 1/(PIVOTS / 2) of it is left per top-k pass, at most ceil(d / (PIVOTS / 2 + 1))
    per top-p pass."""
    half = triton_rejection.PIVOTS // 2
    d = 2 ** 32
    for _ in range(triton_rejection.TOP_K_PASSES):
        d = -(-d // half) - 1
    assert d <= 0
    d = 2 ** 32
    for _ in range(triton_rejection.TOP_P_PASSES):
        d = -(-d // (half + 1))
    assert d <= 1


@needs_triton
def test_ties_at_both_cuts_and_the_edges():
    """Rows built so the top-k cut and the top-p cut fall inside tie groups (the lower ids
    kept), k >= V, p = 1, tiny p, all -inf but one, -inf inside the kept range, a NaN row, a
    +inf row, an all -inf row and widely spread values (keys far apart)."""
    V = 64
    g = torch.Generator().manual_seed(5)
    rows = []
    tie = torch.randn(V, generator=g)
    tie[torch.randperm(V, generator=g)[:12]] = 2.0  # a tie group of 12 at the top...
    tie[torch.randperm(V, generator=g)[:3]] = 3.0   # ...below three tied maxima
    rows.append(tie)
    flat = torch.zeros(V)                           # every token tied
    rows.append(flat)
    one = torch.full((V,), -INF)
    one[17] = 0.0                                   # a single finite token
    rows.append(one)
    spread = torch.randn(V, generator=g) * 1e3      # values far apart in key space
    spread[::3] = -spread[::3].abs() * 1e-30        # tiny negatives near zero
    rows.append(spread)
    subnormal = torch.randn(V, generator=g) * 1e-40  # subnormal logits
    rows.append(subnormal)
    plain = torch.randn(V, generator=g) * 2
    rows.append(plain)
    logits = torch.stack(rows)
    edges = [(V, 0.5), (V + 10, 0.7), (0, 1.0), (12, 0.6), (14, 0.3), (2, 0.5), (V - 1, 1.0),
             (4, 1e-12)]
    for i, (top_k, top_p) in enumerate(FILTERS + edges):
        check_kept_set(logits, (1.0, 0.5, 3.0)[i % 3], top_k, top_p)
    degenerate = torch.stack([torch.tensor([0.5, NAN, 1.0, NAN] + [0.0] * (V - 4)),
                              torch.tensor([0.5, 1.0, INF, 2.0, INF] + [0.0] * (V - 5)),
                              torch.full((V,), -INF)])
    for top_k, top_p in ((5, 0.5), (0, 0.9), (3, 1.0)):
        check_kept_set(degenerate, 1.0, top_k, top_p)


def top_p_tie_row(V, m, top_k=0):
    """A row whose top-p cut falls after the m-th token of a tie group of 6 interleaved with
    other ids (top_p half a token's weight past it), and that top_p."""
    x = torch.zeros(V)
    x[4] = 2.5
    tied = [1, 3, 5, 9, 11, 20]
    x[tied] = 1.0
    x[30:] = -1.0
    e = torch.exp(x.double() - 2.5)
    order = sorted(range(V), key=lambda i: (-float(x[i]), i))
    z = e[order[:top_k or V]].sum()
    before = e[4]
    return x, float((before + (m - 0.5) * e[1]) / z)


@needs_triton
@pytest.mark.parametrize("m", [1, 2, 4, 6])
def test_top_p_cut_inside_a_tie_group(m):
    x, top_p = top_p_tie_row(40, m)
    check_kept_set(x[None], 1.0, 0, top_p)
    kept = (filtered_probs(x[None], 1.0, 0, top_p)[0] > 0).nonzero().flatten().tolist()
    assert kept == sorted([4] + [1, 3, 5, 9, 11, 20][:m])
    x, top_p = top_p_tie_row(40, min(m, 3), top_k=4)  # top-k cuts the same group after 3
    check_kept_set(x[None], 1.0, 4, top_p)


@needs_triton
@pytest.mark.parametrize("top_k,top_p,temperature", [
    (50, 0.9, 0.8),
    pytest.param(0, 0.9, 0.8, marks=pytest.mark.slow),
    pytest.param(50, 1.0, 0.8, marks=pytest.mark.slow),
    pytest.param(0, 1e-12, 1.0, marks=pytest.mark.slow)])
def test_kept_set_at_qwen_vocab(top_k, top_p, temperature):
    """One row of 151,936 logits (Qwen3's vocabulary), with ties at the cut (about 10 s a case
    in the interpreter): the kept set equals the reference's in a handful of passes."""
    V = 151936
    x = random_rows(1, V, seed=3, scale=2.0)
    x[0, V - 5:] = x[0].max()  # tied maxima at the end of the row
    x[0, :1000] = (x[0, :1000] * 4).round() / 4
    npass = check_kept_set(x, temperature, top_k, top_p)
    assert int(npass[0]) <= 12, int(npass[0])


@needs_triton
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 4, 0.9), (0.6, 0, 0.7),
                                                      (1.5, 9, 1.0), (1.0, 3, 1e-9)])
def test_samplers_match_the_reference_with_ties(temperature, top_k, top_p, ties):
    """rejection_sample_logits (one program a row) and tree_rejection_sample, outputs
    poisoned, against their references bit for bit on rows with ties at the cuts."""
    R, V, Vd = 6, 90, 60
    g = torch.Generator().manual_seed(17 + top_k)
    logits = random_rows(R, V, seed=23 + top_k, ties=ties)
    logits[0, 10] = logits[0, 50] = logits[0].max() + 1  # duplicated maxima
    logits[1, ::7] = -INF
    d2t = torch.randperm(V, generator=g)[:Vd]
    q = torch.softmax(torch.randn(R, Vd, generator=g) * 2, -1)
    tok = d2t[torch.randint(0, Vd, (R,), generator=g)]
    tok[2] = int(logits[2].argmin())
    u = torch.rand(R, 2, generator=g)
    dev = TRITON_DEVICE
    args = [t.to(dev) for t in (logits, q, d2t, tok, u)]
    ref = rejection_sample_logits_reference(*args, temperature, top_k, top_p)
    with poisoned_outputs():
        out = triton_rejection._launch_rejection_logits(
            args[0], args[1], target_to_draft_map(args[2], V), args[3], args[4], None, None,
            temperature, top_k, top_p, chunk=0)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    from spd_kernels.verify.triton_tree import tree_rejection_sample_triton
    for r in range(R):
        cand = torch.tensor([int(logits[r].argmax()), -1, int(tok[r])], device=dev)
        if int(cand[2]) == int(cand[0]):
            cand[2] = -1
        uu = torch.rand(4, generator=g).to(dev)
        want = tree_rejection_sample_reference(args[0][r], cand, uu, temperature, top_k, top_p)
        with poisoned_outputs():
            got = tree_rejection_sample_triton(args[0][r], cand, uu, temperature, top_k, top_p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (r, got, want)
