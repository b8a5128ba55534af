"""In-place KV truncation kernels vs the reference: lengths from a device tensor, every layer in
one launch, debug poison of exactly the dropped rows (rows kept and rows never written untouched)."""
import pytest
import torch
from conftest import GPU_BACKENDS, gpu_backend, needs_gpu, needs_simt, needs_triton

from spd_kernels import SPDBackendError, SPDInputError, _cuda, dispatch, truncate_kv_
from spd_kernels.kv_cache import truncate_kv_reference
from spd_kernels.testing import TRITON_DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(C, H, S, hd, dtype, device, seed, per_cache=True, seq_first=False):
    g = torch.Generator().manual_seed(seed)
    shape = (C, S, H, hd) if seq_first else (C, H, S, hd)
    bufs = [(torch.randn(shape, generator=g) + 3.0).to(dtype).to(device) for _ in range(2)]
    old = torch.randint(0, S + 1, (C,), generator=g)
    if per_cache:
        new = torch.randint(0, S + 1, (C,), generator=g)
        new[0] = old[0] + 1 if old[0] < S else old[0]  # one cache that must not grow
    else:
        new = torch.tensor(int(torch.randint(0, S + 1, (), generator=g)))
    return old.to(device), new.to(device), bufs


def run_both(C, H, S, hd, dtype, device, seed, backend, **kw):
    seq_dim = 1 if kw.get("seq_first") else -2
    old, new, bufs = make_case(C, H, S, hd, dtype, device, seed, **kw)
    ref_len, ref_bufs = old.clone(), [b.clone() for b in bufs]
    truncate_kv_reference(ref_len, new, ref_bufs, seq_dim, True)
    length = old.clone()
    out = truncate_kv_(length, new, bufs, seq_dim=seq_dim, poison=True, backend=backend)
    assert out is length
    assert torch.equal(length, ref_len)
    for b, rb in zip(bufs, ref_bufs):
        assert torch.equal(b.isnan(), rb.isnan())
        assert torch.equal(torch.nan_to_num(b), torch.nan_to_num(rb))
    return old, length, bufs


