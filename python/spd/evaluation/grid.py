"""The evaluation grid: AR, pipeline-parallel AR, EAGLE-3, PPSD and SPD on the same prompts.

`run_grid` decodes every prompt of every dataset with every method configuration at every
temperature, checks each greedy output against the autoregressive one (a mismatch is an error:
every method here is lossless), and keeps the results in `<out>/grid.json` after every cell, so a
run that stops resumes where it was (finished cells are skipped). `spd.evaluation.report` turns that file
into the markdown report and the plots.

Cells: `ar` and `eagle3` run once per dataset and temperature (one device, no stages); `pp`,
`ppsd` and `spd` once per stage count n (and `spd` per PDM depth L_s). Drafters come from the
checkpoints shipped with the package or from `checkpoint_dirs`; a configuration with no trained
drafter is recorded as skipped, with the command that trains one.

`pp` (plain pipeline-parallel decoding on the same n stages) computes exactly what AR computes,
token for token and forward for forward, so its counts follow from the AR cell (N tokens take
K = N*n stage cycles) instead of decoding everything again; its cost comes from the cost model.

Batched rows (issue 54): the cost model also times its pieces over R rows for the batch sizes
`GridSpec.batch_sizes`, and the report projects ar, pp and spd with B sequences at once from
them (`spd.evaluation.batched`). A grid stored before them gains them when resumed: only the
batched pieces are measured then.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from spd.errors import InternalError, SPDError
from spd.evaluation import methods
from spd.evaluation.batched import BATCH_SIZES
from spd.evaluation.cost_model import Costs, measure_batch_costs, measure_costs, runtime_overhead
from spd.evaluation.evaluate import add_totals, encode_question, first_difference, result_row
from spd.evaluation.methods import NAMES as METHODS
from spd.runtime import metrics
from spd.runtime.types import SamplingParams

GRID_FILE = "grid.json"
# Every method's tokens/s is measured in this one process, but only single-device methods run
# here as they would be deployed (Method.measured_for_real); the pipelined ones run their
# stages one after another.


@dataclass
class GridSpec:
    methods: list[str]
    stages: list[int]
    pdm_layers: list[int]
    datasets: dict            # name -> list of questions ({'id', 'turns', ...})
    temperatures: list[float]
    max_new_tokens: int = 256
    seed: int = 0
    checkpoint_dirs: list[str] = field(default_factory=list)
    cost_context: int = 256
    cost_reps: int = 10
    lookup: int = 0           # context lookup for spd/ppsd cells (0: the drafters alone)
    # B of the batched rows (the report's projections; [] none). Not a setting: the cells do
    # not depend on it, and a resumed grid measures what its batched rows lack
    batch_sizes: list[int] = field(default_factory=lambda: list(BATCH_SIZES))

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise SPDError(f"unknown method(s) {bad or self.methods}: choose from "
                           f"{', '.join(METHODS)}")
        if not self.stages or any(n < 2 for n in self.stages):
            raise SPDError(f"--stages must list stage counts >= 2, got {self.stages}")
        if not self.pdm_layers or any(x < 1 for x in self.pdm_layers):
            raise SPDError(f"--pdm-layers must list depths >= 1, got {self.pdm_layers}")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise SPDError(f"--temperature must list values >= 0, got {self.temperatures}")
        if not self.datasets:
            raise SPDError("nothing to evaluate: give --datasets and/or --prompts")
        if self.max_new_tokens < 1:
            raise SPDError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if any(not isinstance(b, int) or b < 1 for b in self.batch_sizes):
            raise SPDError(f"batch sizes must be whole numbers >= 1, got {self.batch_sizes}")

    def settings(self) -> dict:
        """What a resumed run must share with the stored one (cells are comparable)."""
        s = {"max_new_tokens": self.max_new_tokens, "seed": self.seed,
             "prompts": {k: [str(q["id"]) for q in v] for k, v in self.datasets.items()}}
        if self.lookup:  # only when on, so grids stored before the option still resume
            s["lookup"] = self.lookup
        return s


@dataclass(frozen=True)
class Cell:
    method: str
    n: int                 # stages (1 for ar and eagle3)
    pdm_layers: int | None
    dataset: str
    temperature: float

    @property
    def config(self) -> str:
        """The method configuration, the row label of the report."""
        return methods.get(self.method).config(self.n, self.pdm_layers)

    @property
    def key(self) -> str:
        return f"{self.config} | {self.dataset} | T={self.temperature:g}"


def plan_cells(spec: GridSpec) -> list[Cell]:
    """Every cell, AR first (the greedy checks need its outputs)."""
    cells = []
    # The reference (AR) always runs, first: every check and measured ratio compares with it.
    order = sorted(methods.METHODS.values(), key=lambda m: not m.is_reference)
    for m in order:
        if m.name not in spec.methods and not m.is_reference:
            continue
        for temp in spec.temperatures:
            for ds in spec.datasets:
                if not m.staged:
                    cells.append(Cell(m.name, 1, None, ds, temp))
                elif m.per_depth:
                    cells += [Cell(m.name, n, ls, ds, temp) for n in spec.stages
                              for ls in spec.pdm_layers]
                else:
                    cells += [Cell(m.name, n, None, ds, temp) for n in spec.stages]
    return cells


class _Decoders:
    """Builds (once) the decoder of each method configuration; None when no drafter exists."""

    def __init__(self, target, spec: GridSpec):
        self.target = target
        self.search = methods.checkpoint_search(spec.checkpoint_dirs)
        self.lookup = spec.lookup
        self._cache = {}

    def get(self, cell: Cell):
        key = (cell.method, cell.n, cell.pdm_layers)
        if key not in self._cache:
            self._cache[key] = self._build(cell)
        return self._cache[key]

    def _build(self, cell: Cell):
        return methods.get(cell.method).build(self.target, cell.n, cell.pdm_layers, self.search,
                                              self.lookup)


def _tok_s(totals: dict) -> float:
    return metrics.tokens_per_s(totals["N"], totals["decode_s"])


def derived(cell: dict, costs: Costs, ar_totals: dict | None) -> dict:
    """Speedups of one cell's totals: theoretical, draft-cost-adjusted, per device, and the
    measured tokens/s over AR's (`ar_totals`: the AR cell's totals on the same prompts)."""
    method, n = methods.get(cell["method"]), cell["n"]
    t = cell["totals"]
    # S_theory = alpha * n: tokens per target-forward-equivalent (EAGLE: tokens per round)
    alpha = metrics.alpha(t["N"], t["K"])
    s_theory = metrics.theoretical_speedup(t["N"], t["K"], n)
    draft_s = t["draft_s"] / t["draft_calls"] if t["draft_calls"] else 0.0  # per drafter call
    adj = method.adjusted(costs, n, s_theory, draft_s, cell.get("draft_steps", 0),
                          cell["temperature"] == 0)
    devices = method.devices(n)
    tok_s = _tok_s(t)
    measured = None
    if method.is_reference:
        measured = 1.0
    elif method.measured_for_real and ar_totals and _tok_s(ar_totals):
        measured = tok_s / _tok_s(ar_totals)
    return {"alpha": alpha, "theoretical_speedup": s_theory, "adjusted_speedup": adj,
            "devices": devices, "adjusted_speedup_per_device": adj / devices,
            "acceptance_rate": metrics.rate(t["accepted"], t["judged"]),
            "draft_ms": draft_s * 1e3, "decode_tok_s": tok_s, "measured_ratio": measured}


def load_state(out_dir: Path) -> dict:
    path = out_dir / GRID_FILE
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise SPDError(f"{path} is not valid JSON ({exc}); remove it to start over") from exc
    return {}


def _save(out_dir: Path, state: dict) -> None:
    tmp = out_dir / (GRID_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(out_dir / GRID_FILE)  # atomic: a killed run never leaves a torn file


def run_grid(target, spec: GridSpec, out_dir, progress: bool = True, command: str = "",
             recost: bool = False, runtime_from: str | None = None) -> dict:
    """Run every unfinished cell; recost=True measures the cost model again (the report
    recomputes every speedup from it); runtime_from: a bench_protocol.py JSON whose measured
    cost per cycle of the distributed runtime the pipelined methods are charged
    (cost_model.runtime_overhead; kept in the grid until another is given)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_state(out_dir)
    settings = spec.settings()
    if state and state.get("settings") != settings:
        raise SPDError(f"{out_dir / GRID_FILE} holds a grid with other settings (prompts, "
                       "max_new_tokens, seed or lookup); use another --out-dir or remove it")
    state.setdefault("settings", settings)
    state.setdefault("cells", {})
    state.setdefault("reference", {})  # AR token ids per (dataset, T): the greedy checks
    state["target"] = {"name": target.name, "fingerprint": target.fingerprint(),
                       "device": str(target.device), "dtype": str(target.dtype)}
    if command:
        state["command"] = command
    cells = plan_cells(spec)
    decoders = _Decoders(target, spec)
    if recost or "costs" not in state:
        state["costs"] = measure_costs(target, spec.stages, _cost_chunks(cells, decoders),
                                       spec.cost_context, spec.cost_reps,
                                       batch_sizes=spec.batch_sizes).as_dict()
        _save(out_dir, state)
    stored = Costs.from_dict(state["costs"])
    if not target.hybrid and not stored.covers_batches(spec.batch_sizes, spec.stages):
        # an older grid, or more batch sizes or stages: the batched pieces only (those stored
        # and those asked for, timed together), the rest kept
        ns = sorted(set(spec.stages) | {int(n) for n in stored.batch_stage_s})
        sizes = sorted(set(spec.batch_sizes) | set(stored.batch_sizes))
        state["costs"] = measure_batch_costs(target, ns, sizes, stored.context,
                                             stored.reps, stored).as_dict()
        _save(out_dir, state)
    if runtime_from is not None:
        state["costs"]["runtime_s"] = runtime_overhead(runtime_from, target.device.type)
        state["runtime_from"] = str(runtime_from)
        _save(out_dir, state)
    costs = Costs.from_dict(state["costs"])
    # Finished cells are kept; skipped ones (no drafter then) are tried again.
    todo = [c for c in cells if "skipped" in state["cells"].get(c.key, {"skipped": ""})]
    units = sum(len(spec.datasets[c.dataset]) for c in todo
                if not methods.get(c.method).derived_from_reference)
    bar = tqdm(total=units, desc="eval grid", unit="prompt", disable=not progress)
    for cell in todo:
        bar.set_postfix_str(cell.key)
        state["cells"][cell.key] = _run_cell(cell, spec, decoders, state, costs, bar)
        _save(out_dir, state)
    bar.close()
    _rederive(state, costs)
    _save(out_dir, state)
    return state


