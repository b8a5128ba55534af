"""batch_stage_step: rows of several sequences through one stage step, each against its own slot
of a batched cache, against each sequence's own stage_step (the one-sequence path): a batch of
one bit for bit, several within float32 rounding (the CPU's products are not batch-invariant:
docs/batching.md); each row's key/value lands in its own slot at its position and nothing else
in the caches moves (NaN poison past every slot's length)."""
import pytest
import torch
from conftest import make_tiny_target

from spd_kernels.stage import batch_stage_step, stage_step

PROMPTS = (5, 9, 3)  # each slot's context length
S = 16


@pytest.fixture(scope="module")
def stage():
    t = make_tiny_target(seed=3, vocab=48, layers=3, model_type="qwen3")  # q/k norms too
    cos, sin = t.rope(0, S)
    return t, t.stage_weights(range(t.num_layers)), cos, sin


def filled_caches(t, weights, cos, sin, seed=0):
    """Caches [B, layers, kv_heads, S, hd], slot b holding a random prompt of PROMPTS[b] rows
    prefilled through stage_step; NaN past each prompt."""
    shape = (len(PROMPTS), t.num_layers, t.num_kv_heads, S, t.head_dim)
    k = torch.full(shape, float("nan"), dtype=t.dtype)
    v = torch.full(shape, float("nan"), dtype=t.dtype)
    g = torch.Generator().manual_seed(seed)
    for b, P in enumerate(PROMPTS):
        stage_step(torch.randn(P, t.hidden_size, generator=g).to(t.dtype), weights, k[b], v[b],
                   0, cos, sin)
    return k, v


@pytest.mark.parametrize("rows", [[1], [2, 0, 1], [0, 2]])
def test_rows_of_several_sequences_equal_each_alone(stage, rows):
    t, weights, cos, sin = stage
    k, v = filled_caches(t, weights, cos, sin)
    alone_k, alone_v = k.clone(), v.clone()
    x = torch.randn(len(rows), t.hidden_size, generator=torch.Generator().manual_seed(7))
    slots = torch.tensor(rows)
    positions = torch.tensor([PROMPTS[b] for b in rows])
    outs = batch_stage_step(x, weights, k, v, slots, positions, cos, sin)
    assert len(outs) == t.num_layers and outs[-1].shape == x.shape
    for r, b in enumerate(rows):
        P = PROMPTS[b]
        ref = stage_step(x[r:r + 1], weights, alone_k[b], alone_v[b], P, cos, sin)
        for got, want in zip(outs, ref):
            if len(rows) == 1:  # one row: the one-sequence step's very numbers
                assert torch.equal(got[r], want[0])
            else:
                torch.testing.assert_close(got[r], want[0], atol=1e-5, rtol=1e-5)
        # its key/value at its position, in its slot; the slot's other rows untouched
        torch.testing.assert_close(k[b, :, :, :P + 1], alone_k[b, :, :, :P + 1], atol=1e-5,
                                   rtol=1e-5)
        assert k[b, :, :, P + 1:].isnan().all() and v[b, :, :, P + 1:].isnan().all()
    for b in set(range(len(PROMPTS))) - set(rows):  # a slot with no row: not a bit moved
        assert torch.equal(k[b].nan_to_num(), alone_k[b].nan_to_num())
        assert torch.equal(k[b].isnan(), alone_k[b].isnan())


@pytest.mark.parametrize("units", [[1], [2, 0]])
def test_token_tree_units_of_several_sequences_equal_each_alone(stage, units):
    """batch_tree_stage_step: each slot's W = 3 tree rows (their own K/V rows past the prompt,
    a random branch mask) against that slot's tree_stage_step: one unit bit for bit, several
    within float32 rounding; each unit's K/V land in its slot's rows alone."""
    from spd_kernels.stage import batch_tree_stage_step, tree_stage_step
    t, weights, cos, sin = stage
    k, v = filled_caches(t, weights, cos, sin)
    alone_k, alone_v = k.clone(), v.clone()
    W, M = 3, 6
    g = torch.Generator().manual_seed(11)
    x = torch.randn(len(units) * W, t.hidden_size, generator=g)
    rows = torch.stack([PROMPTS[b] + torch.randperm(W, generator=g) for b in units])  # [U, W]
    prefix = torch.tensor([PROMPTS[b] for b in units])
    keys = torch.stack([torch.cat([r, r]) for r in rows])                   # [U, M]
    mask = torch.rand(len(units), W, M, generator=g) < 0.5
    mask[:, torch.arange(W), torch.arange(W)] = True                         # itself
    at = prefix.repeat_interleave(W)
    outs = batch_tree_stage_step(x, weights, k, v, units, rows, prefix, keys, mask,
                                 cos.index_select(0, at), sin.index_select(0, at))
    for u, b in enumerate(units):
        mine = slice(u * W, (u + 1) * W)
        ref = tree_stage_step(x[mine], weights, alone_k[b], alone_v[b], rows[u], prefix[u:u + 1],
                              keys[u], mask[u], cos.index_select(0, at[mine]),
                              sin.index_select(0, at[mine]))
        for got, want in zip(outs, ref):
            if len(units) == 1:
                assert torch.equal(got[mine], want)
            else:
                torch.testing.assert_close(got[mine], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k[b].nan_to_num(), alone_k[b].nan_to_num(), atol=1e-5,
                                   rtol=1e-5)
        assert torch.equal(k[b].isnan(), alone_k[b].isnan())
    for b in set(range(len(PROMPTS))) - set(units):
        assert torch.equal(k[b].isnan(), alone_k[b].isnan())
        assert torch.equal(k[b].nan_to_num(), alone_k[b].nan_to_num())
