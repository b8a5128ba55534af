"""A decode as an iterator of text pieces: what a streaming client reads.

`TextStream` runs a generate call in a worker thread and hands over each new token with the text
it adds, so the caller iterates instead of passing a callback. Text that could still turn out to
be the start of a stop string is held back until the next token settles it, so no part of a stop
string is ever sent. Leaving the loop early (break, close(), an exception in the consumer) stops
the decode at its next token and leaves the engine free for the next request.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from spd.errors import SPDError
from spd.runtime.stopping import find_stop


@dataclass
class TextPiece:
    token_id: int | None  # None: held-back text released at the end
    text: str             # the text it adds (may be empty: a partial character, held-back text)


def safe_text(tokenizer, ids: list[int], stop_strings: tuple[str, ...] = ()) -> str:
    """The text of `ids` that can be shown now: cut before a stop string found in it, without a
    partial character at the end or a tail that may still become a stop string."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    cut = find_stop(text, stop_strings)
    if cut is not None:
        return text[:cut]
    if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
        text = text[:-1]
    hold = max((len(s) - 1 for s in stop_strings), default=0)
    return text[:len(text) - hold] if hold else text


class _Cancelled(Exception):
    """Raised inside the decode, from its token callback, when the consumer has left."""


class TextStream:
    """Iterate once for TextPiece's; afterwards `result` is the GenerationResult (finish
    reason, text, stats). run(on_token) runs the decode, calling on_token with each new token."""

    _END = object()

    def __init__(self, run: Callable, tokenizer, stop_strings: tuple[str, ...] = ()):
        self._run, self.tokenizer, self.stop_strings = run, tokenizer, stop_strings
        self._queue: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._work, name="spd-stream", daemon=True)
        self._started = False
        self._error: BaseException | None = None
        self.result = None

    def _work(self) -> None:
        try:
            self.result = self._run(self._on_token)
        except _Cancelled:
            pass
        except BaseException as exc:  # noqa: BLE001 - raised again in the consumer's thread
            self._error = exc
        finally:
            self._queue.put(self._END)

    def _on_token(self, token: int) -> None:
        if self._cancel.is_set():
            raise _Cancelled()
        self._queue.put(token)

    def __iter__(self) -> Iterator[TextPiece]:
        if self._started:
            raise SPDError("a TextStream can be iterated once")
        self._started = True
        self._thread.start()
        ids: list[int] = []
        sent = ""
        try:
            while (item := self._queue.get()) is not self._END:
                ids.append(item)
                text = (safe_text(self.tokenizer, ids, self.stop_strings)
                        if hasattr(self.tokenizer, "decode") else "")
                piece = text[len(sent):] if text.startswith(sent) else ""
                sent += piece
                yield TextPiece(item, piece)
            if self._error is not None:
                raise self._error
            final = self.result.text if self.result is not None else None
            if final and len(final) > len(sent) and final.startswith(sent):
                yield TextPiece(None, final[len(sent):])
        finally:
            self.close()

    def close(self) -> None:
        """Stop the decode at its next token and wait for the worker to leave."""
        self._cancel.set()
        if self._started:
            self._thread.join()
