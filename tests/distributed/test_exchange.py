"""Endpoint.exchange: a cycle's messages posted at once. Under NCCL one group
(batch_isend_irecv, checked here against a stand-in: NCCL needs a GPU per rank), with the draft
on a stage too (its process runs both roles' messages, one group a hand-off); on gloo one
message at a time, receives first."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from spd.distributed.config import Placement
from spd.distributed.messages import SNAP_TAG, UNIT_TAG
from spd.distributed.transport import Endpoint


class _Work:
    def __init__(self):
        self.waits = 0

    def wait(self, *timeout):
        self.waits += 1
        return True


def _endpoint(backend: str, process: int, draft_on_stage=None) -> Endpoint:
    placement = Placement(3, draft_on_stage)
    rt = SimpleNamespace(placement=placement, backend=backend,
                         config=SimpleNamespace(stage_through_host=None, fault=None),
                         signer=None, data_group=object(), rank=process, host_staged=0)
    return Endpoint(rt, placement.roles_of(process)[0], store=None)


def _group(monkeypatch) -> tuple[list, _Work]:
    groups, work = [], _Work()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: groups.append(ops) or [work])
    # (the real P2POp looks its group up in torch.distributed's registry: not made here)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group, tag: SimpleNamespace(
        op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    return groups, work


def test_nccl_posts_a_cycle_as_one_group(monkeypatch):
    """Stage 1's cycle (role 2): its snap to rank 0 and output to stage 2, its next unit from
    stage 0, one group; each receive gets the group's one work; the sends wait with it."""
    ep = _endpoint("nccl", 2)
    groups, work = _group(monkeypatch)
    snap, out, inbox = torch.randn(4), torch.randn(6), torch.zeros(6)
    got = ep.exchange([(snap, 0, SNAP_TAG), (out, 3, UNIT_TAG)], [(inbox, 1, UNIT_TAG)])
    (ops,) = groups
    assert [(o.op, o.tensor is t, o.peer, o.tag) for o, t in zip(ops, (snap, out, inbox))] == [
        (dist.isend, True, 0, SNAP_TAG), (dist.isend, True, 3, UNIT_TAG),
        (dist.irecv, True, 1, UNIT_TAG)]
    assert {id(o.group) for o in ops} == {id(ep.rt.data_group)}
    assert got == [work]
    assert ep.messages == Counter({("send", "data"): 2, ("recv", "data"): 1})
    ep.order(got[0], 1, "cycle unit")
    ep.flush_sends(host=False)
    assert work.waits == 2 and ep._outgoing == []  # (on the stream under NCCL: no timeout)
    assert ep.exchange([], []) == [] and len(groups) == 1  # nothing to post: no group


def test_nccl_with_the_draft_on_a_stage_maps_roles_to_processes(monkeypatch):
    """Process 0 runs the draft rank and stage 1 (n = 3): stage 1's output to stage 2 (role 3,
    process 2) and its next unit from stage 0 (role 1, process 1), one group; a message to a
    role of its own process is an internal fault."""
    ep = _endpoint("nccl", 0, draft_on_stage=1)
    groups, _ = _group(monkeypatch)
    ep.exchange([(torch.randn(6), 3, UNIT_TAG)], [(torch.zeros(6), 1, UNIT_TAG)])
    (ops,) = groups
    assert [(o.op, o.peer) for o in ops] == [(dist.isend, 2), (dist.irecv, 1)]
    with pytest.raises(Exception, match="a role of this process"):
        ep.exchange([(torch.randn(6), 2, UNIT_TAG)], [])


def test_gloo_posts_one_message_at_a_time(monkeypatch):
    ep = _endpoint("gloo", 3)
    posted = []

    def post(kind):
        def fn(tensor, peer, group=None, tag=0):
            posted.append((kind, peer, tag))
            return _Work()
        return fn
    monkeypatch.setattr(dist, "isend", post("send"))
    monkeypatch.setattr(dist, "irecv", post("recv"))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pytest.fail("a group"))
    works = ep.exchange([(torch.randn(4), 0, SNAP_TAG)], [(torch.zeros(6), 2, UNIT_TAG)])
    assert len(works) == 1
    assert posted == [("recv", 2, UNIT_TAG), ("send", 0, SNAP_TAG)]  # receives first
