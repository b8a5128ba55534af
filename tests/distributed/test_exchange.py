"""Endpoint.exchange: a cycle's messages posted at once. Under NCCL one group
(batch_isend_irecv, checked here against a stand-in: NCCL needs a GPU per rank); on gloo and
with the draft on a stage, one message at a time."""
from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from spd.distributed.config import Placement
from spd.distributed.protocol import CYCLE_SNAP_TAG, CYCLE_UNIT_TAG
from spd.distributed.transport import Endpoint


class _Work:
    def __init__(self):
        self.waits = 0

    def wait(self, *timeout):
        self.waits += 1
        return True


def _endpoint(backend: str, role: int, draft_on_stage=None) -> Endpoint:
    data, draft = object(), object()
    rt = SimpleNamespace(placement=Placement(3, draft_on_stage), backend=backend,
                         config=SimpleNamespace(stage_through_host=None, fault=None),
                         signer=None, data_group=data, ctrl_group=data,
                         draft_groups=(data if draft_on_stage is None else draft, data),
                         rank=role if draft_on_stage is None else 1, host_staged=0)
    return Endpoint(rt, role, None, store=None)


def test_nccl_posts_a_cycle_as_one_group(monkeypatch):
    """Stage 1's cycle (role 2): its snap to rank 0 and output to stage 2, its next unit from
    stage 0, one group; each receive gets the group's one work; the sends wait with it."""
    ep = _endpoint("nccl", 2)
    groups, work = [], _Work()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: groups.append(ops) or [work])
    # (the real P2POp looks its group up in torch.distributed's registry: not made here)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group, tag: SimpleNamespace(
        op=op, tensor=tensor, peer=peer, group=group, tag=tag))
    snap, out, inbox = torch.randn(4), torch.randn(6), torch.zeros(6)
    got = ep.exchange([(snap, 0, CYCLE_SNAP_TAG), (out, 3, CYCLE_UNIT_TAG)],
                      [(inbox, 1, CYCLE_UNIT_TAG)])
    (ops,) = groups
    assert [(o.op, o.tensor is t, o.peer, o.tag) for o, t in zip(ops, (snap, out, inbox))] == [
        (dist.isend, True, 0, CYCLE_SNAP_TAG), (dist.isend, True, 3, CYCLE_UNIT_TAG),
        (dist.irecv, True, 1, CYCLE_UNIT_TAG)]
    assert {id(o.group) for o in ops} == {id(ep.rt.data_group)}
    assert got == [work]
    assert ep.messages == Counter({("send", "data"): 2, ("recv", "data"): 1})
    ep.order(got[0], 1, "cycle unit")
    ep.flush_sends(host=False)
    assert work.waits == 2 and ep._outgoing == []  # (on the stream under NCCL: no timeout)
    assert ep.exchange([], []) == [] and len(groups) == 1  # nothing to post: no group


@pytest.mark.parametrize("backend,draft_on_stage", [("gloo", None), ("nccl", 1)])
def test_one_message_at_a_time_on_gloo_and_with_the_draft_on_a_stage(monkeypatch, backend,
                                                                     draft_on_stage):
    ep = _endpoint(backend, 3, draft_on_stage)
    posted = []

    def post(kind):
        def fn(tensor, peer, group=None, tag=0):
            posted.append((kind, peer, tag))
            return _Work()
        return fn
    monkeypatch.setattr(dist, "isend", post("send"))
    monkeypatch.setattr(dist, "irecv", post("recv"))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: pytest.fail("a group"))
    works = ep.exchange([(torch.randn(4), 0, CYCLE_SNAP_TAG)], [(torch.zeros(6), 2, 80)])
    assert len(works) == 1
    # receives first, then sends; roles mapped to processes (draft on stage 1: stage 1 is 0)
    recv_from = 2 if draft_on_stage is None else 0
    assert posted == [("recv", recv_from, CYCLE_UNIT_TAG), ("send", 0, CYCLE_SNAP_TAG)]
