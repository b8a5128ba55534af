"""Prompt text to token ids, the model's chat template applied when asked (and when it has one)."""
from __future__ import annotations

from spd.errors import SPDError


def encode_prompt(tokenizer, text: str, chat: bool, system: str | None = None) -> list[int]:
    """The prompt's ids: through the chat template as the user's turn (after `system`, when
    given) when `chat` and the model has a template, else the text as it is."""
    if not text:
        raise SPDError("the prompt is empty: pass --prompt TEXT")
    if chat and getattr(tokenizer, "chat_template", None):
        turns = [{"role": "system", "content": system}] if system else []
        return encode_messages(tokenizer, turns + [{"role": "user", "content": text}])
    return tokenizer(text)["input_ids"]


def encode_request_prompt(tokenizer, prompt):
    """A request's prompt as token ids: text is tokenized as it is, chat messages (a list of
    {"role", "content"} dicts) go through the chat template with the generation prompt added;
    anything else (token ids) is returned unchanged for the engine's own checks."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise SPDError("a text prompt needs the target's tokenizer: give token ids")
        if not prompt:
            raise SPDError("the prompt is empty: give some text")
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return encode_messages(tokenizer, prompt)
    return prompt


def is_prompt_batch(prompt) -> bool:
    """Whether `prompt` is several prompts (as vLLM's LLM.generate takes them): a list of texts,
    of token-id lists or tensors, or of chats (lists of message dicts). A list of ints is one
    prompt's ids and a list of dicts one chat."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple)) or (hasattr(p, "dim") and p.dim() == 1)
               for p in prompt)


def encode_messages(tokenizer, messages) -> list[int]:
    """Chat messages through the model's chat template, the assistant's turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise SPDError("chat messages need a tokenizer with a chat template; this target has "
                       "none: give text or token ids")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SPDError(f"message {i} must have a string 'role' and 'content', got {m!r}")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                        tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
