"""A chunk's first cache position, given as an int (host) or an int64 tensor of one element
(device: the kernels read it there, so a CUDA graph replays at any position)."""
from __future__ import annotations

import operator

import torch

from spd_kernels.checks import SPDInputError, check_tensor, check_values_enabled


def check_start(start, rows: int, capacity: int, device) -> int | None:
    """Check a chunk's first position (int, or int64 tensor of one element on `device`) against
    a cache of `capacity` positions; returns it when its value could be read without a host
    synchronisation (see check_values_enabled), else None."""
    if isinstance(start, torch.Tensor):
        check_tensor("start", start, dtype=torch.int64, device=device)
        if start.numel() != 1:
            raise SPDInputError(f"start must hold one position, got shape {tuple(start.shape)}")
        first = int(start.reshape(-1)[0]) if check_values_enabled(start) else None
    else:
        try:  # an int (or numpy integer), never a float truncated to one
            first = operator.index(start)
        except TypeError:
            raise SPDInputError(f"start must be an int or an int64 tensor of one element, got "
                                f"{type(start).__name__} {start!r}") from None
    if first is not None and (first < 0 or first + rows > capacity):
        raise SPDInputError(f"rows {first}..{first + rows - 1} do not fit a cache of "
                            f"{capacity} positions")
    return first


def positions(start, rows: int, device) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start.reshape(-1)[:1].to(torch.int64) + torch.arange(rows, device=device)
    return torch.arange(start, start + rows, device=device)


def start_tensor(start, device) -> torch.Tensor:
    """start as the int64 tensor of one element the kernels read on the device."""
    if not isinstance(start, torch.Tensor):
        return torch.tensor([int(start)], dtype=torch.int64, device=device)
    return start.reshape(1)
