"""The training layout that makes PDM training see exactly what inference shows it.

At inference, when the newest in-flight token sits at position t and `fill` tokens are in flight,
position p carries features of depth t - p if t - p < fill (inside the in-flight window) and depth
n otherwise (committed). Every row of the window is recomputed in that cycle, so each row q of
the window also sees keys at those same depths. We therefore replicate the sequence once per
depth that occurs (copies 0..fill-1 and n) and let row (copy k, position P) attend to key
(copy j, position P') for P' <= P with

    j = n                 if k == n (committed rows only ever saw committed keys)
    j = k + (P - P')      if that is < fill  (the key is inside the same in-flight window)
    j = n                 otherwise.

Row (copy 0, position t) then computes, through every layer, exactly the draft row of the cycle
whose newest token is t; the loss is taken on copy 0. Replicating per depth rather than per
aggregation type is what makes this exact for several layers: two depths of one type see
different windows. The cost is (fill + 1) copies of the sequence.

Several sequences train in one forward by packing: their layouts are laid side by side (a
block-diagonal mask, so no row sees another sequence), positions restart at 0 in each, and
`token` says which token of the packed anchors [m, sum T, d] a row reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.model.partition import DepthLayout


@dataclass
class TrainLayout:
    depth: torch.Tensor      # [R] depth (copy) of each row
    position: torch.Tensor   # [R] sequence position of each row
    types: torch.Tensor      # [R] aggregation type of each row
    mask: torch.Tensor       # [R, R] bool, True where a row may attend to a key
    loss_rows: torch.Tensor  # [T] row index of (copy 0, position p) for p = 0..T-1
    token: torch.Tensor | None = None  # [R] token each row reads (None: its position)

    @property
    def tokens(self) -> torch.Tensor:
        return self.position if self.token is None else self.token


def copies_for_fill(n: int, fill: int) -> list[int]:
    if not 1 <= fill <= n:
        raise ValueError(f"fill level must lie in [1, {n}], got {fill}")
    return list(range(fill)) + [n]


def training_layout(seq_len: int, layout: DepthLayout, fill: int, device=None,
                    shift: int = 0) -> TrainLayout:
    """shift=1 lays out post-step drafting: the PDM runs after the stage step, so every
    in-flight token is one stage deeper (the attention pattern is the same, only the
    aggregation type of each copy changes)."""
    n = layout.n
    copies = torch.tensor(copies_for_fill(n, fill), device=device)
    depth = copies.repeat_interleave(seq_len)
    position = torch.arange(seq_len, device=device).repeat(len(copies))
    gap = position[:, None] - position[None, :]                 # P - P'
    j = depth[:, None] + gap
    key_depth = torch.where((depth[:, None] == n) | (j >= fill), torch.full_like(j, n), j)
    mask = (gap >= 0) & (depth[None, :] == key_depth)
    type_of_depth = torch.tensor([layout.agg_type(min(n, k + shift)) for k in range(n + 1)],
                                 device=device)
    return TrainLayout(depth, position, type_of_depth[depth], mask,
                       torch.arange(seq_len, device=device))


def packed_layout(lengths: list[int], layout: DepthLayout, fills: list[int], device=None,
                  shift: int = 0) -> TrainLayout:
    """Sequences of `lengths` tokens, each at its own fill level, in one layout: rows of
    sequence i after those of sequence i-1, attending only inside their own sequence; loss rows
    in token order (sequence by sequence). One sequence gives training_layout's layout."""
    if len(lengths) != len(fills) or not lengths:
        raise ValueError(f"one fill level per sequence: {len(lengths)} lengths, {len(fills)} fills")
    parts = [training_layout(t, layout, f, device, shift) for t, f in zip(lengths, fills)]
    if len(parts) == 1:
        return parts[0]
    rows = [len(p.depth) for p in parts]
    row_start = torch.tensor([0] + rows[:-1], device=device).cumsum(0).tolist()
    tok_start = torch.tensor([0] + list(lengths[:-1]), device=device).cumsum(0).tolist()
    return TrainLayout(
        depth=torch.cat([p.depth for p in parts]),
        position=torch.cat([p.position for p in parts]),
        types=torch.cat([p.types for p in parts]),
        mask=torch.block_diag(*[p.mask.to(torch.uint8) for p in parts]).bool(),
        loss_rows=torch.cat([p.loss_rows + r for p, r in zip(parts, row_start)]),
        token=torch.cat([p.position + t for p, t in zip(parts, tok_start)]))
