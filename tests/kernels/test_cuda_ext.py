"""The CUDA C++ extension: built whenever nvcc is there (CI), importable, and on a machine
without a usable GPU every entry point raises a clear RuntimeError instead of crashing. The
package must import and work without the extension."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import needs_gpu, needs_simt

from spd_kernels import _cuda, dispatch

ROOT = Path(__file__).resolve().parents[2]
NO_GPU_MESSAGE = r"no usable CUDA device.*(InsufficientDriver|NoDevice|none found)"


def nvcc_present() -> bool:
    return (shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
            or bool(os.environ.get("CUDA_HOME")))


def test_extension_built_when_nvcc_is_present():
    if os.environ.get("SPD_SKIP_CUDA_BUILD") == "1" or not nvcc_present():
        pytest.skip("no nvcc (or SPD_SKIP_CUDA_BUILD=1): the extension is not expected")
    assert _cuda.built(), _cuda.unavailable_reason()
    ext = _cuda.ext()
    assert ext.runtime_version() >= 12000
    assert ext.verify_greedy_num_blocks(151936) > 0


def test_host_emulation_built_when_nvcc_is_present():
    """The same kernel sources compiled for the CPU (csrc/emulation/): the cuda backend's tests
    run on every machine with the toolkit, GPU or not."""
    if os.environ.get("SPD_SKIP_CUDA_BUILD") == "1" or not nvcc_present():
        pytest.skip("no nvcc (or SPD_SKIP_CUDA_BUILD=1): the emulation is not expected")
    with _cuda.simulated() as sim:
        assert sim.host_emulation and sim.device_count() == 1
        assert "cuda" in dispatch.available("verify_greedy", "cpu")
        assert dispatch.select("verify_greedy", torch.device("cpu"))[0] == "reference"  # auto
    assert "cuda" not in dispatch.available("verify_greedy", "cpu")
    assert not _cuda.ext().host_emulation


@needs_simt
def test_emulated_multiprocessor_count_reaches_both_plans():
    """simulated(multiprocessors=n) sets the SM count the Python launchers plan with and the one
    the kernels' C++ launchers read (set_multiprocessors returns the count it replaces), and
    restores both on exit, nested too."""
    cpu = torch.device("cpu")
    with _cuda.simulated(multiprocessors=132) as sim:
        assert _cuda.multiprocessors(cpu) == 132 and sim.set_multiprocessors(132) == 132
        with _cuda.simulated():
            assert _cuda.multiprocessors(cpu) == _cuda.EMULATED_SMS
            assert sim.set_multiprocessors(_cuda.EMULATED_SMS) == _cuda.EMULATED_SMS
        assert _cuda.multiprocessors(cpu) == 132 and sim.set_multiprocessors(132) == 132
    with _cuda.simulated() as sim:
        assert sim.set_multiprocessors(_cuda.EMULATED_SMS) == _cuda.EMULATED_SMS
    assert _cuda.multiprocessors(cpu) == _cuda.EMULATED_SMS
    with pytest.raises(ValueError, match="multiprocessors"):
        with _cuda.simulated(multiprocessors=0):
            pass


@needs_simt
def test_host_emulation_known_answers_and_deadlock():
    """The emulation is the CPU oracle of the CUDA kernels, so it is checked itself: warp
    shuffles, ballot, match, reduce and a block barrier on 64 threads against their CUDA
    definitions, and a barrier half a warp never reaches reported instead of hanging."""
    with _cuda.simulated() as sim:
        out = torch.full((64 * 9,), -1, dtype=torch.int32)
        sim.selftest(0, out.data_ptr())
        got = out.view(64, 9).tolist()
        for t in range(64):
            lane, base = t % 32, t - t % 32
            peers = [base + i for i in range(32) if i % 4 == lane % 4]
            want = [base + (lane ^ 5), t - 3 if lane >= 3 else t, t + 3 if lane < 29 else t,
                    base + 7, sum(1 << i for i in range(0, 32, 3)),
                    sum(1 << (p - base) for p in peers), sum(peers), (63 - t) ** 2, 64]
            want = [w - (1 << 32) if w >= 1 << 31 else w for w in want]  # as int32
            assert got[t] == want, (t, got[t], want)
        with pytest.raises(RuntimeError, match="cudaErrorLaunchFailure.*deadlock"):
            sim.selftest(1, out.data_ptr())
        sim.selftest(0, out.data_ptr())  # usable after a deadlock


@needs_simt
def test_host_emulation_reports_a_thread_that_skips_pdl_wait():
    """Every kernel may be launched programmatically on a GPU (SPD_PDL=1), where touching memory
    before pdl_wait() races with the kernel before it. The emulation fails any launch in which a
    thread ends without reaching pdl_wait(), so every emulated kernel test also checks that."""
    with _cuda.simulated() as sim:
        out = torch.full((64,), -1, dtype=torch.int32)
        with pytest.raises(RuntimeError, match="cudaErrorNotPermitted.*pdl_wait"):
            sim.selftest(2, out.data_ptr())
        assert (out == 2).all()  # the threads ran; only the missing wait is reported
        full = torch.zeros(64 * 9, dtype=torch.int32)  # kept alive: the call takes its address
        sim.selftest(0, full.data_ptr())  # usable after it


def test_programmatic_launch_switch():
    """SPD_PDL=1 turns programmatic dependent launch on, a bad value is refused by name (an
    SPDInputError, so the CLI exits 2 with the message), the context manager restores the
    previous setting, and the extension (when built) follows the switch."""
    code = ("from spd_kernels import _cuda\n"
            "print('ON', _cuda.programmatic_launch_enabled())\n"
            "with _cuda.programmatic_launch(False):\n"
            "    print('INSIDE', _cuda.programmatic_launch_enabled())\n"
            "print('AFTER', _cuda.programmatic_launch_enabled())\n")
    for value, on in (("1", True), ("0", False), ("on", True)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "SPD_PDL": value}, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["ON", str(on), "INSIDE", "False", "AFTER", str(on)]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SPD_PDL": "yes please"}, timeout=120)
    assert out.returncode != 0 and "SPDInputError: SPD_PDL='yes please'" in out.stderr
    was = _cuda.programmatic_launch_enabled()
    ext = _cuda.load()
    with _cuda.programmatic_launch():
        assert _cuda.programmatic_launch_enabled()
        assert dispatch.describe()["programmatic_launch"]
        assert ext is None or ext.programmatic_launch()
        with _cuda.programmatic_launch(False):
            assert ext is None or not ext.programmatic_launch()
        assert ext is None or ext.programmatic_launch()
    assert _cuda.programmatic_launch_enabled() == was
    assert ext is None or ext.programmatic_launch() == was


def run_python(code: str) -> subprocess.CompletedProcess:
    """code in a fresh interpreter (a module hidden there stays hidden from this process)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=120)


