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

import dataclasses
from dataclasses import dataclass

import torch

from spd_kernels.linear import fused_linear
from spd_kernels.qkv_rope import back_to_back
from spd_kernels.quant import quantize_weight
from spd_kernels.stage import (
    LayerWeights,
    batch_decoder_layer,
    batch_tree_decoder_layer,
    decoder_layer,
    tree_decoder_layer,
)

__all__ = ["STEP_OPS", "LayerWeights", "PDMWeights", "pdm_batch_step", "pdm_batch_tree_step",
           "pdm_step", "pdm_tree_step", "quantize_group", "quantize_pdm_weights"]

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
    # [Vd] fp32 when lm_head is quantised (int8 / float8_e4m3fn, spd_kernels.quant); the layers
    # carry their own scales (LayerWeights)
    lm_head_scale: torch.Tensor | None = None

    @classmethod
    def from_pdm(cls, pdm) -> "PDMWeights":
        c = pdm.config
        return cls([LayerWeights.from_module(layer) for layer in pdm.layers], pdm.norm.weight,
                   pdm.lm_head.weight, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_eps)


def quantize_group(ws: list[torch.Tensor], kind: str) -> list[tuple]:
    """[(q, scale)] of weights ws; weights lying back to back (pack_qkv) are quantised as one,
    so the copies and their scales lie back to back too (one product in the step)."""
    packed = back_to_back(*ws) if len(ws) > 1 else None
    if packed is None:
        return [quantize_weight(w, kind) for w in ws]
    q, scale = quantize_weight(packed, kind)
    sizes = [w.shape[0] for w in ws]
    return list(zip(q.split(sizes), scale.split(sizes)))


def quantize_pdm_weights(weights: PDMWeights, kind: str = "int8") -> PDMWeights:
    """A copy of float `weights` with every matrix the step reads (q/k/v, o, gate/up, down, the
    LM head) quantised: int8 or fp8 (spd_kernels.quant.quantize_weight); norms and biases kept."""
    layers = []
    for lw in weights.layers:
        (wq, sq), (wk, sk), (wv, sv) = quantize_group([lw.wq, lw.wk, lw.wv], kind)
        (wg, sg), (wu, su) = quantize_group([lw.w_gate, lw.w_up], kind)
        wo, so = quantize_weight(lw.wo, kind)
        wd, sd = quantize_weight(lw.w_down, kind)
        layers.append(dataclasses.replace(
            lw, wq=wq, wk=wk, wv=wv, wq_scale=sq, wk_scale=sk, wv_scale=sv, wo=wo, wo_scale=so,
            w_gate=wg, gate_scale=sg, w_up=wu, up_scale=su, w_down=wd, down_scale=sd))
    head, head_scale = quantize_weight(weights.lm_head, kind)
    return dataclasses.replace(weights, layers=layers, lm_head=head, lm_head_scale=head_scale)


