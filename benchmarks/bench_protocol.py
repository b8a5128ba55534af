"""Protocol benchmark: the distributed runtime's own cost per cycle, with emulated compute.

The real runtime (n stage ranks + rank 0, self-launched, gloo by default) runs its one decode
cycle (spd.runtime.cycle; the stage ranks' side: spd.distributed.stage_rank) with every stage
step and every draft step replaced by a fixed wait of F (spd.distributed.emulate: a host sleep on
the CPU, so the cores stay free for the ranks' own work). Ideally a cycle then takes F: the stage
steps and the draft overlap. What it takes beyond F is the runtime's: messages, the judgement,
the bookkeeping on the device, the host's launches and reads. Reported per (n, F, drafter, draft
placement): rank 0's cycle (the time between its host's reads of consecutive cycles' published
state: mean and median), (cycle - F) / F, tokens per F, and each role's messages per cycle.
Drafters: the reference drafter always right (every cycle full and accepted: the steady state)
and right half the time (rejections and refills), both proposing the emulated target's own
continuation; every decode is checked against it (the benchmark exits on a difference).

    python benchmarks/bench_protocol.py --stages 2,4,8 --emulate-ms 2,5,10 --json-out out.json
    # n devices against n + 1: the draft in stage 0's process as well (--draft-on-stage)
    python benchmarks/bench_protocol.py --stages 2,4 --draft-on-stage none,0
    # GPU (ranks sharing one GPU over gloo; see --wait)
    python benchmarks/bench_protocol.py --device cuda --backend gloo --emulate-ms 0.2,0.3,0.6

On a small CPU machine the ranks' own work (Python, gloo, bookkeeping) competes for the cores:
figures there are an upper bound of what separate hosts would see, and are labelled CPU. The
JSON (rows of n, F_ms, drafter, draft_on_stage, cycle_ms, ...) is what `spd eval --runtime-from`
reads (spd.evaluation.cost_model.runtime_overhead).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Table, run_meta, write_json  # noqa: E402

from spd.distributed.config import DistConfig, GenerateRequest  # noqa: E402
from spd.distributed.emulate import reference_tokens, tiny_target  # noqa: E402
from spd.distributed.launch import launch_local  # noqa: E402
from spd.distributed.rank import run_requests  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 11, 200]
SEED = 3


def run_one(n: int, f_s: float, args, on_stage: int | None = None) -> list[dict]:
    """One launch of n + 1 ranks (n with the draft on stage `on_stage`) with F = f_s: a
    warm-up, then each drafter's generation."""
    layers = max(8, n)
    target = tiny_target(SEED, layers, device=args.device)
    m = args.max_new_tokens
    ref = reference_tokens(target, PROMPT, m + n + 2)
    drafters = [("always-right", 1.0), ("half-right", 0.5)]
    reqs = [GenerateRequest(PROMPT, 8, reference=ref)]  # warm-up (first messages, allocations)
    reqs += [GenerateRequest(PROMPT, m, reference=ref, reference_accuracy=acc, reference_seed=1)
             for _, acc in drafters]
    factory = partial(tiny_target, SEED, layers, device=args.device)
    config = DistConfig(n_stages=n, target_factory=factory,
                        device=args.device, backend=args.backend, threads=1,
                        fault_timeout=30.0, op_timeout=120.0, lookup=0,
                        emulate_s=f_s, emulate_wait=args.wait,
                        draft_on_stage=on_stage, ahead=args.ahead)
    t0 = time.perf_counter()
    res = launch_local(config, partial(run_requests, reqs), timeout=900)[1:]
    wall = time.perf_counter() - t0
    rows = []
    f_ms = f_s * 1e3
    for (name, _), r in zip(drafters, res):
        if r.token_ids != ref[len(PROMPT):len(PROMPT) + m]:
            sys.exit(f"n={n} F={f_ms:g} ms {name}: tokens differ from the emulated target's")
        d = r.stats.distributed
        cycle, median = d["cycle_ms"]["mean"], d["cycle_ms"]["median"]
        rows.append(dict(n=n, processes=d["processes"], draft_on_stage=on_stage, F_ms=f_ms,
                         drafter=name, N=r.stats.N, K=r.stats.K, cycle_ms=cycle,
                         cycle_ms_median=median, overhead=(cycle - f_ms) / f_ms,
                         overhead_median=(median - f_ms) / f_ms,
                         tokens_per_F=r.stats.N * f_ms / (r.stats.decode_s * 1e3),
                         ahead=d["ahead"], cycles_run=d["cycles_run"], drain_ms=d["drain_ms"],
                         messages_per_cycle=d["messages_per_cycle"],
                         rank_phase_ms_per_cycle={x["rank"]: x["phase_ms_per_cycle"]
                                                  for x in d["ranks"]}))
    print(f"n={n} draft on stage {on_stage} F={f_ms:g} ms: launch + {len(reqs)} generations "
          f"took {wall:.1f} s", file=sys.stderr)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--emulate-ms", default="2,5,10", help="F, the emulated compute (ms)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default=None, help="default: gloo on CPU, nccl on CUDA")
    ap.add_argument("--wait", default="sleep", choices=("sleep", "spin"),
                    help="the emulated compute: a host sleep, or a CUDA spin kernel (one GPU per "
                         "rank only: kernels of processes sharing a GPU are time-sliced)")
    ap.add_argument("--draft-on-stage", default="none",
                    help="comma-separated: none (a draft rank of its own: n + 1 processes) or a "
                         "stage S whose process also runs the draft (n processes)")
    ap.add_argument("--ahead", type=int, default=2,
                    help="cycles each rank launches past the one its host has read")
    ap.add_argument("--label", default=None, help="a name for this run (e.g. before, after)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    rows = []
    try:
        placements = [None if x.strip() == "none" else int(x)
                      for x in args.draft_on_stage.split(",")]
    except ValueError:
        sys.exit(f"--draft-on-stage takes none or stage indices, got {args.draft_on_stage!r}")
    if args.ahead < 0:
        sys.exit(f"--ahead takes a count >= 0, got {args.ahead}")
    table = Table([("n", ">3"), ("processes", ">7", "procs"),
                   ("draft_on_stage", ">8", "draft@"),
                   ("F_ms", ">7.2f", "F ms"), ("drafter", ">14"), ("N", ">5"),
                   ("K", ">5"), ("cycle_ms", ">10.3f", "cycle ms"),
                   ("overhead", ">12.3f", "(cycle-F)/F"), ("overhead_median", ">10.3f", "(median)"),
                   ("tokens_per_F", ">12.3f", "tokens / F")])
    for n in [int(x) for x in args.stages.split(",")]:
        for f_ms in [float(x) for x in args.emulate_ms.split(",")]:
            for on_stage in placements:
                rows += run_one(n, f_ms * 1e-3, args, on_stage)
    device = "CPU" if args.device == "cpu" else args.device
    print(f"\nRuntime overhead with emulated compute ({device}, {args.backend or 'default'} "
          f"backend, {os.cpu_count()} cores, {args.wait} wait, ahead {args.ahead}, "
          f"{args.max_new_tokens} new tokens{', ' + args.label if args.label else ''})")
    table.print_header()
    for r in rows:
        table.print(r)
    print("(cycle: the interval between rank 0's reads of consecutive cycles' published state; "
          "ideal = F, tokens / F = 1 for an always-right drafter)")
    print("\nMessages per cycle and process (the always-right run; a role in rank 0's process "
          "exchanges nothing with it)")
    per_rank = Table([("n", ">3"), ("draft_on_stage", ">8", "draft@"), ("F_ms", ">7.2f", "F ms"),
                      ("rank", ">5"), ("send", ">8.3f"), ("recv", ">8.3f")])
    per_rank.print_header()
    for r in rows[::2]:
        for rank, m in r["messages_per_cycle"].items():
            per_rank.print(dict(n=r["n"], draft_on_stage=r["draft_on_stage"], F_ms=r["F_ms"],
                                rank=rank, send=m.get("send/data", 0.0),
                                recv=m.get("recv/data", 0.0)))
    if args.json_out:
        write_json(args.json_out, run_meta(args.device, label=args.label, wait=args.wait,
                                           backend=args.backend, rank_threads=1,
                                           ahead=args.ahead,
                                           max_new_tokens=args.max_new_tokens,
                                           torch_threads=torch.get_num_threads()), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
