"""The wire protocol between rank 0 and the stages: message tags and the unit messages.

Decode runs as a stream of units: each token rank 0 puts into the pipeline is one unit, and
every stage processes every unit, in order, as soon as its input arrives. What a stage needs to
know travels with the data, as tensors it uses where they are and never reads on the host:

  rank 0 -> stage 0          [position, token] int64 (UNIT_TAG)
  stage s -> stage s + 1     packed bytes: [position] int64, then the output row (UNIT_TAG)
  rank 0 -> last stage       [position, token] of every unit but the first (JUDGE_TAG): the
                             draft the last stage judges when the unit before it leaves
  stage s -> rank 0          its anchor rows of the unit (SNAP_TAG)
  last stage -> rank 0       greedy: the verdict [target token, accepted] (VERDICT_TAG);
                             sampling: the output row rides in its snap (rank 0 judges)

A unit's position sets the stage's KV cache length before its rows are written, so a rollback
is only a lower position: the correction carries it down the pipeline. Units rank 0 dropped
(announced on an optimistic accept, or in flight at a rejection) are still processed by every
stage in the cycles they would idle anyway; rank 0 receives and drops their messages.

The end of a generation is the one host decision a stage takes: a stop message on its unit tag
from a rank other than its data source (rank 0 for stages 1.., stage 1 for stage 0), told apart
by the receive's source rank, not by reading a tensor.

Messages of one kind between two ranks match in the order they were posted (gloo), so no tag
carries a sequence number. The prefill moves whole prompts on PREFILL_TAG.
"""
from __future__ import annotations

import torch

PREFILL_TAG, UNIT_TAG, JUDGE_TAG, SNAP_TAG, VERDICT_TAG = 20, 40, 50, 30, 60
GLOO_TAGS = (UNIT_TAG, JUDGE_TAG)  # any-source receives and stops: gloo even under NCCL

HEADER = 2       # rank 0's unit: [position, token]
POS_BYTES = 8    # the position in front of a stage's output row


def unit_header(device) -> torch.Tensor:
    """A unit message from rank 0 (and a receive buffer for one)."""
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
