"""benchmarks/bench_protocol.py on the CPU, with emulated compute: n + 1 processes and the draft
on a stage, both drafters decoding the emulated target's tokens (the benchmark exits
otherwise), each row with its messages per cycle, and a JSON that `spd eval --runtime-from`
reads (spd.evaluation.cost_model.runtime_overhead). No timing bounds."""
import json
import sys

from conftest import bench_module

from spd.evaluation.cost_model import runtime_overhead


def test_bench_protocol_rows(tmp_path, monkeypatch, capsys):
    bench = bench_module("bench_protocol")
    out = tmp_path / "protocol.json"
    monkeypatch.setattr(sys, "argv", ["bench_protocol.py", "--stages", "2", "--emulate-ms", "1",
                                      "--draft-on-stage", "none,0", "--max-new-tokens", "12",
                                      "--json-out", str(out)])
    assert bench.main() == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["draft_on_stage"], r["processes"], r["drafter"]) for r in rows] == [
        (None, 3, "always-right"), (None, 3, "half-right"),
        (0, 2, "always-right"), (0, 2, "half-right")]
    for r in rows:
        assert r["N"] == 11 and r["K"] >= r["N"] and r["cycle_ms"] > 0 and r["ahead"] == 2
        assert r["messages_per_cycle"]["0"]["send/data"] > 0
    assert rows[1]["K"] > rows[0]["K"]  # the half-right drafter's rejections cost cycles
    assert set(rows[0]["messages_per_cycle"]) == {"0", "1", "2"}
    assert set(rows[2]["messages_per_cycle"]) == {"0", "2"}  # stage 0 runs in rank 0's process
    assert data["meta"]["device_type"] == "cpu"
    assert set(runtime_overhead(out, "cpu")) == {"2"}
    assert "(cycle-F)/F" in capsys.readouterr().out
