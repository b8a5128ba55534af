"""Online distillation: the teacher's features, packing, the streamed corpus, the loop on one
and two ranks (gloo), resuming after a killed rank, memory that does not grow with the data."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_hybrid, make_tiny_target

from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.train.batches import BatchPlan, CachedBatches, Piece, packs, sequence_rng, window
from spd.train.corpus import Corpus, CorpusConfig
from spd.train.distill import FeatureSet, extract_features
from spd.train.teacher import Teacher
from spd.train.trainer import Distiller, TrainConfig, init_pdm

ANCHORS = [0, 2, 3]
ROOT = Path(__file__).resolve().parents[2]


def _pdm(t, n=2, vocab=None):
    lay = DepthLayout.build(t.num_layers, n, None, ANCHORS)
    cfg = TrainConfig(n_stages=n, anchors=ANCHORS, pdm_layers=2, intermediate_size=64,
                      draft_vocab_size=t.vocab_size, seed=3)
    pdm = init_pdm(t, lay, cfg, vocab if vocab is not None else torch.arange(t.vocab_size))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # away from init's identities, so every weight gets a gradient
        for name, p in pdm.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return pdm


def _grads(pdm):
    return torch.cat([p.grad.flatten() for p in pdm.parameters() if p.grad is not None])


def _sums(distiller, pieces, pack_tokens=0):
    distiller.pdm.zero_grad()
    loss, valid, agree, _, tokens = distiller.sums(pieces, pack_tokens)
    loss.backward()
    return float(loss.detach()), valid, agree, tokens, _grads(distiller.pdm)


@pytest.mark.parametrize("make", [lambda: make_tiny_target(seed=7, vocab=40, layers=4, hidden=32),
                                  lambda: make_tiny_hybrid(seed=8, vocab=32)],
                         ids=["llama", "qwen3.5"])
def test_online_and_cached_give_the_same_loss_and_gradients(make, tmp_path):
    """The same batch, its features from the frozen target now or from the cache (stored in
    fp16): the same loss and gradients, up to that rounding."""
    t = make()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, t.vocab_size, (n,), generator=g).tolist() for n in (23, 9, 31)]
    extract_features(t, seqs, ANCHORS, tmp_path / "feat", shard_tokens=16)
    cached = FeatureSet(tmp_path / "feat", t).items
    online = Teacher(t, ANCHORS)(seqs)
    pdm = _pdm(t)
    d = Distiller(t, pdm, ANCHORS)
    fills = [1, 2, 2]
    a = _sums(d, [Piece(x, f, i) for i, (x, f) in enumerate(zip(online, fills))])
    b = _sums(d, [Piece(x, f, i) for i, (x, f) in enumerate(zip(cached, fills))])
    assert a[1:4] == b[1:4]  # loss tokens, agreement, tokens
    assert a[0] == pytest.approx(b[0], rel=2e-3)
    torch.testing.assert_close(a[4], b[4], rtol=2e-2, atol=2e-4)
    # the check can fail: other fill levels give another loss
    c = _sums(d, [Piece(x, 1, i) for i, x in enumerate(online)])
    assert abs(c[0] - a[0]) > 1e-3 * abs(a[0])


def test_packed_sequences_train_as_separate_ones():
    """Packing sequences into one forward (block-diagonal layout, positions restarting) gives
    the loss and gradients of running them one by one."""
    t = make_tiny_target(seed=7, vocab=40, layers=4, hidden=32)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 40, (n,), generator=g).tolist() for n in (12, 7, 20, 5)]
    items = Teacher(t, ANCHORS)(seqs)
    d = Distiller(t, _pdm(t), ANCHORS)
    pieces = [Piece(x, f, i) for i, (x, f) in enumerate(zip(items, [2, 1, 2, 1]))]
    assert [len(p) for p in packs(pieces, 25)] == [2, 2]  # 12+7, then 20+5
    assert [len(p) for p in packs(pieces, 0)] == [1, 1, 1, 1]
    one = _sums(d, pieces, 0)
    for size in (25, 1000):
        packed = _sums(d, pieces, size)
        assert packed[1:4] == one[1:4]
        assert packed[0] == pytest.approx(one[0], rel=1e-5)
        torch.testing.assert_close(packed[4], one[4], rtol=1e-4, atol=1e-6)


def test_batch_plan_splits_a_step_the_same_way_for_any_ranks():
    one = BatchPlan(8, 2, 1)
    two = BatchPlan(8, 4, 2)
    assert one.accumulate == 4 and two.accumulate == 1
    for step in (0, 3):
        a = sorted(g for mb in one.indices(step, 0) for g in mb)
        b = sorted(g for r in (0, 1) for mb in two.indices(step, r) for g in mb)
        assert a == b == list(range(8 * step, 8 * step + 8))
    with pytest.raises(SPDError, match="multiple of ranks x micro-batch"):
        BatchPlan(6, 4, 2)
    # a sequence's window and fill depend on the seed and its index alone
    assert window(100, 10, sequence_rng(0, 7)) == window(100, 10, sequence_rng(0, 7))
    assert window(5, 10, sequence_rng(0, 7)) == (0, 5) and window(50, 0, sequence_rng(0, 1)) == \
        (0, 50)


def test_cached_batches_walk_shuffled_epochs():
    items = [{"tokens": torch.tensor([i] * 4)} for i in range(5)]
    b = CachedBatches(items, BatchPlan(2, 2, 1), 0, 0, seed=3, fill_of=lambda rng: 1)
    seen = [int(p.item["tokens"][0]) for s in range(5) for mb in b.step(s) for p in mb]
    assert sorted(seen[:5]) == list(range(5)) and sorted(seen[5:10]) == list(range(5))
    assert seen[:5] != seen[5:10]  # each epoch its own order
    again = CachedBatches(items, BatchPlan(2, 2, 1), 0, 0, seed=3, fill_of=lambda rng: 1)
    assert [int(p.item["tokens"][0]) for mb in again.step(3) for p in mb] == seen[6:8]


# --- the corpus ----------------------------------------------------------------------------
def _conversations(n, words=6):
    return [[{"role": "user", "content": f"question number {i} " + "word " * (i % words)},
             {"role": "assistant", "content": f"answer {i} " + "more " * (i % 7)}]
            for i in range(n)]


def _write_jsonl(path, convs):
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    return str(path)


def _encode(conv):  # a stand-in tokenizer: one id per character
    return [ord(ch) % 97 for t in conv for ch in t["content"]]


def test_corpus_splits_filters_and_shards(tmp_path):
    from spd.data.conversations import in_holdout
    convs = _conversations(300)
    src = _write_jsonl(tmp_path / "d.jsonl", convs)
    keys = {" ".join(convs[5][0]["content"].split())[:60].lower()}  # one evaluation prompt
    cfg = CorpusConfig([src], max_len=40, min_len=16, holdout=0.1, shuffle_window=16)
    corpus = Corpus(cfg, _encode, exclude_keys=keys)
    stats = corpus.count()
    held = [c for c in convs if in_holdout(c, 0.1)]
    assert 10 < len(held) < 60 and stats.dropped["held out"] == len(held)
    assert stats.dropped["evaluation prompt"] == (0 if in_holdout(convs[5], 0.1) else 1)
    assert stats.dropped["too long"] > 0
    train = list(corpus.epoch(0))
    assert len(train) == stats.sequences and all(16 <= len(s) <= 40 for s in train)
    held_ids = {tuple(_encode(c)) for c in held}
    assert not held_ids & {tuple(s) for s in train}
    assert corpus.held_out(3) == [s for s in map(_encode, held) if 16 <= len(s) <= 40][:3]
    assert list(corpus.epoch(1)) != train and sorted(corpus.epoch(1)) == sorted(train)
    # two ranks read the global stream between them, from any start
    stream = [s for _, (_, s) in zip(range(2 * len(train)), corpus.stream())]
    r0 = [x for _, x in zip(range(len(train)), corpus.stream(0, 0, 2))]
    r1 = [x for _, x in zip(range(len(train)), corpus.stream(0, 1, 2))]
    assert [g for g, _ in r0] == list(range(0, 2 * len(train), 2))
    merged = [x for pair in zip(r0, r1) for x in pair]
    assert [s for _, s in merged] == stream
    assert [x for _, x in zip(range(3), corpus.stream(17, 1, 2))] == r1[8:11]
    cut = Corpus(CorpusConfig([src], max_len=40, too_long="cut", holdout=0.1), _encode, set())
    assert cut.count().sequences > stats.sequences


def test_corpus_refuses_what_it_cannot_use(tmp_path):
    with pytest.raises(SPDError, match="no training data source"):
        CorpusConfig([])
    with pytest.raises(SPDError, match="too_long"):
        CorpusConfig(["x"], too_long="wrap")
    src = _write_jsonl(tmp_path / "short.jsonl", _conversations(5))
    corpus = Corpus(CorpusConfig([src], min_len=500, max_len=600), _encode, set())
    with pytest.raises(SPDError, match="no training sequence in .*short.jsonl.*too short"):
        corpus.count()
    with pytest.raises(SPDError, match="missing.jsonl"):
        Corpus(CorpusConfig([str(tmp_path / "missing.jsonl")]), _encode, set())


def test_a_small_set_holds_one_conversation_out_or_none(tmp_path):
    """The hash share of a small set may hold no conversation: from MIN_FOR_PINNED usable ones
    on, the one the share would take next is held out (never trained on, the same on every
    rank); below that, none is, and the run trains on them all."""
    from spd.data.conversations import conversation_key, in_holdout
    from spd.train.corpus import MIN_FOR_PINNED
    convs = [c for c in _conversations(80, words=12) if not in_holdout(c, 0.02)][:30]
    src = _write_jsonl(tmp_path / "small.jsonl", convs)
    cfg = CorpusConfig([src], max_len=200, min_len=4, holdout=0.02)
    corpus = Corpus(cfg, _encode, set())
    stats = corpus.count()
    assert stats.sequences == 30 and corpus.held_out(4) == []
    assert corpus.pin_holdout(stats)
    lowest = min(convs, key=conversation_key)
    assert corpus.held_out(4) == [_encode(lowest)]
    assert _encode(lowest) not in list(corpus.epoch(0)) and corpus.count().sequences == 29
    again = Corpus(cfg, _encode, set())  # another rank: the same choice
    assert again.pin_holdout(again.count()) and again.pinned == corpus.pinned
    assert not corpus.pin_holdout(corpus.count())  # one is held out now: nothing more
    few = Corpus(CorpusConfig([_write_jsonl(tmp_path / "few.jsonl", convs[:MIN_FOR_PINNED - 1])],
                              max_len=200, min_len=4, holdout=0.02), _encode, set())
    assert not few.pin_holdout(few.count()) and few.held_out(1) == []
    off = Corpus(CorpusConfig([src], max_len=200, min_len=4, holdout=0.0), _encode, set())
    assert not off.pin_holdout(off.count())  # --holdout 0: none wanted


# --- whole runs through the command line ----------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from spd.model.loading import save_tiny_random_llama
    return save_tiny_random_llama(tmp_path_factory.mktemp("online") / "model")


def _train_args(model, data, out, *extra):
    return ["train", "--model", str(model), "--data", *data, "--out", str(out), "--stages",
            "2", "--anchors", "0,2,3", "--pdm-layers", "1", "--intermediate-size", "32",
            "--draft-vocab-size", "49152", "--crop-len", "0", "--max-len", "96",
            "--holdout", "0.1", "--eval-sequences", "2", "--lr", "3e-3", "--json", *extra]


def _run(args, env=None, nproc=1, timeout=300):
    cmd = ([sys.executable, "-m", "spd"] if nproc == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(29500 + os.getpid() % 1000), "-m", "spd"])
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, env=e)


def _history(out):
    return json.loads((Path(out) / "history.json").read_text())


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return _write_jsonl(d / "chat.jsonl", _conversations(120, words=12))


def test_online_training_through_the_cli(tiny_model, chat_data, tmp_path, capsys):
    from spd.cli import main
    out = tmp_path / "run"
    assert main(_train_args(tiny_model, [chat_data], out, "--steps", "4", "--batch", "2",
                            "--eval-every", "2")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["data"]["sequences"] > 50
    assert summary["data"]["dropped"]["held out"] > 0
    hist = _history(out)
    assert [h["step"] for h in hist] == [1, 2, 3, 4] and "S_est" in hist[1] and "accept" in hist[3]
    assert all(h["loss"] > 0 for h in hist) and hist[1]["fill2_kl"] > 0
    c = json.loads((out / "config.json").read_text())
    assert c["extra"]["train"]["lr"] == 3e-3 and c["extra"]["data"]["sources"] == [chat_data]
    # one epoch by default (the paper's schedule) when --steps is not given
    assert main(_train_args(tiny_model, [chat_data], tmp_path / "epoch", "--batch", "16",
                            "--eval-every", "100")) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == -(-summary["data"]["sequences"] // 16)
    # bad input: one clear line each, before any model loads
    assert main(_train_args(tiny_model, [str(tmp_path / "nothing.jsonl")], tmp_path / "x")) == 2
    assert "nothing.jsonl" in capsys.readouterr().err
    assert main(_train_args(tiny_model, [chat_data], tmp_path / "y", "--mode", "online",
                            "--code-prompts", "5")) == 2
    assert "--code-prompts" in capsys.readouterr().err
    for extra, message in ((("--holdout", "1.5"), "--holdout must lie in [0, 1)"),
                           (("--epochs", "0"), "--epochs must be > 0"),
                           (("--batch", "3", "--micro-batch", "2"), "multiple of ranks x micro"),
                           (("--method", "eagle3", "--mode", "online"), "online training is for")):
        assert main(_train_args(tiny_model, [chat_data], tmp_path / "z", *extra)) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "z").exists()


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(tiny_model, chat_data, tmp_path):
    """The same global batch (4 sequences a step) on one process accumulating two micro-batches
    and on two ranks of two sequences each: the same losses and the same weights, up to the
    order of floating-point sums."""
    common = ("--steps", "4", "--batch", "4", "--micro-batch", "2", "--eval-every", "2",
              "--storage", "fp32", "--precision", "fp32")
    one = _run(_train_args(tiny_model, [chat_data], tmp_path / "one", *common))
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(_train_args(tiny_model, [chat_data], tmp_path / "two", *common), nproc=2)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _history(tmp_path / "one"), _history(tmp_path / "two")
    assert [h["tokens"] for h in a] == [h["tokens"] for h in b]
    assert all(h["loss"] > 0 for h in a) and a[0]["loss"] != a[-1]["loss"]  # something trains
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    from safetensors.torch import load_file
    wa = load_file(str(tmp_path / "one" / "model.safetensors"))
    wb = load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def _write_sharegpt(path, convs):
    with open(path, "w") as f:
        for c in convs:
            turns = [{"from": "human" if t["role"] == "user" else "gpt", "value": t["content"]}
                     for t in c]
            f.write(json.dumps({"conversations": turns}) + "\n")
    return str(path)


@pytest.mark.slow
def test_a_small_set_trains_on_two_ranks(tiny_model, tmp_path):
    """48 conversations (OpenAI messages and ShareGPT files) at the default held-out share:
    one is held out and evaluated on; 5 conversations train with a warning and no held-out
    figures."""
    from spd.data.conversations import in_holdout
    convs = [c for c in _conversations(120, words=12) if not in_holdout(c, 0.02)][:48]
    chats = _write_jsonl(tmp_path / "chats.jsonl", convs[:24])
    share = _write_sharegpt(tmp_path / "sharegpt.jsonl", convs[24:])
    args = _train_args(tiny_model, [chats, share], tmp_path / "small", "--steps", "4",
                       "--batch", "2", "--eval-every", "2")
    args[args.index("--holdout") + 1] = "0.02"
    run = _run(args, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["data"]["sequences"] == 47 and "no held-out" not in run.stderr
    assert "accept" in _history(tmp_path / "small")[-1]
    few = _write_jsonl(tmp_path / "few.jsonl", convs[:5])
    args = _train_args(tiny_model, [few], tmp_path / "few", "--steps", "2", "--batch", "2")
    args[args.index("--holdout") + 1] = "0.02"
    run = _run(args)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "no held-out conversation" in run.stderr and "no held-out acceptance" in run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["data"]["sequences"] == 5
    assert all("accept" not in h for h in _history(tmp_path / "few"))


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_and_it_resumes_exactly(tiny_model, chat_data, tmp_path):
    common = ("--steps", "6", "--batch", "4", "--eval-every", "2", "--precision", "fp32")
    whole = _run(_train_args(tiny_model, [chat_data], tmp_path / "whole", *common), nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _run(_train_args(tiny_model, [chat_data], tmp_path / "cut", *common), nproc=2,
                  env={"SPD_TRAIN_FAULT": "rank=1,step=5"}, timeout=240)
    assert killed.returncode != 0
    assert "rerun the same command to resume" in killed.stderr or "Signals.SIGKILL" in \
        killed.stderr, killed.stderr[-3000:]
    assert [h["step"] for h in _history(tmp_path / "cut")] == [1, 2, 3, 4]
    resumed = _run(_train_args(tiny_model, [chat_data], tmp_path / "cut", *common), nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = _history(tmp_path / "whole"), _history(tmp_path / "cut")
    assert [h["step"] for h in b] == list(range(1, 7))
    assert [h["loss"] for h in a] == [h["loss"] for h in b]
    assert all(h["loss"] > 0 for h in a) and len({h["loss"] for h in a}) == 6


@pytest.mark.slow
def test_memory_does_not_grow_with_the_data(tiny_model, tmp_path):
    """A run reads its data as a stream: a source 10x larger, the same steps, the same peak
    memory (give or take what the tokenizer and allocator keep)."""
    peaks = []
    for size in (300, 3000):
        data = _write_jsonl(tmp_path / f"d{size}.jsonl", _conversations(size, words=12) * 1)
        probe = ("import resource, runpy, sys; sys.argv = ['spd'] + sys.argv[1:]; "
                 "from spd.cli import main; rc = main(sys.argv[1:]); "
                 "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); "
                 "sys.exit(rc)")
        r = subprocess.run([sys.executable, "-c", probe] + _train_args(
            tiny_model, [data], tmp_path / f"m{size}", "--steps", "2", "--batch", "2",
            "--eval-every", "2"), capture_output=True, text=True, timeout=300,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert r.returncode == 0, r.stderr[-3000:]
        peaks.append(int(r.stdout.split("PEAK")[1].split()[0]) / 1024)
    assert os.path.getsize(tmp_path / "d3000.jsonl") > 9 * os.path.getsize(tmp_path / "d300.jsonl")
    assert peaks[1] < peaks[0] + 25, peaks  # MB


def test_regeneration_answers_with_the_target_and_resumes(tiny_model, tmp_path):
    """Each conversation's first answer becomes the target's greedy answer to its first user
    turn; two ranks answer disjoint halves; a run killed mid-line resumes without repeating."""
    from spd.model.loading import load_target
    from spd.train.regenerate import generate_answers, prompt_ids, regenerate
    t = load_target(str(tiny_model))
    convs = [[{"role": "system", "content": "Be brief."}] + c for c in _conversations(7)]
    out = tmp_path / "r.jsonl"
    assert regenerate(t, convs, out, max_new_tokens=4, batch_size=3, progress=False) == 7
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["source_index"] for r in rows] == list(range(7))
    for r, c in zip(rows, convs):
        assert r["messages"][:2] == c[:2] and r["messages"][2]["role"] == "assistant"
    ids = prompt_ids(t.tokenizer, convs[3][:2])
    want = t.tokenizer.decode(generate_answers(t, [ids], 4, progress=False)[0],
                              skip_special_tokens=True)
    assert rows[3]["messages"][2]["content"] == want
    # a kill in the middle of a line: the partial line goes, the rest is answered once
    text = out.read_text()
    out.write_text(text[:text.index("\n", len(text) // 2) + 20])
    regenerate(t, convs, out, max_new_tokens=4, batch_size=3, progress=False)
    again = [json.loads(line) for line in out.read_text().splitlines()]
    assert again == rows
    parts = [tmp_path / f"rank{r}.jsonl" for r in (0, 1)]
    for r, p in enumerate(parts):
        regenerate(t, convs, p, max_new_tokens=4, batch_size=2, rank=r, world=2, progress=False)
    split = sorted((json.loads(x) for p in parts for x in p.read_text().splitlines()),
                   key=lambda r: r["source_index"])
    assert split == rows


def test_answer_mask_marks_the_rows_that_drafting_meets(tiny_model):
    """Rows from the first answer token to the one before the end of turn, in every assistant
    turn; the loss and top-1 of a masked item count those rows alone."""
    from spd.model.loading import load_target
    from spd.train.corpus import AnswerMask, encode_conversation
    t = load_target(str(tiny_model))
    tok = t.tokenizer
    conv = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue is one."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Red."}]
    ids = encode_conversation(tok, conv)
    mask = AnswerMask(tok, t.eos_token_ids)(ids)
    kept = tok.decode([i for i, m in zip(ids, mask) if m])
    assert kept == "Blue is one.Red."
    # a masked item's loss is the unmasked loss over those rows alone
    item = Teacher(t, [0, 2, 3])([ids])[0]
    d = Distiller(t, _pdm(t, vocab=torch.arange(t.vocab_size)), [0, 2, 3])
    per_row, valid, agree, counted = d._terms([item], [2], False)
    item["mask"] = torch.tensor(mask)
    m_row, m_valid, m_agree, m_counted = d._terms([item], [2], False)
    torch.testing.assert_close(m_row, per_row)
    assert torch.equal(m_valid, valid & item["mask"]) and int(m_counted.sum()) == sum(mask)
    assert torch.equal(m_agree, agree & item["mask"])
