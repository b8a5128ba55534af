"""The distributed runtime (gloo on 127.0.0.1) on a hybrid target: the same tokens and counts as
the single-process engine, with random accept / reject sequences (DeltaNet state rollbacks on
every stage rank)."""
from functools import partial

import pytest
from conftest import make_tiny_hybrid

from spd import SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.draft.drafters import ReferenceDrafter

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def hybrid_factory(seed: int, rank: int):
    """The hybrid target every rank builds (identical weights from the seed)."""
    return make_tiny_hybrid(seed=seed, vocab=48, model_type="qwen3_5")


@pytest.mark.parametrize("n,speculative", [(2, "on"), (3, "off")])
def test_hybrid_same_tokens_as_single_process(n, speculative):
    t = hybrid_factory(20 + n, 0)
    eng = SPDEngine(t, n_stages=n)
    ar = eng.generate_ar(PROMPT, 20).token_ids
    ref = PROMPT + ar
    cases = [(GenerateRequest(PROMPT, 20), {}),
             (GenerateRequest(PROMPT, 20, reference=ref, reference_accuracy=0.6,
                              reference_seed=n), {"drafter": ReferenceDrafter(ref, 0.6, n)})]
    expected = [eng.generate(r.prompt_ids, 20, **kw) for r, kw in cases]
    assert expected[0].token_ids == ar
    config = DistConfig(n_stages=n, target_factory=partial(hybrid_factory, 20 + n),
                        fault_timeout=5.0, op_timeout=60.0, speculative_control=speculative)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=150)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert (g.stats.N, g.stats.K, g.stats.drafts_judged, g.stats.drafts_accepted) == \
            (e.stats.N, e.stats.K, e.stats.drafts_judged, e.stats.drafts_accepted)
    assert 0 < got[1].stats.drafts_accepted < got[1].stats.drafts_judged
