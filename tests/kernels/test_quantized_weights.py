"""Weight-only quantised weights (spd_kernels.quant): int8 and fp8 (e4m3) weights with one fp32
scale per output row in fused_linear, fused_swiglu, qkv_rope_append, anchor_projection and the
PDM step. The Triton kernels against the references on fresh random inputs, outputs poisoned
first; the quantiser's round-trip bounds; the argument checks; the CUDA kernels refusing them
with a reason (the dispatcher falls back, a forced backend="cuda" raises)."""
import pytest
import torch
from conftest import needs_simt, needs_triton, needs_triton_interpreter

from spd_kernels import (
    SPDBackendError,
    SPDInputError,
    _cuda,
    anchor_projection,
    dispatch,
    fused_linear,
    fused_swiglu,
    pdm_step,
    qkv_rope_append,
    use_backend,
)
from spd_kernels.linear import fused_linear_reference, fused_swiglu_reference
from spd_kernels.linear.triton_kernel import launch
from spd_kernels.pdm import PDMWeights
from spd_kernels.qkv_rope import pack_back_to_back
from spd_kernels.quant import dequantize_weight, quantize_weight
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

KINDS = ["int8", "fp8"]


def rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


def tol(dtype):
    # fp32: summation order only; bf16 / fp16: one rounding of the model dtype either way
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else \
        dict(rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps)


# --- the quantiser ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_quantize_weight_round_trip_bounds(kind):
    g = torch.Generator().manual_seed(1)
    w = rand(g, 64, 96) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[5] = 0.0  # a zero row stays exact
    w[7, 3] = -w[7].abs().max() * 2  # the row maximum negative
    q, s = quantize_weight(w, kind)
    assert q.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    assert q.shape == w.shape and s.shape == (64,) and s.dtype == torch.float32
    assert q.is_contiguous() and s.is_contiguous()
    back = dequantize_weight(q, s)
    err = (back - w).abs()
    if kind == "int8":  # round to nearest on a grid of step scale
        assert (err <= s[:, None] * 0.5 * (1 + 1e-6)).all()
        assert q.abs().max() == 127
    else:  # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6) 2^-10 s
        bound = torch.maximum(w.abs() * 2.0 ** -4, s[:, None] * 2.0 ** -10)
        assert (err <= bound * (1 + 1e-6)).all()
        assert q.float().abs().max() == 448
    assert torch.equal(back[5], torch.zeros(96)) and s[5] == 1.0
    # each row's largest magnitude comes back exactly (to the scale's fp32 rounding)
    amax = w.abs().amax(1)
    nz = amax > 0
    torch.testing.assert_close(back.abs().amax(1)[nz], amax[nz], rtol=1e-6, atol=0)
    # bf16 weights quantise the same values as their fp32 copy
    qb, sb = quantize_weight(w.bfloat16(), kind)
    qf, sf = quantize_weight(w.bfloat16().float(), kind)
    assert torch.equal(qb.float(), qf.float()) and torch.equal(sb, sf)


def test_quantize_weight_refuses_bad_input():
    with pytest.raises(SPDInputError, match="kind must be one of int8, fp8"):
        quantize_weight(torch.randn(4, 4), "int4")
    with pytest.raises(SPDInputError, match="float"):
        quantize_weight(torch.randn(4))
    with pytest.raises(SPDInputError, match="float"):
        quantize_weight(torch.zeros(4, 4, dtype=torch.int8))


# --- fused_linear / fused_swiglu ---------------------------------------------------------------

def linear_case(R, K, N, dtype, kind, seed, device):
    g = torch.Generator().manual_seed(seed)
    x = rand(g, R, K, scale=2.0).to(device=device, dtype=dtype)
    q, s = quantize_weight(rand(g, N, K, scale=K ** -0.5), kind)
    q2, s2 = quantize_weight(rand(g, N, K, scale=K ** -0.5), kind)
    norm = (torch.rand(K, generator=g) + 0.5).to(device=device, dtype=dtype)
    res = rand(g, R, N).to(device=device, dtype=dtype)
    to = lambda t: t.to(device)
    return x, to(q), to(s), to(q2), to(s2), norm, res


