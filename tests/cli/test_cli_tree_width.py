"""`--tree-width W` end to end: `spd generate` and `spd eval` on the default model draft a
token tree, stay lossless, and report the width; bad values are refused with a reason, and
--distributed passes the width to every rank."""
import json

import pytest

from spd.cli import main

pytestmark = pytest.mark.slow


def test_generate_tree_width_matches_ar(capsys):
    base = ["generate", "--prompt", "Name three colours.", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--stages", "4", "--tree-width", "4"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert main(base + ["--mode", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert tree["token_ids"] == ar["token_ids"]
    assert tree["stats"]["tree_width"] == 4 and tree["stats"]["n"] == 4
    assert tree["stats"]["stage_rows"] > tree["stats"]["K"]


def test_eval_tree_width_reports_it(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x",
                                   "turns": ["Count from one to five."]}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", "--prompts", str(prompts), "--stages", "2", "--tree-width", "2",
                 "--max-new-tokens", "8", "--json-out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["tree_width"] == 2 and report["config"]["checked_against_ar"]


def test_tree_width_bad_values_and_refusals(capsys):
    for bad in ("0", "17", "two"):
        assert main(["generate", "--prompt", "hi", "--tree-width", bad]) == 2
        assert "--tree-width" in capsys.readouterr().err
    from spd.cli.generate import config_from_args
    from spd.cli.main import build_parser
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--stages", "3",
                                      "--tree-width", "4", "--distributed"])
    assert config_from_args(args).tree_width == 4  # every rank is told the width
    assert main(["eval", "--methods", "spd", "--tree-width", "2", "--dataset", "heldout"]) == 2
    assert "spd-tree" in capsys.readouterr().err
