"""Tensor-to-host reads of the distributed runtime per steady-state cycle (CPU, gloo).

Compute is emulated (spd.distributed.emulate: stage steps and the draft step are fixed waits), so
what is counted is the runtime's own reads, not those of the kernels' CPU reference paths. A read
(benchmarks/probe_host_reads.py's ReadLog) is anything that brings a tensor's value into Python
(item, int / bool / float of a tensor, tolist, numpy) or makes the host wait on the data to size
a result (nonzero and the like): on a GPU each one stalls the host until the device catches up.

The one exception, made explicitly and by identity (spd.distributed.protocol.is_header): the
header of each unit message, [op, seq], that a stage reads to tell a unit from the stop. It is
host memory on every device: under gloo (here) the int64 view of the first 16 bytes of the one
host buffer a unit arrives in, under NCCL a host tensor of its own on the gloo control group; so
reading it never waits on a device. The payload it goes with ([position, token] or
[position | row]: the rest of that buffer, or device memory on a GPU) is counted like any other
tensor, and so is any other view of the buffer, the whole of it included. Header reads are logged
as ("header",) instead, so the tests can see them.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from conftest import bench_module, needs_gpu

from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.emulate import reference_tokens, tiny_target
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests

PROMPT = [5, 17, 3, 99, 42, 7, 11, 200]
SEED, LAYERS = 4, 6
probe = bench_module("probe_host_reads")
ReadLog, CallLog = probe.ReadLog, probe.CallLog  # what a read is: ReadLog's docstring


def counting_factory(rank: int):
    """Every rank's target; on a stage rank, each generation's loop also logs its reads (between
    the first unit and the stop) into the store, for rank 0's job to collect."""
    if rank != 0:
        probe.log_stage_runs("reads")
    return tiny_target(SEED, LAYERS)


def counted_job(engine, request: GenerateRequest):
    """Rank 0: run `request` logging reads (and where they were made), each cycle's draft, each
    unit sent, each judged draft committed and each rollback."""
    from spd.distributed.draft_rank import RemoteStages, UnitStream
    from spd.runtime.sequence import SequenceDecode
    log: list = []
    with CallLog(log, (UnitStream, "send"), (SequenceDecode, "draft"),
                 (SequenceDecode, "commit"), (RemoteStages, "rollback")):
        with ReadLog(log, where=True):
            result = run_requests([request], engine)[0]
    stages = [json.loads(engine.rt.store.get(f"test/reads/1/{r}")) for r in range(1, engine.n + 1)]
    return result, log, stages


def _cycles(log: list) -> list[list]:
    """The log split at each draft (one per cycle); what comes before the first is dropped, and
    so are the reads made inside spd_kernels (its CPU-only value checks and reference paths,
    which a GPU run does not take)."""
    out = []
    for event in log:
        if event[0] == "draft":
            out.append([])
        elif out and not (event[0] == "read" and "spd_kernels" in event[2]):
            out[-1].append(event[0])
    return out


def _stage_reads(result, stages) -> None:
    """No stage rank reads a tensor value but one host header per unit (and the stop's)."""
    for rank, slog in enumerate(stages, start=1):
        units = [e for e in slog if e[0] == "unit"]
        assert len(units) == result.stats.distributed["units"]
        first = slog.index(["unit"])
        assert [e for e in slog[first:] if e[0] == "read"] == [], f"rank {rank} reads"
        headers = [e for e in slog if e[0] == "header"]
        assert len(headers) == len(units) + 1, f"rank {rank}: a header per unit and the stop"


@pytest.mark.parametrize("n", [2, 4])
def test_host_reads_per_accepted_cycle(n):
    """Steady state, every draft accepted: no read on the stage ranks but one host header per
    unit (module docstring); on rank 0 one read per cycle (the last stage's verdict), after the
    cycle's unit has been sent."""
    m = 24
    target = tiny_target(SEED, LAYERS)
    ref = reference_tokens(target, PROMPT, m + n + 2)
    config = DistConfig(n_stages=n, target_factory=counting_factory, fault_timeout=5.0,
                        op_timeout=60.0, lookup=0, speculative_control="on", emulate_s=0.002)
    request = GenerateRequest(PROMPT, m, reference=ref)
    result, log, stages = launch_local(config, partial(counted_job, request=request),
                                       timeout=150)
    assert result.token_ids == ref[len(PROMPT):len(PROMPT) + m]
    assert result.stats.K == result.stats.N + n - 1  # every draft accepted
    _stage_reads(result, stages)
    cycles = _cycles(log)
    assert len(cycles) == result.stats.K
    steady = cycles[n - 1:-2]  # full cycles with a successor announced (not the last two)
    assert len(steady) >= m - n - 2
    for events in steady:
        assert events.count("read") == 1, events
        assert "send" in events[:events.index("read")], events  # the next unit went first


