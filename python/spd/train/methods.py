"""What `spd train` needs to know about each drafter it trains, described once per method.

A `TrainMethod` holds a method's name, the defaults it sets (feature timing, PDM depth, anchors,
the hidden states its features must hold), the options it refuses, and the function that trains
it. The CLI looks the method up once and branches on these fields, never on the name.

Each description lives next to the code it describes: the PDM's (SPD) here, beside the PDM
trainer; PPSD's in spd.baselines.ppsd (a PDM configuration); EAGLE-3's in
spd.baselines.eagle_train. spd.baselines.training gathers them (the --method choices).
"""
from __future__ import annotations

from argparse import Namespace
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from spd.errors import SPDError
from spd.model.partition import DepthLayout

# --argmax-weight is checked for every method (>= 0) and refused by those without a PDM loss.
ARGMAX_MESSAGE = ("--argmax-weight must be >= 0 and is a PDM option, got {argmax_weight} with "
                  "--method {method}")


@dataclass(frozen=True)
class Refusal:
    """Options (argparse dests) a method refuses: one message when any of them is given."""
    options: tuple[str, ...]
    message: str                          # formatted with method= and each option's value
    given: Callable[[Any], bool] = bool   # whether a value counts as given (default: truthy)

    def check(self, method: str, options: Namespace) -> None:
        values = {o: getattr(options, o) for o in self.options}
        if any(self.given(v) for v in values.values()):
            raise SPDError(self.message.format(method=method, **values))


@dataclass(frozen=True)
class TrainJob:
    """What the CLI resolved before training: the data, the layout and the `spd train` flags."""
    target: Any
    features: Any                      # spd.train.distill.FeatureSet
    layout: DepthLayout
    precision: str                     # "fp32" or "bf16" (--precision resolved)
    fill_weights: list[float] | None   # --fill-weights parsed and checked
    options: Namespace                 # every `spd train` flag as parsed
    group: Any = None                  # spd.train.ranks.RankGroup (None: one process)


def _no_layers(num_layers: int) -> Sequence[int]:
    return ()


@dataclass(frozen=True)
class TrainMethod:
    name: str
    summary: str                       # its entry in `spd train --help` (--method)
    # (method, job) -> the final held-out summary; writes the checkpoint to job.options.out
    train: Callable[["TrainMethod", TrainJob], dict]
    feature_timing: str | None = None  # --feature-timing when not given
    pdm_layers: int | None = None      # --pdm-layers when not given
    # (num_layers, n_stages, split) -> anchors when --anchors is not given (None: the layout's)
    anchors: Callable[[int, int, list[int] | None], list[int]] | None = None
    # hidden states the feature cache must hold besides the layout's and the default anchors
    feature_layers: Callable[[int], Sequence[int]] = _no_layers
    refuses: tuple[Refusal, ...] = ()
    # further checks of the options it reads, made before any data is built
    check: Callable[[Namespace], None] | None = None

    def check_options(self, options: Namespace) -> None:
        """Raise SPDError for an option this method refuses or a value it cannot use."""
        for refusal in self.refuses:
            refusal.check(self.name, options)
        if self.check is not None:
            self.check(options)

    def refused(self) -> set[str]:
        """The options (argparse dests) this method refuses."""
        return {o for r in self.refuses for o in r.options}

    def run(self, job: TrainJob) -> dict:
        return self.train(self, job)


def pdm_train_config(method: TrainMethod, job: TrainJob):
    """The PDM trainer's settings (spd.train.trainer.TrainConfig) from the flags and the
    method's defaults."""
    from spd.train.trainer import TrainConfig
    o, layout = job.options, job.layout
    return TrainConfig(n_stages=layout.n, split=layout.split, anchors=list(layout.anchors),
                       pdm_layers=o.pdm_layers or method.pdm_layers,
                       method=method.name, init_from=o.init_from,
                       intermediate_size=o.intermediate_size or 768,
                       draft_vocab_size=o.draft_vocab_size, steps=o.steps or 1,
                       draft_vocab_coverage=getattr(o, "draft_vocab_coverage", None),
                       batch_sequences=o.batch, micro_batch=getattr(o, "micro_batch", 0),
                       pack_tokens=getattr(o, "pack_tokens", 0), lr=o.lr,
                       eval_every=o.eval_every, save_every=o.eval_every, max_len=o.max_len,
                       seed=o.seed, eval_sequences=o.eval_sequences,
                       features=o.feature_timing or method.feature_timing, crop_len=o.crop_len,
                       fill_weights=job.fill_weights, argmax_weight=o.argmax_weight,
                       precision=job.precision, loss_on=getattr(o, "loss_on", None) or "all")


def train_pdm(method: TrainMethod, job: TrainJob) -> dict:
    """Train a PDM with the method's defaults (SPD's and PPSD's trainer: spd.train.trainer)."""
    from spd.train.trainer import train
    return train(job.target, job.features, pdm_train_config(method, job), job.options.out,
                 storage=job.options.storage, group=job.group)


SPD = TrainMethod("spd", summary="a PDM on multi-depth features", train=train_pdm,
                  feature_timing="pre-step", pdm_layers=2)


__all__ = ["ARGMAX_MESSAGE", "Refusal", "SPD", "TrainJob", "TrainMethod", "pdm_train_config",
           "train_pdm"]
