"""The grid's measured runtime cost per cycle (cost_model.runtime_overhead): read from a
bench_protocol.py JSON, added to every pipelined cycle, named in the report; a bad file or a
file of another device type is refused."""
import json
from pathlib import Path

import pytest

from spd.errors import SPDError
from spd.evaluation.cost_model import Costs, runtime_overhead

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / \
    "2026-12-05-distributed-device-loop-cpu.json"


def _file(tmp_path, rows, device_type="cpu"):
    path = tmp_path / "protocol.json"
    path.write_text(json.dumps({"meta": {"device_type": device_type}, "rows": rows}))
    return path


def _row(n, f, cycle, loop="device", drafter="always-right", on_stage=None):
    return dict(n=n, F_ms=f, cycle_ms=cycle, loop=loop, drafter=drafter,
                draft_on_stage=on_stage)


def test_reads_the_device_loop_steady_rows(tmp_path):
    rows = [_row(2, 2.0, 3.0), _row(2, 5.0, 6.5), _row(2, 10.0, 11.2),  # overheads 1, 1.5, 1.2
            _row(2, 2.0, 9.0, drafter="half-right"), _row(2, 2.0, 9.0, loop="host"),
            _row(2, 2.0, 9.0, on_stage=0), _row(4, 2.0, 1.0)]            # below F: 0
    got = runtime_overhead(_file(tmp_path, rows), "cpu")
    assert got == pytest.approx({"2": 1.2e-3, "4": 0.0})
    host_only = runtime_overhead(_file(tmp_path, [_row(2, 2.0, 4.0, loop="host")]), "cpu")
    assert host_only == pytest.approx({"2": 2e-3})
    assert set(runtime_overhead(RESULT, "cpu")) == {"2", "4", "8"}  # the committed CPU run


def test_cycle_charges_it_and_the_report_names_it():
    from spd.evaluation.report import markdown
    costs = Costs("cpu", 256, 3, forward_s=0.04, head_s=0.004, stage_s={"2": [0.02, 0.02]})
    assert costs.cycle(2, 0.021) == pytest.approx(0.021)
    costs.runtime_s = {"2": 0.003}
    assert costs.cycle(2, 0.021) == pytest.approx(0.024)
    assert costs.cycle(4, 0.011) == pytest.approx(0.011)  # no figure for n = 4: none charged
    state = {"settings": {"prompts": {}, "max_new_tokens": 8}, "cells": {}, "costs": costs.as_dict(),
             "runtime_from": "x.json"}
    assert "n=2 3.00 ms" in markdown(state) and "x.json" in markdown(state)
    state["costs"]["runtime_s"] = {}
    assert "not charged" in markdown(state)


@pytest.mark.parametrize("content,device,match", [
    ("not json", "cpu", "not a bench_protocol"),
    (json.dumps({"rows": []}), "cpu", "not a bench_protocol"),
    (json.dumps({"meta": {"device_type": "cuda"}, "rows": []}), "cpu", "measured on 'cuda'"),
    (json.dumps({"meta": {"device_type": "cpu"}, "rows": []}), "cpu", "no always-right"),
])
def test_bad_files_are_refused(tmp_path, content, device, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SPDError, match=match):
        runtime_overhead(path, device)
    with pytest.raises(SPDError, match="not a bench_protocol"):
        runtime_overhead(tmp_path / "missing.json", "cpu")
