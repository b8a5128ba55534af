"""The wire protocol between rank 0 and the stages: message tags and the control message."""
from __future__ import annotations

# Hidden states and snaps alternate between two tags by cycle parity, so that a receive for this
# cycle can be posted while last cycle's from the same peer is still outstanding.
TAG_CTRL, TAG_HIDDEN, TAG_SNAP = 10, 20, 30
OP_CYCLE, OP_STOP = 1, 2
CTRL_FIELDS = 6  # op, cycle, window start, window count, truncate to (-1: none), token entering
