"""The wire protocol between rank 0 and the stages: message tags and the control message.

Rank 0 sends every stage one control message per cycle; the stages send hidden states to the next
stage and their anchor states ("snaps") to rank 0. The control message travels as a small int64
tensor on the gloo control group (host integers, cheap to send); `ControlMessage` is its named
view, so neither side indexes fields by position.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

# Every kind of message alternates between two tags (base, base + 1), so that a receive for the
# next message can be posted while the last one from the same peer is still outstanding. Hidden
# states and snaps alternate by cycle parity, control messages by their sequence number (a cycle
# may be sent twice, see ControlMessage).
TAG_CTRL, TAG_HIDDEN, TAG_SNAP = 10, 20, 30


def ctrl_tag(seq: int) -> int:
    return TAG_CTRL + seq % 2


def hidden_tag(cycle: int) -> int:
    return TAG_HIDDEN + cycle % 2


def snap_tag(cycle: int) -> int:
    return TAG_SNAP + cycle % 2


def is_ctrl_tag(tag: int) -> bool:
    return tag in (TAG_CTRL, TAG_CTRL + 1)


class Op(IntEnum):
    CYCLE = 1  # run one pipeline cycle
    STOP = 2   # the generation is over: leave the cycle loop


_NO_TRUNCATE = -1  # the wire value of truncate_to=None


@dataclass(frozen=True)
class ControlMessage:
    """What rank 0 tells every stage at the start of a cycle.

    The window is `count` tokens from position `start`: stage s works this cycle when s < count,
    on position start + count - 1 - s. A stage that receives the same cycle twice treats the
    second message as the cycle (rank 0 announced it on an optimistic accept, the draft was
    rejected): it truncates and discards what the first attempt produced."""
    op: Op
    cycle: int
    start: int = 0                  # window start
    count: int = 0                  # window count: stages 0 .. count - 1 work
    truncate_to: int | None = None  # rollback: every stage truncates its cache to this length
    token: int = 0                  # the token entering stage 0 (embedded there)

    FIELDS = 6  # the tensor's length: the fields above, in order

    def works(self, stage: int) -> bool:
        return stage < self.count

    def position(self, stage: int) -> int:
        """The position stage `stage` computes this cycle (when it works)."""
        return self.start + self.count - 1 - stage

    @classmethod
    def stop(cls, cycle: int) -> ControlMessage:
        return cls(Op.STOP, cycle)

    def to_tensor(self) -> torch.Tensor:
        trunc = _NO_TRUNCATE if self.truncate_to is None else self.truncate_to
        return torch.tensor([int(self.op), self.cycle, self.start, self.count, trunc, self.token],
                            dtype=torch.int64)

    @classmethod
    def buffer(cls) -> torch.Tensor:
        """A receive buffer for one message."""
        return torch.empty(cls.FIELDS, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> ControlMessage:
        op, cycle, start, count, trunc, token = t.tolist()  # a host tensor: no device sync
        return cls(Op(op), cycle, start, count, None if trunc == _NO_TRUNCATE else trunc, token)
