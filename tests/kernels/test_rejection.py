"""Rejection-sampling kernels vs the reference: bit for bit with shared uniforms, and statistically
(chi-square against the target distribution) with the kernel's own Philox stream.

Significance: each chi-square test fails a correct sampler with probability 1e-3; the seeds are
fixed, so a run is deterministic.
"""
import math

import pytest
import torch
from conftest import GPU_BACKENDS, gpu_backend, needs_gpu, needs_simt, needs_triton

from spd_kernels import (
    SPDInputError,
    _cuda,
    dispatch,
    rejection_sample,
    rejection_sample_logits,
)
from spd_kernels._triton import HAS_TRITON, tl, triton
from spd_kernels.sampling import filtered_probs, sample_from_probs
from spd_kernels.testing import (
    TRITON_DEVICE,
    chi2_pvalue,
    poisoned_outputs,
)
from spd_kernels.verify import (
    rejection_sample_logits_reference,
    rejection_sample_reference,
    scatter_draft_probs,
    target_to_draft_map,
    triton_rejection,
    triton_split,
)

triton_cdiv = lambda a, b: -(-a // b)

if HAS_TRITON:
    from triton.language.random import uint_to_uniform_float

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def probs_case(R, V, seed, device):
    """p and q on target ids with zeros in both, rows with p == q and disjoint supports."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(R, V, generator=g) ** 3
    p[:, ::7] = 0.0
    q = torch.rand(R, V, generator=g) ** 2
    q[:, 3::5] = 0.0
    if R > 1:
        q[1] = p[1]                      # identical: always accepted, empty residual
    if R > 2:
        q[2] = torch.where(p[2] > p[2].median(), 0.0, q[2])  # q avoids p's likeliest tokens
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    tok = sample_from_probs(q, torch.rand(R, generator=g))
    u = torch.rand(R, 2, generator=g)
    return [t.to(device) for t in (p, q, tok, u)]


def logits_case(R, V, Vd, seed, device, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g) * 3
    if ties:
        logits = (logits * 2).round() / 2  # many exactly equal logits (top-k ties)
    d2t = torch.randperm(V, generator=g)[:Vd]
    q = torch.softmax(torch.randn(R, Vd, generator=g) * 2, -1)
    q[:, ::4] = 0.0
    q = q / q.sum(-1, keepdim=True)
    idx = sample_from_probs(q, torch.rand(R, generator=g))
    tok = d2t[idx]
    u = torch.rand(R, 2, generator=g)
    return [t.to(device) for t in (logits, q, d2t, tok, u)]


@needs_triton
@pytest.mark.parametrize("R,V", [(1, 10), (5, 37), (8, 300), (3, 1000), (4, 4099)])
def test_probs_kernel_matches_reference_bit_for_bit(R, V):
    p, q, tok, u = probs_case(R, V, seed=V, device=TRITON_DEVICE)
    ref = rejection_sample_reference(p, q, tok, u)
    for mode in ("a", "b"):
        with poisoned_outputs(mode):
            out = rejection_sample(p, q, tok, u, backend="triton")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    if R > 1:
        assert bool(out[1][1])  # p == q: always accepted


SAMPLING = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5), (0.0, 0, 1.0),
            (1.0, 1, 1.0), (0.5, 0, 0.05), (2.0, 7, 0.9)]


@needs_triton
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("R,V,Vd", [(4, 50, 20), (3, 301, 150), (2, 1000, 999)])
def test_logits_kernel_matches_reference_bit_for_bit(R, V, Vd, temperature, top_k, top_p):
    logits, q, d2t, tok, u = logits_case(R, V, Vd, seed=V + top_k, device=TRITON_DEVICE)
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    with poisoned_outputs("b"):
        out = rejection_sample_logits(logits, q, d2t, tok, u, backend="triton", **kw)
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])


@needs_triton
@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (10, 1.0), (1, 1.0)])
def test_logits_kernel_with_tied_logits(top_k, top_p):
    """Top-k keeps the first k tokens of the order (ties by id), as the reference
    (spd_kernels.sampling's rules; tests/kernels/test_sampling_ties.py tests top-p ties)."""
    logits, q, d2t, tok, u = logits_case(6, 120, 60, seed=11 + top_k, device=TRITON_DEVICE,
                                         ties=True)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
    out = rejection_sample_logits(logits, q, d2t, tok, u, temperature=1.0, top_k=top_k,
                                  top_p=top_p, backend="triton")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def check_philox_distribution(case, backend, device, n, temperature, top_k, top_p):
    """The output of the kernel's own Philox stream must be distributed as p (chi-square at
    significance 1e-3), and the acceptance rate must equal sum(min(p, q))."""
    g = torch.Generator().manual_seed(4)
    V, Vd = 12, 9
    logits = torch.randn(V, generator=g) * 1.5
    p = filtered_probs(logits, temperature, top_k, top_p)
    d2t = torch.randperm(V, generator=g)[:Vd]
    q = torch.rand(Vd, generator=g)
    if case == "disjoint_support":
        q[p[d2t] > 0.1] = 0.0  # the draft never proposes the target's likeliest tokens
    q = q / q.sum()
    tok = d2t[sample_from_probs(q.expand(n, -1), torch.rand(n, generator=g))]
    dev = device
    seed = torch.tensor([1234], device=dev)
    offset = torch.tensor([0], device=dev)
    out, acc = rejection_sample_logits(
        logits.expand(n, -1).contiguous().to(dev), q.expand(n, -1).contiguous().to(dev),
        d2t.to(dev), tok.to(dev), temperature=temperature, top_k=top_k, top_p=top_p,
        philox_seed=seed, philox_offset=offset, backend=backend)
    assert int(offset) == n  # the offset advanced by one per row
    counts = torch.bincount(out.cpu(), minlength=V)
    assert chi2_pvalue(counts, p) > 1e-3
    q_full = scatter_draft_probs(q[None], d2t, V)[0]
    expect = torch.minimum(p, q_full).sum().item()
    rate = acc.float().mean().item()
    assert abs(rate - expect) < 4 * math.sqrt(expect * (1 - expect) / n) + 1e-9


@needs_triton
@pytest.mark.parametrize("case", ["random", "disjoint_support"])
def test_philox_kernel_follows_target_distribution(case):
    # Top-k / top-p thresholds cost several interpreted passes per row: the bit-exact tests cover
    # them; here only the temperature path, whose randomness is the point.
    if TRITON_DEVICE == "cpu":
        check_philox_distribution(case, "triton", "cpu", 800, 0.8, 0, 1.0)
    else:
        check_philox_distribution(case, "triton", "cuda", 200000, 0.8, 10, 0.95)


@needs_triton
def test_philox_draws_equal_the_reference():
    """Given a seed and an offset, the kernel draws Philox(seed, offset + r) for row r and the
    reference draws the same stream (spd_kernels.philox): the same tokens and acceptances, the
    offset advanced alike (past 2**32: the counter's high word)."""
    logits, q, d2t, tok, _ = logits_case(32, 120, 60, seed=5, device=TRITON_DEVICE)
    got = {}
    for backend in ("reference", "triton"):
        offset = torch.tensor([2**32 - 7], device=TRITON_DEVICE)
        out = rejection_sample_logits(logits, q, d2t, tok, temperature=0.9,
                                      philox_seed=torch.tensor([-7], device=TRITON_DEVICE),
                                      philox_offset=offset, backend=backend)
        got[backend] = (out[0].tolist(), out[1].tolist(), int(offset))
    assert got["triton"] == got["reference"]
    assert 0 < sum(got["triton"][1]) < 32  # (accepted and rejected rows both)


# --- the CUDA kernel (csrc/kernels/sampling.cu) in the host emulation (CPU) ---------------------------------

@needs_simt
@pytest.mark.parametrize("R,V", [(1, 10), (5, 37), (8, 300), (3, 1000)])
def test_cuda_probs_kernel_in_host_emulation(R, V):
    p, q, tok, u = probs_case(R, V, seed=V, device="cpu")
    ref = rejection_sample_reference(p, q, tok, u)
    with _cuda.simulated():
        for mode in ("a", "b"):
            with poisoned_outputs(mode):
                out = rejection_sample(p, q, tok.int(), u, backend="cuda")
            assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@needs_simt
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
@pytest.mark.parametrize("R,V,Vd", [(4, 50, 20), (3, 301, 150), (2, 1000, 999)])
def test_cuda_logits_kernel_in_host_emulation(R, V, Vd, temperature, top_k, top_p):
    """Every pass in one block: stats, the radix selects of top-k and top-p, the walk in tiles
    (V = 1000 spans a tile of 1024 only partly; 301 and 50 leave most threads idle)."""
    logits, q, d2t, tok, u = logits_case(R, V, Vd, seed=V + top_k, device="cpu")
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    with _cuda.simulated(), poisoned_outputs("b"):
        out = rejection_sample_logits(logits, q, d2t, tok, u, temperature=temperature,
                                      top_k=top_k, top_p=top_p, backend="cuda")
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])


