"""The PDM decoder step as plain tensors, and its fused pieces.

`pdm_step` is the draft module's forward for a chunk of rows against its KV cache (what
`spd.draft.pdm.PipelineDraftModule.step` computes), written over plain weight tensors so kernels can
replace its parts and a CUDA graph can capture it: per layer RMSNorm + QKV + q/k norm + RoPE +
cache append, causal GQA attention over the cache, output projection + residual, RMSNorm + SwiGLU
MLP + residual; then the final norm and the LM head over the draft vocabulary for the last row.
The position `start` may be a device tensor, so nothing in the step needs the host.

Op `qkv_rope_append` (dispatched, see spd_kernels.dispatch):
  reference  torch, mirroring spd.model.layers (RMSNorm in fp32 then the model dtype, Llama RoPE).
  triton     the q, k and v projections through fused_linear (RMSNorm fused, each weight tile
             read once for all rows; on a GPU whichever backend fused_linear's dispatch picks,
             in the interpreter its Triton kernel), then one launch, program (row, head), applies
             the per-head RMSNorm and RoPE in registers and writes q out or k/v straight into the
             cache at position start + row (read on the device; rows past the capacity dropped).
  cuda       the products on fused_linear's tensor-core CUDA kernel, then csrc/kernels/rope_append.cu, a
             block per (row, head), for the same per-head work (bf16 / fp16, <= 16 rows). On
             request only until a GPU has timed it.
Op `cache_attention` (dispatched):
  reference  torch. With an int `start`: SDPA over cache rows [0, start + R) with the causal
             chunk mask, exactly spd.model.layers' attention. With a tensor `start`: the mask over the
             whole cache is built on the device (no host read), fp32 math.
  triton     program (kv head, key split, block of (row, query head) pairs): every key block is
             read once for all rows and the G = H / KVH heads sharing it, both products on the
             tensor cores (tl.dot), online softmax over keys up to start + row (read on the
             device), fp32 statistics and accumulation. On a GPU the keys are split
             (flash-decoding); the split is fixed by the cache capacity, not the position, so
             graphs replay anywhere, and a second launch merges the splits that hold keys in a
             fixed order. One rounding to the cache dtype. Output [R, H * head_dim], ready for
             o_proj.
  cuda       csrc/kernels/attention.cu, bf16 / fp16, head_dim 64 or 128: block (kv head, key split, up
             to 64 pairs), 32-key tiles through shared memory (the next tile's loads in flight),
             scores on tensor cores with the q and K pieces as fragments as loaded, online softmax
             a warp per pair, P V in fp32 FMAs; the same split-and-merge plan as Triton's.
             Registered on request only (backend="cuda", SPD_BACKEND=cache_attention=cuda) until
             a GPU has timed it against Triton.
The output projection + residual, RMSNorm + SwiGLU MLP + residual and the final RMSNorm + LM
head are spd_kernels.linear's fused_linear / fused_swiglu (dispatched the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, pdl, tl, triton
from spd_kernels.checks import (
    SPDInputError,
    check_kernel_float,
    check_tensor,
    check_values_enabled,
    last_dim_contiguous,
)
from spd_kernels.linear import _supports as linear_kernel_supports
from spd_kernels.linear import cuda_launch as linear_cuda_launch
from spd_kernels.linear import fused_linear, fused_swiglu, rms_norm
from spd_kernels.linear import launch as linear_launch

if HAS_TRITON:
    from spd_kernels._triton import pdl_enter, round_to


@dataclass
class LayerWeights:
    """One Qwen3-style decoder layer as plain tensors ([out, in] linear weights)."""
    input_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: torch.Tensor
    post_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor

    @classmethod
    def from_module(cls, layer) -> "LayerWeights":
        """From a layer with Llama/Qwen3 attribute names (spd.draft.pdm's layers, HF layers)."""
        a, m = layer.self_attn, layer.mlp
        qn = getattr(a, "q_norm", None)
        kn = getattr(a, "k_norm", None)
        return cls(layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight,
                   a.v_proj.weight, None if qn is None else qn.weight,
                   None if kn is None else kn.weight, a.o_proj.weight,
                   layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                   m.down_proj.weight)


@dataclass
class PDMWeights:
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor          # [Vd, hidden]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def from_pdm(cls, pdm) -> "PDMWeights":
        c = pdm.config
        return cls([LayerWeights.from_module(layer) for layer in pdm.layers], pdm.norm.weight,
                   pdm.lm_head.weight, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_eps)


def pack_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor):
    """Copies of wq, wk, wv as consecutive views of one buffer: the Triton qkv_rope_append then
    streams the three as one [Nq + Nk + Nv, D] product (one launch, a wider N to split)."""
    buf = torch.cat([wq, wk, wv]).contiguous()
    nq, nk = wq.shape[0], wk.shape[0]
    return buf[:nq], buf[nq:nq + nk], buf[nq + nk:]


