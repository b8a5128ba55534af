"""Where a decode ends before its token budget, and the text it leaves.

A decode ends at the first new token that is an end-of-sequence id of the model, one of the
request's `stop_token_ids`, or that completes one of its `stop` strings in the decoded text. That
token is kept in the token ids (as with EOS); the text is cut before the stop string, which is
not part of it (OpenAI's rule). The finish reason is "stop" then, "length" when the budget ran
out first.
"""
from __future__ import annotations

from typing import Iterable

from spd.errors import SPDError
from spd.runtime.text import StopText


def _strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise SPDError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(not s for s in stop):
        raise SPDError("stop strings must not be empty")
    return tuple(stop)


def _ids(ids, vocab_size: int | None) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if not isinstance(ids, (list, tuple, set, frozenset)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise SPDError(f"stop_token_ids must be a list of integer token ids, got {ids!r}")
    if vocab_size is not None and any(not 0 <= i < vocab_size for i in ids):
        raise SPDError(f"stop_token_ids must lie in [0, {vocab_size}) for this target")
    return frozenset(ids)


class StopRule:
    """Feed every new token once, in order (`feed`); `ended` says whether the decode ends there.

    eos_ids: the model's end-of-sequence ids; stop_token_ids / stop: the request's. Stop strings
    need the tokenizer (the text is decoded with special tokens skipped, incrementally:
    spd.runtime.text)."""

    def __init__(self, eos_ids: Iterable[int] = (), stop_token_ids=None, stop=None,
                 tokenizer=None, vocab_size: int | None = None):
        self.stop_ids = frozenset(eos_ids) | _ids(stop_token_ids, vocab_size)
        self.stop_strings = _strings(stop)
        if self.stop_strings and not hasattr(tokenizer, "decode"):
            raise SPDError("stop strings need the target's tokenizer")
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        # an Event that, once set, ends the decode at its next token (a client that left)
        self.cancel = None
        self.ended = False
        self._text = StopText(tokenizer, self.stop_strings) if self.stop_strings else None

    @property
    def cut(self) -> int | None:
        """Where the text ends (a stop string's start), if one hit."""
        return None if self._text is None else self._text.cut

    def feed(self, token: int) -> bool:
        self.ids.append(token)
        if token in self.stop_ids or (self.cancel is not None and self.cancel.is_set()):
            self.ended = True
        elif self._text is not None:
            self._text.add(token)
            self.ended = self._text.cut is not None
        return self.ended

    @property
    def finish_reason(self) -> str:
        return "stop" if self.ended else "length"

    def text(self) -> str:
        """The decoded text of the fed tokens, cut before the stop string that ended it (once,
        at the end: the whole answer, or what the incremental text settled)."""
        if self._text is not None:
            return self._text.final()
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)