@needs_simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_logits_kernel_half_precision_and_long_rows(dtype):
    """bf16 / fp16 logits and q (the kernel converts on load); 5000 entries: several walk tiles."""
    logits, q, d2t, tok, u = logits_case(3, 5000, 700, seed=8, device="cpu")
    logits, q = logits.to(dtype), q.to(dtype)
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 40, 0.9)]:
        ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
        with _cuda.simulated():
            out = rejection_sample_logits(logits, q, d2t, tok, u, temperature=temperature,
                                          top_k=top_k, top_p=top_p, backend="cuda")
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@needs_simt
@pytest.mark.parametrize("top_k,top_p", [(0, 0.3), (0, 0.9), (50, 0.6), (7, 1.0)])
def test_cuda_logits_kernel_at_the_thresholds(top_k, top_p):
    """Drafts spread evenly over the vocabulary: many fall just inside or just outside the
    top-k / top-p set, so a threshold off by one token changes some row's outcome."""
    R, V = 64, 200
    logits, _, _, _, u = logits_case(R, V, V, seed=21 + top_k, device="cpu")
    d2t = torch.arange(V)
    q = torch.full((R, V), 1.0 / V)
    order = logits.argsort(-1, descending=True)
    tok = order.gather(1, torch.arange(R)[:, None] % 60 + 1).squeeze(1)  # ranks 2 .. 61
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
    with _cuda.simulated():
        out = rejection_sample_logits(logits, q, d2t, tok, u, top_k=top_k, top_p=top_p,
                                      backend="cuda")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert ref[1].any() and not ref[1].all()


