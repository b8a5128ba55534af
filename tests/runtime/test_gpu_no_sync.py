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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sampling", [SamplingParams(),
                                      SamplingParams(temperature=1.0, top_k=20, seed=11)],
                         ids=["greedy", "sampled"])
def test_gpu_single_process_decode_never_synchronises(sampling):
    from spd.model.target import TargetModel
    from spd.runtime.sequence import SequenceDecode
    on_reference = [op for op in HOT_OPS if dispatch.select(op, torch.device("cuda"))[0]
                    == "reference"]
    if on_reference:
        pytest.skip(f"no Triton or CUDA kernel for {on_reference} here: the reference ops "
                    "read values on the host")
    cpu = make_tiny_target(seed=6, vocab=64, layers=4)
    t = TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=3, lookup=2, warn_untrained=False)
    warm = eng.generate(PROMPT, 48, sampling)  # captures the graphs the checked run replays
    run = SequenceDecode.run

    def strict_run(self):
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(self)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SequenceDecode, "run", strict_run)
        res = eng.generate(PROMPT, 48, sampling)
    st = res.stats
    assert res.token_ids == warm.token_ids and len(res.token_ids) == 48
    assert st.drafts_accepted < st.drafts_judged  # rollbacks happened inside the checked loop
    assert st.lookup_judged > 0
    if sampling.greedy:
        assert res.token_ids == eng.generate_ar(PROMPT, 48).token_ids
        assert eng._stages[-1].verify_graphs.replays > 0
    assert eng.drafter.graphs is not None and eng.drafter.graphs.failed is None
