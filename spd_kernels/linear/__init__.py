"""Linear layers over a handful of rows, with the RMSNorm before them and the residual or SwiGLU
after them fused in: the dense part of the PDM step (o_proj + residual, RMSNorm + gate/up +
SwiGLU, down + residual, final RMSNorm + draft LM head).

With at most n+1 rows these are GEMVs in disguise: the time is reading the weight once. The kernel
reads each weight tile once for all rows, normalises the rows on the fly (the normed activations
never go to memory) and applies the epilogue in registers.

Op `fused_linear(x, weight, norm_weight=None, eps, residual=None, weight_scale=None)`:
    residual + rms_norm(x) @ weight.T   (norm and residual optional), in x's dtype.
Op `fused_swiglu(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None)`:
    silu(h @ w_gate.T) * (h @ w_up.T) with h = rms_norm(x), in x's dtype.
Quantised weights (spd_kernels.quant): an int8 / float8_e4m3fn weight [N, K] with its fp32 scale
[N] stands for weight * scale[:, None]; its product is round(fp32 sum of h * float(q), times the
scale) to x's dtype (`quantized_product`), then the epilogue as for float weights. Reference and
Triton take them; the CUDA kernel does not (its `supports` says so, the dispatcher falls back).

  reference  torch, exactly what spd.model.layers computes (rms_norm: fp32 statistics, rounded to the
             model dtype before the weight), so the runtime's step is unchanged bit for bit.
  triton     grid (output blocks, K splits). Program (j, s) holds the [rows, BLOCK_N] fp32
             accumulator(s) for output columns j*BLOCK_N.. and sums its share of K with tl.dot
             (rows padded to 16, the MMA minimum), normalising each x tile in registers. With one
             split the epilogue (rounding, SwiGLU, residual) runs in the same program; with
             several (a narrow output, e.g. o_proj or down at 2560 columns, would leave most SMs
             idle) partial sums go to an fp32 workspace and a second launch reduces them in a
             fixed order (deterministic) and applies the epilogue. Intermediates are rounded to
             the model dtype where the reference rounds. A consumer that can add the splits up
             itself takes them without the reduce launch (triton_kernel.partial_sums: the
             QKV product, summed in qkv_rope_append's RoPE kernel). Quantised (1-byte) weights
             have their own GPU tiles, twice as deep in K, so a pipeline stage moves as many
             bytes as a bf16 tile.
  cuda       csrc/kernels/linear.cu, bf16 / fp16 and at most 16 rows: tensor-core mma with the rows of x
             as the MMA's 16 rows, each weight byte loaded once straight into the fragments
             (16-byte loads, a whole batch in flight per lane); the norm is a first launch, K
             splits (to fill the GPU at 2560 output columns) a last one, in a fixed order.
             On request only (spd_kernels.on_request.linear_cuda) until a GPU has timed it
             against Triton.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import dispatch
from spd_kernels.checks import SPDInputError, check_kernel_float, check_tensor, last_dim_contiguous
from spd_kernels.opdef import op
from spd_kernels.quant import QUANT_DTYPES, check_weight

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

def quantized_product(h: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """h [R, K] (model dtype) times a quantised weight q [N, K] with scale [N] (fp32) -> [R, N]
    in h's dtype: (h @ q.T summed in fp32) * scale, rounded once (spd_kernels.quant)."""
    return ((h.float() @ q.float().t()) * scale).to(h.dtype)


def product(h: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """h @ w.T for a float weight (F.linear, as spd.model.layers) or a quantised one."""
    return F.linear(h, w) if scale is None else quantized_product(h, w, scale)


def _check_common(x, norm_weight, weights):
    """weights: (name, w [N, K], scale name, scale [N] or None) for each weight."""
    check_tensor("x", x, dim=2, floating=True)
    R, K = x.shape
    for name, w, scale_name, scale in weights:
        check_weight(name, w, scale_name, scale, x.device)
        check_tensor(name, w, dim=2, floating=scale is None, device=x.device)
        if w.shape[1] != K:
            raise SPDInputError(f"{name} must be [out, {K}] to take rows of width {K}, got "
                                f"{tuple(w.shape)}")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, floating=True, device=x.device)
        if tuple(norm_weight.shape) != (K,):
            raise SPDInputError(f"norm_weight must have shape ({K},), got "
                                f"{tuple(norm_weight.shape)}")


