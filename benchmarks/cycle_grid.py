"""The one cycle on the default model, a grid of n and W: every decode against AR and against
the reference decoder (tests/reference_decoder.py: README's steps with host branches), in one
process and across ranks, every rank under SPD_REPLAY_CHECK. Not a timing: a check (CPU).

A cell (n, W, where the stages run) passes when every greedy decode equals AR token for token,
and every decode, greedy and seeded sampling, equals the reference decoder's in tokens, N, K,
judged and accepted drafts by draft position, stage rows and the lookup's counts. The engine is
the default one (`SPDEngine(target, n_stages=n, tree_width=W)`: the shipped PDM for n where
there is one, else an untrained one, and the context lookup); the prompts are the held-out
set's first ones (spd.data.datasets "heldout", first turn in the chat template). Prints a row
per cell and writes JSON after each one (a long grid keeps what it finished).

    python benchmarks/cycle_grid.py --n 2,3,4,8 --widths 1,2,4 --prompts 2 \\
        --json-out benchmarks/results/<date>-cycle-grid-cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path

from harness import RESULTS, Table, run_meta, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_decoder import ReferenceDecoder  # noqa: E402

from spd import env  # noqa: E402
from spd.data.datasets import load_dataset  # noqa: E402
from spd.distributed.config import DistConfig, GenerateRequest  # noqa: E402
from spd.distributed.launch import launch_local  # noqa: E402
from spd.distributed.rank import run_requests  # noqa: E402
from spd.model.loading import load_target  # noqa: E402
from spd.model.prompt import encode_prompt  # noqa: E402
from spd.runtime.engine import SPDEngine  # noqa: E402
from spd.runtime.types import SamplingParams  # noqa: E402

SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=5)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def counts(tokens, s) -> dict:
    return {"tokens": list(tokens), "N": s.N, "K": s.K, "judged": s.drafts_judged,
            "accepted": s.drafts_accepted, "stage_rows": s.stage_rows,
            "by_position": {str(k): v for k, v in sorted(s.by_position.items())},
            "lookup": [s.lookup_judged, s.lookup_accepted]}


def decode(place: str, target, n: int, width: int, requests) -> list:
    """The results of `requests` with the stages in this process, or on n + 1 ranks."""
    if place == "process":
        eng = SPDEngine(target, n_stages=n, tree_width=width, warn_untrained=False)
        return [eng.generate(r.prompt_ids, r.max_new_tokens, r.sampling) for r in requests]
    config = DistConfig(n_stages=n, tree_width=width, fault_timeout=30.0, op_timeout=600.0)
    return launch_local(config, partial(run_requests, requests), timeout=3600)


def run_cell(target, n: int, width: int, place: str, prompts, ar, new: int) -> dict:
    requests = [GenerateRequest(p, new) for p in prompts] + \
        [GenerateRequest(p, new, SAMPLED) for p in prompts]
    os.environ[env.REPLAY_CHECK.name] = "1"  # (the ranks take it too)
    try:
        got = [counts(r.token_ids, r.stats) for r in decode(place, target, n, width, requests)]
    finally:
        del os.environ[env.REPLAY_CHECK.name]
    oracle = ReferenceDecoder(SPDEngine(target, n_stages=n, tree_width=width,
                                        warn_untrained=False))
    rows = []
    for i, (req, g) in enumerate(zip(requests, got)):
        want = counts(*oracle.generate(req.prompt_ids, new, req.sampling))
        greedy = req.sampling.greedy
        rows.append({"prompt": i % len(prompts), "sampled": not greedy, **g,
                     "equals_reference": g == want,
                     "equals_ar": g["tokens"] == ar[i % len(prompts)] if greedy else None})
    ok = all(r["equals_reference"] and r["equals_ar"] is not False for r in rows)
    N, K = sum(r["N"] for r in rows), sum(r["K"] for r in rows)
    return {"n": n, "width": width, "place": place, "ok": ok, "alpha": N / K,
            "accepted": sum(r["accepted"] for r in rows) / sum(r["judged"] for r in rows),
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=ints, default=[2, 3, 4, 8])
    ap.add_argument("--widths", type=ints, default=[1, 2, 4])
    ap.add_argument("--places", default="process,ranks",
                    help="where the stages run: process (one), ranks (n + 1 processes)")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per cell")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json-out", default=None,
                    help=f"JSON file (default {RESULTS}/<date>-cycle-grid-cpu.json)")
    args = ap.parse_args()
    target = load_target(None)
    prompts = [encode_prompt(target.tokenizer, q["turns"][0], True)
               for q in load_dataset("heldout")[:args.prompts]]
    ar_engine = SPDEngine(target, n_stages=1)
    ar = [ar_engine.generate_ar(p, args.max_new_tokens).token_ids for p in prompts]
    meta = run_meta("cpu", max_new_tokens=args.max_new_tokens,
                    prompts=f"heldout[:{args.prompts}]",
                    sampled={"temperature": SAMPLED.temperature, "top_p": SAMPLED.top_p,
                             "seed": SAMPLED.seed})
    path = args.json_out or RESULTS / f"{meta['date']}-cycle-grid-cpu.json"
    table = Table([("n", ">3"), ("width", ">6", "W"), ("place", ">9"), ("ok", ">6"),
                   ("alpha", ">7.3f"), ("accepted", ">9.3f"), ("seconds", ">9.1f")])
    table.print_header()
    cells = []
    for n in args.n:
        for w in args.widths:
            for place in args.places.split(","):
                t0 = time.perf_counter()
                cell = run_cell(target, n, w, place, prompts, ar, args.max_new_tokens)
                cell["seconds"] = time.perf_counter() - t0
                cells.append(cell)
                table.print({**cell, "ok": str(cell["ok"])})
                write_json(path, meta, all_ok=all(c["ok"] for c in cells), cells=cells)
    print("every cell equals AR and the reference decoder" if all(c["ok"] for c in cells)
          else "SOME CELLS DIFFER")
    sys.exit(0 if all(c["ok"] for c in cells) else 1)


if __name__ == "__main__":
    main()