@needs_simt
@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_cuda_logits_kernel_with_tied_logits(top_k):
    logits, q, d2t, tok, u = logits_case(6, 120, 60, seed=11 + top_k, device="cpu", ties=True)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, 1.0)
    with _cuda.simulated():
        out = rejection_sample_logits(logits, q, d2t, tok, u, temperature=1.0, top_k=top_k,
                                      backend="cuda")
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


@needs_simt
@pytest.mark.parametrize("case", ["random", "disjoint_support"])
def test_cuda_philox_kernel_follows_target_distribution(case):
    with _cuda.simulated():
        check_philox_distribution(case, "cuda", "cpu", 2000, 0.8, 10, 0.95)


@needs_simt
@needs_triton
def test_cuda_and_triton_draw_the_same_philox_numbers():
    """csrc/kernels/sampling.cu reproduces Triton's Philox-4x32-10 stream and uniform mapping, so the two
    backends sample the same tokens from the same seed and offset."""
    logits, q, d2t, tok, _ = logits_case(16, 64, 32, seed=3, device="cpu")
    q = q.clone()
    q[:, 1::4] = 0.0  # more rejections: the draw uses u1 too
    q = q / q.sum(-1, keepdim=True)
    seed, start = 2**40 + 7, 2**32 - 5  # the counter's high word changes inside the batch

    def run(backend, device):
        offset = torch.tensor([start], device=device)
        out = rejection_sample_logits(
            logits.to(device), q.to(device), d2t.to(device), tok.to(device),
            philox_seed=torch.tensor([seed], device=device), philox_offset=offset,
            backend=backend)
        assert int(offset) == start + 16
        return out
    a, acc_a = run("triton", TRITON_DEVICE)
    with _cuda.simulated():
        b, acc_b = run("cuda", "cpu")
    assert not acc_a.all() and acc_a.any()
    assert torch.equal(a.cpu(), b) and torch.equal(acc_a.cpu(), acc_b)


