"""Kernel launches per steady cycle outside the stage and draft steps, on every rank (CPU count).

benchmarks/probe_cycle_launches.py counts them from a dispatch trace (views and allocations left
out, an spd_kernels op counted once, the publish copy counted): on a GPU each is a dependent
launch on the cycle's critical path. A chain's or a token tree's cycle, greedy or sampled,
alone or a batch of 8, and every stage rank's must stay within LIMIT.
"""
from __future__ import annotations

from collections import Counter

import pytest
from conftest import bench_module

probe = bench_module("probe_cycle_launches")
LIMIT = 8
CONTROL = {"spd.cycle_open.default", "spd.cycle_candidate.default", "spd.cycle_commit.default"}
TREE = {"spd.tree_open.default", "spd.tree_children.default", "spd.tree_commit.default"}


@pytest.fixture(scope="module")
def target():
    return probe._target()


@pytest.mark.parametrize("kind,lookup", [("greedy", 0), ("greedy", 2), ("sampled", 2)])
def test_one_sequence(target, kind, lookup):
    ops = probe.count_one(kind, 4, 1, lookup, tokens=16, target=target)
    assert len(ops) <= LIMIT, Counter(ops)
    assert CONTROL <= set(ops)  # (the count saw the cycle's control)


@pytest.mark.parametrize("kind,lookup", [("greedy", 0), ("sampled", 2)])
def test_one_tree(target, kind, lookup):
    ops = probe.count_one(kind, 4, 3, lookup, tokens=16, target=target)
    assert len(ops) <= LIMIT, Counter(ops)
    assert TREE <= set(ops)


@pytest.mark.parametrize("kind,batch,width", [("greedy", 1, 1), ("greedy", 8, 1),
                                              ("sampled", 8, 1), ("sampled", 8, 3)])
def test_a_batch(target, kind, batch, width):
    """The control's ops run once over every slot, and the open draws every sampled slot's
    uniforms (spd_kernels.philox): the count does not grow with the batch."""
    ops = probe.count_batch(kind, batch, 4, width, tokens=16, target=target)
    assert len(ops) <= LIMIT, Counter(ops)
    assert (TREE if width > 1 else CONTROL) <= set(ops)


def _counting_factory(rank: int):
    if rank != 0:
        probe.count_stage_runs()
    return probe._target()


def test_every_stage_rank():
    """n = 3 stage ranks, sampled (the last stage sends its rows back): each rank's cycle
    outside its stage step and its messages."""
    for s, ops in enumerate(probe.count_stage_ranks("sampled", 3, 1, tokens=14, factory=_counting_factory)):
        assert 0 < len(ops) <= LIMIT, (s, Counter(ops))