def packed_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor) -> torch.Tensor | None:
    """The [Nq + Nk + Nv, D] view over wq, wk, wv when they lie back to back in one storage (as
    pack_qkv leaves them), else None."""
    if not (wq.is_contiguous() and wk.is_contiguous() and wv.is_contiguous()):
        return None
    if wq.untyped_storage().data_ptr() != wk.untyped_storage().data_ptr() or \
            wk.untyped_storage().data_ptr() != wv.untyped_storage().data_ptr():
        return None
    el = wq.element_size()
    if wk.data_ptr() != wq.data_ptr() + wq.numel() * el or \
            wv.data_ptr() != wk.data_ptr() + wk.numel() * el:
        return None
    n = wq.shape[0] + wk.shape[0] + wv.shape[0]
    return wq.as_strided((n, wq.shape[1]), (wq.shape[1], 1))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _check_start(start, rows: int, capacity: int, device) -> int | None:
    """Check a chunk's first position (int, or int64 tensor of one element on `device`) against
    a cache of `capacity` positions; returns it when its value could be read without a host
    synchronisation (see check_values_enabled), else None."""
    if isinstance(start, torch.Tensor):
        check_tensor("start", start, dtype=torch.int64, device=device)
        if start.numel() != 1:
            raise SPDInputError(f"start must hold one position, got shape {tuple(start.shape)}")
        first = int(start.reshape(-1)[0]) if check_values_enabled(start) else None
    else:
        first = int(start)
    if first is not None and (first < 0 or first + rows > capacity):
        raise SPDInputError(f"rows {first}..{first + rows - 1} do not fit a cache of "
                            f"{capacity} positions")
    return first


def _positions(start, rows: int, device) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start.reshape(-1)[:1].to(torch.int64) + torch.arange(rows, device=device)
    return torch.arange(start, start + rows, device=device)


# ------------------------------------------------------------------------------------------------
# qkv_rope_append
# ------------------------------------------------------------------------------------------------

