"""The distributed breakdown: communication / control time per cycle, never negative."""
from types import SimpleNamespace

import pytest

from spd.distributed.config import DistConfig
from spd.distributed.stats import breakdown
from spd.runtime.types import DecodeStats


def _stage(rank, forward_s):
    return {"rank": rank, "role": "stage", "layers": [0, 1], "forward_s": forward_s,
            "phase_s": {}, "prefill_s": 0.0}


def test_comm_control_is_per_cycle_overhead_minus_that_cycles_verification():
    # Cycles of 10, 10 and 18 ms over an 8 ms stage forward: overheads 2, 2 and 10 ms; only the
    # last one verified (and rolled back), for 9 ms. Subtracting the mean verification (3 ms)
    # from every cycle made the median -1 ms; per cycle it is 2, 2 and 1 ms.
    stats = DecodeStats(mode="spd", n=2)
    stats.phase_s = {"verify": 0.004, "rollback": 0.005}
    rt = SimpleNamespace(world=3, backend="gloo", config=DistConfig(n_stages=2))
    out = breakdown(rt, stats, [0.010, 0.010, 0.018], [0.001, 0.001, 0.001],
                    [_stage(1, [0.008, 0.008, 0.008])], verify_s=[0.0, 0.0, 0.009])
    assert out["overhead_ms"]["median"] == pytest.approx(2.0)
    assert out["comm_control_ms"]["median"] == pytest.approx(2.0)
    assert out["comm_control_ms"]["mean"] == pytest.approx(5.0 / 3)
    assert out["verify_rollback_ms_per_cycle"] == pytest.approx(3.0)


def test_comm_control_is_never_negative():
    # a verification that overlapped a slower stage forward: more verify time than overhead
    stats = DecodeStats(mode="spd", n=2)
    stats.phase_s = {"verify": 0.005}
    rt = SimpleNamespace(world=3, backend="gloo", config=DistConfig(n_stages=2))
    out = breakdown(rt, stats, [0.010], [0.001],
                    [_stage(1, [0.009])], verify_s=[0.005])
    assert out["comm_control_ms"]["median"] == 0.0


def test_summary_names_processes_when_the_draft_shares_a_stage():
    from spd.distributed.stats import DistributedDecodeStats
    stats = DistributedDecodeStats(mode="spd", n=2)
    stats.phase_s = {}
    for on_stage, want in ((None, " ranks=3 "), (0, " ranks=2 (draft on stage 0) ")):
        rt = SimpleNamespace(world=3, backend="gloo",
                             config=DistConfig(n_stages=2, draft_on_stage=on_stage))
        stats.distributed = breakdown(rt, stats, [0.01], [0.001], [_stage(1, [0.008])],
                                      verify_s=[0.0])
        assert want in stats.summary()
