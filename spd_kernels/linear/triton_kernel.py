"""fused_linear / fused_swiglu on Triton: plan, kernels, launcher (see spd_kernels.linear)."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import (
    HAS_TRITON,
    INTERPRET,
    dtype_code,
    next_pow2,
    pdl,
    sm_count,
    tl,
    triton,
)
from spd_kernels.linear import linear_supports, swiglu_supports

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to


# GPU tiles are autotuned on the first call per shape (no GPU has tuned them by hand yet); K per
# split is a multiple of the largest BLOCK_K so every config covers a split exactly.
GPU_CONFIGS = ((64, 64, 8), (32, 128, 4), (64, 128, 8), (128, 64, 8), (32, 64, 4))  # BN, BK, warps
# Quantised (1-byte) weights: the same tiles would put half the bytes in flight per program (the
# int8 PDM step ran at 0.88x bf16's time for half the bytes on an H200), so their tiles are
# twice as deep in K: 256 bytes of a weight row per tile row, 16-byte loads per thread, and as
# many bytes a tile as the bf16 configs (or twice). Dequantised in registers (exact) before the dot.
GPU_QUANT_CONFIGS = ((64, 256, 8), (32, 256, 4), (128, 256, 8), (64, 128, 4), (16, 256, 4))
K_GRAIN = 256
GPU_BLOCK_N = 64       # for the split decision and the reduce launch


def plan(rows: int, N: int, K: int, device, split_k: int | None = None):
    """(R_PAD, BLOCK_N, BLOCK_K, splits, K per split) for an [rows, K] x [N, K]^T product;
    BLOCK_N / BLOCK_K are None on a GPU (autotuned)."""
    r_pad = max(16, next_pow2(rows))
    if INTERPRET or device.type != "cuda":  # few, large numpy steps
        block_n, block_k = min(64, max(16, next_pow2(N))), min(128, max(16, next_pow2(K)))
        grain, n_blocks = block_k, triton.cdiv(N, block_n)
    else:
        block_n = block_k = None
        grain, n_blocks = K_GRAIN, triton.cdiv(N, GPU_BLOCK_N)
    k_blocks = triton.cdiv(K, grain)
    if split_k is None:  # about two programs per SM, never a split smaller than one K grain
        split_k = 1 if device.type != "cuda" else triton.cdiv(2 * sm_count(device), n_blocks)
    split_k = max(1, min(int(split_k), k_blocks))
    k_per = triton.cdiv(k_blocks, split_k) * grain
    return r_pad, block_n, block_k, triton.cdiv(K, k_per), k_per


if HAS_TRITON:

    @triton.jit
    def _epilogue(acc, acc2, res_ptr, stride_res, sc_ptr, sc2_ptr, rows, cols, N, mask,
                  SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                  DT: tl.constexpr):
        """Round like the reference: each product to the model dtype (QUANT: the fp32 sum times
        its row scale first, spd_kernels.quant), then SwiGLU (silu in fp32, rounded; times up,
        rounded) or the residual add (rounded)."""
        if QUANT:  # once per output, never per weight
            acc = acc * tl.load(sc_ptr + cols, mask=cols < N, other=0.0)[None, :]
            if SWIGLU:
                acc2 = acc2 * tl.load(sc2_ptr + cols, mask=cols < N, other=0.0)[None, :]
        y = round_to(acc, DT)
        if SWIGLU:
            s = round_to(y / (1.0 + tl.exp(-y)), DT)
            y = round_to(s * round_to(acc2, DT), DT)
        if RESIDUAL:
            r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_res + cols[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            y = round_to(r + y, DT)
        return y

    @triton.jit
    def _linear_kernel(x_ptr, stride_x, g_ptr, w_ptr, w2_ptr, res_ptr, stride_res, out_ptr,
                       stride_out, ws_ptr, SET_STRIDE, sc_ptr, sc2_ptr, R, N, K, K_PER, eps,
                       NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                       PARTIAL: tl.constexpr, QUANT: tl.constexpr, DT: tl.constexpr,
                       FP32_DOT: tl.constexpr,
                       R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
        """Program (j, s): output columns j*BLOCK_N.. over K range s*K_PER.. (PARTIAL: store fp32
        partial sums into ws [splits, 1 or 2, R, N]; else apply the epilogue and store out).
        QUANT: w / w2 are int8 or fp8 (exact in the model dtype and in fp32): each tile is
        converted as loaded and sc / sc2 [N] (fp32 row scales) multiply the sums in the epilogue."""
        pdl_enter(PDL)
        j = tl.program_id(0)
        s = tl.program_id(1)
        rows = tl.arange(0, R_PAD)
        rmask = rows < R
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = cols < N
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_x
        rstd = tl.zeros([R_PAD], dtype=tl.float32)
        if NORM:  # every program needs the full-row statistics: R x K reads, from L2
            ss = tl.zeros([R_PAD], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                xv = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :],
                             other=0.0).to(tl.float32)
                ss += tl.sum(xv * xv, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
        k_lo = s * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        w_rows = cols[:, None].to(tl.int64) * K
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            km = kk < k_hi
            xv = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & km[None, :],
                         other=0.0).to(tl.float32)
            if NORM:
                gv = tl.load(g_ptr + kk, mask=km, other=0.0).to(tl.float32)
                xv = round_to(gv[None, :] * round_to(xv * rstd[:, None], DT), DT)
            wmask = nmask[:, None] & km[None, :]
            w = tl.load(w_ptr + w_rows + kk[None, :], mask=wmask, other=0.0)
            if QUANT:  # int8 / e4m3 values are exact in the model dtype and in fp32 (the
                # interpreter's int8 -> bf16 cast is wrong, so there it goes through fp32)
                w = w.to(tl.float32) if FP32_DOT else w.to(x_ptr.dtype.element_ty)
            # FP32_DOT: fp32 weights, or the interpreter (its bf16 dot is wrong); bf16 x bf16
            # products are exact in fp32, so only the summation order differs from the MMA path
            if FP32_DOT:
                acc += tl.dot(xv, tl.trans(w).to(tl.float32), input_precision="ieee")
            else:  # xv holds model-dtype values already (rounded), so the cast is exact
                acc += tl.dot(xv.to(w.dtype), tl.trans(w))
            if SWIGLU:
                w2 = tl.load(w2_ptr + w_rows + kk[None, :], mask=wmask, other=0.0)
                if QUANT:
                    w2 = w2.to(tl.float32) if FP32_DOT else w2.to(x_ptr.dtype.element_ty)
                if FP32_DOT:
                    acc2 += tl.dot(xv, tl.trans(w2).to(tl.float32), input_precision="ieee")
                else:
                    acc2 += tl.dot(xv.to(w2.dtype), tl.trans(w2))
        omask = rmask[:, None] & nmask[None, :]
        if PARTIAL:  # ws [splits, SET_STRIDE]: the split's gate (or only) sums, then its up sums
            base = ws_ptr + s.to(tl.int64) * SET_STRIDE
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            tl.store(base + offs, acc, mask=omask)
            if SWIGLU:
                tl.store(base + R * N + offs, acc2, mask=omask)
        else:
            y = _epilogue(acc, acc2, res_ptr, stride_res, sc_ptr, sc2_ptr, rows, cols, N, omask,
                          SWIGLU, RESIDUAL, QUANT, DT)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y,
                     mask=omask)

    @triton.jit
    def _reduce_kernel(ws_ptr, SET_STRIDE, res_ptr, stride_res, out_ptr, stride_out, sc_ptr,
                       sc2_ptr, R, N, SPLITS, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                       QUANT: tl.constexpr, DT: tl.constexpr,
                       R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        """Program j: sums the splits' partials for columns j*BLOCK_N.. in split order, then the
        epilogue."""
        pdl_enter(PDL)
        j = tl.program_id(0)
        rows = tl.arange(0, R_PAD)
        cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < R)[:, None] & (cols < N)[None, :]
        offs = rows[:, None].to(tl.int64) * N + cols[None, :]
        acc = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
        for s in range(0, SPLITS):
            base = ws_ptr + s * SET_STRIDE  # the launcher keeps ws under 2**31 elements
            acc += tl.load(base + offs, mask=mask, other=0.0)
            if SWIGLU:
                acc2 += tl.load(base + R * N + offs, mask=mask, other=0.0)
        y = _epilogue(acc, acc2, res_ptr, stride_res, sc_ptr, sc2_ptr, rows, cols, N, mask,
                      SWIGLU, RESIDUAL, QUANT, DT)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y, mask=mask)

    def _quick_bench(fn, quantiles):
        """Short timings: the first draft of a run pays for tuning (about 5 shapes x 5 configs)."""
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    def _configs(table):
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in table]

    _FLOAT_CONFIGS = _configs(GPU_CONFIGS)
    _QUANT_CONFIGS = _configs(GPU_QUANT_CONFIGS)

    def tuning_configs(configs, nargs, **kwargs):
        """The autotuner's candidates for a launch: the quantised-weight tiles when QUANT."""
        quant = {id(c) for c in _QUANT_CONFIGS}
        return [c for c in configs if (id(c) in quant) == bool(kwargs.get("QUANT"))]

    # the outputs are pure functions of the inputs, so the autotuner may rerun the kernel freely
    _linear_tuned = triton.autotune(
        _FLOAT_CONFIGS + _QUANT_CONFIGS,
        key=["N", "K", "R_PAD", "NORM", "SWIGLU", "PARTIAL", "QUANT"], do_bench=_quick_bench,
        prune_configs_by={"early_config_prune": tuning_configs})(_linear_kernel)