# --- the split-row plan (no top-k / top-p; the GPU's default from 16k entries a row) ------------

@needs_triton
@pytest.mark.parametrize("chunk", [16, 64, 4096])
@pytest.mark.parametrize("R,V", [(5, 37), (8, 300), (4, 4099)])
def test_split_probs_plan_matches_reference_bit_for_bit(R, V, chunk):
    p, q, tok, u = probs_case(R, V, seed=V + chunk, device=TRITON_DEVICE)
    ref = rejection_sample_reference(p, q, tok, u)
    with poisoned_outputs("a"):
        out = triton_rejection._launch_rejection_probs(p, q, tok, u, chunk=chunk)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert not out[1].all()  # the residual draw ran


@needs_triton
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0, 0.0])
@pytest.mark.parametrize("R,V,Vd,chunk", [(4, 50, 20, 16), (3, 301, 150, 32), (6, 1000, 999, 128)])
def test_split_logits_plan_matches_reference_bit_for_bit(R, V, Vd, chunk, temperature):
    logits, q, d2t, tok, u = logits_case(R, V, Vd, seed=V + chunk, device=TRITON_DEVICE)
    logits[0, 3] = logits[0].max() + 1   # the argmax in the first chunk ...
    logits[0, V - 2] = logits[0, 3]      # ... tied in the last: the lower id wins
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, 0, 1.0)
    t2d = target_to_draft_map(d2t, V)
    with poisoned_outputs("b"):
        out = triton_rejection._launch_rejection_logits(logits, q, t2d, tok, u, None, None,
                                                        temperature, 0, 1.0, chunk=chunk)
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])
    if temperature == 0.0:
        assert int(out[0][0]) == 3


@needs_triton
def test_split_plan_philox_follows_target_distribution():
    """The split-row plan with its own Philox draws: distributed as p (chi-square, 1e-3), and
    the same numbers as the one-program plan (both read Philox(seed, offset + row))."""
    g = torch.Generator().manual_seed(8)
    V, Vd, n = 20, 14, 360  # two chunks of 16: every interpreted program costs
    logits = torch.randn(V, generator=g) * 1.5
    p = filtered_probs(logits, 0.8, 0, 1.0)
    d2t = torch.randperm(V, generator=g)[:Vd]
    q = torch.rand(Vd, generator=g)
    q = q / q.sum()
    tok = d2t[sample_from_probs(q.expand(n, -1), torch.rand(n, generator=g))]
    dev = TRITON_DEVICE
    args = [logits.expand(n, -1).contiguous().to(dev), q.expand(n, -1).contiguous().to(dev),
            target_to_draft_map(d2t.to(dev), V), tok.to(dev)]
    outs = []
    for chunk in (16, 0):
        offset = torch.tensor([0], device=dev)
        outs.append(triton_rejection._launch_rejection_logits(
            *args, None, torch.tensor([5], device=dev), offset, 0.8, 0, 1.0, chunk=chunk))
        assert int(offset) == n
    (out, acc), (one, one_acc) = outs
    assert torch.equal(acc, one_acc)
    assert (out == one).float().mean() > 0.99  # chunked sums may flip a draw at a boundary
    assert chi2_pvalue(torch.bincount(out.cpu(), minlength=V), p) > 1e-3


# --- the split-row plan with top-k / top-p: thresholds by radix select ---------------------------

