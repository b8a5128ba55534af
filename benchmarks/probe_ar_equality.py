"""Greedy SPD against `--mode ar` on the default model, token for token: the one decode cycle
(spd.runtime.cycle) in one process and distributed (n + 1 ranks, and n with the draft on a
stage), chains and token trees, several n and W, the shipped PDMs with the context lookup on.
CPU, several minutes on 2 cores. Prints a table (a row per configuration: whether each prompt's
tokens equal AR's, N and K), writes JSON (--json-out) and exits 1 on a mismatch.

    python benchmarks/probe_ar_equality.py --json-out /tmp/ar-equality.json
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Table, run_meta, write_json  # noqa: E402

from spd import SPDEngine  # noqa: E402
from spd.distributed.config import DistConfig, GenerateRequest  # noqa: E402
from spd.distributed.launch import launch_local  # noqa: E402
from spd.distributed.rank import run_requests  # noqa: E402
from spd.model.loading import load_target  # noqa: E402
from spd.model.prompt import encode_prompt  # noqa: E402

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a CPU cache works."]
ONE_PROCESS = [(2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (2, 4), (4, 2), (4, 3), (6, 2)]
# (n, W, draft on stage): n + 1 processes, or n with the draft in stage S's
DISTRIBUTED = [(2, 1, None), (3, 1, None), (4, 1, None), (2, 1, 0), (4, 1, 1), (2, 4, None),
               (4, 3, None), (3, 2, 0)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true",
                    help="one configuration of each kind, 16 new tokens (a check of the probe)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    new = 16 if args.quick else args.max_new_tokens
    one, dist = (ONE_PROCESS[:1] + ONE_PROCESS[5:6], DISTRIBUTED[3:4]) if args.quick else \
        (ONE_PROCESS, DISTRIBUTED)
    t = load_target()
    ids = [encode_prompt(t.tokenizer, p, True) for p in PROMPTS]
    ar = [SPDEngine(t, n_stages=1).generate_ar(i, new).token_ids for i in ids]
    table = Table([("where", "<13"), ("n", ">3"), ("W", ">3"), ("draft_on_stage", ">7", "draft@"),
                   ("equal", ">14"), ("NK", ">16", "N/K"), ("seconds", ">8.0f")])
    table.print_header()
    rows = []

    def report(where, n, w, on_stage, results, t0):
        row = dict(where=where, n=n, W=w, draft_on_stage=on_stage,
                   equal=[list(r.token_ids) == a for r, a in zip(results, ar)],
                   N=[r.stats.N for r in results], K=[r.stats.K for r in results],
                   seconds=time.perf_counter() - t0)
        table.print(dict(row, equal=" ".join(map(str, row["equal"])),
                         NK=" ".join(f"{a}/{b}" for a, b in zip(row["N"], row["K"]))))
        rows.append(row)

    for n, w in one:
        t0 = time.perf_counter()
        e = SPDEngine(t, n_stages=n, tree_width=w)
        report("one process", n, w, None, [e.generate(i, new) for i in ids], t0)
    for n, w, on_stage in dist:
        t0 = time.perf_counter()
        cfg = DistConfig(n_stages=n, tree_width=w, draft_on_stage=on_stage, fault_timeout=30.0,
                         op_timeout=300.0)
        reqs = [GenerateRequest(list(i), new) for i in ids]
        report("distributed", n, w, on_stage,
               launch_local(cfg, partial(run_requests, reqs), timeout=1200), t0)
    ok = all(all(r["equal"]) for r in rows)
    print("ALL EQUAL" if ok else "MISMATCH")
    if args.json_out:
        write_json(args.json_out, run_meta("cpu", model=t.name, prompts=PROMPTS,
                                           max_new_tokens=new, all_equal=ok), rows=rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
