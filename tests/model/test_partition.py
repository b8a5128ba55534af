import pytest

from spd.errors import SPDError
from spd.model.partition import (
    DepthLayout,
    check_anchors,
    default_anchors,
    parse_split,
    partition_layers,
)


def test_uniform_split_larger_first():
    assert [len(r) for r in partition_layers(30, 4)] == [8, 8, 7, 7]
    assert [len(r) for r in partition_layers(30, 6)] == [5] * 6
    ranges = partition_layers(7, 3)
    assert [(r.start, r.stop) for r in ranges] == [(0, 3), (3, 5), (5, 7)]


def test_explicit_split():
    assert [len(r) for r in partition_layers(30, 4, [10, 10, 5, 5])] == [10, 10, 5, 5]
    assert parse_split("8,8,7,7") == [8, 8, 7, 7]


@pytest.mark.parametrize("n,split,msg", [
    (31, None, "at most one stage per layer"),
    (0, None, "positive integer"),
    (4, [8, 8, 7, 6], "sums to 29"),
    (4, [8, 8, 14], "has 3 entries"),
    (3, [15, 15, 0], "at least one layer"),
])
def test_bad_splits(n, split, msg):
    with pytest.raises(SPDError, match=msg):
        partition_layers(30, n, split)


def test_default_anchors():
    assert default_anchors(32) == [0, 8, 16, 24, 31]
    assert default_anchors(30) == [0, 8, 15, 23, 29]
    assert default_anchors(2) == [0, 1]
    for L in range(1, 40):
        a = default_anchors(L)
        assert a[0] == 0 and a == sorted(set(a)) and a[-1] <= L


@pytest.mark.parametrize("anchors,msg", [
    ([1, 8], "start with 0"), ([0, 8, 8], "strictly increasing"), ([0, 31], "out of range"),
    ([], "start with 0")])
def test_bad_anchors(anchors, msg):
    with pytest.raises(SPDError, match=msg):
        check_anchors(anchors, 30)


def test_depth_types_follow_stage_boundaries():
    lay = DepthLayout.build(30, 4, None, [0, 8, 15, 23, 29])
    assert [lay.layers_done(k) for k in range(5)] == [0, 8, 16, 23, 30]
    assert [lay.agg_type(k) for k in range(5)] == [0, 1, 2, 3, 4]
    lay6 = DepthLayout.build(30, 6, None, [0, 8, 15, 23, 29])
    assert [lay6.agg_type(k) for k in range(7)] == [0, 0, 1, 2, 2, 3, 4]
    assert lay6.types == [0, 1, 2, 3, 4]
    # Each anchor is produced by exactly one stage (the embedding by none: it precedes stage 1).
    produced = [j for s in range(lay6.n) for j, _ in lay6.anchors_of_stage(s)]
    assert produced == [1, 2, 3, 4]
    lay2 = DepthLayout.build(30, 2, None, [0, 8, 15, 23, 29])
    assert [lay2.agg_type(k) for k in range(3)] == [0, 2, 4] and lay2.types == [0, 2, 4]
