"""Token trees (`tree_width` W): up to W candidate rows per position, lossless.

Greedy output equals AR token for token for W = 2..8 with random accept paths that accept
non-top rows (so accepted branches end early and the pipeline has gaps); a stage's tree mask
keeps every row to its own branch (a mask that lets rows see other slots reads the trash slot,
poisoned here, and leaves AR's output); under sampling the tokens follow the target's law
(chi-square, as tests/runtime/test_sampling_lossless.py). Every decode against the reference
decoder, wherever the stages run: test_cycle.py.
"""
import pytest
import torch
from conftest import NoisyTreeDrafter, make_tiny_hybrid, make_tiny_target, needs_gpu
from reference_decoder import ReferenceDecoder
from test_sampling_lossless import V, conditional_pvalue, exact_first_tokens

from spd import SamplingParams, SPDEngine
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError
from spd.runtime.unit import StageStep
from spd_kernels.testing import chi2_pvalue

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _engine(t, n, W, **kw):
    return SPDEngine(t, n_stages=n, anchors=[0, 2, 3], tree_width=W, **kw)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("n,W", [(2, 2), (3, 4), (4, 8), (4, 2)])
def test_greedy_tree_equals_ar(model_type, n, W):
    t = make_tiny_target(seed=n + W, vocab=32, layers=4, model_type=model_type)
    eng = _engine(t, n, W)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    drafter = NoisyTreeDrafter(eng.pdm, PROMPT + ar, accuracy=0.5, seed=n * W)
    res = eng.generate(PROMPT, 40, drafter=drafter)
    assert res.token_ids == ar
    s = res.stats
    assert 0 < s.drafts_accepted < s.drafts_judged
    assert s.tree_width == W and s.N == len(ar) - 1
    # at most W rows per stage per cycle, and more than the chain's one somewhere
    assert s.K < s.stage_rows <= s.K * n * W
    # the real PDM with the context lookup, untouched
    res = eng.generate(PROMPT + PROMPT, 24)
    assert res.token_ids == eng.generate_ar(PROMPT + PROMPT, 24).token_ids


def test_non_top_rows_accepted_and_gaps_happen():
    """The accept path the noisy drafter makes takes lower rows and leaves gaps (an accepted
    branch that ends before the newest position: nothing enters that cycle), the cases the
    chain never meets: seen in the reference decoder, whose counts the cycle's equal."""
    t = make_tiny_target(seed=7, vocab=32, layers=4)
    eng = _engine(t, 4, 4)
    ar = eng.generate_ar(PROMPT, 48).token_ids
    seen = {"gap": 0, "lower": 0}
    ref = ReferenceDecoder(eng)
    real_accept = ref._accept

    def accept(j, lane):
        newest = max(ref.depth)
        seen["lower"] += lane > 0
        keep = real_accept(j, lane)
        seen["gap"] += keep < newest
        return keep
    ref._accept = accept
    make = lambda: NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.4, 3)  # noqa: E731
    tokens, stats = ref.generate(PROMPT, 48, SamplingParams(), drafter=make())
    res = eng.generate(PROMPT, 48, drafter=make())
    assert tokens == res.token_ids == ar
    assert (stats.N, stats.K, stats.drafts_accepted, stats.stage_rows) == \
        (res.stats.N, res.stats.K, res.stats.drafts_accepted, res.stats.stage_rows)
    assert seen["lower"] > 0 and seen["gap"] > 0


