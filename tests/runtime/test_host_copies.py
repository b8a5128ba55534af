"""Copies of Python values to the device per decode cycle (CPU): none, greedy or sampled.

The hot path's rule: positions, lengths and tokens live in device tensors, so a cycle makes no
tensor from a Python value and writes none into one. On a GPU such a copy (torch.tensor of a
list, x[i] = 5: torch stages the value in pageable host memory) holds the host until the device
has taken it, and CUDA's sync debug mode raises on it (tests/runtime/test_gpu_no_sync.py, which
needs a GPU). On a CPU every tensor is host memory, so this test counts the constructions
themselves, with the host-read probe's logger (benchmarks/probe_host_reads.py: ReadLog with
copies=True, its COPY_FUNCS): torch.tensor / as_tensor of Python data, full / full_like of a
Python value, and __setitem__ of one into any tensor but the host memory the runtime keeps by
design (a unit's header, a host mirror's copy). An in-place fill_ of a buffer made once is not
counted (the value rides in the kernel's arguments). Copies made inside spd_kernels are left
out (its CPU reference paths; a GPU runs its kernels), as the host-read tests leave out its reads.

Every cycle counts, from the first draft to the end of the decode: fill, refill after each
rejection and the first cycle of each staircase included (the tables a cycle indexes are made
before the first one).

The chain only (tree width 1): a token tree builds small index tensors from the tree's shape,
which its host keeps, every cycle by design (spd.runtime.tree).
"""
from __future__ import annotations

import json
import os
from functools import partial

import pytest
from conftest import bench_module, make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.emulate import tiny_target
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests

probe = bench_module("probe_host_reads")
ReadLog, CallLog = probe.ReadLog, probe.CallLog  # what a copy is: ReadLog's docstring
KERNELS = f"{os.sep}spd_kernels{os.sep}"
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=11)]


def copies_per_cycle(log: list) -> list[list[str]]:
    """`log` (ReadLog(where=True, copies=True) with CallLog of SequenceDecode.draft and .finish)
    split at each draft, one list per cycle of the copies made ("what at file:line function"),
    up to the end of the decode; those made inside spd_kernels are left out."""
    cycles: list[list[str]] = []
    for event in log:
        if event[0] == "finish":
            break
        if event[0] == "draft":
            cycles.append([])
        elif cycles and event[0] == "copy" and KERNELS not in event[2]:
            cycles[-1].append(f"{event[1]} at {event[2]}")
    return cycles


def logged_generate(generate, *args):
    """generate(*args) with its copies logged -> (its result, copies per cycle)."""
    from spd.runtime.sequence import SequenceDecode
    log: list = []
    with CallLog(log, (SequenceDecode, "draft"), (SequenceDecode, "finish")):
        with ReadLog(log, where=True, copies=True):
            result = generate(*args)
    return result, copies_per_cycle(log)


def assert_no_copies(cycles: list[list[str]], K: int) -> None:
    assert len(cycles) == K  # every cycle was seen
    copied = [(k, c) for k, c in enumerate(cycles, start=1) if c]
    assert not copied, f"copies of Python values (cycle, what): {copied[:5]}"


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_single_process_cycles_copy_no_python_value(sampling):
    """SPDEngine.generate with an untrained PDM (rejections: every cache rolls back, the
    correction enters alone) and the context lookup on (its token enters; sampled, its one-hot
    q is made)."""
    t = make_tiny_target(seed=6, vocab=64, layers=4)
    # lookup 1 (the shortest match): the lookup proposes often, sampled too
    eng = SPDEngine(t, n_stages=3, lookup=1, warn_untrained=False)
    res, cycles = logged_generate(eng.generate, [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9], 48,
                                  sampling)
    st = res.stats
    assert len(res.token_ids) == 48
    assert st.drafts_accepted < st.drafts_judged and st.lookup_judged > 0
    assert_no_copies(cycles, st.K)


# --- distributed: rank 0 and the stage ranks, compute emulated -------------------------------
PROMPT = [5, 17, 3, 99, 42, 7, 11, 200]


def counting_factory(rank: int):
    """Every rank's target; a stage rank logs each generation's copies into the store."""
    if rank != 0:
        probe.log_stage_runs("copies", where=True, copies=True)
    return tiny_target(4, 6)


def counted_job(engine, requests: list[GenerateRequest]):
    """Rank 0: each request with its copies per cycle logged; every stage rank's copies after
    its first unit (until the stop), per request."""
    out = []
    for gen, request in enumerate(requests, start=1):
        res, cycles = logged_generate(run_requests, [request], engine)
        stages = []
        for r in range(1, engine.n + 1):
            slog = json.loads(engine.rt.store.get(f"test/copies/{gen}/{r}"))
            first = slog.index(["unit"])
            stages.append([e[1:] for e in slog[first:] if e[0] == "copy"])
        out.append((res[0], cycles, stages))
    return out


@pytest.mark.slow  # a minute on 2 CPU cores: four processes start
def test_distributed_cycles_copy_no_python_value():
    """The distributed runtime over gloo, the engine's untrained PDM drafting with the lookup
    on, greedy (the last stage judges) then sampled (rank 0 judges), both with rejections: no
    cycle of rank 0 copies a Python value (its units' position and token go in as device
    views), nor does any stage rank after its first unit (it writes only host headers)."""
    n, m = 3, 24
    config = DistConfig(n_stages=n, target_factory=counting_factory, fault_timeout=5.0,
                        op_timeout=60.0, lookup=2, speculative_control="on", emulate_s=0.002)
    requests = [GenerateRequest(PROMPT, m, s) for s in SAMPLINGS]
    runs = launch_local(config, partial(counted_job, requests=requests), timeout=240)
    for (res, cycles, stages), verify_on in zip(runs, ["last stage", "rank 0"]):
        st = res.stats
        assert len(res.token_ids) == m and st.distributed["verify_on"] == verify_on
        assert st.drafts_accepted < st.drafts_judged  # rollbacks inside the counted cycles
        assert_no_copies(cycles, st.K)
        assert stages == [[]] * n, f"stage ranks' copies: {stages}"
