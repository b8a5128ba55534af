"""`--device-loop` end to end: `spd generate` on the default model decides each cycle on the
device and prints the tokens of the host loop (and AR); with --distributed every rank runs the
cycles in lock-step and prints the one-process engine's tokens; a bad --ahead names itself."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spd.cli import main

REPO = Path(__file__).resolve().parents[2]


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


def test_generate_distributed_device_loop(tmp_path):
    """`spd generate --distributed --device-loop` on a tiny model folder: n + 1 ranks on the
    CPU, the one-process engine's tokens and counts."""
    from spd.model.loading import load_target, save_tiny_random_llama
    from spd.model.prompt import encode_prompt
    from spd.runtime.engine import SPDEngine
    folder = str(save_tiny_random_llama(tmp_path / "tiny"))
    prompt = "Tell me about caches."
    cmd = [sys.executable, "-m", "spd", "generate", "--model", folder, "--distributed",
           "--stages", "2", "--device-loop", "--ahead", "1", "--lookup", "0", "--prompt",
           prompt, "--max-new-tokens", "12", "--json", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    t = load_target(folder)
    expected = SPDEngine(t, n_stages=2, lookup=0).generate(
        encode_prompt(t.tokenizer, prompt, True), 12)
    assert got["token_ids"] == expected.token_ids
    st = got["stats"]
    assert st["loop"] == "device" and st["distributed"]["loop"] == "device"
    assert (st["N"], st["K"]) == (expected.stats.N, expected.stats.K)


def test_device_loop_bad_ahead(capsys):
    assert main(["generate", "--prompt", "hi", "--device-loop", "--ahead", "-1"]) == 2
    assert "--ahead" in capsys.readouterr().err


def test_distributed_summary_reads_the_cycle_against_plain_decoding(monkeypatch, tmp_path):
    """The line under a distributed summary: the measured cycle and tok/s, beside the last
    `--mode ar` speed of this model and device (with the ratio), or that there is none yet."""
    from types import SimpleNamespace

    from spd.cli import plain_speed
    monkeypatch.setattr(plain_speed, "cache_dir", lambda: tmp_path)
    target = SimpleNamespace(name="tiny", dtype="torch.float32")
    stats = SimpleNamespace(decode_tok_s=30.0, distributed={
        "loop": "device", "cycles": 40, "cycle_ms": {"median": 12.5}})
    line = plain_speed.explain_distributed(target, "cpu", stats)
    assert "device loop" in line and "12.50 ms (median of 40)" in line
    assert "30.0 tok/s" in line and "not measured here yet" in line
    plain_speed.record(target, "cpu", 20.0)
    line = plain_speed.explain_distributed(target, "cpu", stats)
    assert "30.0 tok/s (1.50x)" in line and "ran at 20.0 tok/s" in line
