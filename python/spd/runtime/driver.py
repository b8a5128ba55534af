"""The host's side of the cycles: launch ahead, read what each cycle published, stop.

Every process that runs cycles (rank 0 or the one process, and each stage rank) drives them
the same way (`drive`): it launches cycles up to `ahead` past the last one it has read, reads each
cycle's published state from pinned memory behind an event (a copy of a few ints, never a wait
for the stream), and stops at the end cycle once it is known (every rank runs exactly the cycles
before it: point-to-point messages must pair), or, with no peers, as soon as the host has what it
needs.
"""
from __future__ import annotations

from typing import Callable

import torch

from spd.errors import InternalError

STOP = -1  # `read`'s answer when the host has what it needs and no peer waits for more cycles


class Published:
    """A small int64 device vector's value after each of the last `depth` steps, in pinned host
    memory: `publish(step, x)` copies x behind the work queued so far, with an event after it;
    `read(step)` waits for that copy alone."""

    def __init__(self, depth: int, size: int, device: torch.device):
        cuda = torch.device(device).type == "cuda"
        self.depth = depth
        self.host = torch.zeros(depth, size, dtype=torch.int64, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(depth)]

    def publish(self, step: int, x: torch.Tensor) -> None:
        """x [size] int64 on the device, after step `step`'s work (its slot is step % depth)."""
        slot = step % self.depth
        self.host[slot].copy_(x, non_blocking=self.events[slot] is not None)
        if self.events[slot] is not None:
            self.events[slot].record()

    def read(self, step: int) -> list[int]:
        """What step `step` published (its slot not published again since)."""
        slot = step % self.depth
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # this copy alone: not a stream or device sync
        return mark_host_copy(self.host[slot]).tolist()


def mark_host_copy(view: torch.Tensor) -> torch.Tensor:
    """Marks `view` (this tensor object, not its base) as host memory that reading waits on no
    device for (a copy behind an event, or on a CPU the cycle's own memory: `peek`)."""
    view._spd_host_copy = True
    return view


def is_host_copy(x) -> bool:
    """Whether `x` is host memory being read that waits on no device (tests and probes of host
    reads tell these apart by identity)."""
    return isinstance(x, torch.Tensor) and getattr(x, "_spd_host_copy", False) is True


def peek(x: torch.Tensor) -> list:
    """A CPU tensor's values, read where the host is the device (free): what lets a cycle on a
    CPU skip the work of a dead unit. Never on a GPU: there a cycle is the same work every time
    (one CUDA graph)."""
    if x.device.type != "cpu":
        raise RuntimeError("peek reads CPU tensors only")
    return mark_host_copy(x.view(-1)).tolist()


def drive(launch: Callable[[int, int | None], None], read: Callable[[int], int | None],
          ahead: int) -> int:
    """Cycles from 0: launch(c, end) launches cycle c (`end`: the end cycle, once known);
    read(c) reads what cycle c published -> the end cycle once it is known (> 0), None while it
    is not, or STOP. Cycles are launched up to `ahead` past the last one read; once the end is
    known, every cycle before it without reading more. Returns the cycles launched."""
    launched = nread = 0
    end: int | None = None
    while end is None or launched < end:
        limit = end if end is not None else nread + ahead + 1
        while launched < limit:
            launch(launched, end)
            launched += 1
        if end is not None:
            break
        got = read(nread)
        nread += 1
        if got == STOP:
            break
        if got:
            if launched >= got:  # the last cycle went out as a steady one: peers would desync
                raise InternalError("the end cycle was read too late", end=got,
                                    launched=launched)
            end = got
    return launched
