"""The drafters `spd train` trains (its --method choices), each described next to its trainer:
the PDM's (SPD) in spd.train.methods, PPSD's in spd.baselines.ppsd, EAGLE-3's in
spd.baselines.eagle_train. The first is the default."""
from __future__ import annotations

from spd.baselines import eagle_train, ppsd
from spd.errors import SPDError
from spd.train.methods import SPD, TrainMethod

TRAIN_METHODS: dict[str, TrainMethod] = {m.name: m for m in (SPD, ppsd.TRAIN, eagle_train.TRAIN)}
NAMES = tuple(TRAIN_METHODS)
DEFAULT = NAMES[0]


def get(name: str) -> TrainMethod:
    try:
        return TRAIN_METHODS[name]
    except KeyError:
        raise SPDError(f"unknown training method {name!r}: choose from "
                       f"{', '.join(NAMES)}") from None


__all__ = ["DEFAULT", "NAMES", "TRAIN_METHODS", "get"]
