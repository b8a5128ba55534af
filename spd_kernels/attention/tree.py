"""Op `tree_attention`: token-tree rows against a KV cache (tree drafting).

Terms. A token tree drafts several candidate rows per position. Every row attends to the
committed prefix of the cache, slots [0, prefix_len), and to a few "tree slots": cache slots
holding tree tokens (its ancestors on its own branch, and itself), chosen per row by a boolean
mask. Row r's keys are the prefix slots, then tree_slots[m] for each m with tree_mask[r, m], in
that order; a slot listed twice (or a tree slot inside the prefix) counts as two keys. Cache
slots no row attends to may hold anything (NaN poison): they never reach the output.

A row with no key (prefix_len 0 and an all-False mask row) gets zeros, on every backend. With
an int prefix_len of 0 the host refuses an empty tree_slots; the mask's content is not read on
the host (that would be a device synchronisation), so an empty mask row is not an error.

  reference  torch, fp32 math, one rounding to the caches' dtype. With an int prefix_len: the
             prefix sliced [0, prefix_len) and the tree slots gathered. With a tensor
             prefix_len (read on the device, no host synchronisation): the mask over all S
             prefix positions built on the device, plus the gathered tree slots. Keys no row
             sees are zeroed before the products, so a 0 weight never meets a NaN value.
  triton     on request (registered automatic=False: checked in the interpreter, not yet
             compiled or timed on a GPU): program (kv head, block of (row, query head) pairs),
             the prefix in key blocks then the tree slots in blocks of gathered rows, both
             products with tl.dot, online softmax, fp32 statistics and accumulation, one
             rounding to the cache dtype. No key split yet (one program walks the whole prefix),
             so the automatic choice is the reference.
  cuda       no.
"""
from __future__ import annotations

import operator

import torch

from spd_kernels import dispatch
from spd_kernels.attention import check_q_and_caches
from spd_kernels.checks import SPDInputError, check_tensor, check_values_enabled
from spd_kernels.opdef import Position, op


def _check_prefix_len(prefix_len, capacity: int, device) -> int | None:
    """prefix_len's value when it can be read without a host synchronisation, else None."""
    if isinstance(prefix_len, torch.Tensor):
        check_tensor("prefix_len", prefix_len, dtype=torch.int64, device=device)
        if prefix_len.numel() != 1:
            raise SPDInputError(f"prefix_len must hold one position, got shape "
                                f"{tuple(prefix_len.shape)}")
        value = int(prefix_len.reshape(-1)[0]) if check_values_enabled(prefix_len) else None
    else:
        try:  # an int (or numpy integer), never a float truncated to one
            value = operator.index(prefix_len)
        except TypeError:
            raise SPDInputError(f"prefix_len must be an int or an int64 tensor of one element, "
                                f"got {type(prefix_len).__name__} {prefix_len!r}") from None
    if value is not None and not 0 <= value <= capacity:
        raise SPDInputError(f"prefix_len must lie in [0, {capacity}] (the cache's slots), "
                            f"got {value}")
    return value


def _check_tree(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale):
    _, R, _, _, S = check_q_and_caches(q, k_cache, v_cache, scale)
    dev = q.device
    check_tensor("tree_slots", tree_slots, dim=1, dtype=torch.int64, device=dev)
    check_tensor("tree_mask", tree_mask, dim=2, dtype=torch.bool, device=dev)
    M = tree_slots.shape[0]
    if tuple(tree_mask.shape) != (R, M):
        raise SPDInputError(f"tree_mask must be [R, M] = [{R}, {M}] (q's rows, tree_slots' "
                            f"length), got {tuple(tree_mask.shape)}")
    prefix = _check_prefix_len(prefix_len, S, dev)
    if prefix == 0 and M == 0:
        raise SPDInputError("prefix_len is 0 and tree_slots is empty: the rows have no key")
    if M and check_values_enabled(tree_slots):
        lo, hi = int(tree_slots.min()), int(tree_slots.max())
        if lo < 0 or hi >= S:
            raise SPDInputError(f"tree_slots must lie in [0, {S}) (the cache's slots), got "
                                f"values in [{lo}, {hi}]")


