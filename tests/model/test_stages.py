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


def test_cache_overflow_is_an_internal_error():
    from spd.errors import InternalError, SPDError
    t = make_tiny_target()
    st = Stage(t, 0, range(0, 2), capacity=4)
    h = t.embed_tokens(torch.tensor([1, 2, 3]))
    st.forward(h, 0)
    with pytest.raises(InternalError, match="overflow") as over:
        st.forward(h[:2], 3)
    assert over.value.context == {"rows": 5, "capacity": 4}
    assert not isinstance(over.value, SPDError)  # not the caller's fault


def test_fingerprint_ignores_load_dtype_but_not_weights():
    from spd.model.target import TargetModel
    t = make_tiny_target(seed=3)
    bf16 = TargetModel(make_tiny_target(seed=3).hf.to(torch.bfloat16), None)
    assert bf16.fingerprint() == t.fingerprint()
    assert make_tiny_target(seed=4).fingerprint() != t.fingerprint()


def test_step_at_a_device_position_equals_forward_and_rolls_back():
    """Stage.run at a device position (a stage rank's unit: never read on the host) gives
    forward's rows, and a lower position is a truncation: after rows that a
    rollback throws away, the same rows come out bit for bit; only the last stage may judge."""
    from spd.errors import InternalError
    t = make_tiny_target(seed=5, vocab=24, layers=4)
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(9, t.hidden_size, generator=g)
    wrong = torch.randn(3, t.hidden_size, generator=g)
    expect = Stage(t, 1, range(2, 4), capacity=16).forward(rows, 0)

    def decode(thrown_away):
        st = Stage(t, 1, range(2, 4), capacity=16, poison=True)  # dropped rows become NaN
        st.forward(rows[:5], 0)
        for i, row in enumerate(thrown_away):
            st.run(row[None], torch.tensor([5 + i]))
        outs = []
        for i in range(5, 9):  # from position 5: the thrown-away rows are overwritten
            layer_outs, verdict = st.run(rows[i:i + 1], torch.tensor([i]))
            assert verdict is None and len(layer_outs) == 2
            outs.append(layer_outs[-1])
        assert int(st.cache.lengths[0]) == 9
        return torch.cat(outs)
    plain = decode([])
    assert torch.equal(decode(wrong), plain)
    torch.testing.assert_close(plain, expect[5:])  # one row at a time vs one chunk
    first = Stage(t, 0, range(0, 2), capacity=16)
    with pytest.raises(InternalError, match="only the last stage can verify"):
        first.run(rows[:1], torch.tensor([0]), torch.tensor([3]))
