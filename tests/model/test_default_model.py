"""Greedy losslessness on the real default model (SmolLM2-135M-Instruct), against HF generate.

Slow: the model is fetched and converted once into $SPD_CACHE, then each case decodes 48 tokens.
"""
import json

import pytest
import torch

from spd import SPDEngine
from spd.cli import main
from spd.draft.drafters import ReferenceDrafter
from spd.draft.lookup import DEFAULT_MIN_LEN
from spd.errors import SPDError
from spd.model.prompt import encode_prompt

pytestmark = pytest.mark.slow

PROMPTS = [
    ("Explain in detail how a CPU cache works.", True),
    ("Write a short story about a robot who learns to paint.", True),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
]
NEW = 48


@pytest.fixture(scope="module")
def references(default_target):
    """Prompt ids and Hugging Face's own greedy continuation for each prompt."""
    out = []
    for text, chat in PROMPTS:
        ids = encode_prompt(default_target.tokenizer, text, chat)
        with torch.no_grad():
            gen = default_target.hf.generate(torch.tensor([ids]), max_new_tokens=NEW,
                                             do_sample=False)
        out.append((ids, gen[0, len(ids):].tolist()))
    # The references must be long enough to exercise the steady state, not stop at once.
    assert sum(len(r) for _, r in out) >= 2 * NEW
    return out


@pytest.fixture(scope="module")
def engines(default_target):
    return {n: SPDEngine(default_target, n_stages=n, pdm="untrained", warn_untrained=False)
            for n in (2, 3, 4, 6)}


@pytest.mark.parametrize("n", [3])  # n with a shipped PDM: test_shipped_pdm_is_picked_...
def test_untrained_pdm_matches_hf_generate(engines, references, n):
    for ids, ref in references:
        res = engines[n].generate(ids, NEW)
        assert res.token_ids == ref


@pytest.mark.parametrize("n", [2, 6])
def test_oracle_drafter_fill_limited_alpha(engines, references, n):
    for ids, ref in references:
        res = engines[n].generate(ids, NEW, drafter=ReferenceDrafter(ids + ref))
        assert res.token_ids == ref
        st = res.stats
        # No rejection: the only cycles without a commit are the n-1 of the first fill.
        assert st.acceptance_rate == 1.0 and st.K == st.N + n - 1
        assert st.alpha == pytest.approx(st.N / (st.N + n - 1))


@pytest.mark.parametrize("n", [2, 4])
def test_mixed_drafter_matches_hf_generate(engines, references, n):
    for i, (ids, ref) in enumerate(references):
        res = engines[n].generate(ids, NEW, drafter=ReferenceDrafter(ids + ref, 0.6, seed=i))
        assert res.token_ids == ref
        if res.stats.drafts_judged >= 30:
            assert 0.3 < res.stats.acceptance_rate < 0.9


def test_ar_path_matches_hf_generate(engines, references):
    for ids, ref in references:
        assert engines[4].generate_ar(ids, NEW).token_ids == ref


