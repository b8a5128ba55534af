"""cache_attention: a chunk of R rows attending causally (GQA) to a KV cache that already holds
them, the position read from a device tensor. Triton kernel and the CUDA kernel (csrc/kernels/attention.cu,
in the host emulation on CPU) against the reference (both of its paths: host int start, device
tensor start), the reference against a per-row loop, errors."""
import math

import pytest
import torch
from conftest import needs_gpu, needs_simt, needs_triton, needs_triton_interpreter

from spd_kernels import SPDBackendError, SPDInputError, _cuda, cache_attention, dispatch
from spd_kernels.attention import triton_kernel as attention_triton
from spd_kernels.on_request import attention_cuda
from spd_kernels.testing import (
    TRITON_DEVICE,
    poisoned_outputs,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(R, start, S, H, KVH, hd, dtype, device, seed):
    """q [H, R, hd]; caches [KVH, S, hd] with every position past the chunk NaN (never written)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, R, hd, generator=g) * 2
    k = torch.randn(KVH, S, hd, generator=g)
    v = torch.randn(KVH, S, hd, generator=g)
    k[:, start + R:] = float("nan")
    v[:, start + R:] = float("nan")
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def per_row(q, k, v, start, scale=None):
    """The specification, one row and head at a time in float64."""
    H, R, hd = q.shape
    g = H // k.shape[0]
    out = torch.empty(R, H, hd, dtype=torch.float64, device=q.device)
    for r in range(R):
        for h in range(H):
            keys = k[h // g, :start + r + 1].double()
            w = torch.softmax(keys @ q[h, r].double() * (scale or hd ** -0.5), dim=0)
            out[r, h] = w @ v[h // g, :start + r + 1].double()
    return out.reshape(R, H * hd)


def run(q, k, v, start, backend, mode="a"):
    with poisoned_outputs(mode):
        return cache_attention(q, k, v, start, backend=backend)


# (R, start, S, H, KVH, hd): R=1, start=0, start+R=S, no GQA, odd group (padded), MQA, R=16,
# odd H, several key blocks.
SHAPES = [(1, 0, 5, 4, 2, 8), (1, 6, 7, 4, 2, 8), (3, 0, 3, 2, 2, 16), (5, 11, 40, 6, 2, 16),
          (9, 130, 160, 4, 1, 32), (16, 17, 33, 8, 4, 4), (7, 3, 10, 5, 5, 8),
          (2, 250, 300, 3, 1, 64)]


def test_reference_paths_match_a_per_row_loop():
    for i, (R, start, S, H, KVH, hd) in enumerate(SHAPES[:6] + [(4, 5, 12, 6, 3, 12)]):
        q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, "cpu", seed=i)
        want = per_row(q, k, v, start).float()
        host = cache_attention(q, k, v, start)
        device = cache_attention(q, k, v, torch.tensor(start))
        assert host.shape == device.shape == (R, H * hd)
        torch.testing.assert_close(host, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(device, want, rtol=1e-5, atol=1e-5)
    scaled = cache_attention(q, k, v, torch.tensor([start]), scale=0.3)
    torch.testing.assert_close(scaled, per_row(q, k, v, start, 0.3).float(), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("R,start,S,H,KVH,hd", SHAPES)
def test_triton_fp32_matches_reference(R, start, S, H, KVH, hd):
    dev = TRITON_DEVICE
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, dev, seed=R * S + hd)
    ref = run(q, k, v, start, "reference")
    start_t = torch.tensor([start] if R % 2 else start, device=dev)  # shapes [1] and []
    out = run(q, k, v, start_t, "triton", "a")
    assert out.shape == (R, H * hd) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(q, k, v, start_t, "triton", "b"), out, rtol=0, atol=0)
    torch.testing.assert_close(run(q, k, v, start_t, "reference"), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(q, k, v, start, "triton"), out, rtol=0, atol=0)  # host start


@needs_triton
@pytest.mark.parametrize("block_n", [16, 32])
def test_triton_online_softmax_over_many_key_blocks(block_n, monkeypatch):
    """Small key blocks: the running max / rescaling path runs many times per row."""
    monkeypatch.setattr(attention_triton, "_attention_blocks", lambda hd, S: block_n)
    R, start, S, H, KVH, hd = 4, 93, 100, 6, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE, seed=block_n)
    q[:, 1] *= 8  # peaky rows: the running max moves between blocks
    out = run(q, k, v, torch.tensor([start], device=TRITON_DEVICE), "triton")
    torch.testing.assert_close(out, run(q, k, v, start, "reference"), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("start", [0, 37, 90])
def test_triton_split_keys_merge_exactly(splits, start, monkeypatch):
    """Keys split over programs (flash-decoding) and merged by the combine launch: same result
    as the reference, including splits that lie wholly past a row's position (empty)."""
    monkeypatch.setattr(attention_triton, "_attention_blocks", lambda hd, S: 16)
    R, S, H, KVH, hd = 5, 100, 6, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE,
                        seed=splits * 100 + start)
    q[:, 2] *= 8  # a peaky row: the maxima differ between splits
    n_splits, chunk = attention_triton.attention_splits(R, KVH, S, 16, torch.device(TRITON_DEVICE), splits)
    assert n_splits == splits and (n_splits - 1) * chunk < S <= n_splits * chunk
    with poisoned_outputs("a"):
        out = attention_triton.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
                                   splits=splits)
    torch.testing.assert_close(out, run(q, k, v, start, "reference"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, per_row(q, k, v, start).float(), rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_combine_over_more_splits_than_one_load(monkeypatch):
    """25 key splits, 23 of them holding keys: the combine merges them 16 a load, twice."""
    monkeypatch.setattr(attention_triton, "_attention_blocks", lambda hd, S: 16)
    R, start, S, H, KVH, hd = 5, 350, 400, 4, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE, seed=25)
    q[:, 3] *= 8
    assert attention_triton.attention_splits(R, KVH, S, 16, torch.device(TRITON_DEVICE), 25) == (25, 16)
    with poisoned_outputs("b"):
        out = attention_triton.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
                                   splits=25)
    torch.testing.assert_close(out, per_row(q, k, v, start).float(), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_rows_over_several_m_blocks(splits):
    """More (row, query head) pairs than one program holds (R * G = 84 > 64): the second block
    sees later rows, so its keys (and its used splits) reach further than the first's."""
    R, start, S, H, KVH, hd = 21, 40, 70, 8, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE, seed=splits)
    with poisoned_outputs("a"):
        out = attention_triton.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
                                   splits=splits)
    torch.testing.assert_close(out, per_row(q, k, v, start).float(), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(dtype):
    R, start, S, H, KVH, hd = 5, 20, 32, 8, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, dtype, TRITON_DEVICE, seed=7)
    start_t = torch.tensor([start], device=TRITON_DEVICE)
    ref = run(q, k, v, start_t, "reference")  # fp32 math, one rounding: as the kernel
    out = run(q, k, v, start_t, "triton")
    assert out.dtype == dtype
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), per_row(q, k, v, start).float(), rtol=2 * tol,
                               atol=2 * tol)


