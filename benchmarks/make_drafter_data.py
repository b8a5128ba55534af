"""Build the training data of the shipped SmolLM2 drafters: ShareGPT prompts the earlier
drafters never saw, answered by the target itself (self-distillation), as an OpenAI-messages JSONL
that `spd train --data` reads.

The earlier shipped drafters (v1-v7) took their prompts from the first 3,984 conversations of
ShareGPT shuffled with seed 0 (evaluation prompts removed first; docs/results.md). This script
takes conversations [--start, --start + --count) of that same order, drops the held-out share
(`spd.data.conversations.in_holdout`, the split `spd train --holdout` uses) and writes
`prompts.jsonl` (the conversations as they are) and `answers.jsonl` (system and first user turn,
then the target's greedy answer; rerunning resumes). Prompts are answered shortest first (a
batch pads to its longest prompt), and those over --max-prompt tokens are passed over.

`--split holdout` takes the held-out conversations of that range instead: a run's held-out
evaluation reads them (spd train never trains on them). `--code-roots DIR...` takes code-completion
prompts made from the documented functions of those package folders
(spd.data.datasets.python_function_prompts; HumanEval's names excluded) instead of ShareGPT,
shuffled with seed 0, [--start, --start + --count) of them.

    python benchmarks/make_drafter_data.py --out data/smollm2-r1 --start 4000 --count 3000
    python benchmarks/make_drafter_data.py --out data/smollm2-r1-holdout --start 4000 \
        --count 7200 --split holdout
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from spd.data.conversations import in_holdout
from spd.data.datasets import (
    contains_eval_prompt,
    eval_prompt_keys,
    humaneval_function_names,
    iter_sharegpt,
    python_function_prompts,
)
from spd.model.loading import load_target
from spd.train.regenerate import prompt_ids, prompt_of, regenerate


def shuffled_sharegpt(seed: int = 0) -> list[list[dict]]:
    """ShareGPT without evaluation prompts, shuffled as spd train's cached path shuffles it
    (the order comes from MT-Bench's and HumanEval's exclusion alone; the held-out set's prompts
    are dropped after the shuffle, as in spd.train.distill.build_sequences)."""
    keys = eval_prompt_keys(("mt_bench", "humaneval"))
    convs = [c for c in iter_sharegpt() if not contains_eval_prompt(c, keys)]
    random.Random(seed).shuffle(convs)
    held = eval_prompt_keys(("heldout",))
    return [c if not contains_eval_prompt(c, held) else None for c in convs]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--start", type=int, default=4000)
    p.add_argument("--count", type=int, default=3000)
    p.add_argument("--holdout", type=float, default=0.02)
    p.add_argument("--response-tokens", type=int, default=192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--split", choices=("train", "holdout"), default="train")
    p.add_argument("--code-roots", nargs="+", default=None, metavar="DIR")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.code_roots:
        names = humaneval_function_names()
        pool = [p for root in args.code_roots for p in python_function_prompts(root, names)]
        random.Random(0).shuffle(pool)
        pool = [[{"role": "user", "content": p}] for p in pool]
    else:
        pool = shuffled_sharegpt()
    held = args.split == "holdout"
    convs = [c for c in pool[args.start:args.start + args.count]
             if c is not None and in_holdout(c, args.holdout) == held]
    with open(out / "prompts.jsonl", "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")
    target = load_target(None, dtype=getattr(torch, args.dtype))
    size = [len(prompt_ids(target.tokenizer, prompt_of(c))) for c in convs]
    by_length = [convs[i] for i in sorted(range(len(convs)), key=lambda i: (size[i], i))]
    t0 = time.perf_counter()
    n = regenerate(target, by_length, out / "answers.jsonl", max_new_tokens=args.response_tokens,
                   max_prompt=args.max_prompt, batch_size=args.batch)
    (out / "made.json").write_text(json.dumps(
        {"start": args.start, "count": args.count, "split": args.split,
         "code_roots": args.code_roots, "kept": len(convs), "answered_now": n,
         "seconds_now": round(time.perf_counter() - t0, 1), "dtype": args.dtype,
         "response_tokens": args.response_tokens, "holdout": args.holdout}, indent=1))
    print(f"{len(convs)} prompts, {n} answered now, in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