def test_simulated_without_the_emulation_says_why():
    code = ("import sys; sys.modules['spd_kernels._spd_simt'] = None\n"
            "from spd_kernels import _cuda\n"
            "try:\n"
            "    with _cuda.simulated(): pass\n"
            "except ImportError as e:\n"
            "    print('ERR', e)\n")
    out = run_python(code)
    assert "ERR spd_kernels._spd_simt is not built" in out.stdout, out.stderr


def test_simt_library_override_that_cannot_load_says_so(tmp_path, monkeypatch):
    bogus = tmp_path / "_spd_simt.so"
    bogus.write_text("not a shared object")
    for path in (tmp_path / "missing.so", bogus):
        monkeypatch.setenv("SPD_SIMT_LIBRARY", str(path))
        out = run_python("from spd_kernels import _cuda\n"
                         "try:\n"
                         "    with _cuda.simulated(): pass\n"
                         "except ImportError as e:\n"
                         "    print('ERR', e)\n")
        assert f"ERR SPD_SIMT_LIBRARY={path} could not be loaded" in out.stdout, out.stderr


HOST_ONLY = {"anchor_projection_items", "runtime_version", "verify_greedy_num_blocks",
             "host_emulation", "programmatic_launch", "set_programmatic_launch"}
# arithmetic on the host, a constant or a host-side setting: no device needed


