"""PDM training pipeline on tiny random targets: data, features, training, checkpoints."""
import json

import pytest
import torch
from conftest import make_tiny_target

from spd.data.datasets import iter_conversations, load_question_file
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.train.distill import FeatureSet, extract_features
from spd.train.trainer import TrainConfig, build_draft_vocab, train

ANCHORS = [0, 2, 3]


@pytest.fixture
def tiny_features(tmp_path):
    t = make_tiny_target(seed=7, vocab=40, layers=4, hidden=32, head_scale=6.0)
    g = torch.Generator().manual_seed(0)
    # Sequences with structure (repeated motifs), so there is something to learn.
    seqs = []
    for i in range(24):
        motif = torch.randint(0, 40, (5,), generator=g).tolist()
        seqs.append((motif * 8)[: 24 + i % 9])
    extract_features(t, seqs, ANCHORS, tmp_path / "feat", shard_tokens=200)
    return t, FeatureSet(tmp_path / "feat", t), seqs


def _cfg(**kw):
    base = dict(n_stages=2, anchors=ANCHORS, pdm_layers=1, intermediate_size=64,
                draft_vocab_size=32, steps=60, batch_sequences=2, lr=3e-3, warmup=5,
                eval_every=30, save_every=30, eval_sequences=4, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_features_are_resumable_and_complete(tiny_features, tmp_path):
    t, fs, seqs = tiny_features
    assert len(fs) == len(seqs) and fs.token_count() == sum(map(len, seqs))
    assert len(fs.meta["shards"]) > 2
    item = fs.items[3]
    assert item["anchors"].shape == (3, len(seqs[3]), 32)
    assert item["tokens"].tolist() == seqs[3]
    # Rerunning skips finished shards (same files, untouched).
    shard = tmp_path / "feat" / fs.meta["shards"][0]
    before = shard.stat().st_mtime_ns
    extract_features(t, seqs, ANCHORS, tmp_path / "feat", shard_tokens=200)
    assert shard.stat().st_mtime_ns == before
    with pytest.raises(SPDError, match="another target"):
        FeatureSet(tmp_path / "feat", make_tiny_target(seed=8, vocab=40, layers=4, hidden=32))
    with pytest.raises(SPDError, match="another target, anchor set or data"):
        extract_features(t, seqs[:5], ANCHORS, tmp_path / "feat")


def test_features_of_other_data_with_the_same_count_are_refused(tiny_features, tmp_path):
    """The folder is keyed by the data itself, not by the number of sequences: other data
    options with the same count were silently reused before."""
    t, fs, seqs = tiny_features
    other = [list(reversed(s)) for s in seqs]
    with pytest.raises(SPDError, match=r"differs: data_sha256.*--features with a fresh folder"):
        extract_features(t, other, ANCHORS, tmp_path / "feat", shard_tokens=200)


def test_feature_folders_concatenate_in_order(tiny_features, tmp_path):
    t, fs, seqs = tiny_features
    extract_features(t, seqs[:5], ANCHORS, tmp_path / "more", shard_tokens=200)
    both = FeatureSet([tmp_path / "more", tmp_path / "feat"], t)
    assert len(both) == len(fs) + 5
    assert both.items[0]["tokens"].tolist() == seqs[0]
    assert both.items[-1]["tokens"].tolist() == seqs[-1]  # held-out rows come from the last
    extract_features(t, seqs[:5], [0, 1, 3], tmp_path / "other", shard_tokens=200)
    with pytest.raises(SPDError, match="anchors"):
        FeatureSet([tmp_path / "other", tmp_path / "feat"], t)
    with pytest.raises(SPDError, match="no meta.json"):
        FeatureSet([tmp_path / "missing", tmp_path / "feat"], t)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_lowers_loss_and_is_deterministic(tiny_features, tmp_path, precision):
    t, fs, _ = tiny_features
    first = train(t, fs, _cfg(precision=precision), tmp_path / "a", progress=False)
    hist = json.loads((tmp_path / "a" / "history.json").read_text())
    early = sum(h["loss"] for h in hist[:5]) / 5
    late = sum(h["loss"] for h in hist[-5:]) / 5
    assert late < 0.6 * early, (early, late)
    assert hist[29]["fill2_kl"] > hist[-1]["fill2_kl"]
    second = train(t, fs, _cfg(precision=precision), tmp_path / "b", progress=False)
    untimed = lambda rec: {k: v for k, v in rec.items() if k != "time_s"}
    assert untimed(first) == untimed(second)  # same seed, same data: the same run
    a = PipelineDraftModule.load(tmp_path / "a", t, DepthLayout.build(4, 2, None, ANCHORS))
    b = PipelineDraftModule.load(tmp_path / "b", t, DepthLayout.build(4, 2, None, ANCHORS))
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), k


