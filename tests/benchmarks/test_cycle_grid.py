"""benchmarks/cycle_grid.py, a few of its cells on the default model: greedy equals AR and
every decode, greedy and sampled, the reference decoder's, in one process and on n + 1 ranks,
every rank under the replay check (the whole grid: its committed JSON, docs/results.md)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_grid_cells_on_the_default_model(tmp_path, default_target):
    out = tmp_path / "grid.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cycle_grid.py"), "--n", "3", "--widths",
         "2", "--places", "process,ranks", "--prompts", "1", "--max-new-tokens", "8",
         "--json-out", str(out)], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    cells = data["cells"]
    # (token trees only: a chain's cells are the same code with W = 1, and the default model's
    # chains are checked against AR in tests/model and the distributed tests)
    assert data["all_ok"] and len(cells) == 2
    assert {(c["width"], c["place"]) for c in cells} == {(2, "process"), (2, "ranks")}
    for c in cells:
        assert len(c["rows"]) == 2 and all(r["equals_reference"] for r in c["rows"])
        assert c["rows"][0]["equals_ar"] and c["rows"][1]["sampled"]
    assert data["meta"]["device_type"] == "cpu"
