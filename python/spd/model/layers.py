"""The training form of a decoder layer, and the layers' packed weights.

A decoder layer against a KV cache (inference: the target's stages, the PDM's step, EAGLE-3's
head) is written once, over plain weight tensors and the kernels' ops:
spd_kernels.stage.decoder_layer. Training needs what that form cannot give: autograd through
nn.Modules, and attention under an arbitrary mask (the replicated-sequence layout of
spd.train.layout) with only some rows querying. `decoder_layer_step` is that form, cache-free;
tests/kernels/test_pdm_step.py holds it equal to the cached one under a causal mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spd_kernels.qkv_rope import back_to_back, pack_back_to_back


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_table(head_dim: int, max_len: int, theta: float, device=None, dtype=torch.float32):
    """Standard RoPE cos/sin tables [max_len, head_dim] (halves repeated, as Llama does)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                                / head_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    """x [H, T, hd], cos/sin [T, hd]."""
    return x * cos + _rotate_half(x) * sin


def _qkv(attn: nn.Module, x: torch.Tensor, cos, sin, num_heads, num_kv_heads, head_dim,
         q_rows: torch.Tensor | None = None):
    """x [T, d] -> q [H, T', hd], k [KVH, T, hd] (both with RoPE), v [KVH, T, hd]; queries only
    for `q_rows` when given (T' of them), else for every row."""
    t = x.shape[0]
    xq, cq, sq = (x, cos, sin) if q_rows is None else (x[q_rows], cos[q_rows], sin[q_rows])
    q = attn.q_proj(xq).view(xq.shape[0], num_heads, head_dim)
    k = attn.k_proj(x).view(t, num_kv_heads, head_dim)
    v = attn.v_proj(x).view(t, num_kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    return (apply_rope(q.transpose(0, 1), cq, sq), apply_rope(k.transpose(0, 1), cos, sin),
            v.transpose(0, 1))


def _attend(attn, q, keys, values, mask, num_heads, num_kv_heads, head_dim):
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                         enable_gqa=num_heads != num_kv_heads)
    return attn.o_proj(out[0].transpose(0, 1).reshape(q.shape[1], num_heads * head_dim))


def attention_step(attn: nn.Module, x: torch.Tensor, cos, sin, k_cache: None, v_cache: None,
                   start: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   mask: torch.Tensor | None = None,
                   query_rows: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] (cos/sin [T, hd]: each row's own position) -> attention output [T, d]: the rows
    attend to each other under the boolean `mask` [T, T] (True = may attend); with
    `query_rows`, only those rows query (output [len(query_rows), d]; every row is still a key).
    k_cache / v_cache / start stay in the signature for the training code; a cache is refused
    (the cached layer is spd_kernels.stage.decoder_layer)."""
    if k_cache is not None or v_cache is not None:
        raise ValueError("spd.model.layers computes the cache-free (training) form of a layer; "
                         "with a KV cache use spd_kernels.stage.decoder_layer")
    q, k, v = _qkv(attn, x, cos, sin, num_heads, num_kv_heads, head_dim, query_rows)
    if query_rows is not None:
        mask = mask[query_rows]
    return _attend(attn, q, k, v, mask, num_heads, num_kv_heads, head_dim)


def decoder_layer_step(layer: nn.Module, x, cos, sin, k_cache, v_cache, start: int,
                       num_heads: int, num_kv_heads: int, head_dim: int, mask=None, rows=None):
    """One decoder layer, cache-free (attention_step). `rows`: compute the outputs of those
    rows alone; the other rows still serve as keys and values (a last layer needs no more)."""
    h = layer.input_layernorm(x)
    a = attention_step(layer.self_attn, h, cos, sin, k_cache, v_cache, start,
                       num_heads, num_kv_heads, head_dim, mask, query_rows=rows)
    x = (x if rows is None else x[rows]) + a
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _pack_(modules, name: str) -> None:
    """Make `name` (weight or bias) of each module a view of one buffer, back to back, values
    unchanged; a no-op when they already are."""
    tensors = [getattr(m, name) for m in modules]
    if any(t is None for t in tensors) or back_to_back(*tensors) is not None:
        return
    for t, view in zip(tensors, pack_back_to_back(*tensors)):
        t.data = view


# Linear layers of a decoder layer whose weights (and biases) lie back to back in one buffer.
PACKED_GROUPS = ((("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  ("weight", "bias")),
                 (("mlp.gate_proj", "mlp.up_proj"), ("weight",)))


def packed_groups(layer: nn.Module) -> list[list[str]]:
    """The layer's parameter names (relative to it) packed together, group by group: the
    loader reads each group straight into one buffer."""
    out = []
    for modules, attrs in PACKED_GROUPS:
        for attr in attrs:
            if all(getattr(layer.get_submodule(m), attr, None) is not None for m in modules):
                out.append([f"{m}.{attr}" for m in modules])
    return out


def pack_layer_(layer: nn.Module) -> nn.Module:
    """Put a decoder layer's q, k and v projections (weights and biases) back to back, and its
    gate and up projections, each in one buffer: the kernels then stream each group as one
    product. Parameters become views (one copy of every weight); for inference, since an
    optimizer holding the old tensors would lose track."""
    for modules, attrs in PACKED_GROUPS:
        for attr in attrs:
            _pack_([layer.get_submodule(m) for m in modules], attr)
    return layer
