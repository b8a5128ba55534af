"""The EAGLE-3-style baseline: training-time test equals the inference chain, the decoder is
lossless (greedy token for token, sampling in distribution), training works, checkpoints are
checked. Tiny random targets only."""
import json

import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.baselines.eagle import EagleHead, find_eagle, find_shipped_eagle
from spd.baselines.eagle_decode import EagleDecoder
from spd.baselines.eagle_train import EagleDistiller, EagleTrainConfig, train_eagle
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.train.distill import FeatureSet, extract_features
from spd_kernels import filtered_probs
from spd_kernels.testing import chi2_pvalue

ANCHORS = [0, 1, 2, 3]   # a 4-layer target's feature cache; the head reads [1, 2, 3]


def _random_head(target, vocab=None, seed=1, scale=0.3):
    """A head with every weight random (the training start's zeroed projections would make the
    layer an identity and hide mistakes)."""
    head = EagleHead.initial(target, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            else:  # norm weights
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return head.eval()


# --- 1. training-time test == inference chain --------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_ttt_logits_equal_the_inference_chain(model_type):
    t = make_tiny_target(seed=3, vocab=24, layers=4, hidden=32, model_type=model_type)
    head = _random_head(t, torch.arange(0, 24, 2))
    g = torch.Generator().manual_seed(5)
    T, J = 13, 4
    feats = torch.randn(3, T, 32, generator=g)
    emb = t.embed.weight.detach()[torch.randint(0, 24, (T,), generator=g)]
    with torch.no_grad():
        ttt = head.forward_ttt(feats[:, :T - 1], emb[1:], J)
        checked = 0
        for s in range(T - 1):   # the chain whose step 1 is the cached row at position s
            cache = head.new_cache(T + J)
            out, logits = head.step(emb[1:s + 2], head.fuse(feats[:, :s + 1]), 0, cache)
            torch.testing.assert_close(logits, ttt[0][s], atol=1e-4, rtol=1e-4)
            o = out[-1:]
            for j in range(2, J + 1):   # step j: a new row at position s+j-1 (teacher-forced)
                i = s + j - 1
                if i > T - 2:
                    break
                o, logits = head.step(emb[i + 1:i + 2], o, i, cache)
                torch.testing.assert_close(logits, ttt[j - 1][i], atol=1e-4, rtol=1e-4,
                                           msg=f"step {j} at position {i}")
                checked += 1
    assert checked == sum(min(J - 1, T - 2 - s) for s in range(T - 1))


# --- 2. greedy losslessness ---------------------------------------------------------------------
PROMPTS = [[3], [1, 5, 7, 2], [9, 9, 9, 9, 9, 9, 9, 9, 4, 11, 0]]


def _check_stats(res, eos_cut: bool = False):
    s = res.stats
    assert s.mode == "eagle3" and s.n == 1
    assert s.N == len(res.token_ids) - 1 and s.new_tokens == len(res.token_ids)
    assert sum(v[0] for v in s.by_position.values()) == s.drafts_judged
    assert sum(v[1] for v in s.by_position.values()) == s.drafts_accepted
    # Every round commits its accepted drafts plus one target token (unless EOS cuts it short).
    if eos_cut:
        assert s.N <= s.drafts_accepted + s.K
    else:
        assert s.N == s.drafts_accepted + s.K
    # Draft at chain step j is judged only if steps 1..j-1 were accepted.
    for j, (judged, _) in s.by_position.items():
        if j > 1:
            assert judged <= s.by_position[j - 1][1]


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_greedy_untrained_head_is_lossless(steps):
    t = make_tiny_target(seed=2, vocab=16, layers=4)
    dec = EagleDecoder(t, head="untrained", draft_steps=steps, warn_untrained=False)
    for prompt in PROMPTS:
        for max_new in (1, 2, 7, 30):
            res = dec.generate(prompt, max_new)
            assert res.token_ids == dec.generate_ar(prompt, max_new).token_ids, (prompt, max_new)
            assert len(res.token_ids) == max_new
            _check_stats(res)


def _oracle(dec, reference, prompt_len, wrong_rate=0.0):
    """Make the decoder draft the target's own continuation (wrong at a fixed random set of
    positions, a `wrong_rate` fraction) to exercise long acceptances, partial ones and the bonus
    token."""
    V = dec.target.vocab_size
    wrong = torch.rand(512, generator=torch.Generator().manual_seed(11)) < wrong_rate

    def choose(logits, position, sampling, gen):
        right = reference[position - prompt_len] if position - prompt_len < len(reference) else 0
        return ((right + 1) % V if wrong[position] else right), None
    dec._choose = choose


@pytest.mark.parametrize("wrong_rate", [0.0, 0.3, 0.6])
def test_greedy_oracle_drafts_are_accepted_and_lossless(wrong_rate):
    t = make_tiny_target(seed=2, vocab=16, layers=4)
    judged = accepted = 0
    for prompt in PROMPTS:
        ref = SPDEngine(t, n_stages=1).generate_ar(prompt, 40).token_ids
        for steps, max_new in ((4, 40), (3, 17), (5, 6), (2, 25)):
            # Poisoned rollback: a dropped cache row read again would turn the output into NaNs.
            dec = EagleDecoder(t, head="untrained", draft_steps=steps, warn_untrained=False,
                               debug_poison=True)
            _oracle(dec, ref, len(prompt), wrong_rate)
            res = dec.generate(prompt, max_new)
            assert res.token_ids == ref[:max_new]
            _check_stats(res)
            judged += res.stats.drafts_judged
            accepted += res.stats.drafts_accepted
            if wrong_rate == 0.0:
                assert res.stats.acceptance_rate == 1.0
                assert res.stats.K == -(-(max_new - 1) // (steps + 1))  # ceil
                assert len(res.stats.by_position) == min(steps, max_new - 2)
    if wrong_rate > 0:
        assert 0.2 < accepted / judged < 0.9


def test_greedy_stops_at_eos_mid_round():
    t = make_tiny_target(seed=2, vocab=16, layers=4)
    prompt = PROMPTS[1]
    ref = SPDEngine(t, n_stages=1).generate_ar(prompt, 40).token_ids
    cut = next(i for i in range(5, 40) if ref[i] not in ref[:i])  # first occurrence at i
    t.eos_token_ids = {ref[cut]}
    want = SPDEngine(t, n_stages=1).generate_ar(prompt, 40).token_ids
    assert want == ref[:cut + 1]
    for steps in (2, 5):
        for oracle in (True, False):
            dec = EagleDecoder(t, head="untrained", draft_steps=steps, warn_untrained=False)
            if oracle:
                _oracle(dec, ref, len(prompt))
            res = dec.generate(prompt, 40)
            assert res.token_ids == want
            _check_stats(res, eos_cut=True)
    # EOS as the prefill's token: nothing else is generated.
    t.eos_token_ids = {ref[0]}
    res = EagleDecoder(t, head="untrained", warn_untrained=False).generate(prompt, 40)
    assert res.token_ids == ref[:1] and res.stats.K == 0


def test_decoder_rejects_bad_input():
    t = make_tiny_target(seed=2, vocab=16, layers=4)
    with pytest.raises(SPDError, match="draft_steps must be a positive integer"):
        EagleDecoder(t, head="untrained", draft_steps=0, warn_untrained=False)
    dec = EagleDecoder(t, head="untrained", warn_untrained=False)
    with pytest.raises(SPDError, match="prompt is empty"):
        dec.generate([], 4)
    with pytest.raises(SPDError, match="max_new_tokens"):
        dec.generate([1, 2], 0)
    with pytest.warns(UserWarning, match="no trained EAGLE-3 head"):
        EagleDecoder(t)


# --- 3. sampling follows the target's distribution -----------------------------------------------
V = 12
SAMPLE_PROMPT = [1, 5, 7, 2]


def _exact_first_tokens(target, sp):
    """P(t1, t2) [V, V] and P(t3) [V] under the filtered target distribution."""
    def next_probs(prefixes):
        with torch.no_grad():
            logits = target.hf(torch.tensor(prefixes)).logits[:, -1]
        return filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p).double()

    p1 = next_probs([SAMPLE_PROMPT])[0]
    joint12 = p1[:, None] * next_probs([SAMPLE_PROMPT + [a] for a in range(V)])
    p3 = next_probs([SAMPLE_PROMPT + [a, b] for a in range(V) for b in range(V)])
    return joint12, (joint12.reshape(-1, 1) * p3).sum(0)


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0),
                                SamplingParams(temperature=0.8, top_k=8, top_p=0.9)])
