"""`spd generate --distributed` end to end on a tiny model folder (n + 1 ranks on the CPU): the
one-process engine's tokens and counts; a bad --ahead names itself; the flags of the removed
host-decided loops still parse, with a warning."""
import json
import subprocess
import sys
from pathlib import Path

from spd.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_generate_distributed(tmp_path):
    from spd.model.loading import load_target, save_tiny_random_llama
    from spd.model.prompt import encode_prompt
    from spd.runtime.engine import SPDEngine
    folder = str(save_tiny_random_llama(tmp_path / "tiny"))
    prompt = "Tell me about caches."
    cmd = [sys.executable, "-m", "spd", "generate", "--model", folder, "--distributed",
           "--stages", "2", "--ahead", "1", "--lookup", "0", "--prompt", prompt,
           "--max-new-tokens", "12", "--json", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    t = load_target(folder)
    expected = SPDEngine(t, n_stages=2, lookup=0).generate(
        encode_prompt(t.tokenizer, prompt, True), 12)
    assert got["token_ids"] == expected.token_ids
    st = got["stats"]
    assert (st["N"], st["K"]) == (expected.stats.N, expected.stats.K)
    assert st["distributed"]["ahead"] == 1


def test_bad_ahead(capsys):
    assert main(["generate", "--prompt", "hi", "--ahead", "-1"]) == 2
    assert "--ahead" in capsys.readouterr().err


def test_retired_flags_warn(tmp_path, capsys):
    from spd.model.loading import save_tiny_random_llama
    folder = str(save_tiny_random_llama(tmp_path / "tiny"))
    assert main(["generate", "--model", folder, "--prompt", "hi", "--max-new-tokens", "2",
                 "--stages", "2", "--device-loop", "--speculative-control", "on"]) == 0
    err = capsys.readouterr().err
    assert "--device-loop is no longer needed" in err
    assert "--speculative-control no longer has an effect" in err


def test_distributed_summary_reads_the_cycle_against_plain_decoding(monkeypatch, tmp_path):
    """The line under a distributed summary: the measured cycle and tok/s, beside the last
    `--mode ar` speed of this model and device (with the ratio), or that there is none yet."""
    from types import SimpleNamespace

    from spd.cli import plain_speed
    monkeypatch.setattr(plain_speed, "cache_dir", lambda: tmp_path)
    target = SimpleNamespace(name="tiny", dtype="torch.float32")
    stats = SimpleNamespace(decode_tok_s=30.0, distributed={
        "cycles": 40, "cycle_ms": {"median": 12.5}})
    line = plain_speed.explain_distributed(target, "cpu", stats)
    assert "distributed" in line and "12.50 ms (median of 40)" in line
    assert "30.0 tok/s" in line and "not measured here yet" in line
    plain_speed.record(target, "cpu", 20.0)
    line = plain_speed.explain_distributed(target, "cpu", stats)
    assert "30.0 tok/s (1.50x)" in line and "ran at 20.0 tok/s" in line