def test_training_resumes(tiny_features, tmp_path):
    t, fs, _ = tiny_features
    train(t, fs, _cfg(steps=30), tmp_path / "r", progress=False)
    train(t, fs, _cfg(steps=60), tmp_path / "r", progress=False)
    hist = json.loads((tmp_path / "r" / "history.json").read_text())
    assert [h["step"] for h in hist] == list(range(1, 61))
    with pytest.raises(SPDError, match="another configuration"):
        train(t, fs, _cfg(n_stages=3, steps=70), tmp_path / "r", progress=False)


def test_resuming_with_other_settings_is_refused_before_any_state_is_loaded(tiny_features,
                                                                           tmp_path):
    """A changed learning rate or PDM shape would mix two runs (a changed shape used to end in a
    state_dict traceback); more steps are allowed, with a warning."""
    t, fs, _ = tiny_features
    train(t, fs, _cfg(steps=4, save_every=4, eval_every=4), tmp_path / "r", progress=False)
    for change, name in ((dict(lr=1e-2), "lr: 0.003 -> 0.01"),
                         (dict(pdm_layers=2), "pdm_layers: 1 -> 2"),
                         (dict(intermediate_size=32), "intermediate_size: 64 -> 32")):
        with pytest.raises(SPDError, match=f"other settings \\({name}\\); resuming would mix"):
            train(t, fs, _cfg(steps=4, save_every=4, eval_every=4, **change), tmp_path / "r",
                  progress=False)
    with pytest.warns(UserWarning, match="with --steps 6 .*started with 4"):
        train(t, fs, _cfg(steps=6, save_every=4, eval_every=4), tmp_path / "r", progress=False)


def test_resuming_on_other_data_is_refused(tiny_features, tmp_path):
    from spd.train.loop import check_resume
    saved = dict(lr=1e-3, steps=10, data="aaa", history=[1])
    check_resume(saved, dict(lr=1e-3, steps=10, data="aaa", history=[]), tmp_path)
    with pytest.raises(SPDError, match="data: 'aaa' -> 'bbb'"):
        check_resume(saved, dict(lr=1e-3, steps=10, data="bbb", history=[]), tmp_path)


def test_interrupted_run_resumes_exactly(tiny_features, tmp_path, monkeypatch):
    """Stopped right after its step-25 checkpoint (mid-epoch: 20 training sequences, 2 a step)
    and restarted, a run ends with the same weights as one that never stopped."""
    t, fs, _ = tiny_features
    cfg = dict(save_every=25)
    train(t, fs, _cfg(**cfg), tmp_path / "whole", progress=False, storage="fp32")
    import spd.train.loop as loop
    real_save = loop.save_state

    def save_then_stop(obj, path, *a, **k):
        real_save(obj, path, *a, **k)
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "save_state", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train(t, fs, _cfg(**cfg), tmp_path / "split", progress=False, storage="fp32")
    monkeypatch.setattr(loop, "save_state", real_save)
    train(t, fs, _cfg(**cfg), tmp_path / "split", progress=False, storage="fp32")
    a = PipelineDraftModule.load(tmp_path / "whole", t).state_dict()
    b = PipelineDraftModule.load(tmp_path / "split", t).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_round_trip_and_refusals(tiny_features, tmp_path):
    t, fs, _ = tiny_features
    train(t, fs, _cfg(steps=4), tmp_path / "c", progress=False, storage="fp32")
    lay = DepthLayout.build(4, 2, None, ANCHORS)
    exact = PipelineDraftModule.load(tmp_path / "c", t, lay)
    exact.save(tmp_path / "q", storage="int8")
    quant = PipelineDraftModule.load(tmp_path / "q", t, lay)
    for (k, x), (_, y) in zip(exact.state_dict().items(), quant.state_dict().items()):
        if x.is_floating_point():
            assert (x - y).abs().max() <= x.abs().max() / 127 + 1e-6, k
        else:
            assert torch.equal(x, y), k
    # The head is not stored: rebuilt from the target's rows of the draft vocabulary.
    assert torch.equal(quant.lm_head.weight, t.lm_head.weight[quant.draft_to_target].float())
    with pytest.raises(SPDError, match="trained on another target"):
        PipelineDraftModule.load(tmp_path / "q", make_tiny_target(seed=1, vocab=40, layers=4,
                                                                  hidden=32), lay)
    with pytest.raises(SPDError, match="n=2 stages but n=4"):
        PipelineDraftModule.load(tmp_path / "q", t, DepthLayout.build(4, 4, None, ANCHORS))
    with pytest.raises(SPDError, match="pass the target"):
        PipelineDraftModule.load(tmp_path / "q")


