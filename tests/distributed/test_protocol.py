"""The unit message's layout (spd.distributed.protocol.UnitMessage), on the CPU."""
from __future__ import annotations

import pytest
import torch

from spd.distributed.protocol import (
    HEADER_BYTES,
    STOP,
    UNIT,
    UNIT_BYTES,
    UnitMessage,
    is_header,
    row_bytes,
)


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
