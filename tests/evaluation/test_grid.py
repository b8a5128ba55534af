"""The comparison grid (spd.evaluation.grid), its cost model and report, on a tiny random target."""
import json
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from spd.errors import InternalError, SPDError
from spd.evaluation import methods
from spd.evaluation.cost_model import Costs, measure_costs
from spd.evaluation.grid import GridSpec, _cost_chunks, derived, plan_cells, run_grid
from spd.evaluation.methods import adjusted_speedup, devices_used
from spd.evaluation.report import markdown, write_report
from spd.train.distill import FeatureSet, extract_features
from spd.train.trainer import TrainConfig, train

VOCAB = 40


class CharTokenizer:
    """Enough of a tokenizer for the harness: text -> ids, no chat template."""
    chat_template = None

    def __call__(self, text):
        return {"input_ids": [ord(c) % VOCAB for c in text]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny target plus a trained SPD drafter (n=2, L_s=1) and a PPSD drafter (n=2)."""
    root = tmp_path_factory.mktemp("grid")
    t = make_tiny_target(seed=7, vocab=VOCAB, layers=4, hidden=32, head_scale=6.0)
    t.tokenizer = CharTokenizer()
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(24):
        motif = torch.randint(0, VOCAB, (5,), generator=g).tolist()
        seqs.append((motif * 8)[: 24 + i % 9])
    extract_features(t, seqs, [0, 1, 2, 3], root / "feat", shard_tokens=200)
    feats = FeatureSet(root / "feat", t)
    common = dict(n_stages=2, intermediate_size=64, draft_vocab_size=32, steps=40,
                  batch_sequences=2, lr=3e-3, warmup=5, eval_every=40, save_every=40,
                  eval_sequences=4, seed=0)
    train(t, feats, TrainConfig(anchors=[0, 1, 2, 3], pdm_layers=1, **common),
          root / "ckpt" / "spd-n2", progress=False)
    train(t, feats, TrainConfig(anchors=[0, 2], pdm_layers=1, features="post-step",
                                method="ppsd", **common),
          root / "ckpt" / "ppsd-n2", progress=False)
    from spd.baselines.eagle import EagleHead
    EagleHead.untrained(t, draft_steps=3).save(root / "ckpt" / "eagle3")
    return t, root / "ckpt"


def _spec(ckpt, **kw):
    base = dict(methods=["ar", "pp", "eagle3", "ppsd", "spd"], stages=[2], pdm_layers=[1, 2],
                datasets={"a": [{"id": 1, "turns": ["hello there"]},
                                {"id": 2, "turns": ["the motif repeats"]}],
                          "b": [{"id": "x", "turns": ["abcabcabc"]}]},
                temperatures=[0.0, 1.0], max_new_tokens=12, checkpoint_dirs=[str(ckpt)],
                cost_context=16, cost_reps=2)
    base.update(kw)
    return GridSpec(**base)


def test_plan_puts_ar_first_and_covers_the_grid(trained):
    spec = _spec(trained[1], methods=["spd", "pp"], stages=[2, 3])
    cells = plan_cells(spec)
    assert cells[0].method == "ar"  # the reference is always run, and first
    keys = {c.key for c in cells}
    assert len(keys) == len(cells)
    # ar: 2 datasets x 2 T; pp: 2 n x 2 x 2; spd: 2 n x 2 L_s x 2 x 2 (eagle3 not asked for)
    assert len(cells) == 4 + 8 + 16


def test_grid_lookup_reaches_the_pipeline_drafters(trained):
    from spd.evaluation.grid import Cell, _Decoders
    t, ckpt = trained
    assert "lookup" not in _spec(ckpt).settings()  # off by default: grids stored before resume
    spec = _spec(ckpt, lookup=2)
    assert spec.settings()["lookup"] == 2
    engine, _ = _Decoders(t, spec).get(Cell("spd", 2, 1, "a", 0.0))
    assert engine.drafter.lookup == 2
    engine, _ = _Decoders(t, _spec(ckpt)).get(Cell("spd", 2, 1, "a", 0.0))
    assert engine.drafter.lookup == 0


def test_grid_runs_checks_resumes_and_reports(trained, tmp_path, monkeypatch):
    t, ckpt = trained
    spec = _spec(ckpt)
    state = run_grid(t, spec, tmp_path, progress=False, command="test")
    cells = state["cells"]
    ar = cells["ar | a | T=0"]
    assert ar["derived"]["theoretical_speedup"] == pytest.approx(1.0)
    assert ar["derived"]["measured_ratio"] == 1.0
    pp = cells["pp n=2 | a | T=0"]
    assert pp["totals"]["K"] == 2 * pp["totals"]["N"]
    assert pp["derived"]["theoretical_speedup"] == pytest.approx(1.0)
    assert pp["derived"]["measured_ratio"] is None  # serial stages: not a real measurement
    for key in ("spd n=2 L_s=1 | a | T=0", "ppsd n=2 | b | T=1"):
        c = cells[key]
        tot, d = c["totals"], c["derived"]
        assert tot["N"] > 0 and tot["K"] >= tot["N"]
        assert d["theoretical_speedup"] == pytest.approx(tot["N"] / tot["K"] * 2)
        assert tot["judged"] == sum(j for j, _ in tot["by_position"].values())
        assert d["adjusted_speedup"] > 0 and d["draft_ms"] > 0
    assert cells["spd n=2 L_s=1 | a | T=0"]["checked_against_ar"] is True
    eagle = cells["eagle3 | a | T=0"]
    assert eagle["draft_steps"] == 3 and eagle["derived"]["devices"] == 1
    assert eagle["derived"]["theoretical_speedup"] == pytest.approx(
        eagle["totals"]["N"] / eagle["totals"]["K"])   # tokens per verification round
    assert eagle["derived"]["measured_ratio"] > 0    # one device: its wall clock is real
    assert set(eagle["totals"]["by_position"]) <= {"1", "2", "3"}
    # No trained L_s=2 drafter: skipped, with the command that trains one
    assert "--pdm-layers 2" in cells["spd n=2 L_s=2 | a | T=0"]["skipped"]
    assert len(cells) == len(plan_cells(spec))
    on_disk = json.loads((tmp_path / "grid.json").read_text())
    assert on_disk["cells"].keys() == cells.keys()

    # Resume: every cell is finished, so nothing decodes again; a skipped cell is tried again
    # (its drafter may exist now).
    import spd.evaluation.grid as harness
    from spd.runtime.engine import SPDEngine
    tried = []
    real_get = harness._Decoders.get

    def spy(self, cell):
        tried.append(cell.key)
        return real_get(self, cell)
    monkeypatch.setattr(harness._Decoders, "get", spy)

    def boom(*a, **k):
        raise AssertionError("a finished cell was decoded again")
    monkeypatch.setattr(SPDEngine, "generate", boom)
    monkeypatch.setattr(SPDEngine, "generate_ar", boom)
    run_grid(t, spec, tmp_path, progress=False)
    assert sorted(tried) == sorted(k for k, c in cells.items() if "skipped" in c)
    with pytest.raises(SPDError, match="other settings"):
        run_grid(t, _spec(ckpt, max_new_tokens=5), tmp_path, progress=False)
    with pytest.raises(SPDError, match="other settings"):  # context lookup on: not comparable
        run_grid(t, _spec(ckpt, lookup=3), tmp_path, progress=False)

    written = write_report(state, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| spd n=2 L_s=1 | 3 |" in md and "| ppsd n=2 | 2 |" in md and "| eagle3 | 1 |" in md
    assert "Skipped:" in md and "## T = 1" in md and "Cost model" in md
    # the batched rows (spd.evaluation.batched), from pieces measured at the default B
    assert Costs.from_dict(state["costs"]).covers_batches([1, 2, 4, 8, 16], [2])
    assert "Batched, B sequences at once (T = 0)" in md and "- spd n=2 L_s=1: " in md
    assert md == markdown(state)
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the test extra has it)")
    for name in ("speedup_vs_n.png", "acceptance_by_position.png"):
        assert (tmp_path / name) in written
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_recost_applies_to_every_cell(trained, tmp_path, monkeypatch):
    """A re-measured cost model changes every adjusted speedup in the report, never the counts."""
    t, ckpt = trained
    import spd.evaluation.grid as harness
    from spd.evaluation.report import _rows_by_config
    fixed = Costs(device="cpu", context=16, reps=1, forward_s=0.010, head_s=0.001,
                  stage_s={"2": [0.008, 0.008]}, chunk_s={})
    monkeypatch.setattr(harness, "measure_costs", lambda *a, **k: Costs(**fixed.as_dict()))
    spec = _spec(ckpt, methods=["spd"], temperatures=[0.0], pdm_layers=[1])
    state = run_grid(t, spec, tmp_path, progress=False)
    before = _rows_by_config(state)[0.0]["spd n=2 L_s=1"]
    # the AR step 1.5 times dearer (a cycle, at least 0.009 s, stays above t_fwd / n)
    dearer = dict(fixed.as_dict(), forward_s=0.015)
    monkeypatch.setattr(harness, "measure_costs", lambda *a, **k: Costs(**dearer))
    after_state = run_grid(t, spec, tmp_path, progress=False, recost=True)
    after = _rows_by_config(after_state)[0.0]["spd n=2 L_s=1"]
    for ds in ("a", "b", "overall"):
        assert after[ds]["derived"]["adjusted_speedup"] == pytest.approx(
            1.5 * before[ds]["derived"]["adjusted_speedup"])
        assert after[ds]["totals"] == before[ds]["totals"]


def test_grid_refuses_an_output_that_differs_from_ar(trained, tmp_path, monkeypatch):
    t, ckpt = trained
    from spd.runtime.engine import SPDEngine
    real = SPDEngine.generate

    def corrupt(self, *a, **k):
        res = real(self, *a, **k)
        res.token_ids[-1] = (res.token_ids[-1] + 1) % VOCAB
        return res
    monkeypatch.setattr(SPDEngine, "generate", corrupt)
    with pytest.raises(InternalError, match="differs from autoregressive") as err:
        run_grid(t, _spec(ckpt, methods=["spd"], temperatures=[0.0]), tmp_path, progress=False)
    ctx = err.value.context  # what a bug report needs: where, and the first token that differs
    assert ctx["cell"].startswith("spd n=2") and isinstance(ctx["first_difference"], int)


def test_spec_rejects_bad_input(trained):
    ckpt = trained[1]
    with pytest.raises(SPDError, match="unknown method"):
        _spec(ckpt, methods=["spd", "medusa"])
    with pytest.raises(SPDError, match="stage counts"):
        _spec(ckpt, stages=[1])
    with pytest.raises(SPDError, match="temperature"):
        _spec(ckpt, temperatures=[-1.0])
    with pytest.raises(SPDError, match="nothing to evaluate"):
        _spec(ckpt, datasets={})


def test_cost_model_formulas():
    c = Costs(device="cpu", context=8, reps=1, forward_s=0.040, head_s=0.004,
              stage_s={"4": [0.010, 0.010, 0.009, 0.009]}, chunk_s={"6": 0.050})
    # SPD, greedy: the last stage judges, so it runs its layers and the head (0.013)
    assert adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.005) == \
        pytest.approx(2.0 / 4 * 0.040 / 0.013)
    # ... and a draft slower than every stage is the cycle
    assert adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.016) == \
        pytest.approx(2.0 / 4 * 0.040 / 0.016)
    # SPD, sampling: the draft rank judges (0.005 + 0.004); no device is slower than the
    # balanced cycle t_fwd / n that S_theory assumes, so the adjusted speedup is S_theory
    assert adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.005, greedy=False) == \
        pytest.approx(2.0)
    assert adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.008, greedy=False) == \
        pytest.approx(2.0 / 4 * 0.040 / 0.012)
    # PPSD waits for its draft every cycle; its last stage verifies
    assert adjusted_speedup("ppsd", c, n=4, s_theory=2.0, draft_s=0.005) == \
        pytest.approx(2.0 / 4 * 0.040 / 0.018)
    assert adjusted_speedup("eagle3", c, s_theory=3.0, draft_s=0.002, draft_steps=5) == \
        pytest.approx(3.0 * 0.040 / (5 * 0.002 + 0.050))
    cheap_chunk = Costs(**dict(c.as_dict(), chunk_s={"6": 0.030}))  # noise: below one row
    assert adjusted_speedup("eagle3", cheap_chunk, s_theory=3.0, draft_s=0.002,
                            draft_steps=5) == pytest.approx(3.0 * 0.040 / (5 * 0.002 + 0.040))
    assert adjusted_speedup("pp", c, n=4) == pytest.approx(0.040 / 0.042)
    assert adjusted_speedup("ar", c) == 1.0
    assert [devices_used(m, 4) for m in ("ar", "eagle3", "pp", "ppsd", "spd", "spd-nd",
                                         "spd-tree")] == [1, 1, 4, 4, 5, 4, 5]


def test_tree_row_charges_w_rows_per_stage_step():
    """spd-tree: each stage's one-row time scaled by what a chunk of W = 4 rows costs over one
    row on this device; the head judges one row; an untimed chunk is charged W times."""
    c = Costs(device="cpu", context=8, reps=1, forward_s=0.040, head_s=0.004,
              stage_s={"4": [0.010, 0.010, 0.009, 0.009]}, chunk_s={"4": 0.060})
    assert methods.TREE_WIDTH == 4
    # stages 1.5x: 15, 15, 13.5, 13.5 + 4 (the head) ms: the last stage is the cycle
    assert adjusted_speedup("spd-tree", c, n=4, s_theory=2.4, draft_s=0.005) == \
        pytest.approx(2.4 / 4 * 0.040 / 0.0175)
    assert adjusted_speedup("spd-tree", c, n=4, s_theory=2.4, draft_s=0.02) == \
        pytest.approx(2.4 / 4 * 0.040 / 0.02)
    free = Costs(**dict(c.as_dict(), chunk_s={"4": 0.030}))  # a chunk no dearer than a row
    assert adjusted_speedup("spd-tree", free, n=4, s_theory=2.4, draft_s=0.005) == \
        adjusted_speedup("spd", free, n=4, s_theory=2.4, draft_s=0.005)
    untimed = Costs(**dict(c.as_dict(), chunk_s={}))  # stages 40, 40, 36 + 4 ms
    assert adjusted_speedup("spd-tree", untimed, n=4, s_theory=2.4, draft_s=0.005) == \
        pytest.approx(2.4 / 4 * 0.040 / 0.040)


def test_spd_on_n_devices_charges_the_draft_to_a_shorter_first_stage():
    """spd-nd: no draft rank; stage 0 drafts too, and the balanced split gives it fewer layers
    (8 layers of 2.5 ms, measured as 4 stages of 2; head 4 ms on the last stage, greedy)."""
    c = Costs(device="cpu", context=8, reps=1, forward_s=0.024, head_s=0.004,
              stage_s={"4": [0.005] * 4}, num_layers=8)
    assert c.layer_costs(4) == [0.0025] * 8
    # draft 3 ms on stage 0 and head 4 ms on stage 3: split [1, 3, 3, 1], stage times
    # 5.5, 7.5, 7.5, 6.5 ms: the cycle is 7.5 ms
    assert c.balanced_cycle(4, 0.004, {0: 0.003}) == pytest.approx(0.0075)
    assert adjusted_speedup("spd-nd", c, n=4, s_theory=2.0, draft_s=0.003) == \
        pytest.approx(2.0 / 4 * 0.024 / 0.0075)
    # sampling: stage 0 drafts and judges (3 + 4 ms), the last stage runs layers only
    assert adjusted_speedup("spd-nd", c, n=4, s_theory=2.0, draft_s=0.003, greedy=False) == \
        pytest.approx(2.0 / 4 * 0.024 / c.balanced_cycle(4, 0.0, {0: 0.007}))
    # the same n devices, without the layer count (an older grid): the fractional bound
    old = Costs(**dict(c.as_dict(), num_layers=0))
    assert old.balanced_cycle(4, 0.004, {0: 0.003}) == pytest.approx((0.020 + 0.007) / 4)
    # spd (n + 1 devices) runs the uniform split, its last stage 5 + 4 ms; spd-nd's balanced
    # split pays the 3 ms draft and is still faster here; a dearer draft turns it round
    assert adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.003) == \
        pytest.approx(2.0 / 4 * 0.024 / 0.009)
    assert adjusted_speedup("spd-nd", c, n=4, s_theory=2.0, draft_s=0.008) < \
        adjusted_speedup("spd", c, n=4, s_theory=2.0, draft_s=0.008)


def test_measure_costs_times_every_piece():
    t = make_tiny_target(vocab=VOCAB)
    c = measure_costs(t, [2, 4], chunk_rows=[3], context=8, reps=2)
    assert len(c.stage_s["2"]) == 2 and len(c.stage_s["4"]) == 4
    assert c.forward_s > 0 and c.head_s > 0 and c.chunk_s["3"] > 0
    assert Costs.from_dict(c.as_dict()) == c


def test_cli_grid_flags_are_checked(tmp_path, capsys):
    from spd.cli import main
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 1, "turns": ["hi"]}) + "\n")
    assert main(["eval", "--prompts", str(q), "--stages", "2,4"]) == 2
    assert "need --methods" in capsys.readouterr().err
    assert main(["eval", "--prompts", str(q), "--temperature", "0,x", "--methods", "ar"]) == 2
    assert "comma-separated numbers" in capsys.readouterr().err


class _StubDecoders:
    """Decoders of a chain drafter with `steps` draft steps, or none (no trained drafter)."""

    def __init__(self, steps):
        self.steps, self.built = steps, []

    def get(self, cell):
        self.built.append((cell.method, cell.n, cell.pdm_layers))
        if self.steps is None:
            return None, "no drafter"
        return type("Chain", (), {"draft_steps": self.steps})(), "stub"


def test_cost_chunks_come_from_the_methods(trained, monkeypatch):
    """The cost model times what each planned method's Method.cost_chunks asks for (EAGLE-3:
    its verification chunk of k+1 tokens), built once per configuration; the grid names none."""
    ckpt = trained[1]
    decoders = _StubDecoders(4)
    assert _cost_chunks(plan_cells(_spec(ckpt)), decoders) == [5]
    assert decoders.built == [("eagle3", 1, None)]   # 2 datasets x 2 T: one decoder
    assert _cost_chunks(plan_cells(_spec(ckpt, methods=["spd", "pp"])), _StubDecoders(4)) == []
    assert _cost_chunks(plan_cells(_spec(ckpt)), _StubDecoders(None)) == []  # nothing to time
    # any method may ask: here PPSD, once per stage count, beside EAGLE-3
    ppsd = methods.METHODS["ppsd"]
    monkeypatch.setitem(methods.METHODS, "ppsd", methods.Method(
        **{**ppsd.__dict__, "cost_chunks": lambda d: [d.draft_steps * 10]}))
    decoders = _StubDecoders(2)
    assert _cost_chunks(plan_cells(_spec(ckpt, stages=[2, 3])), decoders) == [3, 20]
    assert sorted(decoders.built) == [("eagle3", 1, None), ("ppsd", 2, None), ("ppsd", 3, None)]


def test_the_reference_method_is_ar():
    assert methods.reference() is methods.METHODS["ar"]
    assert [m.name for m in methods.METHODS.values() if m.cost_chunks] == ["eagle3", "spd-tree"]


STORED_GRID = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" /
               "2026-11-30-grid-cpu" / "grid.json")


def _cost_cases():
    """The cost model measured for the stored CPU grid, and random ones with extreme shapes
    (a head dearer than a stage, stages cheaper than their share, chunks cheaper than a row)."""
    cases = [Costs.from_dict(json.loads(STORED_GRID.read_text())["costs"])]
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        r = lambda: float(torch.rand((), generator=g)) * 0.02 + 1e-4  # noqa: E731
        stages = {str(n): [r() for _ in range(n)] for n in (2, 3, 4, 6, 8)}
        cases.append(Costs(device="cpu", context=8, reps=1, forward_s=r() * 3, head_s=r(),
                           stage_s=stages, chunk_s={str(k + 1): r() * 3 for k in range(1, 8)},
                           num_layers=24 * (len(cases) % 2)))  # spd-nd: both cost paths
    return cases


@pytest.mark.parametrize("greedy", [True, False])
def test_adjusted_speedup_never_exceeds_theoretical(greedy):
    """Every method, every n, both temperatures, measured and extreme costs: the draft-cost-
    adjusted speedup is at most S_theory (a method can only lose by what it pays beyond
    S_theory's premise), whatever the drafter costs."""
    for costs in _cost_cases():
        for name, m in methods.METHODS.items():
            ns = [int(n) for n in costs.stage_s] if m.staged else [1]
            for n in ns:
                for s in (0.5, 1.0, 1.7, float(n)):
                    for draft_s in (0.0, 1e-4, 0.005, 0.05):
                        steps = [k for k in range(1, 8) if str(k + 1) in costs.chunk_s][:2] \
                            if m.cost_chunks else [0]
                        for k in steps:
                            theory = 1.0 if m.is_reference or m.derived_from_reference else s
                            adj = m.adjusted(costs, n, theory, draft_s, k, greedy)
                            assert 0 < adj <= theory * (1 + 1e-12), (name, n, s, draft_s, k)


def test_stored_grid_charges_the_head_to_the_last_stage_when_greedy():
    """The stored CPU grid's SPD n = 2 cell (S_theory 1.18 at T = 0) was reported at 1.37:
    the last stage's verification was charged to nobody. Now the last stage pays it."""
    state = json.loads(STORED_GRID.read_text())
    costs = Costs.from_dict(state["costs"])
    t0, t1 = costs.stage_s["2"]
    cell = state["cells"]["spd n=2 L_s=2 | mt_bench | T=0"]
    d = derived(cell, costs, None)
    assert d["theoretical_speedup"] > 1.1
    assert d["adjusted_speedup"] == pytest.approx(
        d["theoretical_speedup"] * costs.forward_s / (2 * (t1 + costs.head_s)))
    assert d["adjusted_speedup"] < d["theoretical_speedup"]


def test_grid_runs_spd_on_n_devices(trained, tmp_path):
    """spd-nd decodes with SPD's drafters (same counts, same greedy check) on n devices."""
    t, ckpt = trained
    spec = _spec(ckpt, methods=["spd", "spd-nd"], temperatures=[0.0], pdm_layers=[1])
    cells = run_grid(t, spec, tmp_path, progress=False)["cells"]
    nd, spd = cells["spd-nd n=2 L_s=1 | a | T=0"], cells["spd n=2 L_s=1 | a | T=0"]
    assert nd["checked_against_ar"] is True
    assert (nd["totals"]["N"], nd["totals"]["K"]) == (spd["totals"]["N"], spd["totals"]["K"])
    assert nd["derived"]["devices"] == 2 and spd["derived"]["devices"] == 3
    assert 0 < nd["derived"]["adjusted_speedup"] <= nd["derived"]["theoretical_speedup"]
