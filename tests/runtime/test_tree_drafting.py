"""Tree drafting (spd.runtime.tree): W candidate rows per position, lossless.

Greedy output equals AR token for token for W = 1..8 with random accept paths that accept
non-top rows (so accepted branches end early and the pipeline has gaps), with dropped rows'
K/V poisoned with NaN (a leak through the tree mask would show); a tree of width 1 is the chain
exactly (tokens, N, K, judged drafts); under sampling the tokens follow the target's law
(chi-square, as tests/runtime/test_sampling_lossless.py).
"""
import pytest
import torch
from conftest import NoisyTreeDrafter, make_tiny_hybrid, make_tiny_target, needs_gpu
from test_sampling_lossless import V, conditional_pvalue, exact_first_tokens

from spd import SamplingParams, SPDEngine
from spd.draft.drafters import PDMDrafter
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError
from spd.runtime.engine import LocalStages, TreeLocalStages
from spd.runtime.sequence import SequenceDecode
from spd.runtime.tree import TreeDecode, TreeSchedule
from spd.runtime.types import DecodeStats
from spd_kernels.testing import chi2_pvalue

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class KeyedDrafter(PDMDrafter):
    """The real PDM's logits with the reference token lifted at 3 positions in 5 (a fixed rule
    of the position): the chain's and the tree's drafts see the same logits."""

    def __init__(self, pdm, reference, lookup):
        super().__init__(pdm, lookup=lookup)
        self.reference = reference

    def _lift(self, logits, position):
        if position % 5 < 3 and position < len(self.reference):
            col = int((self.pdm.draft_to_target == self.reference[position]).nonzero()[0])
            logits = logits.clone()
            logits[..., col] += 50.0
        return logits

    def draft(self, anchors, types, start, position, sampling, uniform):
        self._position = position
        return super().draft(anchors, types, start, position, sampling, uniform)

    def draft_logits(self, anchors, types, start):
        return self._lift(super().draft_logits(anchors, types, start), self._position)

    def tree_logits(self, anchors, types, positions, *args):
        return self._lift(super().tree_logits(anchors, types, positions, *args),
                          max(positions) + 1)


def _engine(t, n, W, **kw):
    return SPDEngine(t, n_stages=n, anchors=[0, 2, 3], tree_width=W, debug_poison=True, **kw)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("W", [2, 4, 8])
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
    """The accept path the noisy drafter makes takes lower rows and leaves gaps (depths not a
    staircase): the cases that the chain never meets."""
    t = make_tiny_target(seed=7, vocab=32, layers=4)
    eng = _engine(t, 4, 4)
    ar = eng.generate_ar(PROMPT, 48).token_ids
    seen = {"gap": 0, "lower": 0}
    real_commit = TreeDecode.commit

    def commit(self, verdict, draft):
        if verdict.accepted and verdict.lane is not None:
            rows = self.candidates(self.sched.judged)
            best = max(rows, key=lambda lane: rows[lane].score)
            seen["lower"] += rows[verdict.lane].score < rows[best].score
        real_commit(self, verdict, draft)
        d = self.sched.depths
        seen["gap"] += any(a - b > 1 for a, b in zip(d, d[1:]))
    TreeDecode.commit = commit
    try:
        res = eng.generate(PROMPT, 48, drafter=NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.4, 3))
    finally:
        TreeDecode.commit = real_commit
    assert res.token_ids == ar
    assert seen["lower"] > 0 and seen["gap"] > 0


def test_mask_leak_is_caught():
    """A stage that lets every row see every tree slot of the in-flight positions (no tree
    mask) reads other branches' K/V, poisoned with NaN once dropped: the output leaves AR's."""
    t = make_tiny_target(seed=5, vocab=32, layers=4)
    eng = _engine(t, 3, 4)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    real = TreeDecode.stage_input

    def leaky(self, position):
        idx, prefix, keys, mask = real(self, position)
        if position >= self.committed:  # every live row at every uncommitted position
            keys = [self.slot(p, lane) for p in range(self.committed, position + 1)
                    for lane in range(self.width)]
            mask = [[True] * len(keys) for _ in idx]
        return idx, prefix, keys, mask
    TreeDecode.stage_input = leaky
    try:
        out = eng.generate(PROMPT, 40, drafter=NoisyTreeDrafter(eng.pdm, PROMPT + ar, 0.5, 1))
    finally:
        TreeDecode.stage_input = real
    assert out.token_ids != ar


@pytest.mark.parametrize("lookup", [0, 1])
def test_width_one_tree_is_the_chain(lookup):
    """TreeDecode with W = 1 makes the chain's decisions: same tokens, N, K and judged drafts
    (the context lookup's gate included)."""
    t = make_tiny_target(seed=2, vocab=32, layers=4)
    prompt = PROMPT + PROMPT[:5]
    eng = SPDEngine(t, n_stages=3, anchors=[0, 2, 3], lookup=lookup)
    drafter = KeyedDrafter(eng.pdm, prompt + eng.generate_ar(prompt, 32).token_ids, lookup)
    runs = {}
    for name, cls in (("chain", SequenceDecode), ("tree", TreeDecode)):
        ids, max_new, rule = eng.prepare_request(prompt, 32, None, None)
        kw = {"width": 1} if cls is TreeDecode else {}
        dec = cls(t, eng.layout, drafter, ids, max_new, SamplingParams(),
                  DecodeStats(mode="spd", n=3), None, rule, **kw)
        stages = eng._prepare_stages(dec.buffer_rows, 3)
        runner = LocalStages if cls is SequenceDecode else TreeLocalStages
        dec.start(eng._prefill(stages, ids, dec)[-1:], 0.0, runner(eng, stages, dec))
        dec.run()
        s = dec.stats
        runs[name] = (dec.out, s.N, s.K, s.drafts_judged, s.drafts_accepted, s.lookup_judged)
    assert runs["tree"] == runs["chain"]
    assert 0 < runs["chain"][4] < runs["chain"][3]


@pytest.mark.slow
def test_default_model_tree_equals_ar(default_target):
    eng = SPDEngine(default_target, n_stages=4, tree_width=4)
    prompt = [{"role": "user", "content": "List three prime numbers and explain why."}]
    res = eng.generate(prompt, 32)
    assert res.token_ids == eng.generate_ar(prompt, 32).token_ids
    assert res.stats.drafts_accepted > 0


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
    for seed in range(1000):  # about 25 s a case on one CPU core
        res = eng.generate(prompt, 8, SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed))
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


def test_tree_schedule_gaps():
    s = TreeSchedule(4)
    s.seed(10, drafter_valid=10)
    for _ in range(3):
        s.fill()
    assert s.depths == [3, 2, 1, 0] and s.full and s.judged == 11
    s.accept(keep_through=12, entered=False)   # the branch ends at 12: 13 dropped, no entry
    assert (s.start, s.depths) == (11, [3, 2]) and s.full
    s.accept(keep_through=12, entered=True)
    assert (s.start, s.depths, s.newest) == (12, [3, 0]) + (13,) and s.full
    assert s.stage_work() == [(3, 12), (0, 13)]
    s.reject()
    assert (s.start, s.depths) == (13, [0]) and not s.full


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
