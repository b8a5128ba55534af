"""Anchor-feature aggregation: the PDM input of every row from the target's anchor hidden states.

Row r has aggregation type e(r) (how many anchors its depth makes available, minus one). Its
feature is P_e([h_{b_0}[r]; ...; h_{b_e}[r]]) = sum_{j<=e} W_{e,j} h_{b_j}[r] + bias_e, where
W_{e,j} is the j-th column block of the type-e projection. Rows of different types may be mixed in
one call (the depth staircase of the in-flight window).

Backends (see spd_kernels.dispatch):
  reference  one GEMM per (type present, anchor) on the rows of that type.
  triton     one launch for all rows whatever their types: program (n-block, type e) finds the
             rows of type e on the device (types never go to the host), finds W_e through a table
             of weight pointers and streams its tile of W_e once for all of those rows (up to 16 at
             a time), accumulating sum_j W_{e,j} h_{b_j}[r] in fp32, reading the anchors in place
             through their strides (the concat is never built) and rounding once at the end. One
             more program class writes the NaN rows (below).
  cuda       the same plan in C++ (csrc/kernels/features.cu). SPD_ANCHOR_VARIANT=mma (bf16 / fp16)
             takes a tensor-core kernel instead: blocks of (64 columns, type and K split), each
             split an equal share of the weights, rows through mma.m16n8k16 (csrc/kernels/mma_stream.cuh),
             partial sums reduced in order with the bias by a second launch. Not timed on a GPU
             yet, so not the default.
Quantised projections (spd_kernels.quant; reference and Triton, not CUDA): weights[e] int8 or
float8_e4m3fn with scales[e] [d_out] fp32; the feature is round_to_anchor_dtype(scale_e * (sum_j
h_{b_j}[r] @ q_{e,j}^T summed in fp32) + bias_e) (the bias added in fp32, one rounding).
On device tensors the kernels write NaN for a row whose type is out of range or has no weight
(value checks there need a host sync; SPD_CHECK_VALUES=1 turns them on).
"""
from __future__ import annotations

from typing import Sequence

import torch

from spd_kernels import _alloc, _cuda, dispatch, env
from spd_kernels._host import dtype_code
from spd_kernels.checks import (
    SPDInputError,
    check_kernel_float,
    check_tensor,
    check_values_enabled,
    last_dim_contiguous,
)
from spd_kernels.opdef import op
from spd_kernels.quant import QUANT_DTYPES, check_weight


def _check(anchors, types, weights, biases, scales=None):
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
    if scales is not None and len(scales) != m:
        raise SPDInputError(f"expected one scale slot per anchor ({m}), got {len(scales)}")
    d_out = None
    for e, w in enumerate(weights):  # shapes of every slot: no host sync needed
        scale = None if scales is None else scales[e]
        if w is None:
            if scale is not None:
                raise SPDInputError(f"scales[{e}] is given but weights[{e}] is None")
            continue
        check_weight(f"weights[{e}]", w, f"scales[{e}]", scale, anchors.device)
        check_tensor(f"weights[{e}]", w, dim=2, floating=scale is None, device=anchors.device)
        if w.shape[1] != (e + 1) * d:
            raise SPDInputError(
                f"weights[{e}] must have {(e + 1) * d} input columns ((e+1)*hidden), got {w.shape[1]}")
        if d_out is not None and w.shape[0] != d_out:
            raise SPDInputError(f"weights[{e}] has {w.shape[0]} output rows, the others {d_out}")
        d_out = w.shape[0]
        if w.dtype != anchors.dtype and scale is None:
            raise SPDInputError(f"weights[{e}] has dtype {w.dtype} but anchors {anchors.dtype}: "
                                f"give every tensor one dtype")
        if biases is not None and biases[e] is not None:
            check_tensor(f"biases[{e}]", biases[e], floating=True, device=anchors.device)
            if biases[e].dtype != anchors.dtype:
                raise SPDInputError(f"biases[{e}] has dtype {biases[e].dtype} but anchors "
                                    f"{anchors.dtype}: give every tensor one dtype")
            if biases[e].shape != (w.shape[0],):
                raise SPDInputError(f"biases[{e}] must have shape ({w.shape[0]},)")
    if rows and check_values_enabled(types):
        lo, hi = int(types.min()), int(types.max())
        if lo < 0 or hi >= m:
            raise SPDInputError(f"types must lie in [0, {m - 1}], got values in [{lo}, {hi}]")
        for e in types.unique().tolist():
            if weights[e] is None:
                raise SPDInputError(f"rows of aggregation type {e} present but no projection for it")


