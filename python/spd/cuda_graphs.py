"""Replaying a step as CUDA graphs, one per shape: what the PDM's draft step and the target's
stage and autoregressive steps share (spd.draft.graphs, spd.model.target.Stage,
spd.runtime.ar_decode).

A step of one token is a few dozen small launches; on a GPU their launch gaps would dominate.
With positions held in device tensors nothing in a step reads them on the host, so one graph per
row count replays at every position. A graph keeps every tensor it touches by address: weights
(new values in place are fine), caches, RoPE tables and the static inputs and outputs kept here
must live as long as the graph. If capture fails (a backend that synchronises with the host, an
old driver) the step warns once and runs eagerly from then on: slower, never wrong.
"""
from __future__ import annotations

import warnings
from typing import Callable, Hashable, Sequence

import torch

from spd import env


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs for the decode steps: on CUDA devices unless SPD_CUDA_GRAPHS=0."""
    return torch.device(device).type == "cuda" and env.cuda_graphs_enabled()


class _Entry:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphSet:
    """Graphs of `step(*inputs)`, one per key (a row count). `run` copies the inputs into the
    captured ones and replays; it returns None when graphs failed, so the caller runs eagerly.

    undo(*inputs): called after the eager warm-up that precedes a capture, to take back its
    effects on state the step advances itself (a cache length); writes the replay repeats need no
    undo."""

    def __init__(self, device: torch.device, what: str, step: Callable,
                 undo: Callable[..., None] | None = None):
        self.device, self.what, self.step, self.undo = torch.device(device), what, step, undo
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, _Entry] = {}
        self.failed: str | None = None
        self.replays = 0

    def clear(self) -> None:
        self.graphs.clear()

    def _capture(self, inputs: Sequence[torch.Tensor]) -> _Entry:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (Triton compilation, cuBLAS handles) off capture
            self.step(*inputs)
            if self.undo is not None:
                self.undo(*inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self.step(*inputs)
        return _Entry(graph, inputs, outputs)

    def run(self, key: Hashable, *inputs: torch.Tensor):
        """The step's outputs for `inputs` as a replay (static tensors: read or copy them before
        the next replay of this key), or None: run the step eagerly."""
        if self.failed is not None:
            return None
        if torch.cuda.is_current_stream_capturing():
            # inside a graph of a whole cycle (spd.runtime.cycle): the eager step is
            # what that graph records (a graph cannot be captured inside another's capture)
            return None
        entry = self.graphs.get(key)
        if entry is None:
            static = tuple(x.clone() for x in inputs)
            try:
                entry = self._capture(static)
            except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly
                self.failed = f"{type(exc).__name__}: {exc}"
                warnings.warn(f"CUDA-graph capture of the {self.what} failed ({self.failed}); "
                              "it runs eagerly", RuntimeWarning, stacklevel=3)
                torch.cuda.synchronize(self.device)
                return None
            self.graphs[key] = entry
        else:
            for dst, src in zip(entry.inputs, inputs):
                dst.copy_(src)
        entry.graph.replay()
        self.replays += 1
        return entry.outputs