def test_sampled_tokens_follow_target(sp):
    """Tokens 2 and 3 are chain steps 1 and 2 of the first round (max_new=4, 2 drafts): chi-square
    tests at significance 1e-3 with fixed seeds (a failure reproduces)."""
    t = make_tiny_target(seed=21, vocab=V, layers=4, head_scale=3.0)
    head = _random_head(t, torch.tensor([0, 2, 3, 5, 6, 8, 9, 11]), seed=3, scale=0.5)
    with torch.no_grad():  # a confident drafter whose q overlaps p only in part
        head.lm_head.weight.mul_(3.0)
    dec = EagleDecoder(t, head=head, draft_steps=3)
    joint12, marg3 = _exact_first_tokens(t, sp)
    runs = 2000
    c12 = torch.zeros(V * V, dtype=torch.int64)
    c3 = torch.zeros(V, dtype=torch.int64)
    by_pos = {1: [0, 0], 2: [0, 0]}
    for seed in range(runs):
        res = dec.generate(SAMPLE_PROMPT, 4, SamplingParams(sp.temperature, sp.top_k, sp.top_p,
                                                            seed))
        a, b, c, _ = res.token_ids
        c12[a * V + b] += 1
        c3[c] += 1
        for j, (judged, acc) in res.stats.by_position.items():
            if j in by_pos:
                by_pos[j][0] += judged
                by_pos[j][1] += acc
    for j, (judged, acc) in by_pos.items():
        assert judged > 100 and 0.05 < acc / judged < 0.95, (j, judged, acc)
    assert chi2_pvalue(c12, joint12.reshape(-1)) > 1e-3
    assert chi2_pvalue(c3, marg3) > 1e-3