@op("anchor_projection")
def anchor_projection(anchors: torch.Tensor, types: torch.Tensor,
                      weights: Sequence[torch.Tensor | None],
                      biases: Sequence[torch.Tensor | None] | None = None,
                      scales: Sequence[torch.Tensor | None] | None = None, *,
                      backend: str | None = None) -> torch.Tensor:
    """anchors [m, R, d] (row r's anchor j at anchors[j, r]), types [R] -> features [R, d_out].

    weights[e] is the type-e projection [d_out, (e+1)*d] (None for a type that never occurs),
    biases[e] its bias [d_out] or None. scales[e] [d_out] fp32: weights[e] is quantised (int8 /
    float8_e4m3fn, spd_kernels.quant) and the feature is round_to_anchor_dtype(scales[e] * (the
    fp32 sum of the anchors times float(weights[e])) + biases[e]), the bias in the anchors'
    dtype, added in fp32.
    """
    weights = list(weights)
    biases = None if biases is None else list(biases)
    scales = None if scales is None or all(s is None for s in scales) else list(scales)
    _check(anchors, types, weights, biases, scales)
    return dispatch.call("anchor_projection", anchors.device, anchors, types, weights, biases,
                         scales, backend=backend)


@anchor_projection.register_fake
def _(anchors, types, weights, biases=None, scales=None):
    return anchors.new_empty(anchors.shape[1], _d_out(anchors, weights))


def _d_out(anchors, weights):
    present = [w for w in weights if w is not None]
    return present[0].shape[0] if present else anchors.shape[2]


@dispatch.register("anchor_projection", "reference")
def anchor_projection_reference(anchors, types, weights, biases=None, scales=None):
    m, rows, d = anchors.shape
    out = anchors.new_empty(rows, _d_out(anchors, weights))
    for e in types.unique().tolist():
        sel = (types == e).nonzero(as_tuple=True)[0]
        w = weights[e]
        if scales is not None and scales[e] is not None:  # quantised: fp32 sum, scale, bias, round
            acc = None
            for j in range(e + 1):
                part = anchors[j, sel].float() @ w[:, j * d:(j + 1) * d].float().t()
                acc = part if acc is None else acc + part
            acc = acc * scales[e]
            if biases is not None and biases[e] is not None:
                acc = acc + biases[e].float()
            out[sel] = acc.to(out.dtype)
            continue
        acc = None
        for j in range(e + 1):  # sum of column blocks: the concat is never built
            part = anchors[j, sel] @ w[:, j * d:(j + 1) * d].t()
            acc = part if acc is None else acc + part
        if biases is not None and biases[e] is not None:
            acc = acc + biases[e]
        out[sel] = acc.to(out.dtype)
    return out


def _kernel_supports(anchors, types, weights, biases=None, scales=None):
    why = check_kernel_float("anchors", anchors) or last_dim_contiguous("anchors", anchors)
    if why:
        return why
    present = [(e, w) for e, w in enumerate(weights) if w is not None]
    if not present:
        return "no projection weights given"
    dt = present[0][1].dtype
    quant = dt in QUANT_DTYPES
    for e, w in present:
        if w.dtype != dt or not w.is_contiguous():
            return "the kernels need contiguous projection weights of one dtype"
        b = None if biases is None else biases[e]
        if quant:  # biases stay in the anchors' dtype (spd_kernels.quant)
            if b is not None and (b.dtype != anchors.dtype or not b.is_contiguous()):
                return "the kernels need biases of the anchors' dtype, contiguous"
            if scales is None or scales[e] is None or not scales[e].is_contiguous():
                return "the kernels need a contiguous scale for every quantised projection"
        elif b is not None and (b.dtype != dt or not b.is_contiguous()):
            return "the kernels need biases of the weights' dtype, contiguous"
    return None if quant else check_kernel_float("weights", present[0][1])


_TABLES: dict = {}


def _tables(weights, biases, device, scales=None):
    """int64 device tables of weight and bias addresses per type (0 = none), then of the scales'
    when given ([2 or 3, m]), cached."""
    w_ptrs = tuple(0 if w is None else w.data_ptr() for w in weights)
    b_ptrs = tuple(0 if biases is None or b is None else b.data_ptr()
                   for b in (biases or [None] * len(weights)))
    rows = [w_ptrs, b_ptrs]
    if scales is not None:
        rows.append(tuple(0 if s is None else s.data_ptr() for s in scales))
    key = (device, *rows)
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        t = torch.tensor(rows, dtype=torch.int64).to(device)
        _TABLES[key] = t
    return t


def _cuda_supports(anchors, types, weights, biases=None, scales=None):
    if scales is not None:
        return ("the CUDA kernels read float projection weights; these are quantised "
                "(int8 / fp8 with scales): the Triton kernel and the reference take them")
    why = _kernel_supports(anchors, types, weights, biases)
    if why:
        return why
    w = next(w for w in weights if w is not None)
    if w.dtype != anchors.dtype:
        return f"the CUDA kernel needs anchors and weights of one dtype ({anchors.dtype} vs {w.dtype})"
    return None


CUDA_VARIANTS = ("ffma", "mma")
MMA_TILE = 64  # output columns per block of the tensor-core kernel (kMmaTile, features.cu)


