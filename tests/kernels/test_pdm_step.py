"""PDM decoder step: the fused RMSNorm + QKV + q/k norm + RoPE + cache-append kernel against its
reference, the plain-tensor step (with cache_attention, tests/kernels/test_attention.py) against
spd.model.layers, and the runtime's PipelineDraftModule.step running it bit for bit."""
import pytest
import torch
from conftest import make_tiny_target, needs_gpu, needs_simt, needs_triton, needs_triton_interpreter

from spd import SPDEngine
from spd.model.layers import decoder_layer_step, rope_table
from spd_kernels import (
    SPDInputError,
    _cuda,
    dispatch,
    pdm_step,
    qkv_rope,
    qkv_rope_append,
    use_backend,
)
from spd_kernels.pdm import LayerWeights, PDMWeights, pdm_batch_step
from spd_kernels.qkv_rope import qkv_supports
from spd_kernels.testing import (
    TRITON_DEVICE,
    TRITON_SKIP_REASON,
    poisoned_outputs,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(T, d, H, KVH, hd, S, dtype, device, seed, qk_norm=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)
    x = r(T, d) * 2
    args = dict(
        x=x, norm_weight=torch.rand(d, generator=g) + 0.5, wq=r(H * hd, d) / d ** 0.5,
        wk=r(KVH * hd, d) / d ** 0.5, wv=r(KVH * hd, d) / d ** 0.5,
        q_norm=torch.rand(hd, generator=g) + 0.5 if qk_norm else None,
        k_norm=torch.rand(hd, generator=g) + 0.5 if qk_norm else None)
    cos, sin = rope_table(hd, S + 4, 10000.0)
    args = {k: None if v is None else v.to(device=device, dtype=dtype) for k, v in args.items()}
    args["cos"], args["sin"] = cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
    caches = [torch.full((KVH, S, hd), float("nan"), device=device, dtype=dtype) for _ in range(2)]
    return args, caches


def run(args, caches, start, H, KVH, backend):
    k, v = (c.clone() for c in caches)
    with poisoned_outputs("a"):
        q = qkv_rope_append(args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"],
                            args["wv"], args["q_norm"], args["k_norm"], args["cos"], args["sin"],
                            start, k, v, H, KVH, backend=backend)
    return q, k, v


SHAPES = [(1, 32, 4, 2, 8), (5, 48, 6, 2, 16), (9, 40, 4, 4, 8), (3, 20, 2, 1, 32),
          (2, 100, 3, 1, 4)]


@needs_triton
@pytest.mark.parametrize("T,d,H,KVH,hd", SHAPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_triton_fp32_matches_reference(T, d, H, KVH, hd, qk_norm):
    S = 20
    args, caches = make_case(T, d, H, KVH, hd, S, torch.float32, TRITON_DEVICE, seed=T * d + hd,
                             qk_norm=qk_norm)
    start = 7
    ref = run(args, caches, start, H, KVH, "reference")
    out = run(args, caches, torch.tensor([start], device=TRITON_DEVICE), H, KVH, "triton")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    for got, want in zip(out[1:], ref[1:]):
        assert got[:, :start].isnan().all() and got[:, start + T:].isnan().all()  # untouched
        torch.testing.assert_close(got[:, start:start + T], want[:, start:start + T], rtol=1e-5,
                                   atol=1e-5)


@needs_triton
@pytest.mark.parametrize("T,d,H,KVH,hd", SHAPES[:3])
def test_triton_packed_qkv_weights_match_separate(T, d, H, KVH, hd):
    """Weights packed back to back (qkv_rope.pack_qkv) take the one-product path: same q and cache
    rows as the reference and as the three separate products (to rounding: the product's
    blocking differs with its width)."""
    S, start = 16, 3
    args, caches = make_case(T, d, H, KVH, hd, S, torch.float32, TRITON_DEVICE, seed=hd + T)
    ref = run(args, caches, start, H, KVH, "reference")
    separate = run(args, caches, start, H, KVH, "triton")
    packed_args = dict(args)
    packed_args["wq"], packed_args["wk"], packed_args["wv"] = qkv_rope.pack_qkv(
        args["wq"], args["wk"], args["wv"])
    assert qkv_rope.packed_qkv(packed_args["wq"], packed_args["wk"], packed_args["wv"]) is not None
    out = run(packed_args, caches, start, H, KVH, "triton")
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    for got, sep in zip(out, separate):  # q, then the caches: NaN (unwritten) in the same places
        torch.testing.assert_close(got, sep, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_packed_qkv_only_for_back_to_back_weights():
    w = torch.randn(10, 4)
    assert qkv_rope.packed_qkv(w[:4], w[4:6], w[6:]).shape == (10, 4)
    assert qkv_rope.packed_qkv(w[:4], w[6:], w[4:6]) is None             # out of order
    assert qkv_rope.packed_qkv(w[:4], w[4:6], w[7:]) is None             # a gap
    assert qkv_rope.packed_qkv(w[:4], w[4:6], torch.randn(4, 4)) is None  # another storage
    assert qkv_rope.packed_qkv(w[:4, :2], w[4:6, :2], w[6:, :2]) is None  # not contiguous


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    T, d, H, KVH, hd, S = 4, 64, 4, 2, 16, 12
    args, caches = make_case(T, d, H, KVH, hd, S, dtype, TRITON_DEVICE, seed=3)
    ref = run(args, caches, 2, H, KVH, "reference")
    out = run(args, caches, 2, H, KVH, "triton")
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out[0].float(), ref[0].float(), rtol=tol, atol=tol)
    for got, want in zip(out[1:], ref[1:]):
        torch.testing.assert_close(got[:, 2:2 + T].float(), want[:, 2:2 + T].float(), rtol=tol,
                                   atol=tol)


# (T, d, H, KVH, hd) for the CUDA path (d a multiple of 8): head_dim 8 (4 of a warp's threads
# hold pairs), 16, 64 (one full warp) and 128 (two warps: the per-head norm sums across them).
CUDA_SHAPES = [(1, 32, 4, 2, 8), (5, 48, 6, 2, 16), (9, 40, 4, 4, 8), (3, 24, 2, 1, 64),
               (16, 64, 2, 1, 128)]


@needs_simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,d,H,KVH,hd", CUDA_SHAPES)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_cuda_kernel_matches_reference_in_emulation(dtype, T, d, H, KVH, hd, qk_norm):
    """The products on linear.cu, then rope_append.cu (host emulation), packed and separate
    weights, start on the device and on the host: q as the reference's, k and v written at
    start .. start + T - 1 and nowhere else (the rest of the caches stays NaN)."""
    S, start = 24, 5
    args, caches = make_case(T, d, H, KVH, hd, S, dtype, "cpu", seed=T * d + hd, qk_norm=qk_norm)
    ref = run(args, caches, start, H, KVH, "reference")
    packed = dict(args)
    packed["wq"], packed["wk"], packed["wv"] = qkv_rope.pack_qkv(args["wq"], args["wk"], args["wv"])
    tol = 2 * torch.finfo(dtype).eps
    with _cuda.simulated():
        outs = [run(args, caches, torch.tensor([start]), H, KVH, "cuda"),
                run(packed, caches, start, H, KVH, "cuda")]
    for out in outs:
        assert out[0].shape == (H, T, hd) and out[0].dtype == dtype
        torch.testing.assert_close(out[0].float(), ref[0].float(), rtol=tol, atol=tol)
        for got, want in zip(out[1:], ref[1:]):
            assert got[:, :start].isnan().all() and got[:, start + T:].isnan().all()
            torch.testing.assert_close(got[:, start:start + T].float(),
                                       want[:, start:start + T].float(), rtol=tol, atol=tol)


@needs_simt
def test_cuda_qkv_on_request_only_and_its_limits():
    from spd_kernels import SPDBackendError
    assert "cuda" in dispatch.describe()["ops"]["qkv_rope_append"]["on_request_only"]
    args, caches = make_case(3, 24, 2, 1, 8, 20, torch.bfloat16, "cpu", seed=2)
    with _cuda.simulated():
        assert dispatch.select("qkv_rope_append", torch.device("cpu"))[0] == "reference"
        fp32 = {k: args[k].float() for k in ("x", "norm_weight", "wq", "wk", "wv", "q_norm",
                                              "k_norm", "cos", "sin")}  # the reference's one dtype
        for change, match in ((fp32, "bf16 / fp16"),
                              (dict(cos=args["cos"].half()), "one dtype"),
                              (dict(x=torch.randn(17, 24).to(torch.bfloat16)), "at most 16 rows")):
            bad = dict(args, **change)
            k, v = (c.clone() for c in caches)
            with pytest.raises(SPDBackendError, match=match):
                qkv_rope_append(bad["x"], bad["norm_weight"], 1e-6, bad["wq"], bad["wk"],
                                bad["wv"], bad["q_norm"], bad["k_norm"], bad["cos"], bad["sin"],
                                0, k, v, 2, 1, backend="cuda")


def test_triton_qkv_declines_chunks_past_the_linear_kernels_rows():
    """The Triton path's projections are fused_linear's kernel (at most MAX_KERNEL_ROWS rows): a
    longer chunk (a prefill) is declined, so the dispatcher falls back to the reference."""
    from spd_kernels.linear import MAX_KERNEL_ROWS
    for T, declined in ((MAX_KERNEL_ROWS, False), (MAX_KERNEL_ROWS + 1, True)):
        args, caches = make_case(T, 16, 2, 1, 8, T + 4, torch.float32, "cpu", seed=T)
        why = qkv_supports(args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"],
                                args["wv"], args["q_norm"], args["k_norm"], args["cos"],
                                args["sin"], 0, caches[0], caches[1], 2, 1, None)
        assert (why is not None and f"at most {MAX_KERNEL_ROWS} rows" in why) == declined, why


def test_checks_and_library_op():
    args, caches = make_case(3, 16, 2, 1, 8, 6, torch.float32, "cpu", seed=1)
    with pytest.raises(SPDInputError, match="do not fit a cache of 6"):
        qkv_rope_append(args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"], args["wv"],
                        args["q_norm"], args["k_norm"], args["cos"], args["sin"], 4, caches[0],
                        caches[1], 2, 1)
    with pytest.raises(SPDInputError, match="multiple of"):
        qkv_rope_append(args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"], args["wv"],
                        args["q_norm"], args["k_norm"], args["cos"], args["sin"], 0, caches[0],
                        caches[1], 3, 2)
    with pytest.raises(SPDInputError, match="both q_norm and k_norm"):
        qkv_rope_append(args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"], args["wv"],
                        args["q_norm"], None, args["cos"], args["sin"], 0, caches[0], caches[1],
                        2, 1)
    assert dispatch.select("qkv_rope_append", torch.device("cpu"))[0] == "reference"
    k, v = (torch.zeros_like(c) for c in caches)
    torch.library.opcheck(torch.ops.spd.qkv_rope_append.default,
                          (args["x"], args["norm_weight"], 1e-6, args["wq"], args["wk"],
                           args["wv"], args["q_norm"], args["k_norm"], args["cos"], args["sin"],
                           torch.tensor([1]), k, v, 2, 1))


def layers_step(pdm, feats: torch.Tensor) -> torch.Tensor:
    """The PDM's layers as training computes them (spd.model.layers.decoder_layer_step,
    cache-free, every row under a causal mask; feats [P, hidden] at positions 0..P-1): the
    draft logits of the last row. pdm_step, the cached form, must give the same."""
    c = pdm.config
    rows = feats.shape[0]
    cos, sin = pdm._rope_for(rows, feats)
    causal = torch.ones(rows, rows, dtype=torch.bool).tril()
    x = feats
    for layer in pdm.layers:
        x = decoder_layer_step(layer, x, cos[:rows], sin[:rows], None, None, 0, c.num_heads,
                               c.num_kv_heads, c.head_dim, mask=causal)
    return pdm.lm_head(pdm.norm(x[-1:]))[0].float()


def tiny_pdm(seed=5):
    t = make_tiny_target(seed=seed, vocab=40, layers=4, model_type="qwen3")
    pdm = SPDEngine(t, n_stages=2, anchors=[0, 2, 3]).pdm
    assert pdm.layers[0].self_attn.q_norm is not None
    return pdm


CHUNKS = ((0, 6), (6, 3), (8, 2), (9, 1))  # prefill, then crop-and-recompute chunks


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("device_start", [False, True])
def test_pdm_step_matches_the_runtime_layers(backend, device_start):
    """pdm_step (qkv_rope_append + cache_attention per layer, the cached layer) against the
    training form of the same layers over every row at once (spd.model.layers, cache-free,
    causal mask), across crop-and-recompute chunks: within fp32 rounding on every backend."""
    if backend == "triton" and TRITON_DEVICE != "cpu":
        pytest.skip(TRITON_SKIP_REASON)
    pdm = tiny_pdm()
    c = pdm.config
    g = torch.Generator().manual_seed(0)
    weights = PDMWeights.from_pdm(pdm)
    shape = (c.num_layers, c.num_kv_heads, 32, c.head_dim)
    k, v = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    cos, sin = rope_table(c.head_dim, 32, c.rope_theta)
    feats_now = torch.zeros(32, c.hidden_size)  # each position's feature as it stands
    for start, rows in CHUNKS:
        feats = torch.randn(rows, c.hidden_size, generator=g)
        feats_now[start:start + rows] = feats
        k[:, :, start:] = float("nan")  # the rows being recomputed were dropped
        v[:, :, start:] = float("nan")
        want = layers_step(pdm, feats_now[:start + rows])
        pos = torch.tensor([start]) if device_start else start
        with poisoned_outputs("b"):
            got = pdm_step(feats, weights, k, v, pos, cos, sin, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not k[:, :, :start + rows].isnan().any()


@needs_triton_interpreter
def test_pdm_step_with_every_op_forced_to_triton():
    pdm = tiny_pdm(seed=6)
    c = pdm.config
    g = torch.Generator().manual_seed(1)
    weights = PDMWeights.from_pdm(pdm)
    cos, sin = rope_table(c.head_dim, 40, c.rope_theta)
    caches = {b: [torch.full((c.num_layers, c.num_kv_heads, 40, c.head_dim), float("nan"))
                  for _ in range(2)] for b in ("reference", "triton")}
    start = torch.tensor(0)
    for s, rows in ((0, 7), (5, 4), (9, 1)):
        feats = torch.randn(rows, c.hidden_size, generator=g)
        start.fill_(s)  # one position tensor, rewritten in place as a CUDA graph would see it
        want = pdm_step(feats, weights, *caches["reference"], s, cos, sin)
        with use_backend("triton"), poisoned_outputs("a"):
            got = pdm_step(feats, weights, *caches["triton"], start, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_runtime_step_routes_through_pdm_step_bit_for_bit():
    """PipelineDraftModule.step runs spd_kernels.pdm_step exactly (CPU, reference backend), also
    after its parameters are replaced, and keeps the training form's results (to rounding)."""
    pdm = tiny_pdm(seed=7)
    c = pdm.config
    g = torch.Generator().manual_seed(2)
    cache = pdm.new_cache(16)
    for rnd in range(2):
        weights = PDMWeights.from_pdm(pdm)
        k, v = torch.zeros_like(cache.k), torch.zeros_like(cache.v)
        cos, sin = rope_table(c.head_dim, 16, c.rope_theta)
        feats_now = torch.zeros(16, c.hidden_size)
        for start, rows in CHUNKS:
            feats = torch.randn(rows, c.hidden_size, generator=g)
            feats_now[start:start + rows] = feats
            got = pdm.step(feats, start, cache)
            assert torch.equal(got, pdm_step(feats, weights, k, v, start, cos, sin))
            assert cache.length == start + rows
            assert torch.equal(cache.k[:, :, :start + rows], k[:, :, :start + rows])
            torch.testing.assert_close(got, layers_step(pdm, feats_now[:start + rows]),
                                       rtol=1e-5, atol=1e-5)
        state = {k: torch.randn(v.shape, generator=g) * 0.1 if v.is_floating_point() else v
                 for k, v in pdm.state_dict().items()}
        pdm.load_state_dict(state)  # the step must follow the new weights
        pdm.layers[0].self_attn.o_proj.weight = torch.nn.Parameter(
            torch.randn(pdm.layers[0].self_attn.o_proj.weight.shape, generator=g) * 0.1)


def random_step_weights(d, H, KVH, hd, inter, vd, L, dtype, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(device=device, dtype=dtype)
    one = lambda n: (torch.rand(n, generator=g) + 0.5).to(device=device, dtype=dtype)
    layers = [LayerWeights(one(d), r(H * hd, d, sc=d ** -0.5), r(KVH * hd, d, sc=d ** -0.5),
                           r(KVH * hd, d, sc=d ** -0.5), one(hd), one(hd),
                           r(d, H * hd, sc=d ** -0.5), one(d), r(inter, d, sc=d ** -0.5),
                           r(inter, d, sc=d ** -0.5), r(d, inter, sc=inter ** -0.5))
              for _ in range(L)]
    return PDMWeights(layers, one(d), r(vd, d, sc=d ** -0.5), H, KVH, hd, 1e-6), r


@needs_simt
@pytest.mark.parametrize("sms", [None, 132])  # the emulated device's plans, and an H200's
def test_pdm_step_with_the_cuda_kernels_in_emulation(sms):
    """The step with every op on the CUDA kernels (QKV products, norm / RoPE / append, attention,
    o_proj, SwiGLU MLP, down, LM head; host emulation, bf16) matches the reference step: the
    kernels' strides, views (the head takes x[-1:], the attention q from the QKV step) and
    residuals line up in the real sequence of calls."""
    d, H, KVH, hd, inter, vd, S, L = 64, 4, 2, 64, 96, 200, 48, 2
    w, r = random_step_weights(d, H, KVH, hd, inter, vd, L, torch.bfloat16, "cpu")
    cos, sin = (t.to(torch.bfloat16) for t in rope_table(hd, S, 1e4))
    caches = {b: [r(L, KVH, S, hd) for _ in range(2)] for b in ("reference", "cuda")}
    caches["cuda"] = [c.clone() for c in caches["reference"]]
    for start, rows in ((0, 9), (9, 5), (12, 1)):
        feats = r(rows, d)
        want = pdm_step(feats, w, *caches["reference"], start, cos, sin, backend="reference")
        with _cuda.simulated(sms), poisoned_outputs("a"):
            got = pdm_step(feats, w, *caches["cuda"], start, cos, sin, backend="cuda")
        torch.testing.assert_close(got, want, rtol=0.03, atol=0.05)
        for c, ref in zip(caches["cuda"], caches["reference"]):
            torch.testing.assert_close(c.float(), ref.float(), rtol=0.02, atol=0.02)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backends_at_qwen3_4b_pdm_shapes(backend, dtype):
    if backend not in dispatch.available("qkv_rope_append", "cuda"):
        pytest.skip(f"the {backend} backend is not available for CUDA tensors here")
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA path is bf16 / fp16 only (tensor-core products); fp32 runs on Triton")
    T, d, H, KVH, hd, S = 9, 2560, 32, 8, 128, 4096
    args, caches = make_case(T, d, H, KVH, hd, S, dtype, "cuda", seed=9)
    start = torch.tensor([1000], device="cuda")
    ref = run(args, caches, start, H, KVH, "reference")
    out = run(args, caches, start, H, KVH, backend)
    tol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out[0].float(), ref[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out[1][:, 1000:1009].float(), ref[1][:, 1000:1009].float(),
                               rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qkv,attention,linear", [("triton", "triton", "triton"),
                                                  ("triton", "triton", "cuda"),
                                                  ("cuda", "cuda", "cuda")])
def test_gpu_pdm_step_captured_once_replays_at_any_position(qkv, attention, linear):
    """With a device `start` nothing in pdm_step reads the position on the host: one CUDA graph of
    the whole step (all Triton, Triton with the CUDA dense products, all CUDA) replays at any
    position."""
    wanted = dict(qkv_rope_append=qkv, cache_attention=attention, fused_linear=linear,
                  fused_swiglu=linear)
    for op, backend in wanted.items():
        if backend not in dispatch.available(op, "cuda"):
            pytest.skip(f"the {backend} backend of {op} is not available here")
    dtype, dev = torch.bfloat16, "cuda"
    d, H, KVH, hd, inter, vd, S, T, L = 512, 8, 2, 64, 1024, 1000, 256, 5, 2
    w, r = random_step_weights(d, H, KVH, hd, inter, vd, L, dtype, dev)
    cos, sin = (t.to(device=dev, dtype=dtype) for t in rope_table(hd, S, 1e6))
    k, v = r(L, KVH, S, hd), r(L, KVH, S, hd)
    feats = r(T, d)
    start = torch.tensor([0], device=dev)
    with use_backend(**wanted):
        pdm_step(feats, w, k, v, start, cos, sin)  # compile the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = pdm_step(feats, w, k, v, start, cos, sin)
    for pos in (0, 40, S - T):
        start.fill_(pos)
        kr, vr = k.clone(), v.clone()
        graph.replay()
        want = pdm_step(feats, w, kr, vr, pos, cos, sin, backend="reference")
        torch.testing.assert_close(logits, want, rtol=0.05, atol=0.1)
        torch.testing.assert_close(k[:, :, pos:pos + T].float(), kr[:, :, pos:pos + T].float(),
                                   rtol=0.02, atol=0.02)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pdm_batch_step_equals_each_window_alone(backend):
    """pdm_batch_step over the windows of three slots (different lengths held, windows that
    overlap their held rows: a crop and recompute, as a cycle's) against pdm_step over each
    window in its own cache: the same logits (to fp32 rounding: the rows share the linear
    layers) and the same keys and values written, nothing outside the windows touched."""
    if backend == "triton" and TRITON_DEVICE != "cpu":
        pytest.skip(TRITON_SKIP_REASON)
    pdm = tiny_pdm(seed=8)
    c = pdm.config
    g = torch.Generator().manual_seed(3)
    weights = PDMWeights.from_pdm(pdm)
    S, R = 24, 4
    cos, sin = rope_table(c.head_dim, S, c.rope_theta)
    k = torch.randn(3, c.num_layers, c.num_kv_heads, S, c.head_dim, generator=g)
    v = torch.randn(k.shape, generator=g)
    alone_k, alone_v = k.clone(), v.clone()
    starts, lasts = [0, 7, 15], [3, 1, 2]  # (a row past `last` is computed, never read)
    feats = torch.randn(3 * R, c.hidden_size, generator=g)
    want = torch.stack([
        pdm_step(feats[b * R:(b + 1) * R], weights, alone_k[b], alone_v[b],
                 torch.tensor([s]), cos, sin, last=torch.tensor([lasts[b]]), backend=backend)
        for b, s in enumerate(starts)])
    slots = torch.arange(3).repeat_interleave(R)
    positions = torch.cat([torch.arange(s, s + R) for s in starts])
    last = torch.tensor(lasts) + torch.arange(3) * R
    with poisoned_outputs("b"):
        got = pdm_batch_step(feats, weights, k, v, slots, positions, cos, sin, last,
                             backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for b, s in enumerate(starts):  # the windows' rows written alike, the rest untouched
        torch.testing.assert_close(k[b, :, :, :s + R], alone_k[b, :, :, :s + R])
        torch.testing.assert_close(v[b, :, :, :s + R], alone_v[b, :, :, :s + R])
        assert torch.equal(k[b, :, :, s + R:], alone_k[b, :, :, s + R:])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pdm_batch_tree_step_equals_each_tree_alone(backend):
    """pdm_batch_tree_step over the token trees of two slots of three (slots out of order, one
    between them idle; different prefixes, cache rows and branch masks) against pdm_tree_step
    over each tree in its own cache: the same leaves' logits (to fp32 rounding: the rows share
    the linear layers), the same keys and values written, the idle slot untouched."""
    if backend == "triton" and TRITON_DEVICE != "cpu":
        pytest.skip(TRITON_SKIP_REASON)
    from spd_kernels.pdm import pdm_batch_tree_step, pdm_tree_step
    pdm = tiny_pdm(seed=9)
    c = pdm.config
    g = torch.Generator().manual_seed(4)
    weights = PDMWeights.from_pdm(pdm)
    S, R, W = 32, 6, 2
    cos, sin = rope_table(c.head_dim, S, c.rope_theta)
    k = torch.randn(3, c.num_layers, c.num_kv_heads, S, c.head_dim, generator=g)
    v = torch.randn(k.shape, generator=g)
    alone_k, alone_v, before = k.clone(), v.clone(), k.clone()
    slots, prefixes = [2, 0], [9, 14]
    feats = torch.randn(2 * R, c.hidden_size, generator=g)
    rows = torch.stack([p + torch.randperm(S - p - 2, generator=g)[:R] for p in prefixes])
    positions = torch.randint(0, S, (2 * R,), generator=g)
    # each row sees itself and some earlier rows (its branch); the leaves are two rows each
    masks = (torch.rand(2, R, R, generator=g) < 0.5).tril() | torch.eye(R, dtype=torch.bool)
    leaves = torch.stack([torch.randperm(R, generator=g)[:W] for _ in slots])
    cr, sr = cos.index_select(0, positions), sin.index_select(0, positions)
    want = torch.cat([
        pdm_tree_step(feats[u * R:(u + 1) * R], weights, alone_k[b], alone_v[b], rows[u],
                      torch.tensor([prefixes[u]]), masks[u], cr[u * R:(u + 1) * R],
                      sr[u * R:(u + 1) * R], leaves[u], backend=backend)
        for u, b in enumerate(slots)])
    with poisoned_outputs("b"):
        got = pdm_batch_tree_step(feats, weights, k, v, slots, rows, torch.tensor(prefixes),
                                  masks, cr, sr, (leaves + torch.arange(2).view(2, 1) * R)
                                  .reshape(-1), backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, alone_k)
    torch.testing.assert_close(v, alone_v)
    assert torch.equal(k[1], before[1])  # (the idle slot)
    for u, b in enumerate(slots):  # (each tree's rows were written)
        assert not torch.equal(k[b][:, :, rows[u]], before[b][:, :, rows[u]])