def test_trained_pdm_drafts_in_the_engine(tiny_features, tmp_path):
    from spd import SPDEngine
    t, fs, seqs = tiny_features
    train(t, fs, _cfg(steps=60), tmp_path / "e", progress=False)
    trained = SPDEngine(t, n_stages=2, anchors=ANCHORS, pdm=tmp_path / "e")
    untrained = SPDEngine(t, n_stages=2, anchors=ANCHORS, pdm="untrained")
    prompt = seqs[0][:10]
    a = trained.generate(prompt, 40)
    assert a.token_ids == untrained.generate_ar(prompt, 40).token_ids
    assert a.stats.acceptance_rate > untrained.generate(prompt, 40).stats.acceptance_rate


def test_draft_vocab_by_frequency():
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert build_draft_vocab(counts, 3).tolist() == [0, 2, 5]
    assert build_draft_vocab(counts, 10).tolist() == list(range(6))


def test_draft_vocab_by_coverage():
    """The fewest frequent ids that cover a share of the argmax counts (29 in all)."""
    from spd.train.trainer import coverage_size
    counts = torch.tensor([5, 0, 9, 5, 1, 9])
    assert [coverage_size(counts, c) for c in (0.1, 18 / 29, 18.5 / 29, 28 / 29, 1.0)] == \
        [1, 2, 3, 4, 5]
    assert build_draft_vocab(counts, None, 18 / 29).tolist() == [2, 5]
    assert build_draft_vocab(counts, None, 0.9).tolist() == [0, 2, 3, 5]
    assert build_draft_vocab(counts, 3, 0.99).tolist() == [0, 2, 5]  # capped by the size
    assert build_draft_vocab(counts, 0, 1.0).tolist() == [0, 2, 3, 4, 5]  # 0: no cap
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(SPDError, match="coverage must lie in"):
            build_draft_vocab(counts, None, bad)


def test_truncated_sharegpt_json_decodes_whole_objects():
    text = ('[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}, '
            '{"from": "gpt", "value": "hello"}]},\n {"id": "b", "conversations": '
            '[{"from": "gpt", "value": "starts with the model"}]},\n {"id": "c", "conversa')
    convs = list(iter_conversations(text))
    assert convs == [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]]


