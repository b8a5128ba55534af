"""NCCL, one GPU per rank: every rank's cycle is one CUDA graph's replay, its messages inside it,
and no rank synchronises the device in its decode (gpu-marked: run where the GPUs are lent).

n = 2, greedy and sampled: n + 1 ranks (3 GPUs), and the draft on stage 1 (2 GPUs: stage 1 runs
inside rank 0's captured cycle). Each rank's decode runs under CUDA's sync debug mode set to
raise, but for the capture of its cycle (torch.cuda.graph synchronises as it begins); greedy
gives the one-process engine's tokens. SPD_CUDA_GRAPHS=0 runs the same cycles eagerly.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import needs_gpu

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.emulate import tiny_target
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _strict_factory(rank: int):
    """A CUDA target; every rank's decode runs with synchronisation raising, but for the
    capture of its cycle."""
    from spd.distributed.stage_rank import StageCycles
    from spd.runtime.cycle import Cycle
    from spd.runtime.cycle_graph import CycleGraph

    def in_mode(run, mode, after):
        def wrapped(self):
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return run(self)
            finally:
                torch.cuda.set_sync_debug_mode(after)
        return wrapped
    StageCycles.run = in_mode(StageCycles.run, "error", "default")
    Cycle.run = in_mode(Cycle.run, "error", "default")
    CycleGraph._capture = in_mode(CycleGraph._capture, "default", "error")
    return tiny_target(51, 4, device="cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("on_stage", [None, 1])
@pytest.mark.parametrize("temperature,graphs", [(0.0, "1"), (1.0, "1"), (0.0, "0")])
def test_gpu_cycles_over_nccl_never_synchronise(on_stage, temperature, graphs, monkeypatch):
    processes = 2 if on_stage is not None else 3
    if torch.cuda.device_count() < processes:
        pytest.skip(f"NCCL needs one GPU per rank ({processes} here)")
    monkeypatch.setenv("SPD_CUDA_GRAPHS", graphs)
    sp = SamplingParams(temperature=temperature, seed=3)
    config = DistConfig(n_stages=2, target_factory=_strict_factory, device="cuda",
                        backend="nccl", lookup=0, fault_timeout=10.0, op_timeout=60.0,
                        draft_on_stage=on_stage)
    got = launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 24, sp)]),
                       timeout=240)[0]
    assert len(got.token_ids) == 24
    d = got.stats.distributed
    for graph in [d["graph"]] + [r["graph"] for r in d["ranks"][1:]]:
        assert (graph["eager"] is None and graph["replays"] > 10) if graphs == "1" else \
            (graph["eager"] == "off" and graph["replays"] == 0), graph
    if temperature == 0.0:
        t = tiny_target(51, 4, device="cuda")
        assert got.token_ids == SPDEngine(t, n_stages=2, lookup=0).generate(PROMPT, 24).token_ids
