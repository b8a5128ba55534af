"""In-place KV-cache truncation (rollback after a rejected draft).

A cache is a preallocated buffer plus a length; truncation only lowers the length, so it is O(1)
and never reallocates or copies. `poison=True` (a debug mode for tests) fills the dropped tail
with NaN so that any later read of a stale row shows up as NaN in the output.

Backends (see spd_kernels.dispatch):
  reference  torch.minimum on the lengths; the poison loop reads lengths on the host.
  triton     one launch updates the lengths of every layer; new lengths are read on the device,
             so no host synchronisation and CUDA-graph safe. With poison, one launch before it
             NaNs rows [new, old) of every layer of every buffer (a table of buffer pointers).
  cuda       the same two kernels in C++ (csrc/kernels/kv_cache.cu).
Rule: lengths and new_lengths are >= 0, and with poison no length exceeds a buffer's sequence
capacity; a violation is an SPDInputError on every backend (CPU tensors always; device tensors with
SPD_CHECK_VALUES=1, since the check needs a host sync). Unchecked, the kernels clamp the new
length to [0, old] and the poisoned rows to the buffer's capacity, so they never write outside
a buffer.
"""
from __future__ import annotations

from typing import Sequence

import torch

from spd_kernels import _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.checks import SPDInputError, check_kernel_float, check_tensor, check_values_enabled
from spd_kernels.opdef import op


def _check(lengths, new_lengths, buffers, seq_dim, poison):
    check_tensor("lengths", lengths, dim=1, dtype=torch.int64)
    check_tensor("new_lengths", new_lengths, dtype=torch.int64, device=lengths.device)
    if new_lengths.dim() > 1 or (new_lengths.dim() == 1 and new_lengths.shape != lengths.shape):
        raise SPDInputError(f"new_lengths must be a scalar or have shape {tuple(lengths.shape)}, "
                            f"got {tuple(new_lengths.shape)}")
    checked = check_values_enabled(lengths, new_lengths)
    if checked and bool((new_lengths < 0).any()):
        raise SPDInputError("new_lengths must be non-negative")
    if checked and bool((lengths < 0).any()):
        raise SPDInputError(f"lengths must be non-negative, got {lengths.tolist()}")
    if poison:
        for i, buf in enumerate(buffers):
            check_tensor(f"buffers[{i}]", buf, floating=True, device=lengths.device)
            if buf.dim() < 2:
                raise SPDInputError(f"buffers[{i}] must have a cache axis and a sequence axis, "
                                    f"got shape {tuple(buf.shape)}")
            if buf.shape[0] != lengths.shape[0]:
                raise SPDInputError(f"buffer has {buf.shape[0]} caches, lengths has {lengths.shape[0]}")
            sd = seq_dim if seq_dim < 0 else seq_dim
            if not (-buf.dim() <= sd < buf.dim()) or sd % buf.dim() == 0:
                raise SPDInputError(f"seq_dim {seq_dim} is not a sequence axis of buffers[{i}] "
                                    f"with shape {tuple(buf.shape)} (axis 0 is the cache axis)")
            capacity = buf.shape[seq_dim]
            if checked and lengths.numel() and int(lengths.max()) > capacity:
                raise SPDInputError(f"lengths {lengths.tolist()} exceed the {capacity} positions "
                                    f"of buffers[{i}] (shape {tuple(buf.shape)}, seq_dim "
                                    f"{seq_dim})")


@op("truncate_kv", mutates=("lengths", "buffers"), returns_arg="lengths")
def truncate_kv_(lengths: torch.Tensor, new_lengths: torch.Tensor,
                 buffers: Sequence[torch.Tensor] | None = None, *, seq_dim: int = -2,
                 poison: bool = False, backend: str | None = None) -> torch.Tensor:
    """lengths [C] (int64, one per cache) <- min(lengths, new_lengths), in place.

    With poison, rows [new, old) of every buffer in `buffers` (each [C, ..., S, ...] with the
    sequence axis at `seq_dim` and the cache axis first) are set to NaN.
    """
    buffers = () if buffers is None else tuple(buffers)
    _check(lengths, new_lengths, buffers, seq_dim, poison)
    dispatch.call("truncate_kv", lengths.device, lengths, new_lengths, buffers, seq_dim, poison,
                  backend=backend)
    return lengths