def test_question_file_errors(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text('{"question_id": 1, "turns": ["What is 2+2?"]}\n{"turns": []}\n')
    with pytest.raises(SPDError, match=":2: 'turns' must be a non-empty list"):
        load_question_file(p)
    with pytest.raises(SPDError, match="does not exist"):
        load_question_file(tmp_path / "missing.jsonl")
    p.write_text('{"question_id": 1, "turns": ["What is 2+2?"]}\n')
    assert load_question_file(p)[0]["turns"] == ["What is 2+2?"]


def test_sequences_are_built_once(tmp_path):
    from spd.train.distill import cached_sequences
    calls = []

    def build():
        calls.append(1)
        return [[1, 2, 3], [4, 5]]

    assert cached_sequences(tmp_path / "s.json", build) == [[1, 2, 3], [4, 5]]
    assert cached_sequences(tmp_path / "s.json", build) == [[1, 2, 3], [4, 5]]
    assert len(calls) == 1


def test_crop_takes_one_consistent_window(tiny_features):
    import random

    from spd.train.trainer import crop
    _, fs, seqs = tiny_features
    item = fs.items[10]
    w = crop(item, 7, random.Random(1))
    toks = item["tokens"].tolist()
    start = next(a for a in range(len(toks) - 6) if toks[a:a + 7] == w["tokens"].tolist()
                 and torch.equal(item["final"][a:a + 7], w["final"]))
    assert torch.equal(w["anchors"], item["anchors"][:, start:start + 7])
    assert torch.equal(w["argmax"], item["argmax"][start:start + 7])
    assert crop(item, 1000, random.Random(1)) is item
    assert torch.equal(crop(item, 5, None)["tokens"], item["tokens"][:5])


@pytest.fixture(scope="module")
def tiny_hf_target(tmp_path_factory):
    from spd.model.loading import load_target, save_tiny_random_llama
    return load_target(str(save_tiny_random_llama(tmp_path_factory.mktemp("distill") / "m")))


def _greedy(hf, ids, new):
    ids = list(ids)
    for _ in range(new):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_self_distill_is_the_targets_greedy_response(tiny_hf_target, dtype):
    """Each sequence is the prompt plus the greedy continuation of the target (in `dtype` when
    given), whatever the left padding of its batch; the target itself is never cast."""
    import copy

    from spd.train.distill import _prompt_ids, self_distill
    t = tiny_hf_target
    before = {k: v.clone() for k, v in t.hf.state_dict().items()}
    prompts = ["Hi", "Name three rivers in Europe, please.", "What is 2+2?"]
    # bf16 rounding differs with the padding of a batch: compare those one prompt at a time
    seqs = self_distill(t, prompts, max_new_tokens=12, batch_size=1 if dtype else 3,
                        dtype=dtype)
    ref = copy.deepcopy(t.hf).to(dtype) if dtype else t.hf
    eos = set(t.eos_token_ids)
    differs = False  # the bf16 case only tells something if bf16 and fp32 greedy text differ
    with torch.no_grad():
        for p, s in zip(prompts, seqs):
            ids = _prompt_ids(t.tokenizer, p)
            if dtype is None:
                want = _greedy(ref, ids, 12)  # recomputed from scratch every step
            else:
                # In bf16 a cached step and a full recompute round differently, and which one
                # ties break towards depends on the CPU's bf16 kernels (AVX512-BF16 or not): the
                # reference is the bf16 copy's own cached greedy generation.
                pad = min(t.eos_token_ids)
                want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                    dtype=torch.long), max_new_tokens=12, do_sample=False,
                                    pad_token_id=pad)[0].tolist()
            cut = next((len(ids) + k + 1 for k, x in enumerate(want[len(ids):]) if x in eos),
                       len(want))
            assert s == want[:cut]
            differs |= dtype is not None and want != _greedy(t.hf, ids, 12)
    assert differs or dtype is None
    after = t.hf.state_dict()
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v)
               for k, v in before.items())


CODE_MODULE = '''"""A module."""
import os


def documented(path, mode="r"):
    """Open the file at path and return its first line, stripped of spaces."""
    with open(path, mode) as f:
        return f.readline().strip()


def _private(x):
    """A private helper that the prompts must leave out, however well documented."""
    return x
    pass


@staticmethod
def decorated(x):
    """A decorated function: its source would not read as a plain function head."""
    return x
    pass


def undocumented(x):
    y = x + 1
    return y


def terse(x):
    """Too short."""
    return x
    pass


def has_close_elements(numbers, threshold):
    """A HumanEval name: excluded when the caller passes HumanEval's names."""
    x = 1
    return x


class Holder:
    def method(self):
        """Methods need their class around them to make sense: left out."""
        return 1
        pass


def second(a: int,
           b: int) -> int:
    """Add two numbers and return the sum; a signature over two lines."""
    s = a + b
    return s
'''


def test_python_function_prompts(tmp_path):
    from spd.data.datasets import (
        CODE_INSTRUCTIONS,
        humaneval_function_names,
        python_function_prompts,
    )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(CODE_MODULE)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_mod.py").write_text(CODE_MODULE)  # test folders are passed over
    (tmp_path / "broken.py").write_text("def f(:\n")  # unparsable files are passed over
    prompts = python_function_prompts(tmp_path)
    heads = [p.split("```python\n", 1)[1] for p in prompts]
    assert heads == [
        'def documented(path, mode="r"):\n'
        '    """Open the file at path and return its first line, stripped of spaces."""\n```',
        'def has_close_elements(numbers, threshold):\n'
        '    """A HumanEval name: excluded when the caller passes HumanEval\'s names."""\n```',
        'def second(a: int,\n           b: int) -> int:\n'
        '    """Add two numbers and return the sum; a signature over two lines."""\n```']
    assert [p.split("\n\n", 1)[0] for p in prompts] == list(CODE_INSTRUCTIONS)
    assert python_function_prompts(tmp_path) == prompts  # a fixed order
    names = humaneval_function_names()
    assert {"has_close_elements", "below_zero", "sort_array"} <= names and len(names) > 150
    kept = python_function_prompts(tmp_path, exclude_names=names)
    assert len(kept) == 2 and not any("has_close_elements" in p for p in kept)
    with pytest.raises(SPDError, match="no Python source folder"):
        python_function_prompts(tmp_path / "missing")
    # an installed package's sources: the root's own path may hold site-packages
    pkg = tmp_path / "venv" / "site-packages" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(CODE_MODULE)
    (pkg / "tests").mkdir()
    (pkg / "tests" / "test_mod.py").write_text(CODE_MODULE)
    assert python_function_prompts(pkg) == python_function_prompts(tmp_path / "pkg")


