"""The main job against `--mode ar`, in one run: README's prompt on the default model.

Each repeat runs the autoregressive decode and then the default SPD decode (greedy, one process,
the engine's drafter) of the same chat prompt, and checks they give the same tokens. The ratio
SPD / AR tok/s is taken within each repeat, so a noisy machine moves both sides; the table shows
every repeat and the medians, the JSON keeps them all. In one process the stages run one after
another: this is what a laptop user sees, not what n devices give (S_theory: bench_core.py,
spd eval).

    python benchmarks/bench_main_job.py --repeats 5 --json-out out.json

It imports `spd` from wherever Python finds it, so `PYTHONPATH=<other checkout>/python` times
another version with the same script.
"""
from __future__ import annotations

import argparse
import statistics

from harness import Table, run_meta, write_json

from spd import SPDEngine
from spd.model.loading import load_target

PROMPT = "Explain how a CPU cache works."  # README's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.repeats < 1 or args.max_new_tokens < 1:
        ap.error("--repeats and --max-new-tokens must be at least 1")

    target = load_target()
    engine = SPDEngine(target, n_stages=args.stages)
    msgs = [{"role": "user", "content": args.prompt}]
    engine.generate(msgs, 8)  # warm-up: first-call allocations and caches
    table = Table([("repeat", ">6"), ("ar_tok_s", ">10.2f", "AR tok/s"),
                   ("spd_tok_s", ">10.2f", "SPD tok/s"), ("ratio", ">8.3f"), ("K", ">5"),
                   ("stage_rows", ">11"), ("same", ">6")])
    table.print_header()
    rows = []
    for i in range(args.repeats):
        ar = engine.generate_ar(msgs, args.max_new_tokens)
        spd = engine.generate(msgs, args.max_new_tokens)
        row = dict(repeat=i, ar_tok_s=ar.stats.decode_tok_s, spd_tok_s=spd.stats.decode_tok_s,
                   ratio=spd.stats.decode_tok_s / ar.stats.decode_tok_s, K=spd.stats.K,
                   stage_rows=spd.stats.stage_rows, same=spd.token_ids == ar.token_ids)
        rows.append(row)
        table.print(row)
    median = {k: statistics.median(r[k] for r in rows) for k in ("ar_tok_s", "spd_tok_s", "ratio")}
    print(f"median: AR {median['ar_tok_s']:.2f} tok/s, SPD {median['spd_tok_s']:.2f} tok/s, "
          f"ratio {median['ratio']:.3f}; same tokens in {sum(r['same'] for r in rows)}/"
          f"{len(rows)}")
    if args.json_out:
        write_json(args.json_out, run_meta(target.device, model=target.name, n=args.stages,
                                           max_new_tokens=args.max_new_tokens,
                                           prompt=args.prompt), rows=rows, median=median)


if __name__ == "__main__":
    main()