def _zero_args(fn):
    """Zeros for every parameter of a pybind11 function, read from its signature line."""
    sig = fn.__doc__.splitlines()[0]
    params = re.findall(r"(\w+): ([^,]+)", sig[sig.index("(") + 1:sig.rindex(")")])
    return [False if kind.strip() == "bool" else 0.0 if "Float" in kind else 0
            for _, kind in params]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_calls_without_gpu_raise_clear_errors():
    """Every entry point that touches the device says so before any launch (null pointers: a
    launch would crash), the ones added later included."""
    if not _cuda.built():
        pytest.skip("extension not built")
    ext = _cuda.ext()
    names = [n for n in dir(ext) if not n.startswith("_") and n not in HOST_ONLY]
    assert {"device_count", "verify_greedy", "cache_attention", "fused_linear"} <= set(names)
    for name in names:
        with pytest.raises(RuntimeError, match=NO_GPU_MESSAGE):
            getattr(ext, name)(*_zero_args(getattr(ext, name)))


def test_package_works_without_the_extension():
    code = (
        "import sys; sys.modules['spd_kernels._spd_cuda'] = None\n"
        "import torch, spd_kernels\n"
        "from spd_kernels import _cuda, dispatch, verify_greedy\n"
        "assert not _cuda.built()\n"
        "print('REASON', _cuda.unavailable_reason())\n"
        "print('CUDA_AVAILABLE', dispatch.available('verify_greedy', 'cuda'))\n"
        "t, ok = verify_greedy(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(5, 8),"
        " torch.tensor([0, 1]))\n"
        "print('OK', t.shape)\n")
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert "REASON the CUDA extension spd_kernels._spd_cuda is not built" in out.stdout
    assert "CUDA_AVAILABLE ['triton', 'reference']" in out.stdout or \
        "CUDA_AVAILABLE ['reference']" in out.stdout
    assert "OK torch.Size([2])" in out.stdout


def test_setup_skips_the_build_with_a_message():
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "SPD_SKIP_CUDA_BUILD": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "SPD_SKIP_CUDA_BUILD=1: not building the CUDA extension" in out.stderr


def test_cuda_backend_refuses_cpu_tensors():
    from spd_kernels import SPDBackendError
    with pytest.raises(SPDBackendError, match="need CUDA tensors"):
        dispatch.select("anchor_projection", torch.device("cpu"), backend="cuda")


@pytest.mark.gpu
@needs_gpu
def test_gpu_extension_sees_the_device():
    assert _cuda.built(), _cuda.unavailable_reason()
    assert _cuda.ext().device_count() >= 1
    assert "cuda" in dispatch.available("verify_greedy", "cuda")


# --- the launch wrappers check what they are handed (csrc/bindings/checks.h) ---------------------
# Each binding gets valid arguments but one: a stride, dimension or dtype code that would make the
# kernel read or write out of bounds. The wrapper must refuse it before the launch, with a
# ValueError naming the binding, the argument, and the expected against the given value. The
# addresses are never dereferenced (the check comes first), so one small buffer stands for all.

def _valid_calls(p):
    """binding name -> keyword arguments of a valid call; p is an address."""
    bf16, f32 = 1, 0
    return {
        "verify_greedy": dict(hidden=p, stride_h=64, norm_weight=p, weight=p, stride_w=64,
                              draft=p, draft_i64=True, pval=p, pidx=p, target=p, accepted=p,
                              R=2, D=64, V=40, eps=1e-6, norm_offset=0.0, dtype=f32, stream=0),
        "rejection_sample": dict(x=p, stride_x=40, x_dtype=f32, q=p, stride_q=40, q_dtype=f32,
                                 t2d=0, tok=p, tok_i64=True, u=p, stride_u=2, seed=0, offset=0,
                                 out_tok=p, out_acc=p, R=2, V=40, temperature=1.0, top_k=0,
                                 top_p=1.0, from_logits=True, stream=0),
        "fused_linear": dict(x=p, stride_x=64, norm_weight=0, xn=0, w0=p, w1=0, residual=0,
                             stride_res=0, out=p, stride_out=32, ws=0, R=2, N=32, K=64,
                             splits=1, k_per=64, eps=1e-6, dtype=bf16, stream=0),
        "rope_append": dict(qp=p, stride_qp=4 * 64, kp=p, stride_kp=2 * 64, vp=p,
                            stride_vp=2 * 64, q_norm=0, k_norm=0, cos=p, sin=p, stride_cs=64,
                            start=p, q_out=p, k_cache=p, v_cache=p, rows=2, H=4, KVH=2, S=8,
                            P=8, HD=64, eps=1e-6, dtype=bf16, stream=0),
        "cache_attention": dict(q=p, stride_qh=2 * 64, stride_qr=64, k=p, v=p,
                                stride_ch=8 * 64, stride_cs=64, start=p, out=p,
                                stride_or=4 * 64, ws=0, H=4, R=2, KVH=2, S=8, HD=64, splits=1,
                                chunk=32, scale_log2=0.18, dtype=bf16, stream=0),
        "kv_truncate": dict(lengths=p, new_lengths=p, new_stride=1, C=2, stream=0),
        "kv_poison": dict(lengths=p, new_lengths=p, new_stride=1, table=p, n_buffers=1, C=2,
                          outer=1, S=8, inner=4, dtype=bf16, stream=0),
        "anchor_projection": dict(anchors=p, stride_am=2 * 16, stride_ar=16, types=p,
                                  types_i64=True, table=p, out=p, stride_or=8, M=2, R=2, D=16,
                                  N=8, dtype=f32, vectorized=False, stream=0),
        "anchor_projection_mma": dict(anchors=p, stride_am=2 * 64, stride_ar=64, types=p,
                                      types_i64=True, table=p, out=p, stride_or=8, ws=p, M=2,
                                      R=2, D=64, N=8, k_per=64, dtype=bf16, stream=0),
        "mma_selftest": dict(a=p, b=p, c=p, dtype=bf16, stream=0),
    }


