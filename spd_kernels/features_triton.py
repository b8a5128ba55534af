"""anchor_projection on Triton (see spd_kernels.features)."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, pdl, tl, triton
from spd_kernels.features import _d_out, _kernel_supports, _tables
from spd_kernels.quant import QUANT_DTYPES

# W_CODE of quantised weights (past the float codes of spd_kernels._host)
QUANT_CODES = {torch.int8: 3, torch.float8_e4m3fn: 4}

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to


if HAS_TRITON:

    @triton.jit
    def _anchor_dot(acc, a, w, FP32_DOT: tl.constexpr):
        """acc [R, N] += a [R, K] @ w [N, K]^T in fp32. FP32_DOT: fp32 or mixed operands, or the
        interpreter (its bf16 dot is wrong); ieee so that fp32 is not rounded to tf32."""
        if FP32_DOT:
            return acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)),
                                input_precision="ieee")
        else:
            return acc + tl.dot(a.to(w.dtype), tl.trans(w))

    @triton.jit
    def _anchor_kernel(a_ptr, stride_am, stride_ar, types_ptr, table_ptr, out_ptr, stride_or,
                       M, R, D, N, W_CODE: tl.constexpr, OUT_CODE: tl.constexpr,
                       QUANT: tl.constexpr,
                       FP32_DOT: tl.constexpr, W_ALIGNED: tl.constexpr, EVEN_K: tl.constexpr,
                       R_SCAN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (n-block, class): class M-1-pid1 is a type (heaviest first, as programs start in
        grid order), class -1 the rows with no usable projection (NaN). The rows of the class are
        gathered BLOCK_R at a time, so each W_e tile is loaded once per BLOCK_R of them (once in
        all when R <= R_SCAN and at most BLOCK_R rows share the type) and multiplied with all of
        them by tl.dot (fp32 accumulation). QUANT (W_CODE 3: int8, 4: fp8 e4m3): the table's third
        row holds each type's fp32 row scales, applied to the fp32 sum before the bias."""
        pdl_enter(PDL)
        pid_n = tl.program_id(0)
        cls = M - 1 - tl.program_id(1)
        ec = tl.maximum(cls, 0)
        w_addr = tl.load(table_ptr + ec)
        b_addr = tl.load(table_ptr + M + ec)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        if (cls < 0) | (w_addr != 0):  # a type without weight has no rows: they are class -1
            if W_CODE == 1:
                w_base = w_addr.to(tl.pointer_type(tl.bfloat16))
                b_base = b_addr.to(tl.pointer_type(tl.bfloat16))
            elif W_CODE == 2:
                w_base = w_addr.to(tl.pointer_type(tl.float16))
                b_base = b_addr.to(tl.pointer_type(tl.float16))
            elif W_CODE == 3:  # quantised weights: the biases are in the output dtype
                w_base = w_addr.to(tl.pointer_type(tl.int8))
            elif W_CODE == 4:
                w_base = w_addr.to(tl.pointer_type(tl.float8e4nv))
            else:
                w_base = w_addr.to(tl.pointer_type(tl.float32))
                b_base = b_addr.to(tl.pointer_type(tl.float32))
            if W_ALIGNED:  # a pointer made from an int has no known alignment: without this hint
                w_base = tl.multiple_of(w_base, 16)  # W is not vectorized nor pipelined
            if QUANT:
                if OUT_CODE == 1:
                    b_base = b_addr.to(tl.pointer_type(tl.bfloat16))
                elif OUT_CODE == 2:
                    b_base = b_addr.to(tl.pointer_type(tl.float16))
                else:
                    b_base = b_addr.to(tl.pointer_type(tl.float32))
            k_row = (ec + 1).to(tl.int64) * D  # row length of W_e
            w_rows = w_base + n.to(tl.int64)[:, None] * k_row
            for s0 in range(0, R, R_SCAN):
                # The rows of this class among rows s0 .. s0+R_SCAN-1, compacted: rank = position.
                rs = s0 + tl.arange(0, R_SCAN)
                smask = rs < R
                t = tl.load(types_ptr + rs, mask=smask, other=-1).to(tl.int32)
                tw = tl.load(table_ptr + tl.minimum(tl.maximum(t, 0), M - 1), mask=smask, other=0)
                match = smask & (tl.where((t >= 0) & (t < M) & (tw != 0), t, -1) == cls)
                rank = tl.cumsum(match.to(tl.int32), axis=0) - 1
                count = tl.sum(match.to(tl.int32), axis=0)
                for g in range(0, count, BLOCK_R):
                    slot = g + tl.arange(0, BLOCK_R)
                    pick = match[None, :] & (rank[None, :] == slot[:, None])  # [BLOCK_R, R_SCAN]
                    rr = tl.sum(tl.where(pick, rs[None, :], 0), axis=1).to(tl.int64)
                    rvalid = slot < count
                    o_ptrs = out_ptr + rr[:, None] * stride_or + n[None, :]
                    omask = rvalid[:, None] & nmask[None, :]
                    if cls < 0:  # nothing read through the table
                        tl.store(o_ptrs, tl.full([BLOCK_R, BLOCK_N], float("nan"), tl.float32),
                                 mask=omask)
                    else:
                        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
                        a_rows = a_ptr + rr[:, None] * stride_ar
                        kr = tl.arange(0, BLOCK_K)
                        if EVEN_K:  # no tile straddles two anchors: one loop over the W_e row
                            for kk in range(0, (cls + 1) * D, BLOCK_K):
                                j = kk // D
                                a = tl.load(a_rows + j * stride_am + (kk - j * D) + kr[None, :],
                                            mask=rvalid[:, None], other=0.0)
                                w = tl.load(w_rows + kk + kr[None, :], mask=nmask[:, None],
                                            other=0.0)
                                if QUANT:  # int8 / e4m3 values are exact in the anchors' dtype
                                    # and in fp32 (the interpreter's int8 -> bf16 cast is wrong)
                                    w = w.to(tl.float32) if FP32_DOT else w.to(a_ptr.dtype.element_ty)
                                acc = _anchor_dot(acc, a, w, FP32_DOT)
                        else:
                            for j in range(0, cls + 1):
                                for k0 in range(0, D, BLOCK_K):
                                    k = k0 + kr
                                    kmask = k < D
                                    a = tl.load(a_rows + j * stride_am + k[None, :],
                                                mask=rvalid[:, None] & kmask[None, :], other=0.0)
                                    w = tl.load(w_rows + j * D + k[None, :],
                                                mask=nmask[:, None] & kmask[None, :], other=0.0)
                                    if QUANT:
                                        w = w.to(tl.float32) if FP32_DOT else \
                                            w.to(a_ptr.dtype.element_ty)
                                    acc = _anchor_dot(acc, a, w, FP32_DOT)
                        if QUANT:  # once per output, before the bias
                            s_base = tl.load(table_ptr + 2 * M + ec).to(tl.pointer_type(tl.float32))
                            acc *= tl.load(s_base + n, mask=nmask, other=0.0)[None, :]
                        if b_addr != 0:
                            acc += tl.load(b_base + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
                        tl.store(o_ptrs, round_to(acc, OUT_CODE), mask=omask)


@dispatch.register("anchor_projection", "triton", supports=_kernel_supports, programmatic=True)
def anchor_projection_triton(anchors, types, weights, biases=None, scales=None):
    m, rows, d = anchors.shape
    n_out = _d_out(anchors, weights)
    out = _alloc.empty(rows, n_out, dtype=anchors.dtype, device=anchors.device)
    if rows == 0:
        return out
    types = types.contiguous()
    w_dtype = next(w for w in weights if w is not None).dtype
    # tl.dot needs every block dimension >= 16; 16 rows of one type share each weight tile.
    block_k = max(16, min(next_pow2(d), 256))
    if INTERPRET:
        block_n, warps, stages = max(16, min(next_pow2(n_out), 64)), 1, 1
    else:  # small n-blocks: 5 * 160 programs for N = 2560, enough to balance the 5 row lengths
        block_n, warps, stages = 16, 4, 3
    quant = w_dtype in QUANT_DTYPES
    w_code = QUANT_CODES[w_dtype] if quant else dtype_code(w_dtype)
    # quantised tiles are converted to the anchors' dtype as loaded (exact), so the dot is not mixed
    fp32_dot = INTERPRET or anchors.dtype == torch.float32 or (
        not quant and (w_dtype == torch.float32 or w_dtype != anchors.dtype))
    w_aligned = all(w.data_ptr() % 16 == 0 for w in weights if w is not None)
    programmatic = pdl(anchors.device)
    _anchor_kernel[(triton.cdiv(n_out, block_n), m + 1)](
        anchors, anchors.stride(0), anchors.stride(1), types,
        _tables(weights, biases, anchors.device, scales if quant else None),
        out, out.stride(0), m, rows, d, n_out, W_CODE=w_code,
        OUT_CODE=dtype_code(anchors.dtype), QUANT=quant, FP32_DOT=fp32_dot, W_ALIGNED=w_aligned,
        EVEN_K=d % block_k == 0, R_SCAN=max(16, min(next_pow2(rows), 256)), BLOCK_R=16,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        PDL=programmatic, launch_pdl=programmatic)
    return out