SHAPES = [(1, 48, 40), (9, 100, 70), (5, 256, 300), (17, 64, 129)]


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R,K,N", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_linear_and_swiglu_triton_match_reference(kind, dtype, R, K, N, split_k):
    x, q, s, q2, s2, norm, res = linear_case(R, K, N, dtype, kind, R * K + N + split_k,
                                             TRITON_DEVICE)
    for g, r in ((norm, None), (None, res), (norm, res), (None, None)):
        want = fused_linear_reference(x, q, g, 1e-6, r, s)
        with poisoned_outputs("a"):
            got = launch(x, q, None, g, 1e-6, r, split_k=split_k, scale=s)
        torch.testing.assert_close(got, want, **tol(dtype))
    want = fused_swiglu_reference(x, norm, 1e-6, q, q2, s, s2)
    with poisoned_outputs("b"):
        got = launch(x, q, q2, norm, 1e-6, split_k=split_k, scale=s, scale_up=s2)
    torch.testing.assert_close(got, want, **tol(dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_documented_math(kind):
    """round_to_dtype((h @ q.float().T) * scale), then the residual in x's dtype; near the float
    product of the weights the quantisation stands for."""
    x, q, s, q2, s2, norm, res = linear_case(4, 64, 32, torch.bfloat16, kind, 3, "cpu")
    got = fused_linear(x, q, norm_weight=norm, residual=res, weight_scale=s)
    from spd_kernels.linear import rms_norm
    h = rms_norm(x, norm, 1e-6)
    want = res + ((h.float() @ q.float().t()) * s).to(torch.bfloat16)
    assert torch.equal(got, want)
    near = fused_linear(x, dequantize_weight(q, s, torch.bfloat16), norm_weight=norm,
                        residual=res)
    torch.testing.assert_close(got.float(), near.float(), rtol=0.02, atol=0.05)
    sw = fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s2)
    gate = ((h.float() @ q.float().t()) * s).to(torch.bfloat16)
    up = ((h.float() @ q2.float().t()) * s2).to(torch.bfloat16)
    assert torch.equal(sw, torch.nn.functional.silu(gate) * up)


@needs_triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_dispatched_ops_run_quantised_weights_on_triton(kind):
    x, q, s, q2, s2, norm, res = linear_case(3, 32, 24, torch.float32, kind, 9, "cpu")
    with poisoned_outputs("a"):
        got = fused_linear(x, q, norm_weight=norm, residual=res, weight_scale=s, backend="triton")
        got2 = fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s2, backend="triton")
    torch.testing.assert_close(got, fused_linear(x, q, norm_weight=norm, residual=res,
                                                 weight_scale=s), **tol(torch.float32))
    torch.testing.assert_close(got2, fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s,
                                                  up_scale=s2), **tol(torch.float32))


def test_linear_argument_checks_name_the_argument():
    x, q, s, q2, s2, norm, res = linear_case(3, 32, 24, torch.float32, "int8", 5, "cpu")
    w = torch.randn(24, 32)
    for call, match in (
            (lambda: fused_linear(x, q), "weight is quantised .* weight_scale is missing"),
            (lambda: fused_linear(x, q, weight_scale=s[:5]), r"weight_scale must have shape \(24,\)"),
            (lambda: fused_linear(x, q, weight_scale=s.half()), "weight_scale must have dtype"),
            (lambda: fused_linear(x, q, weight_scale=s.to("meta")), "weight_scale is on meta"),
            (lambda: fused_linear(x, w, weight_scale=s), "weight_scale is given but weight is "
                                                         "not quantised"),
            (lambda: fused_linear(x, q[:, :16].contiguous(), weight_scale=s),
             r"weight must be \[out, 32\]"),
            (lambda: fused_linear(x, q[0], weight_scale=s[:1]), "weight must have 2 dimensions"),
            (lambda: fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s), "up_scale is missing"),
            (lambda: fused_swiglu(x, norm, 1e-6, q, w, gate_scale=s),
             "both .* or\\s+neither"),
            (lambda: fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s[:3]),
             "up_scale must have shape")):
        with pytest.raises(SPDInputError, match=match):
            call()