# (binding, argument, bad value, what the message must say)
BAD_ARGUMENTS = [
    ("verify_greedy", "stride_h", 32, r"stride_h: expected >= 64 \(D.*got 32"),
    ("verify_greedy", "stride_w", 63, r"stride_w: expected >= 64 \(D.*got 63"),
    ("verify_greedy", "D", 0, r"D: expected >= 1.*got 0"),
    ("verify_greedy", "dtype", 7, r"dtype: expected a dtype code in \[0, 2\].*got 7"),
    ("verify_greedy", "pval", 0, r"pval: expected a buffer address, got null"),
    ("rejection_sample", "stride_x", 39, r"stride_x: expected >= 40 \(V.*got 39"),
    ("rejection_sample", "stride_u", 1, r"stride_u: expected >= 2.*got 1"),
    ("rejection_sample", "q_dtype", 3, r"q_dtype: expected a dtype code.*got 3"),
    ("rejection_sample", "u", 0, r"seed, offset: expected both buffers when u is null"),
    ("fused_linear", "stride_x", 48, r"stride_x: expected >= 64 \(K.*got 48"),
    ("fused_linear", "stride_out", 16, r"stride_out: expected >= 32 \(N.*got 16"),
    ("fused_linear", "R", 17, r"R: expected at most 16 rows, got 17"),
    ("fused_linear", "K", 60, r"K: expected a positive multiple of 8, got 60"),
    ("fused_linear", "splits", 2, r"splits: expected .*k_per=64.*K=64.*got 2"),
    ("fused_linear", "k_per", 48, r"k_per: expected a positive multiple of 32.*got 48"),
    ("fused_linear", "dtype", 0, r"dtype: expected a dtype code in \[1, 2\].*got 0"),
    ("fused_linear", "norm_weight", 1, r"xn: expected a buffer for the normed rows"),
    ("rope_append", "stride_qp", 3 * 64, r"stride_qp: expected >= 256 \(H \* HD.*got 192"),
    ("rope_append", "stride_kp", 64, r"stride_kp: expected >= 128 \(KVH \* HD.*got 64"),
    ("rope_append", "stride_cs", 32, r"stride_cs: expected >= 64 \(HD.*got 32"),
    ("rope_append", "HD", 300, r"HD: expected an even head size of at most 256, got 300"),
    ("rope_append", "q_norm", 1, r"q_norm, k_norm: expected both or neither"),
    ("cache_attention", "stride_qr", 32, r"stride_qr: expected >= 64 \(HD.*got 32"),
    ("cache_attention", "stride_cs", 0, r"stride_cs: expected >= 64 \(HD.*got 0"),
    ("cache_attention", "stride_or", 64, r"stride_or: expected >= 256 \(H \* HD.*got 64"),
    ("cache_attention", "H", 3, r"H: expected a multiple of KVH=2, got 3"),
    ("cache_attention", "HD", 96, r"HD: expected 64 or 128, got 96"),
    ("cache_attention", "splits", 2, r"splits: expected .*chunk=32.*S=8.*got 2"),
    ("kv_truncate", "new_stride", 2, r"new_stride: expected 1 .* or 0 .*got 2"),
    ("kv_poison", "n_buffers", 0, r"n_buffers: expected >= 1.*got 0"),
    ("kv_poison", "inner", 0, r"outer, S, inner: expected a positive layout, got 1, 8, 0"),
    ("kv_poison", "dtype", -1, r"dtype: expected a dtype code in \[0, 2\].*got -1"),
    ("anchor_projection", "stride_ar", 8, r"stride_ar: expected >= 16 \(D.*got 8"),
    ("anchor_projection", "stride_or", 4, r"stride_or: expected >= 8 \(N.*got 4"),
    ("anchor_projection", "M", 0, r"M: expected >= 1.*got 0"),
    ("anchor_projection_mma", "D", 60, r"D: expected a multiple of 8.*got 60"),
    ("anchor_projection_mma", "stride_am", 32, r"stride_am: expected >= 64 \(D.*got 32"),
    ("anchor_projection_mma", "k_per", 40, r"k_per: expected a positive multiple of 32.*got 40"),
    ("anchor_projection_mma", "ws", 0, r"ws: expected a buffer address, got null"),
    ("mma_selftest", "dtype", 0, r"dtype: expected a dtype code in \[1, 2\].*got 0"),
]


