"""benchmarks/bench_device_loop.py on the CPU: every row decodes the same tokens in both loops
(K equal), the device rows count their host time apart from the waits, and the JSON holds the
table."""
import json
import sys

from conftest import bench_module


def test_bench_device_loop_rows(tmp_path, monkeypatch, capsys):
    bench = bench_module("bench_device_loop")
    out = tmp_path / "loop.json"
    monkeypatch.setattr(sys, "argv", ["bench_device_loop.py", "--n", "2", "--ahead", "0,2",
                                      "--tokens", "6", "--json-out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 3  # samplings x accuracies x (host, ahead 0, ahead 2)
    for i in range(0, len(rows), 3):
        host, *device = rows[i:i + 3]
        assert host["loop"] == "host" and [r["ahead"] for r in device] == [0, 2]
        assert all(r["K"] == host["K"] and r["N"] == host["N"] for r in device)
        assert all(0 < r["host_us"] <= r["cycle_us"] for r in device)
    assert any(r["accepted"] < r["judged"] for r in rows if r["accuracy"] == 0.5)
    assert all(r["accepted"] == r["judged"] for r in rows if r["accuracy"] == 1.0)
    assert "cycle_us" in capsys.readouterr().out