def test_schemas_take_the_scales_and_opcheck():
    from spd_kernels import opdef
    assert opdef.SPECS["fused_linear"].schema.endswith("Tensor? weight_scale=None) -> Tensor")
    assert "Tensor? gate_scale=None, Tensor? up_scale=None" in opdef.SPECS["fused_swiglu"].schema
    assert "Tensor? wq_scale=None, Tensor? wk_scale=None, Tensor? wv_scale=None" in \
        opdef.SPECS["qkv_rope_append"].schema
    assert "Tensor?[]? scales=None" in opdef.SPECS["anchor_projection"].schema
    x, q, s, q2, s2, norm, res = linear_case(3, 32, 24, torch.float32, "int8", 6, "cpu")
    torch.library.opcheck(torch.ops.spd.fused_linear.default, (x, q, norm, 1e-6, res, s))
    torch.library.opcheck(torch.ops.spd.fused_swiglu.default, (x, norm, 1e-6, q, q2, s, s2))


# --- anchor projection -------------------------------------------------------------------------

def anchor_case(m, R, d, n_out, dtype, kind, seed, device, bias=True):
    g = torch.Generator().manual_seed(seed)
    anchors = rand(g, m, R, d).to(device=device, dtype=dtype)
    types = torch.randint(0, m, (R,), generator=g).to(device)
    pairs = [quantize_weight(rand(g, n_out, (e + 1) * d, scale=d ** -0.5), kind) for e in range(m)]
    weights = [q.to(device) for q, _ in pairs]
    scales = [s.to(device) for _, s in pairs]
    biases = [rand(g, n_out).to(device=device, dtype=dtype) if bias else None for _ in range(m)]
    return anchors, types, weights, biases, scales


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,R,d,n_out", [(3, 1, 32, 48), (3, 9, 40, 40), (5, 20, 64, 70)])
@pytest.mark.parametrize("bias", [True, False])
def test_anchor_projection_triton_matches_reference(kind, dtype, m, R, d, n_out, bias):
    anchors, types, weights, biases, scales = anchor_case(m, R, d, n_out, dtype, kind,
                                                          m * R + d, TRITON_DEVICE, bias)
    want = anchor_projection(anchors.cpu(), types.cpu(), [w.cpu() for w in weights],
                             [None if b is None else b.cpu() for b in biases],
                             [s.cpu() for s in scales], backend="reference")
    with poisoned_outputs("a"):
        got = anchor_projection(anchors, types, weights, biases, scales, backend="triton")
    torch.testing.assert_close(got.cpu(), want, **tol(dtype))
    # a type without a projection (None weight and scale) still works
    weights[0], scales[0] = None, None
    types = torch.where(types == 0, 1, types)
    want = anchor_projection(anchors.cpu(), types.cpu(), [None if w is None else w.cpu()
                             for w in weights], None, [None if s is None else s.cpu()
                                                       for s in scales], backend="reference")
    with poisoned_outputs("b"):
        got = anchor_projection(anchors, types, weights, None, scales, backend="triton")
    torch.testing.assert_close(got.cpu(), want, **tol(dtype))


def test_anchor_reference_is_the_documented_math():
    anchors, types, weights, biases, scales = anchor_case(3, 6, 16, 24, torch.bfloat16, "int8",
                                                          4, "cpu")
    got = anchor_projection(anchors, types, weights, biases, scales)
    for r in range(6):
        e = int(types[r])
        acc = torch.cat([anchors[j, r] for j in range(e + 1)]).float() @ weights[e].float().t()
        want = (acc * scales[e] + biases[e].float()).to(torch.bfloat16)
        assert torch.equal(got[r], want)


