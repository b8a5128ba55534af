"""Judging a draft: the verdict, and the target's own choice of a token.

Terms. The *judged* token is the in-flight token after the one that just left the last stage;
the state that left (its final hidden state) gives the target's distribution p over the judged
position. Greedy: the draft is *accepted* iff it is p's argmax, else the argmax is the
*correction*. Sampling: rejection sampling accepts a draft x drawn from the drafter's q with
probability min(1, p(x) / q(x)); else the correction is drawn from norm(max(p - q, 0)). Either
way the *committed* token is the draft or the correction, and the output follows p exactly.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from spd.device import to_device, to_host
from spd.runtime.types import SamplingParams
from spd_kernels import filtered_probs, rejection_sample_logits, sample_from_probs, verify_greedy

if TYPE_CHECKING:
    from spd.model.target import TargetModel


class Verdict(NamedTuple):
    """One judged draft, on the host: whether it was accepted, and the committed token (the
    draft, or the correction)."""
    accepted: bool
    token: int


def pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """The target's own choice from logits [V] (greedy, or one draw from `gen`)."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    u = torch.rand((), generator=gen, device=gen.device)  # (the decode's device: no copy there)
    return int(sample_from_probs(probs, to_device(u, probs.device)))


def read_verdict(token: torch.Tensor, accepted: torch.Tensor) -> Verdict:
    """The Verdict of a verifier's token [1] int64 and accepted [1] bool: one host read of both
    values, not two, waiting for their own copy (spd.device.to_host)."""
    tok, ok = to_host(torch.cat([token[:1], accepted[:1].to(token.dtype)]))
    return Verdict(bool(ok), tok)


def verify(target: TargetModel, hidden: torch.Tensor, draft_token: torch.Tensor,
           q: torch.Tensor | None, sampling: SamplingParams, u: torch.Tensor | None,
           q_ids: torch.Tensor | None = None) -> Verdict:
    """The Verdict on the draft judged by `hidden` [1, d] (the predecessor's final state);
    draft_token [1] int64. Greedy: accept iff the draft is the argmax. Sampling:
    rejection sampling against the draft distribution q [Vq] over the target ids q_ids [Vq]
    (None: q is over every target id), with the cycle's uniforms u [1, 2]."""
    return read_verdict(*judge_on_device(target, hidden, draft_token, q, sampling, u, q_ids))


def judge_on_device(target: TargetModel, hidden: torch.Tensor, draft_token: torch.Tensor,
                    q: torch.Tensor | None, sampling: SamplingParams, u: torch.Tensor | None,
                    q_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` without the host read: (the committed token [1] int64, accepted [1] bool), on
    the device. q [Vq] (sampling): the draft distribution, or q [1, Vq]."""
    t = target
    if sampling.greedy:
        return verify_greedy(hidden, t.norm.weight, t.rms_eps, t.lm_head.weight, draft_token,
                             t.norm_offset)
    logits = t.logits(hidden)
    # Straight from the logits: on a GPU one fused kernel applies temperature / top-k / top-p
    # (no sort, p never stored), maps q's columns to target ids and samples.
    ids = q_ids if q_ids is not None else _vocab_ids(logits.shape[-1], logits.device)
    return rejection_sample_logits(logits, q.view(1, -1), ids, draft_token,
                                   to_device(u, logits.device).view(1, 2),
                                   temperature=sampling.temperature, top_k=sampling.top_k,
                                   top_p=sampling.top_p)


_VOCAB_IDS: dict = {}


def _vocab_ids(vocab: int, device: torch.device) -> torch.Tensor:
    """arange(vocab) on device, one tensor per (vocab, device): the kernels cache their checks of
    a vocabulary map per tensor, so the same one is passed every cycle."""
    key = (vocab, str(device))
    ids = _VOCAB_IDS.get(key)
    if ids is None:
        ids = _VOCAB_IDS[key] = torch.arange(vocab, device=device)
    return ids
