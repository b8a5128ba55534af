"""The wire protocol between rank 0 and the stages: message tags and the unit messages.

Decode runs as a stream of units: each token rank 0 puts into the pipeline is one unit, and
every stage processes every unit, in order, as soon as its input arrives. Every receive names its
sender. A unit crosses each hop as two messages:

  header   [op, seq] int64 in host memory, on the gloo control group (HEADER_TAG): op UNIT or
           STOP, seq the unit's number (a sanity check). The stage reads it on the host: it is
           host memory on every device, so reading it never waits on a device.
  payload  a device tensor on the data group (NCCL on GPUs, gloo on the CPU), never read on the
           host by a stage:
             rank 0 -> stage 0        [position, token] int64 (UNIT_TAG)
             stage s -> stage s + 1   packed bytes: [position] int64, then the output row

and besides:
  rank 0 -> last stage       [position, token] of every unit but the first (JUDGE_TAG): the
                             draft the last stage judges when the unit before it leaves
  stage s -> rank 0          its anchor rows of the unit (SNAP_TAG)
  last stage -> rank 0       greedy: the verdict [target token, accepted] (VERDICT_TAG);
                             sampling: the output row rides in its snap (rank 0 judges)

A unit's position sets the stage's KV cache length before its rows are written, so a rollback
is only a lower position: the correction carries it down the pipeline. Units rank 0 dropped
(announced on an optimistic accept, or in flight at a rejection) are still processed by every
stage in the cycles they would idle anyway; rank 0 receives and drops their messages.

The end of a generation is a STOP header from rank 0 to stage 0, which each stage passes on to
the next; a stop carries a zero payload too, so the payload receive every stage posts ahead is
always matched (an NCCL receive cannot be cancelled).

Messages between two ranks match in the order they were posted (gloo per tag, NCCL per pair of
ranks whatever the tag), so no tag carries a sequence number; under NCCL receives are posted in
the order the peer sends (stage_rank, draft_rank's UnitStream._post_last). The prefill moves
whole prompts on PREFILL_TAG.
"""
from __future__ import annotations

import torch

PREFILL_TAG, UNIT_TAG, JUDGE_TAG, SNAP_TAG, VERDICT_TAG, HEADER_TAG = 20, 40, 50, 30, 60, 70
GLOO_TAGS = (HEADER_TAG,)  # host headers: the gloo control group even under NCCL
UNIT, STOP = 1, 0          # a header's op


HEADER = 2       # rank 0's unit: [position, token]
POS_BYTES = 8    # the position in front of a stage's output row


def header(op: int = UNIT, seq: int = 0) -> torch.Tensor:
    """A unit's host header [op, seq] (and a receive buffer for one): int64 in host memory."""
    buf = torch.tensor([op, seq], dtype=torch.int64)
    buf._spd_header = True  # marks this tensor object (not its views): see is_header
    return buf


def is_header(x) -> bool:
    """Whether `x` is a header buffer made by `header` (host memory on every device: reading it
    never waits on a device). The one thing a stage reads on the host; tests of host reads
    exclude exactly these tensor objects."""
    return isinstance(x, torch.Tensor) and getattr(x, "_spd_header", False) is True


def unit_header(device) -> torch.Tensor:
    """A unit's payload from rank 0, [position, token] (and a receive buffer for one)."""
    return torch.zeros(HEADER, dtype=torch.int64, device=device)


def packed(hidden: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A receive buffer for a stage's unit message: the position, then one row of `hidden`."""
    return torch.zeros(POS_BYTES + hidden * torch.empty((), dtype=dtype).element_size(),
                       dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(position [1] int64, row [1, hidden]): views of a packed message."""
    return buf[:POS_BYTES].view(torch.int64), buf[POS_BYTES:].view(dtype).view(1, hidden)


def pack(position: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
    """A stage's unit message for the next stage: position [1] int64 and its output row [1, d]."""
    buf = packed(row.shape[-1], row.dtype, row.device)
    pos, out = unpack(buf, row.shape[-1], row.dtype)
    pos.copy_(position)
    out.copy_(row)
    return buf