# (R, start, S, H, KVH, hd) for the CUDA kernel (head_dim 64 / 128): R = 1 at position 0 in a
# cache shorter than a tile; 36 pairs (the Qwen3 group of 4); no GQA at hd 128 with the chunk
# ending at the capacity; 68 pairs (two pair blocks of 34, the second seeing further); an odd
# group of 3; MQA from position 0 (every key causal inside the chunk); Qwen3-4B's heads (32 over
# 8 of 128) at the PDM's 9 rows.
CUDA_SHAPES = [(1, 0, 5, 4, 2, 64), (9, 40, 100, 8, 2, 64), (5, 75, 80, 4, 4, 128),
               (17, 20, 70, 8, 2, 64), (3, 95, 160, 6, 2, 128), (16, 0, 40, 2, 1, 64),
               (9, 150, 200, 32, 8, 128)]


@needs_simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,start,S,H,KVH,hd", CUDA_SHAPES)
@pytest.mark.parametrize("splits,sms", [(1, None), (3, None), (None, None), (None, 132)])
def test_cuda_kernel_matches_reference_in_emulation(dtype, R, start, S, H, KVH, hd, splits, sms):
    """One split (the block normalises; several 32-key tiles when S is long), three, and the
    plan's own on 3 SMs and on an H200's 132 (a split per tile, most holding no key of a row; the
    combine merges the splits holding each row's keys); the cache past the chunk is NaN and the
    output and workspace poisoned, in both sentinel sets (same bits)."""
    q, k, v = make_case(R, start, S, H, KVH, hd, dtype, "cpu", seed=R * S + hd + (splits or 0))
    q[:, R // 2] *= 8  # a peaky row: its maximum moves between tiles and splits
    start_t = torch.tensor([start])
    with _cuda.simulated(sms):
        with poisoned_outputs("a"):
            out = attention_cuda.attention_cuda_launch(q, k, v, start_t, None, splits=splits)
        with poisoned_outputs("b"):
            again = attention_cuda.attention_cuda_launch(q, k, v, start, None, splits=splits)  # host start
    assert out.shape == (R, H * hd) and out.dtype == dtype
    tol = 2 * torch.finfo(dtype).eps
    ref = run(q, k, v, start_t, "reference")  # fp32 math, one rounding: as the kernel
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(out.float(), per_row(q, k, v, start).float(), rtol=2 * tol,
                               atol=2 * tol)
    assert torch.equal(out, again)


def test_cuda_plan_covers_the_cache_in_whole_tiles():
    for S in (1, 5, 32, 33, 100, 4096, 40960):
        for want in (None, 1, 2, 3, 64, 10 ** 6):
            for kvh, pairs in ((8, 36), (1, 200), (2, 4)):
                splits, chunk = attention_cuda.attention_cuda_plan(kvh, pairs, S, torch.device("cpu"), want)
                assert chunk % attention_cuda.CUDA_ATTENTION_TILE == 0 and splits >= 1
                assert (splits - 1) * chunk < S <= splits * chunk
                if want is not None:
                    assert splits <= want


@needs_simt
def test_cuda_dispatch_on_request_only_and_its_limits():
    """The CUDA kernel runs when asked for (not yet timed on a GPU, so the automatic choice
    passes over it), takes a q that is a strided view, and says why it cannot take an argument
    instead of reading past one."""
    assert "cuda" in dispatch.describe()["ops"]["cache_attention"]["on_request_only"]
    R, start, S, H, KVH, hd = 4, 30, 64, 4, 2, 64
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.bfloat16, "cpu", seed=5)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # [H, R, hd] over an [R, H, hd] buffer
    tol = 2 * torch.finfo(torch.bfloat16).eps
    with _cuda.simulated():
        assert dispatch.select("cache_attention", torch.device("cpu"))[0] == "reference"
        got = run(q_view, k, v, torch.tensor(start), "cuda")
        torch.testing.assert_close(got.float(), run(q, k, v, start, "reference").float(),
                                   rtol=tol, atol=tol)
        q32, k32, v32 = make_case(R, start, S, H, KVH, hd, torch.float32, "cpu", seed=5)
        qs, ks, vs = make_case(R, start, S, H, KVH, 32, torch.bfloat16, "cpu", seed=5)
        raw = torch.randn(KVH * S * hd + 4).to(torch.bfloat16)
        shifted = raw[4:].view(KVH, S, hd)  # 8 bytes past a 16-byte boundary
        for call, match in (
                (lambda: cache_attention(q32, k32, v32, start, backend="cuda"), "bf16 / fp16"),
                (lambda: cache_attention(qs, ks, vs, start, backend="cuda"), "64 or 128, got 32"),
                (lambda: cache_attention(q.half(), k, v, start, backend="cuda"),
                 "q in the caches' dtype"),
                (lambda: cache_attention(q, shifted, v, start, backend="cuda"),
                 "k_cache in 16-byte pieces"),
                (lambda: cache_attention(q, k, v.transpose(1, 2).contiguous().transpose(1, 2),
                                         start, backend="cuda"), "contiguous")):
            with pytest.raises(SPDBackendError, match=match):
                call()


