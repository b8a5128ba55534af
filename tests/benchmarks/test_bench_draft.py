"""benchmarks/bench_draft.py's projection path (no GPU): its bytes against hand counts and
built modules, and the table's arithmetic."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import bench_module

from spd.model.partition import DepthLayout, balanced_split, stage_times

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_draft")


def test_layer_and_head_bytes_match_a_built_target(bench):
    """The formulas against the parameters of the random target bench_stage.py builds."""
    hiding = bench_module("bench_draft_hiding")
    # SmolLM2's widths in a Qwen3 layer (stage_target builds Qwen3: q/k norms)
    shape = bench.Shape(**{**vars(bench.MODELS["smollm2-135m"]), "qk_norm": True})
    t = hiding.stage_target(shape, 1, "cpu", torch.float32)
    params = sum(p.numel() * 4 for p in t.layers[0].parameters())
    assert bench.layer_bytes(shape, el=4) == params
    assert bench.head_bytes(shape, el=4) == (t.lm_head.weight.numel() + t.norm.weight.numel()) * 4
    q3 = bench.MODELS["qwen3-4b"]  # with q/k norms: 2 * head_dim more per layer
    assert bench.layer_bytes(q3, 1) - bench.layer_bytes(
        bench.Shape(**{**vars(q3), "qk_norm": False}), 1) == 2 * q3.head_dim


def test_projection_rows_arithmetic(bench):
    shape = bench.MODELS["qwen3-4b"]
    rows = bench.projection_rows(shape, 4, [2], [32768], 1024, 4800.0)
    bf16, int8 = rows
    layout = DepthLayout.build(36, 4)
    assert layout.types == [0, 1, 2, 3, 4] and bf16["stage_layers"] == 9
    d, kv = shape.hidden, shape.kv_heads * shape.head_dim
    # hand count of one PDM step in bf16: projections of types 0..4, two layers, head, KV
    anchor = sum(((e + 1) * d * d + d) * 2 for e in range(5))
    layer = bench.layer_bytes(shape)  # a PDM layer at the target's widths is a target layer
    head = (32768 * d + d) * 2
    assert bf16["draft_parts"] == dict(anchor=anchor, layers=2 * layer, head=head,
                                       kv=2 * 2 * kv * 1024 * 2,
                                       total=anchor + 2 * layer + head + 2 * 2 * kv * 1024 * 2)
    assert bf16["stage_bytes"] == 9 * (layer + 2 * kv * 1024 * 2)
    assert bf16["ratio"] == pytest.approx(bf16["draft_bytes"] / bf16["stage_bytes"])
    assert bf16["draft_us"] == pytest.approx(bf16["draft_bytes"] / 4.8e6)
    assert bf16["kind"] == "projection (bytes)"
    # int8: half the weight bytes, plus 4 bytes of scale per output row; norms, biases, KV stay
    weights16 = bf16["draft_bytes"] - bf16["draft_parts"]["kv"]
    assert int8["draft_parts"]["kv"] == bf16["draft_parts"]["kv"]
    saved = weights16 - (int8["draft_bytes"] - int8["draft_parts"]["kv"])
    assert 0.49 * weights16 < saved < 0.5 * weights16
    assert int8["ratio"] < 0.52 * bf16["ratio"]


def test_draft_on_stage_rows_balance(bench):
    shape = bench.MODELS["qwen3-8b"]
    for r in bench.on_stage_rows(shape, 4, [2], [16384], 1024, [0, 2], 4800.0):
        costs = [float(bench.layer_bytes(shape) + bench.kv_bytes(shape, 1, 1024))] * 36
        extra = {r["stage"]: r["draft_bytes"]}
        assert r["split"] == balanced_split(costs, 4, bench.head_bytes(shape), extra)
        t = stage_times(costs, r["split"], bench.head_bytes(shape), extra)
        assert r["cycle_bytes"] == max(t) and r["stage_layers"] == r["split"][r["stage"]]
        # the host stage gives layers away to the others; the cycle can only grow
        assert r["stage_layers"] < r["n1_split"][r["stage"]] and r["cycle_over_n1"] >= 1.0


def test_cli_projection_writes_labelled_json(tmp_path):
    out = tmp_path / "d.json"
    res = subprocess.run([sys.executable, "benchmarks/bench_draft.py", "--device", "cpu",
                          "--models", "qwen3-4b", "--stages", "4,8", "--pdm-layers", "1",
                          "--draft-vocab", "16384", "--json-out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "every figure is a projection" in res.stdout
    data = json.loads(out.read_text())
    kinds = {r["kind"] for r in data["rows"]}
    assert kinds == {"projection (bytes)"}
    assert {(r["what"], r["n"]) for r in data["rows"]} == {
        ("draft vs stage", 4), ("draft vs stage", 8), ("draft on stage S", 4),
        ("draft on stage S", 8)}
    assert data["meta"]["projection_bandwidth_gb_s"] == 4800.0


def test_argmax_coverage_of_the_draft_vocabularies(bench, tmp_path):
    counts = torch.tensor([1, 8, 0, 3, 4, 4])  # 20 in all; sorted 8, 4, 4, 3, 1, 0
    torch.save(counts, tmp_path / "c.pt")
    assert bench.coverage(str(tmp_path / "c.pt"), [1, 3, 10]) == \
        {"1": 0.4, "3": 0.8, "10": 1.0}
    assert bench.coverage(None, [1]) is None
