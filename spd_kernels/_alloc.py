"""Output allocation for the kernel launchers, with a test hook that poisons fresh buffers.

Under `spd_kernels.testing.poisoned_outputs(mode)` every buffer a launcher allocates (outputs and
scratch) is filled with a sentinel first (NaN / +inf, huge integers, True / False), so an element
a kernel forgets to write shows up as a wrong result instead of passing by luck.
"""
from __future__ import annotations

import torch

POISON: str | None = None  # None, "a" or "b" (two different sentinel sets)


def empty(*shape, dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if POISON is not None:
        if dtype.is_floating_point:
            t.fill_(float("nan") if POISON == "a" else float("inf"))
        elif dtype == torch.bool:
            t.fill_(POISON == "a")
        else:
            t.fill_(-7777777 if POISON == "a" else 7777777)
    return t
