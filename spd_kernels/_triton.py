"""The Triton import, shared by the op modules that hold Triton kernels.

Triton is not a hard dependency (CPU wheels of torch do not pull it in), and importing it costs
~50 MB resident and a second or more: only modules that define Triton kernels import this one,
and the dispatcher imports those only when a Triton kernel may run (spd_kernels.dispatch.defer),
never on a CPU process that runs the reference ops. The host-side helpers live in
spd_kernels._host and are re-exported here for the kernel modules.
"""
from __future__ import annotations

try:  # pragma: no cover - exercised implicitly by every import
    import triton
    import triton.language as tl
    HAS_TRITON = True
except Exception:  # ImportError, or a broken install  # pragma: no cover
    triton = None
    tl = None
    HAS_TRITON = False

from spd_kernels._host import (  # noqa: F401  (re-exported for the kernel modules)
    DTYPE_BF16,
    DTYPE_F16,
    DTYPE_F32,
    INTERPRET,
    dtype_code,
    next_pow2,
    pdl,
    sm_count,
)

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
