"""The device loop across ranks (spd.distributed.device_cycle), on the CPU over gloo: the single-
process engine's tokens, N, K and judged/accepted drafts, every rank in lock-step, and per steady
cycle the messages and host reads of each rank."""
from __future__ import annotations

import json
import time
from functools import partial

import pytest
import torch
from conftest import bench_module, make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.emulate import tiny_target
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.draft.drafters import ReferenceDrafter

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
probe = bench_module("probe_host_reads")


def tiny_factory(seed: int, rank: int, layers: int = 4):
    return make_tiny_target(seed=seed, vocab=48, layers=layers)


def _expect(eng, req: GenerateRequest, kw: dict):
    return eng.generate(req.prompt_ids, req.max_new_tokens, req.sampling, **kw)


def _same(g, e) -> None:
    assert g.token_ids == e.token_ids
    assert (g.stats.N, g.stats.K, g.stats.drafts_judged, g.stats.drafts_accepted) == \
        (e.stats.N, e.stats.K, e.stats.drafts_judged, e.stats.drafts_accepted)
    assert g.stats.by_position == e.stats.by_position


@pytest.mark.parametrize("n,ahead", [(2, 2), (3, 0), (4, 1),
                                     pytest.param(8, 2, marks=pytest.mark.slow)])  # nine ranks
