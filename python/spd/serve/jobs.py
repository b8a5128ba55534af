"""A validated request turned into one decode job: prompt ids (the chat template applied to
messages), the token budget within the context, sampling parameters and stop conditions.
Everything a request can get wrong is found here, before it queues, as a 4xx APIError."""
from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from spd.errors import SPDError
from spd.model.prompt import encode_messages
from spd.runtime.types import SamplingParams
from spd.serve.errors import APIError
from spd.serve.schemas import ChatCompletionRequest, CompletionRequest

_counter = itertools.count(1)


@dataclass
class Job:
    """One request's decode. `emit(event)` hands the worker's events to the request (any
    thread); setting `cancel` stops the decode at its next token."""
    id: str
    prompt_ids: list[int]
    max_new: int
    sampling: SamplingParams
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    emit: Callable[[object], None] = lambda event: None
    events: object = None  # the request's own queue of those events (the app's)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = field(default_factory=time.perf_counter)
    checked_at: float = 0.0  # when the app last asked whether the client is still there


def new_id(prefix: str) -> str:
    return f"{prefix}-{next(_counter)}-{secrets.token_hex(6)}"


def prompt_ids_of(req, tokenizer, vocab_size: int) -> list[int]:
    """The request's prompt as token ids: messages through the chat template, text tokenized as
    it is, token ids checked against the vocabulary."""
    if isinstance(req, ChatCompletionRequest):
        try:
            return encode_messages(tokenizer, [m.as_turn() for m in req.messages])
        except SPDError as exc:
            raise APIError(400, str(exc), "messages") from None
        except Exception as exc:  # the template itself refused (e.g. roles out of order)
            raise APIError(400, f"the chat template refused the messages: {exc}",
                           "messages") from None
    prompt = req.prompt
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if any(not 0 <= i < vocab_size for i in prompt):
        raise APIError(400, f"prompt token ids must lie in [0, {vocab_size})", "prompt")
    return list(prompt)


def make_job(req: ChatCompletionRequest | CompletionRequest, target, default_max_tokens: int,
             prefix: str) -> Job:
    ids = prompt_ids_of(req, target.tokenizer, target.vocab_size)
    context = target.max_context
    if not ids:
        raise APIError(400, "the prompt is empty", "prompt")
    if len(ids) >= context:
        raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context is "
                       f"{context}: shorten it", "messages" if prefix == "chatcmpl" else "prompt",
                       "context_length_exceeded")
    wanted = getattr(req, "max_completion_tokens", None) or req.max_tokens or default_max_tokens
    max_new = min(wanted, context - len(ids))  # finish_reason "length" says it was cut
    if req.stop_token_ids is not None and any(not 0 <= i < target.vocab_size
                                              for i in req.stop_token_ids):
        raise APIError(400, f"stop_token_ids must lie in [0, {target.vocab_size})",
                       "stop_token_ids")
    seed = req.seed
    if seed is None:  # as OpenAI: without a seed, sampling differs from one request to the next
        seed = secrets.randbits(63) if req.temperature > 0 else 0
    try:
        sampling = SamplingParams(req.temperature, max(req.top_k, 0), req.top_p, seed)
    except SPDError as exc:
        raise APIError(400, str(exc)) from None
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    return Job(new_id(prefix), ids, max_new, sampling, stop or None, req.stop_token_ids)
