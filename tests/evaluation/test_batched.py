"""The grid's batched rows (spd.evaluation.batched): B sequences at once, projected from the cost
model's pieces over B rows. Synthetic costs, and one tiny random target; no drafter trained."""
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from spd.evaluation import methods
from spd.evaluation.batched import ar_tok_s, crossover, pp_tok_s, spd_cycle, spd_tok_s
from spd.evaluation.cost_model import (
    Costs,
    batch_rows,
    measure_batch_costs,
    measure_costs,
    pipeline_groups,
)
from spd.evaluation.grid import GridSpec, run_grid
from spd.evaluation.methods import adjusted_speedup
from spd.evaluation.report import batched_rows, markdown

STORED_GRID = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
               "2026-11-30-grid-cpu" / "grid.json")
SIZES = (1, 2, 4, 8, 16)


def _scaled(forward_s=0.040, head_s=0.004, stages=None, grow=0.1, sizes=SIZES, draft_grow=1.0,
            **kw):
    """Costs whose every piece over R rows costs (1 + grow * (R - 1)) times its one row (a
    weight-bound step: B rows for little more than one), B = 1 equal to the one-row pieces;
    the draft step over B windows (1 + draft_grow * (B - 1)) times one window's (1: as B
    steps one after another)."""
    stages = stages or {"2": [0.020, 0.020], "4": [0.010, 0.010, 0.009, 0.009]}
    rows = batch_rows(sizes, [int(n) for n in stages])
    f = {str(r): 1 + grow * (r - 1) for r in rows}
    return Costs(device="cpu", context=8, reps=1, forward_s=forward_s, head_s=head_s,
                 stage_s=stages, batch_sizes=list(sizes),
                 batch_forward_s={r: forward_s * x for r, x in f.items()},
                 batch_head_s={r: head_s * x for r, x in f.items()},
                 batch_stage_s={n: {r: [t * x for t in per] for r, x in f.items()}
                                for n, per in stages.items()},
                 batch_draft_s={n: {str(b): 0.001 * (1 + draft_grow * (b - 1))
                                    for b in {1, *sizes}} for n in stages}, **kw)


def _rising(xs):
    return all(b >= a - 1e-12 * abs(a) for a, b in zip(xs, xs[1:]))


def _falling(xs):
    return _rising([-x for x in xs])