def test_device_loop_ranks_equal_the_single_process_engine(n, ahead, monkeypatch):
    """Greedy with rejections, seeded sampling, the untrained PDM, budgets of 1 and 2 tokens
    and a stop id: the one-process engine's tokens and counts, and every rank ran the same
    cycles (rank 0's stats and each stage rank's). Every rank's steady cycles are the same
    work, op for op and tensor for tensor, messages included (SPD_REPLAY_CHECK): what one CUDA
    graph per cycle replays under NCCL."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")  # (the ranks inherit it)
    t = make_tiny_target(seed=20 + n, vocab=48, layers=max(4, n))
    eng = SPDEngine(t, n_stages=n, lookup=0)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    ref = PROMPT + ar
    sp = SamplingParams(temperature=1.0, top_k=10, seed=7)
    cases = [
        (GenerateRequest(PROMPT, 24, reference=ref, reference_accuracy=0.6, reference_seed=n),
         {"drafter": ReferenceDrafter(ref, 0.6, n)}),                  # accept and reject
        (GenerateRequest(PROMPT, 20), {}),                              # untrained PDM
        (GenerateRequest(PROMPT, 20, sp, reference=ref, reference_accuracy=0.6,
                         reference_seed=1), {"drafter": ReferenceDrafter(ref, 0.6, 1)}),
        (GenerateRequest(PROMPT, 1), {}),                               # the first token ends it
        (GenerateRequest(PROMPT, 2, reference=ref), {"drafter": ReferenceDrafter(ref)}),
    ]
    if n == 8:  # (nine processes: the two cases that reject)
        cases = [cases[0], cases[2]]
    expected = [_expect(eng, r, kw) for r, kw in cases]
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, 20 + n, layers=max(4, n)),
                        lookup=0,
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True, ahead=ahead)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=200)
    for g, e in zip(got, expected):
        _same(g, e)
        d = g.stats.distributed
        assert g.stats.loop == "device" and d["loop"] == "device" and d["ahead"] == ahead
        # every stage rank ran rank 0's cycles, a forward each
        assert all(r["units_worked"] == d["cycles_run"] for r in d["ranks"][1:])
        # every steady cycle checked against the first (the warm-up and, on a stage, the
        # last cycle are not replayed)
        eager = "its messages cannot be captured"  # (gloo)
        assert d["graph"] == {"replays": 0, "checked": d["cycles_run"] - 2, "eager": eager}
        for r in d["ranks"][1:]:
            assert r["graph"] == {"replays": 0, "checked": max(0, d["cycles_run"] - 3),
                                  "eager": eager}, r["rank"]
        json.dumps(g.stats.as_dict())
    assert 0 < got[0].stats.drafts_accepted < got[0].stats.drafts_judged
    assert got[1 if n == 8 else 2].token_ids != got[0].token_ids  # sampling sampled


@pytest.mark.parametrize("n,on_stage", [(2, 0), (4, 3)])
def test_device_loop_with_the_draft_on_a_stage(n, on_stage):
    """n processes (--draft-on-stage): rank 0's cycle and stage S's run on two threads of one
    process, their messages through the in-process mailbox; the one-process engine's tokens and
    counts, greedy with rejections and seeded sampling."""
    t = make_tiny_target(seed=60 + n, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n, lookup=0)
    ref = PROMPT + eng.generate_ar(PROMPT, 40).token_ids
    sp = SamplingParams(temperature=1.0, seed=5)
    cases = [(GenerateRequest(PROMPT, 24, reference=ref, reference_accuracy=0.6,
                              reference_seed=1), {"drafter": ReferenceDrafter(ref, 0.6, 1)}),
             (GenerateRequest(PROMPT, 20, sp), {})]
    expected = [_expect(eng, r, kw) for r, kw in cases]
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, 60 + n), lookup=0,
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True,
                        draft_on_stage=on_stage)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=200)
    for g, e in zip(got, expected):
        _same(g, e)
        assert g.stats.loop == "device" and g.stats.distributed["processes"] == n


def test_device_loop_lookup_stop_id_and_fallback():
    """The context lookup (on) on a prompt that repeats, greedy and sampled; a stop id ends the
    decode on the device (the ranks run on to the end cycle); a decode the device loop does not
    run (a prompt shorter than n) warns and runs on the unit protocol."""
    n = 3
    t = make_tiny_target(seed=31, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n)
    ar = eng.generate_ar(PROMPT, 30).token_ids
    stop_at = ar[6]
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, 31),
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True)
    short, stopped, *looked = launch_local(
        config, partial(_short_stopped_and_looked_up, stop_at=stop_at), timeout=150)
    assert short.stats.loop == "host"
    assert short.token_ids == eng.generate(PROMPT[:2], 12).token_ids
    _same(stopped, eng.generate(PROMPT, 30, stop_token_ids=[stop_at]))
    assert stopped.token_ids[-1] == stop_at and stopped.stats.loop == "device"
    for got, sampling in zip(looked, LOOKUP_SAMPLINGS):
        e = eng.generate(PROMPT * 3, 24, sampling)
        _same(got, e)
        assert (got.stats.lookup_judged, got.stats.lookup_accepted) == \
            (e.stats.lookup_judged, e.stats.lookup_accepted)
    assert looked[0].stats.lookup_judged > 0


LOOKUP_SAMPLINGS = (SamplingParams(), SamplingParams(temperature=0.9, seed=2))


def test_device_loop_tree_runs_on_the_unit_protocol():
    """Token trees are not on the device loop: with --device-loop a tree decode warns and runs
    the unit protocol (the documented slower path), with the one-process engine's tokens."""
    n, width = 2, 2
    t = make_tiny_target(seed=33, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n, tree_width=width)
    sp = SamplingParams(temperature=1.0, top_k=10, seed=4)
    expected = [eng.generate(PROMPT, 16), eng.generate(PROMPT, 16, sp)]
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, 33),
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True, tree_width=width)
    got = launch_local(config, partial(_tree_warned, sp=sp), timeout=150)
    for g, e in zip(got, expected):
        _same(g, e)
        assert g.stats.loop == "host" and g.stats.tree_width == width


def _tree_warned(engine, sp):
    with pytest.warns(UserWarning, match="token trees"):
        return [engine.generate(PROMPT, 16), engine.generate(PROMPT, 16, sp)]


def _short_stopped_and_looked_up(engine, stop_at: int):
    with pytest.warns(UserWarning, match="shorter than n"):
        short = engine.generate(PROMPT[:2], 12)
    return [short, engine.generate(PROMPT, 30, stop_token_ids=[stop_at])] + \
        [engine.generate(PROMPT * 3, 24, sampling) for sampling in LOOKUP_SAMPLINGS]