def _rederive(state: dict, costs: Costs) -> None:
    """Every finished cell's derived speedups from its counts and the current cost model and
    formulas (the counts never change; a re-measured cost or a corrected formula applies to
    every cell alike, as in the report)."""
    for cell in state["cells"].values():
        if "totals" in cell:
            ar = state["cells"].get(_reference_cell(Cell(
                cell["method"], cell["n"], cell["pdm_layers"], cell["dataset"],
                cell["temperature"])).key)
            cell["derived"] = derived(cell, costs, ar["totals"] if ar else None)


def _cost_chunks(cells: list[Cell], decoders: _Decoders) -> list[int]:
    """The chunk sizes the planned methods' adjusted speedups need (Method.cost_chunks), from
    the decoder of each of their configurations (one without a drafter needs none)."""
    rows, seen = set(), set()
    for cell in cells:
        method = methods.get(cell.method)
        key = (cell.method, cell.n, cell.pdm_layers)
        if method.cost_chunks is None or key in seen:
            continue
        seen.add(key)
        decoder = decoders.get(cell)[0]
        if decoder is not None:
            rows |= set(method.cost_chunks(decoder))
    return sorted(rows)


def _reference_cell(cell: Cell) -> Cell:
    """The reference (AR) cell on the same dataset and temperature."""
    return Cell(methods.reference().name, 1, None, cell.dataset, cell.temperature)


