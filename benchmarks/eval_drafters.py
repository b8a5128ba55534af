"""Compare trained PDM checkpoints on the same prompts (the training ablations of issue 3).

Each `--pdm NAME=FOLDER` is decoded with the single-process engine on MT-Bench and HumanEval
(first turn, chat template) at each temperature; the table gives alpha, theoretical speedup and
acceptance per dataset and overall, beside what the checkpoint says about its training (L_s,
feature timing, steps, held-out top-1 at the end). Prints a markdown table and writes JSON.

    python benchmarks/eval_drafters.py --pdm ls2=runs/abl-ls2-pre --pdm post=runs/abl-ls2-post \
        --limit 5 --max-new-tokens 128 --temperature 0 --json-out results.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from harness import run_meta, write_json

from spd.draft.pdm import read_pdm_config
from spd.evaluation.evaluate import collect_sets, run_eval
from spd.model.loading import load_target
from spd.runtime.engine import SPDEngine
from spd.runtime.types import SamplingParams


def describe(folder) -> dict:
    """What the checkpoint records about itself and its training."""
    c = read_pdm_config(folder)
    train = c.extra.get("train", {})
    final = c.extra.get("final_eval", {})
    n = c.n_stages
    return {"n": n, "pdm_layers": c.num_layers, "features": c.features,
            "method": c.extra.get("method", "spd"), "anchors": c.anchors,
            "steps": train.get("steps"), "init_from": train.get("init_from"),
            "held_out_top1": final.get(f"fill{n}_top1"), "held_out_kl": final.get(f"fill{n}_kl")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pdm", action="append", required=True, metavar="NAME=FOLDER")
    ap.add_argument("--datasets", default="mt_bench,humaneval")
    ap.add_argument("--prompts", default=None, help="FastChat question .jsonl instead")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", default="0", help="comma list, e.g. 0,1")
    ap.add_argument("--check", action="store_true",
                    help="also decode autoregressively and compare (greedy only; slower)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    named = []
    for item in args.pdm:
        name, sep, folder = item.rpartition("=")  # names may hold "=" (L_s=2)
        if not sep or not Path(folder).is_dir():
            ap.error(f"--pdm takes NAME=FOLDER with an existing folder, got '{item}'")
        named.append((name, folder))
    sets = collect_sets([d for d in args.datasets.split(",") if d] if not args.prompts else [],
                        args.prompts, args.limit)
    temps = [float(x) for x in args.temperature.split(",")]
    target = load_target(None)
    rows = []
    for name, folder in named:
        info = describe(folder)
        engine = SPDEngine(target, n_stages=info["n"], anchors=info["anchors"], pdm=folder)
        for temp in temps:
            t0 = time.perf_counter()
            rep = run_eval(engine, sets, args.max_new_tokens, SamplingParams(temperature=temp),
                           check=args.check and temp == 0)
            rows.append({"name": name, "folder": str(folder), "temperature": temp, **info,
                         "datasets": {k: {x: v[x] for x in ("N", "K", "alpha",
                                                            "theoretical_speedup",
                                                            "acceptance_rate")}
                                      for k, v in rep["datasets"].items()},
                         "overall": {x: rep["overall"][x] for x in (
                             "N", "K", "alpha", "theoretical_speedup", "acceptance_rate",
                             "draft_vocab_coverage")},
                         "seconds": time.perf_counter() - t0})
            print(f"[{name} T={temp:g}] S_theory {rows[-1]['overall']['theoretical_speedup']:.2f}",
                  file=sys.stderr)

    names = list(sets)
    head = ("| drafter | n | L_s | features | steps | held-out top-1 | T |"
            + "".join(f" {d} S_theory |" for d in names) + " overall S_theory | alpha | acceptance |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        top1 = "-" if r["held_out_top1"] is None else f"{r['held_out_top1']:.3f}"
        lines.append(f"| {r['name']} | {r['n']} | {r['pdm_layers']} | {r['features']} | "
                     f"{r['steps']} | {top1} | {r['temperature']:g} |"
                     + "".join(f" {r['datasets'][d]['theoretical_speedup']:.2f} |" for d in names)
                     + f" {r['overall']['theoretical_speedup']:.2f} | {r['overall']['alpha']:.3f}"
                     f" | {r['overall']['acceptance_rate']:.2f} |")
    table = "\n".join(lines)
    print(table)
    if args.json_out:
        write_json(args.json_out, run_meta("cpu", limit=args.limit,
                                           max_new_tokens=args.max_new_tokens),
                   rows=rows, table=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
