"""Hybrid targets (Qwen3.5 text, Qwen3-Next): partitioned stages with their own caches (KV for
gated attention, state rings for Gated DeltaNet) reproduce the unpartitioned Hugging Face model."""
import pytest
import torch
from conftest import check_stages_match_hf, make_tiny_hybrid, needs_triton_interpreter

from spd.model.partition import partition_layers
from spd.model.target import Stage
from spd_kernels import use_backend

PATTERNS = {
    "linear-first": ("linear_attention", "full_attention", "linear_attention",
                     "linear_attention"),
    "full-first": ("full_attention", "linear_attention", "linear_attention", "full_attention"),
}


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("split", [None, [1, 3], [2, 1, 1]])
def test_hybrid_stages_match_hugging_face(model_type, pattern, split):
    t = make_tiny_hybrid(seed=3, vocab=40, model_type=model_type, layer_types=PATTERNS[pattern])
    n = 2 if split is None else len(split)
    ranges = partition_layers(t.num_layers, n, split)
    stages = [Stage(t, i, r, capacity=32, poison=True, max_rollback=n) for i, r in
              enumerate(ranges)]
    check_stages_match_hf(t, stages)


@needs_triton_interpreter
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
def test_hybrid_stage_on_triton_kernels_equals_reference():
    """Every op of the hybrid stage step on its Triton kernel (the DeltaNet step and conv ring
    included, position from the device length), across a truncation: the reference's outputs."""
    t = make_tiny_hybrid(seed=2, vocab=40, layer_types=PATTERNS["full-first"])
    ids = torch.randint(0, 40, (12,), generator=torch.Generator().manual_seed(3))
    outs = {}
    for backend in ("reference", "triton"):
        st = Stage(t, 0, range(t.num_layers), capacity=32, poison=True, max_rollback=3)
        got = []
        with use_backend(backend):
            for pos, rows in ((0, 6), (6, 3)):
                got.append(st.forward(t.embed_tokens(ids[pos:pos + rows]), pos).clone())
            st.cache.truncate(7)
            for pos in range(7, 12):
                got.append(st._device_step(t.embed_tokens(ids[pos:pos + 1]),
                                              torch.tensor([pos]))[-1].clone())
        outs[backend] = torch.cat(got)
    assert not outs["triton"].isnan().any()
    torch.testing.assert_close(outs["triton"], outs["reference"], rtol=1e-4, atol=1e-5)
