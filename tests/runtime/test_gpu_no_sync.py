"""One GPU: the single-process engine's decode loop never synchronises the device.

From its first cycle to its last, greedy and seeded sampling, with the context lookup on and an
untrained PDM (so rejections roll every cache back), `SequenceDecode.run` runs under CUDA's sync
debug mode set to raise: no stream or device synchronisation, no blocking copy. Each judged
cycle reads its verdict by waiting on an event after the verdict's own copy to pinned memory
(spd.device.to_host), which that mode does not flag. A first decode of the same request
captures every CUDA graph the checked one replays (a capture itself synchronises). What a decode
copies to the device once (the prompt, its table of the drafter's row types) is copied before
`run`, outside the checked loop: the first cycle of each staircase is checked like any other.
The CPU counterpart, which counts copies of Python values per cycle without a GPU, is
tests/runtime/test_host_copies.py.

Needs one GPU and the Triton or CUDA kernels (the reference ops read values on the host): run
by benchmarks/device_session.sh on a lent machine. The three-GPU NCCL counterpart is
tests/distributed/test_host_reads.py::test_gpu_steady_state_never_synchronises.
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd_kernels import dispatch

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9]
HOT_OPS = ("anchor_projection", "qkv_rope_append", "cache_attention", "fused_linear",
           "fused_swiglu", "verify_greedy", "rejection_sample_logits", "truncate_kv")

greedy_and_sampled = pytest.mark.parametrize(
    "sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=11)],
    ids=["greedy", "sampled"])


def in_sync_mode(fn, mode: str, after: str):
    """`fn` run with CUDA's sync debug mode set to `mode`, then to `after`."""
    def wrapped(*args):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(after)
    return wrapped


def cuda_target():
    """The tiny target on the GPU, or a skip where a hot op would run its reference (the
    reference ops read values on the host)."""
    from spd.model.target import TargetModel
    on_reference = [op for op in HOT_OPS if dispatch.select(op, torch.device("cuda"))[0]
                    == "reference"]
    if on_reference:
        pytest.skip(f"no Triton or CUDA kernel for {on_reference} here: the reference ops "
                    "read values on the host")
    cpu = make_tiny_target(seed=6, vocab=64, layers=4)
    return TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)


@pytest.mark.gpu
@needs_gpu
@greedy_and_sampled
def test_gpu_single_process_decode_never_synchronises(sampling):
    from spd.runtime.sequence import SequenceDecode
    t = cuda_target()
    eng = SPDEngine(t, n_stages=3, lookup=2, warn_untrained=False)
    warm = eng.generate(PROMPT, 48, sampling)  # captures the graphs the checked run replays
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SequenceDecode, "run", in_sync_mode(SequenceDecode.run, "error", "default"))
        res = eng.generate(PROMPT, 48, sampling)
    st = res.stats
    assert res.token_ids == warm.token_ids and len(res.token_ids) == 48
    assert st.drafts_accepted < st.drafts_judged  # rollbacks happened inside the checked loop
    assert st.lookup_judged > 0
    if sampling.greedy:
        assert res.token_ids == eng.generate_ar(PROMPT, 48).token_ids
        assert eng._stages[-1].verify_graphs.replays > 0
    assert eng.drafter.graphs is not None and eng.drafter.graphs.failed is None


@pytest.mark.gpu
@needs_gpu
@greedy_and_sampled
def test_gpu_device_loop_replays_one_graph_a_cycle_and_never_synchronises(sampling):
    """The device loop (spd.runtime.device_loop): after its first, eager cycle and the capture
    of the second (a capture synchronises: left out of the check), every cycle is one replay
    and nothing synchronises; greedy, the tokens are the host loop's and AR's. Both loops draw
    their uniforms from the decode's generator on the GPU (Philox), in the same order: with a
    drafter that reads no features, the sampled tokens and counts are the host loop's too."""
    from spd.draft.drafters import ReferenceDrafter
    from spd.runtime.cycle_graph import CycleGraph
    from spd.runtime.device_loop import DeviceLoop
    t = cuda_target()
    host = SPDEngine(t, n_stages=3, lookup=0, warn_untrained=False)
    eng = SPDEngine(t, n_stages=3, lookup=0, pdm=host.pdm, device_loop=True)
    warm = eng.generate(PROMPT, 48, sampling)
    loops, run = [], DeviceLoop.run
    recorded = lambda loop: (loops.append(loop), run(loop))  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeviceLoop, "run", in_sync_mode(recorded, "error", "default"))
        mp.setattr(CycleGraph, "_capture", in_sync_mode(CycleGraph._capture, "default", "error"))
        res = eng.generate(PROMPT, 48, sampling)
    (loop,) = loops
    assert loop.graph_failed is None and loop.replays >= res.stats.K - 1 > 0
    assert res.stats.loop == "device" and res.token_ids == warm.token_ids
    assert res.stats.drafts_accepted < res.stats.drafts_judged  # rejections were replayed
    if sampling.greedy:
        assert res.token_ids == host.generate(PROMPT, 48).token_ids
        assert res.token_ids == eng.generate_ar(PROMPT, 48).token_ids
    ref = PROMPT + host.generate_ar(PROMPT, 48).token_ids
    a, b = (e.generate(PROMPT, 40, sampling, drafter=ReferenceDrafter(ref, 0.6, seed=3))
            for e in (host, eng))
    assert b.stats.loop == "device" and a.stats.loop == "host"
    assert (b.token_ids, b.stats.K, b.stats.drafts_accepted) == \
        (a.token_ids, a.stats.K, a.stats.drafts_accepted)