def launch(x, weight, w_up=None, norm_weight=None, eps=1e-6, residual=None, *,
           split_k: int | None = None, scale: torch.Tensor | None = None,
           scale_up: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher shared by both ops (w_up given: SwiGLU). split_k None: chosen by `plan`.
    scale / scale_up [N] fp32: weight / w_up are quantised (spd_kernels.quant)."""
    return _launch(x, weight, w_up, norm_weight, eps, residual, split_k=split_k, scale=scale,
                   scale_up=scale_up)[0]


def partial_sums(x, weight, norm_weight=None, eps=1e-6, *, scale: torch.Tensor | None = None,
                 split_k: int | None = None) -> tuple[torch.Tensor, int]:
    """rms_norm(x) @ weight.T (x [R, K], weight [N, K]) without its reduce launch, for a kernel
    that consumes the product and can sum the splits itself (qkv_rope_append's RoPE kernel):
    (y, 1) with y [R, N] the product in x's dtype when one split covers K (scale applied, as
    `launch`); else (ws, splits) with ws [splits, R, N] the splits' fp32 partial sums. Summed in
    split order from 0, times scale, rounded to x's dtype, they give `launch`'s product bit for
    bit (its reduce kernel does exactly that)."""
    out, ws, splits = _launch(x, weight, None, norm_weight, eps, None, split_k=split_k,
                              scale=scale, reduce=False)
    if splits == 1:
        return out, 1
    return ws.view(splits, x.shape[0], weight.shape[0]), splits


def _launch(x, weight, w_up=None, norm_weight=None, eps=1e-6, residual=None, *,
            split_k: int | None = None, scale: torch.Tensor | None = None,
            scale_up: torch.Tensor | None = None, reduce: bool = True):
    """-> (out [R, N], workspace, splits); reduce False: with several splits the reduce launch is
    left to the caller (out is then not written)."""
    R, K = x.shape
    N = weight.shape[0]
    out = _alloc.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out, out, 1
    r_pad, block_n, block_k, splits, k_per = plan(R, N, K, x.device, split_k)
    swiglu = w_up is not None
    set_stride = (2 if swiglu else 1) * R * N
    if splits * set_stride >= 2 ** 31:  # the reduce kernel indexes the workspace in int32
        r_pad, block_n, block_k, splits, k_per = plan(R, N, K, x.device, 1)
    partial = splits > 1
    ws = torch.empty(splits * set_stride, dtype=torch.float32, device=x.device) if partial else out
    res = residual if residual is not None else out
    quant = scale is not None
    sc = scale if quant else out  # a placeholder pointer when not read
    sc2 = scale_up if quant and swiglu else sc
    flags = dict(SWIGLU=swiglu, RESIDUAL=residual is not None, QUANT=quant,
                 DT=dtype_code(x.dtype), R_PAD=r_pad)
    args = (x, x.stride(0), norm_weight if norm_weight is not None else x, weight,
            w_up if swiglu else weight, res, res.stride(0), out, out.stride(0), ws, set_stride, sc,
            sc2, R, N, K, k_per, eps)
    programmatic = pdl(x.device)
    kw = dict(NORM=norm_weight is not None, PARTIAL=partial,
              FP32_DOT=x.dtype == torch.float32 or INTERPRET, PDL=programmatic,
              launch_pdl=programmatic, **flags)
    if block_n is None:
        _linear_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), splits)](*args, **kw)
        block_n = GPU_BLOCK_N
    else:
        _linear_kernel[(triton.cdiv(N, block_n), splits)](*args, BLOCK_N=block_n,
                                                          BLOCK_K=block_k, num_warps=1, **kw)
    if partial and reduce:
        _reduce_kernel[(triton.cdiv(N, block_n),)](ws, set_stride, res, res.stride(0), out,
                                                   out.stride(0), sc, sc2, R, N, splits,
                                                   BLOCK_N=block_n,
                                                   num_warps=1 if INTERPRET else 4,
                                                   PDL=programmatic, launch_pdl=programmatic,
                                                   **flags)
    return out, ws, splits


@dispatch.register("fused_linear", "triton", supports=linear_supports, programmatic=True)
def fused_linear_triton(x, weight, norm_weight, eps, residual, weight_scale=None):
    return launch(x, weight, None, norm_weight, eps, residual, scale=weight_scale)


@dispatch.register("fused_swiglu", "triton", supports=swiglu_supports, programmatic=True)
def fused_swiglu_triton(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None):
    return launch(x, w_gate, w_up, norm_weight, eps, scale=gate_scale, scale_up=up_scale)
