"""`--device-loop` end to end: `spd generate` on the default model decides each cycle on the
device and prints the tokens of the host loop (and AR); with --distributed it is refused, and
a bad --ahead names itself."""
import json

import pytest

from spd.cli import main


@pytest.mark.slow
def test_generate_device_loop_matches_the_host_loop(capsys):
    base = ["generate", "--prompt", "Name three colours.", "--max-new-tokens", "16", "--json",
            "--stages", "4", "--lookup", "0"]
    assert main(base + ["--device-loop", "--ahead", "3"]) == 0
    dev = json.loads(capsys.readouterr().out)
    assert main(base) == 0
    host = json.loads(capsys.readouterr().out)
    assert dev["stats"]["loop"] == "device" and host["stats"]["loop"] == "host"
    for key in ("token_ids",):
        assert dev[key] == host[key]
    for key in ("N", "K", "drafts_judged", "drafts_accepted"):
        assert dev["stats"][key] == host["stats"][key]


def test_device_loop_refusals(capsys):
    assert main(["generate", "--prompt", "hi", "--device-loop", "--distributed"]) == 2
    assert "--device-loop" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--device-loop", "--ahead", "-1"]) == 2
    assert "--ahead" in capsys.readouterr().err