def test_cli_json(references, capsys):
    rc = main(["generate", "--prompt", PROMPTS[0][0], "--max-new-tokens", "12", "--stages", "3",
               "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"text", "token_ids", "stats"}
    for key in ("n", "N", "K", "alpha", "theoretical_speedup", "acceptance_rate", "decode_tok_s"):
        assert key in out["stats"]
    assert out["token_ids"] == references[0][1][:12] and out["stats"]["n"] == 3
    assert out["text"].strip() and isinstance(out["text"], str)


def test_cli_streams_text_and_summary(capsys):
    rc = main(["generate", "--prompt", "Hi", "--max-new-tokens", "6", "--mode", "ar"])
    captured = capsys.readouterr()
    assert rc == 0 and "mode=ar" in captured.out and "tok/s" in captured.out


@pytest.mark.parametrize("argv,msg", [
    (["--stages", "31"], "cannot cut a 30-layer model into 31 stages"),
    (["--split", "8,8,7"], "has 3 entries"),
    (["--anchors", "0,8,40"], "out of range"),
    (["--top-p", "0"], "top_p"),
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--pdm", "/nonexistent/pdm"], "not found"),
    (["--lookup", "-1"], "argument --lookup: must be an integer in [0, 6], got -1"),
])
def test_cli_errors(capsys, argv, msg):
    rc = main(["generate", "--prompt", "Hi", "--max-new-tokens", "4"] + argv)
    assert rc == 2 and msg in capsys.readouterr().err


@pytest.mark.parametrize("var,value,msg", [
    ("SPD_BACKEND", "foo", "unknown backend 'foo'"),
    ("SPD_PDL", "maybe", "SPD_PDL='maybe': use 1"),
])
def test_cli_bad_environment(capsys, monkeypatch, var, value, msg):
    """Kernel settings from the environment: a bad value exits 2 with a message naming it."""
    from spd_kernels import _cuda
    monkeypatch.setenv(var, value)
    monkeypatch.setattr(_cuda, "_programmatic", None)  # SPD_PDL is read at the first use
    rc = main(["generate", "--prompt", "Hi", "--max-new-tokens", "4"])
    assert rc == 2 and msg in capsys.readouterr().err


def test_cli_empty_prompt(capsys):
    assert main(["generate", "--prompt", "", "--max-new-tokens", "4"]) == 2
    assert "prompt is empty" in capsys.readouterr().err


def test_cli_eval_two_prompts_writes_json(tmp_path, capsys):
    prompts = tmp_path / "two.jsonl"
    prompts.write_text('{"question_id": 1, "turns": ["Name three primary colours."]}\n'
                       '{"question_id": 2, "turns": ["What is a linked list?"]}\n'
                       '{"question_id": 3, "turns": ["Not used: --limit 2."]}\n')
    out = tmp_path / "report.json"
    rc = main(["eval", "--prompts", str(prompts), "--dataset", "humaneval", "--limit", "2",
               "--stages", "2", "--max-new-tokens", "12", "--json-out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["datasets"]) == {"two", "humaneval"}
    config = report["config"]
    assert config["checked_against_ar"] is True and config["lookup"] == DEFAULT_MIN_LEN
    assert config["device"].startswith("CPU (")  # what the figures were measured on
    for s in list(report["datasets"].values()) + [report["overall"]]:
        for key in ("N", "K", "alpha", "theoretical_speedup", "acceptance_rate", "lookup_share",
                    "lookup_acceptance"):
            assert key in s
    assert report["datasets"]["two"]["prompts"] == 2 and report["overall"]["prompts"] == 4
    assert report["overall"]["N"] == sum(d["N"] for d in report["datasets"].values())
    assert "overall" in capsys.readouterr().out


def _shipped(method: str) -> list:
    """(folder name, config) of every drafter shipped in python/spd/checkpoints for `method`."""
    from spd.draft.pdm import SHIPPED_DIR
    out = []
    for path in sorted(SHIPPED_DIR.glob("*/config.json")):
        c = json.loads(path.read_text())
        if (c.get("method") or (c.get("extra") or {}).get("method", "spd")) == method:
            out.append(pytest.param(path.parent.name, c, id=path.parent.name))
    return out


@pytest.mark.parametrize("name,cfg", _shipped("spd"))
def test_shipped_pdm_is_picked_and_lossless(default_target, references, name, cfg):
    """Each PDM shipped in python/spd/checkpoints loads by default for its n, decodes exactly
    Hugging Face's output, and drafts better than an untrained one (whose drafts are all but
    all rejected: every cache rolls back; on the first prompt, which is lossless too: the
    untrained PDM on every prompt is test_untrained_pdm_matches_hf_generate's). The shipped
    PDM decodes the prompts as a batch, the untrained one alone."""
    n = cfg["n_stages"]
    eng = SPDEngine(default_target, n_stages=n, lookup=0)  # the PDMs alone, no context lookup
    assert eng.pdm_source.endswith(name)
    untrained = SPDEngine(default_target, n_stages=n, pdm="untrained", warn_untrained=False,
                          lookup=0)
    accepted = []
    # (the prompts at once: each decodes as alone, tests/runtime/test_batch.py; the untrained
    # PDM's decode below runs alone)
    for (ids, ref), res in zip(references, eng.generate([i for i, _ in references], NEW)):
        assert res.token_ids == ref
        accepted.append(res.stats.drafts_accepted)
    ids, ref = references[0]
    res = untrained.generate(ids, NEW // 2)  # (half: its drafts all but all rejected, slow)
    assert res.token_ids == ref[:NEW // 2]
    assert accepted[0] > res.stats.drafts_accepted + 5, (accepted, res.stats.drafts_accepted)


@pytest.mark.parametrize("name,cfg", _shipped("ppsd"))
def test_shipped_ppsd_drafter_is_lossless(default_target, references, name, cfg):
    """The PPSD baseline's drafters (first-stage features, post-step) decode exactly."""
    from spd.draft.pdm import SHIPPED_DIR
    eng = SPDEngine(default_target, n_stages=cfg["n_stages"], pdm=SHIPPED_DIR / name)
    assert list(eng.layout.anchors) == cfg["anchors"] and eng.drafter.post_step
    accepted = 0
    for ids, ref in references:
        res = eng.generate(ids, NEW)
        assert res.token_ids == ref
        accepted += res.stats.drafts_accepted
    assert accepted > 5


@pytest.mark.parametrize("name,cfg", _shipped("eagle3"))
def test_shipped_eagle3_head_is_picked_and_lossless(default_target, references, name, cfg):
    from spd.baselines.eagle_decode import EagleDecoder
    dec = EagleDecoder(default_target)
    assert dec.head_source.endswith(name)
    tokens = rounds = 0
    for ids, ref in references:
        res = dec.generate(ids, NEW)
        assert res.token_ids == ref
        tokens += res.stats.N
        rounds += res.stats.K
    assert tokens / rounds > 1.1  # more than one token per target forward


def _default_model_cached() -> bool:
    from spd.model.loading import default_model_dir
    return (default_model_dir() / "config.json").is_file()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not _default_model_cached(),
                    reason="the default model is not in $SPD_CACHE (a device machine has no "
                           "network to fetch it)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_graphed_ar_and_spd_match_hf_generate(dtype):
    """On a GPU: the AR decode (one CUDA graph per token, fused greedy choice) and SPD over
    graphed stages (the last one judging) decode what HF generate decodes from the same weights.
    bf16 is compared over the first tokens only where the kernels' rounding may break a near-tie
    differently from cuBLAS: the AR graph must still equal SPD exactly."""
    from spd.model.loading import load_target
    t = load_target(None, device="cuda", dtype=dtype)
    eng = SPDEngine(t, n_stages=4, pdm="untrained", warn_untrained=False)
    for text, chat in PROMPTS[:2]:
        ids = encode_prompt(t.tokenizer, text, chat)
        with torch.no_grad():
            hf = t.hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW,
                               do_sample=False)[0, len(ids):].tolist()
        ar = eng.generate_ar(ids, NEW).token_ids
        assert eng._ar.graphs is not None and eng._ar.graphs.failed is None
        if dtype == torch.float32:
            assert ar == hf
        else:
            assert ar[:8] == hf[:8]
        for drafter in (None, ReferenceDrafter(ids + ar, 0.6, seed=1)):
            assert eng.generate(ids, NEW, drafter=drafter).token_ids == ar


def test_text_messages_stop_strings_and_streaming(engines, default_target):
    """The API as integrators use it: text and chat messages as prompts, stop strings (cut from
    the text, the decode ended at the token that completed one), and the streamed pieces adding
    up to the result's text, with an early break leaving the engine ready for the next call."""
    t, eng = default_target, engines[2]
    question = "Name three primary colors."
    chat_ids = encode_prompt(t.tokenizer, question, True)
    full = eng.generate(chat_ids, 40)
    assert eng.generate([{"role": "user", "content": question}], 40).token_ids == full.token_ids
    assert eng.generate(question, 8).token_ids == eng.generate(
        t.tokenizer(question)["input_ids"], 8).token_ids
    text = full.text
    assert text == t.tokenizer.decode(full.token_ids, skip_special_tokens=True) and len(text) > 20
    stop = text[12:16]
    at = text.index(stop)
    for generate in (eng.generate, eng.generate_ar):
        res = generate(chat_ids, 40, stop=[stop, "\u2603never"])
        assert res.finish_reason == "stop" and res.text == text[:at]
        assert res.token_ids == full.token_ids[:len(res.token_ids)]
        assert stop in t.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        assert stop not in t.tokenizer.decode(res.token_ids[:-1], skip_special_tokens=True)
    for stop_arg, want in ((None, text), (stop, text[:at])):
        stream = eng.stream(chat_ids, 40, stop=stop_arg)
        pieces = list(stream)
        assert "".join(p.text for p in pieces) == want == stream.result.text
        assert [p.token_id for p in pieces if p.token_id is not None] == stream.result.token_ids
    stream = eng.stream(chat_ids, 40)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert stream.result is None  # stopped, not finished
    assert eng.generate(chat_ids, 40).token_ids == full.token_ids
    with pytest.raises(SPDError, match="message 0 must have a string 'role'"):
        eng.generate([{"content": "hi"}], 4)


def test_cli_spd_summary_is_read_against_plain_decoding(capsys, monkeypatch, tmp_path):
    """In one process SPD's summary says the stages ran one after another and gives the last
    --mode ar speed of this model, device and dtype (recorded by an AR run), or says there is
    none yet."""
    from spd.cli import plain_speed
    monkeypatch.setattr(plain_speed, "cache_dir", lambda: tmp_path)
    argv = ["generate", "--prompt", "Hi", "--max-new-tokens", "6", "--stages", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "the 2 stages ran one after another" in out and "not measured here yet" in out
    assert "3 devices" in out
    assert main(argv + ["--mode", "ar"]) == 0
    ar = capsys.readouterr().out
    assert "one after another" not in ar
    assert main(argv) == 0
    out = capsys.readouterr().out
    speed = json.loads((tmp_path / plain_speed.FILE).read_text())
    (rec,) = speed.values()
    assert f"ran at {rec['tok_s']:.1f} tok/s here on {rec['date']}" in out


def test_cli_system_message_and_quiet(capsys, default_target):
    """--system reaches the chat template (other tokens than without it); --quiet prints the
    text alone."""
    tok = default_target.tokenizer
    with_system = encode_prompt(tok, "Hi", True, "Answer in French.")
    assert with_system != encode_prompt(tok, "Hi", True)
    assert "Answer in French." in tok.decode(with_system)
    rc = main(["generate", "--prompt", "Hi", "--max-new-tokens", "6", "--system",
               "Answer in French.", "--quiet", "--threads", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and out.strip() and "[spd]" not in out
