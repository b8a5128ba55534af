"""SPD on hybrid targets (Qwen3.5, Qwen3-Next) is lossless: greedy SPD with random accept /
reject sequences (poisoned rollbacks) equals the autoregressive path and Hugging Face's
`generate`, token for token."""
import pytest
import torch
from conftest import NoisyPDMDrafter, make_tiny_hybrid

from spd import SPDEngine

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PATTERNS = {
    "linear-first": ("linear_attention", "full_attention", "linear_attention",
                     "linear_attention"),
    "full-first": ("full_attention", "linear_attention", "linear_attention", "full_attention"),
}



@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("model_type,pattern", [("qwen3_5", "linear-first"),
                                                ("qwen3_5", "full-first"),
                                                ("qwen3_next", "linear-first")])
def test_greedy_spd_equals_ar_and_hugging_face(n, model_type, pattern):
    t = make_tiny_hybrid(seed=n, vocab=32, model_type=model_type, layer_types=PATTERNS[pattern])
    eng = SPDEngine(t, n_stages=n, anchors=[0, 2, 3], debug_poison=True)
    ar = eng.generate_ar(PROMPT, 30).token_ids
    with torch.no_grad():
        hf = t.hf.generate(torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False,
                           min_new_tokens=30)[0, len(PROMPT):].tolist()
    assert ar == hf
    drafter = NoisyPDMDrafter(eng.pdm, PROMPT + ar, 0.6, seed=n)
    res = eng.generate(PROMPT, 30, drafter=drafter)
    assert res.token_ids == ar  # a poisoned (NaN) state slot would break this if read
    assert 0 < res.stats.drafts_accepted < res.stats.drafts_judged
