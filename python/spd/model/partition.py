"""Cutting the target's L layers into n contiguous pipeline stages, and what each depth sees.

A token's depth k in {0..n} is how many stages it has completed; l_max(k) is the number of layers
in stages 1..k. Anchor layers B = [b_0=0, ..., b_{m-1}] are hidden-state indices (0 = embedding
output, l = output of layer l). A token at depth k has the anchors with b_j <= l_max(k), always a
prefix b_0..b_e; e(k) is its aggregation type.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from spd.errors import SPDError

log = logging.getLogger(__name__)


AUTO = "auto"  # --split auto: balanced_split over spd.model.stage_costs' cost model


def parse_split(text: str | None) -> list[int] | str | None:
    """'8,8,7,7' -> [8, 8, 7, 7]; 'auto' -> AUTO (resolved once the model's costs are known:
    spd.model.stage_costs.resolve_split); None/'' -> None."""
    if not text:
        return None
    if str(text).strip().lower() == AUTO:
        return AUTO
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


def stage_times(layer_costs: Sequence[float], split: Sequence[int], last_extra: float = 0.0,
                extra: dict[int, float] | None = None) -> list[float]:
    """Each stage's time under `split`: its layers' costs, plus `last_extra` on the last stage
    (final norm + LM head + verify) and `extra[s]` on stage s (e.g. a draft step sharing its
    device)."""
    times, start = [], 0
    for s, size in enumerate(split):
        t = sum(layer_costs[start:start + size]) + (extra or {}).get(s, 0.0)
        times.append(t + (last_extra if s == len(split) - 1 else 0.0))
        start += size
    return times


def balanced_split(layer_costs: Sequence[float], n: int, last_extra: float = 0.0,
                   extra: dict[int, float] | None = None) -> list[int]:
    """The contiguous split of the layers into n stages (each >= 1 layer) whose slowest stage is
    fastest (stage_times: the last stage also pays `last_extra`, stage s `extra[s]`); among
    those, the one whose fastest stage is slowest (the times as even as they can be); among
    those, the largest stages first, like the uniform default (equal costs and no extras give
    exactly partition_layers' split). With equal layer costs (or a hybrid's periodic ones) the
    stage times then differ by at most one layer's cost, unless a stage with extra work is
    down to one layer.

    Every stage keeps at least one layer even where an extra alone exceeds the others' cycle
    (a draft dearer than a stage): that stage then holds one layer and is the cycle, and a
    warning says so, since no split hides such work. Raises SPDError for n outside
    1..len(layer_costs), a stage index of `extra` outside 0..n-1, or a negative cost."""
    costs = [float(c) for c in layer_costs]
    L, extra = len(costs), dict(extra or {})
    if int(n) != n or n < 1:
        raise SPDError(f"number of stages must be a positive integer, got {n}")
    if n > L:
        raise SPDError(f"cannot cut a {L}-layer model into {n} stages (at most one stage per "
                       f"layer: use --stages <= {L})")
    bad = [s for s in extra if not (isinstance(s, int) and 0 <= s < n)]
    if bad:
        raise SPDError(f"extra work on stage(s) {bad}: stages are numbered 0..{n - 1}")
    if any(c < 0 for c in costs) or last_extra < 0 or any(v < 0 for v in extra.values()):
        raise SPDError("stage costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # comparisons allow for float rounding of sums of the same costs taken in another order
    eps = 1e-9 * (prefix[-1] + last_extra + sum(extra.values()) + 1e-30)

    def seg(s: int, i: int, j: int) -> float:  # stage s holding layers i..j-1
        return (prefix[j] - prefix[i] + extra.get(s, 0.0)
                + (last_extra if s == n - 1 else 0.0))

    inf = float("inf")
    # best[s][j]: the least possible slowest stage of stages 0..s holding layers 0..j-1
    best = [[inf] * (L + 1) for _ in range(n)]
    for j in range(1, L - n + 2):
        best[0][j] = seg(0, 0, j)
    for s in range(1, n):
        for j in range(s + 1, L - n + s + 2):
            best[s][j] = min(max(best[s - 1][i], seg(s, i, j)) for i in range(s, j))
    hi = best[n - 1][L]
    # most[s][j]: the largest possible fastest stage, with no stage above hi
    most = [[-inf] * (L + 1) for _ in range(n)]
    for j in range(1, L - n + 2):
        if seg(0, 0, j) <= hi + eps:
            most[0][j] = seg(0, 0, j)
    for s in range(1, n):
        for j in range(s + 1, L - n + s + 2):
            most[s][j] = max((min(most[s - 1][i], seg(s, i, j)) for i in range(s, j)
                              if seg(s, i, j) <= hi + eps), default=-inf)
    lo = most[n - 1][L]
    # fits[s][i]: layers i..L-1 split into stages s..n-1, every stage time within [lo, hi]
    fits = [[False] * (L + 1) for _ in range(n + 1)]
    fits[n][L] = True
    for s in range(n - 1, -1, -1):
        for i in range(L):
            fits[s][i] = any(fits[s + 1][j] and lo - eps <= seg(s, i, j) <= hi + eps
                             for j in range(i + 1, L + 1))
    split, i = [], 0
    for s in range(n):  # the largest stage that still lets the rest fit
        j = max(j for j in range(i + 1, L + 1)
                if fits[s + 1][j] and lo - eps <= seg(s, i, j) <= hi + eps)
        split.append(j - i)
        i = j
    times = stage_times(costs, split, last_extra, extra)
    for s, t in enumerate(times):
        own = extra.get(s, 0.0) + (last_extra if s == n - 1 else 0.0)
        if n > 1 and split[s] == 1 and own > 0 and t > max(times[:s] + times[s + 1:]) + eps:
            log.warning("stage %d keeps one layer and is still the slowest (%.3g against "
                        "%.3g for the others): its extra work does not fit in one cycle",
                        s, t, max(times[:s] + times[s + 1:]))
    return split


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
