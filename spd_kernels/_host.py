"""Host-side helpers shared by the kernel modules that need no Triton (spd_kernels._triton
imports Triton itself: it is imported only once a Triton kernel is needed, see
spd_kernels.dispatch.defer).

`TRITON_INTERPRET=1` must be set before `spd_kernels` is first imported for the Triton kernels to
run on CPU tensors: it is read here, then, and the Triton kernels are decorated under that value
whenever they are imported (spd_kernels.dispatch).
"""
from __future__ import annotations

import functools
import os

# Read once, when spd_kernels is imported; the kernels are decorated under it.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Element-type codes shared by the Triton kernels and the CUDA extension.
DTYPE_F32, DTYPE_BF16, DTYPE_F16 = 0, 1, 2


def dtype_code(dtype) -> int:
    import torch
    try:
        return {torch.float32: DTYPE_F32, torch.bfloat16: DTYPE_BF16, torch.float16: DTYPE_F16}[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}: expected float32, bfloat16 or float16") from None


def pdl(device) -> bool:
    """Whether Triton kernels on `device` launch as programmatic dependent launches: the
    process-wide switch (spd_kernels._cuda.programmatic_launch, SPD_PDL), on a CUDA device,
    compiled (the interpreter has no griddepcontrol). Kernels that take PDL call pdl_enter(PDL)
    first and are launched with launch_pdl=PDL."""
    from spd_kernels import _cuda
    return _cuda.programmatic_launch_enabled() and not INTERPRET and device.type == "cuda"


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (1 for anything else): grid sizing."""
    import torch
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
