"""benchmarks/bench_kernels.py's bookkeeping for the device session: which rows run kernels the
automatic choice does not pick yet, a run that stops at a lost CUDA context, and the merge of
runs made in separate processes."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from conftest import bench_module

from spd_kernels import dispatch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_kernels")


def test_on_request_rows_follow_the_registry(bench, monkeypatch):
    cases = {
        ("pdm_step", "reference"): False, ("pdm_step", "cuda_graph"): False,
        ("pdm_step", "compile"): False, ("pdm_step", "triton"): False,
        ("pdm_step", "triton_cg"): False, ("pdm_step", "triton_attn_cg"): False,
        ("pdm_step", "triton_pdl_cg"): True, ("pdm_step", "cuda"): True,
        ("pdm_step", "cuda_cg"): True, ("pdm_step", "cuda_linear_cg"): True,
        ("anchor_projection", "cuda"): False, ("anchor_projection", "cuda_cg"): False,
        ("anchor_projection", "triton"): False, ("anchor_projection", "cuda_mma_cg"): True,
        ("anchor_projection", "cuda_pdl"): True,
        ("fused_linear", "triton_cg"): False, ("fused_linear", "cuda_cg"): True,
        ("fused_linear", "cuda_1split_cg"): True, ("cache_attention", "triton_1split"): False,
        ("verify_greedy", "cuda"): False, ("verify_greedy", "cuda_pdl"): True,
        ("rejection_sample_logits", "cuda"): True,
        ("rejection_sample_logits", "triton_1prog"): False,
    }
    for (op, backend), want in cases.items():
        assert bench.on_request_row(op, backend) is want, (op, backend)
    # making the dense CUDA kernels automatic moves their rows, and only theirs
    for op in ("fused_linear", "fused_swiglu"):
        monkeypatch.setattr(dispatch._REGISTRY[op]["cuda"], "automatic", True)
    assert not bench.on_request_row("fused_linear", "cuda_cg")
    assert not bench.on_request_row("pdm_step", "cuda_linear_cg")
    assert bench.on_request_row("pdm_step", "cuda_cg")  # attention and QKV still on request
    assert bench.on_request_row("fused_linear", "cuda_pdl_cg")


def _args(**kw):
    base = dict(device="cpu", models="smollm2-135m", ops="truncate_kv,fused_linear",
                dtype="fp32", iters=1, warmup=0, compile="off", rows="all", no_flush=True,
                date="2026-12-02")
    base.update(kw)
    return argparse.Namespace(**base)


def _fake_cases(calls):
    def build_cases(op, s, dtype, device):
        def fn():
            calls.append(op)
            if op == "truncate_kv":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        yield "case", {"reference": (fn, ())}, 1000, {}
    return build_cases


@pytest.mark.parametrize("lost", [False, True])
def test_run_stops_at_a_lost_context(bench, monkeypatch, lost):
    calls, saved = [], []
    monkeypatch.setattr(bench, "build_cases", _fake_cases(calls))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device, timer: 100.0)
    monkeypatch.setattr(bench, "cuda_context_error",
                        lambda: "AcceleratorError: CUDA error: an illegal memory access"
                        if lost else None)
    result = bench.run(_args(), save=lambda r: saved.append(len(r["rows"])))
    errors = [r for r in result["rows"] if "error" in r]
    assert [r["op"] for r in errors] == ["truncate_kv"]
    assert "illegal memory access" in errors[0]["error"]
    if lost:  # nothing runs in the lost context; the message names the row that lost it
        assert calls == ["truncate_kv"]
        assert len(result["rows"]) == 1
        assert len(result["context_lost"]) == 1
        assert "truncate_kv [case] reference" in result["context_lost"][0]
    else:  # an ordinary failure is a row, and the next op is timed
        assert calls == ["truncate_kv", "fused_linear"]
        assert [r["op"] for r in result["rows"]] == ["truncate_kv", "fused_linear"]
        assert "us" in result["rows"][1] and result["context_lost"] == []
    assert saved == [n + 1 for n in range(len(result["rows"]))]  # after every row
    assert result["targets"] == [dict(target="GPU targets", status="not evaluated on CPU")]


def test_rows_option_splits_automatic_from_on_request(bench, monkeypatch):
    timed = []

    def build_cases(op, s, dtype, device):
        fns = {b: (lambda b=b: timed.append(b), ()) for b in ("reference", "compile_like")}
        yield "case", fns, 1000, {}
    monkeypatch.setattr(bench, "build_cases", build_cases)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device, timer: 100.0)
    # "compile_like" stands for an on-request row; backend_ready lets both run on the CPU
    monkeypatch.setattr(bench, "on_request_row", lambda op, b: b == "compile_like")
    monkeypatch.setattr(bench, "backend_ready", lambda op, b, device: None)
    for rows, want in (("automatic", {"reference"}), ("on-request", {"compile_like"}),
                       ("all", {"reference", "compile_like"})):
        timed.clear()
        result = bench.run(_args(ops="truncate_kv", rows=rows))
        assert set(timed) == want
        assert {r["backend"] for r in result["rows"]} == want
        assert result["meta"]["rows"] == rows


def _row(op, backend, us, floor_us, case="case"):
    return dict(model="qwen3-4b", op=op, case=case, backend=backend, us=us, floor_us=floor_us,
                x_floor=us / floor_us, bytes=1)


def test_merge_pairs_rows_across_processes(bench, tmp_path):
    auto = dict(meta=dict(device_type="cuda", command="auto"), context_lost=[],
                rows=[_row("pdm_step", "triton_cg", 396.0, 186.0, "PDM 3 layers"),
                      _row("pdm_step", "triton_cg", 403.0, 200.0, "target stage, 4 layers"),
                      _row("anchor_projection", "cuda_cg", 70.0, 46.5),
                      _row("verify_greedy", "cuda", 200.0, 184.0),
                      dict(_row("truncate_kv", "cuda", 3.1, 1.0), no_host_sync=True)],
                targets=[], challengers=[])
    # a run stopped early: no targets of its own, the rows it saved, the context it lost
    trial = dict(meta=dict(device_type="cuda", command="trial"),
                 context_lost=["qwen3-4b pdm_step [PDM 3 layers] cuda_pdl_cg: boom"],
                 rows=[_row("pdm_step", "cuda_cg", 260.0, 186.0, "PDM 3 layers"),
                       dict(model="qwen3-4b", op="pdm_step", case="PDM 3 layers",
                            backend="cuda_pdl_cg", bytes=1, error="boom")])
    paths = []
    for name, part in (("a.json", auto), ("b.json", trial)):
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(part))
    merged = bench.merge([str(p) for p in paths] + [str(tmp_path / "missing.json")])
    assert len(merged["rows"]) == 7
    assert merged["context_lost"] == trial["context_lost"]
    assert [m["complete"] for m in merged["meta"]["merged_from"]] == [True, False]
    targets = {t["target"]: t for t in merged["targets"]}
    pdm = targets["PDM step (Qwen3-4B) <= 1.5x weight floor"]
    assert pdm["backend"] == "cuda_cg" and pdm["ok"] and pdm["value"] == pytest.approx(260 / 186)
    assert not targets["anchor projection (Qwen3-4B) <= 1.25x bytes floor"]["ok"]
    assert targets["KV truncation < 5 us, no host sync"]["ok"]
    [ch] = [c for c in merged["challengers"] if c["op"] == "pdm_step"]
    assert (ch["challenger"], ch["incumbent"]) == ("cuda_cg", "triton_cg")
    assert ch["speedup"] == pytest.approx(396 / 260)


def test_merge_needs_an_output(bench, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--merge", "a.json"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--merge needs --json-out" in capsys.readouterr().err


def test_pdm_step_is_set_against_a_stage_on_the_same_kernels(bench):
    """The "PDM step faster than a stage" target divides by the stage row of the PDM step's own
    backend, never by a graph of torch ops (which once reported 0.48x for what was 0.98x)."""
    def row(case, backend, us):
        return dict(op="pdm_step", model="qwen3-4b", case=case, backend=backend, us=us,
                    x_floor=us / 200)
    rows = [row("PDM 3 layers", "triton_cg", 396.0), row("PDM 3 layers", "cuda_graph", 841.0),
            row("target stage, 4 layers, 1 row", "cuda_graph", 819.0),
            row("target stage, 4 layers, 1 row", "triton_cg", 403.0)]
    got = {t["target"]: t for t in bench.targets(rows, on_gpu=True)}
    t = next(v for k, v in got.items() if k.startswith("PDM step faster"))
    assert t["backend"] == "triton_cg" and t["value"] == pytest.approx(396.0 / 403.0) and t["ok"]
    rows[-1]["us"] = 390.0  # the stage on the same kernels is faster: not met
    t = next(v for v in bench.targets(rows, on_gpu=True) if v["target"].startswith("PDM step f"))
    assert not t["ok"]


def test_bench_stage_runs_on_the_cpu_and_writes_its_rows(tmp_path):
    """benchmarks/bench_stage.py end to end at a small shape: stage rows per layer count, the
    attention row, the AR row and the stage step over B sequences' rows, each with its
    floor."""
    import subprocess
    out = tmp_path / "stage.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_stage.py"),
                          "--models", "smollm2-135m", "--layers", "1,2", "--context", "16",
                          "--iters", "1", "--warmup", "0", "--rows", "stage,attention,ar,batch",
                          "--batches", "3", "--json-out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["what"], r["layers"]) for r in rows] == [
        ("stage", 1), ("stage", 2), ("attention", 1), ("ar", 30), ("batch1", 2), ("batch3", 2)]
    assert all(r["us"] > 0 and r["floor_us"] > 0 and r["x_floor"] > 0 for r in rows)
    # (the stage step over B sequences' rows: B = 1 added, each against it, the floor growing
    # by each row's keys and values)
    one, three = rows[-2:]
    assert one["vs_one_row"] == 1.0 and three["vs_one_row"] > 0
    assert three["floor_bytes"] > one["floor_bytes"]
