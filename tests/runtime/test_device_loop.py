"""The device loop (spd.runtime.device_loop) against the host loop (SequenceDecode.run).

The device loop decides every cycle on the device, so its tokens, counts and draft statistics
must be the host loop's exactly: same draws (the decode's generator on a CPU), same schedule.
Drafters: the untrained PDM (every draft rejected: refills), NoisyPDMDrafter (the PDM runs at
device positions, the reference token is proposed at random: mixed accept / reject), and
ReferenceDrafter. Also: its steady cycles read nothing on the host and copy no Python value to
the device, cycles launched past the end change nothing (any `ahead`), stops decided on the host
(a stop string) emit nothing past them, and what it does not run falls back with a warning.
"""
from __future__ import annotations

import os

import pytest
import torch
from conftest import NoisyPDMDrafter, bench_module, make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.draft.drafters import ReferenceDrafter
from spd.draft.pdm import PipelineDraftModule
from spd.runtime.device_loop import DeviceLoop
from spd.runtime.sequence import SequenceDecode
from spd.runtime.stopping import StopRule

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
SAMPLINGS = [SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=3)]
KERNELS = f"{os.sep}spd_kernels{os.sep}"


def counts(res) -> tuple:
    s = res.stats
    return (res.token_ids, s.N, s.K, s.drafts_judged, s.drafts_accepted, s.stage_rows,
            s.by_position, res.finish_reason)


def engines(n: int, seed: int = 0, **engine_args):
    """(host-loop engine, device-loop engine) on one tiny target with a stage a layer at most."""
    t = make_tiny_target(seed=10 + n + seed, vocab=48, layers=max(4, n))
    host = SPDEngine(t, n_stages=n, lookup=0, **engine_args)
    return host, SPDEngine(t, n_stages=n, lookup=0, pdm=host.pdm, device_loop=True,
                           **engine_args)


@pytest.mark.parametrize("n,sampling", [(2, SAMPLINGS[0]), (3, SAMPLINGS[0]), (4, SAMPLINGS[0]),
                                        (8, SAMPLINGS[0]), (2, SAMPLINGS[1]), (4, SAMPLINGS[1])],
                         ids=["greedy-2", "greedy-3", "greedy-4", "greedy-8", "sampled-2",
                              "sampled-4"])
def test_device_loop_equals_host_loop(n, sampling, monkeypatch):
    # and every steady cycle is the work a CUDA graph replays (spd.runtime.cycle_graph)
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    host, dev = engines(n)
    ar = host.generate_ar(PROMPT, 30).token_ids
    # sampled: a sample of the target's (drafts of it are accepted until the decode's own
    # sample leaves it)
    ref = ar if sampling.greedy else host.generate_ar(PROMPT, 30, sampling).token_ids
    drafters = [lambda: None,
                lambda: NoisyPDMDrafter(host.pdm, PROMPT + ref, 0.6, seed=n),
                lambda: ReferenceDrafter(PROMPT + ref, 0.5, seed=1)]
    mixed = []
    for make in drafters:
        a, b = host.generate(PROMPT, 30, sampling, drafter=make()), \
            dev.generate(PROMPT, 30, sampling, drafter=make())
        assert b.stats.loop == "device" and a.stats.loop == "host"
        assert counts(b) == counts(a)
        if sampling.greedy:
            assert b.token_ids == ar
        mixed.append(0 < b.stats.drafts_accepted < b.stats.drafts_judged)
    assert any(mixed)  # accepts and rejections in one decode (else the test shows little)


@pytest.mark.parametrize("ahead", [0, 1, 8])
def test_cycles_launched_ahead_change_nothing(ahead):
    host, _ = engines(3)
    dev = SPDEngine(host.target, n_stages=3, lookup=0, pdm=host.pdm, device_loop=True,
                    ahead=ahead)
    ar = host.generate_ar(PROMPT, 30).token_ids
    for max_new in (1, 2, 5, 30):
        make = lambda: NoisyPDMDrafter(host.pdm, PROMPT + ar, 0.6, seed=2)  # noqa: E731
        assert counts(dev.generate(PROMPT, max_new, drafter=make())) == \
            counts(host.generate(PROMPT, max_new, drafter=make()))


