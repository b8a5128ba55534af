"""fused_linear / fused_swiglu (the dense part of the PDM step): the Triton kernel and the CUDA
kernel (csrc/kernels/linear.cu, run in the host emulation on CPU) against their reference on fresh random
inputs, outputs and scratch poisoned first, with and without the fused RMSNorm and residual, with
the K dimension split over programs (partial sums reduced by a last launch)."""
import pytest
import torch
from conftest import needs_gpu, needs_simt, needs_triton, needs_triton_interpreter

from spd_kernels import SPDBackendError, SPDInputError, _cuda, dispatch, fused_linear, fused_swiglu
from spd_kernels._triton import dtype_code
from spd_kernels.linear import (
    CUDA_MAX_ROWS,
    MAX_KERNEL_ROWS,
    fused_linear_reference,
    fused_swiglu_reference,
)
from spd_kernels.linear.triton_kernel import launch, plan
from spd_kernels.on_request.linear_cuda import cuda_launch, cuda_plan
from spd_kernels.testing import (
    TRITON_DEVICE,
    poisoned_outputs,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make(R, K, N, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=g) * sc).to(device=device, dtype=dtype)
    return dict(x=r(R, K, sc=2.0), w=r(N, K, sc=K ** -0.5), w2=r(N, K, sc=K ** -0.5),
                g=(torch.rand(K, generator=g) + 0.5).to(device=device, dtype=dtype),
                res=r(R, N))


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else \
        dict(rtol=2 * torch.finfo(dtype).eps, atol=2 * torch.finfo(dtype).eps)


SHAPES = [(1, 48, 40), (9, 100, 70), (5, 256, 300), (16, 33, 17), (17, 64, 129)]