def test_code_prompts_join_the_self_distilled_data(tiny_hf_target, monkeypatch):
    """build_sequences answers `code_prompts` of the shuffled code pool after `skip`, next to the
    ShareGPT prompts, and refuses to take more than the pool holds."""
    import random

    import spd.data.datasets as ds
    from spd.train.distill import _prompt_ids, build_sequences
    pool = [f"Implement f{i}.\n\n```python\ndef f{i}(x):\n    \"\"\"Doc {i}.\"\"\"\n```"
            for i in range(6)]
    roots = {"pkgA": [f"A{i}" for i in range(3)], "pkgB": ["B0"]}
    monkeypatch.setattr(ds, "python_function_prompts", lambda root=None, exclude_names=():
                        list(pool) if root is None else list(roots[root]))
    monkeypatch.setattr(ds, "humaneval_function_names", lambda: set())
    monkeypatch.setattr(ds, "iter_sharegpt", lambda: iter(
        [[{"role": "user", "content": f"Question {i}?"}] for i in range(4)]))
    t = tiny_hf_target
    seqs = build_sequences(t, conversations=0, self_distill_prompts=1, max_len=200,
                           response_tokens=3, skip=1, code_prompts=2, exclude_eval=False)
    shuffled = list(pool)
    random.Random(0).shuffle(shuffled)
    convs = [f"Question {i}?" for i in range(4)]
    random.Random(0).shuffle(convs)
    want = [convs[1]] + shuffled[1:3]
    assert len(seqs) == 3
    for s, p in zip(seqs, want):
        ids = _prompt_ids(t.tokenizer, p)
        assert s[:len(ids)] == ids and len(ids) < len(s) <= len(ids) + 3
    with pytest.raises(SPDError, match="asked for 6 code prompts after skipping 1.*give 6"):
        build_sequences(t, conversations=0, self_distill_prompts=0, max_len=200,
                        response_tokens=3, skip=1, code_prompts=6, exclude_eval=False)
    # Package roots come after the standard library's prompts, shuffled among themselves: the
    # standard-library part (and what a skip passes over) is unchanged.
    more = roots["pkgA"] + roots["pkgB"]
    random.Random(0).shuffle(more)
    seqs = build_sequences(t, conversations=0, self_distill_prompts=0, max_len=200,
                           response_tokens=3, skip=5, code_prompts=3, exclude_eval=False,
                           code_roots=["pkgA", "pkgB"])
    assert len(seqs) == 3
    for s, p in zip(seqs, shuffled[5:] + more[:2]):
        ids = _prompt_ids(t.tokenizer, p)
        assert s[:len(ids)] == ids
    with pytest.raises(SPDError, match="standard library and the code roots give 10"):
        build_sequences(t, conversations=0, self_distill_prompts=0, max_len=200,
                        response_tokens=3, skip=8, code_prompts=3, exclude_eval=False,
                        code_roots=["pkgA", "pkgB"])


def test_warm_start_into_a_deeper_pdm_computes_the_same(tiny_features, tmp_path):
    """A PDM with more layers than its --init-from source starts as the identity in the new
    layers: its drafts equal the source's until training moves them."""
    from spd.train.trainer import init_pdm, warm_start
    t, fs, _ = tiny_features
    train(t, fs, _cfg(steps=4), tmp_path / "one", progress=False, storage="fp32")
    lay = DepthLayout.build(4, 2, None, ANCHORS)
    src = PipelineDraftModule.load(tmp_path / "one", t, lay)
    deeper = init_pdm(t, lay, _cfg(pdm_layers=2), src.draft_to_target)
    copied = warm_start(deeper, tmp_path / "one")
    assert not any(k.startswith("layers.1.") for k in copied)
    new = deeper.layers[1]
    assert new.self_attn.q_proj.weight.abs().sum() > 0  # only the output projections are zeroed
    feats = torch.randn(7, src.config.hidden_size, generator=torch.Generator().manual_seed(3))
    want = src.step(feats, 0, src.new_cache(16))
    got = deeper.step(feats, 0, deeper.new_cache(16))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the check can fail: a new layer that writes changes the drafts
        new.mlp.down_proj.weight.normal_(std=0.5)
    assert not torch.allclose(deeper.step(feats, 0, deeper.new_cache(16)), want, atol=1e-3)


