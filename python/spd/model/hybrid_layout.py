"""A hybrid target's weights in the stage step's layout, one copy each.

The stage step (spd_kernels.hybrid_stage) wants a gated-attention layer's query and key rows with
their head dimensions permuted (partial RoPE run as full-width RoPE, `head_permutation`), the
output-gate rows apart from the query rows, and q/k/v back to back; and Qwen3-Next's DeltaNet
projections, interleaved per key head, as Qwen3.5's [q | k | v], z, b, a. Instead of copies in
that layout beside Hugging Face's parameters, the parameters themselves hold their rows in that
order (same shape, rows permuted): `arrange_layer_` rearranges a built layer in place, and the
partial loader (spd.model.hybrid_loading) reads the files' rows straight into it.

Hugging Face's forward still sees its own layout: a rearranged Linear carries the buffer
`spd_hf_rows` (its Hugging Face row r is stored at row spd_hf_rows[r]) and a forward hook that
puts its output columns back in that order. Whatever else reads such a weight in Hugging Face's
layout goes through `hf_rows` (e.g. the fingerprint's sample, `sample_hf_layout`).
"""
from __future__ import annotations

import torch

from spd.errors import SPDError
from spd_kernels.qkv_rope import back_to_back

HF_ROWS = "spd_hf_rows"


def rotary_dim(config, head_dim: int) -> int:
    rope = getattr(config, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(head_dim * factor)


def head_permutation(head_dim: int, rot: int) -> torch.Tensor:
    """New order of a head's dimensions: [rot first half | pass first half | rot second half |
    pass second half], so the rotated pairs (i, i + rot/2) lie head_dim/2 apart."""
    r2, p2 = rot // 2, (head_dim - rot) // 2
    return torch.cat([torch.arange(0, r2), torch.arange(rot, rot + p2), torch.arange(r2, rot),
                      torch.arange(rot + p2, head_dim)])


def attention_dims(config) -> tuple[int, int, int, int]:
    """(heads, kv heads, head_dim, rotated dims) of a hybrid config's gated attention."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (config.num_attention_heads, config.num_key_value_heads, hd,
            rotary_dim(config, hd))


def attention_rows(num_heads: int, num_kv_heads: int, head_dim: int, rot: int):
    """Stored row -> Hugging Face row of q_proj ([gate rows of every head | query rows, head
    dims permuted]: the query rows then lie just before k_proj's) and of k_proj (head dims
    permuted)."""
    perm = head_permutation(head_dim, rot)
    heads = torch.arange(num_heads)[:, None] * 2 * head_dim  # HF: per head [query | gate]
    gate = heads + head_dim + torch.arange(head_dim)
    q = torch.cat([gate.reshape(-1), (heads + perm).reshape(-1)])
    k = (torch.arange(num_kv_heads)[:, None] * head_dim + perm).reshape(-1)
    return q, k


def deltanet_rows(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int):
    """Stored row -> Hugging Face row of Qwen3-Next's in_proj_qkvz (per key head [q | k | v | z]
    -> [all q | all k | all v | all z]) and in_proj_ba (per key head [b | a] -> [all b | all a])."""
    rep = num_v_heads // num_k_heads
    dk, vd = head_k_dim, rep * head_v_dim
    base = torch.arange(num_k_heads)[:, None] * (2 * dk + 2 * vd)
    qkvz = torch.cat([(base + off + torch.arange(n)).reshape(-1)
                      for off, n in ((0, dk), (dk, dk), (2 * dk, vd), (2 * dk + vd, vd))])
    base = torch.arange(num_k_heads)[:, None] * 2 * rep
    ba = torch.cat([(base + torch.arange(rep)).reshape(-1),
                    (base + rep + torch.arange(rep)).reshape(-1)])
    return qkvz, ba


def check_layer(layer) -> None:
    """Biases the stage step does not compute are refused (neither model has them)."""
    a = getattr(layer, "self_attn", None)
    if a is not None:
        for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            if getattr(p, "bias", None) is not None:
                raise SPDError("attention biases are not supported on hybrid targets")
    elif layer.linear_attn.conv1d.bias is not None:
        raise SPDError("a bias on the DeltaNet convolution is not supported")


def layer_groups(layer, dims) -> list[list[tuple[str, torch.Tensor | None]]]:
    """The layer's weights held in one buffer each group, in order, as (name relative to the
    layer, stored row -> Hugging Face row, or None for the file's order). dims: attention_dims."""
    groups = []
    if hasattr(layer, "self_attn"):
        q, k = attention_rows(*dims)
        groups.append([("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", k),
                       ("self_attn.v_proj.weight", None)])
    elif hasattr(layer.linear_attn, "in_proj_qkvz"):  # Qwen3-Next
        la = layer.linear_attn
        qkvz, ba = deltanet_rows(la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim)
        groups += [[("linear_attn.in_proj_qkvz.weight", qkvz)],
                   [("linear_attn.in_proj_ba.weight", ba)]]
    if hasattr(layer.mlp, "gate_proj"):  # dense SwiGLU (not a mixture of experts)
        groups.append([("mlp.gate_proj.weight", None), ("mlp.up_proj.weight", None)])
    return groups


