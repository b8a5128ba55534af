"""tree_attention on Triton (see spd_kernels.attention.tree). On request: checked in the
interpreter, not yet compiled or timed on a GPU."""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, tl, triton
from spd_kernels.attention import attention_layout, attention_output
from spd_kernels.checks import check_kernel_float

if HAS_TRITON:
    from spd_kernels._triton import round_to


def _tree_blocks(hd: int, S: int, M: int) -> tuple[int, int]:
    """(prefix keys per block, tree slots per block); tl.dot needs at least 16 of each."""
    if INTERPRET:  # few, large numpy steps
        block_n = min(128, max(16, next_pow2(S)))
    else:
        block_n = 64 if hd <= 128 else 32
    return block_n, min(64, max(16, next_pow2(M)))


if HAS_TRITON:

    @triton.jit
    def _tree_softmax_step(q, k, v, seen, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr,
                           UPCAST: tl.constexpr):
        """One block of keys k, v [BLOCK, HD_PAD] into the running (m_i, l_i, acc) of the pairs
        q [BLOCK_M, HD_PAD]; seen [BLOCK_M, BLOCK]: which pair sees which key. Base 2."""
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        elif UPCAST:  # the interpreter's dot mishandles bf16; tf32 holds bf16/fp16 exactly
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="tf32")
        else:
            s = tl.dot(q, tl.trans(k))  # bf16/fp16 products are exact in fp32
        s = tl.where(seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="tf32")
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _key_prefix(q, k_head, v_head, n_keys, stride_cs, d, dmask, pairs, m_i, l_i, acc,
                    scale_log2, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr):
        """Keys 0..n_keys-1 of one kv head (k_head, v_head: its rows, stride_cs apart) in
        blocks of BLOCK_N, seen by every pair where `pairs`, into the running (m_i, l_i, acc)."""
        for n0 in range(0, n_keys, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < n_keys
            offs = n[:, None].to(tl.int64) * stride_cs + d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_head + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_head + offs, mask=kv_mask, other=0.0)
            seen = pairs[:, None] & nmask[None, :]
            m_i, l_i, acc = _tree_softmax_step(q, k, v, seen, m_i, l_i, acc, scale_log2,
                                               IEEE, UPCAST)
        return m_i, l_i, acc

    @triton.jit
    def _tree_attention_kernel(q_ptr, stride_qh, stride_qr, k_ptr, v_ptr, stride_ch, stride_cs,
                               prefix_ptr, slots_ptr, stride_t, mask_ptr, stride_mr, stride_mc,
                               out_ptr, stride_or, R, S, G, M, scale_log2,
                               HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                               OUT: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
        """Program (j, mb): kv head j and BLOCK_M (row, query head) pairs m = row * G + g of
        the G query heads sharing it, so each key is read once for all of them. Keys: the
        prefix 0..prefix_len-1 (read on the device, clamped to [0, S]) in blocks, seen by every
        pair; then the tree slots in blocks of BLOCK_T gathered cache rows, pair (r, g) seeing
        slot m where tree_mask[r, m]. A tree slot no pair of the block sees is not loaded (it
        may hold NaN, and 0 * NaN is NaN); slots outside the cache are never seen. A pair with
        no key ends with l = 0 and writes zeros."""
        j = tl.program_id(0)
        mb = tl.program_id(1)
        prefix = tl.minimum(tl.maximum(tl.load(prefix_ptr).to(tl.int32), 0), S)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < R * G
        r = m // G
        heads = (j * G + m % G).to(tl.int64)
        d = tl.arange(0, HD_PAD)  # head_dim padded to the dot's minimum of 16
        dmask = d < HD
        q = tl.load(q_ptr + heads[:, None] * stride_qh + r[:, None].to(tl.int64) * stride_qr
                    + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HD_PAD], dtype=tl.float32)
        k_head = k_ptr + j.to(tl.int64) * stride_ch
        v_head = v_ptr + j.to(tl.int64) * stride_ch
        m_i, l_i, acc = _key_prefix(q, k_head, v_head, prefix, stride_cs, d, dmask, mmask,
                                    m_i, l_i, acc, scale_log2, BLOCK_N, IEEE, UPCAST)
        for t0 in range(0, M, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tmask = t < M
            slot = tl.load(slots_ptr + t.to(tl.int64) * stride_t, mask=tmask, other=0)
            tvalid = tmask & (slot >= 0) & (slot < S)
            seen = tl.load(mask_ptr + r[:, None].to(tl.int64) * stride_mr
                           + t[None, :].to(tl.int64) * stride_mc,
                           mask=mmask[:, None] & tvalid[None, :], other=0) != 0
            used = tl.max(seen.to(tl.int32), axis=0) > 0  # [BLOCK_T]: some pair here sees it
            offs = slot[:, None].to(tl.int64) * stride_cs + d[None, :]
            kv_mask = used[:, None] & dmask[None, :]
            k = tl.load(k_head + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_head + offs, mask=kv_mask, other=0.0)
            m_i, l_i, acc = _tree_softmax_step(q, k, v, seen, m_i, l_i, acc, scale_log2,
                                               IEEE, UPCAST)
        out = round_to(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], OUT)
        tl.store(out_ptr + r[:, None].to(tl.int64) * stride_or + heads[:, None] * HD
                 + d[None, :], out, mask=mmask[:, None] & dmask[None, :])


def tree_supports(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale):
    hd = q.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim (tl.arange), got {hd}"
    return check_kernel_float("k_cache", k_cache) or attention_layout(q, k_cache, v_cache)


def tree_attention_launch(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale):
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    M = tree_slots.shape[0]
    out = attention_output(q, k_cache)
    if R == 0:
        return out
    if isinstance(prefix_len, torch.Tensor):
        prefix = prefix_len.reshape(1)
    else:
        prefix = torch.tensor([int(prefix_len)], dtype=torch.int64, device=q.device)
    if M == 0:  # the loop over tree slots never runs, but the pointers must be real
        tree_slots = torch.zeros(1, dtype=torch.int64, device=q.device)
        tree_mask = torch.zeros(R, 1, dtype=torch.bool, device=q.device)
    mask_u8 = tree_mask.view(torch.uint8)  # bool as bytes: one load width on every backend
    group = H // kvh
    block_n, block_t = _tree_blocks(hd, S, M)
    block_m = min(64, max(16, next_pow2(R * group)))
    scale = hd ** -0.5 if scale is None else scale
    _tree_attention_kernel[(kvh, triton.cdiv(R * group, block_m))](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        prefix, tree_slots, tree_slots.stride(0), mask_u8, mask_u8.stride(0), mask_u8.stride(1),
        out, out.stride(0), R, S, group, M, scale * 1.4426950408889634,
        HD=hd, HD_PAD=max(16, hd), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t,
        OUT=dtype_code(k_cache.dtype), IEEE=k_cache.dtype == torch.float32, UPCAST=INTERPRET,
        num_warps=1 if INTERPRET else 4)
    return out


@dispatch.register("tree_attention", "triton", supports=tree_supports, automatic=False)
def tree_attention_triton(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale):
    return tree_attention_launch(q, k_cache, v_cache, prefix_len, tree_slots, tree_mask, scale)
