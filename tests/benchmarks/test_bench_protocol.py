"""benchmarks/bench_protocol.py on the CPU: the unit protocol and the distributed device loop
side by side, with emulated compute. Both decode the emulated target's tokens (the benchmark
exits otherwise) with the same N, the device rows report their messages per cycle, and the
JSON holds the table."""
import json
import sys

from conftest import bench_module


def test_bench_protocol_host_and_device_loops(tmp_path, monkeypatch, capsys):
    bench = bench_module("bench_protocol")
    out = tmp_path / "protocol.json"
    monkeypatch.setattr(sys, "argv", ["bench_protocol.py", "--stages", "2", "--emulate-ms", "1",
                                      "--max-new-tokens", "12", "--loop", "host,device",
                                      "--json-out", str(out)])
    assert bench.main() == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["loop"] for r in rows] == ["host", "host", "device", "device"]
    for host, dev in zip(rows[:2], rows[2:]):
        assert host["drafter"] == dev["drafter"] and host["N"] == dev["N"]
        assert dev["cycle_ms"] > 0 and dev["messages_per_cycle"]["1"]["send/data"] > 0
    assert "(cycle-F)/F" in capsys.readouterr().out