@pytest.mark.parametrize("n", [2, 3])
def test_host_reads_per_sampled_cycle_with_rollbacks(n):
    """Seeded sampling: rank 0 judges every draft itself (rejection sampling), many are
    rejected and roll every stage back. Still no read on the stage ranks but the headers; on
    rank 0, outside spd_kernels' CPU paths, one read per judged cycle (the verdict) and none in
    a filling cycle or a rollback."""
    from spd.runtime.types import SamplingParams
    m = 24
    target = tiny_target(SEED, LAYERS)
    ref = reference_tokens(target, PROMPT, 4 * m)  # greedy: a sampled decode rejects some
    config = DistConfig(n_stages=n, target_factory=counting_factory, fault_timeout=5.0,
                        op_timeout=60.0, lookup=0, speculative_control="auto",
                        emulate_s=0.002)
    request = GenerateRequest(PROMPT, m, SamplingParams(temperature=1.0, seed=3), reference=ref)
    result, log, stages = launch_local(config, partial(counted_job, request=request),
                                       timeout=150)
    st = result.stats
    assert len(result.token_ids) == m and st.distributed["verify_on"] == "rank 0"
    _stage_reads(result, stages)
    cycles = _cycles(log)
    assert len(cycles) == st.K
    assert sum("rollback" in c for c in cycles) == st.drafts_judged - st.drafts_accepted > 2
    for events in cycles:
        assert events.count("read") == events.count("commit") <= 1, events


def _sync_free_factory(rank: int):
    """A CUDA target; a stage rank's whole generation runs with synchronisation raising."""
    if rank != 0:
        from spd.distributed import stage_rank
        run = stage_rank.StageWorker.run

        def strict_run(self, gen, req):
            torch.cuda.set_sync_debug_mode("error")
            try:
                run(self, gen, req)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        stage_rank.StageWorker.run = strict_run
    return tiny_target(SEED, LAYERS, device="cuda")


def sync_free_job(engine, request: GenerateRequest):
    """Rank 0's decode loop with synchronisation raising throughout, the verdict's read
    included: it waits on the event after the verdict's own copy to pinned memory (DraftRank-
    Streams.to_host), which CUDA's sync debug mode does not flag (torch's CUDAEvent::synchronize
    calls no warn_or_error_on_sync), unlike a read of a device tensor."""
    from spd.runtime.sequence import SequenceDecode
    draft, finish = SequenceDecode.draft, SequenceDecode.finish

    def strict_draft(self, *args):  # the first draft starts the decode loop
        torch.cuda.set_sync_debug_mode("error")
        return draft(self, *args)

    def relaxed_finish(self):
        torch.cuda.set_sync_debug_mode("default")
        return finish(self)
    SequenceDecode.draft, SequenceDecode.finish = strict_draft, relaxed_finish
    try:
        return run_requests([request], engine)[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        SequenceDecode.draft, SequenceDecode.finish = draft, finish


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 3,
                    reason="NCCL needs one GPU per rank (3 for n = 2)")
def test_gpu_steady_state_never_synchronises():
    """The same decode over NCCL with CUDA's sync debug mode raising: no stage rank, and no
    cycle of rank 0 (its verdict read waits on one event), may synchronise the device. Unit payloads move over
    NCCL (device memory); only the host headers ride gloo, and reading them is no device sync."""
    n, m = 2, 24
    target = tiny_target(SEED, LAYERS, device="cuda")
    ref = reference_tokens(target, PROMPT, m + n + 2)
    config = DistConfig(n_stages=n, target_factory=_sync_free_factory, device="cuda",
                        backend="nccl", fault_timeout=10.0, op_timeout=60.0, lookup=0,
                        speculative_control="on", emulate_s=0.0003, emulate_wait="spin")
    result = launch_local(config, partial(sync_free_job, request=GenerateRequest(
        PROMPT, m, reference=ref)), timeout=180)
    assert result.token_ids == ref[len(PROMPT):len(PROMPT) + m]