def _to_hf_columns(module, args, out):
    return out.index_select(-1, getattr(module, HF_ROWS))


def set_hf_rows_(module, rows: torch.Tensor) -> None:
    """Mark `module` (a Linear) as holding its weight's rows in the order `rows` (stored row ->
    HF row); its forward then gives Hugging Face's output columns."""
    if hasattr(module, HF_ROWS):
        raise SPDError(f"{type(module).__name__} is rearranged already")
    module.register_buffer(HF_ROWS, torch.argsort(rows).to(module.weight.device),
                           persistent=False)
    module.register_forward_hook(_to_hf_columns)


def hf_rows(module) -> torch.Tensor | None:
    """Hugging Face row -> stored row of a rearranged Linear, else None."""
    return getattr(module, HF_ROWS, None)


@torch.no_grad()
def arrange_layer_(layer, dims) -> None:
    """Put a built (Hugging Face layout) layer's weights in the stage layout, in place: each
    group one buffer, the parameters views of it (one copy of every weight; the old storage is
    freed once nothing else holds it). A no-op on an arranged layer; an arranged layer whose
    weights were moved apart (`.to(device)`) is only packed again."""
    check_layer(layer)
    for group in layer_groups(layer, dims):
        params = [layer.get_parameter(n) for n, _ in group]
        owners = [layer.get_submodule(n.rpartition(".")[0]) for n, _ in group]
        reorder = [rows is not None and hf_rows(m) is None for m, (_, rows) in zip(owners, group)]
        if back_to_back(*params) is not None and not any(reorder):
            continue
        first = params[0]
        buf = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype,
                          device=first.device)
        for p, view, (_, rows), r in zip(params, buf.split([p.shape[0] for p in params]), group,
                                         reorder):
            if r:
                torch.index_select(p, 0, rows.to(p.device), out=view)
            else:
                view.copy_(p)
            p.data = view
        for m, (_, rows), r in zip(owners, group, reorder):
            if r:
                set_hf_rows_(m, rows)


def sample_hf_layout(w: torch.Tensor, rows: torch.Tensor, count: int) -> torch.Tensor:
    """flat[::max(1, numel // count)][:count] of the weight in Hugging Face's layout, read from
    `w` stored with its rows rearranged (rows: hf_rows of its Linear): the same elements a file
    or an unarranged load gives."""
    numel, cols = w.numel(), w.shape[1]
    idx = torch.arange(0, numel, max(1, numel // count), device=w.device)[:count]
    stored = rows.to(w.device)[idx // cols] * cols + idx % cols
    return w.detach().reshape(-1)[stored]
