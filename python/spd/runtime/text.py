"""The text of a growing token sequence, decoded incrementally, and where a stop string cuts it.

Decoding every token of the answer again for each new token costs time quadratic in its length.
`IncrementalText` decodes a short window per token instead: the tokens since the text last
settled, after a few tokens of context (a tokenizer may decode a token differently at the start
of a sequence, SentencePiece's leading space for one), and it settles the new text only where
it does not end in an incomplete character (U+FFFD, a multi-byte character cut between tokens).

`StopText` adds stop strings (OpenAI's rule: the text ends before the first one, which is not
part of it): it searches only the new text and the few characters before it that a stop string
could start in, and says how much can be shown now: never part of a stop string, so a tail that
could still become one is held back until the next token settles it.

The stop rule (spd.runtime.stopping), the text stream (spd.runtime.streaming), the server
(spd.serve.worker) and the command line (spd.cli.common.Streamer) all read text through these.
"""
from __future__ import annotations


def find_stop(text: str, stop_strings, since: int = 0) -> int | None:
    """Where the first stop string found in text[since:] begins, or None."""
    hits = [i for i in (text.find(s, since) for s in stop_strings) if i >= 0]
    return min(hits) if hits else None


class IncrementalText:
    """`add` each new token: `text` is the settled text so far (complete characters only)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # first id of the window decoded for context
        self._read = 0    # ids before this are settled in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append `token`; returns the text it settles (may be empty: a partial character, or
        a token without text)."""
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece

    def final(self) -> str:
        """All of the text, an unsettled tail included as the tokenizer decodes it."""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        return self.text + now[len(before):]


class StopText:
    """IncrementalText with stop strings. `cut`: where the first stop string begins (None
    until one appears); `visible()`: the text that can be shown now."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.inc = IncrementalText(tokenizer)
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) - 1 for s in self.stop_strings), default=0)
        self.cut: int | None = None

    def add(self, token: int) -> None:
        old = len(self.inc.text)
        settled = self.inc.add(token)
        if self.cut is None and self.stop_strings:
            # only a stop string that ends in the new characters can be new; an unsettled tail
            # counts too (a token may complete a stop string and start a character)
            text = self.inc.text if settled else self.inc.final()
            self.cut = find_stop(text, self.stop_strings, max(0, old - self.hold))

    def visible(self) -> str:
        """Settled text before the stop string; without one yet, all but a tail that may still
        become one."""
        text = self.inc.text
        if self.cut is not None:
            return text[:self.cut]
        return text[:max(0, len(text) - self.hold)]

    def final(self) -> str:
        """The whole text, cut before the stop string (the end of a decode: nothing is held)."""
        text = self.inc.final()
        return text if self.cut is None else text[:self.cut]


class TextPieces:
    """What to show of a growing answer, piece by piece (a stream's text): `add(token)` returns
    the text it makes visible, never part of a stop string; `rest(final)` the text still held
    back once the decode's final text is known."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.text = StopText(tokenizer, stop_strings) if hasattr(tokenizer, "decode") else None
        self.sent = ""

    def add(self, token: int) -> str:
        if self.text is None:  # a stand-in tokenizer (tests): no text
            return ""
        self.text.add(token)
        visible = self.text.visible()
        piece = visible[len(self.sent):] if visible.startswith(self.sent) else ""
        self.sent += piece
        return piece

    def rest(self, final: str | None) -> str:
        """The tail of `final` (the result's text) not sent yet ("" if it does not continue
        what was sent)."""
        if not final or not final.startswith(self.sent):
            return ""
        tail = final[len(self.sent):]
        self.sent = final
        return tail