def _cancelled_then_whole(engine, after: int):
    """A decode cancelled from the host once `after` tokens are out (the server's disconnect:
    the host ends it, the ranks run on to the end cycle), then a whole one: still in step."""
    import threading
    cancel = threading.Event()

    def seen(_tok, count=[0]):  # noqa: B006 - a counter across calls
        count[0] += 1
        if count[0] == after:
            cancel.set()
    first = engine.generate(PROMPT, 30, on_token=seen, cancel=cancel)
    return first, engine.generate(PROMPT, 30)


@pytest.mark.parametrize("ahead", [3])
def test_device_loop_cancelled_by_the_host_keeps_the_ranks_in_step(ahead):
    """The host ends the decode (a cancel, as a stop string would): it emits nothing past the
    token after the cancel, and the next request on the same ranks gives the one-process
    engine's tokens and counts."""
    t = make_tiny_target(seed=33, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=3, lookup=0)
    config = DistConfig(n_stages=3, target_factory=partial(tiny_factory, 33), lookup=0,
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True, ahead=ahead)
    cancelled, whole = launch_local(config, partial(_cancelled_then_whole, after=5),
                                    timeout=150)
    e = eng.generate(PROMPT, 30)
    assert cancelled.token_ids == e.token_ids[:6] and cancelled.stats.loop == "device"
    assert cancelled.stats.distributed["cycles_run"] < e.stats.K
    _same(whole, e)


def _counting_factory(rank: int):
    if rank != 0:
        probe.log_stage_runs("reads", where=True, copies=True)
    return make_tiny_target(seed=41, vocab=48, layers=4)


def _counted_job(engine, request):
    from spd.runtime.device_loop import DeviceLoop
    log: list = []
    with probe.CallLog(log, (DeviceLoop, "cycle")):
        with probe.ReadLog(log, where=True, copies=True):
            result = run_requests([request], engine)[0]
    stages = [json.loads(engine.rt.store.get(f"test/reads/1/{r}")) for r in range(1, engine.n + 1)]
    return result, log, stages


@pytest.mark.parametrize("greedy", [False])  # (greedy sends the same messages)
def test_device_loop_messages_and_host_reads_per_cycle(greedy):
    """Per cycle: rank 0 sends stage 0 one unit and receives a snap from every stage with
    anchors (the last always); stage s receives one unit (none in cycle 0 past stage 0), sends
    one on (none in the last cycle, none from the last stage) and one snap; nothing on a
    control group. No stage reads a tensor but its `end` (published, `ahead` cycles late); rank
    0 reads only each cycle's published state. No rank makes a tensor of a Python value in a
    cycle."""
    n = 3
    t = make_tiny_target(seed=41, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n, lookup=0)
    ref = PROMPT + eng.generate_ar(PROMPT, 30).token_ids
    sp = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=3)
    request = GenerateRequest(PROMPT, 24, sp, reference=ref, reference_accuracy=0.7,
                              reference_seed=2)
    config = DistConfig(n_stages=n, target_factory=_counting_factory, lookup=0,
                        fault_timeout=5.0, op_timeout=60.0, device_loop=True)
    result, log, stages = launch_local(config, partial(_counted_job, request=request),
                                       timeout=150)
    d = result.stats.distributed
    C = d["cycles_run"]
    msgs = d["messages_per_cycle"]
    snapping = [s for s in range(n) if eng.layout.anchors_of_stage(s)] + [n - 1]
    assert msgs["0"] == pytest.approx({"send/data": 1.0, "recv/data": len(set(snapping))})
    for s in range(n):
        got = msgs[str(s + 1)]
        recv = C if s == 0 else C - 1
        send = (C - 1 if s < n - 1 else 0) + (C if s in snapping else 0)
        assert got == pytest.approx({"send/data": send / C, "recv/data": recv / C}), s
    # rank 0: no read of a device value; between two cycles' launches at most one read of
    # the published state (host memory: ReadLog logs it as "host"), made outside spd_kernels
    cycles = []
    for event in log:
        if event[0] == "cycle":
            cycles.append([])
        elif cycles and event[0] in ("read", "host", "copy") and "spd_kernels" not in str(event):
            cycles[-1].append(event[0])
    assert len(cycles) == C
    assert all(c in ([], ["host"]) for c in cycles), [c for c in cycles if len(c) > 1][:2]
    assert sum(map(len, cycles)) >= C - (n + 3)  # read until the end cycle is known
    # stage ranks: no read of a device value; the host copy of `end`, read for every cycle
    # until the end cycle is known
    for slog in stages:
        assert [e for e in slog if e[0] == "read" and "spd_kernels" not in e[2]] == []
        # tensors made from Python values: the set-up's (the prompt, the bubble) only
        copies = [e for e in slog if e[0] == "copy" and "spd_kernels" not in e[2]]
        assert len(copies) <= 4 < C, copies
        assert C - 2 * (n + 3) <= sum(e[0] == "host" for e in slog) <= C