def _check_qkv(x, norm_weight, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
               num_heads, num_kv_heads):
    check_tensor("x", x, dim=2, floating=True)
    dev = x.device
    T, d = x.shape
    for name, t in (("norm_weight", norm_weight), ("wq", wq), ("wk", wk), ("wv", wv),
                    ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, floating=True, device=dev)
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
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != hd:
        raise SPDInputError(f"cos and sin must be RoPE tables [positions, {hd}], got "
                            f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    first = _check_start(start, T, k_cache.shape[1], dev)
    if first is not None:
        if first + T > cos.shape[0]:
            raise SPDInputError(f"the RoPE tables cover {cos.shape[0]} positions, rows reach "
                                f"{first + T - 1}")


def qkv_rope_append(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache,
                    v_cache, num_heads, num_kv_heads, *, backend=None) -> torch.Tensor:
    """Rows x [T, d] at positions start..start+T-1 -> q [num_heads, T, head_dim] (RMSNorm'd input,
    per-head q/k RMSNorm when q_norm/k_norm are given, RoPE from the full tables cos/sin
    [P, head_dim] at those positions). Writes the rows' k (with RoPE) and v into k_cache/v_cache
    [num_kv_heads, S, head_dim] at the same positions. `start` is an int or an int64 tensor."""
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        if not isinstance(start, torch.Tensor):
            start = torch.tensor(int(start), dtype=torch.int64, device=x.device)
        return torch.ops.spd.qkv_rope_append(x, norm_weight, float(eps), wq, wk, wv, q_norm,
                                             k_norm, cos, sin, start, k_cache, v_cache,
                                             int(num_heads), int(num_kv_heads))
    _check_qkv(x, norm_weight, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache, v_cache,
               num_heads, num_kv_heads)
    return dispatch.call("qkv_rope_append", x.device, x, norm_weight, float(eps), wq, wk, wv,
                         q_norm, k_norm, cos, sin, start, k_cache, v_cache, int(num_heads),
                         int(num_kv_heads), backend=backend)


@dispatch.register("qkv_rope_append", "reference")
def qkv_rope_append_reference(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                              k_cache, v_cache, num_heads, num_kv_heads):
    T = x.shape[0]
    hd = k_cache.shape[2]
    h = rms_norm(x, norm_weight, eps)
    q = F.linear(h, wq).view(T, num_heads, hd)
    k = F.linear(h, wk).view(T, num_kv_heads, hd)
    v = F.linear(h, wv).view(T, num_kv_heads, hd)
    if q_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    pos = _positions(start, T, x.device)
    c, s = cos[pos], sin[pos]
    q = q.transpose(0, 1)
    k = k.transpose(0, 1)
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache[:, pos] = k.to(k_cache.dtype)
    v_cache[:, pos] = v.transpose(0, 1).to(v_cache.dtype)
    return q.contiguous()


def _qkv_supports(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache,
                  v_cache, num_heads, num_kv_heads):
    hd = k_cache.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim, got {hd}"
    named = [("x", x), ("norm_weight", norm_weight), ("wq", wq), ("wk", wk), ("wv", wv),
             ("cos", cos), ("sin", sin), ("k_cache", k_cache), ("v_cache", v_cache)]
    named += [(n, t) for n, t in (("q_norm", q_norm), ("k_norm", k_norm)) if t is not None]
    why = linear_kernel_supports(x, ())  # the projections run fused_linear's kernel: its limits
    if why:
        return why
    for name, t in named:
        if t.dtype != x.dtype:
            return (f"the kernel needs every tensor in one dtype (x is {x.dtype}, {name} is "
                    f"{t.dtype})")
        why = last_dim_contiguous(name, t)
        if why:
            return why
    for name, t in (("wq", wq), ("wk", wk), ("wv", wv), ("k_cache", k_cache),
                    ("v_cache", v_cache)):
        if not t.is_contiguous():
            return f"{name} must be contiguous"
    return None


if HAS_TRITON:

    @triton.jit
    def _qk_rope_append_kernel(qp_ptr, stride_qp, kp_ptr, stride_kp, vp_ptr, stride_vp, qn_ptr,
                               kn_ptr, cos_ptr, sin_ptr, stride_cs, start_ptr, q_ptr, kc_ptr,
                               vc_ptr, T, H, KVH, S, eps,
                               HD: tl.constexpr, QK_NORM: tl.constexpr, R: tl.constexpr,
                               PDL: tl.constexpr):
        """Program (t, j) on the projections q [T, H*HD], k, v [T, KVH*HD] (row strides given;
        already rounded to the model dtype, code R): j < H: query head j; then H..H+KVH-1 key
        heads; then value heads.
        Per-head RMSNorm and RoPE in registers, rounded op by op where the reference rounds; q
        goes out, k and v straight into the caches at position start + t (read on the device;
        rows past the cache capacity are dropped)."""
        pdl_enter(PDL)
        HALF: tl.constexpr = HD // 2
        t = tl.program_id(0)
        j = tl.program_id(1)
        pos = tl.load(start_ptr).to(tl.int64) + t
        half = tl.arange(0, HALF)
        if j < H:
            src = qp_ptr + t.to(tl.int64) * stride_qp + j * HD
        elif j < H + KVH:
            src = kp_ptr + t.to(tl.int64) * stride_kp + (j - H) * HD
        else:
            src = vp_ptr + t.to(tl.int64) * stride_vp + (j - H - KVH) * HD
        lo = tl.load(src + half).to(tl.float32)
        hi = tl.load(src + HALF + half).to(tl.float32)
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


def _project(x, w, norm_weight, eps):
    """rms_norm(x) @ w.T for the Triton QKV step. On a GPU it goes through fused_linear's
    dispatch, so use_backend(fused_linear="cuda") (or SPD_BACKEND) moves these products to the
    CUDA kernel with the others; in the interpreter it is the Triton kernel."""
    if x.device.type == "cuda":
        return fused_linear(x, w, norm_weight=norm_weight, eps=eps)
    return linear_launch(x, w, None, norm_weight, eps)


def _start_tensor(start, device) -> torch.Tensor:
    """start as the int64 tensor of one element the kernels read on the device."""
    if not isinstance(start, torch.Tensor):
        return torch.tensor([int(start)], dtype=torch.int64, device=device)
    return start.reshape(1)


def _qkv_products(x, norm_weight, eps, wq, wk, wv, project):
    """(q, k, v) projections of rms_norm(x) through project(x, w, norm_weight, eps): one product
    over the packed weights when they lie back to back (then views of its columns), else three."""
    qkv = packed_qkv(wq, wk, wv)
    if qkv is None:
        return tuple(project(x, w, norm_weight, eps) for w in (wq, wk, wv))
    y = project(x, qkv, norm_weight, eps)
    nq, nk = wq.shape[0], wk.shape[0]
    return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]


