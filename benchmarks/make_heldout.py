"""Write the project's held-out prompt set, python/spd/data/heldout.jsonl (`spd eval --dataset
heldout`): prompts no drafter trained on and no recipe or gate was tuned on.

- chat (12), code (4 of the 12) and one multilingual prompt: first turns of ShareGPT
  conversations that lie in the held-out split by hash (`in_holdout(c, 0.02)`, which `spd train
  --holdout` never trains on) and past the first 4,000 of ShareGPT shuffled with seed 0 (the
  prompts the shipped v1-v7 drafters took their data from), picked by reading for standalone
  questions before any model ran on them;
- code (8), math (8) and multilingual (3): written for this set (2026-12-04).

Every evaluation prompt is excluded from training data (`spd.data.datasets.eval_prompt_keys`).
Rerunning this script rewrites the same file.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from spd.data.conversations import in_holdout
from spd.data.datasets import contains_eval_prompt, eval_prompt_keys, iter_sharegpt

OUT = Path(__file__).resolve().parents[1] / "python" / "spd" / "data" / "heldout.jsonl"

# positions in ShareGPT (evaluation prompts removed, shuffled with seed 0)
CHAT = (4014, 4182, 4398, 5135, 5341, 5613, 5701, 5714, 6104, 7547, 7718, 7971)
CODE_CHAT = (6477, 6690, 7119, 7292)
MULTILINGUAL_CHAT = (7761,)


def _function(head: str) -> str:
    return ("Complete the following Python function. Reply with the code only.\n\n```python\n"
            f"{head}```")


CODE = [
    _function('def running_median(values: list[float]) -> list[float]:\n'
              '    """Return the median of values[:i + 1] for every i, in order."""\n'),
    _function('def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n'
              '    """Merge overlapping closed intervals; return them sorted by their start."""\n'),
    _function('def is_balanced(text: str) -> bool:\n'
              '    """True if every (, [ and { in text is closed, in the right order."""\n'),
    _function('def top_words(text: str, top: int) -> list[tuple[str, int]]:\n'
              '    """The `top` most common lowercase words of text with their counts, most\n'
              '    common first, ties in alphabetical order."""\n'),
    _function('def rotate_clockwise(m: list[list[int]]) -> list[list[int]]:\n'
              '    """Return the square matrix m rotated 90 degrees clockwise."""\n'),
    _function('def roman_to_int(s: str) -> int:\n'
              '    """Convert a Roman numeral such as \'MCMXCIV\' to an integer."""\n'),
    "Write a Python class LRUCache with get(key) and put(key, value) methods and a fixed "
    "capacity that evicts the least recently used entry when it is full.",
    "Write a bash script that prints the ten largest files under the current directory, with "
    "their sizes in a human-readable form.",
]

MATH = [
    "A bakery sells muffins for $3 each and cookies for $1.50 each. Maya buys 4 muffins and 6 "
    "cookies and pays with a $20 bill. How much change does she get?",
    "A train travels 180 kilometres in 2 hours and then 150 kilometres in 3 hours. What is its "
    "average speed over the whole trip?",
    "Tom has twice as many marbles as Ana. Together they have 54 marbles. How many marbles does "
    "Tom have?",
    "A rectangle has a perimeter of 36 cm and its length is 4 cm more than its width. What is "
    "its area?",
    "A shop takes 25% off an $80 jacket, then adds 10% sales tax to the reduced price. What is "
    "the final price?",
    "Lena reads 12 pages on Monday, and each day after that she reads 3 pages more than the day "
    "before. How many pages has she read in all by the end of Friday?",
    "A tank holds 240 litres. One pipe fills it in 6 hours and another pipe empties it in 10 "
    "hours. With both pipes open, how long does it take to fill the empty tank?",
    "Three friends share a restaurant bill of $96. Sam pays $12 more than Kim, and Kim pays "
    "twice as much as Lee. How much does each of them pay?",
]

MULTILINGUAL = [
    "¿Cuáles son los beneficios de aprender un segundo idioma? Explícalo en pocas frases.",
    "Peux-tu m'expliquer la différence entre la météo et le climat ?",
    "Schreibe eine kurze E-Mail an meinen Vermieter, dass die Heizung in meiner Wohnung nicht "
    "funktioniert.",
]


def main() -> int:
    keys = eval_prompt_keys(("mt_bench", "humaneval"))
    convs = [c for c in iter_sharegpt() if not contains_eval_prompt(c, keys)]
    random.Random(0).shuffle(convs)

    def first_turn(i: int) -> str:
        c = convs[i]
        assert i >= 4000 and in_holdout(c, 0.02), i
        return c[0]["content"]

    rows = ([("chat", first_turn(i)) for i in CHAT] + [("code", first_turn(i)) for i in CODE_CHAT]
            + [("code", p) for p in CODE] + [("math", p) for p in MATH]
            + [("multilingual", first_turn(i)) for i in MULTILINGUAL_CHAT]
            + [("multilingual", p) for p in MULTILINGUAL])
    with open(OUT, "w", encoding="utf-8") as f:
        for k, (category, text) in enumerate(rows):
            f.write(json.dumps({"question_id": k, "category": category, "turns": [text]},
                               ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
