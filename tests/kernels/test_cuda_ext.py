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

from spd_kernels import _cuda, dispatch
from spd_kernels.testing import SIMT_SKIP_REASON

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
    """The same kernel sources compiled for the CPU (csrc/emulation/simt_host.h): the cuda backend's tests
    run on every machine with the toolkit, GPU or not."""
    if os.environ.get("SPD_SKIP_CUDA_BUILD") == "1" or not nvcc_present():
        pytest.skip("no nvcc (or SPD_SKIP_CUDA_BUILD=1): the emulation is not expected")
    with _cuda.simulated() as sim:
        assert sim.host_emulation and sim.device_count() == 1
        assert "cuda" in dispatch.available("verify_greedy", "cpu")
        assert dispatch.select("verify_greedy", torch.device("cpu"))[0] == "reference"  # auto
    assert "cuda" not in dispatch.available("verify_greedy", "cpu")
    assert not _cuda.ext().host_emulation


@pytest.mark.skipif(SIMT_SKIP_REASON is not None, reason=str(SIMT_SKIP_REASON))
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


@pytest.mark.skipif(SIMT_SKIP_REASON is not None, reason=str(SIMT_SKIP_REASON))
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


@pytest.mark.skipif(SIMT_SKIP_REASON is not None, reason=str(SIMT_SKIP_REASON))
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
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_extension_sees_the_device():
    assert _cuda.built(), _cuda.unavailable_reason()
    assert _cuda.ext().device_count() >= 1
    assert "cuda" in dispatch.available("verify_greedy", "cuda")
