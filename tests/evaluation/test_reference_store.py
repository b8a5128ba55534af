"""`spd eval --ar-cache`: the autoregressive reference is decoded once per prompt and reused; a
reused reference still checks the SPD output (a wrong one is caught)."""
import json

import pytest
from conftest import make_tiny_target

from spd import SPDEngine
from spd.errors import InternalError
from spd.evaluation.evaluate import ReferenceStore, run_eval
from spd.runtime.types import SamplingParams


class _Tok:
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % 16 for c in text]}


def test_references_are_decoded_once_and_still_check(tmp_path, monkeypatch):
    t = make_tiny_target(seed=3)
    t.tokenizer = _Tok()
    monkeypatch.setattr("spd.evaluation.evaluate.encode_question",
                        lambda tok, q: tok(q["turns"][0])["input_ids"])
    engine = SPDEngine(t, n_stages=2, pdm="untrained")
    sets = {"s": [{"id": i, "category": "", "turns": [f"prompt {i} abc"]} for i in range(3)]}
    store = ReferenceStore(tmp_path / "ref")
    greedy = SamplingParams(temperature=0.0)
    first = run_eval(engine, sets, 12, greedy, check=True, progress=False, references=store)
    assert len(list((tmp_path / "ref").iterdir())) == 3
    calls = []
    real = engine.generate_ar
    monkeypatch.setattr(engine, "generate_ar", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = run_eval(engine, sets, 12, greedy, check=True, progress=False, references=store)
    assert calls == [] and second["overall"]["N"] == first["overall"]["N"]
    assert second["config"]["ar_reference"] == "cache"
    run_eval(engine, sets, 13, greedy, check=True, progress=False, references=store)
    assert len(calls) == 3  # another budget is another decode
    for f in (tmp_path / "ref").iterdir():  # a wrong reference fails the check
        ids = json.loads(f.read_text())["token_ids"]
        f.write_text(json.dumps({"token_ids": ids[:-1] + [(ids[-1] + 1) % 16]}))
    with pytest.raises(InternalError, match="differs from the autoregressive output"):
        run_eval(engine, sets, 12, greedy, check=True, progress=False, references=store)