def test_anchor_argument_checks_name_the_argument():
    anchors, types, weights, biases, scales = anchor_case(3, 6, 16, 24, torch.float32, "int8",
                                                          4, "cpu")
    floats = [torch.randn(w.shape) for w in weights]
    for call, match in (
            (lambda: anchor_projection(anchors, types, weights, biases), "weights\\[0\\] is "
                                                                          "quantised"),
            (lambda: anchor_projection(anchors, types, weights, biases, scales[:2]),
             "one scale slot per anchor"),
            (lambda: anchor_projection(anchors, types, weights, biases,
                                       [scales[0], scales[1][:3], scales[2]]),
             r"scales\[1\] must have shape \(24,\)"),
            (lambda: anchor_projection(anchors, types, weights, biases,
                                       [scales[0], scales[1], scales[2].double()]),
             r"scales\[2\] must have dtype"),
            (lambda: anchor_projection(anchors, types, floats, biases, scales),
             r"scales\[0\] is given but weights\[0\] is not quantised"),
            (lambda: anchor_projection(anchors, types, [weights[0], weights[0], weights[2]],
                                       biases, scales), r"weights\[1\] must have 32 input")):
        with pytest.raises(SPDInputError, match=match):
            call()


# --- qkv_rope_append ---------------------------------------------------------------------------

def qkv_case(T, d, H, KVH, hd, S, dtype, kind, seed, device, packed, bias):
    from spd.model.layers import rope_table
    g = torch.Generator().manual_seed(seed)
    x = rand(g, T, d, scale=2.0).to(device=device, dtype=dtype)
    norm = (torch.rand(d, generator=g) + 0.5).to(device=device, dtype=dtype)
    pairs = [quantize_weight(rand(g, n * hd, d, scale=d ** -0.5), kind) for n in (H, KVH, KVH)]
    ws = [q.to(device) for q, _ in pairs]
    ss = [s.to(device) for _, s in pairs]
    if packed:
        ws, ss = pack_back_to_back(*ws), pack_back_to_back(*ss)
    qn = (torch.rand(hd, generator=g) + 0.5).to(device=device, dtype=dtype)
    kn = (torch.rand(hd, generator=g) + 0.5).to(device=device, dtype=dtype)
    b = rand(g, (H + 2 * KVH) * hd).to(device=device, dtype=dtype) if bias else None
    cos, sin = rope_table(hd, S + 4, 10000.0)
    return (x, norm, ws, ss, qn, kn, cos.to(device=device, dtype=dtype),
            sin.to(device=device, dtype=dtype), b)


def run_qkv(case, start, S, H, KVH, hd, backend):
    x, norm, ws, ss, qn, kn, cos, sin, b = case
    k, v = (torch.full((KVH, S, hd), float("nan"), device=x.device, dtype=x.dtype)
            for _ in range(2))
    with poisoned_outputs("a"):
        q = qkv_rope_append(x, norm, 1e-6, *ws, qn, kn, cos, sin, start, k, v, H, KVH,
                            qkv_bias=b, wq_scale=ss[0], wk_scale=ss[1], wv_scale=ss[2],
                            backend=backend)
    return q, k, v


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,packed,bias", [(1, True, False), (5, False, True), (9, True, True)])
def test_qkv_rope_append_triton_matches_reference(kind, dtype, T, packed, bias):
    d, H, KVH, hd, S = 48, 4, 2, 16, 24
    case = qkv_case(T, d, H, KVH, hd, S, dtype, kind, T * 7 + packed, TRITON_DEVICE, packed, bias)
    cpu = tuple(None if t is None else (t.cpu() if isinstance(t, torch.Tensor)
                                        else [u.cpu() for u in t]) for t in case)
    want = run_qkv(cpu, 3, S, H, KVH, hd, "reference")
    got = run_qkv(case, 3, S, H, KVH, hd, "triton")
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, equal_nan=True, **tol(dtype))


