"""fused_linear / fused_swiglu on csrc/kernels/linear.cu (on request: see spd_kernels.on_request).

bf16 / fp16 and at most 16 rows: tensor-core mma with the rows of x as the MMA's 16 rows, each
weight byte loaded once straight into the fragments; the norm is a first launch, K splits a last
one, in a fixed order.
"""
from __future__ import annotations

import torch

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.linear import (
    CUDA_COLUMNS,
    CUDA_MIN_CHUNKS,
    kernel_supports,
    linear_tensors,
    swiglu_tensors,
)


def _linear_cuda_supports(*args):
    return kernel_supports(args[0], linear_tensors(*args), cuda=True)


def _swiglu_cuda_supports(*args):
    return kernel_supports(args[0], swiglu_tensors(*args), cuda=True)


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
    _cuda.ext().fused_linear(
        x, x.stride(0), norm_weight, xn, weight, w_up,
        residual, residual.stride(0) if residual is not None else 0, out,
        out.stride(0), ws, R, N, K, splits, k_per, float(eps), dtype_code(x.dtype),
        _cuda.stream_of(x))
    return out


@dispatch.register("fused_linear", "cuda", supports=_linear_cuda_supports, automatic=False)
def fused_linear_cuda(x, weight, norm_weight, eps, residual, weight_scale=None):
    # quantised weights never get here: _linear_cuda_supports refuses them
    return cuda_launch(x, weight, None, norm_weight, eps, residual)


@dispatch.register("fused_swiglu", "cuda", supports=_swiglu_cuda_supports, automatic=False)
def fused_swiglu_cuda(x, norm_weight, eps, w_gate, w_up, gate_scale=None, up_scale=None):
    return cuda_launch(x, w_gate, w_up, norm_weight, eps)
