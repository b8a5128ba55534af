"""Context lookup: propose the token that followed the latest earlier occurrence of the text's end.

A drafter's weakest moments are right after a rejection: the newest token has only its
embedding, and the PDM must guess past it from shallow features. Token ids, by contrast, are
known at every depth. When the last `min_len` or more tokens (committed and in flight) already
occurred earlier in the committed text, the token that followed them then is a strong guess:
greedy answers restate their prompt, repeat list structure, and code restates its docstring and
names. Measured on the default model (n = 4, MT-Bench + HumanEval, greedy): such a match exists for
about half the judged drafts and is right 0.88 of the time there, against 0.58 for the PDM.

The proposal replaces the PDM's token only (the PDM still runs every cycle, so its cache stays
as inference expects); under sampling its draft distribution is one-hot, which keeps rejection
sampling exact. The index holds committed tokens only: they never roll back.
"""
from __future__ import annotations

DEFAULT_MIN_LEN = 3   # shortest match used (0 turns lookup off); 2 and 3 measured alike overall
MAX_LEN = 6           # longest match tried: the longest one wins (most specific)


class NgramLookup:
    """Append-only index of committed tokens: every suffix of length 1..MAX_LEN ending at a
    position maps to the token that followed it there (the latest occurrence wins)."""

    def __init__(self, min_len: int = DEFAULT_MIN_LEN, max_len: int = MAX_LEN):
        if not 1 <= min_len <= max_len:
            raise ValueError(f"lookup match lengths need 1 <= min_len <= max_len, got "
                             f"{min_len} and {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.tokens: list[int] = []
        self._next: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks = self.tokens
        for k in range(1, min(self.max_len, len(toks)) + 1):
            self._next[tuple(toks[-k:])] = token  # the k tokens before `token` were followed by it
        toks.append(int(token))

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(t)

    def context(self, in_flight: list[int]) -> list[int]:
        """The text's end as `propose` needs it: the last committed tokens, then `in_flight`
        (the tokens past the committed ones, oldest first)."""
        return self.tokens[-self.max_len:] + list(in_flight)

    def propose(self, context: list[int]) -> tuple[int, int] | None:
        """(token, match length) for the longest suffix of `context` (>= min_len tokens) seen
        earlier with a committed successor, or None."""
        for k in range(min(self.max_len, len(context)), self.min_len - 1, -1):
            token = self._next.get(tuple(context[-k:]))
            if token is not None:
                return token, k
        return None


__all__ = ["DEFAULT_MIN_LEN", "MAX_LEN", "NgramLookup"]