def test_qkv_argument_checks_name_the_argument():
    d, H, KVH, hd, S = 32, 2, 1, 8, 8
    x, norm, ws, ss, qn, kn, cos, sin, b = qkv_case(2, d, H, KVH, hd, S, torch.float32, "int8",
                                                    1, "cpu", False, False)
    k, v = torch.zeros(KVH, S, hd), torch.zeros(KVH, S, hd)
    call = lambda w, s: qkv_rope_append(x, norm, 1e-6, *w, qn, kn, cos, sin, 0, k, v, H, KVH,
                                        wq_scale=s[0], wk_scale=s[1], wv_scale=s[2])
    with pytest.raises(SPDInputError, match="wk is quantised .* wk_scale is missing"):
        call(ws, [ss[0], None, ss[2]])
    with pytest.raises(SPDInputError, match="all three .* or none"):
        call([ws[0], torch.randn(ws[1].shape), torch.randn(ws[2].shape)], [ss[0], None, None])
    with pytest.raises(SPDInputError, match=r"wv_scale must have shape \(8,\)"):
        call(ws, [ss[0], ss[1], ss[0]])
    with pytest.raises(SPDInputError, match=r"wq must have shape \(16, 32\)"):
        call([ws[0][:8].contiguous(), ws[1], ws[2]], [ss[0][:8].contiguous(), ss[1], ss[2]])
    with pytest.raises(SPDInputError, match="wq_scale is given but wq is not quantised"):
        call([torch.randn(ws[0].shape), ws[1], ws[2]], ss)


# --- the PDM step ------------------------------------------------------------------------------

def quantised_weights(weights: PDMWeights, kind: str) -> PDMWeights:
    """weights with every matrix the step reads quantised (q/k/v and gate/up packed)."""
    import dataclasses
    layers = []
    for lw in weights.layers:
        qkv = [quantize_weight(w, kind) for w in (lw.wq, lw.wk, lw.wv)]
        wq, wk, wv = pack_back_to_back(*(q for q, _ in qkv))
        sq, sk, sv = pack_back_to_back(*(s for _, s in qkv))
        (wo, so), (wg, sg), (wu, su), (wd, sd) = (quantize_weight(w, kind) for w in (
            lw.wo, lw.w_gate, lw.w_up, lw.w_down))
        layers.append(dataclasses.replace(
            lw, wq=wq, wk=wk, wv=wv, wq_scale=sq, wk_scale=sk, wv_scale=sv, wo=wo, wo_scale=so,
            w_gate=wg, gate_scale=sg, w_up=wu, up_scale=su, w_down=wd, down_scale=sd))
    head, head_scale = quantize_weight(weights.lm_head, kind)
    return dataclasses.replace(weights, layers=layers, lm_head=head, lm_head_scale=head_scale)


def tiny_pdm_weights(seed=5):
    from conftest import make_tiny_target

    from spd import SPDEngine
    t = make_tiny_target(seed=seed, vocab=40, layers=4, model_type="qwen3")
    pdm = SPDEngine(t, n_stages=2, anchors=[0, 2, 3]).pdm
    return pdm, PDMWeights.from_pdm(pdm)


