"""Anchor-feature aggregation: the PDM input of every row from the target's anchor hidden states.

Row r has aggregation type e(r) (how many anchors its depth makes available, minus one). Its
feature is P_e([h_{b_0}[r]; ...; h_{b_e}[r]]) = sum_{j<=e} W_{e,j} h_{b_j}[r] + bias_e, where
W_{e,j} is the j-th column block of the type-e projection. Rows of different types may be mixed in
one call (the depth staircase of the in-flight window).

Backends (see spd_kernels.dispatch):
  reference  one GEMM per (type present, anchor) on the rows of that type.
  triton     one launch for all rows whatever their types: program (n-block, row) reads the row's
             type on the device, finds W_e through a table of weight pointers and accumulates
             sum_j W_{e,j} h_{b_j}[r] in fp32, reading the anchors in place through their strides
             (the concat is never built) and rounding once at the end.
  cuda       the same plan in C++ (csrc/features.cu).
On device tensors the kernels write NaN for a row whose type is out of range or has no weight
(value checks there need a host sync; SPD_CHECK_VALUES=1 turns them on).
"""
from __future__ import annotations

from typing import Sequence

import torch

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, dtype_code, next_pow2, triton, tl
from spd_kernels.checks import (SPDInputError, check_kernel_float, check_tensor,
                                check_values_enabled, last_dim_contiguous)

if HAS_TRITON:
    from spd_kernels._triton import round_to


def _check(anchors, types, weights, biases):
    check_tensor("anchors", anchors, dim=3, floating=True)
    check_tensor("types", types, dim=1)
    m, rows, d = anchors.shape
    if types.shape[0] != rows:
        raise SPDInputError(f"types has {types.shape[0]} rows but anchors has {rows}")
    if types.dtype not in (torch.int32, torch.int64):
        raise SPDInputError(f"types must be an integer tensor, got {types.dtype}")
    if types.device != anchors.device:
        raise SPDInputError(f"types is on {types.device} but anchors on {anchors.device}")
    if len(weights) != m:
        raise SPDInputError(f"expected one weight slot per anchor ({m}), got {len(weights)}")
    if biases is not None and len(biases) != m:
        raise SPDInputError(f"expected one bias slot per anchor ({m}), got {len(biases)}")
    d_out = None
    for e, w in enumerate(weights):  # shapes of every slot: no host sync needed
        if w is None:
            continue
        check_tensor(f"weights[{e}]", w, dim=2, floating=True, device=anchors.device)
        if w.shape[1] != (e + 1) * d:
            raise SPDInputError(
                f"weights[{e}] must have {(e + 1) * d} input columns ((e+1)*hidden), got {w.shape[1]}")
        if d_out is not None and w.shape[0] != d_out:
            raise SPDInputError(f"weights[{e}] has {w.shape[0]} output rows, the others {d_out}")
        d_out = w.shape[0]
        if biases is not None and biases[e] is not None:
            check_tensor(f"biases[{e}]", biases[e], floating=True, device=anchors.device)
            if biases[e].shape != (w.shape[0],):
                raise SPDInputError(f"biases[{e}] must have shape ({w.shape[0]},)")
    if rows and check_values_enabled(types):
        lo, hi = int(types.min()), int(types.max())
        if lo < 0 or hi >= m:
            raise SPDInputError(f"types must lie in [0, {m - 1}], got values in [{lo}, {hi}]")
        for e in types.unique().tolist():
            if weights[e] is None:
                raise SPDInputError(f"rows of aggregation type {e} present but no projection for it")


def anchor_projection(anchors: torch.Tensor, types: torch.Tensor,
                      weights: Sequence[torch.Tensor | None],
                      biases: Sequence[torch.Tensor | None] | None = None, *,
                      backend: str | None = None) -> torch.Tensor:
    """anchors [m, R, d] (row r's anchor j at anchors[j, r]), types [R] -> features [R, d_out].

    weights[e] is the type-e projection [d_out, (e+1)*d] (None for a type that never occurs),
    biases[e] its bias [d_out] or None.
    """
    weights = list(weights)
    biases = None if biases is None else list(biases)
    _check(anchors, types, weights, biases)
    return dispatch.call("anchor_projection", anchors.device, anchors, types, weights, biases,
                         backend=backend)


def _d_out(anchors, weights):
    present = [w for w in weights if w is not None]
    return present[0].shape[0] if present else anchors.shape[2]


@dispatch.register("anchor_projection", "reference")
def anchor_projection_reference(anchors, types, weights, biases=None):
    m, rows, d = anchors.shape
    out = anchors.new_empty(rows, _d_out(anchors, weights))
    for e in types.unique().tolist():
        sel = (types == e).nonzero(as_tuple=True)[0]
        w = weights[e]
        acc = None
        for j in range(e + 1):  # sum of column blocks: the concat is never built
            part = anchors[j, sel] @ w[:, j * d:(j + 1) * d].t()
            acc = part if acc is None else acc + part
        if biases is not None and biases[e] is not None:
            acc = acc + biases[e]
        out[sel] = acc.to(out.dtype)
    return out


def _kernel_supports(anchors, types, weights, biases=None):
    why = check_kernel_float("anchors", anchors) or last_dim_contiguous("anchors", anchors)
    if why:
        return why
    present = [(e, w) for e, w in enumerate(weights) if w is not None]
    if not present:
        return "no projection weights given"
    dt = present[0][1].dtype
    for e, w in present:
        if w.dtype != dt or not w.is_contiguous():
            return "the kernels need contiguous projection weights of one dtype"
        b = None if biases is None else biases[e]
        if b is not None and (b.dtype != dt or not b.is_contiguous()):
            return "the kernels need biases of the weights' dtype, contiguous"
    return check_kernel_float("weights", present[0][1])


