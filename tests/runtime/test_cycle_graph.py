"""CycleGraph's replay check (SPD_REPLAY_CHECK): a steady cycle must be the same work, op for
op and tensor for tensor, as the first; what a CUDA graph's replay would repeat."""
from __future__ import annotations

import pytest
import torch

from spd.errors import InternalError
from spd.runtime.cycle_graph import CycleGraph
from spd_kernels.features import anchor_projection


@pytest.fixture(autouse=True)
def checking(monkeypatch):
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")


def _launch(cycle, times: int = 5, **kw) -> CycleGraph:
    g = CycleGraph(cycle, torch.device("cpu"), "test cycle", **kw)
    for _ in range(times):
        g.launch()
    return g


def test_a_cycle_of_device_state_alone_passes():
    state, buf = torch.zeros(4, dtype=torch.int64), torch.randn(8, 3)
    gen = torch.Generator().manual_seed(0)

    def cycle():
        pos = state[:1].clone()
        u = torch.rand(1, generator=gen)
        buf.index_copy_(0, pos % 8, (buf.index_select(0, pos) * u).view(1, 3))
        state[:1] += 1
        state[1] = torch.where(u > 0.5, state[1] + 1, state[1])

    g = _launch(cycle, 6)
    assert g.describe() == {"replays": 0, "checked": 4, "eager": "off"}
    assert state[0] == 6  # it ran


def test_a_python_value_that_changes_between_cycles_is_caught():
    state = torch.zeros(4, dtype=torch.int64)
    count = [0]

    def cycle():
        count[0] += 1
        state[0] += count[0]  # a constant in a graph: the first replay's value for ever

    with pytest.raises(InternalError, match="not the one a CUDA graph would replay"):
        _launch(cycle)


def test_a_new_tensor_kept_from_the_last_cycle_is_caught():
    state = torch.zeros(4)
    kept = [torch.zeros(4)]

    def cycle():
        kept[0] = kept[0] + state  # read by address next cycle: a fresh one each time
        state.add_(1)

    with pytest.raises(InternalError, match="launch=3"):
        _launch(cycle)


def test_a_branch_on_the_host_is_caught():
    state = torch.zeros(2)
    seen = [0]

    def cycle():
        seen[0] += 1
        if seen[0] % 2:  # a host branch: a graph records one side of it
            state.add_(1)
        else:
            state.mul_(2)

    with pytest.raises(InternalError, match="aten.add_"):
        _launch(cycle)


def test_a_kernel_call_is_one_op_and_a_python_constant_a_value():
    """anchor_projection's CPU reference reads its types on the host (the GPU kernel does not):
    under the check it is one op. `x[k:] = False` lifts a Python constant: compared by value."""
    torch.manual_seed(0)
    anchors, weights = torch.randn(2, 3, 8), [torch.randn(8, 8), torch.randn(8, 16)]
    types = torch.zeros(3, dtype=torch.int64)
    out = torch.zeros(3, 8)
    keep = torch.ones(6, dtype=torch.bool)

    def cycle():
        types.copy_(torch.randint(0, 2, (3,)))
        out.copy_(anchor_projection(anchors, types, weights))
        keep[3:] = False

    _launch(cycle, 6)
    with pytest.raises(InternalError):  # and the check does look inside a cycle's ops
        _launch(lambda: out.add_(torch.full((3, 8), float(torch.rand(1)))))


def test_a_cycle_that_is_not_replayable_is_not_checked():
    count = [0]

    def cycle():
        count[0] += 1
        torch.zeros(count[0])

    g = _launch(cycle, replayable=False)
    assert g.describe() == {"replays": 0, "checked": 0, "eager": "not the same work every cycle"}
