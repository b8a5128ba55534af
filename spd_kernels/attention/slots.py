"""Op `slot_attention`: rows of several sequences, each against its own slot of a batched cache.

Terms. A batched cache holds B sequences, one per slot: k_cache[b] is slot b's
[KVH, S, head_dim] cache, laid out as a one-sequence cache is (spd.model.cache). A row belongs
to slot slots[r] and sees that slot's first lengths[r] keys, [0, lengths[r]): for a row at
position p whose key and value are already written there, lengths[r] = p + 1. Keys past a
row's length (another sequence's future, a dropped draft, NaN poison) never reach its output.
A row of length 0 (a free slot's bubble) gets zeros, on every backend.

  reference  torch. On the CPU (reading a length is free there) row by row, each exactly as
             `cache_attention` computes one row at position lengths[r] - 1 of slot slots[r]: the
             same numbers whether a sequence runs alone or beside others. On another device (no
             host read): the rows' slots gathered, the mask over all S keys built on the device,
             fp32 math, keys past each row's length zeroed before the products.
  triton     not yet (the batched cycle, issue 54, first runs on the reference).
  cuda       no.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import dispatch
from spd_kernels.attention import check_q_and_caches
from spd_kernels.checks import SPDInputError, check_tensor, check_values_enabled
from spd_kernels.opdef import op


def _check_slots(q, k_cache, v_cache, slots, lengths, scale):
    check_tensor("q", q, dim=3, floating=True)
    dev = q.device
    check_tensor("k_cache", k_cache, dim=4, floating=True, device=dev)
    check_tensor("v_cache", v_cache, dim=4, floating=True, device=dev)
    B = k_cache.shape[0]
    if B == 0 or v_cache.shape[0] != B:
        raise SPDInputError(f"k_cache and v_cache must hold the same slots, at least one, got "
                            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    # a slot is a one-sequence cache: the checks every attention op makes of q and caches
    _, R, _, _, S = check_q_and_caches(q, k_cache[0], v_cache[0], scale)
    for name, t in (("slots", slots), ("lengths", lengths)):
        check_tensor(name, t, dim=1, dtype=torch.int64, device=dev)
        if t.shape[0] != R:
            raise SPDInputError(f"{name} must hold one value per row of q ({R}), got "
                                f"{t.shape[0]}")
    if R and check_values_enabled(slots, lengths):
        if int(slots.min()) < 0 or int(slots.max()) >= B:
            raise SPDInputError(f"slots must lie in [0, {B}) (the caches' slots), got values in "
                                f"[{int(slots.min())}, {int(slots.max())}]")
        if int(lengths.min()) < 0 or int(lengths.max()) > S:
            raise SPDInputError(f"lengths must lie in [0, {S}] (a slot's keys), got values in "
                                f"[{int(lengths.min())}, {int(lengths.max())}]")


@op("slot_attention")
def slot_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, lengths: torch.Tensor, scale: float | None = None, *,
                   backend: str | None = None) -> torch.Tensor:
    """Attention of rows of several sequences, each against its own slot of a batched cache
    (see the module docstring).

    q [H, R, head_dim]: the rows' queries (RoPE applied).
    k_cache, v_cache [B, KVH, S, head_dim]: one cache per slot; H a multiple of KVH (query head
    h reads kv head h // (H/KVH)).
    slots [R] int64: each row's slot, in [0, B).
    lengths [R] int64: each row sees keys [0, lengths[r]) of its slot, in [0, S].
    scale: softmax scale, default 1/sqrt(head_dim).

    Returns [R, H * head_dim] in the caches' dtype (heads concatenated, ready for o_proj); a
    row of length 0 is zeros.
    """
    _check_slots(q, k_cache, v_cache, slots, lengths, scale)
    scale = None if scale is None else float(scale)
    return dispatch.call("slot_attention", q.device, q, k_cache, v_cache, slots, lengths, scale,
                         backend=backend)


@slot_attention.register_fake
def _(q, k_cache, v_cache, slots, lengths, scale=None):
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2], dtype=k_cache.dtype)


@dispatch.register("slot_attention", "reference")
def slot_attention_reference(q, k_cache, v_cache, slots, lengths, scale):
    H, R, hd = q.shape
    B, kvh, S, _ = k_cache.shape
    if lengths.device.type == "cpu":
        return _row_by_row(q, k_cache, v_cache, slots, lengths, scale)
    return _masked(q, k_cache, v_cache, slots, lengths, scale)


def _row_by_row(q, k_cache, v_cache, slots, lengths, scale):
    """Each row as cache_attention's reference computes a one-row chunk at position
    lengths[r] - 1 (SDPA over the slot's keys [0, lengths[r]))."""
    H, R, hd = q.shape
    B, kvh, S, _ = k_cache.shape
    out = torch.zeros(R, H * hd, dtype=k_cache.dtype, device=q.device)
    for r, (b, n) in enumerate(zip(slots.tolist(), lengths.tolist())):
        b, n = min(max(b, 0), B - 1), min(max(n, 0), S)  # (unchecked values: clamped)
        if n == 0:
            continue
        o = F.scaled_dot_product_attention(q[None, :, r:r + 1].to(k_cache.dtype),
                                           k_cache[None, b, :, :n], v_cache[None, b, :, :n],
                                           enable_gqa=H != kvh, scale=scale)
        out[r] = o[0, :, 0].reshape(H * hd)
    return out


def _masked(q, k_cache, v_cache, slots, lengths, scale):
    """On the device: every row's slot gathered, its keys past its length masked and zeroed."""
    H, R, hd = q.shape
    B, kvh, S, _ = k_cache.shape
    if R == 0:
        return q.new_empty(0, H * hd, dtype=k_cache.dtype)
    b = slots.clamp(0, B - 1)
    seen = torch.arange(S, device=q.device)[None, :] < lengths.clamp(0, S)[:, None]  # [R, S]
    keep = seen[:, None, :, None]
    k = torch.where(keep, k_cache.index_select(0, b).float(), 0.0)   # [R, KVH, S, hd]
    v = torch.where(keep, v_cache.index_select(0, b).float(), 0.0)
    qf = q.float().permute(1, 0, 2).reshape(R, kvh, H // kvh, 1, hd)  # [R, KVH, g, 1, hd]
    scores = torch.matmul(qf, k[:, :, None].transpose(-1, -2))       # [R, KVH, g, 1, S]
    scores = scores * (hd ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~seen[:, None, None, None, :], float("-inf"))
    # softmax by hand so that a row with no key gives zeros, not NaN
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v[:, :, None]) / torch.where(total > 0, total, 1.0)  # [R, KVH, g, 1, hd]
    return out.reshape(R, H * hd).to(k_cache.dtype)


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("slot_attention", "triton", "spd_kernels.attention.slots_triton")
