"""The PDM's draft step replayed as CUDA graphs (GPU only).

A draft step is a few dozen small launches (anchor projection, per layer the fused QKV/RoPE/
append, cache attention, o_proj, MLP, then the draft head); at one token per cycle their launch
gaps would dominate on a GPU. With the position held in a device tensor nothing in the step reads
it on the host, so one graph per row count R (1..n+1 in decoding) replays at every position.

What a graph keeps by address, and so must not be reallocated while it lives: the PDM's weights
(loading new values in place is fine; a replaced Parameter is noticed when the next generation
begins, and the graphs are rebuilt),
the KV cache (a new cache means a new `PDMStepGraphs`), the RoPE table (sized for the cache's
capacity up front) and the static inputs below. Host bookkeeping (cache length, truncation)
stays outside the graph, as eager calls before the replay.

If capture fails (a backend that synchronises with the host, an old driver) the step warns once
and runs eagerly from then on: slower, never wrong.
"""
from __future__ import annotations

import warnings

import torch

from spd import env
from spd_kernels import pdm_step


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs for the draft step: on CUDA devices unless SPD_CUDA_GRAPHS=0."""
    return device.type == "cuda" and env.cuda_graphs_enabled()


class _Entry:
    def __init__(self, graph, anchors, types, logits):
        self.graph, self.anchors, self.types, self.logits = graph, anchors, types, logits


class PDMStepGraphs:
    """Runs `features + step` of `pdm` against `cache` (rows at start..) as graph replays."""

    def __init__(self, pdm, cache):
        self.pdm, self.cache = pdm.pack_qkv_(), cache  # one q/k/v product per layer
        w = pdm.lm_head.weight
        self.device = w.device
        self.start = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.cos, self.sin = pdm._rope_for(cache.capacity, w)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, _Entry] = {}
        self.weights_key = None
        self.failed: str | None = None
        self.replays = 0

    def check_weights(self) -> None:
        """Drop the graphs if a weight was replaced since they were captured. Called once per
        generation (PDMDrafter.begin), not per draft: the addresses cost ~30 reads."""
        key = tuple(p.data_ptr() for p in self.pdm.parameters()) + (
            self.pdm.draft_to_target.data_ptr(),)
        if key != self.weights_key:
            self.graphs.clear()
            self.weights_key = key

    def _eager(self, anchors, types, start):
        feats = self.pdm.features(anchors, types)
        return pdm_step(feats, self.pdm.kernel_weights(), self.cache.k, self.cache.v, start,
                        self.cos, self.sin)

    def _capture(self, anchors, types) -> _Entry:
        """Capture the step for anchors.shape[1] rows; the static inputs are filled already."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (Triton compilation, cuBLAS handles) off capture
            self._eager(anchors, types, self.start)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._eager(anchors, types, self.start)
        return _Entry(graph, anchors, types, logits)

    def run(self, anchors: torch.Tensor, types: torch.Tensor, start: int) -> torch.Tensor:
        """Draft logits of the last row [Vd] for rows anchors [m, R, d] with types [R] at
        positions start..start+R-1 (the cache is truncated to `start` first)."""
        rows = anchors.shape[1]
        self.cache.truncate(start)
        if self.failed is not None or start + rows > self.cache.capacity:
            self.cache.reserve(start, rows)  # eager; reserve raises the overflow clearly
            return self._eager(anchors, types, start)
        self.cache.reserve(start, rows)
        self.start.fill_(start)
        entry = self.graphs.get(rows)
        if entry is None:
            static_a, static_t = anchors.clone(), types.clone()
            try:
                entry = self._capture(static_a, static_t)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly
                self.failed = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"CUDA-graph capture of the PDM step failed ({self.failed}); "
                              "drafting runs eagerly", RuntimeWarning, stacklevel=3)
                torch.cuda.synchronize(self.device)
                return self._eager(anchors, types, start)
            self.graphs[rows] = entry
        else:
            entry.anchors.copy_(anchors)
            entry.types.copy_(types)
        entry.graph.replay()
        self.replays += 1
        return entry.logits
