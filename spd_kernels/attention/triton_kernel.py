"""cache_attention on Triton (see spd_kernels.attention)."""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, pdl, tl, triton
from spd_kernels.attention import attention_output, attention_supports, key_splits
from spd_kernels.cache_positions import start_tensor

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to


def _attention_blocks(hd: int, S: int) -> int:
    """Keys per block of the loop (BLOCK_N)."""
    if INTERPRET:  # few, large numpy steps
        return min(128, max(16, next_pow2(S)))
    return 64 if hd <= 128 else 32


def _attention_block_m(rows_x_group: int) -> int:
    """(row, query head) pairs per program: tl.dot needs at least 16; 64 bounds the registers."""
    return min(64, max(16, next_pow2(rows_x_group)))


if HAS_TRITON:

    @triton.jit
    def _attention_rows_end(start, mb, R, G, S, BLOCK_M: tl.constexpr):
        """One past the last key any pair of m-block mb may see: start + its last row + 1."""
        last_row = (tl.minimum((mb + 1) * BLOCK_M, R * G) - 1) // G
        return tl.minimum(start + last_row + 1, S)

    @triton.jit
    def _cache_attention_kernel(q_ptr, stride_qh, stride_qr, k_ptr, v_ptr, stride_ch, stride_cs,
                                start_ptr, out_ptr, stride_or, ws_ptr, R, S, G, SPLITS, CHUNK,
                                scale_log2, HD: tl.constexpr, HD_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, OUT: tl.constexpr,
                                PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                                UPCAST: tl.constexpr, PDL: tl.constexpr):
        """Program (j, s, mb): kv head j, keys s*CHUNK.., and BLOCK_M (row, query head) pairs
        m = row * G + g of the G query heads sharing j, so every key block is read once for all
        rows and heads and both products run on the tensor cores (tl.dot; fp32 caches in IEEE
        fp32). Row r sees keys 0..start + r (start read on the device). Online softmax in base 2,
        fp32 statistics and accumulator; p meets v in tf32 (bf16/fp16 caches: v exact, p to 10
        bits). One split: one rounding to the output dtype (code OUT). PARTIAL: the split's
        unnormalised output, running max and sum go to the workspace slot
        ((j * SPLITS + s) * M_TOTAL + m) * (HD + 2) for _attention_combine_kernel; splits past
        the block's last position write nothing (the combine never reads them)."""
        pdl_enter(PDL)
        j = tl.program_id(0)
        sp = tl.program_id(1)
        mb = tl.program_id(2)
        start = tl.load(start_ptr).to(tl.int32)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < R * G
        r = m // G
        heads = (j * G + m % G).to(tl.int64)
        pos = start + r
        end = _attention_rows_end(start, mb, R, G, S, BLOCK_M)
        lo = sp * CHUNK
        hi = tl.minimum(end, lo + CHUNK)
        d = tl.arange(0, HD_PAD)  # head_dim padded to the dot's minimum of 16
        dmask = d < HD
        q = tl.load(q_ptr + heads[:, None] * stride_qh + r[:, None].to(tl.int64) * stride_qr
                    + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HD_PAD], dtype=tl.float32)
        kv_head = k_ptr + j.to(tl.int64) * stride_ch
        vv_head = v_ptr + j.to(tl.int64) * stride_ch
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            offs = n[:, None].to(tl.int64) * stride_cs + d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(kv_head + offs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            elif UPCAST:  # the interpreter's dot mishandles bf16; tf32 holds bf16/fp16 exactly
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="tf32")
            else:
                s = tl.dot(q, tl.trans(k))  # bf16/fp16 products are exact in fp32
            s = s * scale_log2
            seen = (n[None, :] <= pos[:, None]) & nmask[None, :] & mmask[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vv_head + offs, mask=kv_mask, other=0.0).to(tl.float32)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v, input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if PARTIAL:
            keep = mmask & (lo < end)
            slot = ws_ptr + ((j * SPLITS + sp).to(tl.int64) * (R * G) + m) * (HD + 2)
            tl.store(slot[:, None] + d[None, :], acc, mask=keep[:, None] & dmask[None, :])
            tl.store(slot + HD, m_i, mask=keep)
            tl.store(slot + HD + 1, l_i, mask=keep)
        else:
            out = round_to(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], OUT)
            tl.store(out_ptr + r[:, None].to(tl.int64) * stride_or + heads[:, None] * HD
                     + d[None, :], out, mask=mmask[:, None] & dmask[None, :])

    @triton.jit
    def _attention_combine_kernel(ws_ptr, start_ptr, out_ptr, stride_or, R, S, G, SPLITS, CHUNK,
                                  HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                                  OUT: tl.constexpr, PDL: tl.constexpr):
        """Program (m, j): merges, for (row, query head) pair m of kv head j, the splits that hold
        its keys (those below its position + 1, found from start on the device), BLOCK_S splits
        a load, in a fixed order (deterministic): rescale each by 2^(m_s - M), sum, divide by the
        summed l, round once. A program per pair, not per block of pairs: the merge is a few
        wide loads, not a serial walk over the splits."""
        pdl_enter(PDL)
        m = tl.program_id(0)  # pairs on the first grid axis: it takes more than 65535
        j = tl.program_id(1)
        start = tl.load(start_ptr).to(tl.int32)
        r = m // G
        used = tl.cdiv(tl.minimum(start + r + 1, S), CHUNK)
        d = tl.arange(0, HD_PAD)
        dmask = d < HD
        sp = tl.arange(0, BLOCK_S)
        base = ws_ptr + (j.to(tl.int64) * SPLITS * (R * G) + m) * (HD + 2)
        step = (R * G) * (HD + 2)  # from one split's slot to the next's
        m_all = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        for s0 in range(0, used, BLOCK_S):
            slots = base + (s0 + sp).to(tl.int64) * step
            m_all = tl.maximum(m_all, tl.load(slots + HD, mask=s0 + sp < used,
                                              other=float("-inf")))
        m_top = tl.max(m_all, axis=0)
        l_all = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc = tl.zeros([BLOCK_S, HD_PAD], dtype=tl.float32)
        for s0 in range(0, used, BLOCK_S):
            smask = s0 + sp < used
            slots = base + (s0 + sp).to(tl.int64) * step
            m_s = tl.load(slots + HD, mask=smask, other=float("-inf"))
            w = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_top), 0.0)  # no key there: 0
            l_all += tl.load(slots + HD + 1, mask=smask, other=0.0) * w
            acc += tl.load(slots[:, None] + d[None, :], mask=smask[:, None] & dmask[None, :],
                           other=0.0) * w[:, None]
        l_sum = tl.sum(l_all, axis=0)
        out = round_to(tl.sum(acc, axis=0) / tl.where(l_sum > 0, l_sum, 1.0), OUT)
        head = (j * G + m % G).to(tl.int64)
        tl.store(out_ptr + r.to(tl.int64) * stride_or + head * HD + d, out, mask=dmask)