def _sorted_thresholds(logits, temperature, top_k, top_p):
    """Per row, by sorting (ties by lower id first, spd_kernels.sampling's order): the top-k key
    (the k-th token's), the top-p key (the last kept token's: the mass before it in the order,
    within the top-k set, is below top_p * that set's total) and the mass sum exp(x - max) of the
    kept set, in float64; keys as the kernels order floats."""
    x = logits.float() / temperature
    bits = x.view(torch.int32)
    key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    e = torch.exp(x - x.max(-1, keepdim=True).values).double()
    out = []
    for kr, er in zip(key, e):
        order = torch.sort(kr, descending=True, stable=True).indices
        if 0 < top_k < kr.numel():
            order = order[:top_k]
        tk = kr[order[-1]]
        m = er[order]
        keep = torch.ones_like(m, dtype=torch.bool)
        if top_p < 1.0:
            keep = (m.cumsum(0) - m) < top_p * m.sum()
            keep[0] = True
        tp = kr[order[keep][-1]]
        out.append((int(tk), int(tp), m[keep].sum().item()))
    return out


RADIX_CASES = [(3, 50, 16, 0.7, 5, 1.0), (4, 301, 32, 1.3, 0, 0.8), (2, 1000, 128, 0.9, 20, 0.5),
               (3, 777, 64, 2.0, 7, 0.9), (2, 300, 32, 1.0, 1, 1.0), (3, 200, 16, 0.5, 0, 0.05),
               (2, 4099, 16, 0.1, 3, 0.7)]  # last: most masses underflow; chunks capped at 128


@needs_triton
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("R,V,chunk,temperature,top_k,top_p", RADIX_CASES)
def test_radix_select_finds_the_sorted_thresholds(R, V, chunk, temperature, top_k, top_p, ties):
    logits = logits_case(R, V, 8, seed=V + top_k, device=TRITON_DEVICE, ties=ties)[0]
    use_k, use_p = 0 < top_k < V, top_p < 1.0
    chunk, *_, thr, zsel = triton_split._split_row_stats(logits, temperature, True, False, chunk,
                                                         top_k, top_p, use_k, use_p)
    assert triton_cdiv(V, chunk) <= triton_split.RADIX_MAX_CHUNKS
    for r, (tk, tp, z) in enumerate(_sorted_thresholds(logits.cpu(), temperature, top_k, top_p)):
        if use_k:
            assert int(thr[r, 0]) == tk
        if use_p:
            assert int(thr[r, 2]) == tp
        assert float(zsel[r]) == pytest.approx(z, rel=1e-5)


@needs_triton
@pytest.mark.parametrize("temperature,top_k,top_p", [s for s in SAMPLING if s[1] or s[2] < 1])
@pytest.mark.parametrize("R,V,Vd,chunk", [(4, 50, 20, 16), (3, 301, 150, 32), (8, 1000, 999, 128)])
def test_split_plan_with_top_k_top_p_matches_reference_bit_for_bit(R, V, Vd, chunk, temperature,
                                                                   top_k, top_p):
    logits, q, d2t, tok, u = logits_case(R, V, Vd, seed=V + top_k, device=TRITON_DEVICE)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    with poisoned_outputs("b"):
        out = triton_rejection._launch_rejection_logits(
            logits, q, target_to_draft_map(d2t, V), tok, u, None, None, temperature, top_k,
            top_p, chunk=chunk)
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])


@needs_triton
@pytest.mark.parametrize("top_k", [1, 3, 10])
def test_split_plan_with_tied_logits(top_k):
    logits, q, d2t, tok, u = logits_case(6, 120, 60, seed=11 + top_k, device=TRITON_DEVICE,
                                         ties=True)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, 1.0)
    out = triton_rejection._launch_rejection_logits(logits, q, target_to_draft_map(d2t, 120), tok,
                                                    u, None, None, 1.0, top_k, 1.0, chunk=32)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])



if HAS_TRITON:

    @triton.jit
    def _philox_uniforms_kernel(seed_ptr, offset_ptr, u_ptr, R, BLOCK: tl.constexpr):
        r = tl.arange(0, BLOCK)
        c0, c1, _, _ = tl.randint4x(tl.load(seed_ptr), tl.load(offset_ptr) + r)
        tl.store(u_ptr + 2 * r, uint_to_uniform_float(c0), mask=r < R)
        tl.store(u_ptr + 2 * r + 1, uint_to_uniform_float(c1), mask=r < R)


