"""Under sampling, SPD on a hybrid target (Qwen3.5: DeltaNet state rollbacks, the zero-centred
final norm) follows the target's distribution exactly: the chi-square test of
test_sampling_lossless on the first three new tokens, against the exact law from Hugging Face's
forward."""
import torch
from conftest import make_tiny_hybrid
from test_sampling_lossless import exact_first_tokens

from spd import SamplingParams, SPDEngine
from spd.draft.pdm import PipelineDraftModule
from spd_kernels.testing import chi2_pvalue as chi2_test

V = 12
PROMPT = [1, 5, 7, 2]


def test_hybrid_sampled_tokens_follow_target():
    n, sp = 2, SamplingParams(temperature=0.9, top_k=10)
    t = make_tiny_hybrid(seed=21, vocab=V, head_scale=3.0,
                         layer_types=("linear_attention", "full_attention", "linear_attention"))
    draft_vocab = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    pdm = PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=n, pdm=None).layout,
                                        draft_vocab=draft_vocab, seed=3)
    with torch.no_grad():  # a random but confident drafter: its q overlaps p only in part
        pdm.lm_head.weight.mul_(30.0)
    eng = SPDEngine(t, n_stages=n, pdm=pdm, lookup=0, debug_poison=True)
    joint12, marg3 = exact_first_tokens(t, sp, PROMPT)
    c12 = torch.zeros(V * V, dtype=torch.int64)
    c3 = torch.zeros(V, dtype=torch.int64)
    accepted = judged = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend (about 30x slower on 2 cores)
    try:
        for seed in range(2000):
            res = eng.generate(PROMPT, 3, SamplingParams(sp.temperature, sp.top_k, sp.top_p,
                                                         seed))
            a, b, c = res.token_ids
            c12[a * V + b] += 1
            c3[c] += 1
            accepted += res.stats.drafts_accepted
            judged += res.stats.drafts_judged
    finally:
        torch.set_num_threads(threads)
    assert 0.05 < accepted / judged < 0.95, "both the accept and the residual paths must occur"
    assert chi2_test(c12, joint12.reshape(-1)) > 1e-3
    assert chi2_test(c3, marg3) > 1e-3