@op("fused_linear")
def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, residual: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """x [R, K] -> [R, N]: residual + rms_norm(x, norm_weight, eps) @ weight.T, weight [N, K].
    norm_weight None: no normalisation; residual None: no residual. Result in x's dtype.
    weight_scale [N] fp32: weight is quantised (int8 / float8_e4m3fn, spd_kernels.quant) and the
    product is round_to_x_dtype((h @ weight.float().T in fp32) * weight_scale), h the (normed)
    rows; the residual is then added in x's dtype as for a float weight."""
    _check_common(x, norm_weight, [("weight", weight, "weight_scale", weight_scale)])
    if residual is not None:
        check_tensor("residual", residual, dim=2, floating=True, device=x.device)
        if tuple(residual.shape) != (x.shape[0], weight.shape[0]):
            raise SPDInputError(f"residual must be [{x.shape[0]}, {weight.shape[0]}] like the "
                                f"output, got {tuple(residual.shape)}")
    return dispatch.call("fused_linear", x.device, x, weight, norm_weight, float(eps), residual,
                         weight_scale, backend=backend)


@fused_linear.register_fake
def _(x, weight, norm_weight=None, eps=1e-6, residual=None, weight_scale=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@op("fused_swiglu")
def fused_swiglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w_gate: torch.Tensor,
                 w_up: torch.Tensor, *, gate_scale: torch.Tensor | None = None,
                 up_scale: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """x [R, K] -> [R, I]: silu(h @ w_gate.T) * (h @ w_up.T), h = rms_norm(x, norm_weight, eps);
    w_gate and w_up [I, K]. Result in x's dtype. gate_scale / up_scale [I] fp32: the weights are
    quantised (both or neither), each product rounded as fused_linear's with weight_scale."""
    _check_common(x, norm_weight, [("w_gate", w_gate, "gate_scale", gate_scale),
                                   ("w_up", w_up, "up_scale", up_scale)])
    if w_gate.shape != w_up.shape:
        raise SPDInputError(f"w_gate and w_up must have one shape, got {tuple(w_gate.shape)} and "
                            f"{tuple(w_up.shape)}")
    if (gate_scale is None) != (up_scale is None):
        raise SPDInputError("quantise w_gate and w_up both (with gate_scale and up_scale) or "
                            "neither")
    return dispatch.call("fused_swiglu", x.device, x, norm_weight, float(eps), w_gate, w_up,
                         gate_scale, up_scale, backend=backend)


@fused_swiglu.register_fake
def _(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None):
    return x.new_empty(x.shape[0], w_gate.shape[0])


# ------------------------------------------------------------------------------------------------
# reference
# ------------------------------------------------------------------------------------------------

@dispatch.register("fused_linear", "reference")
def fused_linear_reference(x, weight, norm_weight, eps, residual, weight_scale=None):
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    y = product(h, weight, weight_scale)
    return y if residual is None else residual + y


@dispatch.register("fused_swiglu", "reference")
def fused_swiglu_reference(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None):
    h = rms_norm(x, norm_weight, eps)
    return F.silu(product(h, w_gate, gate_scale)) * product(h, w_up, up_scale)


# ------------------------------------------------------------------------------------------------
# what the kernels take (the Triton kernel here, the CUDA one in spd_kernels.on_request)
# ------------------------------------------------------------------------------------------------

def kernel_supports(x, tensors, *, cuda: bool = False):
    """None when the Triton kernel (cuda: the CUDA kernel) takes these tensors, else why not."""
    why = check_kernel_float("x", x)
    if why:
        return why
    R, K = x.shape
    quantized = [(n, t.dtype) for n, t in tensors if t is not None and t.dtype in QUANT_DTYPES]
    if cuda and quantized:
        return (f"the CUDA kernel reads bf16 / fp16 weights; {quantized[0][0]} is quantised "
                f"({quantized[0][1]}): the Triton kernel and the reference take int8 / fp8 "
                f"weights")
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
        if name.endswith("scale"):  # fp32 whatever x's dtype (spd_kernels.quant), read [N]
            if cuda:
                return f"the CUDA kernel takes no weight scales ({name} given)"
            if not t.is_contiguous():
                return f"{name} must be contiguous"
            continue
        if t.dtype != x.dtype and not (name.startswith("w") and t.dtype in QUANT_DTYPES):
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


def linear_tensors(x, weight, norm_weight, eps, residual, weight_scale=None):
    return [("x", x), ("weight", weight), ("norm_weight", norm_weight), ("residual", residual),
            ("weight_scale", weight_scale)]


def swiglu_tensors(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None):
    return [("x", x), ("norm_weight", norm_weight), ("w_gate", w_gate), ("w_up", w_up),
            ("gate_scale", gate_scale), ("up_scale", up_scale)]


def linear_supports(*args):
    return kernel_supports(args[0], linear_tensors(*args))


def swiglu_supports(*args):
    return kernel_supports(args[0], swiglu_tensors(*args))


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("fused_linear", "triton", "spd_kernels.linear.triton_kernel")
dispatch.defer("fused_swiglu", "triton", "spd_kernels.linear.triton_kernel")
