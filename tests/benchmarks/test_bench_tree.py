"""benchmarks/bench_tree.py: the tree step's inputs, the pooled arithmetic, both parts on a tiny
random target (fast), and the --quick command line on the default model (slow)."""
import json

import pytest
from conftest import bench_module, make_tiny_target

from spd.runtime.types import SamplingParams


@pytest.fixture(scope="module")
def bench():
    return bench_module("bench_tree")


def test_tree_inputs_follow_the_runtime_layout(bench):
    a = bench.tree_inputs(context=20, n=4, width=4)
    base = 21  # slots past the positions 0..20: capacity + (position mod (n + 1)) * W + lane
    assert a["position"] == 20 and a["prefix_len"] == 17  # n - 1 = 3 positions uncommitted
    assert a["slots"] == [base + (20 % 5) * 4 + r for r in range(4)]
    mask = a["tree_mask"]
    assert len(mask) == 4 and all(len(m) == len(a["tree_slots"]) for m in mask)
    assert all(sum(m) == 4 for m in mask)  # its own slot and n - 1 ancestors
    for r, m in enumerate(mask):  # each row sees its own slot, no sibling's
        own = a["tree_slots"].index(a["slots"][r])
        assert m[own] and not any(m[a["tree_slots"].index(s)] for s in a["slots"] if s !=
                                  a["slots"][r])
    # lanes 0 and 1 share their parent (lane 0), lanes 2 and 3 theirs (lane 1)
    assert len(a["tree_slots"]) == 4 + 2 + 1 + 1
    chain = bench.tree_inputs(context=20, n=4, width=1)
    assert chain["tree_mask"] == [[True] * 4] and len(chain["tree_slots"]) == 4


def test_pick_prompts_takes_every_category_in_turn(bench):
    records = [{"id": i, "category": c} for i, c in enumerate("aaaabbc")]
    assert [r["id"] for r in bench.pick_prompts(records, 5)] == [0, 4, 6, 1, 5]
    assert [r["id"] for r in bench.pick_prompts(records, None)] == [0, 4, 6, 1, 5, 2, 3]


def test_pooled_sums_before_dividing(bench):
    rows = [dict(N=10, K=20, judged=8, accepted=4, stage_rows=30, lookup_judged=1,
                 lookup_accepted=1, decode_s=1.0, new_tokens=11, mismatch=False,
                 category="a"),
            dict(N=30, K=20, judged=12, accepted=12, stage_rows=50, lookup_judged=0,
                 lookup_accepted=0, decode_s=1.0, new_tokens=31, mismatch=True,
                 category="b")]
    s = bench.pooled(rows, n=4)
    assert s["alpha"] == pytest.approx(40 / 40)
    assert s["theoretical_speedup"] == pytest.approx(4.0)
    assert s["acceptance_rate"] == pytest.approx(16 / 20)
    assert s["rows_per_stage_cycle"] == pytest.approx(80 / (40 * 4))
    assert s["mismatches"] == 1 and s["checked"] == 2 and s["prompts"] == 2
    unchecked = [dict(r, mismatch=None) for r in rows]
    assert bench.pooled(unchecked, 4)["mismatches"] is None


def test_acceptance_rows_on_a_tiny_target_are_lossless(bench):
    t = make_tiny_target()
    prompts = [({"id": i, "category": "ab"[i % 2]}, [1 + i, 3, 5, 7, 2 + i]) for i in range(3)]
    seen = []
    rows = bench.acceptance_rows(t, prompts, [2], [1, 2], [None, 0], 10, SamplingParams(),
                                 on_row=seen.append)
    assert rows == seen
    assert [(r["n"], r["drafter"], r["width"]) for r in rows] == [
        (2, "gated lookup", 1), (2, "gated lookup", 2), (2, "PDM alone", 1), (2, "PDM alone", 2)]
    for r in rows:
        assert r["mismatches"] == 0 and r["checked"] == 3 and r["prompts"] == 3
        assert r["alpha"] == pytest.approx(r["N"] / r["K"])
        assert r["theoretical_speedup"] == pytest.approx(2 * r["N"] / r["K"])
        assert r["rows_per_stage_cycle"] == pytest.approx(r["stage_rows"] / (2 * r["K"]))
        assert set(r["by_category"]) == {"a", "b"} and len(r["per_prompt"]) == 3
        assert sum(c["N"] for c in r["by_category"].values()) == r["N"]
    assert rows[0]["s_over_chain"] == 1.0 and rows[0]["rows_per_stage_cycle"] <= 1.0
    assert rows[1]["s_over_chain"] == pytest.approx(
        rows[1]["theoretical_speedup"] / rows[0]["theoretical_speedup"])
    assert rows[2]["lookup"] == 0 and rows[0]["lookup"] > 0
    # sampled: nothing to compare with
    sampled = bench.acceptance_rows(t, prompts[:1], [2], [2], [0], 6,
                                    SamplingParams(temperature=1.0))
    assert sampled[0]["mismatches"] is None and sampled[0]["checked"] == 0


def test_stage_step_rows_on_a_tiny_target(bench):
    harness = bench_module("harness")
    t = make_tiny_target()
    rows = bench.stage_step_rows(t, [2, 4], [1, 2, 4], 16, harness.Timer("cpu", 2, 0))
    assert [(r["n"], r["width"]) for r in rows] == [(n, w) for n in (2, 4) for w in (1, 2, 4)]
    for r in rows:
        assert r["kind"] == "measured (CPU, eager)" and r["chain_graph_us"] is None
        assert r["stage_layers"] == 4 // r["n"] and r["tree_us"] > 0
        assert r["ratio"] == pytest.approx(r["tree_us"] / r["chain_us"])
    assert all(r["over_tree1"] == 1.0 for r in rows if r["width"] == 1)


@pytest.mark.slow
def test_quick_run_on_the_default_model(bench, default_target, tmp_path, capsys):
    out = tmp_path / "tree.json"
    rc = bench.main(["--quick", "--limit", "2", "--max-new-tokens", "8", "--stages", "2",
                     "--widths", "1,2", "--lookup", "default,0", "--json-out", str(out)],
                    target=default_target)
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "rows/st/cyc" in text and "measured (CPU, eager)" in text and "lossless: all 8" in text
    data = json.loads(out.read_text())
    acc = [r for r in data["rows"] if r["what"] == "acceptance"]
    step = [r for r in data["rows"] if r["what"] == "stage step"]
    assert [(r["drafter"], r["width"]) for r in acc] == [
        ("gated lookup", 1), ("gated lookup", 2), ("PDM alone", 1), ("PDM alone", 2)]
    assert all(r["mismatches"] == 0 and r["checked"] == 2 and r["n"] == 2 for r in acc)
    assert all("smollm2" in r["pdm"].lower() for r in acc)  # the shipped drafter, not untrained
    assert [r["width"] for r in step] == [1, 2] and step[0]["context"] == 64
    assert data["meta"]["ar_mismatches"] == 0 and data["meta"]["ar_checked"] == 8
    assert data["meta"]["quick"] and data["meta"]["max_new_tokens"] == 8
    assert set(acc[0]["by_category"]) == {"chat", "code"}  # --limit 2: one of each, in turn
