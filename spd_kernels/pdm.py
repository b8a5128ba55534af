"""The PDM decoder step as plain tensors.

`pdm_step` is the draft module's forward for a chunk of rows against its KV cache (what
`spd.draft.pdm.PipelineDraftModule.step` computes), written over plain weight tensors so kernels can
replace its parts and a CUDA graph can capture it: per layer RMSNorm + QKV + q/k norm + RoPE +
cache append (`qkv_rope_append`), causal GQA attention over the cache (`cache_attention`), output
projection + residual, RMSNorm + SwiGLU MLP + residual (`fused_linear`, `fused_swiglu`); then the
final norm and the LM head over the draft vocabulary for the last row. The position `start` may
be a device tensor, so nothing in the step needs the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd_kernels.attention import cache_attention
from spd_kernels.linear import fused_linear, fused_swiglu
from spd_kernels.qkv_rope import qkv_rope_append

# the dispatched ops the step runs (benchmarks time the step against them)
STEP_OPS = ("qkv_rope_append", "cache_attention", "fused_linear", "fused_swiglu")


@dataclass
class LayerWeights:
    """One Qwen3-style decoder layer as plain tensors ([out, in] linear weights)."""
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

    @classmethod
    def from_module(cls, layer) -> "LayerWeights":
        """From a layer with Llama/Qwen3 attribute names (spd.draft.pdm's layers, HF layers)."""
        a, m = layer.self_attn, layer.mlp
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        return cls(layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight,
                   a.v_proj.weight, None if qn is None else qn.weight,
                   None if kn is None else kn.weight, a.o_proj.weight,
                   layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                   m.down_proj.weight)


@dataclass
class PDMWeights:
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor          # [Vd, hidden]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def from_pdm(cls, pdm) -> "PDMWeights":
        c = pdm.config
        return cls([LayerWeights.from_module(layer) for layer in pdm.layers], pdm.norm.weight,
                   pdm.lm_head.weight, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_eps)


def pdm_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
             v_cache: torch.Tensor, start, cos: torch.Tensor, sin: torch.Tensor, *,
             backend: str | None = None) -> torch.Tensor:
    """Rows features [T, hidden] at positions start.. through every layer -> draft logits of the
    last row [Vd] (fp32). k_cache/v_cache [layers, kv_heads, S, head_dim] get the rows' keys and
    values; cos/sin are the full RoPE tables. `backend` picks the backend of every op of the step
    (qkv_rope_append, cache_attention, fused_linear, fused_swiglu; None: the dispatcher's
    choice). `start` is an int, or an int64 tensor of one element: with a tensor nothing in the
    step reads the position on the host (a CUDA graph of it replays at any position)."""
    H, KVH = weights.num_heads, weights.num_kv_heads
    if not isinstance(start, torch.Tensor):
        start = int(start)
    x = features
    for i, lw in enumerate(weights.layers):
        q = qkv_rope_append(x, lw.input_norm, weights.eps, lw.wq, lw.wk, lw.wv, lw.q_norm,
                            lw.k_norm, cos, sin, start, k_cache[i], v_cache[i], H, KVH,
                            backend=backend)
        att = cache_attention(q, k_cache[i], v_cache[i], start, backend=backend)
        x = fused_linear(att, lw.wo, residual=x, backend=backend)
        mid = fused_swiglu(x, lw.post_norm, weights.eps, lw.w_gate, lw.w_up, backend=backend)
        x = fused_linear(mid, lw.w_down, residual=x, backend=backend)
    return fused_linear(x[-1:], weights.lm_head, norm_weight=weights.final_norm, eps=weights.eps,
                        backend=backend)[0].float()