@dispatch.register("qkv_rope_append", "triton", supports=_qkv_supports)
def qkv_rope_append_triton(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                           k_cache, v_cache, num_heads, num_kv_heads):
    # The projections are the fused RMSNorm + linear kernel (each weight tile read once for all
    # rows, split over K to fill the GPU); a program per (row, head) then does the per-head norm,
    # RoPE and cache append. A program per (row, head) that also did the product read every
    # weight once per row: 9 rows cost 33x the weight-read floor on an H200.
    T, D = x.shape
    kvh, S, hd = k_cache.shape
    q = _alloc.empty(num_heads, T, hd, dtype=x.dtype, device=x.device)
    if T == 0:
        return q
    start = _start_tensor(start, x.device)
    qp, kp, vp = _qkv_products(x, norm_weight, eps, wq, wk, wv, _project)
    programmatic = pdl(x.device)
    _qk_rope_append_kernel[(T, num_heads + 2 * num_kv_heads)](
        qp, qp.stride(0), kp, kp.stride(0), vp, vp.stride(0),
        q_norm if q_norm is not None else norm_weight,
        k_norm if k_norm is not None else norm_weight, cos, sin, cos.stride(0), start, q,
        k_cache, v_cache, T, num_heads, num_kv_heads, S, eps, HD=hd,
        QK_NORM=q_norm is not None, R=dtype_code(x.dtype), num_warps=1 if INTERPRET else 2,
        PDL=programmatic, launch_pdl=programmatic)
    return q


CUDA_ROPE_MAX_HEAD_DIM = 256  # a thread per pair of RoPE elements, one block per head


def _qkv_cuda_supports(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start, k_cache,
                       v_cache, num_heads, num_kv_heads):
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


def _project_cuda(x, w, norm_weight, eps):
    return linear_cuda_launch(x, w, None, norm_weight, eps)


@dispatch.register("qkv_rope_append", "cuda", supports=_qkv_cuda_supports, automatic=False)
def qkv_rope_append_cuda(x, norm_weight, eps, wq, wk, wv, q_norm, k_norm, cos, sin, start,
                         k_cache, v_cache, num_heads, num_kv_heads):
    # The products on linear.cu's tensor-core kernel (packed into one when the weights lie back
    # to back), then csrc/kernels/rope_append.cu, a block per (row, head): per-head norm, RoPE, append.
    T = x.shape[0]
    kvh, S, hd = k_cache.shape
    q = _alloc.empty(num_heads, T, hd, dtype=x.dtype, device=x.device)
    if T == 0:
        return q
    start = _start_tensor(start, x.device)
    qp, kp, vp = _qkv_products(x, norm_weight, eps, wq, wk, wv, _project_cuda)
    ptr = lambda t: 0 if t is None else t.data_ptr()
    _cuda.ext().rope_append(
        qp.data_ptr(), qp.stride(0), kp.data_ptr(), kp.stride(0), vp.data_ptr(), vp.stride(0),
        ptr(q_norm), ptr(k_norm), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        start.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), T, num_heads,
        num_kv_heads, S, cos.shape[0], hd, float(eps), dtype_code(x.dtype), _cuda.stream_of(x))
    return q


# ------------------------------------------------------------------------------------------------
# cache_attention
# ------------------------------------------------------------------------------------------------

def _check_attention(q, k_cache, v_cache, start, scale):
    check_tensor("q", q, dim=3, floating=True)
    dev = q.device
    check_tensor("k_cache", k_cache, dim=3, floating=True, device=dev)
    check_tensor("v_cache", v_cache, dim=3, floating=True, device=dev)
    H, R, hd = q.shape
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise SPDInputError(f"k_cache and v_cache must have one shape and dtype, got "
                            f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} "
                            f"{v_cache.dtype}")
    kvh, S, chd = k_cache.shape
    if chd != hd:
        raise SPDInputError(f"q has head_dim {hd} but the caches [num_kv_heads, S, head_dim] "
                            f"have head_dim {chd}")
    if kvh <= 0 or H <= 0 or H % kvh:
        raise SPDInputError(f"q's heads ({H}) must be a positive multiple of the caches' kv "
                            f"heads ({kvh}) (grouped-query attention)")
    if scale is not None and not (isinstance(scale, (int, float)) and float(scale) > 0):
        raise SPDInputError(f"scale must be a positive float or None, got {scale!r}")
    _check_start(start, R, S, dev)


def cache_attention(q, k_cache, v_cache, start, scale=None, *, backend=None) -> torch.Tensor:
    """Attention of a chunk of rows against a KV cache that already holds them.

    q [H, R, head_dim]: the rows' queries (RoPE applied), row r at position start + r.
    k_cache, v_cache [KVH, S, head_dim]: keys/values, rows start..start+R-1 already written (e.g.
    by qkv_rope_append); H must be a multiple of KVH (query head h reads kv head h // (H/KVH)).
    start: an int, or an int64 tensor with one element (shape [] or [1]) on q's device, read on
    the device by the kernel: no host synchronisation, so a CUDA graph can replay the call at
    any position. Row r attends to cache positions 0..start+r (causal inside the chunk).
    scale: softmax scale, default 1/sqrt(head_dim).

    Returns [R, H * head_dim] in the caches' dtype (heads concatenated, ready for o_proj).
    """
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        if not isinstance(start, torch.Tensor):
            start = torch.tensor(int(start), dtype=torch.int64, device=q.device)
        return torch.ops.spd.cache_attention(q, k_cache, v_cache, start,
                                             None if scale is None else float(scale))
    _check_attention(q, k_cache, v_cache, start, scale)
    if not isinstance(start, torch.Tensor):
        start = int(start)
    scale = None if scale is None else float(scale)
    return dispatch.call("cache_attention", q.device, q, k_cache, v_cache, start, scale,
                         backend=backend)