def cuda_variant() -> str:
    """SPD_ANCHOR_VARIANT: ffma (default: the kernel timed on the H200) or mma (the tensor-core
    kernel, bf16 / fp16 only, not timed on a GPU yet)."""
    v = env.ANCHOR_VARIANT.get().strip().lower() or "ffma"
    if v not in CUDA_VARIANTS:
        raise SPDInputError(f"SPD_ANCHOR_VARIANT must be one of {', '.join(CUDA_VARIANTS)}, got {v!r}")
    return v


def _vector_loads_ok(anchors, weights, align: int = 32) -> bool:
    """Loads of 8 elements need every row start aligned to 8 elements: 16 bytes for bf16 / fp16
    (the tensor-core kernel), the FMA kernel asks 32 (its fp32 path loads 32 bytes)."""
    d = anchors.shape[2]
    addrs = [anchors.data_ptr()] + [w.data_ptr() for w in weights if w is not None]
    return (d % 8 == 0 and anchors.stride(0) % 8 == 0 and anchors.stride(1) % 8 == 0
            and all(a % align == 0 for a in addrs))


def _mma_ok(anchors, weights) -> bool:
    return (anchors.dtype in (torch.bfloat16, torch.float16)
            and _vector_loads_ok(anchors, weights, align=16))


def mma_plan(m: int, d: int, n_out: int, device, k_per: int | None = None) -> tuple[int, int]:
    """(K columns per work item, work items) of the tensor-core kernel: about four blocks per SM
    in all, each on an equal share of sum_e (e + 1) * d, at least 4 warp steps."""
    if k_per is None:
        tiles = -(-n_out // MMA_TILE)
        items = max(m, round(4 * _cuda.multiprocessors(device) / tiles))
        k_per = -(-(d * m * (m + 1) // 2) // items)
    k_per = max(4 * _cuda.MMA_CHUNK, -(-int(k_per) // _cuda.MMA_CHUNK) * _cuda.MMA_CHUNK)
    count = lambda k: sum(-(-(e + 1) * d // k) for e in range(m))
    while count(k_per) > 65535:  # the grid's y limit
        k_per *= 2
    return k_per, count(k_per)


def anchor_projection_cuda_mma(anchors, types, weights, biases=None, *, k_per=None):
    """The tensor-core kernel (bf16 / fp16, 16-byte aligned rows): see csrc/kernels/features.cu."""
    if not _mma_ok(anchors, weights):
        raise SPDInputError("the tensor-core anchor kernel needs bf16 / fp16 anchors and weights "
                            "with rows on 16-byte boundaries (D and the strides multiples of 8)")
    return _launch_mma(anchors, types, weights, biases, k_per)


def _launch_mma(anchors, types, weights, biases, k_per):
    m, rows, d = anchors.shape
    n_out = _d_out(anchors, weights)
    out = _alloc.empty(rows, n_out, dtype=anchors.dtype, device=anchors.device)
    if rows == 0:
        return out
    k_per, items = mma_plan(m, d, n_out, anchors.device, k_per)
    ws = _alloc.empty(items * rows * n_out, dtype=torch.float32, device=anchors.device)
    types = types.contiguous()
    _cuda.ext().anchor_projection_mma(
        anchors, anchors.stride(0), anchors.stride(1), types,
        types.dtype == torch.int64, _tables(weights, biases, anchors.device),
        out, out.stride(0), ws, m, rows, d, n_out, k_per,
        dtype_code(anchors.dtype), _cuda.stream_of(anchors))
    return out


dispatch.defer("anchor_projection", "triton", "spd_kernels.features_triton")


@dispatch.register("anchor_projection", "cuda", supports=_cuda_supports)
def anchor_projection_cuda(anchors, types, weights, biases=None, scales=None):
    # quantised projections never get here: _cuda_supports refuses them
    if cuda_variant() == "mma" and _mma_ok(anchors, weights):
        return _launch_mma(anchors, types, weights, biases, None)
    vec = _vector_loads_ok(anchors, weights)
    ext = _cuda.ext()
    m, rows, d = anchors.shape
    n_out = _d_out(anchors, weights)
    out = _alloc.empty(rows, n_out, dtype=anchors.dtype, device=anchors.device)
    if rows == 0:
        return out
    types = types.contiguous()
    table = _tables(weights, biases, anchors.device)
    ext.anchor_projection(anchors, anchors.stride(0), anchors.stride(1),
                          types, types.dtype == torch.int64, table,
                          out, out.stride(0), m, rows, d, n_out,
                          dtype_code(anchors.dtype), vec, _cuda.stream_of(anchors))
    return out


def __getattr__(name: str):
    """The Triton kernel and its launcher live in features_triton (imported on demand: it imports
    Triton); reached here under their old names."""
    if name in ("anchor_projection_triton", "_anchor_kernel", "_anchor_dot"):
        from spd_kernels import features_triton
        return getattr(features_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
