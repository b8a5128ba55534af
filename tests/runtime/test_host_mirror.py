"""Host mirrors (spd.runtime.host_mirror): the decode loop's late reads of device values (the
context lookup's in-flight drafts, whether the lookup's token was used) come from host copies
made behind their producers, never from the device in the cycle that needs them."""
from __future__ import annotations

import torch
from conftest import bench_module, make_tiny_target

from spd.runtime.engine import SPDEngine
from spd.runtime.host_mirror import HostMirror, is_host_copy

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


def test_the_decode_loop_reads_only_its_verdict_from_the_device():
    """Single process, context lookup on, a prompt that repeats (the lookup proposes and the
    gate decides on the device): outside spd_kernels' CPU-only value checks, the loop's reads
    of device values are the verdict's (in `judge`) and the set-up's; the lookup's matching
    (`_lookup`) and its stats (`commit`) read host mirrors only."""
    t = make_tiny_target(seed=3, vocab=24, layers=4)
    eng = SPDEngine(t, n_stages=2, lookup=2, warn_untrained=False)
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]
    log: list = []
    with probe.ReadLog(log, where=True):
        res = eng.generate(prompt, 40)
    assert res.stats.lookup_judged > 0  # the lookup took part
    assert sum(e == ("host",) for e in log) >= res.stats.lookup_judged
    readers = {e[2].split()[-1] for e in log
               if e[0] == "read" and "spd_kernels" not in e[2]}
    # set-up: pick (the first token), begin (the draft vocabulary's columns, once per map)
    assert readers <= {"judge", "check_prompt", "__init__", "pick", "begin"}, readers
    assert res.token_ids == SPDEngine(t, n_stages=2, lookup=0,
                                      warn_untrained=False).generate(prompt, 40).token_ids
