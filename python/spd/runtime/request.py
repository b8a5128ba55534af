"""A request's prompt and budget, checked before anything decodes: bad input is the caller's
(SPDError), named and explained."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

from spd.errors import SPDError

if TYPE_CHECKING:
    from spd.model.target import TargetModel


def _one_sequence(prompt_ids) -> torch.Tensor:
    """Token ids of one sequence as int64 [L]: a list / tuple of ints, a 1-D integer tensor, or a
    [1, L] one (a tokenizer's return_tensors="pt"). A batch is refused, never flattened: SPD
    decodes one sequence at a time."""
    if isinstance(prompt_ids, (str, bytes)):
        raise SPDError("the prompt is text: give its token ids (e.g. "
                       "spd.model.prompt.encode_prompt(target, text) or the tokenizer's ids)")
    if not isinstance(prompt_ids, torch.Tensor):
        if not isinstance(prompt_ids, (list, tuple)) or any(
                isinstance(x, bool) or not isinstance(x, int) for x in prompt_ids):
            kind = type(prompt_ids).__name__
            raise SPDError(f"the prompt must be one sequence of token ids (a list of ints or a "
                           f"1-D integer tensor), got {kind}"
                           + (" holding non-integers or nested lists (a batch?)"
                              if isinstance(prompt_ids, (list, tuple)) else ""))
        return torch.tensor(prompt_ids, dtype=torch.int64).reshape(-1)
    if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or \
            prompt_ids.is_complex():
        raise SPDError(f"prompt token ids must be an integer tensor, got {prompt_ids.dtype}")
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1:
        raise SPDError(f"the prompt must be one sequence: a 1-D tensor of token ids (or [1, L]), "
                       f"got shape {tuple(prompt_ids.shape)}; for several prompts give a list "
                       f"of them (one result each)")
    return prompt_ids.to(torch.int64)


def check_prompt(target: TargetModel, prompt_ids, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """(prompt ids on the target's device, max_new_tokens capped to the context left)."""
    t = target
    ids = _one_sequence(prompt_ids)
    if ids.numel() == 0:
        raise SPDError("the prompt is empty: give at least one token")
    if int(ids.min()) < 0 or int(ids.max()) >= t.vocab_size:
        raise SPDError(f"prompt token ids must lie in [0, {t.vocab_size}) for this target")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise SPDError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if ids.numel() >= t.max_context:
        raise SPDError(f"the prompt has {ids.numel()} tokens but the model's context is "
                       f"{t.max_context}: shorten the prompt")
    room = t.max_context - ids.numel()
    if max_new_tokens > room:
        # stacklevel 3: past this function and the generate() that called it
        warnings.warn(f"max_new_tokens={max_new_tokens} exceeds the context left after the "
                      f"prompt; generating at most {room}", stacklevel=3)
        max_new_tokens = room
    return ids.to(t.device), int(max_new_tokens)
