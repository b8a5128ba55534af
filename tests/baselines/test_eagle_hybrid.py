"""The EAGLE-3 baseline on a hybrid target (Qwen3.5): greedy output equals the autoregressive
path, with oracle drafts wrong at random positions (poisoned DeltaNet state rollbacks)."""
import pytest
import torch
from conftest import make_tiny_hybrid

from spd.baselines.eagle_decode import EagleDecoder

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("steps", [1, 4])
def test_eagle_on_hybrid_target_is_lossless(steps):
    t = make_tiny_hybrid(seed=6, vocab=16)
    dec = EagleDecoder(t, head="untrained", draft_steps=steps, warn_untrained=False,
                       debug_poison=True)
    ref = dec.generate_ar(PROMPT, 30).token_ids
    wrong = torch.rand(512, generator=torch.Generator().manual_seed(11)) < 0.4

    def choose(logits, position, sampling, gen):  # the target's own token, wrong at times
        right = ref[position - len(PROMPT)] if position - len(PROMPT) < len(ref) else 0
        return ((right + 1) % 16 if wrong[position] else right), None
    dec._choose = choose
    res = dec.generate(PROMPT, 30)
    assert res.token_ids == ref
    assert 0 < res.stats.drafts_accepted < res.stats.drafts_judged
