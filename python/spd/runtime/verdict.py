"""The target's own choice of a token, and the vocabulary map a verifier reads.

Terms. The *judged* position is the one after the token that just left the last stage; that
token's final hidden state gives the target's distribution p over it. Greedy: a draft is
*accepted* iff it is p's argmax, else the argmax is the *correction*. Sampling: rejection
sampling accepts a draft x drawn from the drafter's q with probability min(1, p(x) / q(x)), else
the correction is drawn from norm(max(p - q, 0)); a token tree's candidates are point masses,
checked in turn (spd_kernels.tree_rejection_sample). Either way the *committed* token follows p
exactly. The cycle judges on the device (spd.runtime.cycle); `pick` is the first token's choice,
and the autoregressive baseline's.
"""
from __future__ import annotations

import torch

from spd.device import to_device
from spd.runtime.types import SamplingParams
from spd_kernels import filtered_probs, sample_from_probs


def pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """The target's own choice from logits [V] (greedy, or one draw from `gen`)."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    u = torch.rand((), generator=gen, device=gen.device)  # (the decode's device: no copy there)
    return int(sample_from_probs(probs, to_device(u, probs.device)))


_VOCAB_IDS: dict = {}


def vocab_ids(vocab: int, device: torch.device) -> torch.Tensor:
    """arange(vocab) on device, one tensor per (vocab, device): the kernels cache their checks of
    a vocabulary map per tensor, so the same one is passed every cycle."""
    key = (vocab, str(device))
    ids = _VOCAB_IDS.get(key)
    if ids is None:
        ids = _VOCAB_IDS[key] = torch.arange(vocab, device=device)
    return ids
