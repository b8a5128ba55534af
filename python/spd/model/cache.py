"""Preallocated KV caches whose rollback is O(1) and in place."""
from __future__ import annotations

import torch

from spd.errors import InternalError
from spd_kernels import truncate_kv_


class KVCache:
    """K/V buffers [layers, kv_heads, capacity, head_dim] and one length per layer.

    All layers of one cache always hold the same number of rows. `lengths` (a device tensor) is
    the truth the kernels read: a graphed stage step takes its position from `lengths[:1]` and
    advances it on the device, and truncation only lowers it, so neither needs the host. The host
    mirror `length` follows the same writes for checks (overflow, write position) that cost no
    device read. `poison_on_truncate` (debug) NaNs dropped rows.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device, dtype, poison_on_truncate: bool = False):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(num_layers, dtype=torch.int64, device=device)
        # a truncation's new length, filled in place (no tensor made per rollback: on a GPU that
        # would be a blocking copy from pageable memory)
        self._new_length = torch.zeros((), dtype=torch.int64, device=device)
        self.capacity = capacity
        self.poison_on_truncate = poison_on_truncate
        self._length = 0  # host mirror: positions are known on the host anyway

    @property
    def length(self) -> int:
        return self._length

    def reserve(self, start: int, rows: int, *, advance: bool = True) -> None:
        """Check that rows [start, start+rows) may be written next, and account for them on the
        host. advance=False: the step that writes them advances `lengths` itself (a graph)."""
        if start != self._length:
            raise InternalError("cache write out of order", position=start, rows_held=self._length)
        if start + rows > self.capacity:
            raise InternalError("KV cache overflow", rows=start + rows, capacity=self.capacity)
        self._length = start + rows
        if advance:
            self.lengths.fill_(self._length)

    @property
    def position(self) -> torch.Tensor:
        """The next write position as an int64 tensor [1] on the device (a view of lengths)."""
        return self.lengths[:1]

    def truncate(self, length: int) -> None:
        """Keep rows [0, length): O(1), in place."""
        if length < 0:
            raise InternalError("truncation to a negative length", length=length)
        if length >= self._length:
            return
        truncate_kv_(self.lengths, self._new_length.fill_(length), (self.k, self.v), seq_dim=-2,
                     poison=self.poison_on_truncate)
        self._length = length
