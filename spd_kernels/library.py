"""torch.library registration: the ops as `torch.ops.spd.*`, with fake (meta) implementations.

The custom ops run the same dispatcher as the Python functions (so SPD_BACKEND applies), and their
fake implementations give output shapes and dtypes without running anything, so the ops trace
under torch.compile (fullgraph) and export. The Python functions in spd_kernels call the
dispatcher directly (no custom-op overhead on the eager decode path); other runtimes and compiled
graphs use torch.ops.spd.*.

    torch.ops.spd.verify_greedy(hidden, norm_weight, eps, lm_head_weight, draft_tokens)
        -> (target int64 [R], accepted bool [R])
    torch.ops.spd.rejection_sample(target_probs, draft_probs, draft_tokens, uniforms)
        -> (token int64 [R], accepted bool [R])
    torch.ops.spd.rejection_sample_logits(target_logits, draft_probs, draft_to_target,
        draft_tokens, uniforms, philox_seed, philox_offset, temperature, top_k, top_p)
        -> (token, accepted); mutates philox_offset (advanced by R) when uniforms is None
    torch.ops.spd.truncate_kv_(lengths, new_lengths, buffers, seq_dim, poison) -> ()
        mutates lengths (and buffers when poison)
    torch.ops.spd.anchor_projection(anchors, types, weights, biases) -> features [R, d_out]
        (biases: one slot per type, None where there is none; a list has no schema default)
    torch.ops.spd.qkv_rope_append(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin,
        start, k_cache, v_cache, num_heads, num_kv_heads) -> q [H, T, hd]; mutates the caches
    torch.ops.spd.cache_attention(q, k_cache, v_cache, start, scale) -> [R, H * hd]
        (start: int64 tensor of one element, read on the device; scale None: 1/sqrt(hd))
    torch.ops.spd.fused_linear(x, weight, norm_weight, eps, residual) -> [R, N]
        (residual + rms_norm(x) @ weight.T; norm_weight / residual may be None)
    torch.ops.spd.fused_swiglu(x, norm_weight, eps, w_gate, w_up) -> [R, I]

The schemas carry the Python functions' defaults (None / int / float / bool), so optional
arguments may be left out: torch.ops.spd.fused_linear(x, w, norm_weight=nw, eps=1e-6).
Under torch.compile the Python functions call these ops (opaque to Dynamo, so the host-side
checks and the dispatcher never break the graph); the `backend=` keyword then does not apply.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from spd_kernels import features, kv_cache, linear, pdm, verify

LIB = "spd"


@torch.library.custom_op(f"{LIB}::verify_greedy", mutates_args=())
def verify_greedy_op(hidden: Tensor, norm_weight: Tensor, eps: float, lm_head_weight: Tensor,
                     draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    return verify.verify_greedy(hidden, norm_weight, eps, lm_head_weight, draft_tokens)


@verify_greedy_op.register_fake
def _(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    verify._check_heads(hidden, norm_weight, lm_head_weight)
    rows = hidden.shape[0]
    return (hidden.new_empty(rows, dtype=torch.int64), hidden.new_empty(rows, dtype=torch.bool))


@torch.library.custom_op(f"{LIB}::rejection_sample", mutates_args=())
def rejection_sample_op(target_probs: Tensor, draft_probs: Tensor, draft_tokens: Tensor,
                        uniforms: Tensor) -> tuple[Tensor, Tensor]:
    return verify.rejection_sample(target_probs, draft_probs, draft_tokens, uniforms)


@rejection_sample_op.register_fake
def _(target_probs, draft_probs, draft_tokens, uniforms):
    rows = target_probs.shape[0]
    return (target_probs.new_empty(rows, dtype=torch.int64),
            target_probs.new_empty(rows, dtype=torch.bool))


@torch.library.custom_op(f"{LIB}::rejection_sample_logits", mutates_args=("philox_offset",))
def rejection_sample_logits_op(target_logits: Tensor, draft_probs: Tensor,
                               draft_to_target: Tensor, draft_tokens: Tensor,
                               uniforms: Optional[Tensor] = None,
                               philox_seed: Optional[Tensor] = None,
                               philox_offset: Optional[Tensor] = None, temperature: float = 1.0,
                               top_k: int = 0, top_p: float = 1.0) -> tuple[Tensor, Tensor]:
    return verify.rejection_sample_logits(
        target_logits, draft_probs, draft_to_target, draft_tokens, uniforms,
        temperature=temperature, top_k=top_k, top_p=top_p, philox_seed=philox_seed,
        philox_offset=philox_offset)


@rejection_sample_logits_op.register_fake
def _(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms=None, philox_seed=None,
      philox_offset=None, temperature=1.0, top_k=0, top_p=1.0):
    rows = target_logits.shape[0]
    return (target_logits.new_empty(rows, dtype=torch.int64),
            target_logits.new_empty(rows, dtype=torch.bool))


@torch.library.custom_op(f"{LIB}::truncate_kv_", mutates_args=("lengths", "buffers"))
def truncate_kv_op(lengths: Tensor, new_lengths: Tensor, buffers: list[Tensor],
                   seq_dim: int = -2, poison: bool = False) -> None:
    kv_cache.truncate_kv_(lengths, new_lengths, buffers, seq_dim=seq_dim, poison=poison)


@truncate_kv_op.register_fake
def _(lengths, new_lengths, buffers, seq_dim=-2, poison=False):
    return None


@torch.library.custom_op(f"{LIB}::anchor_projection", mutates_args=())
def anchor_projection_op(anchors: Tensor, types: Tensor, weights: list[Optional[Tensor]],
                         biases: list[Optional[Tensor]]) -> Tensor:
    return features.anchor_projection(anchors, types, weights, biases)


@anchor_projection_op.register_fake
def _(anchors, types, weights, biases):
    present = [w for w in weights if w is not None]
    d_out = present[0].shape[0] if present else anchors.shape[2]
    return anchors.new_empty(anchors.shape[1], d_out)


@torch.library.custom_op(f"{LIB}::qkv_rope_append", mutates_args=("k_cache", "v_cache"))
def qkv_rope_append_op(x: Tensor, norm_weight: Tensor, eps: float, wq: Tensor, wk: Tensor,
                       wv: Tensor, q_norm: Optional[Tensor], k_norm: Optional[Tensor],
                       cos: Tensor, sin: Tensor, start: Tensor, k_cache: Tensor, v_cache: Tensor,
                       num_heads: int, num_kv_heads: int) -> Tensor:
    return pdm.qkv_rope_append(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin,
                                    start, k_cache, v_cache, num_heads, num_kv_heads)


@qkv_rope_append_op.register_fake
def _(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
      num_heads, num_kv_heads):
    return x.new_empty(num_heads, x.shape[0], k_cache.shape[2])


@torch.library.custom_op(f"{LIB}::cache_attention", mutates_args=())
def cache_attention_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, start: Tensor,
                       scale: Optional[float] = None) -> Tensor:
    return pdm.cache_attention(q, k_cache, v_cache, start, scale)


@cache_attention_op.register_fake
def _(q, k_cache, v_cache, start, scale=None):
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2], dtype=k_cache.dtype)


@torch.library.custom_op(f"{LIB}::fused_linear", mutates_args=())
def fused_linear_op(x: Tensor, weight: Tensor, norm_weight: Optional[Tensor] = None,
                    eps: float = 1e-6, residual: Optional[Tensor] = None) -> Tensor:
    return linear.fused_linear(x, weight, norm_weight=norm_weight, eps=eps, residual=residual)


@fused_linear_op.register_fake
def _(x, weight, norm_weight=None, eps=1e-6, residual=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op(f"{LIB}::fused_swiglu", mutates_args=())
def fused_swiglu_op(x: Tensor, norm_weight: Tensor, eps: float, w_gate: Tensor,
                    w_up: Tensor) -> Tensor:
    return linear.fused_swiglu(x, norm_weight, eps, w_gate, w_up)


@fused_swiglu_op.register_fake
def _(x, norm_weight, eps, w_gate, w_up):
    return x.new_empty(x.shape[0], w_gate.shape[0])
