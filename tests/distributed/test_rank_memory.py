"""Each stage rank of the distributed runtime holds about its own layers, measured: its peak
resident memory (VmHWM, polled until it exits) on the default model at n = 4, above the same
rank's on a tiny model (the base: imports, process group, code; the same code path holding
almost no weights), is at most 1.3x the bytes of the weights it holds. (Above a bare
`import torch` process a rank also carries ~90 MB that do not grow with the model: spd's and
Hugging Face's modeling imports, torch._dynamo and sympy among them, and the process group.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def probe():
    """benchmarks/probe_rank_memory.py: the launch, the poll and the bytes each rank holds."""
    spec = importlib.util.spec_from_file_location("probe_rank_memory",
                                                  BENCH / "probe_rank_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_each_stage_rank_peaks_at_most_1_3x_the_weights_it_holds(probe):
    n = 4
    tiny = probe.tiny_model_dir()
    base_peaks = probe.rank_peaks(n, tiny, max_new=4)
    peaks = probe.rank_peaks(n, None, max_new=4)
    assert sorted(peaks) == sorted(base_peaks) == list(range(n + 1))
    parts = probe.rank_parts(None, n)
    above = probe.above_base(peaks, base_peaks, probe.rank_parts(tiny, n))
    bare_torch = probe.process_peak_kb("import torch") * 1024  # for the message only
    report = {r: {"above base MB": round(above[r] / 2**20, 1),
                  "held MB": round(parts[r]["bytes"] / 2**20, 1),
                  "above bare torch MB": round((peaks[r] * 1024 - bare_torch) / 2**20, 1)}
              for r in range(1, n + 1)}
    for r in range(1, n + 1):
        # held: its layers (stage 0: and the embedding); the poll saw them resident
        assert 0.5 * parts[r]["bytes"] < above[r] <= 1.3 * parts[r]["bytes"], report