# --- 4. training and checkpoints ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_features(tmp_path_factory):
    """Self-distilled data, as for the real target: short random prompts and the target's own
    greedy continuations (which settle into loops a head can learn)."""
    t = make_tiny_target(seed=7, vocab=40, layers=4, hidden=32, head_scale=6.0)
    g = torch.Generator().manual_seed(0)
    ar = SPDEngine(t, n_stages=1)
    seqs = []
    for i in range(28):
        prompt = torch.randint(0, 40, (3,), generator=g).tolist()
        seqs.append(prompt + ar.generate_ar(prompt, 21 + i % 9).token_ids)
    folder = tmp_path_factory.mktemp("eagle") / "feat"
    extract_features(t, seqs, ANCHORS, folder, shard_tokens=200)
    return t, FeatureSet(folder, t), seqs


def _cfg(**kw):
    base = dict(steps=60, batch_sequences=2, lr=3e-3, warmup=5, eval_every=20, save_every=20,
                eval_sequences=4, seed=0, draft_vocab_size=32, intermediate_size=64,
                ttt_steps=3, draft_steps=4)
    base.update(kw)
    return EagleTrainConfig(**base)


@pytest.fixture(scope="module")
def trained(tiny_features, tmp_path_factory):
    t, fs, _ = tiny_features
    out = tmp_path_factory.mktemp("eagle") / "run"
    last = train_eagle(t, fs, _cfg(), out, progress=False, storage="fp32")
    return out, last


def test_training_lowers_the_loss(tiny_features, trained):
    out, last = trained
    hist = json.loads((out / "history.json").read_text())
    assert [h["step"] for h in hist] == list(range(1, 61))
    early = sum(h["loss"] for h in hist[:5]) / 5
    late = sum(h["loss"] for h in hist[-5:]) / 5
    assert late < 0.6 * early, (early, late)
    assert hist[19]["kl"] > last["kl"]
    assert {"step1_top1", "step2_top1", "step3_top1", "step3_kl"} <= set(last)
    assert last["step1_top1"] > hist[19]["step1_top1"]


class _Stop(Exception):
    pass


def test_training_resumes_exactly(tiny_features, trained, tmp_path, monkeypatch):
    t, fs, _ = tiny_features
    out, last = trained
    # Stop the run right after its first checkpoint (step 20), then start it again.
    import spd.train.loop as loop
    real_save = loop.save_state

    def save_then_stop(obj, path):
        real_save(obj, path)
        raise _Stop

    with monkeypatch.context() as m:
        m.setattr(loop, "save_state", save_then_stop)
        with pytest.raises(_Stop):
            train_eagle(t, fs, _cfg(), tmp_path / "r", progress=False, storage="fp32")
    assert torch.load(tmp_path / "r" / "train_state.pt", weights_only=False)["step"] == 20
    again = train_eagle(t, fs, _cfg(), tmp_path / "r", progress=False, storage="fp32")
    assert again == last   # resumed run == uninterrupted run
    hist = json.loads((tmp_path / "r" / "history.json").read_text())
    assert hist == json.loads((out / "history.json").read_text())
    a, b = EagleHead.load(out, t), EagleHead.load(tmp_path / "r", t)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k
    with pytest.raises(SPDError, match="another configuration"):
        train_eagle(t, fs, _cfg(ttt_steps=2, steps=70), tmp_path / "r", progress=False)


