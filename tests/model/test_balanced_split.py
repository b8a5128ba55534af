"""The automatic split (spd.model.partition.balanced_split, `--split auto`) and the bytes-based
cost model it uses by default (spd.model.stage_costs)."""
import itertools
import json
import logging
import random

import pytest
import torch

from spd.errors import SPDError
from spd.model.partition import (
    AUTO,
    DepthLayout,
    balanced_split,
    parse_split,
    partition_layers,
    stage_times,
)
from spd.model.stage_costs import (
    StepCosts,
    draft_step_cost,
    file_costs,
    pdm_step_bytes,
    resolve_split,
    target_costs,
)


def _spread(costs, split, head=0.0, extra=None):
    t = stage_times(costs, split, head, extra)
    return max(t) - min(t)


def test_uniform_costs_give_the_uniform_split():
    for L in range(1, 40):
        for n in range(1, min(L, 9) + 1):
            assert balanced_split([2.5] * L, n) == [len(r) for r in partition_layers(L, n)]


@pytest.mark.parametrize("L", [24, 30, 36])
@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_stage_times_within_one_layer_with_the_head_and_a_draft(L, n):
    """Head on the last stage (0..8 layers' worth) and a draft (0..3 layers) on stage S: the
    slowest and the fastest stage differ by at most one layer's cost."""
    for head, draft in itertools.product((0.0, 1.0, 3.5, 8.0), (0.0, 0.7, 2.0, 3.0)):
        for S in range(n):
            extra = {S: draft}
            split = balanced_split([1.0] * L, n, head, extra)
            assert sum(split) == L and min(split) >= 1
            if min(split[S], split[-1]) >= 2:  # no stage pinned to one layer by its extra
                assert _spread([1.0] * L, split, head, extra) <= 1.0 + 1e-9, (split, head, S)