def philox_uniforms(seed, offset, R):
    """The uniforms [R, 2] the kernels draw with Philox: row r's (u0, u1) from the first two
    words of Philox-4x32-10(seed, offset + r), mapped as tl.rand does."""
    u = torch.empty(R, 2, dtype=torch.float32, device=seed.device)
    _philox_uniforms_kernel[(1,)](seed, offset, u, R, BLOCK=triton.next_power_of_2(R))
    return u


def edge_uniforms(u):
    """u0 = 0 (accepted iff p(x) > 0) and just below 1; u1 at 0 and just below 1 (the top end
    of the inverse CDF, where the clamp to the last token with mass matters)."""
    u = u.clone()
    u[0::2, 0] = 0.0
    u[1::2, 0] = 1.0 - 2 ** -24
    u[0::3, 1] = 1.0 - 2 ** -24
    u[1::3, 1] = 0.0
    return u


@needs_triton
@pytest.mark.parametrize("chunk", [0, 16])  # one program a row; the split-row plan
def test_probs_plans_at_the_edges(chunk):
    """rejection_sample's two plans against the reference, bit for bit: one-hot p, p == q,
    disjoint supports, a draft where p is 0, uniforms at the ends of [0, 1)."""
    R, V = 9, 100
    p, q, tok, u = probs_case(R, V, seed=31, device=TRITON_DEVICE)
    p[3] = 0.0
    p[3, 40] = 1.0
    tok[4] = 0  # p[:, ::7] == 0: always rejected
    tok[5] = int(p[5].argmax())
    u = edge_uniforms(u)
    ref = rejection_sample_reference(p, q, tok, u)
    out = triton_rejection._launch_rejection_probs(p, q, tok, u, chunk=chunk)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    assert ref[1].any() and not ref[1].all()


LOGIT_EDGES = [  # temperature, top_k, top_p, tied logits, -inf logits
    (0.0, 0, 1.0, True, False),     # greedy: tied maxima, the lowest id wins
    (1.0, 119, 1.0, True, False),   # top-k one short of V, ties at the threshold
    (1.0, 120, 0.95, False, False),  # top-k = V: no top-k
    (0.8, 5, 0.9, False, True),     # -inf logits (a masked vocabulary)
    (1.0, 0, 0.3, False, True),
]


@needs_triton
@pytest.mark.parametrize("chunk", [0, 32])  # one program a row; the split-row plan
@pytest.mark.parametrize("temperature,top_k,top_p,ties,neg_inf", LOGIT_EDGES)
def test_logits_plans_at_the_edges(chunk, temperature, top_k, top_p, ties, neg_inf):
    """rejection_sample_logits' two plans against the reference, bit for bit, with given
    uniforms and with Philox: tied maxima, top-k at and next to V, -inf logits, drafts outside
    the kept set and outside the draft vocabulary, uniforms at the ends of [0, 1)."""
    R, V = 8, 120
    logits, q, d2t, tok, u = logits_case(R, V, 90, seed=41 + top_k, device=TRITON_DEVICE,
                                         ties=ties)
    if top_p == 1.0:  # (top-p with ties at its boundary: the reference's unstable sort decides)
        logits[0, 5] = logits[0].max() + 1
        logits[0, V - 3] = logits[0, 5]
    if neg_inf:
        logits[:, 1::9] = float("-inf")
    tok[1] = int(logits[1].argmin())  # p(x) == 0 unless nothing is cut
    tok[2] = int(logits[2].argmax())
    outside = torch.ones(V, dtype=torch.bool)
    outside[d2t.cpu()] = False
    tok[3] = int(outside.nonzero()[0])  # q(x) == 0: accepted iff p(x) > 0
    u = edge_uniforms(u)
    t2d = target_to_draft_map(d2t, V)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    out = triton_rejection._launch_rejection_logits(logits, q, t2d, tok, u, None, None,
                                                    temperature, top_k, top_p, chunk=chunk)
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])
    if temperature == 0.0:
        assert int(out[0][0]) == 5 or bool(out[1][0])  # the lower of the tied maxima
    # Philox: the same draws as the reference given Philox(seed, offset + row)'s uniforms
    seed = torch.tensor([2**40 + 7], device=TRITON_DEVICE)
    offset = torch.tensor([2**32 - 3], device=TRITON_DEVICE)  # the counter's high word changes
    u = philox_uniforms(seed, offset, R)
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    out = triton_rejection._launch_rejection_logits(logits, q, t2d, tok, None, seed, offset,
                                                    temperature, top_k, top_p, chunk=chunk)
    assert int(offset) == 2**32 - 3 + R
    assert torch.equal(out[0], ref[0]), (out, ref)
    assert torch.equal(out[1], ref[1])


