"""A host copy of a small per-position device buffer, kept without waiting on the device.

The decode loop needs a few device values on the host some time after they were made: the
in-flight draft tokens (the context lookup matches on them) and whether the lookup's token was
used (stats, read when the draft is judged). Reading them with `.tolist()` / `bool()` would wait
for everything queued on the stream, the work of the current cycle included. Instead every write
is copied into pinned host memory right behind the work that produced it, with an event, and a
read waits for those copies' events only: for values made a cycle or more ago they have long
completed. On a CPU the copies are plain copies and there are no events.
"""
from __future__ import annotations

import torch


class HostMirror:
    """buf [C] on its device, mirrored position by position in host memory."""

    def __init__(self, buf: torch.Tensor):
        self.buf = buf
        self.cuda = buf.is_cuda
        self.host = torch.zeros(buf.shape, dtype=buf.dtype, pin_memory=self.cuda)
        self._events: dict[int, torch.cuda.Event] = {}  # position -> its latest copy (CUDA)

    def wrote(self, start: int, stop: int) -> None:
        """buf[start:stop] was just written on the current stream: copy it behind that write.
        Copies of one position complete in order (one stream), so the latest event is enough."""
        self.host[start:stop].copy_(self.buf[start:stop], non_blocking=self.cuda)
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            for p in range(start, stop):
                self._events[p] = event

    def read(self, start: int, stop: int) -> list:
        """buf[start:stop] as Python values, waiting only for those positions' copies."""
        for p in range(start, stop):
            event = self._events.pop(p, None)
            if event is not None:
                event.synchronize()  # not a stream or device sync: nothing after the copy
        return mark_host_copy(self.host[start:stop]).tolist()


class Published:
    """A small int64 device vector's value after each of the last `depth` steps, in pinned host
    memory: `publish(step, x)` copies x behind the work queued so far, with an event after it;
    `read(step)` waits for that copy alone. The device loops' way to tell the host their state
    up to `depth - 1` steps late (spd.runtime.device_loop, spd.distributed.device_cycle)."""

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
    """Marks `view` (this tensor object, not its base) as host memory copied from a device
    behind an event: reading it waits on no device (is_host_copy)."""
    view._spd_host_copy = True
    return view


def is_host_copy(x) -> bool:
    """Whether `x` is a HostMirror's host memory being read: a read that waits on no device
    (tests and probes of host reads tell these apart by identity)."""
    return isinstance(x, torch.Tensor) and getattr(x, "_spd_host_copy", False) is True
