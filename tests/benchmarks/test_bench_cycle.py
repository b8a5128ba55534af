"""benchmarks/bench_cycle.py on the CPU, a tiny configuration: chain and tree, greedy and
sampled, every decode equal to AR (the benchmark exits otherwise), the same decode whatever
`ahead`, the host's time within the cycle's, and the JSON holds the table. No timing bounds."""
import json
import sys

from conftest import bench_module


def test_bench_cycle_rows(tmp_path, monkeypatch, capsys):
    bench = bench_module("bench_cycle")
    out = tmp_path / "cycle.json"
    monkeypatch.setattr(sys, "argv", ["bench_cycle.py", "--n", "2", "--widths", "1,4",
                                      "--ahead", "0,2", "--tokens", "8", "--json-out", str(out)])
    bench.main()
    rows = json.loads(out.read_text())["rows"]
    plan = [(w, s, a, ahead) for w in (1, 4) for s in ("greedy", "sampled") for a in (1.0, 0.5)
            for ahead in (0, 2)]
    assert [(r["W"], r["sampling"], r["accuracy"], r["ahead"]) for r in rows] == plan
    for r in rows:
        assert r["n"] == 2 and r["F_us"] == 0 and r["K"] > 0 and r["reads"] > 0
        assert 0 < r["host_us"] <= r["cycle_us"] and r["per_K_us"] > 0
        assert r["replays"] == 0 and r["eager"] == "off"  # no CUDA graphs on a CPU
    for a, b in zip(rows[::2], rows[1::2]):  # ahead 0 and 2: the same decode
        assert (a["K"], a["N"], a["accepted"]) == (b["K"], b["N"], b["accepted"])
    assert all(r["accepted"] == r["judged"] for r in rows if r["accuracy"] == 1.0)
    assert any(r["accepted"] < r["judged"] for r in rows if r["accuracy"] == 0.5)
    assert "cycle_us" in capsys.readouterr().out
