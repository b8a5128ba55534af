"""A decode as an iterator of text pieces: what a streaming client reads.

`TextStream` runs a generate call in a worker thread and hands over each new token with the text
it adds (spd.runtime.text.TextPieces: decoded incrementally), so the caller iterates instead of
passing a callback. Text that could still turn out to be the start of a stop string is held back
until the next token settles it, so no part of a stop string is ever sent. Leaving the loop
early (break, close(), an exception in the consumer) stops the decode at its next token and
leaves the engine free for the next request.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from spd.errors import SPDError
from spd.runtime.text import TextPieces


@dataclass
class TextPiece:
    token_id: int | None  # None: held-back text released at the end
    text: str             # the text it adds (may be empty: a partial character, held-back text)


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
        pieces = TextPieces(self.tokenizer, self.stop_strings)
        try:
            while (item := self._queue.get()) is not self._END:
                yield TextPiece(item, pieces.add(item))
            if self._error is not None:
                raise self._error
            tail = pieces.rest(self.result.text if self.result is not None else None)
            if tail:
                yield TextPiece(None, tail)
        finally:
            self.close()

    def close(self) -> None:
        """Stop the decode at its next token and wait for the worker to leave."""
        self._cancel.set()
        if self._started:
            self._thread.join()
