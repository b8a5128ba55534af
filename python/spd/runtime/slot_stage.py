"""One stage of the target over the slots of a batch: its step over one unit of each of several
sequences (docs/batching.md). The one-process batch (spd.runtime.batch_spd) holds one a stage;
a stage rank of a distributed batch session (spd.distributed.batch_stage) holds its own."""
from __future__ import annotations

import torch

from spd.model.hybrid import full_width_rope
from spd.model.target import Stage
from spd.runtime.unit import CPOS, CSLOT, FIXED, LIVE, POS, PREFIX, UnitFormat
from spd_kernels.hybrid_stage import batch_hybrid_stage_step
from spd_kernels.stage import batch_stage_step, batch_tree_stage_step


class SlotStage:
    """Stage s (the layers layout.stages[s]) over `slots` sequences of `context` rows: its
    weights, its KV cache k, v [slots, layers, kv_heads, context, head_dim] (allocated once),
    the RoPE tables, and each slot's `Stage` view of its rows (a prompt's prefill). On a hybrid
    target each slot's Stage has a cache of its own (its attention layers' KV and its DeltaNet
    state rings, spd.model.hybrid.HybridCache, all made here at once; k and v are None)."""

    def __init__(self, target, layout, s: int, slots: int, context: int):
        t, r = target, layout.stages[s]
        self.target, self.layout, self.s, self.layers = t, layout, s, r
        self.slots, self.context = slots, context
        self.weights = t.stage_weights(r)
        self.cos, self.sin = t.rope(0, context)
        self._views: dict[int, Stage] = {}
        self.k = self.v = None
        if t.hybrid:  # (partial rotation as full-width RoPE, as Stage's)
            self.cos, self.sin = full_width_rope(self.cos, self.sin, t.head_dim)
            for b in range(slots):
                self._views[b] = Stage(t, s, r, context, cuda_graphs=False,
                                       max_rollback=layout.n)
            return
        self.k = torch.zeros(slots, len(r), t.num_kv_heads, context, t.head_dim, dtype=t.dtype,
                             device=t.device)
        self.v = torch.zeros_like(self.k)

    @property
    def bytes_per_slot(self) -> int:
        """A slot's KV rows (a hybrid's: its cache and state rings) at this stage."""
        if self.k is not None:
            return 2 * self.k[0].numel() * self.k.element_size()
        c = self._views[0].cache
        return sum(x.numel() * x.element_size() for x in (c.k, c.v, c.conv, c.state))

    def fits(self, slots: int, context: int) -> bool:
        return self.slots >= slots and self.context >= context

    def view(self, slot: int) -> Stage:
        """Slot `slot`'s rows as a one-sequence Stage."""
        if slot not in self._views:
            self._views[slot] = Stage(self.target, self.s, self.layers, self.context,
                                      cuda_graphs=False, max_rollback=self.layout.n,
                                      buffers=(self.k[slot], self.v[slot]))
        return self._views[slot]

    def commit(self, slot: int, head: torch.Tensor) -> None:
        """A token tree's row accepted since the unit `head` [H] before: its K/V to its
        position (what StageStep does, also for a dead unit a CPU skips)."""
        self.view(slot).commit_rows(head[CPOS:CPOS + 1], head[CSLOT:CSLOT + 1])

    def prefill(self, slot: int, x: torch.Tensor, start: int) -> list[torch.Tensor]:
        """Rows x [T, d] of slot `slot`'s prompt at positions start.. (a chunk) -> each
        layer's output; the first chunk empties the slot (a hybrid's rings start afresh)."""
        st = self.view(slot)
        if start == 0:
            st.cache.truncate(0)
        return st.run(x, start)[0]

    def rows_step(self, x: torch.Tensor, run: tuple[int, ...], idx: torch.Tensor,
                  positions: torch.Tensor, live: torch.Tensor | None = None
                  ) -> list[torch.Tensor]:
        """One row of each slot of `run` (host ints; idx [R] the same on the device): x [R, d]
        at positions [R] (int64, on the device) -> each layer's output [R, d]: a dense
        target's rows attend to their slots (`batch_stage_step`), a hybrid's go through their
        slots' caches and rings (`batch_hybrid_stage_step`; live [R] int64, None: all live:
        a dead row writes no ring entry, as a CPU that skips it)."""
        if self.target.hybrid:
            caches = [self._views[b].cache for b in run]
            return batch_hybrid_stage_step(x, self.weights, [(c.k, c.v, c.conv, c.state)
                                                             for c in caches],
                                           positions, self.cos, self.sin, live=live)
        return batch_stage_step(x, self.weights, self.k, self.v, idx, positions, self.cos,
                                self.sin)

    def run(self, fmt: UnitFormat, run: tuple[int, ...], idx: torch.Tensor, heads: torch.Tensor,
            x: torch.Tensor | None) -> list[torch.Tensor]:
        """The step over one unit of each slot of `run` (host ints; idx [R] the same on the
        device): heads [R, H], x [R, W, d] their rows (None: stage 0, which embeds the heads'
        tokens) -> each layer's output [R * W, d]. A chain's rows attend to their slots
        (`batch_stage_step`); a token tree's units first commit, then attend within their
        slots (`batch_tree_stage_step`); a hybrid target's chain rows each through its slot's
        cache and state rings (`batch_hybrid_stage_step`), a dead unit's (a bubble) writing
        none of them: the ring entry after a parked slot's trash row may be the one its next
        prefill chunk reads."""
        t = self.target
        if not fmt.tree:
            x = t.embed_tokens(heads[:, FIXED]) if x is None else x[:, 0]
            return self.rows_step(x, run, idx, heads[:, POS], heads[:, LIVE])
        for b, head in zip(run, heads):
            self.commit(b, head)
        R, W = len(run), fmt.width
        x = (t.embed_tokens(heads[:, fmt.tok].reshape(-1)) if x is None else
             x.reshape(R * W, -1))
        at = heads[:, POS].view(R, 1).expand(R, W).reshape(-1)
        mask = heads[:, fmt.mask].view(R, W, fmt.keys).bool()
        return batch_tree_stage_step(x, self.weights, self.k, self.v, list(run),
                                     heads[:, fmt.slots], heads[:, PREFIX],
                                     heads[:, fmt.key_slots], mask,
                                     self.cos.index_select(0, at), self.sin.index_select(0, at))
