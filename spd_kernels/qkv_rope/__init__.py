"""Op `qkv_rope_append`: RMSNorm + q/k/v projections (+ biases, Qwen2) + per-head q/k RMSNorm +
RoPE + cache append.

  reference  torch, mirroring spd.model.layers (RMSNorm in fp32 then the model dtype, Llama RoPE).
  triton     the q, k and v projections through fused_linear (RMSNorm fused, each weight tile
             read once for all rows; on a GPU whichever backend fused_linear's dispatch picks,
             in the interpreter its Triton kernel), then one launch, program (row, head), applies
             the per-head RMSNorm and RoPE in registers and writes q out or k/v straight into the
             cache at position start + row (read on the device; rows past the capacity dropped).
             Packed weights on fused_linear's Triton kernel split over K: the product launch
             leaves its fp32 split sums and the RoPE launch adds them up (in the reduce launch's
             order, so bit for bit the same), scales and rounds them: two launches, not three.
  cuda       on request (spd_kernels.on_request.qkv_rope_cuda): the products on fused_linear's
             tensor-core CUDA kernel, then csrc/kernels/rope_append.cu, a block per (row, head).
Quantised q/k/v weights (spd_kernels.quant; reference and Triton): wq/wk/wv int8 or
float8_e4m3fn with wq_scale/wk_scale/wv_scale [rows] fp32, each product as fused_linear's
(`quantized_product`); packed weights with packed scales (both back to back, as
`pack_qkv(..., scales)` leaves them) stay one product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import dispatch
from spd_kernels._host import next_pow2
from spd_kernels.cache_positions import check_start, positions
from spd_kernels.checks import (
    SPDInputError,
    check_not_aliased,
    check_same_dtype,
    check_tensor,
    last_dim_contiguous,
)
from spd_kernels.linear import kernel_supports as linear_kernel_supports
from spd_kernels.linear import product, rms_norm
from spd_kernels.opdef import Position, op
from spd_kernels.quant import QUANT_DTYPES, check_weight


def pack_back_to_back(*parts: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `parts` as consecutive views of one buffer (what back_to_back recognises)."""
    buf = torch.cat([p.detach() for p in parts]).contiguous()
    return list(buf.split([p.shape[0] for p in parts]))


def pack_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor):
    """Copies of wq, wk, wv as consecutive views of one buffer: the Triton qkv_rope_append then
    streams the three as one [Nq + Nk + Nv, D] product (one launch, a wider N to split). For
    quantised weights pack their scales [rows] the same way (pack_back_to_back)."""
    return tuple(pack_back_to_back(wq, wk, wv))


