"""Decoder-layer math against a project-owned KV cache.

Target layers are Hugging Face modules (Llama / Qwen2 / Qwen3); the PDM's layers are our own
modules with the same attribute names, so one function runs both. Only attention is ours: it
writes the chunk's keys/values into the preallocated cache and attends causally over it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


def attention_step(attn: nn.Module, x: torch.Tensor, cos, sin, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, start: int, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """x [T, d] at positions start..start+T-1 -> attention output [T, d].

    Writes K/V into k_cache/v_cache [kvh, S, hd] at rows start..start+T-1 and attends over rows
    0..start+T-1, causally inside the chunk.
    """
    t = x.shape[0]
    q = attn.q_proj(x).view(t, num_heads, head_dim)
    k = attn.k_proj(x).view(t, num_kv_heads, head_dim)
    v = attn.v_proj(x).view(t, num_kv_heads, head_dim)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: per-head RMSNorm before RoPE
        q = attn.q_norm(q)
        k = attn.k_norm(k)
    q = apply_rope(q.transpose(0, 1), cos, sin)
    k = apply_rope(k.transpose(0, 1), cos, sin)
    end = start + t
    k_cache[:, start:end] = k
    v_cache[:, start:end] = v.transpose(0, 1)
    keys, values = k_cache[:, :end], v_cache[:, :end]
    mask = None
    if t > 1:
        mask = (torch.arange(end, device=x.device)[None, :]
                <= torch.arange(start, end, device=x.device)[:, None])
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask,
                                         enable_gqa=num_heads != num_kv_heads)
    return attn.o_proj(out[0].transpose(0, 1).reshape(t, num_heads * head_dim))


def decoder_layer_step(layer: nn.Module, x, cos, sin, k_cache, v_cache, start: int,
                       num_heads: int, num_kv_heads: int, head_dim: int):
    h = layer.input_layernorm(x)
    x = x + attention_step(layer.self_attn, h, cos, sin, k_cache, v_cache, start,
                           num_heads, num_kv_heads, head_dim)
    return x + layer.mlp(layer.post_attention_layernorm(x))
