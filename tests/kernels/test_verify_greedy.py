"""Greedy verification kernels (fused RMSNorm + LM-head GEMV + argmax + compare) vs the reference.

The Triton kernel runs in the interpreter on CPU (TRITON_INTERPRET=1, set by conftest) or compiled
on a GPU; the CUDA kernel on a GPU (tests marked `gpu`) and, on CPU tensors, in its host emulation
(`_cuda.simulated()`, the same csrc/kernels/verify.cu compiled with csrc/emulation/simt_host.h).
fp32 must match exactly; in bf16 / fp16 the kernel rounds like the reference, and any
disagreement must be a near-tie of the reference logits (fp32 accumulation order differs).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import GPU_BACKENDS, gpu_backend, needs_gpu, needs_simt, needs_triton

from spd_kernels import SPDBackendError, SPDInputError, _cuda, dispatch, verify_greedy
from spd_kernels.testing import (
    TRITON_DEVICE,
    poisoned_outputs,
)
from spd_kernels.verify import final_logits, verify_greedy_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_inputs(R, D, V, dtype, device, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, D + (5 if strided else 0), generator=g) * 2
    norm = torch.rand(D, generator=g) + 0.5
    head = torch.randn(V, D, generator=g) / D ** 0.5
    cast = lambda t: t.to(device=device, dtype=dtype)
    hidden, norm, head = cast(hidden), cast(norm), cast(head)
    if strided:  # sliced after the move (.to would copy it contiguous)
        hidden = hidden[:, 2:D + 2]  # row stride D + 5: the kernel must use the stride
    ref = final_logits(hidden, norm, 1e-6, head).argmax(-1)
    drafts = torch.randint(0, V, (R,), generator=g).to(device)
    drafts[::2] = ref[::2]  # half the rows carry the right draft
    return hidden, norm, head, drafts


def check_against_reference(hidden, norm, head, drafts, backend, exact):
    ref_t, ref_ok = verify_greedy_reference(hidden, norm, 1e-6, head, drafts)
    for mode in ("a", "b"):
        with poisoned_outputs(mode):
            t, ok = verify_greedy(hidden, norm, 1e-6, head, drafts, backend=backend)
        assert t.dtype == torch.int64 and ok.dtype == torch.bool
        if exact:
            assert torch.equal(t, ref_t), (t, ref_t)
            assert torch.equal(ok, ref_ok)
        else:
            logits = final_logits(hidden, norm, 1e-6, head).float()
            best = logits.max(-1).values
            got = logits.gather(1, t[:, None].clamp(0, head.shape[0] - 1))[:, 0]
            ulp = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-6))) - 7)
            assert ((t >= 0) & (t < head.shape[0])).all()
            assert (got >= best - ulp).all(), "kernel argmax is not a near-tie of the reference"
            assert torch.equal(ok, t == drafts.long())
            assert (t == ref_t).float().mean() >= 0.5


SHAPES = [(1, 32, 100), (3, 45, 257), (5, 64, 300), (17, 24, 50), (2, 7, 33), (4, 128, 1000),
          (6, 96, 131)]


@needs_triton
@pytest.mark.parametrize("R,D,V", SHAPES)
def test_triton_fp32_exact(R, D, V):
    args = make_inputs(R, D, V, torch.float32, TRITON_DEVICE, seed=R * 1000 + D)
    check_against_reference(*args, backend="triton", exact=True)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("R,D,V", [(1, 64, 500), (5, 40, 333)])
def test_triton_half_precision(R, D, V, dtype):
    args = make_inputs(R, D, V, dtype, TRITON_DEVICE, seed=V)
    check_against_reference(*args, backend="triton", exact=False)


@needs_triton
def test_triton_strided_hidden_and_int32_drafts():
    hidden, norm, head, drafts = make_inputs(3, 40, 90, torch.float32, TRITON_DEVICE, seed=7,
                                             strided=True)
    assert not hidden.is_contiguous()
    check_against_reference(hidden, norm, head, drafts.int(), backend="triton", exact=True)
    spaced = torch.stack([drafts, drafts], 1).reshape(-1)[::2]  # a strided draft-token view
    assert spaced.stride(0) == 2
    check_against_reference(hidden, norm, head, spaced, backend="triton", exact=True)


def tied_case():
    """Duplicate LM-head rows give exactly tied logits; the reference argmax is the lowest id."""
    g = torch.Generator().manual_seed(3)
    D, V = 16, 200
    head = torch.randn(V, D, generator=g)
    hidden = torch.randn(4, D, generator=g)
    norm = torch.ones(D)
    ref = final_logits(hidden, norm, 1e-6, head).argmax(-1)
    for r, winner in enumerate(ref.tolist()):
        for dup in (winner + 67, winner + 131):  # copies in other vocabulary blocks, later ids
            head[dup % V] = head[winner]
    ref = final_logits(hidden, norm, 1e-6, head).argmax(-1)
    return hidden, norm, head, ref


@needs_triton
def test_triton_ties_go_to_lowest_id():
    hidden, norm, head, ref = (t.to(TRITON_DEVICE) for t in tied_case())
    t, ok = verify_greedy(hidden, norm, 1e-6, head, ref, backend="triton")
    assert torch.equal(t, ref) and ok.all()


@needs_triton
def test_triton_empty_batch():
    hidden = torch.randn(0, 8, device=TRITON_DEVICE)
    t, ok = verify_greedy(hidden, torch.ones(8, device=TRITON_DEVICE), 1e-6,
                          torch.randn(10, 8, device=TRITON_DEVICE),
                          torch.zeros(0, dtype=torch.int64, device=TRITON_DEVICE), backend="triton")
    assert t.shape == (0,) and ok.shape == (0,)


def _nan_cases():
    """(name, hidden, norm, head): logits with NaN and infinities across several vocab blocks."""
    g = torch.Generator().manual_seed(11)
    D, V = 24, 300
    hidden = torch.rand(3, D, generator=g) + 0.1          # positive: signs of sums are known
    norm = torch.rand(D, generator=g) + 0.5
    head = torch.randn(V, D, generator=g)
    two_nans = head.clone()
    two_nans[250, 3] = two_nans[150, 7] = float("nan")
    nan_row = hidden.clone()
    nan_row[1, 5] = float("nan")                             # row 1: every logit NaN
    all_neg_inf = torch.full((V, D), float("-inf"))
    inf_and_nan = head.clone()
    inf_and_nan[0] = float("inf")
    inf_and_nan[200, 0] = float("nan")
    return [("two NaN ids", hidden, norm, two_nans), ("a NaN hidden row", nan_row, norm, head),
            ("every logit -inf", hidden, norm, all_neg_inf),
            ("+inf and NaN", hidden, norm, inf_and_nan)]


def _cpu_backends():
    out = [("reference", None)]
    if TRITON_DEVICE == "cpu" and "triton" in dispatch.available("verify_greedy", "cpu"):
        out.append(("triton", None))
    if _cuda.simt_unavailable_reason() is None:
        out.append(("cuda", _cuda.simulated))
    return out


@pytest.mark.parametrize("name,hidden,norm,head", _nan_cases(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_nan_and_inf_logits_follow_torch_argmax_on_every_backend(name, hidden, norm, head):
    """NaN ranks above every number, ties to the lowest id: an id in [0, V) always."""
    want = final_logits(hidden, norm, 1e-6, head).argmax(-1)
    expected = {"two NaN ids": [150] * 3, "a NaN hidden row": None, "every logit -inf": [0] * 3,
                "+inf and NaN": [200] * 3}[name]
    if expected is not None:
        assert want.tolist() == expected
    else:
        assert want[1] == 0
    drafts = want.clone()
    for backend, ctx in _cpu_backends():
        with ctx() if ctx else torch.no_grad():
            t, ok = verify_greedy(hidden, norm, 1e-6, head, drafts, backend=backend)
        assert t.tolist() == want.tolist(), (backend, t.tolist())
        assert ok.all(), backend


def test_empty_vocabulary_or_hidden_size_is_refused():
    with pytest.raises(SPDInputError, match="vocabulary 0"):
        verify_greedy(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(0, 8),
                      torch.zeros(2, dtype=torch.int64))
    with pytest.raises(SPDInputError, match="hidden size 0"):
        verify_greedy(torch.randn(2, 0), torch.ones(0), 1e-6, torch.randn(5, 0),
                      torch.zeros(2, dtype=torch.int64))


def test_cpu_default_is_reference_and_checks():
    assert dispatch.select("verify_greedy", torch.device("cpu"))[0] == "reference"
    h, w, head = torch.randn(2, 8), torch.ones(8), torch.randn(10, 8)
    with pytest.raises(SPDInputError, match="hidden size mismatch"):
        verify_greedy(h, w, 1e-6, torch.randn(10, 4), torch.tensor([0, 1]))
    with pytest.raises(SPDInputError, match="int32 or int64"):
        verify_greedy(h, w, 1e-6, head, torch.tensor([0.0, 1.0]))
    with pytest.raises(SPDInputError, match="dtype"):
        verify_greedy(h, w, 1e-6, head.double(), torch.tensor([0, 1]))
    with pytest.raises(SPDInputError, match="2 rows"):
        verify_greedy(h, w, 1e-6, head, torch.tensor([0, 1, 2]))
    with pytest.raises(SPDBackendError, match="CUDA tensors"):
        verify_greedy(h, w, 1e-6, head, torch.tensor([0, 1]), backend="cuda")


def test_library_op_and_fake():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(3, 16, generator=g), torch.rand(16, generator=g) + 0.5, 1e-6,
            torch.randn(40, 16, generator=g), torch.tensor([1, 2, 3]))
    torch.library.opcheck(torch.ops.spd.verify_greedy.default, args)
    t, ok = torch.ops.spd.verify_greedy(*args)
    assert torch.equal(t, verify_greedy_reference(*args)[0])

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(h, w, head, d):
        t, ok = torch.ops.spd.verify_greedy(h, w, 1e-6, head, d)
        return t + 1, ok
    t2, _ = step(args[0], args[1], args[3], args[4])
    assert torch.equal(t2, t + 1)


# --- CUDA kernel in the host emulation (CPU) --------------------------------------------------------
# Small shapes: every CUDA thread is a fiber. (17, 24, 50) takes three row tiles of 8; D = 45 and
# 7 take the scalar path, the others the 16-byte vector path.

@needs_simt
@pytest.mark.parametrize("R,D,V", [(1, 32, 100), (3, 45, 257), (17, 24, 50), (2, 7, 33),
                                   (6, 96, 131)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_kernel_in_host_emulation(R, D, V, dtype):
    args = make_inputs(R, D, V, dtype, "cpu", seed=R * 1000 + D)
    with _cuda.simulated():
        check_against_reference(*args, backend="cuda", exact=dtype == torch.float32)


@needs_simt
@pytest.mark.parametrize("R,D,V", [(1, 32, 100), (3, 45, 257), (6, 96, 131)])
def test_cuda_kernel_with_an_h200_sized_grid(R, D, V):
    """The persistent grid as sized on an H200's 132 SMs: far more blocks than vocabulary rows,
    most of them with nothing to do."""
    args = make_inputs(R, D, V, torch.bfloat16, "cpu", seed=R * 1000 + D + 1)
    with _cuda.simulated(multiprocessors=132):
        check_against_reference(*args, backend="cuda", exact=False)


@needs_simt
def test_cuda_kernel_in_host_emulation_strides_ties_and_empty():
    hidden, norm, head, drafts = make_inputs(3, 40, 90, torch.float32, "cpu", seed=7, strided=True)
    spaced = torch.stack([drafts, drafts], 1).reshape(-1)[::2]
    th, tn, tw, tref = tied_case()
    with _cuda.simulated():
        check_against_reference(hidden, norm, head, drafts.int(), backend="cuda", exact=True)
        check_against_reference(hidden, norm, head, spaced, backend="cuda", exact=True)
        t, ok = verify_greedy(th, tn, 1e-6, tw, tref, backend="cuda")
        assert torch.equal(t, tref) and ok.all()
        t, ok = verify_greedy(hidden[:0], norm, 1e-6, head, drafts[:0], backend="cuda")
        assert t.shape == (0,) and ok.shape == (0,)


@needs_simt
def test_cuda_launcher_hands_the_callers_tensors_and_its_own_buffers_as_addresses(monkeypatch):
    """The binding checks dtype, device and bytes of every tensor handed to it, which costs host
    time on each call: the caller's inputs go as tensors (checked), the four buffers the launcher
    sizes itself as addresses (null and alignment still checked), and the result is unchanged."""
    hidden, norm, head, drafts = make_inputs(2, 32, 70, torch.bfloat16, "cpu", seed=11)
    with _cuda.simulated() as sim:
        seen = {}

        class Recorder:
            def __getattr__(self, name):
                return getattr(sim, name)

            def verify_greedy(self, *args):
                seen["args"] = args
                return sim.verify_greedy(*args)

        monkeypatch.setattr(_cuda, "ext", lambda: Recorder())
        check_against_reference(hidden, norm, head, drafts, backend="cuda", exact=False)
    args = seen["args"]
    assert [type(args[i]) for i in (0, 2, 3, 5)] == [torch.Tensor] * 4  # hidden, norm, head, draft
    assert all(isinstance(args[i], int) and args[i] != 0 for i in (7, 8, 9, 10))  # pval..accepted


@needs_simt
@pytest.mark.parametrize("variant", ["1", "2"])
def test_cuda_kernel_load_shapes_in_host_emulation(variant):
    """SPD_VERIFY_VARIANT is read once per process: the other two load shapes in a subprocess."""
    code = ("import torch, sys; sys.path[:0] = ['tests', 'tests/kernels']\n"
            "from test_verify_greedy import make_inputs, check_against_reference\n"
            "from spd_kernels import _cuda\n"
            "for R, D, V in [(1, 64, 100), (9, 32, 77)]:\n"
            "    for dt in (torch.float32, torch.bfloat16):\n"
            "        args = make_inputs(R, D, V, dt, 'cpu', seed=R + D)\n"
            "        with _cuda.simulated():\n"
            "            check_against_reference(*args, backend='cuda', exact=dt == torch.float32)\n"
            "print('OK')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=300,
                         env={**os.environ, "SPD_VERIFY_VARIANT": variant})
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("R,D,V", [(1, 576, 49152), (1, 2560, 151936), (3, 2560, 151936),
                                   (9, 4096, 151936), (2, 100, 1001)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_backends_match_reference(backend, R, D, V, dtype):
    gpu_backend("verify_greedy", backend)
    args = make_inputs(R, D, V, dtype, "cuda", seed=R + D)
    check_against_reference(*args, backend=backend, exact=False)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_cuda_graph_replay(backend):
    gpu_backend("verify_greedy", backend)
    hidden, norm, head, drafts = make_inputs(1, 2560, 151936, torch.bfloat16, "cuda", seed=5)
    verify_greedy(hidden, norm, 1e-6, head, drafts, backend=backend)  # warm up / compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t, ok = verify_greedy(hidden, norm, 1e-6, head, drafts, backend=backend)
    for seed in range(3):
        hidden.copy_(torch.randn_like(hidden) * 2)
        graph.replay()
        ref, _ = verify_greedy_reference(hidden, norm, 1e-6, head, drafts)
        torch.cuda.synchronize()
        assert torch.equal(t, ref)