_TABLES: dict = {}


def _tables(weights, biases, device):
    """int64 device tables of weight and bias addresses per type (0 = none), cached."""
    w_ptrs = tuple(0 if w is None else w.data_ptr() for w in weights)
    b_ptrs = tuple(0 if biases is None or b is None else b.data_ptr()
                   for b in (biases or [None] * len(weights)))
    key = (device, w_ptrs, b_ptrs)
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        t = torch.tensor([w_ptrs, b_ptrs], dtype=torch.int64).to(device)
        _TABLES[key] = t
    return t


if HAS_TRITON:

    @triton.jit
    def _anchor_kernel(a_ptr, stride_am, stride_ar, types_ptr, table_ptr, out_ptr, stride_or,
                       M, D, N, W_CODE: tl.constexpr, OUT_CODE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        e = tl.load(types_ptr + r).to(tl.int32)
        ec = tl.minimum(tl.maximum(e, 0), M - 1)
        w_addr = tl.load(table_ptr + ec)
        b_addr = tl.load(table_ptr + M + ec)
        ok = (e >= 0) & (e < M) & (w_addr != 0)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if ok:
            if W_CODE == 1:
                w_base = w_addr.to(tl.pointer_type(tl.bfloat16))
                b_base = b_addr.to(tl.pointer_type(tl.bfloat16))
            elif W_CODE == 2:
                w_base = w_addr.to(tl.pointer_type(tl.float16))
                b_base = b_addr.to(tl.pointer_type(tl.float16))
            else:
                w_base = w_addr.to(tl.pointer_type(tl.float32))
                b_base = b_addr.to(tl.pointer_type(tl.float32))
            k_row = (ec + 1).to(tl.int64) * D  # row length of W_e
            w_rows = w_base + n.to(tl.int64)[:, None] * k_row
            for j in range(0, ec + 1):
                a_row = a_ptr + j * stride_am + r * stride_ar
                for k0 in range(0, D, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)
                    kmask = k < D
                    a = tl.load(a_row + k, mask=kmask, other=0.0).to(tl.float32)
                    w = tl.load(w_rows + j * D + k[None, :], mask=nmask[:, None] & kmask[None, :],
                                other=0.0).to(tl.float32)
                    acc += tl.sum(w * a[None, :], axis=1)
            if b_addr != 0:
                acc += tl.load(b_base + n, mask=nmask, other=0.0).to(tl.float32)
        else:
            acc += float("nan")
        tl.store(out_ptr + r * stride_or + n, round_to(acc, OUT_CODE), mask=nmask)


@dispatch.register("anchor_projection", "triton", supports=_kernel_supports)
def anchor_projection_triton(anchors, types, weights, biases=None):
    m, rows, d = anchors.shape
    n_out = _d_out(anchors, weights)
    out = _alloc.empty(rows, n_out, dtype=anchors.dtype, device=anchors.device)
    if rows == 0:
        return out
    types = types.contiguous()
    w_dtype = next(w for w in weights if w is not None).dtype
    if INTERPRET:
        block_n, block_k, warps = min(next_pow2(n_out), 64), min(next_pow2(d), 256), 1
    else:
        block_k = min(next_pow2(d), 256)
        block_n, warps = max(16, min(64, 8192 // block_k)), 4
    _anchor_kernel[(triton.cdiv(n_out, block_n), rows)](
        anchors, anchors.stride(0), anchors.stride(1), types, _tables(weights, biases, anchors.device),
        out, out.stride(0), m, d, n_out, W_CODE=dtype_code(w_dtype),
        OUT_CODE=dtype_code(anchors.dtype), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


def _cuda_supports(anchors, types, weights, biases=None):
    why = _kernel_supports(anchors, types, weights, biases)
    if why:
        return why
    w = next(w for w in weights if w is not None)
    if w.dtype != anchors.dtype:
        return f"the CUDA kernel needs anchors and weights of one dtype ({anchors.dtype} vs {w.dtype})"
    return None


@dispatch.register("anchor_projection", "cuda", supports=_cuda_supports)
def anchor_projection_cuda(anchors, types, weights, biases=None):
    ext = _cuda.ext()
    m, rows, d = anchors.shape
    n_out = _d_out(anchors, weights)
    out = _alloc.empty(rows, n_out, dtype=anchors.dtype, device=anchors.device)
    if rows == 0:
        return out
    types = types.contiguous()
    table = _tables(weights, biases, anchors.device)
    # 16-byte vector loads need every row start aligned to 8 elements (32 bytes for fp32).
    addrs = [anchors.data_ptr()] + [w.data_ptr() for w in weights if w is not None]
    vec = (d % 8 == 0 and anchors.stride(0) % 8 == 0 and anchors.stride(1) % 8 == 0
           and all(a % 32 == 0 for a in addrs))
    ext.anchor_projection(anchors.data_ptr(), anchors.stride(0), anchors.stride(1),
                          types.data_ptr(), types.dtype == torch.int64, table.data_ptr(),
                          out.data_ptr(), out.stride(0), m, rows, d, n_out,
                          dtype_code(anchors.dtype), vec, _cuda.stream_of(anchors))
    return out
