"""cache_attention: a chunk of R rows attending causally (GQA) to a KV cache that already holds
them, the position read from a device tensor. Triton kernel against the reference (both of its
paths: host int start, device tensor start), the reference against a per-row loop, errors."""
import math

import pytest
import torch

from spd_kernels import SPDBackendError, SPDInputError, cache_attention, dispatch, pdm
from spd_kernels.testing import TRITON_DEVICE, TRITON_SKIP_REASON, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason=TRITON_SKIP_REASON)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
    monkeypatch.setattr(pdm, "_attention_blocks", lambda hd, S: block_n)
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
    monkeypatch.setattr(pdm, "_attention_blocks", lambda hd, S: 16)
    R, S, H, KVH, hd = 5, 100, 6, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE,
                        seed=splits * 100 + start)
    q[:, 2] *= 8  # a peaky row: the maxima differ between splits
    n_splits, chunk = pdm.attention_splits(R, KVH, S, 16, torch.device(TRITON_DEVICE), splits)
    assert n_splits == splits and (n_splits - 1) * chunk < S <= n_splits * chunk
    with poisoned_outputs("a"):
        out = pdm.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
                                   splits=splits)
    torch.testing.assert_close(out, run(q, k, v, start, "reference"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, per_row(q, k, v, start).float(), rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_combine_over_more_splits_than_one_load(monkeypatch):
    """25 key splits, 23 of them holding keys: the combine merges them 16 a load, twice."""
    monkeypatch.setattr(pdm, "_attention_blocks", lambda hd, S: 16)
    R, start, S, H, KVH, hd = 5, 350, 400, 4, 2, 16
    q, k, v = make_case(R, start, S, H, KVH, hd, torch.float32, TRITON_DEVICE, seed=25)
    q[:, 3] *= 8
    assert pdm.attention_splits(R, KVH, S, 16, torch.device(TRITON_DEVICE), 25) == (25, 16)
    with poisoned_outputs("b"):
        out = pdm.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
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
        out = pdm.attention_launch(q, k, v, torch.tensor([start], device=TRITON_DEVICE), None,
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


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="needs the Triton interpreter")
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_triton_at_qwen3_4b_pdm_shapes_and_graph_replay(dtype):
    """bf16 / fp32 on CUDA at the Qwen3-4B PDM shapes (9 rows, 32 heads over 8 kv heads,
    head_dim 128), then one CUDA graph replayed at other positions by writing `start`."""
    if "triton" not in dispatch.available("cache_attention", "cuda"):
        pytest.skip("Triton not available for CUDA tensors here (TRITON_INTERPRET=1?)")
    R, S, H, KVH, hd = 9, 4096, 32, 8, 128
    q, k, v = make_case(R, 4000, S, H, KVH, hd, dtype, "cuda", seed=9)
    k, v = k.nan_to_num(), v.nan_to_num()
    tol = 2e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    start = torch.tensor([1000], device="cuda")
    ref = run(q, k, v, start, "reference")
    out = run(q, k, v, start, "triton")
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    graph = torch.cuda.CUDAGraph()
    cache_attention(q, k, v, start, backend="triton")  # compile outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = cache_attention(q, k, v, start, backend="triton")
    for pos in (0, 17, 2500, S - R):
        start.fill_(pos)
        graph.replay()
        want = cache_attention(q, k, v, pos, backend="reference")
        torch.testing.assert_close(captured.float(), want.float(), rtol=tol, atol=tol)
    assert math.isfinite(captured.float().abs().max().item())