def test_hybrid_costs_within_one_layer():
    """Three linear-attention layers, then a dearer full-attention one (Qwen3.5's pattern)."""
    rng = random.Random(0)
    for _ in range(300):
        L = rng.randint(8, 40)
        n = rng.randint(2, min(8, L // 2))
        costs = [1.3 if i % 4 == 3 else 1.0 for i in range(L)]
        head, S = rng.uniform(0, 4), rng.randrange(n)
        extra = {S: rng.uniform(0, 2)}
        split = balanced_split(costs, n, head, extra)
        if min(split[S], split[-1]) >= 2:
            assert _spread(costs, split, head, extra) <= 1.3 + 1e-9


def test_balanced_split_is_optimal_against_brute_force():
    """Slowest stage least; then fastest stage greatest; then larger stages first."""
    rng = random.Random(1)
    for _ in range(150):
        L, n = rng.randint(1, 9), rng.randint(1, 4)
        if n > L:
            continue
        costs = [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(L)]
        head, extra = rng.choice([0.0, 1.0, 2.5]), {rng.randrange(n): rng.choice([0.0, 1.5])}
        found = balanced_split(costs, n, head, extra)
        splits = [list(c) for c in itertools.product(range(1, L + 1), repeat=n) if sum(c) == L]
        key = [(max(t), -min(t), [-x for x in s]) for s in splits
               for t in [stage_times(costs, s, head, extra)]]
        want = splits[key.index(min(key))]
        assert found == want, (costs, n, head, extra)


def test_head_shortens_the_last_stage():
    # SmolLM2-135M-like: the LM head reads about 7.2 layers' bytes
    assert balanced_split([1.0] * 30, 3, 7.2) == [13, 12, 5]
    assert balanced_split([1.0] * 30, 3, 7.2, {0: 3.0}) == [11, 13, 6]


def test_impossible_requests_are_refused():
    with pytest.raises(SPDError, match="cannot cut a 4-layer model into 5 stages"):
        balanced_split([1.0] * 4, 5)
    with pytest.raises(SPDError, match="stages are numbered 0..3"):
        balanced_split([1.0] * 8, 4, extra={4: 1.0})
    with pytest.raises(SPDError, match="positive integer"):
        balanced_split([1.0] * 8, 0)
    with pytest.raises(SPDError, match=">= 0"):
        balanced_split([1.0, -1.0], 1)


def test_an_extra_larger_than_a_cycle_keeps_one_layer_and_warns(caplog):
    """A draft dearer than the other stages' cycle: its stage keeps one layer (a stage never
    gets none) and the split says so in a warning; it stays the min-max split."""
    with caplog.at_level(logging.WARNING, logger="spd.model.partition"):
        split = balanced_split([1.0] * 10, 4, extra={0: 20.0})
    assert split == [1, 3, 3, 3]
    assert "stage 0 keeps one layer and is still the slowest" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="spd.model.partition"):
        balanced_split([1.0] * 10, 4, 1.0, {0: 1.0})
    assert caplog.text == ""


def test_parse_and_resolve_split():
    assert parse_split("auto") == AUTO and parse_split(" AUTO ") == AUTO
    costs = StepCosts([1.0] * 30, 7.2)
    assert resolve_split(None, costs, 3) is None
    assert resolve_split("10,10,10", costs, 3) == [10, 10, 10]
    assert resolve_split("auto", costs, 3) == [13, 12, 5]
    assert resolve_split("auto", lambda: costs, 3, draft_on_stage=0, draft_cost=3.0) == \
        [11, 13, 6]
    with pytest.raises(SPDError, match="stages are numbered 0..2"):
        resolve_split("auto", costs, 3, draft_on_stage=3)
    with pytest.raises(SPDError, match="comma-separated integers"):
        resolve_split("8,x", costs, 3)
    # a layout built on it keeps the DepthLayout API
    assert DepthLayout.build(30, 3, resolve_split("auto", costs, 3)).split == [13, 12, 5]


def test_pdm_step_bytes_hand_count():
    """d = 8 (target and PDM), 2 heads of 4, 1 KV head, MLP 16, one layer, draft vocab 10,
    types [0, 1], 5 cached positions, bf16."""
    b = pdm_step_bytes(8, 8, 2, 1, 4, 16, 1, 10, [0, 1], 5, el=2)
    anchor = (8 * 8 + 8) * 2 + (8 * 16 + 8) * 2
    layer = (8 * 8 + 4 * 8 + 4 * 8 + 8 * 8 + 2 * 4 + 3 * 16 * 8 + 2 * 8) * 2
    head = (10 * 8 + 8) * 2
    kv = 2 * 4 * 5 * 2
    assert b == dict(anchor=anchor, layers=layer, head=head, kv=kv,
                     total=anchor + layer + head + kv)
    q = pdm_step_bytes(8, 8, 2, 1, 4, 16, 1, 10, [0, 1], 5, el=2, weights="int8")
    # 2-D weights: one byte each plus an fp32 scale per output row; norms, biases, KV unchanged
    assert q["anchor"] == (8 * 8 + 4 * 8 + 8 * 2) + (8 * 16 + 4 * 8 + 8 * 2)
    assert q["head"] == 10 * 8 + 4 * 10 + 8 * 2 and q["kv"] == kv


def test_pdm_step_bytes_match_a_built_pdm(tiny_target):
    """The formula against the parameters of a real PDM (spd.draft.pdm) at fill n."""
    from spd.draft.pdm import PipelineDraftModule, pdm_config_for
    t = tiny_target
    layout = DepthLayout.build(t.num_layers, 2)
    cfg = pdm_config_for(t, layout, num_layers=2, draft_vocab_size=16)
    pdm = PipelineDraftModule(cfg).to(torch.bfloat16)
    params = sum(p.numel() * p.element_size() for p in pdm.parameters())
    b = pdm_step_bytes(cfg.hidden_size, t.hidden_size, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim, cfg.intermediate_size, 2, 16, layout.types, 0, el=2)
    assert b["total"] == params
    assert draft_step_cost(t.config, 2, 2, 16, context=0) == params


def test_target_costs_count_weights_kv_and_head(tiny_target):
    t = tiny_target
    c = target_costs(t, context=7)
    el = t.dtype.itemsize
    w = sum(p.numel() * p.element_size() for p in t.layers[0].parameters())
    assert c.layers[0] == w + 2 * t.num_kv_heads * t.head_dim * 7 * el
    assert c.head == (t.lm_head.weight.numel() + t.norm.weight.numel()) * el
    assert len(c.layers) == t.num_layers


def test_file_costs_equal_the_loaded_targets(tmp_path):
    from spd.model.loading import load_target, save_tiny_random_llama
    folder = save_tiny_random_llama(tmp_path / "m")
    t = load_target(folder, dtype="float32")
    assert file_costs(folder, torch.float32, context=9) == target_costs(t, context=9)


def test_hybrid_linear_layers_cost_their_state(tmp_path):
    from spd.model.loading import load_target, save_tiny_random_hybrid
    folder = save_tiny_random_hybrid(tmp_path / "h")
    t = load_target(folder, dtype="float32")
    c = target_costs(t, context=4096)
    types = t.config.layer_types
    lin = [x for x, k in zip(c.layers, types) if k == "linear_attention"]
    full = [x for x, k in zip(c.layers, types) if k != "linear_attention"]
    assert lin and full
    # the state does not grow with the context; the KV rows do
    assert target_costs(t, context=8).layers[types.index("linear_attention")] == lin[0]
    assert target_costs(t, context=8).layers[types.index("full_attention")] < full[0]
    json.dumps(file_costs(folder, torch.float32).layers)  # plain numbers
