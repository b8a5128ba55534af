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


def mark_host_copy(view: torch.Tensor) -> torch.Tensor:
    """Marks `view` (this tensor object, not its base) as host memory copied from a device
    behind an event: reading it waits on no device (is_host_copy)."""
    view._spd_host_copy = True
    return view


def is_host_copy(x) -> bool:
    """Whether `x` is a HostMirror's host memory being read: a read that waits on no device
    (tests and probes of host reads tell these apart by identity)."""
    return isinstance(x, torch.Tensor) and getattr(x, "_spd_host_copy", False) is True
