"""Single-process engine benchmark on the default model (or --model).

For each weight dtype and n: SPD with the reference ("oracle") drafter, which proposes the
target's own next token (the fill-limited ceiling of alpha), and with the engine's PDM (the one
shipped for the target and n, else an untrained one: the floor). Beside them the autoregressive
path on the same stages (`--mode ar`) and Hugging Face `generate` of the same weights, all timed
in this one run, so the ratios are comparable even on a noisy machine. In one process the stages
run one after another: SPD's tok/s here is not what n devices give (S_theory is). Prints a table
and writes JSON.

    python benchmarks/bench_core.py --stages 2,4 --dtypes float32,bfloat16 --json-out out.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from harness import Table, run_meta, write_json

from spd import SPDEngine
from spd.draft.drafters import ReferenceDrafter
from spd.model.loading import describe_device, load_target
from spd.model.prompt import encode_prompt
from spd.runtime import metrics

PROMPTS = [
    "Explain in detail how a CPU cache works.",
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for writing clear Python code, with examples.",
]


def load_prompts(path: str | None, limit: int) -> list[str]:
    if path is None:
        return PROMPTS[:limit]
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                out.append(json.loads(line)["turns"][0])
    return out[:limit]


def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def run_method(fn, prompts_ids):
    """Run fn(ids) -> GenerationResult over all prompts; aggregate N, K, times, phases."""
    agg = {"N": 0, "K": 0, "judged": 0, "accepted": 0, "decode_s": 0.0, "phase_s": {}}
    for ids in prompts_ids:
        r = fn(ids)
        st = r.stats
        agg["N"] += st.N
        agg["K"] += st.K
        agg["judged"] += st.drafts_judged
        agg["accepted"] += st.drafts_accepted
        agg["decode_s"] += st.decode_s
        for k, v in st.as_dict()["phase_s"].items():
            agg["phase_s"][k] = agg["phase_s"].get(k, 0.0) + v
        agg.setdefault("outputs", []).append(r.token_ids)
    return agg


def bench_dtype(target, dtype: str, prompts: list[str], m: int, stages: list[int]) -> list[dict]:
    """Rows for one loaded target: HF generate, AR on the same stages, SPD per n and drafter;
    every SPD output is checked against AR's, and HF's agreement with AR is recorded."""
    ids_list = [encode_prompt(target.tokenizer, p, True) for p in prompts]
    base = SPDEngine(target, n_stages=1)
    ar = run_method(lambda ids: base.generate_ar(ids, m), ids_list)
    refs = ar["outputs"]

    hf_tokens, hf_s, hf_same = 0, 0.0, 0
    for ids, ref in zip(ids_list, refs):  # HF generate: time for M tokens minus a prefill-only call
        x = torch.tensor([ids])
        with torch.no_grad():
            t0 = time.perf_counter()
            out = target.hf.generate(x, max_new_tokens=m, do_sample=False)
            t1 = time.perf_counter()
            target.hf.generate(x, max_new_tokens=1, do_sample=False)
            t2 = time.perf_counter()
        hf_tokens += out.shape[1] - len(ids) - 1
        hf_s += (t1 - t0) - (t2 - t1)
        hf_same += out[0, len(ids):].tolist() == ref
    hf_tok_s = metrics.tokens_per_s(hf_tokens, hf_s)
    ar_tok_s = metrics.tokens_per_s(ar["N"], ar["decode_s"])
    rows = [dict(method="hf-generate", n=1, decode_tok_s=hf_tok_s,
                 same_tokens_as_ar=f"{hf_same}/{len(ids_list)}"),
            dict(method="ar (same stages)", n=1, N=ar["N"], K=ar["K"], alpha=1.0,
                 theoretical_speedup=1.0, decode_tok_s=ar_tok_s, phase_s=ar["phase_s"])]

    for n in stages:
        eng = SPDEngine(target, n_stages=n, warn_untrained=False)
        pdm = "spd+untrained-pdm" if eng.pdm_source == "untrained" else "spd+shipped-pdm"
        drafters = {
            "spd+oracle": lambda ids, i: ReferenceDrafter(ids + refs[i]),
            pdm: lambda ids, i: None,
        }
        for name, make in drafters.items():
            counter = iter(range(len(ids_list)))
            agg = run_method(lambda ids: eng.generate(ids, m, drafter=make(ids, next(counter))),
                             ids_list)
            assert agg["outputs"] == refs, f"{name} n={n}: output differs from autoregressive"
            rows.append(dict(method=name, n=n, N=agg["N"], K=agg["K"],
                             alpha=metrics.alpha(agg["N"], agg["K"]),
                             theoretical_speedup=metrics.theoretical_speedup(agg["N"], agg["K"], n),
                             acceptance_rate=metrics.rate(agg["accepted"], agg["judged"]),
                             decode_tok_s=metrics.tokens_per_s(agg["N"], agg["decode_s"]),
                             cycle_ms=1000 * agg["decode_s"] / agg["K"],
                             phase_s=agg["phase_s"]))
    for r in rows:
        r.update(dtype=dtype, vs_ar=r["decode_tok_s"] / ar_tok_s,
                 vs_hf=r["decode_tok_s"] / hf_tok_s)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--stages", default="2,4,6")
    ap.add_argument("--dtypes", default="float32",
                    help="weight dtypes, e.g. float32,bfloat16 (spd.model.loading.resolve_dtype)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=None, help="FastChat question .jsonl (first turn used)")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = load_prompts(args.prompts, args.limit)
    m = args.max_new_tokens
    rows, target = [], None
    for dtype in args.dtypes.split(","):
        torch.manual_seed(0)
        target = load_target(args.model, dtype=dtype)
        rows += bench_dtype(target, dtype, prompts, m, [int(x) for x in args.stages.split(",")])
    print(f"\nSingle-process engine, {target.name}, {len(prompts)} prompts x {m} new tokens, "
          + describe_device("cpu") + "; one process: the stages run one after another, so SPD's "
          "tok/s is not what n devices give (S_theory is)")
    table = Table([("dtype", "<9"), ("method", "<20"), ("n", ">3"), ("N", ">6"), ("K", ">6"),
                   ("alpha", ">8.3f"),
                   ("theoretical_speedup", ">10.2f", "S_theory"), ("decode_tok_s", ">8.1f", "tok/s"),
                   ("vs_ar", ">7.2f", "vs AR"), ("vs_hf", ">7.2f", "vs HF"),
                   ("cycle_ms", ">10.2f", "cycle ms")])
    table.print_header()
    for r in rows:
        table.print(r)
    print("\nWhere a cycle's time goes (ms per cycle):")
    for r in rows:
        if "phase_s" in r and r["method"].startswith("spd"):
            parts = "  ".join(f"{k}={1000 * v / r['K']:.2f}" for k, v in sorted(r["phase_s"].items()))
            print(f"  {r['dtype']:<9} {r['method']:<20} n={r['n']}: {parts}")
    if args.json_out:
        write_json(args.json_out, run_meta("cpu", model=target.name, prompts=prompts,
                                           max_new_tokens=m, dtypes=args.dtypes), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
