"""The CUDA-context guard (tests/cuda_guard.py), with the fault simulated: a fake probe reports
the context lost once an inner test has set FAKE_CUDA_FAULT."""
from __future__ import annotations

import os

from cuda_guard import WORKER_EXIT_CODE, CudaContextGuard

from spd_kernels.testing import cuda_context_error

pytest_plugins = ("pytester",)

INNER = """
import os

def test_a():
    pass

def test_b_faults():
    os.environ["FAKE_CUDA_FAULT"] = "AcceleratorError: CUDA error: an illegal memory access"

def test_c():
    pass
"""


def _guard(exits=None):
    return CudaContextGuard(probe=lambda: os.environ.get("FAKE_CUDA_FAULT"),
                            exit_worker=(exits.append if exits is not None else None))


def test_faulting_test_fails_and_the_session_stops(pytester, monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_FAULT", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[_guard()])
    monkeypatch.delenv("FAKE_CUDA_FAULT", raising=False)
    # test_b's body passed, its teardown names the fault; test_c never runs in the lost context
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_b_faults*",
        "*this test left the CUDA context unusable: AcceleratorError: CUDA error: an illegal*",
        "*CUDA context lost in test_inner.py::test_b_faults*no later test can run*"])


def test_xdist_worker_exits_after_the_faulting_test(pytester, monkeypatch):
    monkeypatch.delenv("FAKE_CUDA_FAULT", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    pytester.makepyfile(test_inner=INNER)
    exits = []
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[_guard(exits)])
    monkeypatch.delenv("FAKE_CUDA_FAULT", raising=False)
    assert exits == [WORKER_EXIT_CODE]  # once, right after test_b: xdist blames the running test
    result.assert_outcomes(passed=2, errors=1)
    result.stderr.fnmatch_lines(["*CUDA context lost in test_inner.py::test_b_faults*"
                                 "exiting so that pytest-xdist starts a fresh worker*"])


def test_healthy_context_changes_nothing(pytester, monkeypatch):
    monkeypatch.setenv("FAKE_CUDA_FAULT", "")  # empty: the probe finds nothing wrong
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    pytester.makepyfile(test_inner="def test_a():\n    pass\n\ndef test_c():\n    pass\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider",
                                          plugins=[CudaContextGuard(probe=lambda: None)])
    result.assert_outcomes(passed=2)


def test_probe_never_initialises_cuda():
    # on a machine without a GPU (or before any CUDA call) there is nothing to lose
    import torch
    initialised = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert cuda_context_error() is None
    assert (torch.cuda.is_available() and torch.cuda.is_initialized()) == initialised
