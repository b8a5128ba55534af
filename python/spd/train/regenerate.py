"""Self-distillation: the target answers the data's prompts itself, since the drafter must
predict what the target says, not what people wrote.

`generate_answers` is batched greedy generation (left-padded, Hugging Face `generate`, in the
target's dtype or a copy in another). `regenerate` streams conversations, replaces each one's
first assistant turn by the target's answer to everything before it (system and first user
turn), and appends the result, in OpenAI `messages` form, to a JSONL file: rank r of W answers
the conversations i with i % W == r into its own file. Each line records the conversation's
index in the stream (`source_index`), so rerunning resumes after the last complete line.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

from spd.errors import SPDError


def prompt_of(conversation: list[dict]) -> list[dict]:
    """The messages the target answers: leading system messages and the first user turn."""
    k = 0
    while k < len(conversation) and conversation[k]["role"] == "system":
        k += 1
    if k >= len(conversation) or conversation[k]["role"] != "user":
        raise SPDError("a conversation to regenerate must start with a user turn (after system "
                       "messages)")
    return conversation[:k + 1]


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.no_grad()
def generate_answers(target, prompts: list[list[int]], max_new_tokens: int,
                     batch_size: int = 16, dtype: torch.dtype | None = None,
                     progress: bool = True) -> list[list[int]]:
    """The target's greedy answer (ids, up to and including the first end-of-sequence token) to
    each prompt, batched by length (less padding), left-padded.

    `dtype` generates with a copy of the target in that dtype (bf16 on a CPU with avx512_bf16
    is ~1.8x faster than fp32); the answers are then the target's greedy text at that precision."""
    tok = target.tokenizer
    hf = target.hf
    if dtype is not None and dtype != target.dtype:
        hf = copy.deepcopy(hf).to(dtype)  # never cast the target itself: fp32 -> bf16 is lossy
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(target.eos_token_ids)
    eos = set(target.eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: dict[int, list[int]] = {}
    for b in tqdm(range(0, len(order), batch_size), desc="self-distillation", unit="batch",
                  disable=not progress):
        idx = order[b:b + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        attn = torch.zeros((len(idx), width), dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            attn[r, width - len(prompts[i]):] = 1
        gen = hf.generate(ids.to(target.device), attention_mask=attn.to(target.device),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        for r, i in enumerate(idx):
            resp = gen[r, width:].tolist()
            stop = next((k + 1 for k, t in enumerate(resp) if t in eos), len(resp))
            answers[i] = resp[:stop]
    return [answers[i] for i in range(len(prompts))]


def _last_index(path: Path) -> int:
    """`source_index` of the last complete line of `path` (-1: none); a partial last line (a
    kill mid-write) is cut off."""
    if not path.exists():
        return -1
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    lines = data[:end].splitlines()
    if not lines:
        return -1
    try:
        return int(json.loads(lines[-1])["source_index"])
    except (ValueError, KeyError, TypeError):
        raise SPDError(f"{path} was not written by this regeneration (its last line has no "
                       "source_index): give another --out, or delete it") from None


def regenerate(target, conversations: Iterable[list[dict]], out_file, *, max_new_tokens: int,
               max_prompt: int = 1024, batch_size: int = 16, dtype: torch.dtype | None = None,
               rank: int = 0, world: int = 1, progress: bool = True) -> int:
    """Answer rank `rank`'s share of `conversations` into `out_file` (JSONL of {"messages",
    "source_index"}), resuming after the last conversation it holds. Prompts longer than
    max_prompt tokens are passed over. Returns the number of conversations answered now."""
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = _last_index(out)
    tok = target.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise SPDError("regenerating answers needs the target's tokenizer with a chat template")
    bar = tqdm(desc=f"self-distillation (rank {rank})", unit="conv", disable=not progress)
    batch: list[tuple[int, list[dict]]] = []
    answered = 0

    def flush(f):
        nonlocal answered
        answers = generate_answers(target, [prompt_ids(tok, m) for _, m in batch],
                                   max_new_tokens, batch_size, dtype, progress=False)
        for (i, messages), ans in zip(batch, answers):
            text = tok.decode(ans, skip_special_tokens=True)
            reply = {"role": "assistant", "content": text}
            f.write(json.dumps({"messages": messages + [reply], "source_index": i},
                               ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
        bar.update(len(batch))
        answered += len(batch)
        batch.clear()

    with open(out, "a", encoding="utf-8") as f:
        for i, conv in enumerate(conversations):
            if i % world != rank or i <= done:
                continue
            messages = prompt_of(conv)
            if len(prompt_ids(tok, messages)) > max_prompt:
                continue
            batch.append((i, messages))
            if len(batch) == batch_size:
                flush(f)
        if batch:
            flush(f)
    bar.close()
    return answered


__all__ = ["generate_answers", "prompt_ids", "prompt_of", "regenerate"]
