"""A pytest plugin for runs on a GPU: a test that faults a kernel must not fail every later one.

A kernel fault is sticky (`spd_kernels.testing.cuda_context_error`): after it every CUDA call of
the process fails with the same message, so every later GPU test of that process fails too and
the report no longer says which test did it. With this plugin the test that left the context
unusable fails at teardown, naming the fault, and no later test runs in that context: under
pytest-xdist the worker exits, so xdist reports the crash against that test and starts a fresh
worker for the rest; without xdist the session stops, saying why. Registered by conftest.py.
"""
from __future__ import annotations

import os
import sys

import pytest

from spd_kernels.testing import cuda_context_error

WORKER_EXIT_CODE = 75  # any non-zero code: xdist replaces a worker that died


class CudaContextGuard:
    def __init__(self, probe=cuda_context_error, exit_worker=os._exit):
        self.probe = probe              # () -> why the context is lost, or None
        self.exit_worker = exit_worker  # replaced in this plugin's own test
        self.lost: tuple[str, str] | None = None  # (test id, fault) once the context is lost

    @pytest.fixture(autouse=True)
    def _cuda_context_guard(self, request):
        yield
        err = self.probe() if self.lost is None else None
        if err is not None:
            self.lost = (request.node.nodeid, err)
            pytest.fail(f"this test left the CUDA context unusable: {err}", pytrace=False)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        yield
        if self.lost is None:  # a fault in a module- or session-scoped fixture's teardown
            err = self.probe()
            if err is not None:
                self.lost = (item.nodeid, err)
        if self.lost is None:
            return
        msg = (f"CUDA context lost in {self.lost[0]} ({self.lost[1]}): no later test can run "
               "in this process")
        if os.environ.get("PYTEST_XDIST_WORKER"):
            print(f"{msg}; exiting so that pytest-xdist starts a fresh worker", file=sys.stderr,
                  flush=True)
            self.exit_worker(WORKER_EXIT_CODE)  # does not return (os._exit)
        item.session.shouldstop = msg
