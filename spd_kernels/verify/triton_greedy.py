"""verify_greedy on Triton: fused RMSNorm + LM-head GEMV + argmax, the vocabulary split over
programs, partial maxima reduced by a second launch."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, tl, triton
from spd_kernels.checks import check_kernel_float, last_dim_contiguous

if HAS_TRITON:

    from spd_kernels._triton import round_to

# ------------------------------------------------------------------------------------------------
# Triton
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _greedy_partial_kernel(h_ptr, g_ptr, w_ptr, pval_ptr, pidx_ptr,
                               R, D, V, NB, stride_h, stride_w, eps, norm_offset,
                               CENTRED: tl.constexpr, R_H: tl.constexpr, R_G: tl.constexpr, R_L: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        """Program (v, r): rows r*BLOCK_R.. against vocabulary rows v*BLOCK_V..; writes the block's
        max logit and its lowest id per row to pval/pidx[row, v]."""
        pid_v = tl.program_id(0)
        pid_r = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
        # RMS of each row (the hidden rows are tiny and stay in cache across programs).
        ss = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(h_rows + cols[None, :], mask=rmask[:, None] & (cols < D)[None, :],
                        other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / D + eps)
        vrows = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = vrows < V
        w_rows = w_ptr + vrows.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            x = tl.load(h_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            g = tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if CENTRED:  # zero-centred: (h * (offset + norm_weight)).to(hidden.dtype)
                hn = round_to(x * rstd[:, None] * (norm_offset + g[None, :]), R_H)
            else:
                hn = round_to(x * rstd[:, None], R_H)      # h.to(hidden.dtype)
                hn = round_to(g[None, :] * hn, R_G)         # norm_weight * h
            w = tl.load(w_rows + cols[None, :], mask=vmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(hn[:, None, :] * w[None, :, :], axis=2)
        logits = round_to(acc, R_L)                          # logits in the model dtype
        # torch.argmax's order: NaN above every number, ties to the lowest id (a block with a
        # NaN reports NaN and its first NaN id)
        isnan = (logits != logits) & vmask[None, :]
        has_nan = tl.max(isnan.to(tl.int32), axis=1) > 0
        clean = tl.where(vmask[None, :] & ~isnan, logits, float("-inf"))
        best = tl.max(clean, axis=1)
        idx = tl.min(tl.where(vmask[None, :] & (clean == best[:, None]), vrows[None, :],
                              2147483647), axis=1)
        nan_idx = tl.min(tl.where(isnan, vrows[None, :], 2147483647), axis=1)
        idx = tl.where(has_nan, nan_idx, idx)
        best = tl.where(has_nan, float("nan"), best)
        out = rows.to(tl.int64) * NB + pid_v
        tl.store(pval_ptr + out, best, mask=rmask)
        tl.store(pidx_ptr + out, idx, mask=rmask)

    @triton.jit
    def _greedy_reduce_kernel(pval_ptr, pidx_ptr, draft_ptr, target_ptr, accepted_ptr, NB,
                              BLOCK_NB: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        best = tl.full([], float("-inf"), tl.float32)
        bidx = tl.full([], 2147483647, tl.int32)
        found_nan = tl.full([], 0, tl.int32)
        for b0 in range(0, NB, BLOCK_NB):  # blocks in vocabulary order
            offs = b0 + tl.arange(0, BLOCK_NB)
            m = offs < NB
            vals = tl.load(pval_ptr + r * NB + offs, mask=m, other=float("-inf"))
            idxs = tl.load(pidx_ptr + r * NB + offs, mask=m, other=2147483647)
            isnan = (vals != vals) & m
            chunk_nan = tl.max(isnan.to(tl.int32), axis=0)
            clean = tl.where(isnan, float("-inf"), vals)
            cm = tl.max(clean, axis=0)
            ci = tl.min(tl.where(m & (clean == cm), idxs, 2147483647), axis=0)
            ni = tl.min(tl.where(isnan, idxs, 2147483647), axis=0)
            take_nan = (chunk_nan > 0) & ((found_nan == 0) | (ni < bidx))
            take = (found_nan == 0) & (chunk_nan == 0) & ((cm > best) |
                                                          ((cm == best) & (ci < bidx)))
            bidx = tl.where(take_nan, ni, tl.where(take, ci, bidx))
            best = tl.maximum(best, cm)
            found_nan = tl.maximum(found_nan, chunk_nan)
        target = bidx.to(tl.int64)
        tl.store(target_ptr + r, target)
        draft = tl.load(draft_ptr + r).to(tl.int64)
        tl.store(accepted_ptr + r, (draft == target).to(tl.int8))


def _greedy_blocks(R, D, V):
    block_r = min(next_pow2(R), 4)
    if INTERPRET:  # big tiles: fewer interpreted iterations
        return block_r, min(next_pow2(V), 64), min(next_pow2(D), 256), 1
    budget = 8192 // block_r  # fp32 elements of the [BLOCK_V, BLOCK_D] tile per row
    block_d = min(next_pow2(D), 256)
    block_v = max(16, min(64, budget // block_d))
    return block_r, block_v, block_d, 4


def _triton_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens,
                            norm_offset=0.0):
    for name, t in (("hidden", hidden), ("norm_weight", norm_weight),
                    ("lm_head_weight", lm_head_weight)):
        why = check_kernel_float(name, t) or last_dim_contiguous(name, t)
        if why:
            return why
    return None


@dispatch.register("verify_greedy", "triton", supports=_triton_greedy_supports)
def verify_greedy_triton(hidden, norm_weight, eps, lm_head_weight, draft_tokens,
                         norm_offset=0.0):
    R, D = hidden.shape
    V = lm_head_weight.shape[0]
    target = _alloc.empty(R, dtype=torch.int64, device=hidden.device)
    accepted = _alloc.empty(R, dtype=torch.bool, device=hidden.device)
    if R == 0:
        return target, accepted
    draft_tokens = draft_tokens.contiguous()  # the kernels index it by row
    block_r, block_v, block_d, warps = _greedy_blocks(R, D, V)
    nb = triton.cdiv(V, block_v)
    pval = _alloc.empty(R, nb, dtype=torch.float32, device=hidden.device)
    pidx = _alloc.empty(R, nb, dtype=torch.int32, device=hidden.device)
    _greedy_partial_kernel[(nb, triton.cdiv(R, block_r))](
        hidden, norm_weight, lm_head_weight, pval, pidx, R, D, V, nb,
        hidden.stride(0), lm_head_weight.stride(0), eps, float(norm_offset),
        CENTRED=norm_offset != 0.0, R_H=dtype_code(hidden.dtype),
        R_G=dtype_code(torch.result_type(norm_weight, hidden)),
        R_L=dtype_code(lm_head_weight.dtype),
        BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=block_d, num_warps=warps)
    _greedy_reduce_kernel[(R,)](pval, pidx, draft_tokens, target, accepted.view(torch.int8), nb,
                                BLOCK_NB=min(next_pow2(nb), 1024))
    return target, accepted
