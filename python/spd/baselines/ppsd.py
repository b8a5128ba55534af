"""PPSD (pipelined speculative decoding) as a PDM configuration.

PPSD's drafter sees only the first stage's output: anchors 0 and the first stage boundary. It
drafts after each pipeline step (post-step features, so drafting is on the critical path) with
one decoder layer. Training and decoding are the PDM's own; only these settings differ.
"""
from __future__ import annotations

from spd.model.partition import DepthLayout

NAME = "ppsd"
FEATURE_TIMING = "post-step"
PDM_LAYERS = 1


def anchors(num_layers: int, n_stages: int, split: list[int] | None = None) -> list[int]:
    """Embedding output and the first stage's output."""
    return [0, DepthLayout.build(num_layers, n_stages, split).split[0]]


def layout(num_layers: int, n_stages: int, split: list[int] | None = None) -> DepthLayout:
    return DepthLayout.build(num_layers, n_stages, split,
                             anchors(num_layers, n_stages, split))
