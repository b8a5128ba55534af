"""Distributed runtime benchmark: per-cycle breakdown of n stage ranks + rank 0 (local ranks).

For each n, one local launch (gloo on 127.0.0.1, one process per rank) runs every prompt with the
reference ("oracle") drafter, which proposes the target's own next token (steady state: every
cycle full and accepted), and with the untrained PDM (rejections and refills). Outputs are checked
against autoregressive decoding of the same target. Reported per cycle (ms), from each run's
breakdown (spd.distributed.stats): the cycle on rank 0 (the interval between its host's reads of
consecutive cycles' published state: spd.runtime.cycle), each stage rank's median stage step,
and the overhead = cycle - the slowest stage's median step: messages, the judgement, the
bookkeeping, i.e. the fixed cost n devices could not hide. K-weighted over prompts.

    python benchmarks/bench_distributed.py --stages 2,3 --max-new-tokens 48 --json-out out.json

On a CPU machine with fewer cores than ranks the stage steps and the draft compete for cores,
so cycle times there are an upper bound of what separate devices would see; the overhead column
is the number this benchmark is for.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

import torch
from harness import Table, run_meta, write_json

from spd import SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.model.loading import load_target
from spd.model.prompt import encode_prompt

PROMPTS = [
    "Explain in detail how a CPU cache works.",
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for writing clear Python code, with examples.",
]


def tiny_model_dir() -> str:
    """A random 4-layer, hidden-64 Llama with the default model's tokenizer (built once in
    $SPD_CACHE): its stage forwards take well under a millisecond, so a cycle is almost all
    communication and control."""
    from spd.model.loading import cache_dir, save_tiny_random_llama

    folder = cache_dir() / "models" / "tiny-random-llama"
    if not (folder / "config.json").exists():
        save_tiny_random_llama(folder)
    return str(folder)


def weighted(results, key_fn):
    total_k = sum(r.stats.K for r in results)
    return sum(key_fn(r) * r.stats.K for r in results) / total_k if total_k else 0.0


def summarise(results) -> dict:
    d0 = results[0].stats.distributed
    n_ranks = d0["world_size"]
    out = {
        "N": sum(r.stats.N for r in results), "K": sum(r.stats.K for r in results),
        "decode_s": sum(r.stats.decode_s for r in results),
        "cycle_ms": weighted(results, lambda r: r.stats.distributed["cycle_ms"]["mean"]),
        "cycle_ms_median": weighted(results, lambda r: r.stats.distributed["cycle_ms"]["median"]),
        "overhead_ms": weighted(results, lambda r: r.stats.distributed["overhead_ms"]["mean"]),
        "overhead_ms_median": weighted(
            results, lambda r: r.stats.distributed["overhead_ms"]["median"]),
        "stage_forward_ms": [weighted(results, lambda r, i=i: r.stats.distributed["ranks"][i]
                                      ["forward_ms"]["median"]) for i in range(1, n_ranks)],
        "rank_phase_ms_per_cycle": {},
    }
    for i in range(n_ranks):
        phases = {}
        for r in results:
            for k, v in r.stats.distributed["ranks"][i]["phase_ms_per_cycle"].items():
                phases[k] = phases.get(k, 0.0) + v * r.stats.K
        out["rank_phase_ms_per_cycle"][f"rank{i}"] = {k: v / out["K"] for k, v in phases.items()}
    out["alpha"] = out["N"] / out["K"]
    out["decode_tok_s"] = out["N"] / out["decode_s"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="local HF folder; default SmolLM2-135M-Instruct; 'tiny' = a random "
                         "4-layer Llama (measures the fixed per-cycle overhead)")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the autoregressive baseline and of each rank (default 1:"
                         " on a small CPU machine more threads than cores slow everything down)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        args.model = tiny_model_dir()

    target = load_target(args.model)
    prompts = PROMPTS[:args.limit]
    ids_list = [encode_prompt(target.tokenizer, p, True) for p in prompts]
    m = args.max_new_tokens
    base = SPDEngine(target, n_stages=1)
    ar_tok, ar_s, refs = 0, 0.0, []
    for ids in ids_list:
        r = base.generate_ar(ids, m)
        refs.append(r.token_ids)
        ar_tok += r.stats.N
        ar_s += r.stats.decode_s
    ar_tok_s = ar_tok / ar_s
    rows = []
    for n in [int(x) for x in args.stages.split(",")]:
        warm = [GenerateRequest(ids_list[0], 8)]
        oracle = [GenerateRequest(ids, m, reference=ids + ref) for ids, ref in zip(ids_list, refs)]
        untrained = [GenerateRequest(ids, m) for ids in ids_list]
        config = DistConfig(n_stages=n, model=args.model, fault_timeout=30.0,
                            threads=args.threads)
        t0 = time.perf_counter()
        res = launch_local(config, partial(run_requests, warm + oracle + untrained), timeout=1800)
        wall = time.perf_counter() - t0
        res = res[1:]
        for name, part in (("oracle", res[:len(ids_list)]), ("untrained-pdm", res[len(ids_list):])):
            assert [r.token_ids for r in part] == refs, f"n={n} {name}: output differs from AR"
            rows.append(dict(method=name, n=n, **summarise(part)))
        print(f"n={n}: launch + {2 * len(ids_list) + 1} generations took {wall:.1f} s",
              file=sys.stderr)

    print(f"\nDistributed runtime on CPU (gloo, 127.0.0.1), {target.name}, {len(ids_list)} prompts x "
          f"{m} new tokens, {os.cpu_count()} cores, {args.threads} thread(s) per process; "
          f"single-process AR: {ar_tok_s:.1f} tok/s")
    table = Table([("method", "<15", "drafter"), ("n", ">3"), ("N", ">5"), ("K", ">5"),
                   ("alpha", ">7.3f"), ("decode_tok_s", ">7.1f", "tok/s"),
                   ("cycle_ms", ">8.2f", "cycle"), ("stages", ">18", "stage steps"),
                   ("overhead_ms", ">10.2f", "overhead"), ("overhead_ms_median", ">9.2f",
                                                           "(median)")])
    table.print_header()
    for r in rows:
        table.print(dict(r, stages="/".join(f"{x:.1f}" for x in r["stage_forward_ms"])))
    print("(ms per cycle; stage steps: each stage rank's median; overhead = cycle - the slowest "
          "stage's median step)")
    print("\nEach rank's phases (ms per cycle):")
    for r in rows:
        for rank, ph in r["rank_phase_ms_per_cycle"].items():
            if not ph:
                continue
            parts = "  ".join(f"{k}={v:.2f}" for k, v in sorted(ph.items()))
            print(f"  {r['method']:<14} n={r['n']} {rank}: {parts}")
    if args.json_out:
        write_json(args.json_out, run_meta("cpu", rank_threads=args.threads, model=target.name,
                                           prompts=prompts, max_new_tokens=m, ar_tok_s=ar_tok_s),
                   rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
