"""Which sequences each training step reads, and their features: online or from the cache.

Terms:
- **global batch**: the sequences of one optimiser step, over every rank and micro-batch;
- **micro-batch**: the sequences one rank runs through one forward (its teacher forward and its
  packed PDM forwards); a rank accumulates `accumulate` micro-batches a step;
- **global index** g: sequence g of the data stream (spd.train.corpus); step s reads
  g in [s * B, (s + 1) * B), and rank r of W the g with g % W == r.

Each sequence's own randomness (its fill level and crop window) comes from a generator seeded by
the run's seed and g alone, so a step reads the same windows at the same fill levels whatever
the number of ranks or micro-batches, and a run resumes from its step count alone.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from spd.errors import SPDError


@dataclass
class Piece:
    """One sequence window of a micro-batch with its fill level. item: tokens [T] int32,
    anchors [m, T, d], final [T, d], argmax [T] int32 (a FeatureSet item, or the teacher's)."""
    item: dict   # (and mask [T] bool where only some rows count: spd.train.teacher)
    fill: int
    index: int  # global index


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int   # sequences per optimiser step, all ranks together
    micro_batch: int    # sequences per forward on one rank
    world: int = 1

    def __post_init__(self):
        if self.global_batch < 1 or self.micro_batch < 1:
            raise SPDError(f"batch sizes must be >= 1 (global {self.global_batch}, micro "
                           f"{self.micro_batch})")
        if self.global_batch % (self.world * self.micro_batch):
            raise SPDError(f"the global batch ({self.global_batch} sequences) must be a multiple "
                           f"of ranks x micro-batch ({self.world} x {self.micro_batch})")

    @property
    def accumulate(self) -> int:
        """Micro-batches a rank runs per optimiser step."""
        return self.global_batch // (self.world * self.micro_batch)

    def indices(self, step: int, rank: int) -> list[list[int]]:
        """Global indices of rank `rank`'s micro-batches at `step`."""
        first = step * self.global_batch
        mine = [g for g in range(first, first + self.global_batch) if g % self.world == rank]
        m = self.micro_batch
        return [mine[a:a + m] for a in range(0, len(mine), m)]


def sequence_rng(seed: int, index: int) -> random.Random:
    return random.Random(f"{seed}:sequence:{index}")


def window(length: int, crop_len: int, rng: random.Random) -> tuple[int, int]:
    """[a, b) of a random window of crop_len tokens (the whole sequence if shorter; crop_len 0:
    always the whole sequence)."""
    if crop_len <= 0 or length <= crop_len:
        return 0, length
    a = rng.randint(0, length - crop_len)
    return a, a + crop_len


def cut(item: dict, a: int, b: int) -> dict:
    return {k: (v[:, a:b] if k == "anchors" else v[a:b]) for k, v in item.items()}


FillOf = Callable[[random.Random], int]  # a sequence's generator -> its fill level


class OnlineBatches:
    """Micro-batches whose features the frozen target computes now (spd.train.teacher)."""

    def __init__(self, corpus, teacher, plan: BatchPlan, rank: int, crop_len: int, seed: int,
                 fill_of: FillOf):
        self.corpus, self.teacher, self.plan, self.rank = corpus, teacher, plan, rank
        self.crop_len, self.seed, self.fill_of = crop_len, seed, fill_of
        self._stream = None
        self._next = None  # global index the stream yields next (None: not opened)

    def _sequences(self, indices: list[int]) -> list[list[int]]:
        if self._next is None or self._next > indices[0]:
            self._stream = self.corpus.stream(indices[0], self.rank, self.plan.world)
        out = []
        for want in indices:
            g, ids = next(self._stream)
            while g < want:  # a step skipped (resume): read past it
                g, ids = next(self._stream)
            out.append(ids)
            self._next = g + 1
        return out

    def step(self, step: int) -> list[list[Piece]]:
        batches = []
        for indices in self.plan.indices(step, self.rank):
            seqs = self._sequences(indices)
            spans, fills = [], []
            for g, ids in zip(indices, seqs):
                rng = sequence_rng(self.seed, g)
                fills.append(self.fill_of(rng))
                spans.append(window(len(ids), self.crop_len, rng))
            # the teacher reads each window with the context before it
            items = self.teacher([ids[:b] for ids, (_, b) in zip(seqs, spans)])
            batches.append([Piece(cut(it, a, b), f, g) for it, (a, b), f, g
                            in zip(items, spans, fills, indices)])
        return batches


class CachedBatches:
    """Micro-batches of extracted features held in memory (spd.train.distill.FeatureSet items):
    global index g reads item perm_e[g mod N] of epoch e = g div N, each epoch's permutation
    seeded by the run's seed."""

    def __init__(self, items: list[dict], plan: BatchPlan, rank: int, crop_len: int, seed: int,
                 fill_of: FillOf):
        if not items:
            raise SPDError("no training sequences")
        self.items, self.plan, self.rank = items, plan, rank
        self.crop_len, self.seed, self.fill_of = crop_len, seed, fill_of
        self._perm: tuple[int, list[int]] | None = None

    def _item(self, g: int) -> dict:
        n = len(self.items)
        epoch = g // n
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(n))
            random.Random(f"{self.seed}:epoch:{epoch}").shuffle(order)
            self._perm = (epoch, order)
        return self.items[self._perm[1][g % n]]

    def step(self, step: int) -> list[list[Piece]]:
        batches = []
        for indices in self.plan.indices(step, self.rank):
            pieces = []
            for g in indices:
                item = self._item(g)
                rng = sequence_rng(self.seed, g)
                fill = self.fill_of(rng)
                a, b = window(len(item["tokens"]), self.crop_len, rng)
                pieces.append(Piece(cut(item, a, b), fill, g))
            batches.append(pieces)
        return batches


def packs(pieces: list[Piece], pack_tokens: int) -> list[list[Piece]]:
    """Pieces grouped, in order, into packs of at most pack_tokens tokens (a longer piece is a
    pack of its own; pack_tokens 0: one piece a pack)."""
    out, cur, size = [], [], 0
    for p in pieces:
        t = len(p.item["tokens"])
        if cur and (pack_tokens <= 0 or size + t > pack_tokens):
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += t
    if cur:
        out.append(cur)
    return out


__all__ = ["BatchPlan", "CachedBatches", "OnlineBatches", "Piece", "cut", "packs",
           "sequence_rng", "window"]
