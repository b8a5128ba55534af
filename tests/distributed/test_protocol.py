"""The unit message's layout and the rings of buffers (spd.distributed.protocol), on the CPU."""
from __future__ import annotations

import pytest
import torch

from spd.distributed.protocol import (
    HEADER_BYTES,
    STOP,
    UNIT,
    UNIT_BYTES,
    Ring,
    UnitMessage,
    is_header,
    row_bytes,
)
from spd.errors import InternalError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_message_is_one_buffer_with_the_header_in_front(dtype):
    d = 6
    msg = UnitMessage(row_bytes(d, dtype), "cpu", folded=True)
    row = torch.arange(d, dtype=dtype).view(1, d) + 0.5
    msg.set_header(UNIT, 7)
    msg.write_row(torch.tensor([41]), row)
    assert msg.data is msg.wire and msg.wire.dtype == torch.uint8
    assert msg.wire.numel() == HEADER_BYTES + 8 + d * row.element_size()
    # the header is a view of the message's first bytes, and the only marked tensor
    assert msg.header.data_ptr() == msg.wire.data_ptr() and msg.header.tolist() == [UNIT, 7]
    assert is_header(msg.header)
    assert not is_header(msg.wire) and not is_header(msg.payload)
    assert not is_header(msg.wire[:HEADER_BYTES].view(torch.int64))  # another view: counted
    pos, got = msg.row(d, dtype)
    assert pos.tolist() == [41] and torch.equal(got, row)
    assert msg.payload.data_ptr() == msg.wire.data_ptr() + HEADER_BYTES  # no copy on the CPU


def test_rank0_unit_and_two_message_form():
    folded = UnitMessage(UNIT_BYTES, "cpu", folded=True)
    folded.set_header(STOP, 3)
    folded.write_unit(12, torch.tensor(99))
    assert folded.wire.view(torch.int64).tolist() == [STOP, 3, 12, 99]
    two = UnitMessage(UNIT_BYTES, "cpu", folded=False)  # NCCL's form (here on the CPU)
    two.set_header(UNIT, 1)
    two.write_unit(5, 8)
    assert two.data is two.payload and two.wire is None
    assert is_header(two.header) and two.header.tolist() == [UNIT, 1]
    assert [x.tolist() for x in two.unit()] == [[5], [8]]


def test_ring_takes_in_turn_and_refuses_a_buffer_in_flight():
    made = []
    ring = Ring(lambda: made.append(torch.zeros(1)) or made[-1], 3, "tests",
                busy=lambda buf, owner: owner == "in flight")
    got = [ring.take("done") for _ in range(4)]
    assert len(made) == 3 and got[0] is got[3] and len({id(x) for x in got[:3]}) == 3
    ring.take("in flight")  # slot 1
    ring.take("done")       # slot 2
    ring.take("done")       # slot 0
    with pytest.raises(InternalError, match=r"ring of tests came round to a buffer still.*depth=3"):
        ring.take()         # slot 1 again, still in flight
