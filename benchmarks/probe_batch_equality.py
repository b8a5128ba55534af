"""Held-out prompts decoded batched against each alone, on the default model (issue 54): how
often a batched sequence's token differs from AR's (greedy) and why it could (docs/batching.md,
"Exactness": the CPU's products over B rows are not batch-invariant).

Per configuration (n, tree width W, mode): the prompts together (`generate` on a list, one
process; spd: each with its own speculation; dist: SPD on n + 1 local ranks, the distributed
batch; distpipe: the pipeline without speculation on the same ranks), up to `--max-batch` at
once (fewer than the prompts: later ones join as earlier ones leave), each compared with its
AR decode alone: sequences equal, and tokens equal up to the first difference.

    python benchmarks/probe_batch_equality.py --prompts 8 --max-new-tokens 32 \
        --json-out benchmarks/results/2026-12-06-batch-equality-cpu.json
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from harness import Table, run_meta, write_json

from spd import SPDEngine
from spd.data.datasets import load_dataset
from spd.distributed.config import DistConfig
from spd.distributed.launch import launch_local
from spd.model.loading import load_target


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ranks_job(engine, prompts, max_new_tokens: int, max_batch: int,
               mode: str) -> list[list[int]]:
    """Rank 0 of a local launch: the prompts through a batch session of `mode`."""
    return [r.token_ids for r in engine.generate_batch(prompts, max_new_tokens,
                                                       max_batch=max_batch, mode=mode)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--configs", default="spd:4:1,spd:4:3,spd:2:1,pipeline:4:1,ar:1:1",
                    help="mode:n:W, comma-separated (mode: spd, dist, distpipe, pipeline or ar)")
    ap.add_argument("--max-batch", type=int, default=None,
                    help="sequences at once (default: every prompt)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target()
    qs = load_dataset("heldout")[:args.prompts]
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in qs]
    plain = SPDEngine(target, n_stages=1)
    ar = [plain.generate_ar(p, args.max_new_tokens).token_ids for p in prompts]
    table = Table([("mode", ">9"), ("n", ">3"), ("W", ">3"), ("prompts", ">8"),
                   ("max_batch", ">6", "batch"),
                   ("equal", ">6"), ("tokens_equal", ">13", "tokens equal"), ("tokens", ">7"),
                   ("seconds", ">8.1f", "s")])
    table.print_header()
    rows = []
    max_batch = args.max_batch or len(prompts)
    for spec in args.configs.split(","):
        mode, n, W = spec.split(":")
        n, W = int(n), int(W)
        t0 = time.perf_counter()
        if mode in ("dist", "distpipe"):
            got = launch_local(DistConfig(n_stages=n, tree_width=W, threads=1),
                               partial(_ranks_job, prompts=prompts,
                                       max_new_tokens=args.max_new_tokens, max_batch=max_batch,
                                       mode="spd" if mode == "dist" else "pipeline"))
        else:
            eng = SPDEngine(target, n_stages=max(n, 1), tree_width=W)
            run = {"spd": eng.generate, "ar": eng.generate_ar,
                   "pipeline": eng.generate_pipeline}[mode]
            got = [r.token_ids for r in run(prompts, args.max_new_tokens, max_batch=max_batch)]
        secs = time.perf_counter() - t0
        same = sum(g == a for g, a in zip(got, ar))
        upto = sum(first_difference(g, a) for g, a in zip(got, ar))
        row = dict(mode=mode, n=n, W=W, prompts=len(prompts), max_batch=max_batch, equal=same,
                   tokens_equal=upto, tokens=sum(len(a) for a in ar), seconds=secs)
        rows.append(row)
        table.print(row)
    if args.json_out:
        write_json(args.json_out, run_meta(prompts="heldout", max_new_tokens=args.max_new_tokens),
                   rows=rows)


if __name__ == "__main__":
    main()
