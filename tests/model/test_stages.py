"""Partitioned stages with project-owned caches reproduce the unpartitioned Hugging Face model."""
import pytest
import torch
from conftest import check_stages_match_hf, make_tiny_target

from spd.model.partition import partition_layers
from spd.model.target import Stage


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("split", [None, [1, 3], [2, 1, 1]])
def test_stages_match_full_model(model_type, split):
    t = make_tiny_target(seed=3, vocab=40, layers=4, model_type=model_type)
    n = 2 if split is None else len(split)
    ranges = partition_layers(t.num_layers, n, split)
    stages = [Stage(t, i, r, capacity=32) for i, r in enumerate(ranges)]
    check_stages_match_hf(t, stages)


def test_cache_overflow_and_gap_are_errors():
    from spd.errors import SPDError
    t = make_tiny_target()
    st = Stage(t, 0, range(0, 2), capacity=4)
    h = t.embed_tokens(torch.tensor([1, 2, 3]))
    st.forward(h, 0)
    with pytest.raises(SPDError, match="cache write at position 5"):
        st.forward(h[:1], 5)
    with pytest.raises(SPDError, match="overflow"):
        st.forward(h[:2], 3)


def test_fingerprint_ignores_load_dtype_but_not_weights():
    from spd.model.target import TargetModel
    t = make_tiny_target(seed=3)
    bf16 = TargetModel(make_tiny_target(seed=3).hf.to(torch.bfloat16), None)
    assert bf16.fingerprint() == t.fingerprint()
    assert make_tiny_target(seed=4).fingerprint() != t.fingerprint()
