"""Linear layers over a handful of rows, with the RMSNorm before them and the residual or SwiGLU
after them fused in: the dense part of the PDM step (o_proj + residual, RMSNorm + gate/up +
SwiGLU, down + residual, final RMSNorm + draft LM head).

With at most n+1 rows these are GEMVs in disguise: the time is reading the weight once. The kernel
reads each weight tile once for all rows, normalises the rows on the fly (the normed activations
never go to memory) and applies the epilogue in registers.

Op `fused_linear(x, weight, norm_weight=None, eps, residual=None)`:
    residual + rms_norm(x) @ weight.T   (norm and residual optional), in x's dtype.
Op `fused_swiglu(x, norm_weight, eps, w_gate, w_up)`:
    silu(h @ w_gate.T) * (h @ w_up.T) with h = rms_norm(x), in x's dtype.

  reference  torch, exactly what spd.model.layers computes (rms_norm: fp32 statistics, rounded to the
             model dtype before the weight), so the runtime's step is unchanged bit for bit.
  triton     grid (output blocks, K splits). Program (j, s) holds the [rows, BLOCK_N] fp32
             accumulator(s) for output columns j*BLOCK_N.. and sums its share of K with tl.dot
             (rows padded to 16, the MMA minimum), normalising each x tile in registers. With one
             split the epilogue (rounding, SwiGLU, residual) runs in the same program; with
             several (a narrow output, e.g. o_proj or down at 2560 columns, would leave most SMs
             idle) partial sums go to an fp32 workspace and a second launch reduces them in a
             fixed order (deterministic) and applies the epilogue. Intermediates are rounded to
             the model dtype where the reference rounds.
  cuda       csrc/kernels/linear.cu, bf16 / fp16 and at most 16 rows: tensor-core mma with the rows of x
             as the MMA's 16 rows, each weight byte loaded once straight into the fragments
             (16-byte loads, a whole batch in flight per lane); the norm is a first launch, K
             splits (to fill the GPU at 2560 output columns) a last one, in a fixed order.
             Registered on request only (backend="cuda", SPD_BACKEND=fused_linear=cuda) until a
             GPU has timed it against Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import _alloc, _cuda, dispatch
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
from spd_kernels.checks import SPDInputError, check_kernel_float, check_tensor, last_dim_contiguous

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to

MAX_KERNEL_ROWS = 64   # past this (a prefill chunk) a GEMM library is the right tool
CUDA_MAX_ROWS = 16     # the MMA's M: rows of x
CUDA_COLUMNS = 64      # output columns per block (half of that per weight with SwiGLU)
CUDA_MIN_CHUNKS = 4    # K chunks per split at least: fewer and the partial sums cost more than
                       # the extra blocks gain


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As spd.model.layers.RMSNorm: fp32 statistics, result in the input dtype times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# argument checks and public functions
# ------------------------------------------------------------------------------------------------

def _check_common(x, norm_weight, weights):
    check_tensor("x", x, dim=2, floating=True)
    R, K = x.shape
    for name, w in weights:
        check_tensor(name, w, dim=2, floating=True, device=x.device)
        if w.shape[1] != K:
            raise SPDInputError(f"{name} must be [out, {K}] to take rows of width {K}, got "
                                f"{tuple(w.shape)}")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, floating=True, device=x.device)
        if tuple(norm_weight.shape) != (K,):
            raise SPDInputError(f"norm_weight must have shape ({K},), got "
                                f"{tuple(norm_weight.shape)}")


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """x [R, K] -> [R, N]: residual + rms_norm(x, norm_weight, eps) @ weight.T, weight [N, K].
    norm_weight None: no normalisation; residual None: no residual. Result in x's dtype."""
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        return torch.ops.spd.fused_linear(x, weight, norm_weight, float(eps), residual)
    _check_common(x, norm_weight, [("weight", weight)])
    if residual is not None:
        check_tensor("residual", residual, dim=2, floating=True, device=x.device)
        if tuple(residual.shape) != (x.shape[0], weight.shape[0]):
            raise SPDInputError(f"residual must be [{x.shape[0]}, {weight.shape[0]}] like the "
                                f"output, got {tuple(residual.shape)}")
    return dispatch.call("fused_linear", x.device, x, weight, norm_weight, float(eps), residual,
                         backend=backend)


def fused_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_gate: torch.Tensor,
                 w_up: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """x [R, K] -> [R, I]: silu(h @ w_gate.T) * (h @ w_up.T), h = rms_norm(x, norm_weight, eps);
    w_gate and w_up [I, K]. Result in x's dtype."""
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        return torch.ops.spd.fused_swiglu(x, norm_weight, float(eps), w_gate, w_up)
    _check_common(x, norm_weight, [("w_gate", w_gate), ("w_up", w_up)])
    if w_gate.shape != w_up.shape:
        raise SPDInputError(f"w_gate and w_up must have one shape, got {tuple(w_gate.shape)} and "
                            f"{tuple(w_up.shape)}")
    return dispatch.call("fused_swiglu", x.device, x, norm_weight, float(eps), w_gate, w_up,
                         backend=backend)


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------

