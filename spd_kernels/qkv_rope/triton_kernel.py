"""qkv_rope_append on Triton (see spd_kernels.qkv_rope)."""
from __future__ import annotations

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, pdl, tl, triton
from spd_kernels.cache_positions import start_tensor
from spd_kernels.linear import fused_linear
from spd_kernels.linear.triton_kernel import launch as linear_launch
from spd_kernels.linear.triton_kernel import partial_sums
from spd_kernels.qkv_rope import back_to_back, packed_qkv, qkv_products, qkv_supports

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to


if HAS_TRITON:

    @triton.jit
    def _qk_rope_append_kernel(qp_ptr, stride_qp, kp_ptr, stride_kp, vp_ptr, stride_vp, qn_ptr,
                               kn_ptr, bias_ptr, cos_ptr, sin_ptr, stride_cs, start_ptr, q_ptr,
                               kc_ptr, vc_ptr, sc_ptr, SPLITS, SPLIT_STRIDE, T, H, KVH, S, eps,
                               HD: tl.constexpr, QK_NORM: tl.constexpr, BIAS: tl.constexpr,
                               SUMS: tl.constexpr, QUANT: tl.constexpr,
                               R: tl.constexpr, PDL: tl.constexpr):
        """Program (t, j) on the projections q [T, H*HD], k, v [T, KVH*HD] (row strides given;
        already rounded to the model dtype, code R): j < H: query head j; then H..H+KVH-1 key
        heads; then value heads. SUMS: instead, qp holds the packed product's K-split fp32
        partial sums [SPLITS, T, (H + 2 KVH) * HD] (SPLIT_STRIDE apart; head j's columns at
        j * HD): summed in split order, times the row scales sc (QUANT) and rounded, exactly as
        fused_linear's reduce launch would (this kernel is that launch). BIAS: the packed q/k/v
        bias (head j's at j * HD) is added first. Per-head RMSNorm and RoPE in registers, rounded
        op by op where the reference rounds; q goes out, k and v straight into the caches at
        position start + t (read on the device; rows past the cache capacity are dropped)."""
        pdl_enter(PDL)
        HALF: tl.constexpr = HD // 2
        t = tl.program_id(0)
        j = tl.program_id(1)
        pos = tl.load(start_ptr).to(tl.int64) + t
        half = tl.arange(0, HALF)
        if SUMS:
            src = qp_ptr + t.to(tl.int64) * stride_qp + j * HD
            lo = tl.zeros([HALF], dtype=tl.float32)
            hi = tl.zeros([HALF], dtype=tl.float32)
            for s in range(0, SPLITS):  # the reduce kernel's order: split 0 first
                lo += tl.load(src + s * SPLIT_STRIDE + half)
                hi += tl.load(src + s * SPLIT_STRIDE + HALF + half)
            if QUANT:
                lo = lo * tl.load(sc_ptr + j * HD + half)
                hi = hi * tl.load(sc_ptr + j * HD + HALF + half)
            lo = round_to(lo, R)
            hi = round_to(hi, R)
        else:
            if j < H:
                src = qp_ptr + t.to(tl.int64) * stride_qp + j * HD
            elif j < H + KVH:
                src = kp_ptr + t.to(tl.int64) * stride_kp + (j - H) * HD
            else:
                src = vp_ptr + t.to(tl.int64) * stride_vp + (j - H - KVH) * HD
            lo = tl.load(src + half).to(tl.float32)
            hi = tl.load(src + HALF + half).to(tl.float32)
        if BIAS:
            lo = round_to(lo + tl.load(bias_ptr + j * HD + half).to(tl.float32), R)
            hi = round_to(hi + tl.load(bias_ptr + j * HD + HALF + half).to(tl.float32), R)
        ok = pos < S
        if j < H + KVH:
            if QK_NORM:
                r2 = 1.0 / tl.sqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / HD + eps)
                if j < H:
                    n_lo = tl.load(qn_ptr + half).to(tl.float32)
                    n_hi = tl.load(qn_ptr + HALF + half).to(tl.float32)
                else:
                    n_lo = tl.load(kn_ptr + half).to(tl.float32)
                    n_hi = tl.load(kn_ptr + HALF + half).to(tl.float32)
                lo = round_to(n_lo * round_to(lo * r2, R), R)
                hi = round_to(n_hi * round_to(hi * r2, R), R)
            cs_row = pos * stride_cs
            c_lo = tl.load(cos_ptr + cs_row + half, mask=ok, other=0.0).to(tl.float32)
            c_hi = tl.load(cos_ptr + cs_row + HALF + half, mask=ok, other=0.0).to(tl.float32)
            s_lo = tl.load(sin_ptr + cs_row + half, mask=ok, other=0.0).to(tl.float32)
            s_hi = tl.load(sin_ptr + cs_row + HALF + half, mask=ok, other=0.0).to(tl.float32)
            # x * cos + rotate_half(x) * sin, rounded op by op like the reference
            out_lo = round_to(round_to(lo * c_lo, R) + round_to(-hi * s_lo, R), R)
            out_hi = round_to(round_to(hi * c_hi, R) + round_to(lo * s_hi, R), R)
            if j < H:
                q_row = q_ptr + (j.to(tl.int64) * T + t) * HD
                tl.store(q_row + half, out_lo)
                tl.store(q_row + HALF + half, out_hi)
            else:
                k_row = kc_ptr + ((j - H).to(tl.int64) * S + pos) * HD
                tl.store(k_row + half, out_lo, mask=ok & (half >= 0))
                tl.store(k_row + HALF + half, out_hi, mask=ok & (half >= 0))
        else:
            v_row = vc_ptr + ((j - H - KVH).to(tl.int64) * S + pos) * HD
            tl.store(v_row + half, lo.to(vc_ptr.dtype.element_ty), mask=ok & (half >= 0))
            tl.store(v_row + HALF + half, hi.to(vc_ptr.dtype.element_ty), mask=ok & (half >= 0))