@pytest.mark.parametrize("rank,action", [(2, "kill")])
def test_a_failing_rank_in_the_device_loop_stops_every_rank(rank, action):
    """A stage rank killed, or rank 0 raising, in the middle of the lock-step cycles: the run
    ends within the fault timeout naming that rank (its peers are blocked in a receive)."""
    from spd.distributed.faults import RankFailedError
    config = DistConfig(n_stages=3, target_factory=partial(tiny_factory, 5), fault_timeout=3.0,
                        op_timeout=60.0, lookup=0, device_loop=True,
                        fault={"rank": rank, "cycle": 6, "action": action})
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 40)]), timeout=120)
    err = info.value
    assert err.rank == rank and ("stage 1" if rank == 2 else "draft rank") in str(err)
    assert err.stopped_s < config.fault_timeout + 2.5
    assert time.monotonic() - t0 < 60


def _strict_factory(rank: int):
    """A CUDA target; every rank's decode loop runs with synchronisation raising, but for the
    capture of its cycle (torch.cuda.graph synchronises as it begins)."""
    from spd.distributed.device_cycle import StageCycles
    from spd.runtime.cycle_graph import CycleGraph
    from spd.runtime.device_loop import DeviceLoop

    def in_mode(run, mode, after):
        def wrapped(self):
            torch.cuda.set_sync_debug_mode(mode)
            try:
                return run(self)
            finally:
                torch.cuda.set_sync_debug_mode(after)
        return wrapped
    StageCycles.run = in_mode(StageCycles.run, "error", "default")
    DeviceLoop.run = in_mode(DeviceLoop.run, "error", "default")
    CycleGraph._capture = in_mode(CycleGraph._capture, "default", "error")
    return tiny_target(51, 4, device="cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 3,
                    reason="NCCL needs one GPU per rank (3 for n = 2)")
@pytest.mark.parametrize("temperature,graphs", [(0.0, "1"), (1.0, "1"), (0.0, "0")])
def test_gpu_device_loop_over_nccl_never_synchronises(temperature, graphs, monkeypatch):
    """n = 2 over NCCL, greedy and sampled: no rank synchronises the device in its decode loop
    (the host reads only published pinned copies behind events); every rank's steady cycle is
    one CUDA graph's replay, its messages inside it (or eager, SPD_CUDA_GRAPHS=0); greedy gives
    the one-process engine's tokens."""
    monkeypatch.setenv("SPD_CUDA_GRAPHS", graphs)
    n = 2
    sp = SamplingParams(temperature=temperature, seed=3)
    config = DistConfig(n_stages=n, target_factory=_strict_factory, device="cuda",
                        backend="nccl", lookup=0, fault_timeout=10.0, op_timeout=60.0,
                        device_loop=True)
    got = launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 24, sp)]),
                       timeout=240)[0]
    assert got.stats.loop == "device" and len(got.token_ids) == 24
    d = got.stats.distributed
    for graph in [d["graph"]] + [r["graph"] for r in d["ranks"][1:]]:
        assert (graph["eager"] is None and graph["replays"] > 10) if graphs == "1" else \
            (graph["eager"] == "off" and graph["replays"] == 0), graph
    if temperature == 0.0:
        t = tiny_target(51, 4, device="cuda")
        assert got.token_ids == SPDEngine(t, n_stages=n, lookup=0).generate(PROMPT, 24).token_ids