def test_mask_leak_is_caught(monkeypatch):
    """The trash slot (where dead rows write, and a unit's unused keys point) is NaN before
    every tree step: the output stays AR's. A stage that lets every row see every key reads it
    and leaves AR's output."""
    t = make_tiny_target(seed=5, vocab=32, layers=4)
    eng = _engine(t, 3, 4)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    real = StageStep.run

    def poisoned(step, head, x, leak=False):
        trash = step.stage.cache.capacity - 1
        step.stage.cache.k[:, :, trash] = float("nan")
        step.stage.cache.v[:, :, trash] = float("nan")
        if leak:
            f = step.fmt
            head = head.clone()
            head[f.mask] = 1
        return real(step, head, x)
    for leak in (False, True):
        monkeypatch.setattr(StageStep, "run", lambda s, h, x: poisoned(s, h, x, leak))
        out = eng.generate(PROMPT, 40, drafter=NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.5, 1))
        assert (out.token_ids == ar) != leak


@pytest.mark.slow
@pytest.mark.parametrize("n,sp", [
    (3, SamplingParams(temperature=1.0)),
    (2, SamplingParams(temperature=0.8, top_k=8, top_p=0.9)),
])
def test_sampled_tree_follows_target(n, sp):
    t = make_tiny_target(seed=21, vocab=V, layers=3, head_scale=3.0)
    draft_vocab = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    pdm = PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=n, pdm=None).layout,
                                        draft_vocab=draft_vocab, seed=3)
    with torch.no_grad():
        pdm.lm_head.weight.mul_(30.0)
    eng = SPDEngine(t, n_stages=n, pdm=pdm, lookup=0, tree_width=4)
    prompt = [1, 5, 7, 2]
    joint12, marg3 = exact_first_tokens(t, sp, prompt)
    c12 = torch.zeros(V * V, dtype=torch.int64)
    c3 = torch.zeros(V, dtype=torch.int64)
    outputs, accepted, judged = [], 0, 0
    seeded = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed) for seed in range(1000)]
    # eight at a time, each exactly its decode alone (tests/runtime/test_batch.py): faster
    for res in eng.generate([prompt] * len(seeded), 8, seeded, max_batch=32):
        a, b, c = res.token_ids[:3]
        c12[a * V + b] += 1
        c3[c] += 1
        outputs.append(res.token_ids)
        accepted += res.stats.drafts_accepted
        judged += res.stats.drafts_judged
    assert 0.05 < accepted / judged < 0.95, "both the accept and the residual paths must occur"
    assert chi2_pvalue(c12, joint12.reshape(-1)) > 1e-3
    assert chi2_pvalue(c3, marg3) > 1e-3
    assert conditional_pvalue(t, sp, prompt, outputs) > 1e-3


def test_bad_tree_width_and_hybrid_refused():
    t = make_tiny_target(seed=0, vocab=32, layers=4)
    for bad in (0, 17, 2.0, True, "4"):
        with pytest.raises(SPDError, match="tree width"):
            SPDEngine(t, n_stages=2, tree_width=bad)
    h = make_tiny_hybrid(seed=0)
    with pytest.raises(SPDError, match="hybrid"):
        SPDEngine(h, n_stages=2, tree_width=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_gpu_tree_equals_ar(backend):
    """On a GPU, the tree's ops on `backend` (tree_attention, tree_rejection_sample; Triton is
    on request for both): greedy equals AR with gaps; sampled decodes run and stay in the
    vocabulary."""
    from spd.model.target import TargetModel
    from spd_kernels import dispatch
    t = make_tiny_target(seed=9, vocab=32, layers=4)
    t = TargetModel(t.hf.to("cuda"), None, name=t.name)
    with dispatch.use_backend(tree_attention=backend, tree_rejection_sample=backend):
        eng = SPDEngine(t, n_stages=3, anchors=[0, 2, 3], tree_width=4)
        ar = eng.generate_ar(PROMPT, 32).token_ids
        res = eng.generate(PROMPT, 32, drafter=NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.5, 2))
        assert res.token_ids == ar
        assert 0 < res.stats.drafts_accepted < res.stats.drafts_judged
        sp = SamplingParams(temperature=1.0, top_k=8, seed=4)
        out = eng.generate(PROMPT, 24, sp).token_ids
        assert len(out) == 24 and all(0 <= x < 32 for x in out)
