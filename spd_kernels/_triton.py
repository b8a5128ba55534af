"""Optional Triton import, shared by the op modules.

Triton is not a hard dependency (CPU wheels of torch do not pull it in). Whether its interpreter is
active is fixed when the kernels are decorated, i.e. when `spd_kernels` is first imported:
`TRITON_INTERPRET=1` must be set before that for the Triton kernels to run on CPU tensors.
"""
from __future__ import annotations

import functools
import os

try:  # pragma: no cover - exercised implicitly by every import
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # ImportError, or a broken install  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

# Read once, at the same moment the @triton.jit decorators below run.
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


if HAS_TRITON:

    @triton.jit
    def round_to(x, CODE: tl.constexpr):
        """Round fp32 values to the precision of element type CODE, result kept in fp32.

        bf16 rounding is done with integer ops (round to nearest even) so the interpreter, whose
        fp32->bf16 casts truncate, gives the same bits as the GPU and as torch. NaN/inf inputs
        are not expected on this path (finite logits and features).
        """
        if CODE == 1:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif CODE == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """At a kernel's start: let the next kernel launch, then wait for the one before (as
        csrc/kernels/common.cuh's pdl_trigger / pdl_wait). A no-op unless PDL."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def float_key(x):
        """Monotone map fp32 -> int32: a < b  <=>  key(a) < key(b) (no NaN)."""
        bits = x.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
