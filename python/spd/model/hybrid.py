"""Hybrid linear-attention targets (Qwen3.5, Qwen3-Next): their layers as plain tensors for
spd_kernels.hybrid_stage, the RoPE tables of their partial rotation, and a stage cache whose
linear-attention state rolls back by length.

The layers' weights are held in the step's layout (spd.model.hybrid_layout: q/k head dimensions
permuted for partial RoPE, q/k/v back to back, Qwen3-Next's interleaved DeltaNet projections in
Qwen3.5's layout), so the weights built here are views of the parameters, not copies.
"""
from __future__ import annotations

import torch

from spd.errors import InternalError
from spd.model.cache import KVCache
from spd.model.hybrid_layout import (  # noqa: F401 (rotary_dim, head_permutation: re-exported)
    arrange_layer_,
    attention_dims,
    head_permutation,
    rotary_dim,
)
from spd_kernels import truncate_kv_
from spd_kernels.hybrid_stage import (
    DeltaNetWeights,
    GatedAttentionWeights,
    HybridStageWeights,
    MLPWeights,
)

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")


def is_hybrid(config) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or ())


def full_width_rope(cos: torch.Tensor, sin: torch.Tensor, head_dim: int):
    """Partial-rotation tables cos/sin [P, rot] -> [P, head_dim] in the permuted order: the
    unrotated dimensions get cos 1, sin 0 (x * 1 + y * 0 = x exactly)."""
    P, rot = cos.shape
    r2, p2 = rot // 2, (head_dim - rot) // 2
    one, zero = cos.new_ones(P, p2), sin.new_zeros(P, p2)
    return (torch.cat([cos[:, :r2], one, cos[:, r2:], one], dim=1),
            torch.cat([sin[:, :r2], zero, sin[:, r2:], zero], dim=1))


def _offset(norm) -> torch.Tensor:
    """A zero-centred RMSNorm's effective weight 1 + w, in the weight's dtype."""
    return (1.0 + norm.weight.detach().float()).to(norm.weight.dtype)


def _mlp(layer) -> MLPWeights:
    m = layer.mlp
    post = _offset(layer.post_attention_layernorm)
    if not hasattr(m, "gate_proj"):  # Qwen3-Next's sparse mixture of experts
        return MLPWeights(post, moe=m)
    return MLPWeights(post, m.gate_proj.weight.detach(), m.up_proj.weight.detach(),
                      m.down_proj.weight.detach())


def attention_weights(layer, num_heads: int, num_kv_heads: int, head_dim: int,
                      rot: int) -> GatedAttentionWeights:
    """Views of an arranged layer (spd.model.hybrid_layout): q_proj holds [gate | query] rows."""
    arrange_layer_(layer, (num_heads, num_kv_heads, head_dim, rot))
    a = layer.self_attn
    perm = head_permutation(head_dim, rot).to(a.q_proj.weight.device)
    gate, wq = a.q_proj.weight.detach().split(num_heads * head_dim)
    return GatedAttentionWeights(_offset(layer.input_layernorm), wq, gate,
                                 a.k_proj.weight.detach(), a.v_proj.weight.detach(),
                                 _offset(a.q_norm)[perm], _offset(a.k_norm)[perm],
                                 a.o_proj.weight.detach(), _mlp(layer))


def deltanet_weights(layer, config) -> DeltaNetWeights:
    """Views of an arranged layer: Qwen3-Next's in_proj_qkvz holds [q | k | v | z] rows and its
    in_proj_ba [b | a] rows (spd.model.hybrid_layout)."""
    arrange_layer_(layer, attention_dims(config))
    la = layer.linear_attn
    hk, hv, dk, dv = la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim
    if hasattr(la, "in_proj_qkv"):  # Qwen3.5
        w_qkv, w_z = la.in_proj_qkv.weight.detach(), la.in_proj_z.weight.detach()
        w_b, w_a = la.in_proj_b.weight.detach(), la.in_proj_a.weight.detach()
    else:  # Qwen3-Next
        w_qkv, w_z = la.in_proj_qkvz.weight.detach().split([2 * hk * dk + hv * dv, hv * dv])
        w_b, w_a = la.in_proj_ba.weight.detach().split(hv)
    return DeltaNetWeights(_offset(layer.input_layernorm), w_qkv, w_z, w_b, w_a,
                           la.conv1d.weight.detach()[:, 0], la.A_log.detach(),
                           la.dt_bias.detach(), la.norm.weight.detach(),
                           la.out_proj.weight.detach(), _mlp(layer), hk, hv, dk, dv)


def hybrid_stage_weights(target, layer_ids: range) -> HybridStageWeights:
    layers = []
    for i in layer_ids:
        layer = target.layers[i]
        if hasattr(layer, "linear_attn"):
            layers.append(deltanet_weights(layer, target.config))
        else:
            layers.append(attention_weights(layer, target.num_heads, target.num_kv_heads,
                                            target.head_dim, target.rotary_dim))
    return HybridStageWeights(layers, target.num_heads, target.num_kv_heads, target.head_dim,
                              target.rms_eps)