@dispatch.register("cache_attention", "reference")
def cache_attention_reference(q, k_cache, v_cache, start, scale):
    """Two paths with the same result (up to rounding):
    - start an int: exactly spd.model.layers.attention_step's attention (SDPA over cache rows
      [0, start + R) with the causal chunk mask), so the runtime's PDM step is unchanged bit for
      bit on the reference backend;
    - start a tensor: the mask over all S cache positions is built on the device (no .item()),
      math in fp32; rows at or past start + R are zeroed first, so whatever an unwritten cache
      holds (NaN poison) cannot leak through a zero softmax weight."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    if R == 0:
        return q.new_empty(0, H * hd, dtype=k_cache.dtype)
    if not isinstance(start, torch.Tensor):
        end = start + R
        mask = None
        if R > 1:
            mask = (torch.arange(end, device=q.device)[None, :]
                    <= torch.arange(start, end, device=q.device)[:, None])
        out = F.scaled_dot_product_attention(q[None].to(k_cache.dtype), k_cache[None, :, :end],
                                             v_cache[None, :, :end], attn_mask=mask,
                                             enable_gqa=H != kvh, scale=scale)
        return out[0].transpose(0, 1).reshape(R, H * hd)
    g = H // kvh
    qpos = _positions(start, R, q.device)                      # [R]
    kpos = torch.arange(S, device=q.device)                    # [S]
    allowed = kpos[None, :] <= qpos[:, None]                   # [R, S]
    written = (kpos <= qpos[-1])[:, None]                      # [S, 1]
    k = torch.where(written, k_cache.float(), 0.0)             # [KVH, S, hd]
    v = torch.where(written, v_cache.float(), 0.0)
    qf = q.float().view(kvh, g, R, hd)
    scores = torch.matmul(qf, k[:, None].transpose(-1, -2))   # [KVH, g, R, S]
    scores = scores * (hd ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v[:, None])  # [KVH, g, R, hd]
    return out.reshape(H, R, hd).transpose(0, 1).reshape(R, H * hd).to(k_cache.dtype)


def _attention_supports(q, k_cache, v_cache, start, scale):
    hd = q.shape[2]
    if hd != next_pow2(hd):
        return f"the kernel needs a power-of-two head_dim (tl.arange), got {hd}"
    return check_kernel_float("k_cache", k_cache) or _attention_layout(q, k_cache, v_cache)


def _attention_layout(q, k_cache, v_cache, *, pieces16: bool = False):
    """None when both kernels' layout needs hold (pieces16: rows read in 16-byte pieces, as the
    CUDA kernel does), else why not."""
    if q.dtype != k_cache.dtype:
        return f"the kernel needs q in the caches' dtype (q is {q.dtype}, caches {k_cache.dtype})"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        why = last_dim_contiguous(name, t)
        if why:
            return why
        if pieces16 and (t.data_ptr() % 16 or t.stride(0) % 8 or t.stride(1) % 8):
            return (f"the CUDA kernel reads {name} in 16-byte pieces: it must start on a 16-byte "
                    f"boundary with rows a multiple of 8 elements apart")
    if k_cache.stride() != v_cache.stride():
        return (f"the kernel needs k_cache and v_cache with the same strides (got "
                f"{k_cache.stride()} and {v_cache.stride()})")
    return None


def _attention_blocks(hd: int, S: int) -> int:
    """Keys per block of the loop (BLOCK_N)."""
    if INTERPRET:  # few, large numpy steps
        return min(128, max(16, next_pow2(S)))
    return 64 if hd <= 128 else 32


def _attention_block_m(rows_x_group: int) -> int:
    """(row, query head) pairs per program: tl.dot needs at least 16; 64 bounds the registers."""
    return min(64, max(16, next_pow2(rows_x_group)))


if HAS_TRITON:

    @triton.jit
    def _attention_rows_end(start, mb, R, G, S, BLOCK_M: tl.constexpr):
        """One past the last key any pair of m-block mb may see: start + its last row + 1."""
        last_row = (tl.minimum((mb + 1) * BLOCK_M, R * G) - 1) // G
        return tl.minimum(start + last_row + 1, S)

    @triton.jit
    def _cache_attention_kernel(q_ptr, stride_qh, stride_qr, k_ptr, v_ptr, stride_ch, stride_cs,
                                start_ptr, out_ptr, stride_or, ws_ptr, R, S, G, SPLITS, CHUNK,
                                scale_log2, HD: tl.constexpr, HD_PAD: tl.constexpr,
                                BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, OUT: tl.constexpr,
                                PARTIAL: tl.constexpr, IEEE: tl.constexpr,
                                UPCAST: tl.constexpr, PDL: tl.constexpr):
        """Program (j, s, mb): kv head j, keys s*CHUNK.., and BLOCK_M (row, query head) pairs
        m = row * G + g of the G query heads sharing j, so every key block is read once for all
        rows and heads and both products run on the tensor cores (tl.dot; fp32 caches in IEEE
        fp32). Row r sees keys 0..start + r (start read on the device). Online softmax in base 2,
        fp32 statistics and accumulator; p meets v in tf32 (bf16/fp16 caches: v exact, p to 10
        bits). One split: one rounding to the output dtype (code OUT). PARTIAL: the split's
        unnormalised output, running max and sum go to the workspace slot
        ((j * SPLITS + s) * M_TOTAL + m) * (HD + 2) for _attention_combine_kernel; splits past
        the block's last position write nothing (the combine never reads them)."""
        pdl_enter(PDL)
        j = tl.program_id(0)
        sp = tl.program_id(1)
        mb = tl.program_id(2)
        start = tl.load(start_ptr).to(tl.int32)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < R * G
        r = m // G
        heads = (j * G + m % G).to(tl.int64)
        pos = start + r
        end = _attention_rows_end(start, mb, R, G, S, BLOCK_M)
        lo = sp * CHUNK
        hi = tl.minimum(end, lo + CHUNK)
        d = tl.arange(0, HD_PAD)  # head_dim padded to the dot's minimum of 16
        dmask = d < HD
        q = tl.load(q_ptr + heads[:, None] * stride_qh + r[:, None].to(tl.int64) * stride_qr
                    + d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HD_PAD], dtype=tl.float32)
        kv_head = k_ptr + j.to(tl.int64) * stride_ch
        vv_head = v_ptr + j.to(tl.int64) * stride_ch
        for n0 in range(lo, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < hi
            offs = n[:, None].to(tl.int64) * stride_cs + d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(kv_head + offs, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            elif UPCAST:  # the interpreter's dot mishandles bf16; tf32 holds bf16/fp16 exactly
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="tf32")
            else:
                s = tl.dot(q, tl.trans(k))  # bf16/fp16 products are exact in fp32
            s = s * scale_log2
            seen = (n[None, :] <= pos[:, None]) & nmask[None, :] & mmask[:, None]
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vv_head + offs, mask=kv_mask, other=0.0).to(tl.float32)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v, input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if PARTIAL:
            keep = mmask & (lo < end)
            slot = ws_ptr + ((j * SPLITS + sp).to(tl.int64) * (R * G) + m) * (HD + 2)
            tl.store(slot[:, None] + d[None, :], acc, mask=keep[:, None] & dmask[None, :])
            tl.store(slot + HD, m_i, mask=keep)
            tl.store(slot + HD + 1, l_i, mask=keep)
        else:
            out = round_to(acc / tl.where(l_i > 0, l_i, 1.0)[:, None], OUT)
            tl.store(out_ptr + r[:, None].to(tl.int64) * stride_or + heads[:, None] * HD
                     + d[None, :], out, mask=mmask[:, None] & dmask[None, :])

    @triton.jit
    def _attention_combine_kernel(ws_ptr, start_ptr, out_ptr, stride_or, R, S, G, SPLITS, CHUNK,
                                  HD: tl.constexpr, HD_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                                  OUT: tl.constexpr, PDL: tl.constexpr):
        """Program (m, j): merges, for (row, query head) pair m of kv head j, the splits that hold
        its keys (those below its position + 1, found from start on the device), BLOCK_S splits
        a load, in a fixed order (deterministic): rescale each by 2^(m_s - M), sum, divide by the
        summed l, round once. A program per pair, not per block of pairs: the merge is a few
        wide loads, not a serial walk over the splits."""
        pdl_enter(PDL)
        m = tl.program_id(0)  # pairs on the first grid axis: it takes more than 65535
        j = tl.program_id(1)
        start = tl.load(start_ptr).to(tl.int32)
        r = m // G
        used = tl.cdiv(tl.minimum(start + r + 1, S), CHUNK)
        d = tl.arange(0, HD_PAD)
        dmask = d < HD
        sp = tl.arange(0, BLOCK_S)
        base = ws_ptr + (j.to(tl.int64) * SPLITS * (R * G) + m) * (HD + 2)
        step = (R * G) * (HD + 2)  # from one split's slot to the next's
        m_all = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
        for s0 in range(0, used, BLOCK_S):
            slots = base + (s0 + sp).to(tl.int64) * step
            m_all = tl.maximum(m_all, tl.load(slots + HD, mask=s0 + sp < used,
                                              other=float("-inf")))
        m_top = tl.max(m_all, axis=0)
        l_all = tl.zeros([BLOCK_S], dtype=tl.float32)
        acc = tl.zeros([BLOCK_S, HD_PAD], dtype=tl.float32)
        for s0 in range(0, used, BLOCK_S):
            smask = s0 + sp < used
            slots = base + (s0 + sp).to(tl.int64) * step
            m_s = tl.load(slots + HD, mask=smask, other=float("-inf"))
            w = tl.where(m_s > float("-inf"), tl.exp2(m_s - m_top), 0.0)  # no key there: 0
            l_all += tl.load(slots + HD + 1, mask=smask, other=0.0) * w
            acc += tl.load(slots[:, None] + d[None, :], mask=smask[:, None] & dmask[None, :],
                           other=0.0) * w[:, None]
        l_sum = tl.sum(l_all, axis=0)
        out = round_to(tl.sum(acc, axis=0) / tl.where(l_sum > 0, l_sum, 1.0), OUT)
        head = (j * G + m % G).to(tl.int64)
        tl.store(out_ptr + r.to(tl.int64) * stride_or + head * HD + d, out, mask=dmask)


