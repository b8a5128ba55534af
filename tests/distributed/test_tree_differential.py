"""A randomised differential test of distributed tree decoding: many seeds of a drafter whose
tree follows the PDM's features (conftest.FeatureTreeDrafter: rows from several leaves, lanes
that survive an accept in any subset, rejections and gaps), each decoded in one process and
over n + 1 ranks (or n, the draft on a stage). Both must agree in tokens, N, K, judged and
accepted drafts and by-position counts, greedy (which must also equal AR) and seeded sampling.

This is the test that catches a distributed tree reading the wrong row of the last stage's
output (lanes kept after a draft was sent ahead) or missing anchor rows that arrive after their
position was committed: each changes the tree, so K or the tokens part."""
from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from conftest import feature_tree_drafter, make_tiny_target, run_traced

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local

VOCAB = 48


def tiny_factory(seed: int, layers: int, rank: int):
    return make_tiny_target(seed=seed, vocab=VOCAB, layers=layers)


def stats_of(result):
    s = result.stats
    return (s.N, s.K, s.drafts_judged, s.drafts_accepted, s.by_position)


def cases(eng: SPDEngine, rng: random.Random, count: int):
    """`count` requests with random prompts, lengths, accuracies and drafter seeds; every third
    one sampled with a random seed, temperature and filters."""
    out = []
    for i in range(count):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 12))]
        new = rng.randrange(16, 33)
        sampling = SamplingParams()
        if i % 3 == 2:
            sampling = SamplingParams(temperature=rng.choice([0.7, 1.0]),
                                      top_k=rng.choice([0, 12]), top_p=rng.choice([1.0, 0.9]),
                                      seed=rng.randrange(1 << 20))
        ref = prompt + eng.generate_ar(prompt, new).token_ids
        drafter = partial(feature_tree_drafter, ref, rng.choice([0.4, 0.7, 0.9]),
                          rng.randrange(1 << 20))
        out.append((GenerateRequest(prompt, new, sampling, drafter=drafter), ref[len(prompt):]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n,width,layers,on_stage,control", [
    (2, 3, 4, None, "on"), (3, 2, 6, None, "auto"), (4, 4, 4, None, "on"),
    (4, 3, 8, 2, "on")])
def test_distributed_tree_equals_one_process_over_many_seeds(n, width, layers, on_stage,
                                                             control):
    """`control`: speculative control ("on": every full cycle's draft is sent ahead of its
    verdict, so accepts keep lanes of a unit already in the pipeline)."""
    seed = 100 * n + width
    rng = random.Random(seed)
    eng = SPDEngine(tiny_factory(seed, layers, 0), n_stages=n, tree_width=width)
    todo = cases(eng, rng, 6)
    expected = []
    for r, _ in todo:
        drafter = r.drafter(eng)
        result = eng.generate(r.prompt_ids, r.max_new_tokens, r.sampling, drafter=drafter)
        expected.append((result, drafter.trace))
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, seed, layers),
                        fault_timeout=5.0, op_timeout=60.0, tree_width=width,
                        draft_on_stage=on_stage, speculative_control=control)
    got = launch_local(config, partial(run_traced, [r for r, _ in todo]), timeout=300)
    rejected = 0
    for (req, ar), (e, e_trace), (g, g_trace) in zip(todo, expected, got):
        where = f"prompt {req.prompt_ids}, sampling {req.sampling}"
        # the drafter read the same features in every draft (the tree's rows, their depths'
        # anchors): a missing or misplaced anchor row shows here even where the tree survives it
        assert [rows for rows, _ in g_trace] == [rows for rows, _ in e_trace], where
        for (rows, fe), (_, fg) in zip(e_trace, g_trace):
            torch.testing.assert_close(torch.tensor(fg), torch.tensor(fe), rtol=1e-4, atol=1e-4,
                                       msg=f"{where}, rows {rows}")
        assert g.token_ids == e.token_ids, where
        assert stats_of(g) == stats_of(e), where
        if req.sampling.greedy:
            assert g.token_ids == ar, where
        rejected += e.stats.drafts_accepted < e.stats.drafts_judged
    assert rejected >= 3  # the drafts were rejected too, not only accepted
