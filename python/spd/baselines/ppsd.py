"""PPSD (pipelined speculative decoding) as a PDM configuration.

PPSD's drafter sees only the first stage's output: anchors 0 and the first stage boundary. It
drafts after each pipeline step (post-step features, so drafting is on the critical path) with
one decoder layer. Training and decoding are the PDM's own; only these settings differ (`TRAIN`:
what `spd train --method ppsd` sets).
"""
from __future__ import annotations

from spd.model.partition import DepthLayout
from spd.train.methods import TrainMethod, train_pdm

NAME = "ppsd"
FEATURE_TIMING = "post-step"
PDM_LAYERS = 1


def anchors(num_layers: int, n_stages: int, split: list[int] | None = None) -> list[int]:
    """Embedding output and the first stage's output."""
    return [0, DepthLayout.build(num_layers, n_stages, split).split[0]]


def layout(num_layers: int, n_stages: int, split: list[int] | None = None) -> DepthLayout:
    return DepthLayout.build(num_layers, n_stages, split,
                             anchors(num_layers, n_stages, split))


TRAIN = TrainMethod(NAME, summary="the PPSD baseline (a drafter on the first stage's output "
                    "only, run after each pipeline step)", train=train_pdm,
                    feature_timing=FEATURE_TIMING, pdm_layers=PDM_LAYERS, anchors=anchors)
