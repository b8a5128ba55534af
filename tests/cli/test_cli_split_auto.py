"""`--split auto` end to end: `spd generate` on the default model (SmolLM2-135M, 30 layers)
cuts it by bytes read per step, its LM head on the last stage, and stays lossless."""
import json

import pytest

from spd.cli import main
from spd.runtime.engine import SPDEngine

pytestmark = pytest.mark.slow


def test_generate_split_auto_balances_and_matches_ar(capsys, monkeypatch):
    splits = []
    real_init = SPDEngine.__init__

    def spy(self, *a, **k):
        splits.append(k.get("split"))
        real_init(self, *a, **k)
    monkeypatch.setattr(SPDEngine, "__init__", spy)
    base = ["generate", "--prompt", "Name three colours.", "--max-new-tokens", "8", "--json"]
    assert main(base + ["--stages", "3", "--split", "auto"]) == 0
    spd = json.loads(capsys.readouterr().out)
    assert main(base + ["--mode", "ar", "--split", "auto"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert spd["token_ids"] == ar["token_ids"] and spd["stats"]["n"] == 3
    # the head (tied 49152 x 576) reads about 7.2 layers' bytes: the last stage keeps 5 layers
    assert splits[0] == [13, 12, 5]
    assert splits[1] == [30]  # --mode ar: one stage holds every layer


def test_split_auto_help_and_bad_values(capsys):
    try:
        main(["generate", "--help"])
    except SystemExit:
        pass
    assert "or auto: equal stage times" in " ".join(capsys.readouterr().out.split())
    assert main(["generate", "--prompt", "hi", "--split", "auto,3"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_distributed_split_auto_is_resolved_from_the_files():
    """--distributed: the launcher resolves `auto` from the config and safetensors headers,
    before any rank loads, so every rank builds the same layout; --draft-on-stage S charges
    stage S an estimated draft step."""
    from spd.cli.generate import config_from_args
    from spd.cli.main import build_parser
    argv = ["generate", "--prompt", "hi", "--stages", "3", "--split", "auto", "--distributed"]
    parse = build_parser().parse_args
    assert config_from_args(parse(argv)).split == [13, 12, 5]
    try:
        args = parse(argv + ["--draft-on-stage", "0"])
    except SystemExit:
        pytest.skip("no --draft-on-stage flag in this checkout")
    split = config_from_args(args).split
    assert sum(split) == 30 and split[0] < 13
