"""A unit: what one stage runs in one cycle, and the one stage step that runs it.

Terms.
  unit      the rows that entered stage 0 in one cycle (W of them: a token tree's candidates at
            one position, or one token), described by an int64 header that travels with them
            from stage to stage: every stage runs the unit the stage before it ran last cycle.
  live      the unit is still in flight. A dead unit (dropped by a rejection, or a bubble where
            nothing entered) runs on, at rows no live row reads before a live one rewrites
            them; only the controller knows a unit died after it was sent, so a stage never
            needs to.
  slot      where a row keeps its K/V in every stage's cache: a chain's row (W = 1) at its
            position; a tree's uncommitted row at capacity + (position mod (n + 1)) * W + lane,
            its committed one at its position. Dead rows write to the trash slot (the last).
  commit    a tree row accepted since the unit before: its K/V are copied from its slot to its
            position in every stage's cache before the unit's rows run (each stage has run that
            row by then; later units read it as prefix).

Header fields (`UnitFormat`, int64): position, end (the cycle every rank stops at, 0 while
unknown), live, prefix_len, commit position, commit slot, tokens [W] (stage 0 embeds them),
then for a tree (W > 1) slots [W], keys [M] and the mask [W, M] (0 / 1) of
spd_kernels.tree_attention: M = n * W keys, slot(position - k, lane) for k < n.

`StageStep.run` is the stage step of every runtime: the in-process stages and the stage ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.model.partition import DepthLayout
from spd.model.target import Stage
from spd_kernels.control import CPOS, CSLOT, END, LIVE, POS, PREFIX, UNIT  # noqa: F401

FIXED = len(UNIT)


@dataclass(frozen=True)
class UnitFormat:
    """The header of a unit for n stages and W rows a unit (module docstring)."""
    n: int
    width: int

    @property
    def tree(self) -> bool:
        return self.width > 1

    @property
    def keys(self) -> int:
        return self.n * self.width if self.tree else 0

    @property
    def tok(self) -> slice:
        return slice(FIXED, FIXED + self.width)

    @property
    def slots(self) -> slice:
        at = FIXED + self.width
        return slice(at, at + (self.width if self.tree else 0))

    @property
    def key_slots(self) -> slice:
        return slice(self.slots.stop, self.slots.stop + self.keys)

    @property
    def mask(self) -> slice:
        return slice(self.key_slots.stop, self.key_slots.stop + self.width * self.keys)

    @property
    def size(self) -> int:
        return self.mask.stop

    def row_bytes(self, d: int, dtype: torch.dtype) -> int:
        """Bytes of the unit's rows [W, d] between stages."""
        return self.width * d * torch.empty((), dtype=dtype).element_size()


def dead_unit(fmt: UnitFormat, position: int, trash: int) -> torch.Tensor:
    """The header [H] of a dead unit at `position` (set-up: a Python-made tensor): its rows,
    keys and commit name the trash slot `trash` (a bubble, or a batch's parked slot)."""
    head = torch.zeros(fmt.size, dtype=torch.int64)
    head[POS], head[PREFIX] = position, position
    head[CPOS] = head[CSLOT] = trash
    head[fmt.slots] = trash
    head[fmt.key_slots] = trash
    return head


def split_message(buf: torch.Tensor, fmt: UnitFormat, d: int, dtype: torch.dtype):
    """A stage-to-stage message (uint8: the header, then the rows) -> (header [H] int64,
    rows [W, d])."""
    h = fmt.size * 8
    return buf[:h].view(torch.int64), buf[h:].view(dtype).view(fmt.width, d)


def message_bytes(fmt: UnitFormat, d: int, dtype: torch.dtype) -> int:
    return fmt.size * 8 + fmt.row_bytes(d, dtype)


class StageStep:
    """Stage s's step of a unit: header [H] int64 and rows x [W, d] (stage 0: None, it embeds
    the header's tokens) -> (its anchor rows, each [W, d], in anchor-slot order; its output
    [W, d]; greedy chain, the last stage's argmax after its row [1], else None)."""

    def __init__(self, stage: Stage, layout: DepthLayout, fmt: UnitFormat, judge: bool):
        self.stage, self.fmt = stage, fmt
        self.target = stage.target
        s = stage.index
        self.first = s == 0
        first_layer = stage.layer_ids.start
        self.anchor_layers = [b - first_layer - 1 for _, b in layout.anchors_of_stage(s)]
        self.anchor_slots = [j for j, _ in layout.anchors_of_stage(s)]
        # the last stage of a greedy chain judges after its layers: its argmax, compared with the
        # draft by the controller (the draft it is given is a stand-in)
        self.judge = (torch.zeros(1, dtype=torch.int64, device=self.target.device)
                      if judge else None)

    def skip(self, head: torch.Tensor) -> None:
        """A dead unit a CPU does not run: only the commit it carries."""
        if self.fmt.tree:
            self.stage.commit_rows(head[CPOS:CPOS + 1], head[CSLOT:CSLOT + 1])

    def run(self, head: torch.Tensor, x: torch.Tensor | None):
        f = self.fmt
        if self.first:
            x = self.target.embed_tokens(head[f.tok])
        pos = head[POS:POS + 1]
        token = None
        if f.tree:
            self.stage.commit_rows(head[CPOS:CPOS + 1], head[CSLOT:CSLOT + 1])
            mask = head[f.mask].view(f.width, f.keys).bool()
            outs = self.stage.tree_run(x, pos, head[f.slots], head[PREFIX:PREFIX + 1],
                                       head[f.key_slots], mask)
        else:
            outs, verdict = self.stage.run(x, pos, self.judge)
            token = None if verdict is None else verdict[0]
        return [outs[i] for i in self.anchor_layers], outs[-1], token