def test_checks():
    q, k, v = make_case(3, 2, 8, 4, 2, 8, torch.float32, "cpu", seed=0)
    with pytest.raises(SPDInputError, match="rows 6..8 do not fit a cache of 8"):
        cache_attention(q, k, v, 6)
    with pytest.raises(SPDInputError, match="do not fit a cache of 8"):
        cache_attention(q, k, v, torch.tensor([6]))
    with pytest.raises(SPDInputError, match="do not fit"):
        cache_attention(q, k, v, -1)
    cache_attention(q, k, v, 5)  # start + R == S is fine
    with pytest.raises(SPDInputError, match="start must have dtype torch.int64"):
        cache_attention(q, k, v, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(SPDInputError, match="one position"):
        cache_attention(q, k, v, torch.tensor([1, 2]))
    with pytest.raises(SPDInputError, match="q must have 3 dimensions"):
        cache_attention(q[0], k, v, 0)
    with pytest.raises(SPDInputError, match="positive multiple"):
        cache_attention(q[:3], k, v, 0)
    with pytest.raises(SPDInputError, match="head_dim 4"):
        cache_attention(q[..., :4], k, v, 0)
    with pytest.raises(SPDInputError, match="one shape and dtype"):
        cache_attention(q, k, v.double(), 0)
    with pytest.raises(SPDInputError, match="one shape and dtype"):
        cache_attention(q, k, v[:, :5], 0)
    with pytest.raises(SPDInputError, match="is on meta"):
        cache_attention(q, k.to("meta"), v, 0)
    with pytest.raises(SPDInputError, match="scale must be"):
        cache_attention(q, k, v, 0, scale=-1.0)
    assert dispatch.select("cache_attention", torch.device("cpu"))[0] == "reference"
    assert cache_attention(q[:, :0], k, v, 0).shape == (0, 32)


@needs_triton_interpreter
def test_triton_needs_power_of_two_head_dim(monkeypatch):
    q, k, v = make_case(2, 3, 8, 4, 2, 12, torch.float32, "cpu", seed=1)
    with pytest.raises(SPDBackendError, match="power-of-two head_dim.*got 12"):
        cache_attention(q, k, v, 3, backend="triton")
    q8, k8, v8 = make_case(2, 3, 8, 4, 2, 8, torch.float32, "cpu", seed=1)
    with pytest.raises(SPDBackendError, match="q in the caches' dtype"):
        cache_attention(q8.double(), k8, v8, 3, backend="triton")
    monkeypatch.setattr(dispatch, "_auto_order", lambda device: ("triton", "reference"))
    args = (q, k, v, 3, None)
    assert dispatch.select("cache_attention", torch.device("cpu"), args)[0] == "reference"
    args = (q8, k8, v8, 3, None)
    assert dispatch.select("cache_attention", torch.device("cpu"), args)[0] == "triton"


def test_library_op():
    q, k, v = make_case(3, 4, 9, 4, 2, 8, torch.float32, "cpu", seed=2)
    k, v = k.nan_to_num(), v.nan_to_num()  # opcheck compares outputs with NaN-free inputs
    out = torch.ops.spd.cache_attention(q, k, v, torch.tensor([4]), None)
    torch.testing.assert_close(out, cache_attention(q, k, v, 4), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.spd.cache_attention.default,
                          (q, k, v, torch.tensor([4]), None))
    torch.library.opcheck(torch.ops.spd.cache_attention.default,
                          (q, k, v, torch.tensor(2), 0.5))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backends_at_qwen3_4b_pdm_shapes_and_graph_replay(backend, dtype):
    """bf16 / fp32 on CUDA at the Qwen3-4B PDM shapes (9 rows, 32 heads over 8 kv heads,
    head_dim 128), then one CUDA graph replayed at other positions by writing `start`."""
    if backend not in dispatch.available("cache_attention", "cuda"):
        pytest.skip(f"the {backend} backend is not available for CUDA tensors here")
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernel is bf16 / fp16 only (tensor-core scores); fp32 runs on Triton")
    R, S, H, KVH, hd = 9, 4096, 32, 8, 128
    q, k, v = make_case(R, 4000, S, H, KVH, hd, dtype, "cuda", seed=9)
    k, v = k.nan_to_num(), v.nan_to_num()
    tol = 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    start = torch.tensor([1000], device="cuda")
    ref = run(q, k, v, start, "reference")
    out = run(q, k, v, start, backend)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    graph = torch.cuda.CUDAGraph()
    cache_attention(q, k, v, start, backend=backend)  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = cache_attention(q, k, v, start, backend=backend)
    for pos in (0, 17, 2500, S - R):
        start.fill_(pos)
        graph.replay()
        want = cache_attention(q, k, v, pos, backend="reference")
        torch.testing.assert_close(captured.float(), want.float(), rtol=tol, atol=tol)
    assert math.isfinite(captured.float().abs().max().item())
