"""Op `cache_attention`: a chunk of rows against a KV cache that already holds them.

  reference  torch. With an int `start`: SDPA over cache rows [0, start + R) with the causal
             chunk mask, exactly spd.model.layers' attention. With a tensor `start`: the mask over the
             whole cache is built on the device (no host read), fp32 math.
  triton     program (kv head, key split, block of (row, query head) pairs): every key block is
             read once for all rows and the G = H / KVH heads sharing it, both products on the
             tensor cores (tl.dot), online softmax over keys up to start + row (read on the
             device), fp32 statistics and accumulation. On a GPU the keys are split
             (flash-decoding); the split is fixed by the cache capacity, not the position, so
             graphs replay anywhere, and a second launch merges the splits that hold keys in a
             fixed order. One rounding to the cache dtype. Output [R, H * head_dim], ready for
             o_proj.
  cuda       on request (spd_kernels.on_request.attention_cuda): csrc/kernels/attention.cu, bf16 /
             fp16, head_dim 64 or 128, the same split-and-merge plan as Triton's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import _alloc, dispatch
from spd_kernels._host import next_pow2
from spd_kernels.cache_positions import check_start, positions
from spd_kernels.checks import SPDInputError, check_kernel_float, check_tensor, last_dim_contiguous
from spd_kernels.opdef import Position, op


def check_q_and_caches(q, k_cache, v_cache, scale) -> tuple[int, int, int, int, int]:
    """The checks every attention op makes of its queries q [H, R, hd], caches [KVH, S, hd]
    (one shape and dtype, GQA) and softmax scale -> (H, R, hd, KVH, S)."""
    check_tensor("q", q, dim=3, floating=True)
    dev = q.device
    check_tensor("k_cache", k_cache, dim=3, floating=True, device=dev)
    check_tensor("v_cache", v_cache, dim=3, floating=True, device=dev)
    H, R, hd = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise SPDInputError(f"k_cache and v_cache must have one shape and dtype, got "
                            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                            f"{v_cache.dtype}")
    kvh, S, chd = k_cache.shape
    if chd != hd:
        raise SPDInputError(f"q has head_dim {hd} but the caches [num_kv_heads, S, head_dim] "
                            f"have head_dim {chd}")
    if kvh <= 0 or H <= 0 or H % kvh:
        raise SPDInputError(f"q's heads ({H}) must be a positive multiple of the caches' kv "
                            f"heads ({kvh}) (grouped-query attention)")
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and 0 < float(scale) < float("inf")):
        raise SPDInputError(f"scale must be a positive finite float or None, got {scale!r}")
    return H, R, hd, kvh, S


def _check_attention(q, k_cache, v_cache, start, scale):
    _, R, _, _, S = check_q_and_caches(q, k_cache, v_cache, scale)
    check_start(start, R, S, q.device)


@op("cache_attention")
def cache_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    start: Position, scale: float | None = None, *,
                    backend: str | None = None) -> torch.Tensor:
    """Attention of a chunk of rows against a KV cache that already holds them.

    q [H, R, head_dim]: the rows' queries (RoPE applied), row r at position start + r.
    k_cache, v_cache [KVH, S, head_dim]: keys/values, rows start..start+R-1 already written (e.g.
    by qkv_rope_append); H must be a multiple of KVH (query head h reads kv head h // (H/KVH)).
    start: an int, or an int64 tensor with one element (shape [] or [1]) on q's device, read on
    the device by the kernel: no host synchronisation, so a CUDA graph can replay the call at
    any position. Row r attends to cache positions 0..start+r (causal inside the chunk).
    scale: softmax scale, default 1/sqrt(head_dim).

    Returns [R, H * head_dim] in the caches' dtype (heads concatenated, ready for o_proj).
    """
    _check_attention(q, k_cache, v_cache, start, scale)
    if not isinstance(start, torch.Tensor):
        start = int(start)
    scale = None if scale is None else float(scale)
    return dispatch.call("cache_attention", q.device, q, k_cache, v_cache, start, scale,
                         backend=backend)


@cache_attention.register_fake
def _(q, k_cache, v_cache, start, scale=None):
    return q.new_empty(q.shape[1], q.shape[0] * q.shape[2], dtype=k_cache.dtype)


@dispatch.register("cache_attention", "reference")
def cache_attention_reference(q, k_cache, v_cache, start, scale):
    """Two paths with the same result (up to rounding):
    - start an int, or a CPU tensor (read on the host, where that waits for nothing: the same
      numbers whichever form the caller holds the position in): SDPA over cache rows
      [0, start + R) with the causal chunk mask, as the training form of the layer computes it
      (spd.model.layers.attention_step, cache-free);
    - start a tensor on another device: the mask over all S cache positions is built on the
      device (no .item()), math in fp32; rows at or past start + R are zeroed first, so
      whatever an unwritten cache holds (NaN poison) cannot leak through a zero softmax
      weight."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    if R == 0:
        return q.new_empty(0, H * hd, dtype=k_cache.dtype)
    if isinstance(start, torch.Tensor) and start.device.type == "cpu":
        start = int(start.reshape(-1)[0])
    if not isinstance(start, torch.Tensor):
        end = start + R
        mask = None
        if R > 1:
            mask = (torch.arange(end, device=q.device)[None, :]
                    <= torch.arange(start, end, device=q.device)[:, None])
        out = F.scaled_dot_product_attention(q[None].to(k_cache.dtype), k_cache[None, :, :end],
                                             v_cache[None, :, :end], attn_mask=mask,
                                             enable_gqa=H != kvh, scale=scale)
        return out[0].transpose(0, 1).reshape(R, H * hd)
    g = H // kvh
    qpos = positions(start, R, q.device)                      # [R]
    kpos = torch.arange(S, device=q.device)                    # [S]
    allowed = kpos[None, :] <= qpos[:, None]                   # [R, S]
    written = (kpos <= qpos[-1])[:, None]                      # [S, 1]
    k = torch.where(written, k_cache.float(), 0.0)             # [KVH, S, hd]
    v = torch.where(written, v_cache.float(), 0.0)
    qf = q.float().view(kvh, g, R, hd)
    scores = torch.matmul(qf, k[:, None].transpose(-1, -2))   # [KVH, g, R, S]
    scores = scores * (hd ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v[:, None])  # [KVH, g, R, hd]
    return out.reshape(H, R, hd).transpose(0, 1).reshape(R, H * hd).to(k_cache.dtype)


def attention_supports(q, k_cache, v_cache, start, scale):
    hd = q.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim (tl.arange), got {hd}"
    return check_kernel_float("k_cache", k_cache) or attention_layout(q, k_cache, v_cache)


def attention_layout(q, k_cache, v_cache, *, pieces16: bool = False):
    """None when both kernels' layout needs hold (pieces16: rows read in 16-byte pieces, as the
    CUDA kernel does), else why not."""
    if q.dtype != k_cache.dtype:
        return f"the kernel needs q in the caches' dtype (q is {q.dtype}, caches {k_cache.dtype})"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        why = last_dim_contiguous(name, t)
        if why:
            return why
        if pieces16 and (t.data_ptr() % 16 or t.stride(0) % 8 or t.stride(1) % 8):
            return (f"the CUDA kernel reads {name} in 16-byte pieces: it must start on a 16-byte "
                    f"boundary with rows a multiple of 8 elements apart")
    if k_cache.stride() != v_cache.stride():
        return (f"the kernel needs k_cache and v_cache with the same strides (got "
                f"{k_cache.stride()} and {v_cache.stride()})")
    return None


def key_splits(S: int, unit: int, splits: int) -> tuple[int, int]:
    """(splits, keys per split): S keys cut into at most `splits` ranges of whole `unit`s."""
    units = -(-S // unit)
    chunk = -(-units // max(1, min(int(splits), units))) * unit
    return -(-S // chunk), chunk


def attention_output(q, k_cache):
    """The attention's output [R, H * head_dim] in the caches' dtype (poisoned under test)."""
    H, R, hd = q.shape
    return _alloc.empty(R, H * hd, dtype=k_cache.dtype, device=q.device)


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("cache_attention", "triton", "spd_kernels.attention.triton_kernel")
