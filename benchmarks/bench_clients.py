"""Several clients at once, in one engine: what each decode path gives them (issue 54).

C clients each send one request at t = 0 (held-out prompts, chat template, greedy); the engine
serves them as each path can, and every token's time is taken from its callback. Per client
count and path: total tokens/s, per-request tokens/s (its tokens over its time from t = 0 to its
last token), time to first token (TTFT, from t = 0: waiting included) and time between tokens
(TBT, p50 and p99 over all requests' gaps).

  spd          the SPD decode, one request at a time
  spd-batched  SPD with all C requests in the pipeline at once, each with its own speculation
               (`generate` on a list: spd.runtime.batch_spd)
  ar           autoregressive, one request at a time
  ar-batched   autoregressive with continuous batching, all C at once (`generate_ar` on a list)
  pipeline-batched
               the pipeline without speculation on the same n stages, all C at once, one token
               per request per trip through the stages (`generate_pipeline` on a list:
               spd.runtime.batch_pipeline)

In one process the stages run one after another (SPD's and the pipeline's n stages share this
machine: their figures here are not what n devices give), and the server's HTTP layer is left
out (benchmarks/bench_serve.py --clients measures through it).

    python benchmarks/bench_clients.py --clients 1,2,4,8,16 --json-out out.json
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import Table, percentile, run_meta, write_json

from spd import SPDEngine
from spd.data.datasets import load_dataset
from spd.model.loading import load_target

PATHS = ("spd", "spd-batched", "ar", "ar-batched", "pipeline-batched")


def serve(engine: SPDEngine, path: str, prompts: list, max_new: int) -> dict:
    """Every prompt's token times (s from t = 0) when `path` serves them all from t = 0."""
    times: list[list[float]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    if path.endswith("-batched"):
        run = {"spd-batched": engine.generate, "ar-batched": engine.generate_ar,
               "pipeline-batched": engine.generate_pipeline}[path]
        run(prompts, max_new, max_batch=len(prompts),
            on_token=lambda i, _tok: times[i].append(time.perf_counter() - t0))
    else:
        run = engine.generate if path == "spd" else engine.generate_ar
        for i, p in enumerate(prompts):
            run(p, max_new, on_token=lambda _tok, i=i: times[i].append(time.perf_counter() - t0))
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    return dict(total_tok_s=tokens / wall, wall_s=wall, tokens=tokens,
                per_request_tok_s=statistics.median(len(t) / t[-1] for t in times),
                ttft_p50_s=percentile([t[0] for t in times], 0.5),
                ttft_max_s=max(t[0] for t in times),
                tbt_p50_ms=1e3 * percentile(gaps, 0.5) if gaps else 0.0,
                tbt_p99_ms=1e3 * percentile(gaps, 0.99) if gaps else 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--tree-width", type=int, default=1,
                    help="token trees of this width for the SPD paths (1: chains)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    paths = args.paths.split(",")
    if any(c < 1 for c in clients) or any(p not in PATHS for p in paths):
        ap.error(f"--clients: positive integers; --paths: some of {', '.join(PATHS)}")

    target = load_target()
    engine = SPDEngine(target, n_stages=args.stages, tree_width=args.tree_width)
    questions = load_dataset("heldout")
    prompts = [[{"role": "user", "content": q["turns"][0]}] for q in questions]
    if max(clients) > len(prompts):
        ap.error(f"at most {len(prompts)} clients (the held-out prompts)")
    engine.generate(prompts[0], 4)  # warm-up
    table = Table([("clients", ">7"), ("path", ">17"), ("total_tok_s", ">9.2f", "tok/s"),
                   ("per_request_tok_s", ">9.2f", "req tok/s"), ("ttft_p50_s", ">9.2f", "TTFT p50"),
                   ("ttft_max_s", ">9.2f", "TTFT max"), ("tbt_p50_ms", ">9.1f", "TBT p50"),
                   ("tbt_p99_ms", ">9.1f", "TBT p99")])
    table.print_header()
    rows = []
    for c in clients:
        for path in paths:
            row = dict(clients=c, path=path, **serve(engine, path, prompts[:c],
                                                     args.max_new_tokens))
            rows.append(row)
            table.print(row)
    if args.json_out:
        write_json(args.json_out, run_meta(target.device, model=target.name, n=args.stages,
                                           max_new_tokens=args.max_new_tokens,
                                           tree_width=args.tree_width,
                                           prompts="heldout"), rows=rows)


if __name__ == "__main__":
    main()
