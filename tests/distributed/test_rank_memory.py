"""Each stage rank of the distributed runtime holds about its own layers, measured: its peak
resident memory (VmHWM, polled until it exits) on the default model (SmolLM2-135M, fp32) at
n = 4, above a bare `import torch` process, is at most 1.3x the bytes of the weights it holds.
A stage rank builds its target without transformers and never imports Triton, torch._dynamo or
sympy (spd.model.plain_build, spd_kernels.dispatch.defer), so little beyond torch stays fixed."""
from __future__ import annotations

import pytest
from conftest import bench_module


@pytest.fixture(scope="module")
def probe():
    """benchmarks/probe_rank_memory.py: the launch, the poll and the bytes each rank holds."""
    return bench_module("probe_rank_memory")


@pytest.mark.slow
def test_each_stage_rank_peaks_at_most_1_3x_the_weights_it_holds_above_bare_torch(probe):
    n = 4
    bare_torch = probe.process_peak_kb("import torch") * 1024
    peaks = probe.rank_peaks(n, None, max_new=4)
    assert sorted(peaks) == list(range(n + 1))
    parts = probe.rank_parts(None, n)
    above = {r: peaks[r] * 1024 - bare_torch for r in range(1, n + 1)}
    report = {r: {"peak MB": round(peaks[r] / 1024, 1),
                  "above bare torch MB": round(above[r] / 2**20, 1),
                  "held MB": round(parts[r]["bytes"] / 2**20, 1)} for r in range(1, n + 1)}
    for r in range(1, n + 1):
        # held: its layers (stage 0: and the embedding; the last stage: norm and tied head);
        # the lower bound says the poll saw them resident
        assert 0.5 * parts[r]["bytes"] < above[r] <= 1.3 * parts[r]["bytes"], report
