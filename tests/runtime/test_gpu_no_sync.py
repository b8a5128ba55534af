"""One GPU: the one-process cycle (spd.runtime.cycle) never synchronises the device, and replays
one CUDA graph a cycle.

Chain, token tree and a hybrid target, greedy and seeded sampling, the context lookup on, an
untrained PDM (rejections, refills) or a noisy tree drafter (gaps): `Cycle.run` runs under
CUDA's sync debug mode set to raise (no stream or device synchronisation, no blocking copy)
from its first cycle to its last. The host reads each cycle's published state by waiting on an
event after its copy to pinned memory, which that mode does not flag. The capture of the cycle's
graph (at its second launch) synchronises as it begins: it runs with the mode relaxed, and every
later cycle is one replay. The CPU counterpart, which counts host reads and copies of Python
values per cycle without a GPU, is tests/runtime/test_cycle_reads.py.

Needs one GPU and the Triton or CUDA kernels (the reference ops read values on the host): run
by benchmarks/device_session.sh on a lent machine.
"""
from __future__ import annotations

import pytest
import torch
from conftest import NoisyTreeDrafter, make_tiny_hybrid, make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd_kernels import dispatch

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5, 9]
HOT_OPS = ("anchor_projection", "qkv_rope_append", "cache_attention", "fused_linear",
           "fused_swiglu", "verify_greedy", "rejection_sample_logits", "tree_attention",
           "tree_rejection_sample")


def in_sync_mode(fn, mode: str, after: str):
    """`fn` run with CUDA's sync debug mode set to `mode`, then to `after`."""
    def wrapped(*args):
        torch.cuda.set_sync_debug_mode(mode)
        try:
            return fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode(after)
    return wrapped


def cuda_target(kind: str):
    """The tiny target on the GPU, or a skip where a hot op would run its reference (the
    reference ops read values on the host)."""
    from spd.model.target import TargetModel
    on_reference = [op for op in HOT_OPS if dispatch.select(op, torch.device("cuda"))[0]
                    == "reference"]
    if on_reference:
        pytest.skip(f"no Triton or CUDA kernel for {on_reference} here: the reference ops "
                    "read values on the host")
    cpu = make_tiny_hybrid(seed=6) if kind == "hybrid" else make_tiny_target(seed=6, vocab=64,
                                                                              layers=4)
    return TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=1.0, top_k=20, seed=11)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["chain", "tree", "hybrid"])
def test_gpu_cycle_replays_one_graph_and_never_synchronises(kind, sampling):
    from spd.runtime.cycle import Cycle
    from spd.runtime.cycle_graph import CycleGraph
    t = cuda_target(kind)
    width = 4 if kind == "tree" else 1
    eng = SPDEngine(t, n_stages=3, lookup=2, tree_width=width, warn_untrained=False)
    ar = eng.generate_ar(PROMPT, 48).token_ids
    make = ((lambda: NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.5, 2)) if kind == "tree"
            else (lambda: None))
    warm = eng.generate(PROMPT, 48, sampling, drafter=make())  # the steps' kernels compiled
    cycles, run = [], Cycle.run
    recorded = lambda cycle: (cycles.append(cycle), run(cycle))  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Cycle, "run", in_sync_mode(recorded, "error", "default"))
        mp.setattr(CycleGraph, "_capture", in_sync_mode(CycleGraph._capture, "default", "error"))
        res = eng.generate(PROMPT, 48, sampling, drafter=make())
    (cycle,) = cycles
    graph = cycle.graph.describe()
    assert graph["eager"] is None and graph["replays"] >= res.stats.K - 1 > 0
    assert res.token_ids == warm.token_ids and len(res.token_ids) == 48
    assert res.stats.drafts_accepted < res.stats.drafts_judged  # rejections were replayed
    if sampling.greedy:
        assert res.token_ids == ar


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=1.0, top_k=20, seed=11)],
                         ids=["greedy", "sampled"])
def test_gpu_batched_cycle_never_synchronises(sampling):
    """Several sequences through one pipeline (spd.runtime.batch_spd): after the first cycle of
    the batch, every step of it (a graph's captures aside) runs under the sync debug mode set to
    raise; the cycles replay CUDA graphs (one per set of sequences decoding together), and each
    sequence equals its decode alone."""
    from spd.runtime.batch_spd import BatchedSPD
    from spd.runtime.cycle_graph import CycleGraph
    eng = SPDEngine(cuda_target("chain"), n_stages=4, warn_untrained=False, lookup=2)
    prompts = [PROMPT, PROMPT[3:], PROMPT[:6] * 2]
    batch = BatchedSPD(eng, 4, 96)
    joined = []
    for p in prompts:
        ids, max_new, rule = eng.prepare_request(p, 24, None, None)
        joined.append(batch.join(ids, max_new, sampling, rule))
    batch.step()
    steady = in_sync_mode(batch.step, "error", "default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CycleGraph, "_capture", in_sync_mode(CycleGraph._capture, "default", "error"))
        while batch.running:
            steady()
    got = batch.describe()
    assert got["captured"] >= 1 and got["replays"] >= 10, got
    for p, e in zip(prompts, joined):
        alone = eng.generate(p, 24, sampling)
        assert e.out == alone.token_ids and e.stats.K == alone.stats.K
