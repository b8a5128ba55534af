"""Under sampling, SPD's output must follow the target's distribution exactly.

A tiny random target (vocabulary 12) with peaky distributions and an untrained PDM whose draft
vocabulary covers only part of the target's (so q is zero on some tokens and both the accept and
the residual paths are exercised). We sample the first three new tokens many times with different
seeds and compare with the exact distribution, computed by enumerating contexts:
  - the joint law of tokens 1 and 2 (token 2 is the first one that goes through verification),
  - the marginal law of token 3.
Chi-square tests at significance 1e-3 each, with fixed seeds: a correct engine fails with
probability about 0.002, and then deterministically, so a failure is reproducible.
"""
import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.draft.pdm import PipelineDraftModule
from spd_kernels import filtered_probs
from spd_kernels.testing import chi2_pvalue as chi2_test

V = 12
PROMPT = [1, 5, 7, 2]


def exact_first_tokens(target, sp: SamplingParams, prompt=PROMPT):
    """P(t1, t2) [V, V] and P(t3) [V] under the filtered target distribution."""
    PROMPT = prompt  # noqa: N806 (the module constant's name, shadowed on purpose)
    def next_probs(prefixes):
        ids = torch.tensor(prefixes)
        with torch.no_grad():
            logits = target.hf(ids).logits[:, -1]
        return filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p).double()

    p1 = next_probs([PROMPT])[0]
    p2 = next_probs([PROMPT + [a] for a in range(V)])                      # [V, V]
    joint12 = p1[:, None] * p2
    p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)])  # [V*V, V]
    marg3 = (joint12.reshape(-1, 1) * p3).sum(0)
    return joint12, marg3


@pytest.mark.parametrize("n,sp,lookup", [
    (2, SamplingParams(temperature=1.0), 0),
    (3, SamplingParams(temperature=0.8, top_k=8, top_p=0.9), 0),
    # The context lookup's drafts (one-hot q) on a prompt that repeats, mixed with the PDM's
    (3, SamplingParams(temperature=1.0), 1),
])
def test_sampled_tokens_follow_target(n, sp, lookup):
    prompt = PROMPT + PROMPT[:3] if lookup else PROMPT
    t = make_tiny_target(seed=21, vocab=V, layers=3, head_scale=3.0)
    draft_vocab = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    pdm = PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=n, pdm=None).layout,
                                        draft_vocab=draft_vocab, seed=3)
    with torch.no_grad():  # a random but confident drafter: its q overlaps p only in part
        pdm.lm_head.weight.mul_(30.0)
    eng = SPDEngine(t, n_stages=n, pdm=pdm, lookup=lookup)
    if lookup:
        # The gate (spd.draft.lookup.TRUST) compares the PDM's confidence with the match's hit rate;
        # a confidence drawn at random, independent of the target, keeps the output exact and
        # makes both sides of the gate occur: 1-token matches win about half the time, longer
        # ones always.
        real_draft, gen = eng.drafter.draft, torch.Generator().manual_seed(5)

        def draft(*args):
            d = real_draft(*args)
            d.p = 0.26 * torch.rand((), generator=gen)
            return d
        eng.drafter.draft = draft
    joint12, marg3 = exact_first_tokens(t, sp, prompt)
    runs = 3000
    c12 = torch.zeros(V * V, dtype=torch.int64)
    c3 = torch.zeros(V, dtype=torch.int64)
    accepted = judged = lookup_accepted = lookup_judged = 0
    for seed in range(runs):
        res = eng.generate(prompt, 3, SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed))
        a, b, c = res.token_ids
        c12[a * V + b] += 1
        c3[c] += 1
        accepted += res.stats.drafts_accepted
        judged += res.stats.drafts_judged
        lookup_accepted += res.stats.lookup_accepted
        lookup_judged += res.stats.lookup_judged
    assert 0.05 < accepted / judged < 0.95, "both the accept and the residual paths must occur"
    if lookup:
        assert judged / 5 < lookup_judged < judged / 2
        assert 0.05 < lookup_accepted / lookup_judged < 0.95
    assert chi2_test(c12, joint12.reshape(-1)) > 1e-3
    assert chi2_test(c3, marg3) > 1e-3
