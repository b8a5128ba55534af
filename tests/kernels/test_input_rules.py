"""Inputs the ops used to take silently (or answer with a raw error): each is an SPDInputError
naming what is wrong, before any backend runs."""
import numpy as np
import pytest
import torch

from spd_kernels import (
    SPDInputError,
    anchor_projection,
    cache_attention,
    filtered_probs,
    qkv_rope_append,
    rejection_sample_logits,
)
from spd_kernels.sampling import MAX_TOP_K, MIN_TEMPERATURE


def _qkv_args(dtype=torch.float32, start=0, **over):
    g = torch.Generator().manual_seed(3)
    T, d, H, KVH, hd, S = 2, 16, 2, 1, 8, 10
    a = dict(x=torch.randn(T, d, generator=g).to(dtype), norm_weight=torch.ones(d), eps=1e-6,
             wq=torch.randn(H * hd, d, generator=g), wk=torch.randn(KVH * hd, d, generator=g),
             wv=torch.randn(KVH * hd, d, generator=g), q_norm=None, k_norm=None,
             cos=torch.randn(20, hd, generator=g), sin=torch.randn(20, hd, generator=g),
             start=start, k_cache=torch.zeros(KVH, S, hd), v_cache=torch.zeros(KVH, S, hd),
             num_heads=H, num_kv_heads=KVH)
    a.update(over)
    return a


def test_qkv_rope_append_refuses_mixed_dtypes_float_positions_and_aliased_caches():
    with pytest.raises(SPDInputError, match="share one dtype: x torch.float64, norm_weight"):
        qkv_rope_append(**_qkv_args(torch.float64))
    with pytest.raises(SPDInputError, match="start must be an int .* got float 2.5"):
        qkv_rope_append(**_qkv_args(start=2.5))
    cache = torch.zeros(1, 10, 8)
    with pytest.raises(SPDInputError, match="k_cache and v_cache share memory"):
        qkv_rope_append(**_qkv_args(k_cache=cache, v_cache=cache))
    both = torch.zeros(2, 1, 10, 8)  # two halves of one buffer: separate, so accepted
    qkv_rope_append(**_qkv_args(k_cache=both[0], v_cache=both[1]))
    qkv_rope_append(**_qkv_args(start=np.int64(3)))  # an integer of another type is a position


def test_cache_attention_refuses_a_non_finite_scale_and_float_start():
    q, k, v = torch.randn(2, 3, 8), torch.randn(1, 10, 8), torch.randn(1, 10, 8)
    for scale in (float("inf"), float("nan"), True, -1.0):
        with pytest.raises(SPDInputError, match="positive finite float"):
            cache_attention(q, k, v, 0, scale)
    with pytest.raises(SPDInputError, match="start must be an int"):
        cache_attention(q, k, v, 1.0)


def test_anchor_projection_refuses_mixed_dtypes():
    a = torch.randn(2, 3, 4, dtype=torch.float16)
    w = [torch.randn(5, 4, dtype=torch.float16), torch.randn(5, 8)]
    with pytest.raises(SPDInputError, match=r"weights\[1\] has dtype torch.float32 but anchors"):
        anchor_projection(a, torch.tensor([0, 1, 1]), w)
    w = [torch.randn(5, 4, dtype=torch.float16), torch.randn(5, 8, dtype=torch.float16)]
    with pytest.raises(SPDInputError, match=r"biases\[0\] has dtype torch.float32"):
        anchor_projection(a, torch.tensor([0, 1, 1]), w, [torch.zeros(5), None])


def test_sampling_refuses_tiny_temperatures_and_top_k_past_int32():
    logits = torch.randn(2, 10)
    with pytest.raises(SPDInputError, match="too small to sample with .* use 0 for greedy"):
        filtered_probs(logits, temperature=1e-45)
    assert filtered_probs(logits, temperature=MIN_TEMPERATURE).isfinite().all()
    with pytest.raises(SPDInputError, match=r"top_k must be an integer in \[0, 2147483647\]"):
        filtered_probs(logits, top_k=MAX_TOP_K + 1)
    q = torch.full((2, 10), 0.1)
    with pytest.raises(SPDInputError, match="top_k must be an integer"):
        rejection_sample_logits(logits, q, torch.arange(10), torch.tensor([1, 2]),
                                torch.rand(2, 2), top_k=2 ** 40)


def test_reference_philox_draws_row_r_from_offset_plus_r():
    """Row r of a batch is what a one-row call at offset + r draws, as in the kernels."""
    g = torch.Generator().manual_seed(5)
    R, V = 4, 12
    logits, q = torch.randn(R, V, generator=g), torch.softmax(torch.randn(R, V, generator=g), -1)
    tok = torch.multinomial(q, 1, generator=g)[:, 0]
    d2t = torch.arange(V)
    seed = torch.tensor([7])
    batch = rejection_sample_logits(logits, q, d2t, tok, philox_seed=seed,
                                    philox_offset=torch.tensor([10]), top_p=0.9)
    for r in range(R):
        one = rejection_sample_logits(logits[r:r + 1], q[r:r + 1], d2t, tok[r:r + 1],
                                      philox_seed=seed, philox_offset=torch.tensor([10 + r]),
                                      top_p=0.9)
        assert one[0].item() == batch[0][r].item() and one[1].item() == batch[1][r].item()


def test_float64_uniforms_are_read_as_float32_below_one():
    from spd_kernels import rejection_sample
    p = torch.tensor([[0.5, 0.5, 0.0]])
    q = torch.tensor([[0.0, 0.0, 1.0]])  # the draft (id 2) has no target mass: rejected
    u64 = torch.tensor([[0.3, 1.0 - 1e-12]], dtype=torch.float64)  # float32 would round it to 1
    tok, ok = rejection_sample(p, q, torch.tensor([2]), u64)
    assert not ok[0] and tok[0] == 1  # the last token with mass, as u just below 1 draws
    same = rejection_sample(p, q, torch.tensor([2]), u64.float().clamp(max=1 - 2 ** -24))
    assert torch.equal(tok, same[0])


@pytest.mark.parametrize("field,value,msg", [
    ("p", [[float("nan"), 0.5, 0.5]], "target_probs must hold finite probabilities"),
    ("q", [[-0.1, 0.6, 0.5]], "draft_probs must hold finite probabilities"),
    ("p", [[0.2, 0.2, 0.2]], "every row of target_probs must sum to 1"),
    ("u", [[0.5, 1.0]], r"uniforms must lie in \[0, 1\)"),
    ("u", [[float("nan"), 0.2]], r"uniforms must lie in \[0, 1\)"),
])
def test_rejection_refuses_bad_distributions_and_uniforms(field, value, msg):
    from spd_kernels import rejection_sample
    args = dict(p=[[0.2, 0.3, 0.5]], q=[[0.5, 0.25, 0.25]], u=[[0.5, 0.5]])
    args[field] = value
    t = {k: torch.tensor(v) for k, v in args.items()}
    with pytest.raises(SPDInputError, match=msg):
        rejection_sample(t["p"], t["q"], torch.tensor([1]), t["u"])
    if field != "p":  # the logits form checks q and the uniforms the same way
        with pytest.raises(SPDInputError, match=msg.replace("target_probs", "draft_probs")):
            rejection_sample_logits(torch.randn(1, 3), t["q"], torch.arange(3),
                                    torch.tensor([1]), t["u"])