def _run_cell(cell: Cell, spec: GridSpec, decoders: _Decoders, state: dict, costs: Costs,
              bar) -> dict:
    ref_key = f"{cell.dataset} | T={cell.temperature:g}"
    record = asdict(cell) | {"config": cell.config}
    method = methods.get(cell.method)
    ar_cell = state["cells"].get(_reference_cell(cell).key)
    if method.derived_from_reference:  # same computation as AR: counts follow from the AR cell
        t = dict(ar_cell["totals"])
        t.update(K=t["N"] * cell.n, judged=0, accepted=0, by_position={}, draft_s=0.0,
                 draft_calls=0)
        record.update(totals=t, source="derived from the AR cell (identical computation)")
    else:
        decoder, source = decoders.get(cell)
        if decoder is None:
            return record | {"skipped": source}
        record["source"] = source
        if hasattr(decoder, "draft_steps"):  # chain drafters: tokens drafted per round
            record["draft_steps"] = decoder.draft_steps
        reference = state["reference"].setdefault(ref_key, {})
        rows = []
        for i, q in enumerate(spec.datasets[cell.dataset]):
            sampling = SamplingParams(temperature=cell.temperature, seed=spec.seed + i)
            ids = encode_question(decoders.target.tokenizer, q)
            if method.is_reference:
                res = decoder.generate_ar(ids, spec.max_new_tokens, sampling)
                reference[str(q["id"])] = res.token_ids
            else:
                res = decoder.generate(ids, spec.max_new_tokens, sampling)
                ref = reference.get(str(q["id"]))
                if sampling.greedy and ref is not None and ref != res.token_ids:
                    raise InternalError("output differs from autoregressive decoding",
                                        cell=cell.key, prompt=q["id"],
                                        first_difference=first_difference(ref, res.token_ids))
            rows.append(result_row(q, res) | {"id": str(q["id"])})  # grid.json keys ids as text
            bar.update(1)
        record.update(totals=add_totals(rows), per_prompt=rows,
                      checked_against_ar=cell.temperature == 0 and not method.is_reference)
    record["derived"] = derived(record, costs, ar_cell["totals"] if ar_cell else None)
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return record


__all__ = ["Cell", "GridSpec", "METHODS", "derived", "load_state", "plan_cells", "run_grid"]