def test_device_stops_eos_and_stop_ids():
    host, dev = engines(3, seed=3)  # a target whose greedy text does not repeat at once
    ar = host.generate_ar(PROMPT, 30).token_ids
    assert ar.index(ar[4]) == 4
    for sampling in SAMPLINGS:
        stop = host.generate(PROMPT, 30, sampling).token_ids[6]  # ends the decode by token 7
        a = host.generate(PROMPT, 30, sampling, stop_token_ids=[stop])
        b = dev.generate(PROMPT, 30, sampling, stop_token_ids=[stop])
        assert counts(b) == counts(a) and b.finish_reason == "stop"
        assert len(b.token_ids) <= 7 and b.token_ids[-1] == stop
    host.target.eos_token_ids = {ar[4]}
    try:
        assert counts(dev.generate(PROMPT, 30)) == counts(host.generate(PROMPT, 30))
        assert dev.generate(PROMPT, 30).token_ids == ar[:5]
    finally:
        host.target.eos_token_ids = set()


def test_a_stop_only_the_host_sees_emits_nothing_past_it(monkeypatch):
    """A stop string is the host's alone (the device ends only at EOS, stop ids, the budget):
    the device runs cycles past it, none of whose tokens reach on_token or the result."""
    host, dev = engines(4)
    real_feed = StopRule.feed

    def feed(rule, token):  # a stop "string" that ends at the 7th new token
        real_feed(rule, token)
        rule.ended = rule.ended or len(rule.ids) >= 7
        return rule.ended
    monkeypatch.setattr(StopRule, "feed", feed)
    seen_a, seen_b = [], []
    a = host.generate(PROMPT, 30, on_token=seen_a.append)
    b = dev.generate(PROMPT, 30, on_token=seen_b.append)
    assert seen_b == b.token_ids == a.token_ids == seen_a and len(a.token_ids) == 7
    assert counts(b) == counts(a)


