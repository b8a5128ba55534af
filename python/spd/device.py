"""Small host values on their way to the device, without the host waiting.

A copy from ordinary (pageable) host memory to a GPU goes through a staging buffer and holds the
host until it is done. The decode loop moves a few host values to the device every cycle (the
seeded generator's uniforms); `to_device` stages them in pinned memory from torch's caching
host allocator, which keeps a block until the copies that read it have run, so the copy is
asynchronous and the block is never reused early. On a CPU the tensor is returned as it is.
"""
from __future__ import annotations

import torch


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x (host memory) on `device`, copied without a host wait (x itself on a CPU device)."""
    device = torch.device(device)
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)
