"""The PDM's draft step replayed as CUDA graphs (GPU only; spd.cuda_graphs says how).

A draft step is a few dozen small launches (anchor projection, per layer the fused QKV/RoPE/
append, cache attention, o_proj, MLP, then the draft head). One graph per row count R (1..n+1 in
decoding) replays at every position: the position is a device tensor filled before the replay.
Besides what every graph keeps by address (spd.cuda_graphs), a replaced PDM Parameter is noticed
when the next generation begins, and the graphs are rebuilt; a new cache means a new
`PDMStepGraphs`; quantised draft weights are remade (and the graphs with them when their
addresses move) at the same point. The cache's length and the overflow check stay outside the
graph, as eager calls before the replay.
"""
from __future__ import annotations

import torch

from spd.cuda_graphs import GraphSet, graphs_enabled
from spd_kernels import pdm_step

__all__ = ["PDMStepGraphs", "graphs_enabled"]


class PDMStepGraphs:
    """Runs `features + step` of `pdm` against `cache` (rows at start..) as graph replays."""

    def __init__(self, pdm, cache):
        self.pdm, self.cache = pdm.pack_qkv_(), cache  # one q/k/v product per layer
        w = pdm.lm_head.weight
        self.device = w.device
        self.start = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.cos, self.sin = pdm._rope_for(cache.capacity, w)
        # the row whose logits are read (the window's newest; a short prompt's window runs past it)
        self.last = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.set = GraphSet(self.device, "PDM step",
                            lambda a, t: self._eager(a, t, self.start, self.last))
        self.weights_key = None

    @property
    def failed(self) -> str | None:
        return self.set.failed

    @property
    def replays(self) -> int:
        return self.set.replays

    @property
    def graphs(self) -> dict:
        return self.set.graphs

    def check_weights(self) -> None:
        """Drop the graphs if a weight was replaced since they were captured. Called once per
        generation (PDMDrafter.begin), not per draft: the addresses cost ~30 reads."""
        # quantised draft weights (PipelineDraftModule.quantize_): their kind and the copies'
        # addresses (remade here, outside any capture, when a parameter changed)
        key = tuple(p.data_ptr() for p in self.pdm.parameters()) + (
            self.pdm.draft_to_target.data_ptr(), getattr(self.pdm, "draft_weights", "model")) + \
            (self.pdm.draft_weight_addresses() if hasattr(self.pdm, "draft_weight_addresses")
             else ())
        if key != self.weights_key:
            self.set.clear()
            self.weights_key = key

    def _eager(self, anchors, types, start, last):
        feats = self.pdm.features(anchors, types)
        return pdm_step(feats, self.pdm.kernel_weights(), self.cache.k, self.cache.v, start,
                        self.cos, self.sin, last=last)

    def run(self, anchors: torch.Tensor, types: torch.Tensor, start, last=None) -> torch.Tensor:
        """Draft logits [Vd] of row `last` ([1] int64; None: the last row) for rows anchors
        [m, R, d] with types [R] at positions start..start+R-1 (rows from `start` on are
        rewritten). `start`: an int, or an int64 tensor [1] on the device (copied, never
        read)."""
        rows = anchors.shape[1]
        if last is None:
            self.last.fill_(rows - 1)
        else:
            self.last.copy_(last.reshape(1))
        if isinstance(start, torch.Tensor):
            self.start.copy_(start.reshape(1))
            self.cache.set_length(self.start)
            self.cache.advance(rows)
        else:
            self.cache.reserve(start, rows)  # raises an overflow clearly
            self.start.fill_(start)
        logits = self.set.run(rows, anchors, types)
        return self._eager(anchors, types, start, self.last) if logits is None else logits