def attention_splits(rows: int, kv_heads: int, S: int, block_n: int, device,
                     splits: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) over the cache capacity S. The split is fixed by S, not by the
    position (which may live on the device), so one CUDA graph serves every position; splits
    past the rows' positions exit at once and the combine never reads them. Default: one split
    on CPU, else up to 64 splits of at least one key block (short key loops per program; the
    programs holding keys, kv_heads x used splits, spread over the SMs)."""
    if splits is None:
        splits = 1 if device.type != "cuda" else 64
    return _key_splits(S, block_n, splits)


def _key_splits(S: int, unit: int, splits: int) -> tuple[int, int]:
    """(splits, keys per split): S keys cut into at most `splits` ranges of whole `unit`s."""
    units = -(-S // unit)
    chunk = -(-units // max(1, min(int(splits), units))) * unit
    return -(-S // chunk), chunk


def _attention_out(q, k_cache):
    """The attention's output [R, H * head_dim] in the caches' dtype (poisoned under test)."""
    H, R, hd = q.shape
    return _alloc.empty(R, H * hd, dtype=k_cache.dtype, device=q.device)


def attention_launch(q, k_cache, v_cache, start, scale, *, splits: int | None = None):
    """The Triton cache attention (see cache_attention); `splits` forces the key split."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    out = _attention_out(q, k_cache)
    if R == 0:
        return out
    start = _start_tensor(start, q.device)
    group = H // kvh
    block_n = _attention_blocks(hd, S)
    block_m = _attention_block_m(R * group)
    n_mb = triton.cdiv(R * group, block_m)
    n_splits, chunk = attention_splits(R, kvh, S, block_n, q.device, splits)
    partial = n_splits > 1
    ws = (torch.empty(kvh * n_splits * R * group * (hd + 2), dtype=torch.float32,
                      device=q.device) if partial else out)
    scale = hd ** -0.5 if scale is None else scale
    warps = 1 if INTERPRET else 4
    out_code = dtype_code(k_cache.dtype)
    programmatic = pdl(q.device)
    _cache_attention_kernel[(kvh, n_splits, n_mb)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        start, out, out.stride(0), ws, R, S, group, n_splits, chunk, scale * 1.4426950408889634,
        HD=hd, HD_PAD=max(16, hd), BLOCK_M=block_m, BLOCK_N=block_n, OUT=out_code,
        PARTIAL=partial,
        IEEE=k_cache.dtype == torch.float32, UPCAST=INTERPRET, num_warps=warps,
        PDL=programmatic, launch_pdl=programmatic)
    if partial:
        _attention_combine_kernel[(R * group, kvh)](
            ws, start, out, out.stride(0), R, S, group, n_splits, chunk, HD=hd,
            HD_PAD=max(16, hd), BLOCK_S=min(16, next_pow2(n_splits)), OUT=out_code,
            num_warps=1 if INTERPRET else 2, PDL=programmatic, launch_pdl=programmatic)
    return out


