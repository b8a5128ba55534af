"""Prompt text to token ids, the model's chat template applied when asked (and when it has one)."""
from __future__ import annotations

from spd.errors import SPDError


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not text:
        raise SPDError("the prompt is empty: pass --prompt TEXT")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]