def attention_splits(rows: int, kv_heads: int, S: int, block_n: int, device,
                     splits: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) over the cache capacity S. The split is fixed by S, not by the
    position (which may live on the device), so one CUDA graph serves every position; splits
    past the rows' positions exit at once and the combine never reads them. Default: one split
    on CPU, else up to 64 splits of at least one key block (short key loops per program; the
    programs holding keys, kv_heads x used splits, spread over the SMs)."""
    if splits is None:
        splits = 1 if device.type != "cuda" else 64
    return key_splits(S, block_n, splits)


def attention_launch(q, k_cache, v_cache, start, scale, *, splits: int | None = None):
    """The Triton cache attention (see cache_attention); `splits` forces the key split."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    out = attention_output(q, k_cache)
    if R == 0:
        return out
    start = start_tensor(start, q.device)
    group = H // kvh
    block_n = _attention_blocks(hd, S)
    block_m = _attention_block_m(R * group)
    n_mb = triton.cdiv(R * group, block_m)
    n_splits, chunk = attention_splits(R, kvh, S, block_n, q.device, splits)
    partial = n_splits > 1
    ws = (torch.empty(kvh * n_splits * R * group * (hd + 2), dtype=torch.float32,
                      device=q.device) if partial else out)
    scale = hd ** -0.5 if scale is None else scale
    warps = 1 if INTERPRET else 4
    out_code = dtype_code(k_cache.dtype)
    programmatic = pdl(q.device)
    _cache_attention_kernel[(kvh, n_splits, n_mb)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        start, out, out.stride(0), ws, R, S, group, n_splits, chunk, scale * 1.4426950408889634,
        HD=hd, HD_PAD=max(16, hd), BLOCK_M=block_m, BLOCK_N=block_n, OUT=out_code,
        PARTIAL=partial,
        IEEE=k_cache.dtype == torch.float32, UPCAST=INTERPRET, num_warps=warps,
        PDL=programmatic, launch_pdl=programmatic)
    if partial:
        _attention_combine_kernel[(R * group, kvh)](
            ws, start, out, out.stride(0), R, S, group, n_splits, chunk, HD=hd,
            HD_PAD=max(16, hd), BLOCK_S=min(16, next_pow2(n_splits)), OUT=out_code,
            num_warps=1 if INTERPRET else 2, PDL=programmatic, launch_pdl=programmatic)
    return out


@dispatch.register("cache_attention", "triton", supports=attention_supports, programmatic=True)
def cache_attention_triton(q, k_cache, v_cache, start, scale):
    return attention_launch(q, k_cache, v_cache, start, scale)