@needs_triton
def test_philox_reproducible_and_advancing():
    logits, q, d2t, tok, _ = logits_case(6, 64, 32, seed=2, device=TRITON_DEVICE)
    seed = torch.tensor([99], device=TRITON_DEVICE)

    def run(off):
        offset = torch.tensor([off], device=TRITON_DEVICE)
        out = rejection_sample_logits(logits, q, d2t, tok, philox_seed=seed, philox_offset=offset,
                                      backend="triton")
        return out, int(offset)
    (a, ok_a), end_a = run(0)
    (b, ok_b), end_b = run(0)
    assert torch.equal(a, b) and torch.equal(ok_a, ok_b) and end_a == end_b == 6
    outs = [run(off)[0][0] for off in (6, 12, 18, 24)]
    assert any(not torch.equal(o, a) for o in outs)  # new offsets, new draws


def test_reference_is_default_on_cpu_and_philox_fallback():
    assert dispatch.select("rejection_sample_logits", torch.device("cpu"))[0] == "reference"
    logits, q, d2t, tok, _ = logits_case(3, 40, 20, seed=5, device="cpu")
    offset = torch.tensor([0])
    out, acc = rejection_sample_logits(logits, q, d2t, tok, philox_seed=torch.tensor([1]),
                                       philox_offset=offset)
    assert out.shape == (3,) and int(offset) == 3 and ((out >= 0) & (out < 40)).all()


def test_argument_checks():
    logits, q, d2t, tok, u = logits_case(3, 40, 20, seed=6, device="cpu")
    with pytest.raises(SPDInputError, match="needs randomness"):
        rejection_sample_logits(logits, q, d2t, tok)
    with pytest.raises(SPDInputError, match="not both"):
        rejection_sample_logits(logits, q, d2t, tok, u, philox_seed=torch.tensor([1]),
                                philox_offset=torch.tensor([0]))
    with pytest.raises(SPDInputError, match="top_k"):
        rejection_sample_logits(logits, q, d2t, tok, u, top_k=-1)
    with pytest.raises(SPDInputError, match="top_p"):
        rejection_sample_logits(logits, q, d2t, tok, u, top_p=1.5)
    with pytest.raises(SPDInputError, match="temperature"):
        rejection_sample_logits(logits, q, d2t, tok, u, temperature=float("nan"))
    bad = d2t.clone()
    bad[0] = 40
    with pytest.raises(SPDInputError, match="outside the target vocabulary"):
        rejection_sample_logits(logits, q, bad, tok, u)
    dup = d2t.clone()
    dup[1] = dup[0]
    with pytest.raises(SPDInputError, match="same target id"):
        rejection_sample_logits(logits, q, dup, tok, u)
    with pytest.raises(SPDInputError, match=r"draft token ids must lie in \[0, 40\)"):
        rejection_sample_logits(logits, q, d2t, tok + 100, u)
    with pytest.raises(SPDInputError, match="maps 19 ids"):
        rejection_sample_logits(logits, q, d2t[:19], tok, u)
    with pytest.raises(SPDInputError, match="uniforms must have shape"):
        rejection_sample_logits(logits, q, d2t, tok, u[:, :1])
    with pytest.raises(SPDInputError, match="int32 or int64"):
        rejection_sample(torch.rand(2, 5), torch.rand(2, 5), torch.tensor([0.0, 1.0]),
                         torch.rand(2, 2))
    inv = target_to_draft_map(d2t, 40)
    assert inv.dtype == torch.int32 and int((inv >= 0).sum()) == 20
    assert torch.equal(inv[d2t].long(), torch.arange(20))


