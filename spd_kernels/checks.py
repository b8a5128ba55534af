"""Argument checks shared by the ops: a clear error at the Python boundary, never a crash inside."""
from __future__ import annotations

import torch

from spd_kernels import env


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


def check_same_dtype(**tensors: torch.Tensor | None) -> None:
    """The tensors given (None skipped) share one dtype, as the reference's products need."""
    given = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(given.values())) > 1:
        listing = ", ".join(f"{k} {v}" for k, v in given.items())
        raise SPDInputError(f"these inputs must share one dtype: {listing}")


def check_not_aliased(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """a and b do not share memory (an op writes one while reading or writing the other)."""
    if a.numel() == 0 or b.numel() == 0:
        return
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return

    def span(t):
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    if a0 < b1 and b0 < a1:
        raise SPDInputError(f"{a_name} and {b_name} share memory: give them separate buffers")


def check_integer(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise SPDInputError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")


def check_kernel_float(name: str, t: torch.Tensor) -> str | None:
    """Reason why a kernel cannot take t's dtype (None when it can)."""
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"{name} has dtype {t.dtype}; the kernels take float32, bfloat16 or float16"
    return None


def last_dim_contiguous(name: str, t: torch.Tensor) -> str | None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        return f"{name} must be contiguous in its last dimension (stride {t.stride(-1)})"
    return None


def check_values_enabled(*tensors: torch.Tensor) -> bool:
    """Whether to check values inside tensors (token ids in range, lengths >= 0, ...).

    Always for CPU tensors. For device tensors a value check is a host synchronisation, which the
    decode loop must not pay (nor may it happen inside CUDA-graph capture), so there it runs only
    with SPD_CHECK_VALUES=1; the kernels clamp or mask out-of-range values instead of reading out
    of bounds, so an unchecked bad value gives a wrong answer, never an illegal memory access.
    """
    if all(t.device.type == "cpu" for t in tensors):
        return True
    if env.CHECK_VALUES.get() != "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
