"""Triton kernels of spd_kernels.deltanet: the Gated DeltaNet step over a few rows and the conv
ring update, each reading its ring slot from the device position (CUDA-graph safe).

gated_delta_step: program (value head, block of value columns) keeps its [dk, BV] slice of the
state in registers for all T rows (read once from slot start mod R), writes each row's output
and, for the last min(T, R) rows, the state after it into slot (start + t + 1) mod R.
conv_ring_step: program (block of channels) holds the K-1 history rows of its channels in
registers (read once, so writing a slot that aliases the one read is safe), then computes each
row's causal conv + SiLU and writes the histories of the kept rows.
Both skip their ring writes where `live` (one element on the device) is 0: a batch's dead row.
"""
from __future__ import annotations

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, next_pow2, tl, triton
from spd_kernels.cache_positions import start_tensor
from spd_kernels.checks import check_kernel_float


def _supports(rows=(), **tensors) -> str | None:
    """Every tensor a kernel float; `rows` ones may have any row stride (q/k/v: views of the
    conv output), their other dimensions packed; the rest contiguous."""
    for name, t in tensors.items():
        why = check_kernel_float(name, t)
        if why:
            return why
        packed = t[0].is_contiguous() if name in rows and t.shape[0] else t.is_contiguous()
        if not packed:
            return f"{name} must be {'packed after its rows' if name in rows else 'contiguous'}"
    return None


def _delta_supports(q, k, v, g, beta, state_ring, start, live=None):
    return _supports(("q", "k", "v"), q=q, k=k, v=v, g=g, beta=beta, state_ring=state_ring)


def _conv_supports(x, conv_ring, weight, start, live=None):
    return _supports(x=x, conv_ring=conv_ring, weight=weight)


if HAS_TRITON:

    @triton.jit
    def _delta_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, ring_ptr, out_ptr, start_ptr, live_ptr,
                      T, R, KEEP, HK, HV, DK, DV, scale, stride_qt, stride_kt, stride_vt,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_LIVE: tl.constexpr):
        h = tl.program_id(0)
        vb = tl.program_id(1)
        hk = h // (HV // HK)
        kk = tl.arange(0, BK)
        vv = vb * BV + tl.arange(0, BV)
        km, vm = kk < DK, vv < DV
        start = tl.load(start_ptr)
        state_sz = HV * DK * DV
        head = h.to(tl.int64) * DK * DV
        offs = kk[:, None] * DV + vv[None, :]
        smask = km[:, None] & vm[None, :]
        wmask = smask  # (a dead row's: nothing written)
        if HAS_LIVE:
            wmask = smask & (tl.load(live_ptr).to(tl.int32) != 0)
        S = tl.load(ring_ptr + (start % R) * state_sz + head + offs, mask=smask,
                    other=0.0).to(tl.float32)
        for t in range(T):
            q = tl.load(q_ptr + t * stride_qt + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + t * stride_kt + hk * DK + kk, mask=km, other=0.0).to(tl.float32)
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)) * scale
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
            v = tl.load(v_ptr + t * stride_vt + h * DV + vv, mask=vm, other=0.0).to(tl.float32)
            v_off = (t * HV + h) * DV + vv  # out is contiguous
            g = tl.load(g_ptr + t * HV + h).to(tl.float32)
            beta = tl.load(b_ptr + t * HV + h).to(tl.float32)
            S = S * tl.exp(g)
            kv_mem = tl.sum(S * k[:, None], axis=0)
            delta = (v - kv_mem) * beta
            S = S + k[:, None] * delta[None, :]
            o = tl.sum(S * q[:, None], axis=0)
            tl.store(out_ptr + v_off, o.to(out_ptr.dtype.element_ty), mask=vm)
            if t >= T - KEEP:
                slot = (start + t + 1) % R
                tl.store(ring_ptr + slot * state_sz + head + offs, S, mask=wmask)

    @triton.jit
    def _conv_kernel(x_ptr, ring_ptr, w_ptr, out_ptr, start_ptr, live_ptr, T, C, R, KEEP,
                     K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
                     HAS_LIVE: tl.constexpr):
        pid = tl.program_id(0)
        cols = pid * BC + tl.arange(0, BC)
        cm = cols < C
        wm = cm  # (a dead row's: nothing written)
        if HAS_LIVE:
            wm = cm & (tl.load(live_ptr).to(tl.int32) != 0)
        rows = tl.arange(0, KP)
        start = tl.load(start_ptr)
        slot_sz = (K - 1) * C
        hmask = (rows[:, None] < K - 1) & cm[None, :]
        hist = tl.load(ring_ptr + (start % R) * slot_sz + rows[:, None] * C + cols[None, :],
                       mask=hmask, other=0.0).to(tl.float32)
        for t in range(T):
            acc = tl.zeros([BC], dtype=tl.float32)
            for j in tl.static_range(K):
                i = t + j - (K - 1)  # input row; < 0: history row K - 1 + i
                xv = tl.load(x_ptr + i * C + cols, mask=cm & (i >= 0), other=0.0).to(tl.float32)
                hv = tl.sum(tl.where(rows[:, None] == K - 1 + i, hist, 0.0), axis=0)
                w = tl.load(w_ptr + cols * K + j, mask=cm, other=0.0).to(tl.float32)
                acc += w * tl.where(i >= 0, xv, hv)
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # the conv in the dtype
            out = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + t * C + cols, out.to(out_ptr.dtype.element_ty), mask=cm)
            if t >= T - KEEP:
                slot = (start + t + 1) % R
                for m in tl.static_range(K - 1):
                    i = t + 1 + m - (K - 1)
                    xv = tl.load(x_ptr + i * C + cols, mask=cm & (i >= 0), other=0.0)
                    hv = tl.sum(tl.where(rows[:, None] == K - 1 + i, hist, 0.0), axis=0)
                    val = tl.where(i >= 0, xv.to(tl.float32), hv)
                    tl.store(ring_ptr + slot * slot_sz + m * C + cols,
                             val.to(ring_ptr.dtype.element_ty), mask=wm)


@dispatch.register("gated_delta_step", "triton", supports=_delta_supports)
def gated_delta_step_triton(q, k, v, g, beta, state_ring, start, live=None):
    T, HK, DK = q.shape
    R, HV, _, DV = state_ring.shape
    out = _alloc.empty(*v.shape, dtype=v.dtype, device=v.device)  # contiguous
    if T == 0:
        return out
    bv = min(next_pow2(DV), 64)
    at = start_tensor(start, q.device)
    _delta_kernel[(HV, triton.cdiv(DV, bv))](
        q, k, v, g, beta, state_ring, out, at, at if live is None else live, T, R, min(T, R),
        HK, HV, DK, DV, DK ** -0.5, q.stride(0), k.stride(0), v.stride(0), BK=next_pow2(DK),
        BV=bv, HAS_LIVE=live is not None)
    return out


@dispatch.register("conv_ring_step", "triton", supports=_conv_supports)
def conv_ring_step_triton(x, conv_ring, weight, start, live=None):
    T, C = x.shape
    R = conv_ring.shape[0]
    K = weight.shape[1]
    out = _alloc.empty(*x.shape, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    bc = min(next_pow2(C), 128)
    at = start_tensor(start, x.device)
    _conv_kernel[(triton.cdiv(C, bc),)](x, conv_ring, weight, out, at,
                                       at if live is None else live, T, C, R, min(T, R), K=K,
                                       KP=next_pow2(max(K, 2)), BC=bc,
                                       HAS_LIVE=live is not None)
    return out
