"""Host mirrors (spd.runtime.host_mirror): the decode loop's late reads of device values (the
context lookup's in-flight drafts, whether the lookup's token was used) come from host copies
made behind their producers, never from the device in the cycle that needs them."""
from __future__ import annotations

import pytest
import torch
from conftest import bench_module, make_tiny_target

from spd.runtime.engine import LocalStages, SPDEngine
from spd.runtime.host_mirror import HostMirror, is_host_copy
from spd.runtime.types import SamplingParams

probe = bench_module("probe_host_reads")


def test_a_mirror_reads_the_latest_write_of_each_position():
    g = torch.Generator().manual_seed(0)
    buf = torch.full((12,), -7, dtype=torch.int64)  # poisoned: unwritten positions stay apart
    mirror = HostMirror(buf)
    first = torch.randint(0, 1000, (12,), generator=g)
    buf.copy_(first)
    mirror.wrote(0, 12)
    buf[5] = 4242  # a rollback rewrites a position
    mirror.wrote(5, 6)
    buf[6] = 999   # written on the device, not reported: the mirror keeps the last copy
    expect = first.tolist()
    expect[5] = 4242
    assert mirror.read(0, 12) == expect
    assert mirror.read(3, 7) == expect[3:7]
    assert not is_host_copy(mirror.host) and not is_host_copy(buf)


@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=1.0, top_k=12, seed=5)],
                         ids=["greedy", "sampled"])
def test_each_cycle_reads_one_verdict_and_nothing_else(sampling):
    """Single process, context lookup on, a prompt that repeats (the lookup proposes, the gate
    decides on the device), an untrained PDM (many rejections, so rollbacks): outside
    spd_kernels' CPU-only value checks and reference paths, a cycle that judges a draft reads
    one value pair from the device, the verdict, and every other cycle (filling) reads nothing;
    rollbacks read nothing. The lookup's matching and its stats read host mirrors only."""
    from spd.runtime.sequence import SequenceDecode
    t = make_tiny_target(seed=3, vocab=24, layers=4)
    eng = SPDEngine(t, n_stages=3, lookup=2, warn_untrained=False)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    log: list = []
    with probe.CallLog(log, (SequenceDecode, "draft"), (SequenceDecode, "commit"),
                       (LocalStages, "rollback")):
        with probe.ReadLog(log, where=True):
            res = eng.generate(prompt, 40, sampling)
    st = res.stats
    assert st.lookup_judged > 0  # the lookup took part
    assert sum(e == ("host",) for e in log) >= st.lookup_judged
    cycles, setup = [], []
    for e in log:
        if e == ("draft",):
            cycles.append([])
        elif e[0] != "read" or "spd_kernels" not in e[2]:  # the kernels' CPU paths aside
            (cycles[-1] if cycles else setup).append(e)
    assert len(cycles) == st.K
    assert sum(("rollback",) in c for c in cycles) == st.drafts_judged - st.drafts_accepted > 3
    for c in cycles:
        reads = [e[2].split()[-1] for e in c if e[0] == "read"]
        assert reads == ["to_host"] * c.count(("commit",)), c  # the verdict (spd.device)
    # set-up: the prompt's checks, pick (the first token), begin (the draft vocabulary's
    # columns, once per map)
    assert {e[2].split()[-1] for e in setup if e[0] == "read"} <= {
        "check_prompt", "__init__", "pick", "begin"}
    if sampling.greedy:  # the lookup never changes the output
        assert res.token_ids == SPDEngine(t, n_stages=3, lookup=0,
                                          warn_untrained=False).generate(prompt, 40).token_ids
