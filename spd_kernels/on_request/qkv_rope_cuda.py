"""qkv_rope_append on CUDA (on request: see spd_kernels.on_request): the products on
linear.cu's tensor-core kernel, then csrc/kernels/rope_append.cu (bf16 / fp16, <= 16 rows)."""
from __future__ import annotations

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.cache_positions import start_tensor
from spd_kernels.checks import last_dim_contiguous
from spd_kernels.linear import kernel_supports as linear_kernel_supports
from spd_kernels.on_request.linear_cuda import cuda_launch as linear_cuda_launch
from spd_kernels.qkv_rope import qkv_products

CUDA_ROPE_MAX_HEAD_DIM = 256  # a thread per pair of RoPE elements, one block per head


def _qkv_cuda_supports(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache,
                       v_cache, num_heads, num_kv_heads, qkv_bias, wq_scale=None, wk_scale=None,
                       wv_scale=None):
    if wq_scale is not None:
        return (f"the CUDA kernel reads bf16 / fp16 weights; wq, wk, wv are quantised "
                f"({wq.dtype}): the Triton kernel and the reference take int8 / fp8 weights")
    if qkv_bias is not None:
        return "the CUDA kernel takes no q/k/v biases (the Triton one does)"
    hd = k_cache.shape[2]
    if hd > CUDA_ROPE_MAX_HEAD_DIM:
        return f"the CUDA kernel takes head_dim up to {CUDA_ROPE_MAX_HEAD_DIM}, got {hd}"
    # the products run on linear.cu: its limits (bf16 / fp16, <= 16 rows, 16-byte rows)
    why = linear_kernel_supports(x, [("x", x), ("norm_weight", norm_weight), ("wq", wq),
                                     ("wk", wk), ("wv", wv)], cuda=True)
    if why:
        return why
    named = [("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)]
    named += [(n, t) for n, t in (("q_norm", q_norm), ("k_norm", k_norm)) if t is not None]
    for name, t in named:
        if t.dtype != x.dtype:
            return (f"the kernel needs every tensor in one dtype (x is {x.dtype}, {name} is "
                    f"{t.dtype})")
        why = last_dim_contiguous(name, t)
        if why:
            return why
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            return f"{name} must be contiguous"
    return None


def _project_cuda(x, w, norm_weight, eps, scale=None):  # float weights only (supports)
    return linear_cuda_launch(x, w, None, norm_weight, eps)


@dispatch.register("qkv_rope_append", "cuda", supports=_qkv_cuda_supports, automatic=False)
def qkv_rope_append_cuda(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                         k_cache, v_cache, num_heads, num_kv_heads, qkv_bias, wq_scale=None,
                         wk_scale=None, wv_scale=None):
    # The products on linear.cu's tensor-core kernel (packed into one when the weights lie back
    # to back), then csrc/kernels/rope_append.cu, a block per (row, head): per-head norm, RoPE, append.
    T = x.shape[0]
    kvh, S, hd = k_cache.shape
    q = _alloc.empty(num_heads, T, hd, dtype=x.dtype, device=x.device)
    if T == 0:
        return q
    start = start_tensor(start, x.device)
    qp, kp, vp = qkv_products(x, norm_weight, eps, wq, wk, wv, _project_cuda)
    _cuda.ext().rope_append(
        qp, qp.stride(0), kp, kp.stride(0), vp, vp.stride(0),
        q_norm, k_norm, cos, sin, cos.stride(0),
        start, q, k_cache, v_cache, T, num_heads,
        num_kv_heads, S, cos.shape[0], hd, float(eps), dtype_code(x.dtype), _cuda.stream_of(x))
    return q