def test_missing_feature_layers_are_named(tiny_features, tmp_path):
    t, fs, seqs = tiny_features
    extract_features(t, seqs, [0, 2, 3], tmp_path / "f", shard_tokens=400)
    with pytest.raises(SPDError, match=r"missing \[1\]"):
        train_eagle(t, FeatureSet(tmp_path / "f", t), _cfg(steps=2), tmp_path / "o",
                    progress=False)


def test_checkpoint_round_trip_and_refusals(tiny_features, trained, tmp_path):
    t, fs, _ = tiny_features
    out, _ = trained
    head = EagleHead.load(out, t)
    assert head.config.method == "eagle3" and head.config.feature_layers == [1, 2, 3]
    assert torch.equal(head.lm_head.weight, t.lm_head.weight[head.draft_to_target].float())
    head.save(tmp_path / "fp32", storage="fp32")
    head.save(tmp_path / "int8", storage="int8")
    item = fs.items[0]
    d = EagleDistiller(t, head, fs.anchors, 3)
    again = EagleDistiller(t, EagleHead.load(tmp_path / "fp32", t), fs.anchors, 3)
    quant = EagleDistiller(t, EagleHead.load(tmp_path / "int8", t), fs.anchors, 3)
    with torch.no_grad():
        ref, same, close = d.loss(item), again.loss(item), quant.loss(item)
    assert ref[1] == same[1] and ref[2] == same[2]
    assert max(abs(a - b) for a, b in zip(ref[1], close[1])) < 0.05
    with pytest.raises(SPDError, match="trained on another target"):
        EagleHead.load(out, make_tiny_target(seed=1, vocab=40, layers=4, hidden=32))
    with pytest.raises(SPDError, match="pass the target"):
        EagleHead.load(out)
    # A PDM folder is not an EAGLE-3 head, and an EAGLE-3 folder is not a PDM.
    lay = DepthLayout.build(4, 2, None, ANCHORS)
    PipelineDraftModule.untrained(t, lay, 1).save(tmp_path / "pdm")
    with pytest.raises(SPDError, match="is a PDM checkpoint"):
        EagleHead.load(tmp_path / "pdm", t)
    with pytest.raises(SPDError, match="is a PDM checkpoint"):
        EagleDecoder(t, head=tmp_path / "pdm")
    with pytest.raises(SPDError, match="eagle3 draft head, not a PDM"):
        PipelineDraftModule.load(out, t, lay)
    with pytest.raises(SPDError, match="not found"):
        EagleHead.load(tmp_path / "nowhere", t)


def test_trained_head_drafts_better_and_stays_exact(tiny_features, trained, tmp_path,
                                                    monkeypatch):
    t, fs, seqs = tiny_features
    out, _ = trained
    good_alpha = bad_alpha = 0.0
    for prompt in ([5, 1, 30], [7, 7, 2, 9], [11, 3, 25]):   # not in the training data
        ar = SPDEngine(t, n_stages=1).generate_ar(prompt, 40).token_ids
        good = EagleDecoder(t, head=out).generate(prompt, 40)
        bad = EagleDecoder(t, head="untrained", warn_untrained=False).generate(prompt, 40)
        assert good.token_ids == ar == bad.token_ids
        _check_stats(good)
        good_alpha += good.stats.alpha
        bad_alpha += bad.stats.alpha
    assert good_alpha > 1.2 * bad_alpha, (good_alpha, bad_alpha)
    # A head shipped in the package's checkpoint folder is found by fingerprint.
    import spd.baselines.eagle
    monkeypatch.setattr(spd.baselines.eagle, "SHIPPED_DIR", tmp_path)
    assert find_shipped_eagle(t) is None
    EagleHead.load(out, t).save(tmp_path / "tiny-eagle", storage="int8")
    assert find_shipped_eagle(t) == tmp_path / "tiny-eagle"
    assert find_eagle(t, search=[tmp_path / "none", tmp_path]) == tmp_path / "tiny-eagle"
    dec = EagleDecoder(t)
    assert dec.head_source == str(tmp_path / "tiny-eagle") and dec.draft_steps == 4
    assert dec.generate(prompt, 40).token_ids == ar
    assert dec.generate(prompt, 40, SamplingParams(temperature=0.7, seed=1)).stats.N == 39
