"""The messages between ranks: a cycle's units and snaps, and the prefill's.

Every rank runs the same cycles (spd.runtime.cycle); in cycle c:

  rank 0 -> stage 0        the unit header [H] int64 stage 0 runs in cycle c (spd.runtime.unit)
  stage s -> stage s + 1   the header it ran, then its output rows [W, d]: the unit stage s + 1
                           runs in cycle c + 1                                          UNIT_TAG
  stage s -> rank 0        its snap: the last stage's argmax (int64, a greedy chain's verdict;
                           unused otherwise), then rows [R, W, d]: its anchors in slot order,
                           then (the last stage, unless a greedy chain) its output      SNAP_TAG

A stage with no anchors sends no snap, but the last stage always does. Sizes never change, so a
receive is posted before its message is known, and nothing in a message is read on the host to
know what to run. The prefill moves the prompt's rows on PREFILL_TAG, and each stage's prefill
snap [R, P, d] (the last stage's output included: its last row picks the first token) on
SNAP_TAG. Messages between two ranks match in the order they are posted (gloo per tag, NCCL per
pair whatever the tag), and every receive names its sender.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spd.model.partition import DepthLayout

PREFILL_TAG, SNAP_TAG, UNIT_TAG = 20, 30, 40
HEAD = 8  # the int64 in front of a snap's rows


@dataclass(frozen=True)
class SnapFormat:
    """What stage s sends rank 0 about a unit (or, at prefill, about the prompt): its anchor rows
    in slot order (`hidden`: their hidden-state indices, `slots`: the anchor slots rank 0 keeps
    them in), then its output when `with_output`."""
    hidden: tuple[int, ...]
    slots: tuple[int, ...]
    with_output: bool

    @property
    def rows(self) -> int:
        return len(self.hidden) + int(self.with_output)


def snap_format(layout: DepthLayout, stage: int, *, output: bool,
                anchors: bool = True) -> SnapFormat:
    """Stage `stage`'s snap; the last stage adds its output when `output` (the prefill; a cycle
    that rank 0 judges from it: sampling, or a token tree). `anchors` False: no anchor rows
    (nothing drafts: the pipeline without speculation)."""
    pairs = layout.anchors_of_stage(stage) if anchors else ()
    return SnapFormat(tuple(b for _, b in pairs), tuple(j for j, _ in pairs),
                      output and stage == layout.n - 1)


def snap_bytes(fmt: SnapFormat, width: int, d: int, dtype: torch.dtype) -> int:
    return HEAD + fmt.rows * width * d * torch.empty((), dtype=dtype).element_size()


def snap_views(buf: torch.Tensor, width: int, d: int, dtype: torch.dtype):
    """A snap (uint8) -> (its argmax [1] int64, its rows [R, W, d])."""
    return buf[:HEAD].view(torch.int64), buf[HEAD:].view(dtype).view(-1, width, d)
