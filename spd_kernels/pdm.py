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

from spd_kernels.linear import fused_linear
from spd_kernels.stage import LayerWeights, decoder_layer

__all__ = ["STEP_OPS", "LayerWeights", "PDMWeights", "pdm_step"]

# the dispatched ops the step runs (benchmarks time the step against them)
STEP_OPS = ("qkv_rope_append", "cache_attention", "fused_linear", "fused_swiglu")


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
    if not isinstance(start, torch.Tensor):
        start = int(start)
    x = features
    for i, lw in enumerate(weights.layers):
        x = decoder_layer(x, lw, k_cache[i], v_cache[i], start, cos, sin, weights.num_heads,
                          weights.num_kv_heads, weights.eps, backend=backend)
    return fused_linear(x[-1:], weights.lm_head, norm_weight=weights.final_norm, eps=weights.eps,
                        backend=backend)[0].float()