@truncate_kv_.register_fake
def _(lengths, new_lengths, buffers=None, seq_dim=-2, poison=False):
    return None


@dispatch.register("truncate_kv", "reference")
def truncate_kv_reference(lengths, new_lengths, buffers, seq_dim, poison):
    old = lengths.clone() if poison else None
    torch.minimum(lengths, new_lengths.clamp_min(0).expand_as(lengths), out=lengths)
    if poison:
        for buf in buffers:
            capacity = buf.shape[seq_dim]
            for c in range(lengths.shape[0]):
                lo, hi = int(lengths[c]), min(int(old[c]), capacity)
                if hi > lo:
                    buf[c].narrow(seq_dim if seq_dim < 0 else seq_dim - 1, lo, hi - lo).fill_(float("nan"))
    return lengths


def _layout(buf: torch.Tensor, seq_dim: int) -> tuple[int, int, int]:
    """(outer, S, inner) of one cache slice buf[c] viewed as [outer, S, inner]."""
    sd = seq_dim % buf.dim()
    outer = 1
    for s in buf.shape[1:sd]:
        outer *= s
    inner = 1
    for s in buf.shape[sd + 1:]:
        inner *= s
    return outer, buf.shape[sd], inner


def _kernel_supports(lengths, new_lengths, buffers, seq_dim, poison):
    if not lengths.is_contiguous():
        return "lengths must be contiguous for the kernels (they update it in place)"
    if not poison or not buffers:
        return None
    first = buffers[0]
    for i, b in enumerate(buffers):
        why = check_kernel_float(f"buffers[{i}]", b)
        if why:
            return why
        if not b.is_contiguous():
            return f"buffers[{i}] must be contiguous for the poison kernel"
        if b.shape != first.shape or b.dtype != first.dtype:
            return "the poison kernel needs buffers of one shape and dtype"
    return None


_TABLES: dict = {}


def _pointer_table(buffers) -> torch.Tensor:
    """int64 device tensor of the buffers' addresses (cached: built once per set of buffers)."""
    key = (buffers[0].device, tuple(b.data_ptr() for b in buffers))
    t = _TABLES.get(key)
    if t is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        t = torch.tensor(key[1], dtype=torch.int64).to(buffers[0].device)
        _TABLES[key] = t
    return t


dispatch.defer("truncate_kv", "triton", "spd_kernels.kv_cache_triton")


@dispatch.register("truncate_kv", "cuda", supports=_kernel_supports)
def truncate_kv_cuda(lengths, new_lengths, buffers, seq_dim, poison):
    ext = _cuda.ext()
    new_lengths = new_lengths.contiguous()
    C = lengths.shape[0]
    new_stride = 1 if new_lengths.dim() == 1 else 0
    if C == 0:
        return lengths
    stream = _cuda.stream_of(lengths)
    if poison and buffers:
        outer, S, inner = _layout(buffers[0], seq_dim)
        ext.kv_poison(lengths, new_lengths, new_stride,
                      _pointer_table(buffers), len(buffers), C, outer, S, inner,
                      dtype_code(buffers[0].dtype), stream)
    ext.kv_truncate(lengths, new_lengths, new_stride, C, stream,
                    lengths_numel=lengths.numel(), new_lengths_numel=new_lengths.numel())
    return lengths


def __getattr__(name: str):
    """The Triton kernel and its launcher live in kv_cache_triton (imported on demand: it imports
    Triton); reached here under their old names."""
    if name in ("truncate_kv_triton", "_lengths_kernel", "_poison_kernel"):
        from spd_kernels import kv_cache_triton
        return getattr(kv_cache_triton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