def test_argmax_weight_adds_the_argmax_cross_entropy(tiny_features):
    """loss = KL + w * CE(target argmax) over the positions whose argmax the draft vocabulary
    holds; kl_only (what evaluation reports) leaves the extra term out."""
    import torch.nn.functional as F

    from spd.train.trainer import Distiller, init_pdm
    t, fs, _ = tiny_features
    lay = DepthLayout.build(4, 2, None, ANCHORS)
    vocab = build_draft_vocab(fs.argmax_counts(t.vocab_size), 8)  # some argmaxes fall outside
    pdm = init_pdm(t, lay, _cfg(), vocab)
    with torch.no_grad():
        for p in pdm.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    item = next(x for x in fs.items if 0 < int(torch.isin(x["argmax"].long(), vocab).sum())
                < len(x["tokens"]))
    d0 = Distiller(t, pdm, fs.anchors)
    d1 = Distiller(t, pdm, fs.anchors, argmax_weight=0.7)
    kl, nvalid, agree = d0.loss(item, 1)
    both, nvalid1, agree1 = d1.loss(item, 1)
    kl_only, _, _ = d1.loss(item, 1, kl_only=True)
    assert 0 < nvalid < len(item["tokens"]) and (nvalid1, agree1) == (nvalid, agree)
    torch.testing.assert_close(kl_only, kl)
    # brute force: the draft's log-probabilities, column by column in target ids
    q_logp = F.log_softmax(pdm.forward_train(item["anchors"][d0.slots].float(),
                                             d0.layout_for((len(item["tokens"]),), (1,))), dim=-1)
    ce = []
    for pos, tok in enumerate(item["argmax"].tolist()):
        if tok in vocab.tolist():
            ce.append(-q_logp[pos, vocab.tolist().index(tok)])
    want = kl + 0.7 * torch.stack(ce).sum() / nvalid
    torch.testing.assert_close(both, want)
    assert float((both - kl).detach()) > 0.01  # the term is there and not negligible


def test_bf16_training_follows_fp32():
    """bf16 autocast changes the arithmetic of the loss, not what is learnt: from the same start,
    the first step's loss and gradient agree with fp32 to within a few percent (and differ, so
    autocast is really on)."""
    from spd.train.loop import resolve_precision
    from spd.train.trainer import Distiller, init_pdm
    t = make_tiny_target(seed=7, vocab=40, layers=4, hidden=64, head_scale=6.0)
    lay = DepthLayout.build(4, 2, None, ANCHORS)
    g = torch.Generator().manual_seed(1)
    item = {"anchors": torch.randn(len(ANCHORS), 30, 64, generator=g),
            "final": torch.randn(30, 64, generator=g)}
    item["tokens"] = torch.zeros(30, dtype=torch.int32)
    item["argmax"] = (item["final"] @ t.lm_head.weight.detach().t()).argmax(-1).int()
    pdm = init_pdm(t, lay, _cfg(intermediate_size=128), torch.arange(40))
    with torch.no_grad():
        for p in pdm.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    d = Distiller(t, pdm, ANCHORS)
    out = {}
    for precision in ("fp32", "bf16"):
        pdm.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _, _ = d.loss(item, 2)
        loss.backward()
        grads = [p.grad.flatten() for p in pdm.parameters() if p.grad is not None]
        out[precision] = (float(loss.detach()), torch.cat(grads))
    (l32, g32), (l16, g16) = out["fp32"], out["bf16"]
    assert l16 != l32 and abs(l16 - l32) < 0.03 * l32
    assert float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)) > 0.99
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("auto", "cpu") in ("fp32", "bf16")
    with pytest.raises(SPDError, match="precision must be one of"):
        resolve_precision("fp16", "cpu")