def test_library_ops():
    logits, q, d2t, tok, u = logits_case(3, 30, 12, seed=8, device="cpu")
    p = filtered_probs(logits, 0.9, 0, 1.0)
    qf = scatter_draft_probs(q, d2t, 30)
    torch.library.opcheck(torch.ops.spd.rejection_sample.default, (p, qf, tok, u))
    torch.library.opcheck(torch.ops.spd.rejection_sample_logits.default,
                          (logits, q, d2t, tok, u, None, None, 0.9, 5, 0.9))
    torch.library.opcheck(torch.ops.spd.rejection_sample_logits.default,
                          (logits, q, d2t, tok, None, torch.tensor([3]), torch.tensor([0]), 1.0,
                           0, 1.0))
    a = torch.ops.spd.rejection_sample_logits(logits, q, d2t, tok, u, None, None, 0.9, 5, 0.9)
    b = rejection_sample_logits_reference(logits, q, d2t, tok, u, 0.9, 5, 0.9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("temperature,top_k,top_p", SAMPLING)
def test_gpu_backends_match_reference_at_qwen_vocab(backend, temperature, top_k, top_p):
    gpu_backend("rejection_sample_logits", backend)
    logits, q, d2t, tok, u = logits_case(3, 151936, 32768, seed=1, device="cuda")
    ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, temperature, top_k, top_p)
    out = rejection_sample_logits(logits, q, d2t, tok, u, temperature=temperature,
                                  top_k=top_k, top_p=top_p, backend=backend)
    # exp/division on the GPU may differ from torch's in the last bit: allow a rare flip
    assert (out[0] == ref[0]).float().mean() >= 2 / 3, backend


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_philox_in_cuda_graph(backend):
    gpu_backend("rejection_sample_logits", backend)
    logits, q, d2t, tok, _ = logits_case(2, 4096, 1024, seed=3, device="cuda")
    seed = torch.tensor([7], device="cuda")
    offset = torch.tensor([0], device="cuda")
    first, _ = rejection_sample_logits(logits, q, d2t, tok, philox_seed=seed,
                                       philox_offset=offset, backend=backend)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = rejection_sample_logits(logits, q, d2t, tok, philox_seed=seed,
                                         philox_offset=offset, backend=backend)
    start = int(offset)
    for i in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(offset) == start + 3 * 2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_top_k_top_p_follows_target_distribution(backend):
    """At 20k entries a row: Triton takes the split-row plan with the radix select, CUDA one
    block per row. Their own Philox draws must be distributed as p after temperature, top-k
    and top-p (chi-square)."""
    gpu_backend("rejection_sample_logits", backend)
    g = torch.Generator().manual_seed(9)
    V, Vd, n = 20000, 4096, 20000
    logits = torch.randn(V, generator=g) * 3
    temperature, top_k, top_p = 0.8, 12, 0.9
    p = filtered_probs(logits, temperature, top_k, top_p)
    assert triton_split._split_chunk(V, torch.device("cuda")) > 0
    kept = logits.topk(top_k).indices  # the draft vocabulary holds the kept tokens
    rest = torch.randperm(V, generator=g)
    d2t = torch.cat([kept, rest[~torch.isin(rest, kept)][:Vd - top_k]])
    q = torch.rand(Vd, generator=g)
    q = q / q.sum()
    tok = d2t[sample_from_probs(q.expand(n, -1), torch.rand(n, generator=g))]
    out, _ = rejection_sample_logits(
        logits.expand(n, -1).contiguous().cuda(), q.expand(n, -1).contiguous().cuda(),
        d2t.cuda(), tok.cuda(), temperature=temperature, top_k=top_k, top_p=top_p,
        philox_seed=torch.tensor([3], device="cuda"), philox_offset=torch.tensor([0], device="cuda"),
        backend=backend)
    support = p > 0
    counts = torch.bincount(out.cpu(), minlength=V)
    assert counts[~support].sum() == 0
    assert chi2_pvalue(counts[support], p[support]) > 1e-3