@op("tree_attention")
def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   prefix_len: Position, tree_slots: torch.Tensor, tree_mask: torch.Tensor,
                   scale: float | None = None, *, backend: str | None = None) -> torch.Tensor:
    """Attention of token-tree rows against a KV cache: each row sees the committed prefix and
    the tree slots its mask picks (see the module docstring).

    q [H, R, head_dim]: the rows' queries (RoPE applied).
    k_cache, v_cache [KVH, S, head_dim]: H a multiple of KVH (query head h reads kv head
    h // (H/KVH)), as cache_attention.
    prefix_len: an int, or an int64 tensor of one element on q's device read there (no host
    synchronisation); every row attends to slots [0, prefix_len).
    tree_slots [M] int64 (M may be 0): cache slots, normally in [prefix_len, S), any order.
    tree_mask [R, M] bool: row r also attends to tree_slots[m] iff tree_mask[r, m].
    scale: softmax scale, default 1/sqrt(head_dim).

    Returns [R, H * head_dim] in the caches' dtype (heads concatenated, ready for o_proj); a
    row with no key is zeros.
    """
    _check_tree(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale)
    if not isinstance(prefix_len, torch.Tensor):
        prefix_len = int(prefix_len)
    scale = None if scale is None else float(scale)
    return dispatch.call("tree_attention", q.device, q, k_cache, v_cache, prefix_len,
                         tree_slots, tree_mask, scale, backend=backend)


@tree_attention.register_fake
def _(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale=None):
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2], dtype=k_cache.dtype)


@dispatch.register("tree_attention", "reference")
def tree_attention_reference(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale):
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    dev = q.device
    if R == 0:
        return q.new_empty(0, H * hd, dtype=k_cache.dtype)
    # Unchecked device values (SPD_CHECK_VALUES unset) are clamped / masked as the kernel does:
    # a slot outside the cache is never attended, a prefix past the cache ends at S.
    valid = (tree_slots >= 0) & (tree_slots < S)                       # [M]
    idx = torch.where(valid, tree_slots, 0)
    seen_tree = tree_mask & valid[None, :]                             # [R, M]
    used = seen_tree.any(0)[:, None]                                   # [M, 1]: some row sees it
    k_tree = torch.where(used, k_cache.index_select(1, idx).float(), 0.0)  # [KVH, M, hd]
    v_tree = torch.where(used, v_cache.index_select(1, idx).float(), 0.0)
    if isinstance(prefix_len, torch.Tensor) and dev.type == "cpu":  # read where that is free:
        prefix_len = min(max(int(prefix_len.reshape(-1)[0]), 0), S)  # the same numbers as an int
    if isinstance(prefix_len, torch.Tensor):
        end = prefix_len.reshape(-1)[:1].clamp(0, S)                   # [1], stays on the device
        inside = torch.arange(S, device=dev) < end                     # [S]
        k_pre = torch.where(inside[:, None], k_cache.float(), 0.0)     # [KVH, S, hd]
        v_pre = torch.where(inside[:, None], v_cache.float(), 0.0)
        seen_pre = inside.expand(R, S)
    else:  # on the host: only the prefix is read
        k_pre, v_pre = k_cache[:, :prefix_len].float(), v_cache[:, :prefix_len].float()
        seen_pre = torch.ones(R, prefix_len, dtype=torch.bool, device=dev)
    k = torch.cat([k_pre, k_tree], 1)                                  # [KVH, N, hd]
    v = torch.cat([v_pre, v_tree], 1)
    seen = torch.cat([seen_pre, seen_tree], 1)                         # [R, N]
    if k.shape[1] == 0:
        return torch.zeros(R, H * hd, dtype=k_cache.dtype, device=dev)
    qf = q.float().view(kvh, H // kvh, R, hd)
    scores = torch.matmul(qf, k[:, None].transpose(-1, -2))           # [KVH, g, R, N]
    scores = scores * (hd ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~seen, float("-inf"))
    # softmax by hand so that a row with no key gives zeros, not NaN (exp(-inf) = 0, sum 0)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)
    p = torch.exp(scores - top)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v[:, None]) / torch.where(total > 0, total, 1.0)  # [KVH, g, R, hd]
    return out.reshape(H, R, hd).transpose(0, 1).reshape(R, H * hd).to(k_cache.dtype)


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("tree_attention", "triton", "spd_kernels.attention.tree_triton")