@dispatch.register("fused_linear", "reference")
def fused_linear_reference(x, weight, norm_weight, eps, residual):
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    y = F.linear(h, weight)
    return y if residual is None else residual + y


@dispatch.register("fused_swiglu", "reference")
def fused_swiglu_reference(x, norm_weight, eps, w_gate, w_up):
    h = rms_norm(x, norm_weight, eps)
    return F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)


# ------------------------------------------------------------------------------------------------
# triton
# ------------------------------------------------------------------------------------------------

def _supports(x, tensors, *, cuda: bool = False):
    """None when the Triton kernel (cuda: the CUDA kernel) takes these tensors, else why not."""
    why = check_kernel_float("x", x)
    if why:
        return why
    R, K = x.shape
    if cuda:
        if x.dtype not in (torch.bfloat16, torch.float16):
            return (f"the CUDA kernel runs bf16 / fp16 on tensor cores, got {x.dtype} (the "
                    f"Triton kernel takes fp32)")
        if R > CUDA_MAX_ROWS:
            return f"the CUDA kernel is for at most {CUDA_MAX_ROWS} rows (got {R})"
        if K == 0 or K % 8:
            return (f"the CUDA kernel reads K in 16-byte pieces: K must be a positive multiple "
                    f"of 8, got {K}")
    elif R > MAX_KERNEL_ROWS:
        return (f"the kernel is for at most {MAX_KERNEL_ROWS} rows (got {R}); a GEMM "
                f"library serves larger chunks")
    for name, t in tensors:
        if t is None:
            continue
        if t.dtype != x.dtype:
            return f"the kernel needs every tensor in x's dtype (x is {x.dtype}, {name} is {t.dtype})"
        why = last_dim_contiguous(name, t)
        if why:
            return why
        if name.startswith("w") and not t.is_contiguous():  # weights are read as [out, K] rows
            return f"{name} must be contiguous"
        if cuda and (name == "x" or name.startswith("w")) and (t.data_ptr() % 16
                                                               or t.stride(0) % 8):
            return f"{name} must start on a 16-byte boundary with rows a multiple of 8 apart"
    return None


def _linear_tensors(x, weight, norm_weight, eps, residual):
    return [("x", x), ("weight", weight), ("norm_weight", norm_weight), ("residual", residual)]


def _swiglu_tensors(x, norm_weight, eps, w_gate, w_up):
    return [("x", x), ("norm_weight", norm_weight), ("w_gate", w_gate), ("w_up", w_up)]


def _linear_supports(*args):
    return _supports(args[0], _linear_tensors(*args))


def _swiglu_supports(*args):
    return _supports(args[0], _swiglu_tensors(*args))


# GPU tiles are autotuned on the first call per shape (no GPU has tuned them by hand yet); K per
# split is a multiple of the largest BLOCK_K so every config covers a split exactly.
GPU_CONFIGS = ((64, 64, 8), (32, 128, 4), (64, 128, 8), (128, 64, 8), (32, 64, 4))  # BN, BK, warps
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
    def _epilogue(acc, acc2, res_ptr, stride_res, rows, cols, mask, SWIGLU: tl.constexpr,
                  RESIDUAL: tl.constexpr, DT: tl.constexpr):
        """Round like the reference: each product to the model dtype, then SwiGLU (silu in fp32,
        rounded; times up, rounded) or the residual add (rounded)."""
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
                       stride_out, ws_ptr, SET_STRIDE, R, N, K, K_PER, eps,
                       NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr,
                       PARTIAL: tl.constexpr, DT: tl.constexpr, FP32_DOT: tl.constexpr,
                       R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PDL: tl.constexpr):
        """Program (j, s): output columns j*BLOCK_N.. over K range s*K_PER.. (PARTIAL: store fp32
        partial sums into ws [splits, 1 or 2, R, N]; else apply the epilogue and store out)."""
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
            # FP32_DOT: fp32 weights, or the interpreter (its bf16 dot is wrong); bf16 x bf16
            # products are exact in fp32, so only the summation order differs from the MMA path
            if FP32_DOT:
                acc += tl.dot(xv, tl.trans(w).to(tl.float32), input_precision="ieee")
            else:  # xv holds model-dtype values already (rounded), so the cast is exact
                acc += tl.dot(xv.to(w.dtype), tl.trans(w))
            if SWIGLU:
                w2 = tl.load(w2_ptr + w_rows + kk[None, :], mask=wmask, other=0.0)
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
            y = _epilogue(acc, acc2, res_ptr, stride_res, rows, cols, omask, SWIGLU, RESIDUAL, DT)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y,
                     mask=omask)

    @triton.jit
    def _reduce_kernel(ws_ptr, SET_STRIDE, res_ptr, stride_res, out_ptr, stride_out, R, N, SPLITS,
                       SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, DT: tl.constexpr,
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
        y = _epilogue(acc, acc2, res_ptr, stride_res, rows, cols, mask, SWIGLU, RESIDUAL, DT)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], y, mask=mask)

    def _quick_bench(fn, quantiles):
        """Short timings: the first draft of a run pays for tuning (about 5 shapes x 5 configs)."""
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)

    # the outputs are pure functions of the inputs, so the autotuner may rerun the kernel freely
    _linear_tuned = triton.autotune(
        [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in GPU_CONFIGS],
        key=["N", "K", "R_PAD", "NORM", "SWIGLU", "PARTIAL"], do_bench=_quick_bench)(_linear_kernel)


