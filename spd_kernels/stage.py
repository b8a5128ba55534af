"""A block of decoder layers as plain tensors: the target's stage step (and the PDM's layers).

`decoder_layer` is the one decoder layer against a KV cache in the project: the target's stages
(`stage_step`), the PDM's step (spd_kernels.pdm) and EAGLE-3's head run it. Per layer: RMSNorm +
QKV (+ biases) + q/k norm + RoPE + cache append (`qkv_rope_append`), causal GQA attention over
the cache (`cache_attention`), output projection + residual (`fused_linear`), RMSNorm + SwiGLU
(`fused_swiglu`), down projection + residual (`fused_linear`). Training runs the same layer
cache-free under a mask (spd.model.layers.decoder_layer_step; tests/kernels/test_pdm_step.py
holds the two equal). With the position an int64 device tensor nothing reads it on the host, so
a CUDA graph of the step replays at every position. `batch_stage_step` runs rows of several
sequences, each against its own slot of a batched cache (docs/batching.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd_kernels.attention import cache_attention
from spd_kernels.attention.slots import slot_attention
from spd_kernels.attention.tree import tree_attention
from spd_kernels.linear import fused_linear, fused_swiglu
from spd_kernels.qkv_rope import back_to_back, qkv_rope_append


@dataclass
class LayerWeights:
    """One decoder layer as plain tensors ([out, in] linear weights)."""
    input_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    post_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    qkv_bias: torch.Tensor | None = None  # [Nq + Nk + Nv]: q/k/v biases back to back (Qwen2)
    # Weight-only quantisation (spd_kernels.quant): None = float weights; else the weight of the
    # same name is int8 / float8_e4m3fn [N, K] and this its fp32 row scale [N]. The q/k/v scales
    # lie back to back when their weights do (one product).
    wq_scale: torch.Tensor | None = None
    wk_scale: torch.Tensor | None = None
    wv_scale: torch.Tensor | None = None
    wo_scale: torch.Tensor | None = None
    gate_scale: torch.Tensor | None = None
    up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @classmethod
    def from_module(cls, layer) -> "LayerWeights":
        """From a layer with Llama/Qwen names (spd.draft.pdm's layers, Hugging Face layers). The
        q/k/v biases are one view when they lie back to back (spd.model.layers.pack_layer_),
        else a copy."""
        a, m = layer.self_attn, layer.mlp
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        biases = [getattr(p, "bias", None) for p in (a.q_proj, a.k_proj, a.v_proj)]
        bias = None
        if any(b is not None for b in biases):
            bias = back_to_back(*biases)
            if bias is None:
                bias = torch.cat(biases)
        return cls(layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight,
                   a.v_proj.weight, None if qn is None else qn.weight,
                   None if kn is None else kn.weight, a.o_proj.weight,
                   layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                   m.down_proj.weight, bias)


@dataclass
class StageWeights:
    layers: list[LayerWeights]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def _qkv_per_row(x, lw: LayerWeights, k_cache, cos, sin, num_heads: int, num_kv_heads: int,
                 eps: float, backend):
    """q [H, R, hd] and the rows' new k, v [kv_heads, R, hd]: norms, projections and RoPE as a
    chain's step computes them (row r with cos/sin[r]), into a scratch cache of R rows that the
    caller scatters where each row's key and value live."""
    k_new = torch.empty(num_kv_heads, x.shape[0], k_cache.shape[-1], dtype=k_cache.dtype,
                        device=k_cache.device)
    v_new = torch.empty_like(k_new)
    q = qkv_rope_append(x, lw.input_norm, eps, lw.wq, lw.wk, lw.wv, lw.q_norm, lw.k_norm, cos,
                        sin, 0, k_new, v_new, num_heads, num_kv_heads, qkv_bias=lw.qkv_bias,
                        wq_scale=lw.wq_scale, wk_scale=lw.wk_scale, wv_scale=lw.wv_scale,
                        backend=backend)
    return q, k_new, v_new


def _after_attention(att, x, lw: LayerWeights, eps: float, backend) -> torch.Tensor:
    """The rest of a decoder layer after its attention att [T, H * hd]: output projection and
    residual, then RMSNorm + SwiGLU, down projection and residual -> [T, d]."""
    x = fused_linear(att, lw.wo, residual=x, weight_scale=lw.wo_scale, backend=backend)
    mid = fused_swiglu(x, lw.post_norm, eps, lw.w_gate, lw.w_up, gate_scale=lw.gate_scale,
                       up_scale=lw.up_scale, backend=backend)
    return fused_linear(mid, lw.w_down, residual=x, weight_scale=lw.down_scale, backend=backend)


def decoder_layer(x: torch.Tensor, lw: LayerWeights, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, start, cos: torch.Tensor, sin: torch.Tensor,
                  num_heads: int, num_kv_heads: int, eps: float, *,
                  backend: str | None = None) -> torch.Tensor:
    """x [T, d] at positions start.. -> [T, d]; k_cache/v_cache [kv_heads, S, head_dim]."""
    q = qkv_rope_append(x, lw.input_norm, eps, lw.wq, lw.wk, lw.wv, lw.q_norm, lw.k_norm, cos,
                        sin, start, k_cache, v_cache, num_heads, num_kv_heads,
                        qkv_bias=lw.qkv_bias, wq_scale=lw.wq_scale, wk_scale=lw.wk_scale,
                        wv_scale=lw.wv_scale, backend=backend)
    att = cache_attention(q, k_cache, v_cache, start, backend=backend)
    return _after_attention(att, x, lw, eps, backend)


def tree_decoder_layer(x: torch.Tensor, lw: LayerWeights, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slots: torch.Tensor, prefix_len, tree_slots,
                       tree_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       num_heads: int, num_kv_heads: int, eps: float, *,
                       backend: str | None = None) -> torch.Tensor:
    """`decoder_layer` for the rows of a token tree: x [R, d], row r at the position whose RoPE
    is cos/sin[r] ([R, head_dim] each), its key/value written to cache slot slots[r] ([R]
    int64); it attends to slots [0, prefix_len) and to tree_slots[m] ([M] int64) where
    tree_mask[r, m] ([R, M] bool): its ancestors on its own branch and itself
    (spd_kernels.attention.tree). k_cache/v_cache [kv_heads, S, head_dim]."""
    q, k_new, v_new = _qkv_per_row(x, lw, k_cache, cos, sin, num_heads, num_kv_heads, eps,
                                   backend)
    k_cache.index_copy_(1, slots, k_new)
    v_cache.index_copy_(1, slots, v_new)
    att = tree_attention(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, backend=backend)
    return _after_attention(att, x, lw, eps, backend)


def tree_stage_step(x: torch.Tensor, weights: StageWeights, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slots: torch.Tensor, prefix_len, tree_slots,
                    tree_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                    backend: str | None = None) -> list[torch.Tensor]:
    """`stage_step` for the rows of a token tree (tree_decoder_layer's arguments; k_cache/v_cache
    [layers, kv_heads, S, head_dim]) -> each layer's output [R, hidden]."""
    outs = []
    for i, lw in enumerate(weights.layers):
        x = tree_decoder_layer(x, lw, k_cache[i], v_cache[i], slots, prefix_len, tree_slots,
                               tree_mask, cos, sin, weights.num_heads, weights.num_kv_heads,
                               weights.eps, backend=backend)
        outs.append(x)
    return outs


def stage_step(x: torch.Tensor, weights: StageWeights, k_cache: torch.Tensor,
               v_cache: torch.Tensor, start, cos: torch.Tensor, sin: torch.Tensor, *,
               backend: str | None = None) -> list[torch.Tensor]:
    """Rows x [T, hidden] at positions start..start+T-1 through every layer -> each layer's output
    [T, hidden] (the last is the stage's output). k_cache/v_cache [layers, kv_heads, S, head_dim]
    get the rows' keys and values; cos/sin [P, head_dim] are the full RoPE tables. `start`: an
    int, or an int64 tensor of one element read on the device. `backend` picks every op's backend
    (None: the dispatcher's choice)."""
    if not isinstance(start, torch.Tensor):
        start = int(start)
    outs = []
    for i, lw in enumerate(weights.layers):
        x = decoder_layer(x, lw, k_cache[i], v_cache[i], start, cos, sin, weights.num_heads,
                          weights.num_kv_heads, weights.eps, backend=backend)
        outs.append(x)
    return outs


def batch_decoder_layer(x: torch.Tensor, lw: LayerWeights, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                        eps: float, *, backend: str | None = None) -> torch.Tensor:
    """`decoder_layer` for rows of several sequences: x [R, d], row r of slot slots[r] ([R]
    int64) at position positions[r] ([R] int64), its RoPE cos/sin[r] ([R, head_dim] each); its
    key/value written to k_cache/v_cache [B, kv_heads, S, head_dim] at (slots[r], positions[r]),
    then it attends to its slot's keys [0, positions[r]] (slot_attention)."""
    q, k_new, v_new = _qkv_per_row(x, lw, k_cache, cos, sin, num_heads, num_kv_heads, eps,
                                   backend)
    k_cache[slots, :, positions] = k_new.transpose(0, 1)     # [R, kv_heads, hd]
    v_cache[slots, :, positions] = v_new.transpose(0, 1)
    att = slot_attention(q, k_cache, v_cache, slots, positions + 1, backend=backend)
    return _after_attention(att, x, lw, eps, backend)


def batch_stage_step(x: torch.Tensor, weights: StageWeights, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *,
                     backend: str | None = None) -> list[torch.Tensor]:
    """`stage_step` for rows of several sequences (batch_decoder_layer's arguments): x [R, hidden];
    k_cache/v_cache [B, layers, kv_heads, S, head_dim] (slot b's one-sequence cache is k_cache[b],
    which the prompt's prefill fills through `stage_step`); cos/sin [P, head_dim] the full RoPE
    tables -> each layer's output [R, hidden]. Positions stay on the device."""
    at = positions.reshape(-1)
    cos_rows, sin_rows = cos.index_select(0, at), sin.index_select(0, at)
    outs = []
    for i, lw in enumerate(weights.layers):
        x = batch_decoder_layer(x, lw, k_cache[:, i], v_cache[:, i], slots, at, cos_rows,
                                sin_rows, weights.num_heads, weights.num_kv_heads, weights.eps,
                                backend=backend)
        outs.append(x)
    return outs


def batch_tree_decoder_layer(x: torch.Tensor, lw: LayerWeights, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slots: list[int], rows: torch.Tensor,
                             prefix_len: torch.Tensor, tree_slots: torch.Tensor,
                             tree_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             num_heads: int, num_kv_heads: int, eps: float, *,
                             backend: str | None = None) -> torch.Tensor:
    """`tree_decoder_layer` for U token-tree units of several sequences, W rows each: x [U * W,
    d], unit u's rows u * W.. of slot slots[u] (host ints: a batch's set of slots, fixed while
    its sequences are) of k_cache/v_cache [B, kv_heads, S, head_dim]; rows [U, W] int64 where
    each row's key/value go in its slot; prefix_len [U], tree_slots [U, M] and tree_mask [U, W,
    M] (bool) as tree_attention's per unit; cos/sin [U * W, head_dim] the rows' RoPE -> [U * W,
    d]. The linear layers run over every row at once (the weight reads shared); each unit
    attends to its own slot (tree_attention), so a unit computes what `tree_decoder_layer`
    computes of it alone."""
    W = rows.shape[1]
    q, k_new, v_new = _qkv_per_row(x, lw, k_cache, cos, sin, num_heads, num_kv_heads, eps,
                                   backend)
    att = []
    for u, b in enumerate(slots):
        kc, vc, at = k_cache[b], v_cache[b], slice(u * W, (u + 1) * W)
        kc.index_copy_(1, rows[u], k_new[:, at])
        vc.index_copy_(1, rows[u], v_new[:, at])
        att.append(tree_attention(q[:, at], kc, vc, prefix_len[u:u + 1], tree_slots[u],
                                  tree_mask[u], backend=backend))
    return _after_attention(torch.cat(att), x, lw, eps, backend)


def batch_tree_stage_step(x: torch.Tensor, weights: StageWeights, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slots: list[int], rows: torch.Tensor,
                          prefix_len: torch.Tensor, tree_slots: torch.Tensor,
                          tree_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                          backend: str | None = None) -> list[torch.Tensor]:
    """`tree_stage_step` for U token-tree units of several sequences (batch_tree_decoder_layer's
    arguments; k_cache/v_cache [B, layers, kv_heads, S, head_dim]) -> each layer's output
    [U * W, hidden]."""
    outs = []
    for i, lw in enumerate(weights.layers):
        x = batch_tree_decoder_layer(x, lw, k_cache[:, i], v_cache[:, i], slots, rows,
                                     prefix_len, tree_slots, tree_mask, cos, sin,
                                     weights.num_heads, weights.num_kv_heads, weights.eps,
                                     backend=backend)
        outs.append(x)
    return outs