def pdm_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
             v_cache: torch.Tensor, start, cos: torch.Tensor, sin: torch.Tensor, *,
             last: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Rows features [T, hidden] at positions start.. through every layer -> draft logits of the
    last row [Vd] (fp32), or of row `last` (int64 [1] on the device: a window that runs past
    the newest row, whose later rows are never read). k_cache/v_cache [layers, kv_heads, S,
    head_dim] get the rows' keys and values; cos/sin are the full RoPE tables. `backend` picks
    the backend of every op of the step (qkv_rope_append, cache_attention, fused_linear,
    fused_swiglu; None: the dispatcher's choice). `start` is an int, or an int64 tensor of one
    element: with a tensor nothing in the step reads the position on the host (a CUDA graph of
    it replays at any position). Quantised weights (scales in `weights`, spd_kernels.quant) go
    to the ops that read them."""
    if not isinstance(start, torch.Tensor):
        start = int(start)
    x = features
    for i, lw in enumerate(weights.layers):
        x = decoder_layer(x, lw, k_cache[i], v_cache[i], start, cos, sin, weights.num_heads,
                          weights.num_kv_heads, weights.eps, backend=backend)
    row = x[-1:] if last is None else x.index_select(0, last)
    return fused_linear(row, weights.lm_head, norm_weight=weights.final_norm, eps=weights.eps,
                        weight_scale=weights.lm_head_scale, backend=backend)[0].float()


def pdm_batch_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, last: torch.Tensor, *,
                   backend: str | None = None) -> torch.Tensor:
    """`pdm_step` for the windows of several sequences at once: features [T, hidden], row r of
    slot slots[r] ([T] int64) at position positions[r] ([T] int64) of k_cache/v_cache [B,
    layers, kv_heads, S, head_dim] (slot b's one-sequence cache is k_cache[b]); cos/sin the full
    RoPE tables; last [U] int64 the rows whose logits are returned -> draft logits [U, Vd]
    (fp32). The linear layers run over every row at once (the weight reads shared); each row
    writes its key and value at its slot and position, then attends to its slot's keys up to
    its position (spd_kernels.stage.batch_decoder_layer): a window computes what `pdm_step`
    computes of it alone. Positions stay on the device."""
    cos_rows, sin_rows = cos.index_select(0, positions), sin.index_select(0, positions)
    x = features
    for i, lw in enumerate(weights.layers):
        x = batch_decoder_layer(x, lw, k_cache[:, i], v_cache[:, i], slots, positions, cos_rows,
                                sin_rows, weights.num_heads, weights.num_kv_heads, weights.eps,
                                backend=backend)
    return fused_linear(x.index_select(0, last), weights.lm_head,
                        norm_weight=weights.final_norm, eps=weights.eps,
                        weight_scale=weights.lm_head_scale, backend=backend).float()


def pdm_tree_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, prefix_len, tree_mask: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, leaves: torch.Tensor, *,
                  backend: str | None = None) -> torch.Tensor:
    """`pdm_step` over the rows of a token tree: features [R, hidden], row r written to cache
    slot slots[r] ([R] int64) with RoPE cos/sin[r] ([R, head_dim]); it attends to slots
    [0, prefix_len) and to the rows r' of this step where tree_mask[r, r'] ([R, R] bool: its
    ancestors and itself) -> draft logits [len(leaves), Vd] (fp32) of the rows `leaves` ([k]
    int64)."""
    x = features
    for i, lw in enumerate(weights.layers):
        x = tree_decoder_layer(x, lw, k_cache[i], v_cache[i], slots, prefix_len, slots,
                               tree_mask, cos, sin, weights.num_heads, weights.num_kv_heads,
                               weights.eps, backend=backend)
    return fused_linear(x.index_select(0, leaves), weights.lm_head,
                        norm_weight=weights.final_norm, eps=weights.eps,
                        weight_scale=weights.lm_head_scale, backend=backend).float()


def pdm_batch_tree_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slots: list[int], rows: torch.Tensor,
                        prefix_len: torch.Tensor, tree_mask: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, leaves: torch.Tensor, *,
                        backend: str | None = None) -> torch.Tensor:
    """`pdm_tree_step` for U token trees of several sequences, R rows each: features [U * R,
    hidden], tree u's rows u * R.. in slot slots[u] (host ints) of k_cache/v_cache [B, layers,
    kv_heads, S, head_dim], written at its cache rows rows[u] ([U, R] int64); tree u attends to
    its slot's rows [0, prefix_len[u]) ([U] int64) and to its own rows where tree_mask[u]
    ([U, R, R] bool); cos/sin [U * R, head_dim] the rows' RoPE -> draft logits [len(leaves), Vd]
    (fp32) of the rows `leaves` ([k] int64, indices into the U * R rows). The linear layers run
    over every row at once; each tree computes what `pdm_tree_step` computes of it alone."""
    x = features
    for i, lw in enumerate(weights.layers):
        x = batch_tree_decoder_layer(x, lw, k_cache[:, i], v_cache[:, i], slots, rows,
                                     prefix_len, rows, tree_mask, cos, sin, weights.num_heads,
                                     weights.num_kv_heads, weights.eps, backend=backend)
    return fused_linear(x.index_select(0, leaves), weights.lm_head,
                        norm_weight=weights.final_norm, eps=weights.eps,
                        weight_scale=weights.lm_head_scale, backend=backend).float()