class HybridCache(KVCache):
    """A stage's cache on a hybrid target: KV buffers for its full-attention layers (in-place
    truncation, as KVCache) and, for its DeltaNet layers, rings of `ring` states and conv
    histories indexed by length mod ring (spd_kernels.deltanet).

    A truncation may go back at most ring - 1 positions from the furthest length written since
    (`restorable_from`); deeper is an InternalError (the engines never roll back further),
    since the state it needs is overwritten.
    Truncating to 0 is a reset (the empty state is zeros). With poisoning the slots of dropped
    lengths are NaN'd, so a step that read one would give NaN.
    """

    def __init__(self, target, layer_ids: range, capacity: int, ring: int,
                 poison_on_truncate: bool = False):
        attn = [i for i in layer_ids if not hasattr(target.layers[i], "linear_attn")]
        lin = [target.layers[i].linear_attn for i in layer_ids
               if hasattr(target.layers[i], "linear_attn")]
        super().__init__(max(len(attn), 1), target.num_kv_heads, target.head_dim,
                         capacity if attn else 0, target.device, target.dtype, poison_on_truncate)
        self.num_attention = len(attn)
        if not attn:  # no KV buffers; `lengths` still holds the stage's device length
            self.k = self.k[:0]
            self.v = self.v[:0]
        if ring < 2:
            raise InternalError("a state ring needs at least 2 slots", ring=ring)
        self.capacity = capacity
        self.ring = ring
        dev = target.device
        if lin:
            la = lin[0]
            conv_dim, kernel = la.conv1d.weight.shape[0], la.conv1d.weight.shape[-1]
            self.conv = torch.zeros(len(lin), ring, kernel - 1, conv_dim, device=dev,
                                    dtype=target.dtype)
            self.state = torch.zeros(len(lin), ring, la.num_v_heads, la.head_k_dim,
                                     la.head_v_dim, device=dev, dtype=torch.float32)
        else:
            self.conv = torch.zeros(0, ring, 0, 0, device=dev, dtype=target.dtype)
            self.state = torch.zeros(0, ring, 0, 0, 0, device=dev, dtype=torch.float32)
        self.restorable_from = 0  # the lowest length a truncation may restore
        self.written_to = 0       # the furthest length written at a host position

    def ring_bytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.state.numel() * 4

    def check_room(self, start: int, rows: int) -> None:
        """As KVCache's; a write at a host position also moves how far back the rings reach."""
        super().check_room(start, rows)
        self.written_to = max(self.written_to, start + rows)
        self.restorable_from = max(self.restorable_from, start + rows - self.ring + 1)

    def reserve(self, start: int, rows: int) -> None:
        self.check_room(start, rows)
        self.lengths.fill_(start + rows)

    def truncate(self, length: int) -> None:
        if length < 0:
            raise InternalError("truncation to a negative length", length=length)
        if length == 0:  # a reset: the empty state is zeros
            self.restorable_from = self.written_to = 0
            if self.num_attention:
                super().truncate(0)
            else:
                self.lengths.fill_(0)
            self.conv[:, 0].zero_()
            self.state[:, 0].zero_()
            if self.poison_on_truncate:
                self.conv[:, 1:].fill_(float("nan"))
                self.state[:, 1:].fill_(float("nan"))
            return
        # (writes at host positions, which the single-process engines make, set the bound; a
        # stage rank's units carry device positions, and its rollbacks are those positions)
        if length < self.restorable_from:
            raise InternalError("a linear-attention state rolled back deeper than its ring "
                                "holds", length=length, ring=self.ring,
                                restorable=f"{self.restorable_from}..{self.written_to}")
        old = self.length if self.poison_on_truncate else 0  # debug: a host read
        if self.num_attention:
            super().truncate(length)
        else:
            truncate_kv_(self.lengths, self._new_length.fill_(length))
        if self.poison_on_truncate:
            dropped = [p % self.ring for p in range(length + 1, old + 1)]
            if dropped:
                self.conv[:, dropped] = float("nan")
                self.state[:, dropped] = float("nan")


def ring_bytes(config, layer_ids: range, ring: int, dtype_bytes: int = 2) -> int:
    """Bytes of the state rings a stage over `layer_ids` keeps (from the config alone): per
    DeltaNet layer `ring` fp32 states [Hv, dk, dv] and `ring` conv histories [K-1, C] in the
    model dtype."""
    linear = sum(config.layer_types[i] == "linear_attention" for i in layer_ids)
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv = (config.linear_conv_kernel_dim - 1) * (2 * hk * dk + hv * dv) * dtype_bytes
    return linear * ring * (hv * dk * dv * 4 + conv)
