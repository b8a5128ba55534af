"""The training layout against what inference actually shows the PDM."""
import random

import pytest
import torch
from conftest import make_tiny_target

from spd.draft.pdm import PipelineDraftModule
from spd.model.partition import DepthLayout
from spd.train.layout import training_layout


def inference_views(n, prompt_len, decisions):
    """Brute force of the chain's schedule (README, "How a cycle works"): for each cycle, (newest
    position, fill, {position: depth} of every row the drafter's newest row depends on). The
    oldest in-flight position is `start`, `count` are in flight; a full window judges: accept
    slides it, reject leaves the correction alone."""
    start, count, views = prompt_len, 1, []
    it = iter(decisions)
    while True:
        newest = start + count - 1
        views.append((newest, count, {p: n if p < start else newest - p
                                      for p in range(newest + 1)}))
        if count < n:  # filling: the draft enters
            count += 1
            continue
        try:
            accepted = next(it)
        except StopIteration:
            return views
        start, count = start + 1, count if accepted else 1


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mask_matches_brute_force_inference_views(n):
    lay = DepthLayout.build(8, n, None, [0, 3, 5, 7])
    rng = random.Random(n)
    views = inference_views(n, 3, [rng.random() < 0.5 for _ in range(14)])
    T = max(v[0] for v in views) + 1
    layouts = {f: training_layout(T, lay, f) for f in range(1, n + 1)}
    for newest, fill, depth_of in views:
        tl = layouts[fill]
        row_of = {(int(d), int(p)): r for r, (d, p) in enumerate(zip(tl.depth, tl.position))}
        # Every row the draft depends on: the window rows (recomputed this cycle), each seeing
        # exactly one copy of every earlier position, at that position's depth this cycle.
        for q in range(newest - fill + 1, newest + 1):
            r = row_of[(depth_of[q], q)]
            seen = {(int(tl.depth[k]), int(tl.position[k])) for k in tl.mask[r].nonzero()[:, 0]}
            assert seen == {(depth_of[p], p) for p in range(q + 1)}, (newest, fill, q)
            assert int(tl.types[r]) == lay.agg_type(depth_of[q])
        # Committed rows (cached earlier) saw only committed keys.
        for q in range(newest - fill + 1):
            r = row_of[(n, q)]
            seen = {(int(tl.depth[k]), int(tl.position[k])) for k in tl.mask[r].nonzero()[:, 0]}
            assert seen == {(n, p) for p in range(q + 1)}


@pytest.mark.parametrize("shift", [0, 1])
@pytest.mark.parametrize("fill", [1, 2, 3])
def test_training_forward_equals_incremental_inference(fill, shift):
    """Numerically: the loss row for position t equals the engine-style cached PDM step
    (shift=1: post-step drafting, every in-flight token one stage deeper)."""
    n = 3
    t = make_tiny_target(seed=4, vocab=24, layers=6, hidden=32)
    lay = DepthLayout.build(6, n, None, [0, 2, 4, 5])
    pdm = PipelineDraftModule.untrained(t, lay, num_layers=2).float()
    T = 9
    g = torch.Generator().manual_seed(fill)
    anchors = torch.randn(len(lay.anchors), T, 32, generator=g)
    with torch.no_grad():
        train_logits = pdm.forward_train(anchors, training_layout(T, lay, fill, shift=shift))
    for newest in range(fill - 1, T):
        depths = [n if newest - p >= fill else min(n, newest - p + shift)
                  for p in range(newest + 1)]
        types = torch.tensor([lay.agg_type(d) for d in depths])
        # Inference: committed rows were cached with depth-n features, then the window rows are
        # recomputed with this cycle's depths, in one chunk, exactly as the engine does.
        cache = pdm.new_cache(T + 1)
        start = newest - fill + 1
        if start > 0:
            pdm.step(pdm.features(anchors[:, :start], types[:start]), 0, cache)
        logits = pdm.step(pdm.features(anchors[:, start:newest + 1], types[start:]), start, cache)
        torch.testing.assert_close(train_logits[newest], logits, rtol=1e-4, atol=1e-4)


def test_layer_on_selected_rows_equals_the_full_layer_at_those_rows():
    """The training forward's last layer computes only the loss rows: that must be the full
    layer's output at those rows (every row still a key), and fail if a row is mixed up."""
    from spd.model.layers import decoder_layer_step
    n = 3
    t = make_tiny_target(seed=5, vocab=24, layers=6, hidden=32)
    lay = DepthLayout.build(6, n, None, [0, 2, 4, 5])
    pdm = PipelineDraftModule.untrained(t, lay, num_layers=1).float()
    c, layer = pdm.config, pdm.layers[0]
    with torch.no_grad():
        for p in layer.parameters():  # untrained output projections are zero: make them write
            p.normal_(std=0.3)
    tl = training_layout(7, lay, 3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(tl.depth), c.hidden_size, generator=g)
    cos, sin = pdm._rope_for(7, x)
    cos, sin = cos[tl.position], sin[tl.position]
    args = (cos, sin, None, None, 0, c.num_heads, c.num_kv_heads, c.head_dim)
    with torch.no_grad():
        full = decoder_layer_step(layer, x, *args, mask=tl.mask)
        some = decoder_layer_step(layer, x, *args, mask=tl.mask, rows=tl.loss_rows)
        shuffled = decoder_layer_step(layer, x, *args, mask=tl.mask, rows=tl.loss_rows.flip(0))
    torch.testing.assert_close(some, full[tl.loss_rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(shuffled, full[tl.loss_rows], atol=1e-3)
    with pytest.raises(ValueError, match="cache-free"):
        decoder_layer_step(layer, x[:2], cos[:2], sin[:2], torch.zeros(1, 8, c.head_dim),
                           torch.zeros(1, 8, c.head_dim), 0, c.num_heads, c.num_kv_heads,
                           c.head_dim, rows=torch.tensor([0]))
