"""What rank 0 reports about a distributed generation: the per-cycle breakdown of every rank."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from spd.distributed.config import DRAFT_RANK, role_name
from spd.distributed.transport import Endpoint
from spd.runtime.engine import DecodeStats


@dataclass
class DistributedDecodeStats(DecodeStats):
    distributed: dict = field(default_factory=dict)

    def summary(self) -> str:
        d = self.distributed
        extra = ""
        if d:
            procs = d.get("processes", d["world_size"])
            ranks = (f"ranks={procs}" if procs == d["world_size"] else
                     f"ranks={procs} (draft on stage {d.get('draft_on_stage')})")
            extra = (f" {ranks} cycle={d['cycle_ms']['median']:.2f} ms "
                     f"overhead={d['overhead_ms']['median']:.2f} ms")
        return super().summary() + extra


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0}
    srt = sorted(xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
            "p90": srt[min(len(srt) - 1, int(0.9 * len(srt)))]}


def breakdown(rt: Endpoint, stats: DecodeStats, cycle_s: list[float], draft_s: list[float],
              stage_stats: list[dict], verify_s: list[float]) -> dict:
    """Per-cycle breakdown: each rank's phases, stage forwards, waits, and the overhead.

    overhead of a cycle = its wall time on rank 0 minus the longest computation that had to fit
    in it (the draft, or the slowest stage's median forward: stages run units as they arrive,
    not in rank 0's cycles, so a forward has no cycle of its own): communication, control,
    verification and rollback, i.e. what n devices could not hide. comm_control of a cycle = its
    overhead minus that cycle's verification and rollback on rank 0 (verify_s), at least 0 (a
    verification that overlapped a slower stage forward hid nothing else).
    """
    K = len(cycle_s)
    ms = 1e3
    per_cycle = lambda total: total / K * ms if K else 0.0  # noqa: E731
    overhead, comm = [], []
    verify_total = stats.phase_s.get("verify", 0.0) + stats.phase_s.get("rollback", 0.0)
    stage_fwd = max((statistics.median(st["forward_s"]) for st in stage_stats
                     if st["forward_s"]), default=0.0)
    for c in range(K):
        overhead.append((cycle_s[c] - max(stage_fwd, draft_s[c])) * ms)
    verify_per_cycle = per_cycle(verify_total)
    comm = [max(0.0, o - v * ms) for o, v in zip(overhead, verify_s)]
    ranks = [{"rank": 0, "role": role_name(0),
              "phase_ms_per_cycle": {k: per_cycle(v) for k, v in stats.phase_s.items()}}]
    for st in stage_stats:
        worked = st["forward_s"]  # one per unit, dropped units included
        ranks.append({"rank": st["rank"], "role": st["role"], "layers": st["layers"],
                      "units_worked": len(worked),
                      "forward_ms": _summary([f * ms for f in worked]),
                      "phase_ms_per_cycle": {k: per_cycle(v) for k, v in st["phase_s"].items()},
                      "prefill_ms": st["prefill_s"] * ms,
                      **({"graph": st["graph"]} if "graph" in st else {})})
    placement = rt.config.placement
    # world_size counts the roles (ranks of the messages); processes the devices they run on
    return {"world_size": rt.world, "processes": placement.processes,
            "draft_on_stage": placement.draft_on_stage, "backend": rt.backend,
            "draft_rank": DRAFT_RANK,
            "cycles": K, "cycle_ms": _summary([c * ms for c in cycle_s]),
            "draft_ms": _summary([d * ms for d in draft_s]),
            "overhead_ms": _summary(overhead),
            "comm_control_ms": _summary(comm),
            "verify_rollback_ms_per_cycle": verify_per_cycle,
            "ranks": ranks}