def _project(x, w, norm_weight, eps, scale=None):
    """rms_norm(x) @ w.T for the Triton QKV step (scale [N]: w quantised). On a GPU it goes
    through fused_linear's dispatch, so use_backend(fused_linear="cuda") (or SPD_BACKEND) moves
    these products to the CUDA kernel with the others; in the interpreter it is the Triton
    kernel."""
    if x.device.type == "cuda":
        return fused_linear(x, w, norm_weight=norm_weight, eps=eps, weight_scale=scale)
    return linear_launch(x, w, None, norm_weight, eps, scale=scale)


@dispatch.register("qkv_rope_append", "triton", supports=qkv_supports, programmatic=True)
def qkv_rope_append_triton(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                           k_cache, v_cache, num_heads, num_kv_heads, qkv_bias, wq_scale=None,
                           wk_scale=None, wv_scale=None):
    # The projections are the fused RMSNorm + linear kernel (each weight tile read once for all
    # rows, split over K to fill the GPU); a program per (row, head) then does the per-head norm,
    # RoPE and cache append. A program per (row, head) that also did the product read every
    # weight once per row: 9 rows cost 33x the weight-read floor on an H200.
    T, D = x.shape
    kvh, S, hd = k_cache.shape
    q = _alloc.empty(num_heads, T, hd, dtype=x.dtype, device=x.device)
    if T == 0:
        return q
    start = start_tensor(start, x.device)
    scales = (wq_scale, wk_scale, wv_scale)
    packed = _packed_product(x, norm_weight, eps, wq, wk, wv, scales)
    splits, split_stride, scale = 1, 0, None
    if packed is None:
        qp, kp, vp = qkv_products(x, norm_weight, eps, wq, wk, wv, _project, scales)
    elif packed[1] == 1:  # one split: the product itself, rounded; its columns are q, k, v
        y = packed[0]
        nq, nk = wq.shape[0], wk.shape[0]
        qp, kp, vp = y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]
    else:  # the split sums, added up by the RoPE kernel below
        ws, splits, scale = packed
        split_stride = ws.stride(0)
        qp = kp = vp = ws[0]
    programmatic = pdl(x.device)
    _qk_rope_append_kernel[(T, num_heads + 2 * num_kv_heads)](
        qp, qp.stride(0), kp, kp.stride(0), vp, vp.stride(0),
        q_norm if q_norm is not None else norm_weight,
        k_norm if k_norm is not None else norm_weight,
        qkv_bias if qkv_bias is not None else norm_weight, cos, sin, cos.stride(0), start, q,
        k_cache, v_cache, scale if scale is not None else norm_weight, splits, split_stride, T,
        num_heads, num_kv_heads, S, eps, HD=hd,
        QK_NORM=q_norm is not None, BIAS=qkv_bias is not None, SUMS=splits > 1,
        QUANT=scale is not None, R=dtype_code(x.dtype),
        num_warps=1 if INTERPRET else 2,
        PDL=programmatic, launch_pdl=programmatic)
    return q


def _packed_product(x, norm_weight, eps, wq, wk, wv, scales):
    """The packed q/k/v product on the Triton linear kernel without its reduce launch:
    (y [T, N] rounded, 1, None) when one split covers K, else (ws [splits, T, N] fp32 split sums,
    splits, packed scale [N] or None), which the RoPE kernel adds up in its registers (one
    launch fewer). None when the weights (or their scales) are not packed, or on a GPU when
    fused_linear dispatches elsewhere (e.g. use_backend(fused_linear="cuda")): three products
    or the other backend's, as before."""
    qkv = packed_qkv(wq, wk, wv)
    if qkv is None:
        return None
    scale = None
    if scales[0] is not None:
        scale = back_to_back(*scales)
        if scale is None:
            return None
    if x.device.type == "cuda":
        chosen, _ = dispatch.select("fused_linear", x.device,
                                    (x, qkv, norm_weight, float(eps), None, scale))
        if chosen != "triton":
            return None
    y, splits = partial_sums(x, qkv, norm_weight, eps, scale=scale)
    return (y, 1, None) if splits == 1 else (y, splits, scale)
