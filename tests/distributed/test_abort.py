"""A rank leaving on a fault aborts its NCCL communicators first (bounded), gloo's never."""
from __future__ import annotations

import threading

import pytest
import torch.distributed.distributed_c10d as c10d

from spd.distributed import faults
from spd.distributed.faults import FaultHandling


class _Left(Exception):
    pass


def _rank(backend: str, order: list) -> FaultHandling:
    rt = object.__new__(FaultHandling)  # only what exit_now reads
    rt.rank, rt.backend = 2, backend
    rt._exit_lock, rt._exiting = threading.Lock(), False
    rt.exit_hooks = [lambda message: order.append(("hook", message))]
    return rt


@pytest.fixture
def leaving(monkeypatch):
    order: list = []

    def exit_(code):
        order.append(("exit", code))
        raise _Left

    monkeypatch.setattr(faults.os, "_exit", exit_)
    monkeypatch.setattr(c10d, "_abort_process_group",
                        lambda group=None: order.append(("abort", group)))
    return order


def test_nccl_rank_aborts_its_communicators_after_the_hooks_before_it_leaves(leaving):
    with pytest.raises(_Left):
        _rank("nccl", leaving).exit_now(faults.EXIT_PEER, "rank 1 was lost")
    assert [k for k, _ in leaving] == ["hook", "abort", "exit"]
    assert leaving[1] == ("abort", None)  # every group of the process
    assert leaving[2] == ("exit", faults.EXIT_PEER)


def test_gloo_rank_leaves_without_an_abort(leaving):
    with pytest.raises(_Left):
        _rank("gloo", leaving).exit_now(faults.EXIT_PEER, "rank 1 was lost")
    assert [k for k, _ in leaving] == ["hook", "exit"]


def test_a_hanging_abort_delays_the_exit_but_never_stops_it(leaving, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: release.wait(30))
    monkeypatch.setattr(faults, "ABORT_BOUND_S", 0.2)
    rt = _rank("nccl", leaving)
    try:
        assert rt.abort_communicators(bound_s=0.2) is False
        with pytest.raises(_Left):
            rt.exit_now(faults.EXIT_PEER, None)
        assert [k for k, _ in leaving] == ["hook", "exit"]
    finally:
        release.set()


def test_a_raising_abort_is_not_the_exit(leaving, monkeypatch):
    def boom(group=None):
        raise RuntimeError("NCCL error: remote process exited")
    monkeypatch.setattr(c10d, "_abort_process_group", boom)
    rt = _rank("nccl", leaving)
    assert rt.abort_communicators(bound_s=5) is True