def _random_costs(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda: float(torch.rand((), generator=g)) * 0.02 + 1e-4  # noqa: E731
    return _scaled(forward_s=r() * 3, head_s=r(),
                   stages={str(n): [r() for _ in range(n)] for n in (2, 3, 4)},
                   grow=float(torch.rand((), generator=g)),
                   draft_grow=float(torch.rand((), generator=g)), runtime_s={"3": r()})


def test_batch_of_one_is_the_grids_row():
    """At B = 1, with the batched pieces equal to the one-row ones (and with none measured:
    B = 1 falls back on them), each batched row over batched AR is the grid's adjusted
    speedup: spd (both temperatures, any draft, the runtime's cost) and pp."""
    for seed in range(20):
        c = _random_costs(seed)
        bare = Costs(**dict(c.as_dict(), batch_sizes=[], batch_forward_s={}, batch_head_s={},
                            batch_stage_s={}, batch_draft_s={}))
        for costs in (c, bare):
            assert ar_tok_s(costs, 1) == pytest.approx(1 / costs.forward_s)
            for n in (2, 3, 4):
                assert pp_tok_s(costs, n, 1) / ar_tok_s(costs, 1) == pytest.approx(
                    adjusted_speedup("pp", costs, n=n))
                for greedy in (True, False):
                    for draft_s in (0.0, 0.003, 0.05):
                        for s in (0.8, 1.3, float(n)):
                            got = spd_tok_s(costs, n, 1, s, draft_s, greedy) / ar_tok_s(costs, 1)
                            assert got == pytest.approx(adjusted_speedup(
                                "spd", costs, n=n, s_theory=s, draft_s=draft_s, greedy=greedy))


def test_more_rows_never_cost_a_step_less():
    """Pieces that grow with their rows: the AR step and SPD's cycle never shrink as B grows,
    total tokens/s never falls (until the draft rank's B steps bind SPD), and no sequence
    decodes faster in a bigger batch."""
    for seed in range(10):
        c = _random_costs(seed)
        ar = [ar_tok_s(c, b) for b in SIZES]
        assert _rising(ar) and _falling([a / b for a, b in zip(ar, SIZES)])
        for n in (2, 3, 4):
            assert _falling([pp_tok_s(c, n, b) / b for b in SIZES])
            assert _rising([pp_tok_s(c, n, b) for b in SIZES])
            for greedy in (True, False):
                assert _rising([spd_cycle(c, n, b, 0.002, greedy) for b in SIZES])
                assert _falling([spd_tok_s(c, n, b, 1.5, 0.002, greedy) / b for b in SIZES])
                # a free draft: only the pieces' growth limits the batch
                assert _rising([spd_tok_s(c, n, b, 1.5, 0.0, greedy) for b in SIZES])


def test_spd_charges_one_batched_draft_step_to_the_draft_rank():
    """The draft rank runs one draft step over the B windows (its cell's draft time scaled by
    the measured batched PDM step over one window's) and, under sampling, the head over the B
    judged rows; greedy, the last stage judges over B rows. Not measured: no row."""
    c = _scaled(grow=0.0)  # every piece as cheap over 16 rows as over one, the draft as 16
    # greedy, n = 2: stages 20 + 20 ms, the last + 4 ms head; draft 2 ms: 16 windows = 32 ms
    assert spd_cycle(c, 2, 1, 0.002, True) == pytest.approx(0.024)
    assert spd_cycle(c, 2, 16, 0.002, True) == pytest.approx(0.032)
    # sampling: the draft rank also runs the head over the 16 judged rows: 32 + 4 ms
    assert spd_cycle(c, 2, 16, 0.002, False) == pytest.approx(0.036)
    assert spd_tok_s(c, 2, 16, 1.2, 0.002) == pytest.approx(16 * 0.6 / 0.032)
    c.runtime_s = {"2": 0.001}  # the runtime's cost per cycle, where measured
    assert spd_cycle(c, 2, 16, 0.002, True) == pytest.approx(0.033)
    # a draft step over 16 windows for 2.5 of one's (1 + 0.1 * 15): 5 ms, under the stages
    c = _scaled(grow=0.0, draft_grow=0.1)
    assert c.draft_scale(2, 16) == pytest.approx(2.5) and c.draft_scale(2, 1) == 1.0
    assert spd_cycle(c, 2, 16, 0.002, True) == pytest.approx(0.024)
    assert spd_cycle(c, 2, 16, 0.010, False) == pytest.approx(0.025 + 0.004)
    c.batch_draft_s = {}  # (a grid stored before the batched draft step: none past B = 1)
    assert spd_cycle(c, 2, 16, 0.002, True) is None
    assert spd_cycle(c, 2, 1, 0.002, True) == pytest.approx(0.024)
    assert not c.covers_batches([1, 16], [2]) and c.covers_batches([1], [2])


def test_pipeline_holds_b_requests_in_groups():
    """pp: B requests as min(B, n) groups, as even as they go, a token each per trip; the trip
    is the longest of the largest group's pass and each stage's steps of every group."""
    assert [pipeline_groups(b, 4) for b in (1, 2, 4, 8, 16, 6)] == \
        [[1], [1, 1], [1] * 4, [2] * 4, [4] * 4, [2, 2, 1, 1]]
    assert batch_rows([1, 2, 4, 16], [4]) == [1, 2, 4, 16]
    assert batch_rows([5], [2, 3]) == [1, 2, 3, 5]
    c = _scaled(grow=0.5)
    # n = 4, B = 2: two groups of one row; a pass is 10 + 10 + 9 + 9 + 4 = 42 ms (over the
    # 40 ms forward); two steps of the slowest stage (13 ms, the last with the head) are less
    assert pp_tok_s(c, 4, 2) == pytest.approx(2 / 0.042)
    # B = 16: four groups of 4 rows (each piece 2.5x): 4 * 2.5 * 13 ms = 130 ms a trip
    assert pp_tok_s(c, 4, 16) == pytest.approx(16 / 0.130)
    # n = 2, B = 8: two groups of 4: a pass 2.5 * 44 = 110 ms, two steps of the last stage
    # 2 * 2.5 * 24 = 120 ms
    assert pp_tok_s(c, 2, 8) == pytest.approx(8 / 0.120)
    # uneven: n = 2, B = 3: groups of 2 and 1 rows (1.5x and 1x): the last stage spends
    # 1.5 * 24 + 24 = 60 ms a trip, less than the 2-row group's own pass, 1.5 * 44 = 66 ms
    assert pp_tok_s(c, 2, 3) == pytest.approx(3 / 0.066)


def test_crossover():
    assert crossover({1: 0.9, 2: 1.1, 4: 1.2, 8: 0.95, 16: 0.8}) == {
        "beats": [2, 4], "overtakes_at": 2, "stops_at": 8, "last_beating": 4, "again": []}
    assert crossover({1: 1.2, 4: 1.1, 16: 1.01})["stops_at"] is None
    assert crossover({1: 1.0, 2: 0.5}) == {"beats": [], "overtakes_at": None,
                                           "stops_at": None, "last_beating": None, "again": []}
    assert crossover({1: 1.1, 2: 0.9, 4: 1.05, 8: 0.7})["again"] == [4]
    # a piece not measured is left out; B given as text (a JSON's keys) is read as a number
    assert crossover({"1": 1.3, "2": None, "16": 0.7})["stops_at"] == 16
    # a synthetic grid: n = 2, weight-bound steps (as cheap over 16 rows as over one), a
    # stage 20 ms, head 4 ms, forward 40 ms, draft 5 ms, 0.8 tokens a cycle: spd's cycle is
    # 24 ms until the draft rank's B * 5 ms is more (B > 4): 0.8 * 40 / 24 = 1.33x AR up to
    # B = 4, then 0.8 * 40 / 40 = 0.8x at B = 8 and 0.4x at 16
    c = _scaled(grow=0.0)
    ratios = {b: spd_tok_s(c, 2, b, 1.6, 0.005) / ar_tok_s(c, b) for b in SIZES}
    assert ratios[4] == pytest.approx(0.8 * 0.040 / 0.024)
    assert ratios[8] == pytest.approx(0.8) and ratios[16] == pytest.approx(0.4)
    assert crossover(ratios) == {"beats": [1, 2, 4], "overtakes_at": 1, "stops_at": 8,
                                 "last_beating": 4, "again": []}


def test_older_costs_load_and_report_their_b1_row():
    """A grid stored before the batched rows: its costs load (no batched pieces: B = 1 from
    the one-row ones, larger B not projected), and its report says how to get them."""
    state = json.loads(STORED_GRID.read_text())
    assert "batch_forward_s" not in state["costs"]
    c = Costs.from_dict(state["costs"])
    assert c.batch_sizes == [] and c.forward_at(1) == c.forward_s and c.forward_at(2) is None
    assert not c.covers_batches([1, 2], [2]) and c.covers_batches([], [2])
    assert ar_tok_s(c, 2) is None and spd_tok_s(c, 2, 2, 1.2, 0.01) is None
    assert Costs.from_dict(dict(state["costs"], a_later_field=1)) == c  # unknown: left out
    md = markdown(state)
    assert "were not measured in this grid" in md and "| spd n=4 L_s=2 | 5 | " in md
    # with batched pieces: every B's column, the crossover of each row against batched AR
    costs = _scaled(forward_s=c.forward_s, head_s=c.head_s, stages=c.stage_s, grow=0.05,
                    chunk_s=c.chunk_s)
    state["costs"] = costs.as_dict()
    rows = batched_rows(state)[0.0]
    assert rows[0]["config"] == "ar" and rows[0]["crossover"] is None
    spd = next(r for r in rows if r["config"] == "spd n=2 L_s=2")
    assert list(spd["tok_s"]) == list(SIZES) and spd["devices"] == 3
    cell = state["cells"]["spd n=2 L_s=2 | mt_bench | T=0"]
    assert cell["method"] == "spd"
    md = markdown(state)
    assert "| method | devices | B=1 | B=2 | B=4 | B=8 | B=16 |" in md
    assert "- spd n=2 L_s=2: " in md and "not measured" not in md
    x = spd["crossover"]
    if x["stops_at"] is not None:
        assert f"stops beating it at B = {x['stops_at']}" in md


def test_grid_measures_the_batched_pieces_a_stored_grid_lacks(tmp_path, monkeypatch):
    """A grid run without batched rows gains them when resumed with batch sizes: only the
    batched pieces are measured (the one-row costs kept), and no cell decodes again."""
    t = make_tiny_target(seed=3, vocab=40, layers=4, hidden=32)
    t.tokenizer = type("Tok", (), {"chat_template": None,
                                   "__call__": lambda self, s: {"input_ids": [
                                       ord(ch) % 40 for ch in s]}})()
    spec = dict(methods=["ar", "pp"], stages=[2], pdm_layers=[1],
                datasets={"a": [{"id": 1, "turns": ["hello"]}]}, temperatures=[0.0],
                max_new_tokens=4, cost_context=8, cost_reps=1)
    state = run_grid(t, GridSpec(**spec, batch_sizes=[]), tmp_path, progress=False)
    before = Costs.from_dict(state["costs"])
    assert before.batch_sizes == []
    from spd.runtime.engine import SPDEngine
    monkeypatch.setattr(SPDEngine, "generate_ar", lambda *a, **k: pytest.fail("decoded"))
    state = run_grid(t, GridSpec(**spec, batch_sizes=[1, 3]), tmp_path, progress=False)
    after = Costs.from_dict(state["costs"])
    assert after.forward_s == before.forward_s and after.stage_s == before.stage_s
    assert after.batch_sizes == [1, 3] and after.covers_batches([1, 3], [2])
    assert set(after.batch_forward_s) == {"1", "2", "3"}  # pp n = 2, B = 3: groups of 2
    assert set(after.batch_draft_s["2"]) == {"1", "3"}
    rows = batched_rows(state)[0.0]
    assert [r["config"] for r in rows] == ["ar", "pp n=2"]
    assert all(x > 0 for r in rows for x in r["tok_s"].values())
    md = markdown(state)
    assert "Batched, B sequences at once (T = 0)" in md and "| pp n=2 | 2 |" in md


def test_measured_batched_pieces_round_trip():
    t = make_tiny_target(vocab=40)
    c = measure_costs(t, [2], context=8, reps=1, batch_sizes=[2, 5])
    assert c.batch_sizes == [2, 5] and set(c.batch_forward_s) == {"1", "2", "3", "5"}
    assert all(len(per) == 2 and min(per) > 0 for per in c.batch_stage_s["2"].values())
    assert set(c.batch_draft_s["2"]) == {"1", "2", "5"}  # (the PDM step over B windows)
    assert all(x > 0 for x in c.batch_draft_s["2"].values())
    assert Costs.from_dict(json.loads(json.dumps(c.as_dict()))) == c
    assert measure_batch_costs(t, [2], [], context=8).batch_sizes == []
    assert math.isfinite(spd_tok_s(c, 2, 5, 1.5, 1e-3))
    assert [m for m, v in methods.METHODS.items() if v.batched] == ["ar", "pp", "spd"]
