"""PDM decoder step: the fused RMSNorm + QKV + q/k norm + RoPE + cache-append kernel against its
reference, and the plain-tensor step against the runtime's PipelineDraftModule.step."""
import pytest
import torch

from conftest import make_tiny_target
from spd import SPDEngine
from spd.layers import rope_table
from spd_kernels import SPDInputError, dispatch, pdm_step, qkv_rope_append
from spd_kernels.pdm import PDMWeights
from spd_kernels.testing import TRITON_DEVICE, TRITON_SKIP_REASON, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason=TRITON_SKIP_REASON)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_pdm_step_matches_the_runtime_module(backend):
    if backend == "triton" and TRITON_DEVICE != "cpu":
        pytest.skip(TRITON_SKIP_REASON)
    t = make_tiny_target(seed=5, vocab=40, layers=4, model_type="qwen3")
    eng = SPDEngine(t, n_stages=2, anchors=[0, 2, 3])
    pdm = eng.pdm
    assert pdm.layers[0].self_attn.q_norm is not None
    c = pdm.config
    g = torch.Generator().manual_seed(0)
    cache = pdm.new_cache(32)
    weights = PDMWeights.from_pdm(pdm)
    k = torch.full_like(cache.k, float("nan"))
    v = torch.full_like(cache.v, float("nan"))
    cos, sin = rope_table(c.head_dim, 32, c.rope_theta)
    for start, rows in ((0, 6), (6, 3), (8, 2)):  # prefill, then crop-and-recompute chunks
        feats = torch.randn(rows, c.hidden_size, generator=g)
        cache.truncate(start)
        want = pdm.step(feats, start, cache)
        got = pdm_step(feats, weights, k, v, start, cos, sin, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(k[:, :, :start + rows], cache.k[:, :, :start + rows],
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_at_qwen3_4b_pdm_shapes(dtype):
    if "triton" not in dispatch.available("qkv_rope_append", "cuda"):
        pytest.skip("Triton not available for CUDA tensors here")
    T, d, H, KVH, hd, S = 9, 2560, 32, 8, 128, 4096
    args, caches = make_case(T, d, H, KVH, hd, S, dtype, "cuda", seed=9)
    start = torch.tensor([1000], device="cuda")
    ref = run(args, caches, start, H, KVH, "reference")
    out = run(args, caches, start, H, KVH, "triton")
    tol = 1e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out[0].float(), ref[0].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out[1][:, 1000:1009].float(), ref[1][:, 1000:1009].float(),
                               rtol=tol, atol=tol)
