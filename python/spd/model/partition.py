"""Cutting the target's L layers into n contiguous pipeline stages, and what each depth sees.

A token's depth k in {0..n} is how many stages it has completed; l_max(k) is the number of layers
in stages 1..k. Anchor layers B = [b_0=0, ..., b_{m-1}] are hidden-state indices (0 = embedding
output, l = output of layer l). A token at depth k has the anchors with b_j <= l_max(k), always a
prefix b_0..b_e; e(k) is its aggregation type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from spd.errors import SPDError


def parse_split(text: str | None) -> list[int] | None:
    """'8,8,7,7' -> [8, 8, 7, 7]; None/'' -> None."""
    if not text:
        return None
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as exc:
        raise SPDError(f"stage split must be comma-separated integers like 8,8,7,7, got '{text}'") from exc


def partition_layers(num_layers: int, n_stages: int, split: Sequence[int] | None = None
                     ) -> list[range]:
    """Layer ranges of each stage. Uniform by default (sizes differ by at most one, larger first)."""
    if int(n_stages) != n_stages or n_stages < 1:
        raise SPDError(f"number of stages must be a positive integer, got {n_stages}")
    if n_stages > num_layers:
        raise SPDError(f"cannot cut a {num_layers}-layer model into {n_stages} stages "
                       f"(at most one stage per layer: use --stages <= {num_layers})")
    if split is None:
        base, extra = divmod(num_layers, n_stages)
        split = [base + (1 if s < extra else 0) for s in range(n_stages)]
    split = list(split)
    if len(split) != n_stages:
        raise SPDError(f"stage split {split} has {len(split)} entries but there are {n_stages} stages")
    if any(int(s) != s or s < 1 for s in split):
        raise SPDError(f"every stage needs at least one layer; got split {split}")
    if sum(split) != num_layers:
        raise SPDError(f"stage split {split} sums to {sum(split)} but the model has {num_layers} layers")
    ranges, start = [], 0
    for size in split:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def default_anchors(num_layers: int) -> list[int]:
    """Embedding, quarter points and the second-to-last layer output ([0,8,16,24,31] for L=32)."""
    points = [0] + [int(i * num_layers / 4 + 0.5) for i in (1, 2, 3)] + [num_layers - 1]
    return sorted({p for p in points if 0 <= p <= max(num_layers - 1, 0)})


def check_anchors(anchors: Sequence[int], num_layers: int) -> list[int]:
    anchors = [int(a) for a in anchors]
    if not anchors or anchors[0] != 0:
        raise SPDError(f"anchor layers must start with 0 (the embedding output), got {anchors}")
    if any(b <= a for a, b in zip(anchors, anchors[1:])):
        raise SPDError(f"anchor layers must be strictly increasing, got {anchors}")
    if anchors[-1] > num_layers:
        raise SPDError(f"anchor layer {anchors[-1]} is out of range: hidden-state indices of a "
                       f"{num_layers}-layer model run from 0 to {num_layers}")
    return anchors


@dataclass(frozen=True)
class DepthLayout:
    """Stage boundaries plus anchors: which anchors a token at each depth has (its type)."""
    stages: tuple[range, ...]
    anchors: tuple[int, ...]

    @classmethod
    def build(cls, num_layers: int, n_stages: int, split=None, anchors=None) -> "DepthLayout":
        stages = partition_layers(num_layers, n_stages, split)
        anchors = check_anchors(default_anchors(num_layers) if anchors is None else anchors,
                                num_layers)
        return cls(tuple(stages), tuple(anchors))

    @property
    def n(self) -> int:
        return len(self.stages)

    @property
    def split(self) -> list[int]:
        return [len(r) for r in self.stages]

    def layers_done(self, depth: int) -> int:
        """l_max(k): layers completed by a token at depth k."""
        return sum(len(r) for r in self.stages[:depth])

    def agg_type(self, depth: int) -> int:
        lm = self.layers_done(depth)
        return max(j for j, b in enumerate(self.anchors) if b <= lm)

    @property
    def types(self) -> list[int]:
        """The aggregation types that occur at some depth 0..n (one projection each)."""
        return sorted({self.agg_type(k) for k in range(self.n + 1)})

    def anchors_of_stage(self, s: int) -> list[tuple[int, int]]:
        """(anchor slot j, hidden index b_j) produced by stage s (0-based): b_j in (start, end]."""
        r = self.stages[s]
        return [(j, b) for j, b in enumerate(self.anchors) if r.start < b <= r.stop]