@dispatch.register("cache_attention", "triton", supports=_attention_supports)
def cache_attention_triton(q, k_cache, v_cache, start, scale):
    return attention_launch(q, k_cache, v_cache, start, scale)


# ------------------------------------------------------------------------------------------------
# cache_attention on the CUDA kernel (csrc/kernels/attention.cu)
# ------------------------------------------------------------------------------------------------

CUDA_ATTENTION_TILE = 32             # keys per tile (kTile in attention.cu)
CUDA_ATTENTION_PAIRS = 64            # (row, query head) pairs per block (kMaxPairs)
CUDA_ATTENTION_HEAD_DIMS = (64, 128)  # the kernel's instantiations


def _attention_cuda_supports(q, k_cache, v_cache, start, scale):
    hd = q.shape[2]
    if k_cache.dtype not in (torch.bfloat16, torch.float16):
        return (f"the CUDA kernel runs bf16 / fp16 caches (scores on tensor cores), got "
                f"{k_cache.dtype} (the Triton kernel takes fp32)")
    if hd not in CUDA_ATTENTION_HEAD_DIMS:
        return f"the CUDA kernel is built for head_dim 64 or 128, got {hd}"
    return _attention_layout(q, k_cache, v_cache, pieces16=True)


def attention_cuda_plan(kv_heads: int, pairs: int, S: int, device,
                        splits: int | None = None) -> tuple[int, int]:
    """(splits, keys per split) of the CUDA kernel over the cache capacity S (not the position,
    so one graph serves every position): about four blocks per SM when the cache is full, each
    split a whole number of 32-key tiles."""
    if splits is None:
        blocks_z = -(-pairs // CUDA_ATTENTION_PAIRS)
        splits = round(4 * _cuda.multiprocessors(device) / (kv_heads * blocks_z))
    return _key_splits(S, CUDA_ATTENTION_TILE, splits)


def attention_cuda_launch(q, k_cache, v_cache, start, scale, *, splits: int | None = None):
    """The CUDA cache attention (see cache_attention); `splits` forces the key split."""
    H, R, hd = q.shape
    kvh, S, _ = k_cache.shape
    out = _attention_out(q, k_cache)
    if R == 0:
        return out
    start = _start_tensor(start, q.device)
    group = H // kvh
    n_splits, chunk = attention_cuda_plan(kvh, R * group, S, q.device, splits)
    ws = (_alloc.empty(kvh * n_splits * R * group * (hd + 2), dtype=torch.float32,
                       device=q.device) if n_splits > 1 else None)
    scale = hd ** -0.5 if scale is None else scale
    _cuda.ext().cache_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), start.data_ptr(), out.data_ptr(), out.stride(0),
        0 if ws is None else ws.data_ptr(), H, R, kvh, S, hd, n_splits, chunk,
        float(scale) * 1.4426950408889634, dtype_code(k_cache.dtype), _cuda.stream_of(q))
    return out