@needs_triton
@pytest.mark.parametrize("C,H,S,hd", [(1, 1, 8, 4), (3, 2, 10, 4), (5, 3, 17, 7), (4, 8, 33, 16),
                                      (2, 1, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_poison_matches_reference(C, H, S, hd, dtype):
    run_both(C, H, S, hd, dtype, TRITON_DEVICE, seed=C * 100 + S, backend="triton")


@needs_triton
@pytest.mark.parametrize("seq_first", [False, True])
def test_triton_scalar_new_length_and_layouts(seq_first):
    run_both(4, 3, 12, 5, torch.float32, TRITON_DEVICE, seed=9, backend="triton",
             per_cache=False, seq_first=seq_first)


@needs_triton
def test_triton_without_poison_touches_only_lengths():
    old, new, bufs = make_case(6, 2, 20, 8, torch.float32, TRITON_DEVICE, seed=1)
    before = [b.clone() for b in bufs]
    length = old.clone()
    truncate_kv_(length, new, bufs, backend="triton")
    assert torch.equal(length, torch.minimum(old, new))
    assert all(torch.equal(b, c) for b, c in zip(bufs, before))
    truncate_kv_(length, torch.tensor(10**6, device=TRITON_DEVICE), backend="triton")  # never grows
    assert torch.equal(length, torch.minimum(old, new))
    truncate_kv_(length, torch.tensor(0, device=TRITON_DEVICE), backend="triton")
    assert int(length.sum()) == 0


@needs_triton
def test_triton_mixed_buffers_fall_back_or_raise():
    length = torch.tensor([5, 5], device=TRITON_DEVICE)
    bufs = [torch.randn(2, 1, 8, 4, device=TRITON_DEVICE),
            torch.randn(2, 1, 8, 4, device=TRITON_DEVICE).half()]
    with pytest.raises(SPDBackendError, match="one shape and dtype"):
        truncate_kv_(length, torch.tensor(2, device=TRITON_DEVICE), bufs, poison=True,
                     backend="triton")
    with pytest.raises(SPDBackendError, match="contiguous"):
        truncate_kv_(length, torch.tensor(2, device=TRITON_DEVICE),
                     [bufs[0].transpose(2, 3)], seq_dim=-1, poison=True, backend="triton")


def test_reference_default_and_checks():
    assert dispatch.select("truncate_kv", torch.device("cpu"))[0] == "reference"
    length = torch.tensor([4, 4])
    with pytest.raises(SPDInputError, match="non-negative"):
        truncate_kv_(length, torch.tensor([-1, 2]))
    with pytest.raises(SPDInputError, match="scalar or have shape"):
        truncate_kv_(length, torch.tensor([1, 2, 3]))
    with pytest.raises(SPDInputError, match="lengths has 2"):
        truncate_kv_(length, torch.tensor(1), [torch.randn(3, 8, 4)], poison=True)
    with pytest.raises(SPDInputError, match="not a sequence axis"):
        truncate_kv_(length, torch.tensor(1), [torch.randn(2, 8, 4)], seq_dim=0, poison=True)
    with pytest.raises(SPDBackendError, match="CUDA tensors"):
        truncate_kv_(length, torch.tensor(1), backend="cuda")


def _cpu_backends():
    """The backends that run truncate_kv on CPU tensors here (reference; the Triton interpreter
    and the CUDA kernels' host emulation where available)."""
    out = [("reference", None)]
    if "triton" in dispatch.available("truncate_kv", TRITON_DEVICE) and TRITON_DEVICE == "cpu":
        out.append(("triton", None))
    if _cuda.simt_unavailable_reason() is None:
        out.append(("cuda", _cuda.simulated))
    return out


@pytest.mark.parametrize("lengths,msg", [([9, 2], r"exceed the 8 positions of buffers\[0\]"),
                                         ([-1, 2], "lengths must be non-negative")])
def test_lengths_outside_the_buffers_are_refused_on_every_backend(lengths, msg):
    for backend, ctx in _cpu_backends():
        buf = torch.randn(2, 3, 8, 4)
        with (ctx() if ctx else torch.no_grad()):
            with pytest.raises(SPDInputError, match=msg):
                truncate_kv_(torch.tensor(lengths), torch.tensor(1), [buf], poison=True,
                             backend=backend)


def test_unchecked_lengths_past_the_capacity_never_write_outside_the_buffer(monkeypatch):
    """Device tensors skip the value check (it needs a host sync): the kernels then clamp the
    poisoned rows to the buffer's capacity. The buffer is a view at the front of a larger
    allocation, so a write past it shows in the spare cache."""
    import spd_kernels.kv_cache as kv
    monkeypatch.setattr(kv, "check_values_enabled", lambda *t: False)
    for backend, ctx in _cpu_backends()[1:]:
        big = torch.ones(3, 2, 8, 4)
        buf = big[:2]
        length = torch.tensor([13, 8])
        with ctx() if ctx else torch.no_grad():
            truncate_kv_(length, torch.tensor([5, 6]), [buf], poison=True, backend=backend)
        assert length.tolist() == [5, 6], backend
        assert torch.equal(big[2], torch.ones(2, 8, 4)), backend  # nothing past the buffer
        assert not buf[0, :, :5].isnan().any() and buf[0, :, 5:].isnan().all(), backend
        assert not buf[1, :, :6].isnan().any() and buf[1, :, 6:].isnan().all(), backend


def test_library_op():
    length = torch.tensor([7, 3, 5])
    k = torch.randn(3, 2, 8, 4)
    torch.library.opcheck(torch.ops.spd.truncate_kv_.default,
                          (length.clone(), torch.tensor(4), [k.clone(), k.clone()], -2, True))
    torch.ops.spd.truncate_kv_(length, torch.tensor(4), [k], -2, True)
    assert length.tolist() == [4, 3, 4] and k[0, :, 4:7].isnan().all()


# --- CUDA kernels in the host emulation (CPU) -------------------------------------------------------

@needs_simt
@pytest.mark.parametrize("C,H,S,hd", [(1, 1, 8, 4), (5, 3, 17, 7), (300, 2, 9, 3), (2, 1, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernels_in_host_emulation(C, H, S, hd, dtype):
    """300 caches: two blocks of the lengths kernel."""
    with _cuda.simulated():
        run_both(C, H, S, hd, dtype, "cpu", seed=C * 100 + S, backend="cuda")
        run_both(C, H, S, hd, dtype, "cpu", seed=C, backend="cuda", per_cache=False,
                 seq_first=True)


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backends_match_reference(backend, dtype):
    gpu_backend("truncate_kv", backend)
    run_both(36, 8, 2048, 128, dtype, "cuda", seed=3, backend=backend)
    run_both(7, 3, 33, 7, dtype, "cuda", seed=4, backend=backend, per_cache=False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_truncation_in_cuda_graph_without_host_sync(backend):
    """New lengths live in a device tensor: a captured graph truncates to whatever it holds."""
    gpu_backend("truncate_kv", backend)
    length = torch.full((36,), 1000, dtype=torch.int64, device="cuda")
    new = torch.tensor(900, device="cuda")
    k = torch.randn(36, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
    truncate_kv_(length, new, [k], poison=True, backend=backend)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        truncate_kv_(length, new, [k], poison=True, backend=backend)
    expect = 900  # after the warm-up call
    for target in (800, 512, 600, 3):
        new.fill_(target)
        graph.replay()
        torch.cuda.synchronize()
        expect = min(expect, target)  # never grows
        assert int(length.max()) == int(length.min()) == expect
    assert k[:, :, 3:1000].isnan().all() and not k[:, :, :3].isnan().any()
