"""Distributed tree decoding against the single-process engine and against AR on the default
model: a grid of (n, W), a few prompts each, greedy and seeded sampling. Prints a table (one
row per cell) and writes JSON. Not a timing: a losslessness and agreement check (CPU).

    python benchmarks/tree_grid.py --n 2,3,4,8 --width 2,3,4,8 --prompts 3 \
        --out benchmarks/results/2026-12-04-tree-grid-cpu.json

A cell passes when every greedy decode equals AR token for token and the distributed decode
equals the single-process one in tokens, N, K and judged / accepted drafts (greedy and
sampled). The prompts are the held-out set's first ones (spd.data.datasets, "heldout")."""
from __future__ import annotations

import argparse
import json
import time
from functools import partial

from spd.data.datasets import load_dataset
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.model.loading import load_target
from spd.model.prompt import encode_prompt
from spd.runtime.engine import SPDEngine
from spd.runtime.types import SamplingParams

SAMPLED = SamplingParams(temperature=0.8, seed=5)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def summary(result) -> dict:
    s = result.stats
    return {"tokens": result.token_ids, "N": s.N, "K": s.K, "judged": s.drafts_judged,
            "accepted": s.drafts_accepted}


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_cell(target, n: int, width: int, prompts: list[list[int]], ar: list[list[int]],
             new: int, on_stage: int | None) -> dict:
    eng = SPDEngine(target, n_stages=n, tree_width=width)
    requests = [GenerateRequest(p, new) for p in prompts] + [GenerateRequest(prompts[0], new,
                                                                               SAMPLED)]
    one = [summary(eng.generate(r.prompt_ids, r.max_new_tokens, r.sampling)) for r in requests]
    config = DistConfig(n_stages=n, tree_width=width, draft_on_stage=on_stage)
    dist = [summary(r) for r in launch_local(config, partial(run_requests, requests))]
    rows = []
    for i, (o, d) in enumerate(zip(one, dist)):
        greedy = i < len(prompts)
        rows.append({
            "prompt": i if greedy else 0, "sampled": not greedy,
            "one_process": {k: v for k, v in o.items() if k != "tokens"},
            "distributed": {k: v for k, v in d.items() if k != "tokens"},
            "dist_vs_one_first_difference": first_difference(d["tokens"], o["tokens"]),
            "dist_vs_ar_first_difference": (first_difference(d["tokens"], ar[i])
                                            if greedy else None),
            "one_vs_ar_first_difference": (first_difference(o["tokens"], ar[i])
                                           if greedy else None),
            "stats_equal": {k: v for k, v in o.items() if k != "tokens"}
            == {k: v for k, v in d.items() if k != "tokens"},
        })
    ok = all(r["dist_vs_one_first_difference"] is None and r["stats_equal"]
             and r["dist_vs_ar_first_difference"] is None and r["one_vs_ar_first_difference"]
             is None for r in rows)
    return {"n": n, "width": width, "draft_on_stage": on_stage, "ok": ok, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=ints, default=[2, 3, 4, 8])
    ap.add_argument("--width", type=ints, default=[2, 3, 4, 8])
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts per cell")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-on-stage", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args()
    target = load_target(None)
    prompts = [encode_prompt(target.tokenizer, q["turns"][0], True)
               for q in load_dataset("heldout")[:args.prompts]]
    ar_engine = SPDEngine(target, n_stages=1)
    ar = [ar_engine.generate_ar(p, args.max_new_tokens).token_ids for p in prompts]
    cells = []
    print(f"{'n':>2} {'W':>2}  {'ok':<5} per decode (greedy prompts, then sampled): "
          "first token differing dist/one, N/K one -> dist")
    for n in args.n:
        for w in args.width:
            t0 = time.perf_counter()
            cell = run_cell(target, n, w, prompts, ar, args.max_new_tokens, args.draft_on_stage)
            cell["seconds"] = round(time.perf_counter() - t0, 1)
            cells.append(cell)
            desc = "  ".join(
                f"{r['dist_vs_one_first_difference']}:{r['one_process']['N']}/"
                f"{r['one_process']['K']}->{r['distributed']['N']}/{r['distributed']['K']}"
                for r in cell["rows"])
            print(f"{n:>2} {w:>2}  {str(cell['ok']):<5} {desc}", flush=True)
            out = {"what": "distributed tree decoding vs one process vs AR, default model",
                   "device": "CPU", "max_new_tokens": args.max_new_tokens,
                   "prompts": f"heldout[:{args.prompts}]", "draft_on_stage": args.draft_on_stage,
                   "sampled": {"temperature": SAMPLED.temperature, "seed": SAMPLED.seed},
                   "cells": cells, "all_ok": all(c["ok"] for c in cells)}
            if args.out:  # after every cell: a long grid's finished cells are kept
                with open(args.out, "w") as f:
                    json.dump(out, f, indent=1)
    print("all cells ok" if out["all_ok"] else "SOME CELLS DIFFER")


if __name__ == "__main__":
    main()
