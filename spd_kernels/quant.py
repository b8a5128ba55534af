"""Weight-only quantisation for the draft step: int8 or fp8 (e4m3) weights, one scale per output row.

The drafter's precision never changes what SPD commits (verification is exact), so the PDM's
step may read quantised weights and halve its bytes. A quantised weight is a pair

    q [N, K] int8 or torch.float8_e4m3fn,  scale [N] float32,   W ~= q * scale[:, None]

(symmetric per output row, rounded to nearest). The ops that take weights (`fused_linear`,
`fused_swiglu`, `qkv_rope_append`, `anchor_projection`) accept the pair through optional scale
arguments; their math, the same on every backend that takes it:

    y = round_to_dtype(sum_k h[r, k] * float(q[n, k]) * scale[n])

with h the op's (normalised) input rows in the model dtype, the products summed in fp32 and the
scale applied once to the fp32 sum (the epilogue), then rounded to the model dtype; whatever the
op does after its product (bias, SwiGLU, residual) then runs as for float weights. The integer
(and e4m3) weights are exact in bf16 / fp16 / fp32, so the kernels convert the tile they load
and the reference and the kernels differ only in fp32 summation order.

Scales are fp32 whatever the model dtype: a bf16 scale would add a rounding of 2^-9 to every row
and nothing is gained (N scalars next to N * K weights).
"""
from __future__ import annotations

import torch

from spd_kernels.checks import SPDInputError

QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
KINDS = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # largest finite magnitude of each


def is_quantized(w: torch.Tensor | None) -> bool:
    return w is not None and w.dtype in QUANT_DTYPES


@torch.no_grad()
def quantize_weight(w: torch.Tensor, kind: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] int8 or float8_e4m3fn, scale [N] fp32), W ~= q * scale[:, None].

    Symmetric per output row: scale = max|w_row| / qmax (127 for int8, 448 for e4m3), q = w /
    scale rounded to nearest (int8: half to even; fp8: the cast's round to nearest even). A row
    of zeros gets scale 1 and q 0 (exact)."""
    if kind not in KINDS:
        raise SPDInputError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() \
            or w.dtype in QUANT_DTYPES:
        raise SPDInputError(f"quantize_weight takes a float [N, K] tensor, got "
                            f"{getattr(w, 'dtype', type(w).__name__)} "
                            f"{tuple(getattr(w, 'shape', ()))}")
    dtype = KINDS[kind]
    qmax = _QMAX[dtype]
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1) if wf.shape[1] else wf.new_zeros(wf.shape[0])
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = (wf / scale[:, None]).clamp(-qmax, qmax)
    q = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return q.contiguous(), scale.to(SCALE_DTYPE).contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(q [N, K], scale [N]) -> q * scale[:, None] in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def check_weight(name: str, w: torch.Tensor, scale_name: str, scale: torch.Tensor | None,
                 device: torch.device) -> None:
    """w [N, K] a float weight without a scale, or a quantised one with its scale [N] fp32 on
    `device` (SPDInputError naming the argument otherwise). Shapes against the op's are checked
    by the op."""
    if not isinstance(w, torch.Tensor):
        raise SPDInputError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dtype in QUANT_DTYPES:
        if scale is None:
            raise SPDInputError(f"{name} is quantised ({w.dtype}) but {scale_name} is missing: "
                                f"give the per-row scale [{w.shape[0] if w.dim() else '?'}] "
                                f"(spd_kernels.quant.quantize_weight)")
        if w.dim() != 2:
            raise SPDInputError(f"{name} must have 2 dimensions, got shape {tuple(w.shape)}")
        if not isinstance(scale, torch.Tensor):
            raise SPDInputError(f"{scale_name} must be a torch.Tensor, got {type(scale).__name__}")
        if tuple(scale.shape) != (w.shape[0],):
            raise SPDInputError(f"{scale_name} must have shape ({w.shape[0]},) (one scale per "
                                f"row of {name}), got {tuple(scale.shape)}")
        if scale.dtype != SCALE_DTYPE:
            raise SPDInputError(f"{scale_name} must have dtype {SCALE_DTYPE}, got {scale.dtype}")
        if scale.device != device:
            raise SPDInputError(f"{scale_name} is on {scale.device} but the other inputs are on "
                                f"{device}")
        if w.device != device:
            raise SPDInputError(f"{name} is on {w.device} but the other inputs are on {device}")
    elif scale is not None:
        raise SPDInputError(f"{scale_name} is given but {name} is not quantised ({w.dtype}); a "
                            f"scale goes with an int8 or float8_e4m3fn weight")