def back_to_back(*parts: torch.Tensor) -> torch.Tensor | None:
    """The one tensor [sum of first dims, ...] whose consecutive slices are `parts` when they lie
    back to back in one storage (as pack_qkv leaves them), else None."""
    if not all(p.is_contiguous() for p in parts):
        return None
    first = parts[0]
    if any(p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or
           p.shape[1:] != first.shape[1:] or p.dtype != first.dtype for p in parts):
        return None
    el = first.element_size()
    for a, b in zip(parts, parts[1:]):
        if b.data_ptr() != a.data_ptr() + a.numel() * el:
            return None
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def packed_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor | None:
    """The [Nq + Nk + Nv, D] view over wq, wk, wv when they lie back to back in one storage (as
    pack_qkv leaves them), else None."""
    return back_to_back(wq, wk, wv)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check_qkv(x, norm_weight, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
               num_heads, num_kv_heads, qkv_bias, scales=(None, None, None)):
    check_tensor("x", x, dim=2, floating=True)
    dev = x.device
    T, d = x.shape
    for (name, w), scale in zip((("wq", wq), ("wk", wk), ("wv", wv)), scales):
        check_weight(name, w, f"{name}_scale", scale, dev)
    quantized = scales[0] is not None
    if any((s is None) == quantized for s in scales):
        raise SPDInputError("quantise wq, wk and wv all three (with wq_scale, wk_scale and "
                            "wv_scale) or none")
    for name, t in (("norm_weight", norm_weight), ("wq", wq), ("wk", wk), ("wv", wv),
                    ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, floating=not (quantized and name[0] == "w"), device=dev)
    if quantized:  # the weights share their own dtype; the rest x's
        check_same_dtype(wq=wq, wk=wk, wv=wv)
        check_same_dtype(x=x, norm_weight=norm_weight, q_norm=q_norm, k_norm=k_norm,
                         qkv_bias=qkv_bias)
    else:
        check_same_dtype(x=x, norm_weight=norm_weight, wq=wq, wk=wk, wv=wv, q_norm=q_norm,
                         k_norm=k_norm, qkv_bias=qkv_bias)
    check_not_aliased("k_cache", k_cache, "v_cache", v_cache)
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise SPDInputError(f"num_heads ({num_heads}) must be a positive multiple of "
                            f"num_kv_heads ({num_kv_heads})")
    if k_cache.dim() != 3 or k_cache.shape != v_cache.shape or k_cache.shape[0] != num_kv_heads:
        raise SPDInputError(f"k_cache and v_cache must both be [num_kv_heads={num_kv_heads}, S, "
                            f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hd = k_cache.shape[2]
    if hd % 2:
        raise SPDInputError(f"head_dim must be even for RoPE, got {hd}")
    if tuple(norm_weight.shape) != (d,):
        raise SPDInputError(f"norm_weight must have shape ({d},), got {tuple(norm_weight.shape)}")
    for name, w, heads in (("wq", wq, num_heads), ("wk", wk, num_kv_heads),
                           ("wv", wv, num_kv_heads)):
        if tuple(w.shape) != (heads * hd, d):
            raise SPDInputError(f"{name} must have shape ({heads * hd}, {d}), got {tuple(w.shape)}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            check_tensor(name, w, floating=True, device=dev)
            if tuple(w.shape) != (hd,):
                raise SPDInputError(f"{name} must have shape ({hd},), got {tuple(w.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise SPDInputError("give both q_norm and k_norm, or neither")
    if qkv_bias is not None:
        check_tensor("qkv_bias", qkv_bias, floating=True, device=dev)
        n = (num_heads + 2 * num_kv_heads) * hd
        if tuple(qkv_bias.shape) != (n,):
            raise SPDInputError(f"qkv_bias must be the q, k and v biases back to back, shape "
                                f"({n},), got {tuple(qkv_bias.shape)}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != hd:
        raise SPDInputError(f"cos and sin must be RoPE tables [positions, {hd}], got "
                            f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    first = check_start(start, T, k_cache.shape[1], dev)
    if first is not None:
        if first + T > cos.shape[0]:
            raise SPDInputError(f"the RoPE tables cover {cos.shape[0]} positions, rows reach "
                                f"{first + T - 1}")


@op("qkv_rope_append", mutates=("k_cache", "v_cache"))
def qkv_rope_append(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, wq: torch.Tensor,
                    wk: torch.Tensor, wv: torch.Tensor, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                    start: Position, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    num_heads: int, num_kv_heads: int, *,
                    qkv_bias: torch.Tensor | None = None,
                    wq_scale: torch.Tensor | None = None, wk_scale: torch.Tensor | None = None,
                    wv_scale: torch.Tensor | None = None,
                    backend: str | None = None) -> torch.Tensor:
    """Rows x [T, d] at positions start..start+T-1 -> q [num_heads, T, head_dim] (RMSNorm'd input,
    per-head q/k RMSNorm when q_norm/k_norm are given, RoPE from the full tables cos/sin
    [P, head_dim] at those positions). Writes the rows' k (with RoPE) and v into k_cache/v_cache
    [num_kv_heads, S, head_dim] at the same positions. `start` is an int or an int64 tensor.
    qkv_bias [(num_heads + 2 * num_kv_heads) * head_dim]: the q, k and v projections' biases back
    to back (Qwen2), added to the products before the norms and RoPE. wq_scale / wk_scale /
    wv_scale [rows of the weight] fp32: wq, wk, wv are quantised (int8 / float8_e4m3fn, all three
    or none; spd_kernels.quant), each product round_to_x_dtype((h @ w.float().T in fp32) *
    scale), the bias then added in x's dtype."""
    scales = (wq_scale, wk_scale, wv_scale)
    _check_qkv(x, norm_weight, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
               num_heads, num_kv_heads, qkv_bias, scales)
    return dispatch.call("qkv_rope_append", x.device, x, norm_weight, float(eps), wq, wk, wv,
                         q_norm, k_norm, cos, sin, start, k_cache, v_cache, int(num_heads),
                         int(num_kv_heads), qkv_bias, *scales, backend=backend)


@qkv_rope_append.register_fake
def _(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
      num_heads, num_kv_heads, qkv_bias=None, wq_scale=None, wk_scale=None, wv_scale=None):
    return x.new_empty(num_heads, x.shape[0], k_cache.shape[2])


def split_bias(qkv_bias, wq, wk):
    """(bq, bk, bv) views of the packed bias, or three Nones."""
    if qkv_bias is None:
        return None, None, None
    nq, nk = wq.shape[0], wk.shape[0]
    return qkv_bias[:nq], qkv_bias[nq:nq + nk], qkv_bias[nq + nk:]


@dispatch.register("qkv_rope_append", "reference")
def qkv_rope_append_reference(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                              k_cache, v_cache, num_heads, num_kv_heads, qkv_bias, wq_scale=None,
                              wk_scale=None, wv_scale=None):
    T = x.shape[0]
    hd = k_cache.shape[2]
    h = rms_norm(x, norm_weight, eps)
    bq, bk, bv = split_bias(qkv_bias, wq, wk)
    if wq_scale is None:  # as nn.Linear with a bias: one addmm each
        q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    else:  # the quantised product, rounded, then the bias (spd_kernels.quant)
        q, k, v = (product(h, w, s) if b is None else product(h, w, s) + b
                   for w, s, b in ((wq, wq_scale, bq), (wk, wk_scale, bk), (wv, wv_scale, bv)))
    q = q.view(T, num_heads, hd)
    k = k.view(T, num_kv_heads, hd)
    v = v.view(T, num_kv_heads, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    pos = positions(start, T, x.device)
    c, s = cos[pos], sin[pos]
    q = q.transpose(0, 1)
    k = k.transpose(0, 1)
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    k_cache[:, pos] = k.to(k_cache.dtype)
    v_cache[:, pos] = v.transpose(0, 1).to(v_cache.dtype)
    return q.contiguous()


def qkv_supports(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache,
                  v_cache, num_heads, num_kv_heads, qkv_bias, wq_scale=None, wk_scale=None,
                  wv_scale=None):
    hd = k_cache.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim, got {hd}"
    named = [("x", x), ("norm_weight", norm_weight), ("wq", wq), ("wk", wk), ("wv", wv),
             ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)]
    named += [(n, t) for n, t in (("q_norm", q_norm), ("k_norm", k_norm), ("qkv_bias", qkv_bias))
              if t is not None]
    why = linear_kernel_supports(x, ())  # the projections run fused_linear's kernel: its limits
    if why:
        return why
    for name, t in named:
        if t.dtype != x.dtype and not (name[0] == "w" and t.dtype in QUANT_DTYPES):
            return (f"the kernel needs every tensor in one dtype (x is {x.dtype}, {name} is "
                    f"{t.dtype})")
        why = last_dim_contiguous(name, t)
        if why:
            return why
    for name, t in (("wq", wq), ("wk", wk), ("wv", wv), ("k_cache", k_cache),
                    ("v_cache", v_cache), ("wq_scale", wq_scale), ("wk_scale", wk_scale),
                    ("wv_scale", wv_scale)):
        if t is not None and not t.is_contiguous():
            return f"{name} must be contiguous"
    return None


def qkv_products(x, norm_weight, eps, wq, wk, wv, project, scales=(None, None, None)):
    """(q, k, v) projections of rms_norm(x) through project(x, w, norm_weight, eps, scale): one
    product over the packed weights when they lie back to back (then views of its columns; with
    quantised weights their scales must lie back to back too), else three."""
    qkv = packed_qkv(wq, wk, wv)
    scale = None
    if qkv is not None and scales[0] is not None:
        scale = back_to_back(*scales)
        if scale is None:
            qkv = None
    if qkv is None:
        return tuple(project(x, w, norm_weight, eps, s) for w, s in zip((wq, wk, wv), scales))
    y = project(x, qkv, norm_weight, eps, scale)
    nq, nk = wq.shape[0], wk.shape[0]
    return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("qkv_rope_append", "triton", "spd_kernels.qkv_rope.triton_kernel")
