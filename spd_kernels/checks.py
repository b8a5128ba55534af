"""Argument checks shared by the ops: a clear error at the Python boundary, never a crash inside."""
from __future__ import annotations

import torch


class SPDInputError(ValueError):
    """Raised when an op or the runtime receives input it cannot handle; the message names it."""


def check_tensor(name: str, t, *, dim: int | None = None, dtype=None, floating: bool = False,
                 device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise SPDInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise SPDInputError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise SPDInputError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if floating and not t.is_floating_point():
        raise SPDInputError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if device is not None and t.device != device:
        raise SPDInputError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    for name, d in devices.items():
        if d != first:
            listing = ", ".join(f"{k} on {v}" for k, v in devices.items())
            raise SPDInputError(f"inputs must share one device: {listing}")
    return first