@pytest.mark.parametrize("n", [2, 4])
def test_context_lookup_on_the_device(n, monkeypatch):
    """The context lookup (on by default) runs on the device: the host loop's tokens, counts
    and lookup counts, greedy and sampled, with the PDM (its gate) and with a drafter that has
    no confidence (the lookup's token always wins), on a prompt that repeats itself. Every
    steady cycle is the work a CUDA graph replays (SPD_REPLAY_CHECK)."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    t = make_tiny_target(seed=3 + n, vocab=48, layers=4)
    host = SPDEngine(t, n_stages=n)
    dev = SPDEngine(t, n_stages=n, pdm=host.pdm, device_loop=True)
    prompt = PROMPT * 3
    ar = host.generate_ar(prompt, 30).token_ids
    used = []
    for sampling in SAMPLINGS:
        for make in (lambda: None, lambda: looked_up(ReferenceDrafter(prompt + ar, 0.5, 2))):
            a = host.generate(prompt, 30, sampling, drafter=make())
            b = dev.generate(prompt, 30, sampling, drafter=make())
            assert b.stats.loop == "device"
            assert counts(b) == counts(a)
            assert (b.stats.lookup_judged, b.stats.lookup_accepted) == \
                (a.stats.lookup_judged, a.stats.lookup_accepted)
            used.append(a.stats.lookup_judged)
    assert used[1] and any(used[::2])  # the lookup proposed drafts that were judged
    # a PDM with a draft vocabulary of its own: the lookup's token may be outside it (the
    # host loop's q is then over every target id; the device loop's always is)
    pdm = PipelineDraftModule.untrained(t, host.layout, seed=4,
                                        draft_vocab=torch.arange(0, 48, 3))
    host, dev = (SPDEngine(t, n_stages=n, pdm=pdm, device_loop=d) for d in (False, True))
    a, b = (e.generate(prompt, 30, SAMPLINGS[1]) for e in (host, dev))
    assert b.stats.loop == "device" and counts(b) == counts(a)
    assert (b.stats.lookup_judged, b.stats.lookup_accepted) == \
        (a.stats.lookup_judged, a.stats.lookup_accepted)
    assert a.stats.lookup_judged > 0


def looked_up(drafter):
    drafter.lookup = 2  # a drafter asks for the lookup with its shortest match
    return drafter


def test_what_it_does_not_run_falls_back_with_a_warning():
    t = make_tiny_target(seed=3, vocab=48, layers=4)
    dev = SPDEngine(t, n_stages=2, device_loop=True, tree_width=2)
    with pytest.warns(UserWarning, match="token trees"):
        assert dev.generate(PROMPT, 8).stats.loop == "host"
    dev = SPDEngine(t, n_stages=2, device_loop=True)
    with pytest.warns(UserWarning, match="shorter than n"):
        dev.generate(PROMPT[:1], 5)


def test_ahead_is_checked():
    t = make_tiny_target(seed=3, vocab=48, layers=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(Exception, match="ahead"):
            SPDEngine(t, n_stages=2, ahead=bad)


probe = bench_module("probe_host_reads")


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_steady_cycles_read_nothing_and_copy_no_python_value(sampling):
    """Every cycle from the first to the last launched: no tensor read on the host, no tensor
    made from a Python value, outside spd_kernels (its CPU reference paths; a GPU runs its
    kernels). The host's reads of the published state (pinned memory behind an event) are
    logged apart: one per cycle up to the last."""
    host, dev = engines(4, seed=2)
    ar = host.generate_ar(PROMPT, 40).token_ids
    log: list = []
    with probe.CallLog(log, (DeviceLoop, "cycle"), (SequenceDecode, "finish")):
        with probe.ReadLog(log, where=True, copies=True):
            res = dev.generate(PROMPT, 40, sampling,
                               drafter=NoisyPDMDrafter(host.pdm, PROMPT + ar, 0.6, seed=4))
    cycles, host_reads = cycle_events(log)
    # the host read every cycle up to the last, and launched `ahead` more (no-ops)
    assert host_reads == res.stats.K > 10 and len(cycles) == res.stats.K + dev.ahead
    assert 0 < res.stats.drafts_accepted < res.stats.drafts_judged
    assert [c for c in cycles if c] == []


def cycle_events(log: list) -> tuple[list[list], int]:
    """(per cycle launched, the reads of device values and tensors made of Python values made
    outside spd_kernels; the host's reads of the published state) of a ReadLog + CallLog."""
    cycles, host_reads = [], 0
    for event in log:
        if event[0] == "finish":
            break
        if event[0] == "cycle":
            cycles.append([])
        elif event[0] == "host":
            host_reads += 1
        elif cycles and event[0] in ("read", "copy") and KERNELS not in event[2]:
            cycles[-1].append(event)
    return cycles, host_reads


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_lookup_cycles_read_nothing_and_copy_no_python_value(sampling):
    """The same with the context lookup proposing drafts (a prompt that repeats)."""
    t = make_tiny_target(seed=5, vocab=48, layers=4)
    dev = SPDEngine(t, n_stages=3, device_loop=True)
    log: list = []
    with probe.CallLog(log, (DeviceLoop, "cycle"), (SequenceDecode, "finish")):
        with probe.ReadLog(log, where=True, copies=True):
            res = dev.generate(PROMPT * 3, 30, sampling)
    cycles, host_reads = cycle_events(log)
    assert host_reads == res.stats.K and [c for c in cycles if c] == []
    assert res.stats.loop == "device"
