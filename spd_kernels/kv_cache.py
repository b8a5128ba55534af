"""In-place KV-cache truncation (rollback after a rejected draft).

A cache is a preallocated buffer plus a length; truncation only lowers the length, so it is O(1)
and never reallocates or copies. `poison=True` (a debug mode for tests) fills the dropped tail
with NaN so that any later read of a stale row shows up as NaN in the output.
"""
from __future__ import annotations

from typing import Sequence

import torch

from spd_kernels.checks import SPDInputError, check_tensor


def truncate_kv_(lengths: torch.Tensor, new_lengths: torch.Tensor,
                 buffers: Sequence[torch.Tensor] = (), *, seq_dim: int = -2,
                 poison: bool = False) -> torch.Tensor:
    """lengths [C] (int64, one per cache) <- min(lengths, new_lengths), in place.

    With poison, rows [new, old) of every buffer in `buffers` (each [C, ..., S, ...] with the
    sequence axis at `seq_dim` and the cache axis first) are set to NaN.
    """
    check_tensor("lengths", lengths, dim=1, dtype=torch.int64)
    check_tensor("new_lengths", new_lengths, dtype=torch.int64, device=lengths.device)
    if new_lengths.dim() > 1 or (new_lengths.dim() == 1 and new_lengths.shape != lengths.shape):
        raise SPDInputError(f"new_lengths must be a scalar or have shape {tuple(lengths.shape)}, "
                            f"got {tuple(new_lengths.shape)}")
    if bool((new_lengths < 0).any()):
        raise SPDInputError("new_lengths must be non-negative")
    old = lengths.clone() if poison else None
    torch.minimum(lengths, new_lengths.expand_as(lengths), out=lengths)
    if poison:
        for buf in buffers:
            if buf.shape[0] != lengths.shape[0]:
                raise SPDInputError(f"buffer has {buf.shape[0]} caches, lengths has {lengths.shape[0]}")
            for c in range(lengths.shape[0]):
                lo, hi = int(lengths[c]), int(old[c])
                if hi > lo:
                    buf[c].narrow(seq_dim if seq_dim < 0 else seq_dim - 1, lo, hi - lo).fill_(float("nan"))
    return lengths