@dispatch.register("cache_attention", "cuda", supports=_attention_cuda_supports,
                   automatic=False)
def cache_attention_cuda(q, k_cache, v_cache, start, scale):
    return attention_cuda_launch(q, k_cache, v_cache, start, scale)


# ------------------------------------------------------------------------------------------------
# The whole step
# ------------------------------------------------------------------------------------------------

def pdm_step(features: torch.Tensor, weights: PDMWeights, k_cache: torch.Tensor,
             v_cache: torch.Tensor, start, cos: torch.Tensor, sin: torch.Tensor, *,
             backend: str | None = None) -> torch.Tensor:
    """Rows features [T, hidden] at positions start.. through every layer -> draft logits of the
    last row [Vd] (fp32). k_cache/v_cache [layers, kv_heads, S, head_dim] get the rows' keys and
    values; cos/sin are the full RoPE tables. `backend` picks the backend of every op of the step
    (qkv_rope_append, cache_attention, fused_linear, fused_swiglu; None: the dispatcher's
    choice). `start` is an int, or an int64 tensor of one element: with a tensor nothing in the
    step reads the position on the host (a CUDA graph of it replays at any position)."""
    H, KVH = weights.num_heads, weights.num_kv_heads
    if not isinstance(start, torch.Tensor):
        start = int(start)
    x = features
    for i, lw in enumerate(weights.layers):
        q = qkv_rope_append(x, lw.input_norm, weights.eps, lw.wq, lw.wk, lw.wv, lw.q_norm,
                            lw.k_norm, cos, sin, start, k_cache[i], v_cache[i], H, KVH,
                            backend=backend)
        att = cache_attention(q, k_cache[i], v_cache[i], start, backend=backend)
        x = fused_linear(att, lw.wo, residual=x, backend=backend)
        mid = fused_swiglu(x, lw.post_norm, weights.eps, lw.w_gate, lw.w_up, backend=backend)
        x = fused_linear(mid, lw.w_down, residual=x, backend=backend)
    return fused_linear(x[-1:], weights.lm_head, norm_weight=weights.final_norm, eps=weights.eps,
                        backend=backend)[0].float()