@needs_triton_interpreter
@pytest.mark.parametrize("kind", KINDS)
def test_pdm_step_with_quantised_weights_triton_matches_reference(kind):
    from spd.model.layers import rope_table
    pdm, weights = tiny_pdm_weights()
    c = pdm.config
    qw = quantised_weights(weights, kind)
    g = torch.Generator().manual_seed(3)
    cos, sin = rope_table(c.head_dim, 40, c.rope_theta)
    caches = {b: [torch.full((c.num_layers, c.num_kv_heads, 40, c.head_dim), float("nan"))
                  for _ in range(2)] for b in ("reference", "triton")}
    start = torch.tensor(0)
    for s, rows in ((0, 7), (5, 4), (9, 1)):
        feats = torch.randn(rows, c.hidden_size, generator=g)
        start.fill_(s)
        want = pdm_step(feats, qw, *caches["reference"], s, cos, sin, backend="reference")
        with use_backend("triton"), poisoned_outputs("a"):
            got = pdm_step(feats, qw, *caches["triton"], start, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # near what the float weights give (the quantisation error only)
        ref = pdm_step(feats, weights, *(x.clone() for x in caches["reference"]), s, cos, sin)
        assert torch.corrcoef(torch.stack([got, ref]))[0, 1] > 0.99


# --- CUDA: refused with a reason ---------------------------------------------------------------

@needs_simt
def test_cuda_kernels_refuse_quantised_weights_with_a_reason():
    x, q, s, q2, s2, norm, res = linear_case(3, 64, 40, torch.bfloat16, "int8", 2, "cpu")
    anchors, types, weights, biases, scales = anchor_case(3, 4, 16, 24, torch.bfloat16, "int8",
                                                          4, "cpu")
    from spd.model.layers import rope_table
    cos, sin = rope_table(8, 16, 10000.0)
    wq, wk, wv = (quantize_weight(torch.randn(n, 64), "int8") for n in (16, 8, 8))
    k, v = torch.zeros(1, 8, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 8, dtype=torch.bfloat16)
    calls = (
        lambda b: fused_linear(x, q, residual=res, weight_scale=s, backend=b),
        lambda b: fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s2, backend=b),
        lambda b: qkv_rope_append(x, norm, 1e-6, wq[0], wk[0], wv[0], None, None,
                                  cos.bfloat16(), sin.bfloat16(), 0, k, v, 2, 1,
                                  wq_scale=wq[1], wk_scale=wk[1], wv_scale=wv[1], backend=b),
        lambda b: anchor_projection(anchors, types, weights, biases, scales, backend=b))
    with _cuda.simulated():
        for call in calls:
            with pytest.raises(SPDBackendError, match="quantised"):
                call("cuda")
        # what the automatic choice reads on a GPU (then Triton runs them)
        for op, args in (("fused_linear", (x, q, None, 1e-6, res, s)),
                         ("anchor_projection", (anchors, types, weights, biases, scales))):
            impl = dispatch._impl(op, "cuda")
            assert "quantised" in impl.supports(*args)


def test_quantised_ops_trace_under_torch_compile():
    """The public functions with scales compile with fullgraph (the custom ops' schemas take
    them) and compute what they compute eagerly."""
    x, q, s, q2, s2, norm, res = linear_case(4, 32, 24, torch.float32, "int8", 8, "cpu")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def block(x, q, s, q2, s2, norm, res):
        mid = fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s2)
        return fused_linear(mid, q2.t().contiguous(), residual=None,
                            weight_scale=torch.ones(32)) + fused_linear(x, q, weight_scale=s,
                                                                        residual=res).sum()

    got = block(x, q, s, q2, s2, norm, res)
    mid = fused_swiglu(x, norm, 1e-6, q, q2, gate_scale=s, up_scale=s2)
    want = fused_linear(mid, q2.t().contiguous(), weight_scale=torch.ones(32)) + \
        fused_linear(x, q, weight_scale=s, residual=res).sum()
    torch.testing.assert_close(got, want)


@needs_triton
def test_gpu_tiles_of_quantised_weights_move_as_many_bytes():
    """The autotuner's candidates on a GPU: 1-byte weights get their own tiles, as deep in bytes
    as the bf16 tiles at least (the int8 step was 0.88x bf16's time for half the bytes with the
    bf16 tiles), each dividing the K grain so every split is whole tiles; float weights keep
    theirs."""
    from spd_kernels.linear import triton_kernel as lin
    quant = lin.tuning_configs(lin._linear_tuned.configs, {}, QUANT=True)
    plain = lin.tuning_configs(lin._linear_tuned.configs, {}, QUANT=False)
    assert quant and plain and not {id(c) for c in quant} & {id(c) for c in plain}
    shape = lambda c: (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"])  # noqa: E731
    assert sorted(map(shape, plain)) == sorted((bn, bk) for bn, bk, _ in lin.GPU_CONFIGS)
    bf16_bytes = min(bn * bk * 2 for bn, bk, _ in lin.GPU_CONFIGS)
    for c in quant:
        bn, bk = shape(c)
        assert bn * bk >= bf16_bytes and lin.K_GRAIN % bk == 0
    assert max(bk for _, bk in map(shape, quant)) > max(bk for _, bk, _ in lin.GPU_CONFIGS)
