"""Under sampling, SPD's output must follow the target's distribution exactly.

A tiny random target (vocabulary 12) with peaky distributions and an untrained PDM whose draft
vocabulary covers only part of the target's (so q is zero on some tokens and both the accept and
the residual paths are exercised). We sample the first LENGTH new tokens many times with
different seeds (past the fill, through rejections, rollbacks and refills) and compare with the
exact distribution:
  - the joint law of tokens 1 and 2 (token 2 is the first one that goes through verification)
    and the marginal law of token 3, computed by enumerating contexts;
  - every position k of the sequence given the tokens before it: with p_r the target's
    (filtered) distribution at position k of run r given that run's prefix (one exact forward
    per run gives every position's), the counts of each token summed over runs minus the sum
    of the p_r have mean zero and covariance sum_r (diag(p_r) - p_r p_r^T) under an exact
    decode, so their Mahalanobis norm is chi-square; summed over positions (the increments of
    a martingale) it tests the law of the whole sequence.
Chi-square tests at significance 1e-3 each, with fixed seeds: a correct engine fails with
probability about 0.003, and then deterministically, so a failure is reproducible.
"""
import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.draft import drafters
from spd.draft.pdm import PipelineDraftModule
from spd.runtime import chain_batch
from spd_kernels import filtered_probs
from spd_kernels.testing import chi2_pvalue as chi2_test
from spd_kernels.testing import chi2_sf

V = 12
PROMPT = [1, 5, 7, 2]
LENGTH = 8  # new tokens per run: n = 3 fills in 2 cycles, so most are judged after a refill


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


def conditional_pvalue(target, sp: SamplingParams, prompt, runs: list[list[int]]) -> float:
    """p-value of every position's tokens against the filtered target distribution given each
    run's own prefix (module docstring)."""
    ids = torch.tensor([prompt + r for r in runs])
    with torch.no_grad():
        logits = target.hf(ids).logits[:, len(prompt) - 1:-1]      # [runs, LENGTH, V]
    p = filtered_probs(logits.reshape(-1, V), sp.temperature, sp.top_k, sp.top_p).double()
    p = p.reshape(len(runs), -1, V)
    seen = torch.nn.functional.one_hot(torch.tensor(runs), V).double()
    stat, dof = 0.0, 0
    for k in range(p.shape[1]):
        diff = (seen[:, k] - p[:, k]).sum(0)                        # [V]
        cov = torch.diag(p[:, k].sum(0)) - p[:, k].T @ p[:, k]      # [V, V]
        stat += float(diff @ torch.linalg.pinv(cov, hermitian=True) @ diff)
        dof += int(torch.linalg.matrix_rank(cov, hermitian=True))
    return chi2_sf(stat, dof)


@pytest.mark.parametrize("n,sp,lookup,post_step", [
    (2, SamplingParams(temperature=1.0), 0, False),
    (3, SamplingParams(temperature=0.8, top_k=8, top_p=0.9), 0, False),
    # The context lookup's drafts (one-hot q) on a prompt that repeats, mixed with the PDM's
    (3, SamplingParams(temperature=1.0), 1, False),
    # Post-step drafting (an ablation: features one stage deeper, drafted after the stages)
    # judges through the same verifier; its greedy losslessness is test_engine_tiny's
])
def test_sampled_tokens_follow_target(n, sp, lookup, post_step, monkeypatch):
    prompt = PROMPT + PROMPT[:3] if lookup else PROMPT
    t = make_tiny_target(seed=21, vocab=V, layers=3, head_scale=3.0)
    draft_vocab = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    pdm = PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=n, pdm=None).layout,
                                        draft_vocab=draft_vocab, seed=3)
    pdm.config.features = "post-step" if post_step else "pre-step"
    with torch.no_grad():  # a random but confident drafter: its q overlaps p only in part
        pdm.lm_head.weight.mul_(30.0)
    eng = SPDEngine(t, n_stages=n, pdm=pdm, lookup=lookup)
    assert eng.drafter.post_step == post_step
    if lookup:
        # The gate (spd.draft.lookup.TRUST) compares the PDM's confidence with the match's hit rate;
        # a confidence drawn at random, independent of the target, keeps the output exact and
        # makes both sides of the gate occur: 1-token matches win about half the time, longer
        # ones always.
        # (the confidence of every row a draft step picks from: a sequence's, or a batch's)
        gen = torch.Generator().manual_seed(5)

        def confidence(logits):
            return 0.26 * torch.rand(logits.shape[:-1], generator=gen)
        monkeypatch.setattr(drafters, "top_probability", confidence)
        monkeypatch.setattr(chain_batch, "top_probability", confidence)
    joint12, marg3 = exact_first_tokens(t, sp, prompt)
    runs = 2000
    c12 = torch.zeros(V * V, dtype=torch.int64)
    c3 = torch.zeros(V, dtype=torch.int64)
    outputs = []
    accepted = judged = lookup_accepted = lookup_judged = 0
    seeded = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed) for seed in range(runs)]
    # eight at a time, each exactly its decode alone (tests/runtime/test_batch.py): faster
    results = eng.generate([prompt] * runs, LENGTH, seeded, max_batch=32)
    for res in results:
        a, b, c = res.token_ids[:3]
        c12[a * V + b] += 1
        c3[c] += 1
        outputs.append(res.token_ids)
        accepted += res.stats.drafts_accepted
        judged += res.stats.drafts_judged
        lookup_accepted += res.stats.lookup_accepted
        lookup_judged += res.stats.lookup_judged
    assert all(len(o) == LENGTH for o in outputs)
    assert 0.05 < accepted / judged < 0.95, "both the accept and the residual paths must occur"
    if lookup:
        assert judged / 6 < lookup_judged < judged / 2
        assert 0.05 < lookup_accepted / lookup_judged < 0.95
    assert chi2_test(c12, joint12.reshape(-1)) > 1e-3
    assert chi2_test(c3, marg3) > 1e-3
    assert conditional_pvalue(t, sp, prompt, outputs) > 1e-3
