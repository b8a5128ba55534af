"""The OpenAI request bodies spd serves (pydantic: types and ranges checked before any work) and
the response objects it sends back (plain dicts in OpenAI's field layout).

Fields spd does not use (user, presence_penalty, ...) are accepted and ignored, as clients send
them by default; what would change the output and is not supported (n > 1, logprobs, echo) is
refused.
"""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spd.runtime.types import MAX_SEED

# The message roles served, as OpenAI spells them (case included); each goes to the chat template
# as it is. OpenAI's tool roles need tool calls, which this server does not make.
CHAT_ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLES = ("tool", "function")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints take."""
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default is 1 (sampling)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off (vLLM's spelling)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is served: spd decodes one sequence per request")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list[TextPart], None] = None

    @field_validator("role")
    @classmethod
    def _served_role(cls, role: str) -> str:
        served = ", ".join(f"'{r}'" for r in CHAT_ROLES)
        if role in TOOL_ROLES:
            raise ValueError(f"the role '{role}' is not supported: this server has no tools "
                             f"(roles served: {served})")
        if role not in CHAT_ROLES:  # the template would take it as a turn of its own
            raise ValueError(f"unknown role '{role}': a message's role is one of {served}")
        return role

    def as_turn(self) -> dict:
        """{"role", "content"} with the content as one string, for the chat template."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("the prompt is empty")
            if isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise ValueError("one prompt per request: spd decodes one sequence at a time")
                prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("echo", "logprobs")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported")
        return v


# --- responses ---------------------------------------------------------------------------------
def spd_figures(stats) -> dict:
    """SPD's own figures of one decode (definitions: docs/definitions.md)."""
    return {"mode": stats.mode, "n": stats.n, "N": stats.N, "K": stats.K,
            "alpha": stats.alpha, "theoretical_speedup": stats.theoretical_speedup,
            "acceptance_rate": stats.acceptance_rate, "prefill_s": stats.prefill_s,
            "decode_s": stats.decode_s, "decode_tok_s": stats.decode_tok_s}


def usage(prompt_tokens: int, result) -> dict:
    completion = len(result.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "spd": spd_figures(result.stats)}


def chat_response(rid: str, model: str, text: str, result, prompt_tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(prompt_tokens, result)}


def completion_response(rid: str, model: str, text: str, result, prompt_tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": usage(prompt_tokens, result)}


def chat_chunk(rid: str, model: str, created: int, delta: dict,
               finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def completion_chunk(rid: str, model: str, created: int, text: str,
                     finish_reason: str | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None,
                         "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int,
                result) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, result)}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "spd"}]}