@needs_simt
def test_every_binding_is_covered_by_the_argument_checks():
    with _cuda.simulated() as sim:
        launched = {n for n in dir(sim) if not n.startswith("_")} - HOST_ONLY - {
            "device_count", "selftest", "set_multiprocessors"}
    assert launched == set(_valid_calls(0)) == {b for b, *_ in BAD_ARGUMENTS}


@needs_simt
@pytest.mark.parametrize("binding,arg,bad,message", BAD_ARGUMENTS,
                         ids=[f"{b}-{a}" for b, a, *_ in BAD_ARGUMENTS])
def test_binding_refuses_a_bad_argument_by_name(binding, arg, bad, message):
    buf = torch.zeros(16, dtype=torch.int64)  # kept alive; never read (the check comes first)
    kwargs = _valid_calls(buf.data_ptr())[binding]
    assert arg in kwargs
    kwargs[arg] = bad
    with _cuda.simulated() as sim:
        with pytest.raises(ValueError, match=rf"spd_kernels\._spd_simt\.{binding}: {message}"):
            getattr(sim, binding)(**kwargs)


@needs_simt
def test_kv_truncate_refuses_buffers_smaller_than_C():
    """Given the element counts (as kv_cache.py passes them), a C past the end of lengths or
    new_lengths is refused by name; the valid call still truncates."""
    lengths = torch.full((4,), 9, dtype=torch.int64)
    new = torch.tensor([3, 12, -1, 5], dtype=torch.int64)
    with _cuda.simulated() as sim:
        with pytest.raises(ValueError, match=r"kv_truncate: lengths: expected at least C=5 int64 "
                                             r"elements, got 4"):
            sim.kv_truncate(lengths.data_ptr(), new.data_ptr(), 1, 5, 0, lengths_numel=4,
                            new_lengths_numel=8)
        with pytest.raises(ValueError, match=r"kv_truncate: new_lengths: expected at least 4 "
                                             r"int64 elements, got 3"):
            sim.kv_truncate(lengths.data_ptr(), new.data_ptr(), 1, 4, 0, lengths_numel=4,
                            new_lengths_numel=3)
        sim.kv_truncate(lengths.data_ptr(), new.data_ptr(), 1, 4, 0, lengths_numel=4,
                        new_lengths_numel=4)
    assert lengths.tolist() == [3, 9, 0, 5]


@needs_simt
def test_checks_pass_empty_launches_through():
    """No rows launch nothing, so their other sizes are not checked (unchanged behaviour)."""
    with _cuda.simulated() as sim:
        sim.verify_greedy(**{**_valid_calls(0)["verify_greedy"], "R": 0, "stride_h": 0})
        sim.kv_truncate(**{**_valid_calls(0)["kv_truncate"], "C": 0, "new_stride": 5})
