"""The pipeline's bookkeeping as a small pure state machine (no model, no tensors).

Positions index the sequence (prompt first). The in-flight window holds `count` consecutive
positions starting at `start`; they form a staircase of depths: the oldest has depth count-1,
the newest depth 0 (only its embedding exists). Everything before `start` is committed with
depth n. Each cycle:

  1. the drafter recomputes its rows [draft_from, newest] and drafts position newest+1;
  2. every in-flight token runs the stage equal to its depth (stage index 0..n-1);
  3. if the window is full (count == n) the oldest token leaves the last stage and its logits
     judge the next one (position start+1):
       accept -> the window slides by one and the draft enters at depth 0;
       reject -> the correction at start+1 becomes the only in-flight token (refill);
     otherwise (filling) the draft simply enters at depth 0.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PipelineSchedule:
    n: int
    start: int = 0       # position of the oldest in-flight token
    count: int = 0       # tokens in flight (<= n)
    draft_from: int = 0  # drafter cache rows valid below this position (depth-n features)

    def seed(self, position: int, drafter_valid: int) -> None:
        """One token in flight at `position` (after prefill); drafter holds rows < drafter_valid."""
        self.start, self.count, self.draft_from = position, 1, drafter_valid

    @property
    def newest(self) -> int:
        return self.start + self.count - 1

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.count)

    def depth(self, position: int) -> int:
        if position < self.start:
            return self.n
        if position > self.newest:
            raise ValueError(f"position {position} is not in the pipeline yet")
        return self.newest - position

    def draft_rows(self) -> range:
        """Rows the drafter must (re)compute this cycle; the last one drafts newest+1."""
        return range(self.draft_from, self.newest + 1)

    def after_draft(self) -> None:
        # Rows before the oldest in-flight token carry final (depth-n) features: keep them.
        self.draft_from = self.start

    def stage_work(self) -> list[tuple[int, int]]:
        """(stage index, position) for every in-flight token, oldest first."""
        return [(self.depth(p), p) for p in self.positions]

    @property
    def full(self) -> bool:
        """True when the oldest token leaves the last stage this cycle (so a draft is judged)."""
        return self.count == self.n

    @property
    def judged(self) -> int:
        return self.start + 1

    def refill(self) -> None:
        assert not self.full
        self.count += 1

    def accept(self) -> None:
        assert self.full
        self.start += 1

    def reject(self) -> None:
        """The correction at start+1 becomes the only in-flight token; callers truncate caches
        to that position."""
        assert self.full
        self.start += 1
        self.count = 1
        self.draft_from = min(self.draft_from, self.start)