@needs_triton
@pytest.mark.parametrize("R,K,N", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("norm,residual", [(True, False), (False, True), (False, False)])
def test_linear_fp32_matches_reference(R, K, N, split_k, norm, residual):
    a = make(R, K, N, torch.float32, TRITON_DEVICE, seed=R * K + N)
    g = a["g"] if norm else None
    res = a["res"] if residual else None
    want = fused_linear_reference(a["x"], a["w"], g, 1e-6, res)
    with poisoned_outputs("a"):
        got = launch(a["x"], a["w"], None, g, 1e-6, res, split_k=split_k)
    torch.testing.assert_close(got, want, **tol(torch.float32))


@needs_triton
@pytest.mark.parametrize("R,K,N", SHAPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_swiglu_fp32_matches_reference(R, K, N, split_k):
    a = make(R, K, N, torch.float32, TRITON_DEVICE, seed=R + K * N)
    want = fused_swiglu_reference(a["x"], a["g"], 1e-6, a["w"], a["w2"])
    with poisoned_outputs("b"):
        got = launch(a["x"], a["w"], a["w2"], a["g"], 1e-6, split_k=split_k)
    torch.testing.assert_close(got, want, **tol(torch.float32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [1, 2])
def test_half_precision_rounds_like_the_reference(dtype, split_k):
    R, K, N = 9, 160, 96
    a = make(R, K, N, dtype, TRITON_DEVICE, seed=11)
    with poisoned_outputs("a"):
        got = launch(a["x"], a["w"], None, a["g"], 1e-6, a["res"], split_k=split_k)
        got2 = launch(a["x"], a["w"], a["w2"], a["g"], 1e-6, split_k=split_k)
    torch.testing.assert_close(got.float(), fused_linear_reference(
        a["x"], a["w"], a["g"], 1e-6, a["res"]).float(), **tol(dtype))
    torch.testing.assert_close(got2.float(), fused_swiglu_reference(
        a["x"], a["g"], 1e-6, a["w"], a["w2"]).float(), **tol(dtype))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_k", [1, 3])
def test_partial_sums_add_up_to_the_product(dtype, split_k):
    """partial_sums (the product without its reduce launch, for a consumer that sums the splits
    itself): summed in split order and rounded, bit for bit the one-launch product; with one
    split, that product itself."""
    from spd_kernels.linear.triton_kernel import partial_sums
    t = make(5, 384, 70, dtype, TRITON_DEVICE, seed=21)
    with poisoned_outputs("a"):
        want = launch(t["x"], t["w"], None, t["g"], 1e-6, split_k=split_k)
    with poisoned_outputs("b"):
        ws, splits = partial_sums(t["x"], t["w"], t["g"], 1e-6, split_k=split_k)
    assert splits == plan(5, 70, 384, t["x"].device, split_k)[3] and (splits > 1) == (split_k > 1)
    if splits == 1:
        assert torch.equal(ws, want)
    else:
        assert ws.shape == (splits, 5, 70) and ws.dtype == torch.float32
        acc = torch.zeros(5, 70, dtype=torch.float32, device=ws.device)
        for s in range(splits):  # the reduce kernel's order
            acc += ws[s]
        assert torch.equal(acc.to(dtype), want)
    torch.testing.assert_close(want, fused_linear_reference(t["x"], t["w"], t["g"], 1e-6, None),
                               **tol(dtype))


@needs_triton
def test_split_plan_covers_k_exactly():
    """Every K column is summed by exactly one split, whatever split count is asked for."""
    for K in (16, 100, 256, 1000):
        for want in (1, 2, 3, 7, 100):
            _, _, block_k, splits, k_per = plan(4, 64, K, torch.device("cpu"), want)
            assert k_per % block_k == 0 and 1 <= splits <= want
            assert (splits - 1) * k_per < K <= splits * k_per


def test_dispatched_ops_and_checks():
    a = make(3, 32, 24, torch.float32, "cpu", seed=5)
    assert dispatch.select("fused_linear", torch.device("cpu"))[0] == "reference"
    out = fused_linear(a["x"], a["w"], norm_weight=a["g"], residual=a["res"])
    assert torch.equal(out, fused_linear_reference(a["x"], a["w"], a["g"], 1e-6, a["res"]))
    with pytest.raises(SPDInputError, match=r"weight must be \[out, 32\]"):
        fused_linear(a["x"], a["w"].t().contiguous())
    with pytest.raises(SPDInputError, match="residual must be"):
        fused_linear(a["x"], a["w"], residual=a["res"][:, :5])
    with pytest.raises(SPDInputError, match="norm_weight must have shape"):
        fused_swiglu(a["x"], a["g"][:7], 1e-6, a["w"], a["w2"])
    with pytest.raises(SPDInputError, match="one shape"):
        fused_swiglu(a["x"], a["g"], 1e-6, a["w"], a["w2"][:5])
    with pytest.raises(SPDInputError, match="x must"):
        fused_linear(a["x"][0], a["w"])
    torch.library.opcheck(torch.ops.spd.fused_linear.default,
                          (a["x"], a["w"], a["g"], 1e-6, a["res"]))
    torch.library.opcheck(torch.ops.spd.fused_swiglu.default,
                          (a["x"], a["g"], 1e-6, a["w"], a["w2"]))


def test_library_ops_trace_under_torch_compile():
    """An MLP block written with torch.ops.spd.* compiles with fullgraph (the fake
    implementations give the shapes) and computes what the references do."""
    a = make(4, 32, 48, torch.float32, "cpu", seed=9)
    w_down = torch.randn(32, 48) / 48 ** 0.5

    @torch.compile(backend="aot_eager", fullgraph=True)
    def block(x, g, wg, wu, wd):
        mid = torch.ops.spd.fused_swiglu(x, g, 1e-6, wg, wu)
        return torch.ops.spd.fused_linear(mid, wd, None, 1e-6, x) * 2

    got = block(a["x"], a["g"], a["w"], a["w2"], w_down)
    mid = fused_swiglu_reference(a["x"], a["g"], 1e-6, a["w"], a["w2"])
    torch.testing.assert_close(got, fused_linear_reference(mid, w_down, None, 1e-6, a["x"]) * 2)


@needs_triton_interpreter
def test_unsupported_arguments_raise_when_forced_and_fall_back_when_auto():
    big = make(MAX_KERNEL_ROWS + 1, 16, 16, torch.float32, "cpu", seed=2)
    with pytest.raises(SPDBackendError, match=f"at most {MAX_KERNEL_ROWS} rows"):
        fused_linear(big["x"], big["w"], backend="triton")
    a = make(2, 16, 16, torch.float32, "cpu", seed=3)
    with pytest.raises(SPDBackendError, match="dtype"):
        fused_linear(a["x"], a["w"].double(), backend="triton")
    with pytest.raises(SPDBackendError, match="w_gate must be contiguous"):
        fused_swiglu(a["x"], a["g"], 1e-6, a["w"].t().contiguous().t(), a["w2"], backend="triton")
    got = fused_linear(a["x"], a["w"].t().contiguous().t())  # auto: the reference takes it
    torch.testing.assert_close(got, a["x"] @ a["w"].t())


# K a multiple of 8 (the CUDA kernel's 16-byte loads); R past 8 uses the MMA's rows 8..15;
# K = 520 has a last chunk of 8 of 32 columns; N not a multiple of 8 leaves part of a tile.
CUDA_SHAPES = [(1, 48, 40), (9, 104, 70), (5, 256, 300), (16, 32, 17), (12, 520, 129)]


@needs_simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,K,N", CUDA_SHAPES)
@pytest.mark.parametrize("split_k,sms", [(1, None), (3, None), (None, None), (None, 132)])
def test_cuda_kernel_matches_reference_in_emulation(dtype, R, K, N, split_k, sms):
    """Every epilogue (plain, norm + residual, norm + SwiGLU) with one split, three, and the
    plan's own choice, on the emulated device's 3 SMs and on an H200's 132 (a split per chunk of
    K); outputs and scratch (normed rows, partial sums) poisoned."""
    a = make(R, K, N, dtype, "cpu", seed=R * K + N)
    with _cuda.simulated(sms), poisoned_outputs("a"):
        plain = cuda_launch(a["x"], a["w"], split_k=split_k)
        normed = cuda_launch(a["x"], a["w"], None, a["g"], 1e-6, a["res"], split_k=split_k)
        swiglu = cuda_launch(a["x"], a["w"], a["w2"], a["g"], 1e-6, split_k=split_k)
    t = tol(dtype)
    torch.testing.assert_close(plain, fused_linear_reference(a["x"], a["w"], None, 1e-6, None), **t)
    torch.testing.assert_close(normed, fused_linear_reference(a["x"], a["w"], a["g"], 1e-6,
                                                              a["res"]), **t)
    torch.testing.assert_close(swiglu, fused_swiglu_reference(a["x"], a["g"], 1e-6, a["w"],
                                                              a["w2"]), **t)


def test_cuda_plan_covers_k_exactly():
    """Every 32-column chunk of K is summed by exactly one split, for any split count asked."""
    for K in (8, 104, 520, 2560, 9728):
        for want in (None, 1, 2, 3, 7, 1000):
            for N, sets in ((17, 1), (2560, 1), (9728, 2)):
                splits, k_per = cuda_plan(N, K, sets, torch.device("cpu"), want)
                assert k_per % 32 == 0 and splits >= 1
                assert (splits - 1) * k_per < K <= splits * k_per


@needs_simt
def test_cuda_dispatch_on_request_only_and_its_limits():
    """The CUDA kernel runs when asked for (it is not timed on a GPU yet, so the automatic choice
    passes over it), and says why it cannot take an argument instead of reading past one."""
    assert "cuda" in dispatch.describe()["ops"]["fused_linear"]["on_request_only"]
    a = make(3, 64, 40, torch.bfloat16, "cpu", seed=4)
    with _cuda.simulated():
        assert dispatch.select("fused_linear", torch.device("cpu"))[0] == "reference"
        with poisoned_outputs("b"):
            got = fused_linear(a["x"], a["w"], residual=a["res"], backend="cuda")
            got2 = fused_swiglu(a["x"], a["g"], 1e-6, a["w"], a["w2"], backend="cuda")
        torch.testing.assert_close(got, fused_linear_reference(a["x"], a["w"], None, 1e-6,
                                                               a["res"]), **tol(torch.bfloat16))
        torch.testing.assert_close(got2, fused_swiglu_reference(a["x"], a["g"], 1e-6, a["w"],
                                                                a["w2"]), **tol(torch.bfloat16))
        f32 = make(3, 64, 40, torch.float32, "cpu", seed=4)
        big = make(CUDA_MAX_ROWS + 1, 64, 40, torch.bfloat16, "cpu", seed=4)
        odd = make(3, 60, 40, torch.bfloat16, "cpu", seed=4)
        wide = torch.randn(40, 72).to(torch.bfloat16)
        for call, match in (
                (lambda: fused_linear(f32["x"], f32["w"], backend="cuda"), "bf16 / fp16"),
                (lambda: fused_linear(big["x"], big["w"], backend="cuda"), "at most 16 rows"),
                (lambda: fused_linear(odd["x"], odd["w"], backend="cuda"), "multiple of 8"),
                (lambda: fused_linear(a["x"], wide[:, 4:68], backend="cuda"),
                 "weight must be contiguous"),
                (lambda: fused_linear(torch.randn(3, 72).to(torch.bfloat16)[:, 4:68], a["w"],
                                      backend="cuda"), "16-byte boundary"),
                (lambda: fused_swiglu(a["x"], a["g"], 1e-6, a["w"], a["w2"].half(),
                                      backend="cuda"), "x's dtype")):
            with pytest.raises(SPDBackendError, match=match):
                call()


def _mma_selftest(dtype, device):
    """One mma.m16n8k16 with fragments filled element by element from the PTX ISA's layout, on
    small integers (every sum exact): it must equal the matrix product exactly."""
    g = torch.Generator().manual_seed(21)
    a = torch.randint(-4, 5, (16, 16), generator=g).to(device=device, dtype=dtype)
    b = torch.randint(-4, 5, (8, 16), generator=g).to(device=device, dtype=dtype)
    c = torch.full((16, 8), float("nan"), device=device)
    _cuda.ext().mma_selftest(a.data_ptr(), b.data_ptr(), c.data_ptr(), dtype_code(dtype),
                             _cuda.stream_of(a))
    assert torch.equal(c, a.float() @ b.float().T)


@needs_simt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_mma_follows_the_documented_fragment_layout(dtype):
    with _cuda.simulated():
        _mma_selftest(dtype, "cpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mma_follows_the_documented_fragment_layout(dtype):
    """The layout the kernels (and the emulation) assume, against the hardware."""
    if "cuda" not in dispatch.available("fused_linear", "cuda"):
        pytest.skip("the CUDA extension is not built here")
    _mma_selftest(dtype, "cuda")
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("what,K,N", [("o_proj", 4096, 2560), ("gate_up", 2560, 9728),
                                      ("down", 9728, 2560), ("lm_head", 2560, 32768)])
def test_gpu_backends_at_qwen3_4b_pdm_shapes(backend, dtype, what, K, N):
    if backend not in dispatch.available("fused_linear", "cuda"):
        pytest.skip(f"the {backend} backend is not available for CUDA tensors here")
    if backend == "cuda" and dtype == torch.float32:
        pytest.skip("the CUDA kernel is bf16 / fp16 only (tensor cores); fp32 runs on Triton")
    R = 9 if what != "lm_head" else 1
    a = make(R, K, N, dtype, "cuda", seed=N + K)
    t = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    with poisoned_outputs("a"):
        if what == "gate_up":
            got = fused_swiglu(a["x"], a["g"], 1e-6, a["w"], a["w2"], backend=backend)
            want = fused_swiglu_reference(a["x"], a["g"], 1e-6, a["w"], a["w2"])
        else:
            g = a["g"] if what == "lm_head" else None
            res = None if what == "lm_head" else a["res"]
            got = fused_linear(a["x"], a["w"], norm_weight=g, residual=res, backend=backend)
            want = fused_linear_reference(a["x"], a["w"], g, 1e-6, res)
    torch.testing.assert_close(got.float(), want.float(), **t)
    # a CUDA graph of the call replays to the same result (the split workspace is graph memory)
    res = a["res"] if what != "lm_head" else None
    fused_linear(a["x"], a["w"], residual=res, backend=backend)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fused_linear(a["x"], a["w"], residual=res, backend=backend)
    a["x"].copy_(torch.randn_like(a["x"]))
    graph.replay()
    torch.testing.assert_close(replayed.float(),
                               fused_linear_reference(a["x"], a["w"], None, 1e-6, res).float(), **t)
