"""Anchor-feature aggregation: the PDM input of every row from the target's anchor hidden states.

Row r has aggregation type e(r) (how many anchors its depth makes available, minus one). Its
feature is P_e([h_{b_0}[r]; ...; h_{b_e}[r]]) = sum_{j<=e} W_{e,j} h_{b_j}[r] + bias_e, where
W_{e,j} is the j-th column block of the type-e projection. Rows of different types may be mixed in
one call (the depth staircase of the in-flight window).
"""
from __future__ import annotations

from typing import Sequence

import torch

from spd_kernels.checks import SPDInputError, check_tensor


def _check(anchors, types, weights, biases):
    check_tensor("anchors", anchors, dim=3, floating=True)
    check_tensor("types", types, dim=1)
    m, rows, d = anchors.shape
    if types.shape[0] != rows:
        raise SPDInputError(f"types has {types.shape[0]} rows but anchors has {rows}")
    if types.dtype not in (torch.int32, torch.int64):
        raise SPDInputError(f"types must be an integer tensor, got {types.dtype}")
    if types.device != anchors.device:
        raise SPDInputError(f"types is on {types.device} but anchors on {anchors.device}")
    if len(weights) != m:
        raise SPDInputError(f"expected one weight slot per anchor ({m}), got {len(weights)}")
    if rows:
        lo, hi = int(types.min()), int(types.max())
        if lo < 0 or hi >= m:
            raise SPDInputError(f"types must lie in [0, {m - 1}], got values in [{lo}, {hi}]")
    for e in (types.unique().tolist() if rows else []):
        w = weights[e]
        if w is None:
            raise SPDInputError(f"rows of aggregation type {e} present but no projection for it")
        check_tensor(f"weights[{e}]", w, dim=2, floating=True, device=anchors.device)
        if w.shape[1] != (e + 1) * d:
            raise SPDInputError(
                f"weights[{e}] must have {(e + 1) * d} input columns ((e+1)*hidden), got {w.shape[1]}")
        if biases is not None and biases[e] is not None and biases[e].shape != (w.shape[0],):
            raise SPDInputError(f"biases[{e}] must have shape ({w.shape[0]},)")


def anchor_projection_reference(anchors: torch.Tensor, types: torch.Tensor,
                                weights: Sequence[torch.Tensor | None],
                                biases: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """anchors [m, R, d] (row r's anchor j at anchors[j, r]), types [R] -> features [R, d_out]."""
    _check(anchors, types, weights, biases)
    m, rows, d = anchors.shape
    present = [w for w in weights if w is not None]
    d_out = present[0].shape[0] if present else d
    out = anchors.new_empty(rows, d_out)
    for e in types.unique().tolist():
        sel = (types == e).nonzero(as_tuple=True)[0]
        w = weights[e]
        acc = None
        for j in range(e + 1):  # sum of column blocks: the concat is never built
            part = anchors[j, sel] @ w[:, j * d:(j + 1) * d].t()
            acc = part if acc is None else acc + part
        if biases is not None and biases[e] is not None:
            acc = acc + biases[e]
        out[sel] = acc.to(out.dtype)
    return out


def anchor_projection(anchors, types, weights, biases=None):
    """Dispatcher (reference only for now; faster backends slot in here)."""
    return anchor_projection_reference(anchors, types, weights, biases)
