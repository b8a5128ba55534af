"""Preallocated KV caches whose rollback is O(1) and in place."""
from __future__ import annotations

import torch

from spd.errors import InternalError
from spd_kernels import truncate_kv_


class KVCache:
    """K/V buffers [layers, kv_heads, capacity, head_dim] and their length.

    `lengths` [layers] int64 on the device is the one record of how many rows each layer holds
    (all layers hold the same): the kernels read it, a graphed step sets it from its position
    and advances it on the device, and a truncation only lowers it, so none of them needs the
    host. Positions belong to the caller (the schedule knows them, or a stage rank's unit
    carries them on the device): the cache checks that a write at a host position fits
    (`check_room`) but keeps no host copy of its length. `poison_on_truncate` (debug) NaNs
    dropped rows.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int,
                 device, dtype, poison_on_truncate: bool = False, buffers=None):
        """buffers: (k, v) of that shape to use instead of new ones (a slot of a batched cache,
        spd.runtime.batch_spd)."""
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        if buffers is None:
            buffers = (torch.zeros(shape, device=device, dtype=dtype),
                       torch.zeros(shape, device=device, dtype=dtype))
        if any(tuple(b.shape) != shape for b in buffers):
            raise InternalError("KV buffers of the wrong shape", want=shape,
                                got=[tuple(b.shape) for b in buffers])
        self.k, self.v = buffers
        self.lengths = torch.zeros(num_layers, dtype=torch.int64, device=device)
        self.capacity = capacity
        self.poison_on_truncate = poison_on_truncate
        # a truncation's new length, filled in place (no tensor made per rollback: on a GPU that
        # would be a blocking copy from pageable memory)
        self._new_length = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def length(self) -> int:
        """The rows held, read from the device: for checks and tests, not the decode loop."""
        return int(self.lengths[0]) if self.lengths.numel() else 0

    @property
    def position(self) -> torch.Tensor:
        """The next write position as an int64 tensor [1] on the device (a view of lengths)."""
        return self.lengths[:1]

    def check_room(self, start: int, rows: int) -> None:
        """Rows [start, start + rows) fit in the buffers (a host position: no device read)."""
        if start < 0 or start + rows > self.capacity:
            raise InternalError("KV cache overflow", rows=start + rows, capacity=self.capacity)

    def set_length(self, position) -> None:
        """The cache holds exactly `position` rows (an int, or an int64 [1] device tensor): a
        step sets it before it writes there, so a lower position is a rollback."""
        if isinstance(position, torch.Tensor):
            self.lengths.copy_(position.expand_as(self.lengths))
        else:
            self.lengths.fill_(position)

    def advance(self, rows: int) -> None:
        self.lengths.add_(rows)

    def reserve(self, start: int, rows: int) -> None:
        """A write of rows [start, start + rows) at a host position is about to happen (an
        eager step that takes `start` itself): check it fits; the cache then holds start + rows."""
        self.check_room(start, rows)
        self.lengths.fill_(start + rows)

    def truncate(self, length: int) -> None:
        """Keep rows [0, length): O(1), in place, on the device (no effect when it holds fewer)."""
        if length < 0:
            raise InternalError("truncation to a negative length", length=length)
        truncate_kv_(self.lengths, self._new_length.fill_(length), (self.k, self.v), seq_dim=-2,
                     poison=self.poison_on_truncate)
