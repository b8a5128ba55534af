"""One sequence's decode as the controller holds it: its request, buffers, generator and output.

The cycle (spd.runtime.cycle) reads and writes these buffers on the device; the host sees the
sequence only through what each cycle publishes (the committed token, whether it ended), which it
emits here: stop strings, the token callback and the output list.

Buffers, one row per position, then a token tree's slots (spd.runtime.unit), then a trash row
that dead rows write to:
  tokens   [rows] int64: the prompt, the committed tokens, the rows in flight
  anchors  [m, rows, d]: each row's anchor hidden states (slot 0: the embedding)
  final    [rows, d]: the last stage's output of each row (what judges the next position)
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from spd.errors import InternalError, SPDError
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd.runtime.verdict import pick

if TYPE_CHECKING:
    from spd.model.partition import DepthLayout
    from spd.model.target import TargetModel


def check_tree_width(width) -> int:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= 16:
        raise SPDError(f"tree width must be an integer in [1, 16] (1: a chain), got {width!r}")
    return width


def slot_buffers(target: TargetModel, layout: DepthLayout, rows: int,
                 slots: int | None = None) -> tuple:
    """A sequence's buffers for up to `rows` rows (module docstring): (tokens [rows] int64,
    anchors [m, rows, d], final [rows, d]); with `slots`, those of that many sequences, the
    slot first ([slots, ...] each: slot b's are [b])."""
    t, first = target, () if slots is None else (slots,)
    return (torch.zeros(*first, rows, dtype=torch.int64, device=t.device),
            torch.zeros(*first, len(layout.anchors), rows, t.hidden_size, device=t.device,
                        dtype=t.dtype),
            torch.zeros(*first, rows, t.hidden_size, device=t.device, dtype=t.dtype))


class SlotRows:
    """Where a batch keeps its slots' stage rows (`slot_buffers` of several sequences): each
    stage's anchor rows and the last stage's output at the rows each slot's unit occupies
    this cycle (Cycle.keep, for every slot at once). rows [slots, n, W] int64: where each
    stage's unit rows land (the control's plan, which the open writes: a bubble's at its
    trash row); anchors [slots, m, C, d]; final [slots, C, d]."""

    def __init__(self, layout: DepthLayout, rows: torch.Tensor, anchors: torch.Tensor,
                 final: torch.Tensor):
        self.n, self.rows, self.anchors, self.final = layout.n, rows, anchors, final
        self.stage_slots = [[j for j, _ in layout.anchors_of_stage(s)] for s in range(layout.n)]

    def keep(self, s: int, idx: torch.Tensor, anchors: list[torch.Tensor],
             out: torch.Tensor | None) -> None:
        """Stage s's rows of the slots idx [R]: anchors (its anchor rows in slot order, each
        [R W, d] or [R, W, d]) and out (its output, likewise; None where nothing reads it)."""
        rows = self.rows[:, s].index_select(0, idx)                       # [R, W]
        at = (idx.view(-1, 1).expand_as(rows), rows)
        for j, x in zip(self.stage_slots[s], anchors):
            self.anchors[:, j].index_put_(at, x.reshape(*rows.shape, -1))
        if s == self.n - 1 and out is not None:
            self.final.index_put_(at, out.reshape(*rows.shape, -1))


class Sequence:
    """One sequence's SPD decode. Construct it after `check_prompt`; prefill the prompt through
    the stages (their anchor rows into `anchors[:, :prompt_len]`, `keep_anchors`), `start`, run
    the cycles (spd.runtime.cycle), then `finish`. width: candidate rows per position (1: a
    chain; > 1: a token tree, which needs a PDM drafter and a dense target). `buffers`: a
    batch slot's (tokens, anchors, final) allocated once for its most rows (`slot_buffers`);
    this sequence uses their first rows (else its own are made)."""

    def __init__(self, target: TargetModel, layout: DepthLayout, drafter, ids: torch.Tensor,
                 max_new: int, sampling: SamplingParams, stats: DecodeStats,
                 on_token: Callable[[int], None] | None = None, stop: StopRule | None = None,
                 width: int = 1, buffers: tuple | None = None):
        t, n = target, layout.n
        self.target, self.layout, self.n = target, layout, n
        self.width = check_tree_width(width)
        if self.width > 1 and getattr(drafter, "tree_top", None) is None:
            raise SPDError("tree drafting needs the PDM drafter (it reads the PDM's logits)")
        self.drafter, self.sampling, self.stats, self.on_token = drafter, sampling, stats, on_token
        stats.tree_width = self.width
        self.max_new = max_new
        self.stop = stop if stop is not None else StopRule(t.eos_token_ids)
        self.prompt_len = ids.numel()
        self.capacity = self.prompt_len + max_new + n + 2
        tree_rows = (n + 1) * self.width if self.width > 1 else 0
        self.buffer_rows = self.capacity + tree_rows + 1
        self.trash = self.buffer_rows - 1
        drafter.begin(self.buffer_rows, t.vocab_size)
        dev, rows = t.device, self.buffer_rows
        if buffers is None:
            buffers = slot_buffers(t, layout, rows)
        else:
            if buffers[0].shape[0] < rows:
                raise InternalError("a slot's buffers are smaller than its sequence",
                                    rows=rows, slot_rows=buffers[0].shape[0])
            buffers = (buffers[0][:rows], buffers[1][:, :rows], buffers[2][:rows])
            for b in buffers:
                b.zero_()  # (the slot's last sequence's rows gone)
        self.tokens, self.anchors, self.final = buffers
        self.tokens[:self.prompt_len] = ids
        # the anchor slots each stage produces (layout.anchors_of_stage), in slot order
        self.stage_slots = [[j for j, _ in layout.anchors_of_stage(s)] for s in range(n)]
        self.type_of_depth = torch.tensor([layout.agg_type(k) for k in range(n + 1)],
                                          device=dev)
        self.lookup_min = getattr(drafter, "lookup", 0)
        # post-step drafting (an ablation) waits for the stages: features one stage deeper
        self.post_step = getattr(drafter, "post_step", False)
        self.gen = torch.Generator(dev).manual_seed(sampling.seed)
        self.out: list[int] = []
        self.done = False
        self._decode_t0 = 0.0

    @property
    def device(self) -> torch.device:
        return torch.device(self.target.device)

    def keep_anchors(self, stage: int, position: int, rows) -> None:
        """Stage `stage`'s anchor rows for positions position.. (rows[i]: [T, d], the i-th
        anchor that stage produces, in slot order) into `anchors`."""
        for i, j in enumerate(self.stage_slots[stage]):
            r = rows[i]
            self.anchors[j, position:position + r.shape[0]] = r

    def start(self, last_hidden: torch.Tensor, prefill_t0: float) -> int:
        """After the prompt's prefill: `last_hidden` [1, d] is the last prompt row's final state.
        The target picks the first token (emitted here), the drafter caches the prompt's
        depth-n features, and the decode clock starts. Returns the first token."""
        t, n, P = self.target, self.n, self.prompt_len
        first = pick(t.logits(last_hidden)[0], self.sampling, self.gen)
        self.drafter.prefill(self.anchors[:, :P], self.type_of_depth[n].repeat(P))
        self.tokens[P] = first
        self.anchors[0, P] = t.embed_tokens(self.tokens[P:P + 1])[0]
        self.stats.prefill_s = time.perf_counter() - prefill_t0
        self.emit(first)
        self._decode_t0 = time.perf_counter()
        return first

    def emit(self, token: int) -> None:
        """A committed token reaches the host: the output, the stop rule, the callback."""
        self.out.append(token)
        self.done = self.stop.feed(token) or len(self.out) >= self.max_new
        if self.on_token:
            self.on_token(token)

    def finish(self, at: float | None = None) -> None:
        """Stop the decode clock (now, or at the perf_counter time `at`)."""
        self.stats.decode_s = (time.perf_counter() if at is None else at) - self._decode_t0
        self.stats.new_tokens = len(self.out)
