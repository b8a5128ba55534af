"""The stage step of a hybrid target (Qwen3.5 / Qwen3-Next): Gated DeltaNet layers and gated
full-attention layers, each followed by a SwiGLU MLP (or a mixture of experts).

Every RMSNorm of these models computes x * (1 + w); the weights here already hold 1 + w
(spd.model.hybrid builds them), so the project's norms (w * x) compute the same thing (exactly in
fp32). Gated attention is the standard layer with q/k norms (`qkv_rope_append`,
`cache_attention`) plus an output gate; its partial RoPE runs as full-width RoPE because the
builder permutes the q/k head dimensions so that the rotated pairs lie head_dim / 2 apart and
gives the unrotated ones cos 1, sin 0 (q . k is unchanged by a common permutation).
A DeltaNet layer reads and writes its state rings (spd_kernels.deltanet); in a batch a dead
row (a parked slot's bubble) writes none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from spd_kernels.attention import cache_attention
from spd_kernels.deltanet import conv_ring_step, gated_delta_step
from spd_kernels.linear import fused_linear, fused_swiglu, rms_norm
from spd_kernels.qkv_rope import qkv_rope_append


@dataclass
class MLPWeights:
    """Dense SwiGLU (w_gate/w_up/w_down), or `moe` (a module called on the normed rows)."""
    post_norm: torch.Tensor
    w_gate: torch.Tensor | None = None
    w_up: torch.Tensor | None = None
    w_down: torch.Tensor | None = None
    moe: Callable | None = None


@dataclass
class GatedAttentionWeights:
    input_norm: torch.Tensor
    wq: torch.Tensor       # [H*hd, d] query rows (head dims permuted, see the module doc)
    wq_gate: torch.Tensor  # [H*hd, d] output-gate rows
    wk: torch.Tensor       # [KVH*hd, d] (head dims permuted)
    wv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wo: torch.Tensor
    mlp: MLPWeights
    kind = "attention"


@dataclass
class DeltaNetWeights:
    input_norm: torch.Tensor
    w_qkv: torch.Tensor    # [2*Hk*dk + Hv*dv, d]
    w_z: torch.Tensor      # [Hv*dv, d]
    w_b: torch.Tensor      # [Hv, d]
    w_a: torch.Tensor      # [Hv, d]
    conv: torch.Tensor     # [C, K]
    a_log: torch.Tensor    # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    out_norm: torch.Tensor  # [dv] (gated RMSNorm: w * x, not zero-centred)
    w_out: torch.Tensor
    mlp: MLPWeights
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    kind = "linear"


@dataclass
class HybridStageWeights:
    layers: list
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def _mlp(x: torch.Tensor, m: MLPWeights, eps: float, backend) -> torch.Tensor:
    if m.moe is not None:
        return x + m.moe(rms_norm(x, m.post_norm, eps)[None])[0]
    mid = fused_swiglu(x, m.post_norm, eps, m.w_gate, m.w_up, backend=backend)
    return fused_linear(mid, m.w_down, residual=x, backend=backend)


def gated_attention_layer(x, lw: GatedAttentionWeights, k_cache, v_cache, start, cos, sin,
                          num_heads: int, num_kv_heads: int, eps: float, *, backend=None):
    """x [T, d] at positions start.. -> [T, d]; k_cache/v_cache [kv_heads, S, head_dim]."""
    return _gated_attention(x, lw, [(slice(None), k_cache, v_cache, start)], cos, sin,
                            num_heads, num_kv_heads, eps, backend)


def _gated_attention(x, lw: GatedAttentionWeights, units, cos, sin, num_heads: int,
                     num_kv_heads: int, eps: float, backend):
    """The gated attention layer over the rows of several sequences: units = (rows of x,
    k_cache, v_cache, start) a sequence, its rows attending to its own cache; the gate, output
    projection and MLP over every row at once."""
    atts = []
    for rows, kc, vc, start in units:
        q = qkv_rope_append(x[rows], lw.input_norm, eps, lw.wq, lw.wk, lw.wv, lw.q_norm,
                            lw.k_norm, cos, sin, start, kc, vc, num_heads, num_kv_heads,
                            backend=backend)
        atts.append(cache_attention(q, kc, vc, start, backend=backend))
    att = atts[0] if len(atts) == 1 else torch.cat(atts)
    gate = F.linear(rms_norm(x, lw.input_norm, eps), lw.wq_gate)
    att = att * torch.sigmoid(gate)
    x = fused_linear(att, lw.wo, residual=x, backend=backend)
    return _mlp(x, lw.mlp, eps, backend)


def deltanet_layer(x, lw: DeltaNetWeights, conv_ring, state_ring, start, eps: float, *,
                   backend=None):
    """x [T, d] at positions start.. -> [T, d]; conv_ring [R, K-1, C], state_ring
    [R, Hv, dk, dv] fp32 (read at slot start mod R, written for the last rows)."""
    return _deltanet(x, lw, [(slice(None), conv_ring, state_ring, start, None)], eps, backend)


def _deltanet(x, lw: DeltaNetWeights, units, eps: float, backend):
    """The DeltaNet layer over the rows of several sequences: units = (rows of x, conv_ring,
    state_ring, start, live) a sequence, in row order, its conv and recurrence through its own
    rings (live [1] of 0, a dead row: rings left as they were; None: written); the
    projections, the gated norm and the MLP over every row at once."""
    T = x.shape[0]
    h = rms_norm(x, lw.input_norm, eps)
    proj = F.linear(h, lw.w_qkv)
    mixed = [conv_ring_step(proj[rows], conv, lw.conv, start, live=live, backend=backend)
             for rows, conv, _, start, live in units]
    mixed = mixed[0] if len(mixed) == 1 else torch.cat(mixed)
    kd = lw.num_k_heads * lw.head_k_dim
    q, k, v = mixed.split([kd, kd, mixed.shape[1] - 2 * kd], dim=1)
    q = q.reshape(T, lw.num_k_heads, lw.head_k_dim)
    k = k.reshape(T, lw.num_k_heads, lw.head_k_dim)
    v = v.reshape(T, lw.num_v_heads, lw.head_v_dim)
    beta = F.linear(h, lw.w_b).sigmoid()
    g = -lw.a_log.float().exp() * F.softplus(F.linear(h, lw.w_a).float() + lw.dt_bias)
    core = [gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state, start,
                             live=live, backend=backend) for rows, _, state, start, live in units]
    core = core[0] if len(core) == 1 else torch.cat(core)
    # gated RMSNorm per value head: w * norm(core) * silu(z)
    z = F.linear(h, lw.w_z).reshape(T * lw.num_v_heads, lw.head_v_dim)
    core = core.reshape(T * lw.num_v_heads, lw.head_v_dim)
    normed = rms_norm(core, lw.out_norm, eps) * F.silu(z.float())
    x = fused_linear(normed.to(x.dtype).reshape(T, -1), lw.w_out, residual=x, backend=backend)
    return _mlp(x, lw.mlp, eps, backend)


def hybrid_stage_step(x: torch.Tensor, weights: HybridStageWeights, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, conv_rings: torch.Tensor, state_rings: torch.Tensor,
                      start, cos: torch.Tensor, sin: torch.Tensor, *,
                      backend: str | None = None) -> list[torch.Tensor]:
    """Rows x [T, hidden] at positions start.. through every layer -> each layer's output.
    k_cache/v_cache [attention layers, kv_heads, S, hd]; conv_rings [linear layers, R, K-1, C];
    state_rings [linear layers, R, Hv, dk, dv] fp32; the i-th layer of a kind uses entry i."""
    if not isinstance(start, torch.Tensor):
        start = int(start)
    return _layers(x, weights, [(slice(None), k_cache, v_cache, conv_rings, state_rings,
                                 start, None)], cos, sin, backend)


def batch_hybrid_stage_step(x: torch.Tensor, weights: HybridStageWeights, caches: list,
                            positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                            live: torch.Tensor | None = None,
                            backend: str | None = None) -> list[torch.Tensor]:
    """`hybrid_stage_step` for one row of each of U sequences: x [U, hidden], row u at
    positions[u] ([U] int64, on the device) in its own caches[u] = (k_cache, v_cache,
    conv_rings, state_rings) as hybrid_stage_step's -> each layer's output [U, hidden]. The
    projections and MLPs run over every row at once (the weight reads shared); each row's
    attention and DeltaNet recurrence read and write its own cache and rings, so a row
    computes what `hybrid_stage_step` computes of it alone. live [U] (int64 or bool, on the
    device; None: all live): a row of 0 is dead (a bubble: a parked slot's, at its trash row)
    and writes no ring entry, since the entry after its position may be the one its slot's
    next live row reads (a prefill chunk's); its K/V row at its position is written as ever
    (no live row reads past its own position)."""
    return _layers(x, weights, [(slice(u, u + 1), *c, positions[u:u + 1],
                                 None if live is None else live[u:u + 1])
                                for u, c in enumerate(caches)], cos, sin, backend)


def _layers(x, weights: HybridStageWeights, units, cos, sin, backend) -> list[torch.Tensor]:
    """Every layer over the rows of `units` = (rows of x, k_cache, v_cache, conv_rings,
    state_rings, start, live) a sequence."""
    outs, a, li = [], 0, 0
    for lw in weights.layers:
        if lw.kind == "attention":
            x = _gated_attention(x, lw, [(r, k[a], v[a], st) for r, k, v, _, _, st, _ in units],
                                 cos, sin, weights.num_heads, weights.num_kv_heads,
                                 weights.eps, backend)
            a += 1
        else:
            x = _deltanet(x, lw, [(r, c[li], s[li], st, lv)
                                  for r, _, _, c, s, st, lv in units], weights.eps, backend)
            li += 1
        outs.append(x)
    return outs
