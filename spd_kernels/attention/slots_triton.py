"""slot_attention on Triton (see spd_kernels.attention.slots). On request: checked in the
interpreter, not yet compiled or timed on a GPU."""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, tl, triton
from spd_kernels.attention import attention_layout, attention_output
from spd_kernels.checks import check_kernel_float

if HAS_TRITON:
    from spd_kernels._triton import round_to
    from spd_kernels.attention.tree_triton import _key_prefix


if HAS_TRITON:

    @triton.jit
    def _slot_attention_kernel(q_ptr, stride_qh, stride_qr, k_ptr, v_ptr, stride_cb, stride_ch,
                               stride_cs, slots_ptr, lengths_ptr, out_ptr, stride_or, B, S, G,
                               scale_log2, HD: tl.constexpr, HD_PAD: tl.constexpr,
                               BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, OUT: tl.constexpr,
                               IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """Program (r, j): row r's G query heads sharing kv head j, against keys
        [0, lengths[r]) of slot slots[r] (both read on the device, clamped into the cache), so
        each key is read once for the G heads. A row of length 0 ends with l = 0: zeros."""
        r = tl.program_id(0)
        j = tl.program_id(1)
        slot = tl.minimum(tl.maximum(tl.load(slots_ptr + r), 0), B - 1).to(tl.int64)
        n_keys = tl.minimum(tl.maximum(tl.load(lengths_ptr + r).to(tl.int32), 0), S)
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        heads = (j * G + g).to(tl.int64)
        d = tl.arange(0, HD_PAD)
        dmask = d < HD
        q = tl.load(q_ptr + heads[:, None] * stride_qh + r.to(tl.int64) * stride_qr
                    + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, HD_PAD], dtype=tl.float32)
        base = slot * stride_cb + j.to(tl.int64) * stride_ch
        m_i, l_i, acc = _key_prefix(q, k_ptr + base, v_ptr + base, n_keys, stride_cs, d, dmask,
                                    gmask, m_i, l_i, acc, scale_log2, BLOCK_N, IEEE, UPCAST)
        out = round_to(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], OUT)
        tl.store(out_ptr + r.to(tl.int64) * stride_or + heads[:, None] * HD + d[None, :], out,
                 mask=gmask[:, None] & dmask[None, :])


def slot_supports(q, k_cache, v_cache, slots, lengths, scale):
    hd = q.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim (tl.arange), got {hd}"
    return (check_kernel_float("k_cache", k_cache)
            or attention_layout(q, k_cache[0], v_cache[0])
            or (None if k_cache.stride() == v_cache.stride() else
                f"the kernel needs k_cache and v_cache with the same strides (got "
                f"{k_cache.stride()} and {v_cache.stride()})"))


@dispatch.register("slot_attention", "triton", supports=slot_supports, automatic=False)
def slot_attention_triton(q, k_cache, v_cache, slots, lengths, scale):
    H, R, hd = q.shape
    B, kvh, S, _ = k_cache.shape
    out = attention_output(q, k_cache)
    if R == 0:
        return out
    group = H // kvh
    block_n = min(128, max(16, next_pow2(S))) if INTERPRET else (64 if hd <= 128 else 32)
    scale = hd ** -0.5 if scale is None else scale
    _slot_attention_kernel[(R, kvh)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), slots, lengths, out, out.stride(0), B, S, group,
        scale * 1.4426950408889634, HD=hd, HD_PAD=max(16, hd), BLOCK_G=max(16, next_pow2(group)),
        BLOCK_N=block_n, OUT=dtype_code(k_cache.dtype), IEEE=k_cache.dtype == torch.float32,
        UPCAST=INTERPRET, num_warps=1 if INTERPRET else 4)
    return out
