"""Fused anchor concat-projection kernels vs the reference: mixed aggregation types in one launch,
anchors read in place through their strides, outputs poisoned first."""
import pytest
import torch
from conftest import GPU_BACKENDS, gpu_backend, needs_gpu, needs_simt, needs_triton

from spd_kernels import SPDBackendError, SPDInputError, _cuda, anchor_projection, dispatch
from spd_kernels.features import (
    anchor_projection_cuda,
    anchor_projection_cuda_mma,
    anchor_projection_reference,
    anchor_projection_triton,
    mma_plan,
)
from spd_kernels.testing import (
    TRITON_DEVICE,
    poisoned_outputs,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(m, rows, d, d_out, dtype, device, seed, types=None, missing=()):
    g = torch.Generator().manual_seed(seed)
    store = torch.randn(m, rows + 7, d, generator=g)  # a bigger buffer: anchors are a strided view
    if types is None:
        types = torch.randint(0, m, (rows,), generator=g)
        types[0] = m - 1
    weights = [None if e in missing else torch.randn(d_out, (e + 1) * d, generator=g) / d ** 0.5
               for e in range(m)]
    biases = [None if e % 2 or e in missing else torch.randn(d_out, generator=g) for e in range(m)]
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    anchors = cast(store)[:, 3:3 + rows]
    return anchors, types.to(device), [cast(w) for w in weights], [cast(b) for b in biases]


def oracle(anchors, types, weights, biases):
    """The reference in fp32 (the kernels accumulate in fp32 and round once)."""
    up = lambda t: None if t is None else t.float()
    return anchor_projection_reference(up(anchors), types, [up(w) for w in weights],
                                       [up(b) for b in biases])


def staircase(n, m):
    """Types of an n-deep in-flight window: depth k gets the anchors its stages produced."""
    return torch.tensor([min(m - 1, (k * m) // (n + 1)) for k in range(n + 1)][::-1])


def expected(anchors, types, weights, biases):
    """oracle() on the rows with a usable projection, NaN rows for the others."""
    m = anchors.shape[0]
    ts = types.tolist()
    good = [r for r, t in enumerate(ts) if 0 <= t < m and weights[t] is not None]
    d_out = next(w for w in weights if w is not None).shape[0]
    out = torch.full((len(ts), d_out), float("nan"), device=anchors.device)
    if good:
        idx = torch.tensor(good, device=anchors.device)
        out[idx] = oracle(anchors[:, idx], types[idx], weights, biases)
    return out


# Several rows per type: each weight tile is read once for all of them (kernels group rows by type).
SHARED_TYPES = {
    "one-type": ([3] * 20, ()),                     # > 16 rows of one type: two row groups
    "unsorted": ([2, 4, 0, 4, 2, 1, 4, 0, 2], ()),
    "unused-types": ([4, 0, 4, 0, 4], ()),         # types 1..3 have weights but no rows
    "bad-rows": ([4, 9, 1, -1, 4, 1, 3, 3], (3,)),  # out of range or no weight: NaN rows
    "many-rows": ((torch.arange(300) * 7 % 5).tolist(), ()),  # more rows than one scan pass
}


def shared_case(name, d, d_out, dtype, device, seed, int32=False):
    types, missing = SHARED_TYPES[name]
    types = torch.tensor(types, dtype=torch.int32 if int32 else torch.int64)
    return make_case(5, len(types), d, d_out, dtype, device, seed, types=types, missing=missing)


CASES = [(4, 1, 8, 8), (4, 7, 16, 12), (3, 33, 5, 9), (5, 9, 64, 48), (2, 4, 130, 70)]


@needs_triton
@pytest.mark.parametrize("m,rows,d,d_out", CASES)
def test_triton_fp32_matches_reference(m, rows, d, d_out):
    args = make_case(m, rows, d, d_out, torch.float32, TRITON_DEVICE, seed=rows * 10 + d)
    assert not args[0].is_contiguous()
    ref = anchor_projection_reference(*args)
    for mode in ("a", "b"):
        with poisoned_outputs(mode):
            out = anchor_projection(*args, backend="triton")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision_rounds_once(dtype):
    args = make_case(5, 9, 48, 40, dtype, TRITON_DEVICE, seed=2, types=staircase(8, 5))
    with poisoned_outputs("a"):
        out = anchor_projection(*args, backend="triton")
    assert out.dtype == dtype
    ref = oracle(*args)
    # one rounding of an fp32 sum: within half an ulp of the output dtype (plus fp32 noise)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref, rtol=eps, atol=1e-3)


@needs_triton
def test_triton_staircase_int32_types_and_missing_slots():
    m = 5
    types = torch.tensor([3, 3, 2, 1, 0, 1], dtype=torch.int32)  # type 4 absent, no weight
    args = make_case(m, len(types), 24, 20, torch.float32, TRITON_DEVICE, seed=4, types=types,
                     missing=(4,))
    torch.testing.assert_close(anchor_projection(*args, backend="triton"),
                               anchor_projection_reference(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(anchor_projection(args[0], args[1], args[2], None,
                                                 backend="triton"),
                               anchor_projection_reference(args[0], args[1], args[2], None),
                               rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_bad_type_gives_nan_row_not_a_crash():
    """Without value checks (device tensors), a row whose type has no weight becomes NaN."""
    anchors, types, weights, biases = make_case(3, 4, 8, 6, torch.float32, TRITON_DEVICE, seed=5,
                                                types=torch.tensor([0, 1, 2, 0]), missing=(1,))
    out = anchor_projection_triton(anchors, types, weights, biases)
    assert out[1].isnan().all() and not out[[0, 2, 3]].isnan().any()


@needs_triton
@pytest.mark.parametrize("name", list(SHARED_TYPES))
@pytest.mark.parametrize("d", [24, 64])  # ragged and whole BLOCK_K tiles
def test_triton_rows_sharing_types(name, d):
    args = shared_case(name, d, 20, torch.float32, TRITON_DEVICE, seed=d, int32=d == 24)
    want = expected(*args)
    for mode in ("a", "b"):  # NaN and inf sentinels: every element written, NaN rows too
        with poisoned_outputs(mode):
            out = anchor_projection_triton(*args)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@needs_triton
def test_triton_shared_types_half_precision():
    args = shared_case("unsorted", 64, 48, torch.bfloat16, TRITON_DEVICE, seed=3)
    with poisoned_outputs("b"):
        out = anchor_projection(*args, backend="triton")
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.float(), oracle(*args), rtol=eps, atol=1e-3)


def test_reference_default_and_checks():
    assert dispatch.select("anchor_projection", torch.device("cpu"))[0] == "reference"
    a = torch.randn(3, 4, 8)
    w = [torch.randn(6, 8), None, torch.randn(6, 24)]
    with pytest.raises(SPDInputError, match="no projection for it"):
        anchor_projection(a, torch.tensor([0, 1, 0, 2]), w)
    with pytest.raises(SPDInputError, match="output rows"):
        anchor_projection(a, torch.tensor([0, 0, 0, 0]), [torch.randn(6, 8), None,
                                                          torch.randn(5, 24)])
    with pytest.raises(SPDInputError, match="one bias slot per anchor"):
        anchor_projection(a, torch.tensor([0, 0, 0, 0]), w, [None])
    with pytest.raises(SPDInputError, match="integer"):
        anchor_projection(a, torch.tensor([0.0, 0, 0, 0]), w)
    with pytest.raises(SPDBackendError, match="CUDA tensors"):
        anchor_projection(a, torch.tensor([0, 0, 2, 2]), w, backend="cuda")


def test_library_op():
    args = make_case(3, 5, 8, 6, torch.float32, "cpu", seed=6)
    torch.library.opcheck(torch.ops.spd.anchor_projection.default, args)
    torch.testing.assert_close(torch.ops.spd.anchor_projection(*args),
                               anchor_projection_reference(*args))


# --- CUDA kernel in the host emulation (CPU) --------------------------------------------------------

def check_shared_types(fn, name, d, d_out, dtype, device):
    """fn (a backend's implementation) on a SHARED_TYPES case, outputs poisoned both ways."""
    args = shared_case(name, d, d_out, dtype, device, seed=d + len(name), int32=d == 100)
    want = expected(*args)
    tol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    for mode in ("a", "b"):
        with poisoned_outputs(mode):
            out = fn(*args)
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * 10, equal_nan=True)


@needs_simt
@pytest.mark.parametrize("name", list(SHARED_TYPES))
# D = 1600: the vector path's full, half and single k steps (41 outputs: a warp with one);
# D = 100: the scalar path
@pytest.mark.parametrize("d,d_out", [(1600, 41), (100, 36)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_kernel_in_host_emulation(name, d, d_out, dtype):
    with _cuda.simulated():
        check_shared_types(anchor_projection_cuda, name, d, d_out, dtype, "cpu")


@needs_simt
@pytest.mark.parametrize("m,rows,d,d_out", CASES)
def test_cuda_kernel_in_host_emulation_strided_cases(m, rows, d, d_out):
    args = make_case(m, rows, d, d_out, torch.float32, "cpu", seed=rows * 10 + d)
    assert not args[0].is_contiguous()
    with _cuda.simulated(), poisoned_outputs("a"):
        out = anchor_projection(*args, backend="cuda")
    torch.testing.assert_close(out, anchor_projection_reference(*args), rtol=1e-5, atol=1e-5)


@needs_simt
@pytest.mark.parametrize("name", list(SHARED_TYPES))
# the plan's splits on 3 SMs and on an H200's 132, and many small ones
@pytest.mark.parametrize("k_per,sms", [(None, None), (None, 132), (128, None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_mma_kernel_in_host_emulation(name, k_per, sms, dtype):
    """The tensor-core variant: rows grouped by type (more than 16: two MMA passes; more than a
    scan pass), each type's K cut into splits reduced in order with the bias; the scratch of
    partial sums is poisoned too. D = 200: a split ends inside an anchor's columns."""
    fn = lambda *a: anchor_projection_cuda_mma(*a, k_per=k_per)
    with _cuda.simulated(sms):
        check_shared_types(fn, name, 200, 41, dtype, "cpu")


def test_cuda_mma_plan_cuts_every_type_into_equal_splits():
    for m, d, n_out in ((5, 2560, 2560), (3, 200, 41), (1, 8, 8), (8, 4096, 4096)):
        for want in (None, 1, 100, 5000):
            k_per, items = mma_plan(m, d, n_out, torch.device("cpu"), want)
            assert k_per % 32 == 0 and k_per >= 128
            assert items == sum(-(-(e + 1) * d // k_per) for e in range(m)) <= 65535


@needs_simt
def test_cuda_variant_is_chosen_by_the_environment(monkeypatch):
    args = make_case(5, 9, 64, 48, torch.bfloat16, "cpu", seed=3, types=staircase(8, 5))
    want = oracle(*args)
    calls = []
    import spd_kernels.features as features
    real = features._launch_mma  # the tensor-core kernel's launcher
    monkeypatch.setattr(features, "_launch_mma", lambda *a, **k: calls.append(1) or real(*a, **k))
    for variant, mma_calls in (("ffma", 0), ("mma", 1), (None, 1)):  # None: unset, ffma
        if variant is None:
            monkeypatch.delenv("SPD_ANCHOR_VARIANT")
        else:
            monkeypatch.setenv("SPD_ANCHOR_VARIANT", variant)
        with _cuda.simulated(), poisoned_outputs("a"):
            out = anchor_projection(*args, backend="cuda")
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
        assert len(calls) == mma_calls
    monkeypatch.setenv("SPD_ANCHOR_VARIANT", "tensor")
    with _cuda.simulated(), pytest.raises(SPDInputError, match="SPD_ANCHOR_VARIANT"):
        anchor_projection(*args, backend="cuda")


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("d,d_out", [(576, 576), (2560, 2560), (4096, 4096), (100, 36)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backends_match_reference(backend, d, d_out, dtype):
    gpu_backend("anchor_projection", backend)
    args = make_case(5, 9, d, d_out, dtype, "cuda", seed=d, types=staircase(8, 5))
    ref = oracle(*args)
    tol = 1e-4 if dtype == torch.float32 else torch.finfo(dtype).eps
    fns = {backend: lambda *a: anchor_projection(*a, backend=backend)}
    if backend == "cuda" and dtype != torch.float32 and d % 8 == 0:
        fns["cuda_mma"] = anchor_projection_cuda_mma  # the tensor-core variant
    for name, fn in fns.items():
        with poisoned_outputs("a"):
            out = fn(*args)
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * 10, msg=name)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("name", list(SHARED_TYPES))
# CUDA vector path (D = 1600: full, half and single k steps; 41 outputs: a warp with one) and
# the scalar path (D = 100)
@pytest.mark.parametrize("d,d_out", [(1600, 41), (100, 36)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rows_sharing_types(backend, name, d, d_out, dtype):
    """Rows grouped by type on the device: shared, unsorted, unused and bad types, many rows."""
    gpu_backend("anchor_projection", backend)
    fns = {"triton": {"triton": anchor_projection_triton},
           "cuda": {"cuda": anchor_projection_cuda}}[backend]
    if backend == "cuda" and dtype != torch.float32 and d % 8 == 0:
        fns["cuda_mma"] = anchor_projection_cuda_mma
    for fn in fns.values():
        check_shared_types(fn, name, d, d_out, dtype, "cuda")
