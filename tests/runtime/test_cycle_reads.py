"""What a steady cycle reads on the host, and what it copies there, on every rank (CPU).

A read (benchmarks/probe_host_reads.py's ReadLog) is anything that brings a tensor's value
into Python or waits on its data to size a result: on a GPU each one stalls the host until the
device catches up. A copy is a tensor made from, or written with, a Python value (on a GPU a
copy from pageable memory that holds the host). No cycle may do either, outside spd_kernels (its
CPU reference paths; a GPU runs its kernels): the host reads what each cycle publishes, a few
ints in pinned memory behind an event, and on a CPU, where the host is the device, a cycle
looks at its units to skip a dead one's stage step (`peek`); both are host memory by identity
(spd.runtime.driver.is_host_copy) and logged apart as ("host",).
"""
from __future__ import annotations

import json
from functools import partial

import pytest
from conftest import NoisyPDMDrafter, bench_module, engine_for, noisy_tree_drafter, tiny_factory

from spd import SamplingParams
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.runtime.cycle import Cycle
from spd.runtime.sequence import Sequence

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
KERNELS = "/spd_kernels/"
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, top_k=10, seed=3)]
probe = bench_module("probe_host_reads")


def cycle_events(log: list) -> tuple[list[list], int]:
    """(per cycle launched: its reads of device values and copies of Python values made
    outside spd_kernels; the reads of host memory) of a ReadLog + CallLog."""
    cycles, host = [], 0
    for event in log:
        if event[0] == "finish":
            break
        if event[0] == "cycle":
            cycles.append([])
        elif event[0] == "host":
            host += 1
        elif cycles and event[0] in ("read", "copy") and KERNELS not in event[2]:
            cycles[-1].append(event)
    return cycles, host


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("replay", [False, True], ids=["cpu", "checked"])
def test_one_process_cycles_read_nothing_and_copy_no_python_value(width, sampling, replay,
                                                                  monkeypatch):
    """Chain and tree, greedy and sampled, the context lookup on a prompt that repeats. Under
    SPD_REPLAY_CHECK (the GPU's work) the host reads each cycle's published state once, up to
    the last; on a CPU a cycle also looks at its units (and, past the end, at `done`)."""
    if replay:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    eng = engine_for(partial(tiny_factory, 2), 4, width, lookup=2)
    ref = PROMPT * 2 + eng.generate_ar(PROMPT * 2, 40, sampling).token_ids
    drafter = (noisy_tree_drafter(ref, 0.6, 4, eng) if width > 1
               else NoisyPDMDrafter(eng.pdm, ref, 0.6, seed=4))
    log: list = []
    with probe.CallLog(log, (Cycle, "cycle"), (Sequence, "finish")):
        with probe.ReadLog(log, where=True, copies=True):
            res = eng.generate(PROMPT * 2, 40, sampling, drafter=drafter)
    cycles, host = cycle_events(log)
    K = res.stats.K
    assert res.stats.drafts_accepted < res.stats.drafts_judged and K > 10
    assert res.stats.drafts_accepted > 0 or not sampling.greedy
    assert len(cycles) == K + eng.ahead and [c for c in cycles if c] == []
    if replay:
        assert host == K
    else:  # the published state; and each cycle's look at `done` (those past the end: no
        # more) and at its units
        assert host == 3 * K + eng.ahead


def _counting_factory(rank: int):
    if rank != 0:
        probe.log_stage_runs("reads", where=True, copies=True)
    return tiny_factory(41, rank)


def _counted_job(engine, request):
    log: list = []
    with probe.CallLog(log, (Cycle, "cycle")):
        with probe.ReadLog(log, where=True, copies=True):
            result = run_requests([request], engine)[0]
    stages = [json.loads(engine.rt.store.get(f"test/reads/1/{r}"))
              for r in range(1, engine.n + 1)]
    return result, log, stages


@pytest.mark.parametrize("width", [1, 2])
def test_every_rank_reads_nothing_and_posts_fixed_messages(width):
    """n = 3 ranks + rank 0, sampled (the last stage sends its rows). Per cycle: rank 0 sends
    stage 0 one unit and receives a snap from every stage with anchors (the last always);
    stage s receives one unit (none in cycle 0 past stage 0), sends one on (none in the last
    cycle, none from the last stage) and one snap. No rank reads a device value or copies a
    Python value in a cycle: rank 0 reads only each cycle's published state; a stage its
    `end` (published, `ahead` cycles late) and, on a CPU, its unit's liveness."""
    n = 3
    eng = engine_for(partial(tiny_factory, 41), n, width)
    ref = PROMPT + eng.generate_ar(PROMPT, 30).token_ids
    drafter = (partial(noisy_tree_drafter, ref, 0.7, 2) if width > 1 else None)
    request = GenerateRequest(PROMPT, 24, SAMPLINGS[1], reference=ref, reference_accuracy=0.7,
                              reference_seed=2, drafter=drafter)
    config = DistConfig(n_stages=n, target_factory=_counting_factory, lookup=0, tree_width=width,
                        fault_timeout=5.0, op_timeout=60.0, threads=1)
    result, log, stages = launch_local(config, partial(_counted_job, request=request),
                                       timeout=150)
    d = result.stats.distributed
    C = d["cycles_run"]
    msgs = d["messages_per_cycle"]
    snapping = sorted({s for s in range(n) if eng.layout.anchors_of_stage(s)} | {n - 1})
    assert msgs["0"] == pytest.approx({"send/data": 1.0, "recv/data": len(snapping)})
    for s in range(n):
        got = msgs[str(s + 1)]
        recv = C if s == 0 else C - 1
        send = (C - 1 if s < n - 1 else 0) + (C if s in snapping else 0)
        assert got == pytest.approx({"send/data": send / C, "recv/data": recv / C}), s
    cycles, host = cycle_events(log)
    assert len(cycles) == C and [c for c in cycles if c] == []
    assert C - (n + 3) <= host <= C  # read until the end cycle is known
    for slog in stages:
        first = next(i for i, e in enumerate(slog) if e[0] == "unit")  # the set-up before it
        assert [e for e in slog[first:] if e[0] in ("read", "copy") and KERNELS not in e[2]] == []
        assert sum(e[0] == "unit" for e in slog) == C  # one cycle each, the last included
        assert C - 2 * (n + 3) <= sum(e[0] == "host" for e in slog) <= 2 * C