def launch(x, weight, w_up=None, norm_weight=None, eps=1e-6, residual=None, *,
           split_k: int | None = None) -> torch.Tensor:
    """Launcher shared by both ops (w_up given: SwiGLU). split_k None: chosen by `plan`."""
    R, K = x.shape
    N = weight.shape[0]
    out = _alloc.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out
    r_pad, block_n, block_k, splits, k_per = plan(R, N, K, x.device, split_k)
    swiglu = w_up is not None
    set_stride = (2 if swiglu else 1) * R * N
    if splits * set_stride >= 2 ** 31:  # the reduce kernel indexes the workspace in int32
        r_pad, block_n, block_k, splits, k_per = plan(R, N, K, x.device, 1)
    partial = splits > 1
    ws = torch.empty(splits * set_stride, dtype=torch.float32, device=x.device) if partial else out
    res = residual if residual is not None else out
    flags = dict(SWIGLU=swiglu, RESIDUAL=residual is not None, DT=dtype_code(x.dtype), R_PAD=r_pad)
    args = (x, x.stride(0), norm_weight if norm_weight is not None else x, weight,
            w_up if swiglu else weight, res, res.stride(0), out, out.stride(0), ws, set_stride, R,
            N, K, k_per, eps)
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
    if partial:
        _reduce_kernel[(triton.cdiv(N, block_n),)](ws, set_stride, res, res.stride(0), out,
                                                   out.stride(0), R, N, splits, BLOCK_N=block_n,
                                                   num_warps=1 if INTERPRET else 4,
                                                   PDL=programmatic, launch_pdl=programmatic,
                                                   **flags)
    return out


@dispatch.register("fused_linear", "triton", supports=_linear_supports)
def fused_linear_triton(x, weight, norm_weight, eps, residual):
    return launch(x, weight, None, norm_weight, eps, residual)


@dispatch.register("fused_swiglu", "triton", supports=_swiglu_supports)
def fused_swiglu_triton(x, norm_weight, eps, w_gate, w_up):
    return launch(x, w_gate, w_up, norm_weight, eps)


# ------------------------------------------------------------------------------------------------
# cuda
# ------------------------------------------------------------------------------------------------

def _linear_cuda_supports(*args):
    return _supports(args[0], _linear_tensors(*args), cuda=True)


def _swiglu_cuda_supports(*args):
    return _supports(args[0], _swiglu_tensors(*args), cuda=True)


def cuda_plan(N: int, K: int, sets: int, device, split_k: int | None = None) -> tuple[int, int]:
    """(splits, K columns per split) for csrc/kernels/linear.cu: about three blocks per SM in all."""
    chunks = -(-K // _cuda.MMA_CHUNK)
    if split_k is None:
        col_blocks = -(-N // (CUDA_COLUMNS // sets))
        split_k = min(round(3 * _cuda.multiprocessors(device) / col_blocks),
                      chunks // CUDA_MIN_CHUNKS)
    per = -(-chunks // max(1, min(int(split_k), chunks)))
    return -(-chunks // per), per * _cuda.MMA_CHUNK


def cuda_launch(x, weight, w_up=None, norm_weight=None, eps=1e-6, residual=None, *,
                split_k: int | None = None) -> torch.Tensor:
    """Launcher shared by both ops on the CUDA kernel (w_up given: SwiGLU)."""
    R, K = x.shape
    N = weight.shape[0]
    out = _alloc.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return out
    sets = 2 if w_up is not None else 1
    splits, k_per = cuda_plan(N, K, sets, x.device, split_k)
    ws = _alloc.empty(splits * sets * R * N, dtype=torch.float32, device=x.device) \
        if splits > 1 else None
    xn = _alloc.empty(R, K, dtype=x.dtype, device=x.device) if norm_weight is not None else None
    ptr = lambda t: 0 if t is None else t.data_ptr()
    _cuda.ext().fused_linear(
        x.data_ptr(), x.stride(0), ptr(norm_weight), ptr(xn), weight.data_ptr(), ptr(w_up),
        ptr(residual), residual.stride(0) if residual is not None else 0, out.data_ptr(),
        out.stride(0), ptr(ws), R, N, K, splits, k_per, float(eps), dtype_code(x.dtype),
        _cuda.stream_of(x))
    return out


@dispatch.register("fused_linear", "cuda", supports=_linear_cuda_supports, automatic=False)
def fused_linear_cuda(x, weight, norm_weight, eps, residual):
    return cuda_launch(x, weight, None, norm_weight, eps, residual)


@dispatch.register("fused_swiglu", "cuda", supports=_swiglu_cuda_supports, automatic=False)
def fused_swiglu_cuda(x, norm_weight, eps, w_gate, w_up):
    return cuda_launch(x, w_gate, w_up, norm_weight, eps)
