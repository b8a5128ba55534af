"""Small values between the host and a device, without a blocking copy.

A copy from ordinary (pageable) host memory to a GPU goes through a staging buffer and holds the
host until it is done. The decode loop moves a few host values to the device every cycle (the
seeded generator's uniforms); `to_device` stages them in pinned memory from torch's caching
host allocator, which keeps a block until the copies that read it have run, so the copy is
asynchronous and the block is never reused early. The other way, `to_host` reads a few device
values (a verdict) through pinned memory and an event. On a CPU both hand the values over as
they are.
"""
from __future__ import annotations

import threading

import torch


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x (host memory) on `device`, copied without a host wait (x itself on a CPU device)."""
    device = torch.device(device)
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)


_PINNED = threading.local()  # per thread: {device: (pinned int64 buffer, event)}


def to_host(x: torch.Tensor) -> list:
    """A few int64 values on a device, on the host, waiting for their own copy alone: a
    non-blocking copy into pinned memory and an event after it on the current stream; the host
    waits on that event (everything queued before it on this stream, nothing on other streams),
    which CUDA's sync debug mode does not flag as a synchronisation. x.tolist() on a CPU."""
    if x.device.type == "cpu":
        return x.tolist()
    slots = getattr(_PINNED, "slots", None)
    if slots is None:
        slots = _PINNED.slots = {}
    n = x.numel()
    buf, event = slots.get(x.device, (None, None))
    if buf is None or buf.numel() < n:
        buf, event = torch.empty(max(n, 8), dtype=torch.int64, pin_memory=True), torch.cuda.Event()
        slots[x.device] = (buf, event)
    buf[:n].copy_(x.reshape(-1), non_blocking=True)
    event.record()
    event.synchronize()
    return buf[:n].tolist()
