"""Training sequences streamed from conversation sources: the online trainer's data.

A `Corpus` turns the conversations of `--data` sources (spd.data.conversations) into token
sequences with the target's chat template, and decides which of them a run may train on:

- **held out**: a fixed share of conversations, chosen by a hash of the first user turn
  (`in_holdout`), never trained on; the run's held-out evaluation reads its first ones. A small
  set may have none in that share: then, given at least `MIN_FOR_PINNED` usable conversations,
  the one whose hash is lowest (the next the share would take) is held out instead
  (`pin_holdout`); with fewer, the run trains on all of them and reports no held-out figures;
- **evaluation prompts**: conversations holding an MT-Bench, HumanEval or project held-out
  prompt are dropped (`spd.data.datasets.eval_prompt_keys`);
- **length**: sequences longer than `max_len` tokens are dropped (`too_long="drop"`, the
  paper's filter) or cut to `max_len` (`"cut"`); shorter than `min_len` are dropped.

Order is deterministic, so a run resumes by position alone. The usable sequences of one pass
over the sources, numbered 0, 1, ... across epochs (global indices), are shuffled in windows of
`shuffle_window` (each window's permutation seeded by seed, epoch and window), and rank r of W
takes the indices g with g % W == r. Memory holds one window, never the data set.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

from spd.errors import SPDError

TOO_LONG = ("drop", "cut")
# usable conversations a set needs before one is held out when the hash share holds none
MIN_FOR_PINNED = 8


def encode_conversation(tokenizer, conversation: list[dict]) -> list[int]:
    """Token ids of a whole conversation under the tokenizer's chat template (plain lines joined
    when it has none)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(conversation, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer("\n".join(t["content"] for t in conversation))["input_ids"]


class AnswerMask:
    """Which loss rows of a chat sequence predict a token the target writes itself.

    The assistant header is what the chat template adds for `add_generation_prompt` (for
    ChatML: `<|im_start|>assistant\\n`); an answer runs from after a header to the first
    end-of-turn token (the target's end-of-sequence ids). Row p predicts token p + 1, and at
    inference the first answer token comes from the prefill, so the rows that matter are the
    answer's own tokens but its end: p in [first answer token, end of turn). Training and the
    held-out estimate then weigh what drafting meets, not the system prompt or the user's text."""

    def __init__(self, tokenizer, end_ids):
        user = [{"role": "user", "content": "x"}]

        def encode(generation: bool) -> list[int]:
            ids = tokenizer.apply_chat_template(user, add_generation_prompt=generation,
                                                tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        plain, prompted = encode(False), encode(True)
        if prompted[:len(plain)] != plain or len(prompted) == len(plain):
            raise SPDError("the chat template adds no assistant header of its own: train with "
                           "--loss-on all")
        self.header = prompted[len(plain):]
        self.end = set(end_ids)
        if not self.end:
            raise SPDError("the target names no end-of-sequence token: train with --loss-on all")

    def __call__(self, ids: list[int]) -> list[bool]:
        """mask [len(ids)]: True on the rows described above."""
        mask = [False] * len(ids)
        h, n = self.header, len(self.header)
        p = 0
        while p + n <= len(ids):
            if ids[p:p + n] != h:
                p += 1
                continue
            p += n
            while p < len(ids) and ids[p] not in self.end:
                mask[p] = True
                p += 1
        return mask


@dataclass
class CorpusConfig:
    sources: list[str]
    max_len: int = 2048
    too_long: str = "drop"
    min_len: int = 16
    holdout: float = 0.02          # share of conversations held out (by hash), never trained on
    shuffle_window: int = 4096     # sequences shuffled together (memory: one window)
    seed: int = 0
    exclude_eval: bool = True      # drop conversations holding an evaluation prompt

    def __post_init__(self):
        if not self.sources:
            raise SPDError("no training data source given (--data PATH...)")
        if self.too_long not in TOO_LONG:
            raise SPDError(f"too_long must be one of {', '.join(TOO_LONG)}, got {self.too_long!r}")
        if not 0 <= self.holdout < 1:
            raise SPDError(f"the held-out share must lie in [0, 1), got {self.holdout}")
        if self.min_len < 2 or self.max_len < self.min_len:
            raise SPDError(f"need 2 <= min_len <= max_len, got {self.min_len} and {self.max_len}")
        if self.shuffle_window < 1:
            raise SPDError(f"shuffle_window must be >= 1, got {self.shuffle_window}")


@dataclass
class CorpusStats:
    """What one pass over the sources gave; `read` is spd.data.conversations.ReadStats."""
    read: object = None
    dropped: Counter = field(default_factory=Counter)  # held out, evaluation prompt, too long...
    sequences: int = 0
    tokens: int = 0
    lowest_key: str | None = None  # the training conversation the hash share would take next

    def as_dict(self) -> dict:
        return {"sequences": self.sequences, "tokens": self.tokens,
                "dropped": dict(self.dropped),
                "read": self.read.as_dict() if self.read is not None else None}

    def summary(self) -> str:
        drop = ", ".join(f"{v:,} {k}" for k, v in sorted(self.dropped.items())) or "none"
        read = self.read.summary() if self.read is not None else ""
        return f"{self.sequences:,} training sequences, {self.tokens:,} tokens; dropped: {drop}" \
               + (f"; read: {read}" if read else "")


class Corpus:
    def __init__(self, cfg: CorpusConfig, encode: Callable[[list[dict]], list[int]],
                 exclude_keys: set[str] | None = None):
        """encode(conversation) -> token ids (e.g. encode_conversation with the target's
        tokenizer). exclude_keys: evaluation-prompt keys (default: every evaluation set's)."""
        from spd.data.conversations import check_sources
        self.cfg = cfg
        self.encode = encode
        check_sources(cfg.sources)
        if exclude_keys is None and cfg.exclude_eval:
            from spd.data.datasets import eval_prompt_keys
            exclude_keys = eval_prompt_keys()
        self.exclude_keys = exclude_keys or set()
        self.pinned: set[str] = set()  # conversations held out besides the hash share

    def _held_out(self, conversation) -> bool:
        from spd.data.conversations import conversation_key, in_holdout
        if in_holdout(conversation, self.cfg.holdout):
            return True
        return bool(self.pinned) and conversation_key(conversation) in self.pinned

    # --- one pass ---------------------------------------------------------------------------
    def _conversations(self, stats: CorpusStats | None):
        from spd.data.conversations import ReadStats, read_conversations
        read = ReadStats()
        if stats is not None:
            stats.read = read
        return read_conversations(self.cfg.sources, read)

    def _usable(self, conversation, held_out: bool, stats: CorpusStats | None
                ) -> list[int] | None:
        """The sequence of `conversation` if it belongs to the requested split, else None."""
        from spd.data.datasets import contains_eval_prompt
        cfg = self.cfg

        def drop(reason):
            if stats is not None:
                stats.dropped[reason] += 1
            return None
        if self._held_out(conversation) != held_out:
            return drop("other split" if held_out else "held out")
        if self.exclude_keys and contains_eval_prompt(conversation, self.exclude_keys):
            return drop("evaluation prompt")
        ids = self.encode(conversation)
        if len(ids) > cfg.max_len:
            if cfg.too_long == "drop":
                return drop("too long")
            ids = ids[:cfg.max_len]
        if len(ids) < cfg.min_len:
            return drop("too short")
        if stats is not None and not held_out:
            from spd.data.conversations import conversation_key
            key = conversation_key(conversation)
            if stats.lowest_key is None or key < stats.lowest_key:
                stats.lowest_key = key
        return ids

    def pin_holdout(self, stats: CorpusStats) -> bool:
        """After a pass (`stats`) that found no usable held-out conversation: hold out the
        training conversation the hash share would take next, when the set has at least
        MIN_FOR_PINNED usable ones. True if one was pinned (the training split changed: count
        it again). Every rank decides alike (the same data, the same keys)."""
        if self.cfg.holdout <= 0 or stats.sequences < MIN_FOR_PINNED or self.held_out(1):
            return False
        self.pinned.add(stats.lowest_key)
        return True

    def epoch(self, epoch: int, stats: CorpusStats | None = None) -> Iterator[list[int]]:
        """Every training sequence of one pass, shuffled in windows (the same order every time
        for the same seed and epoch)."""
        window: list[list[int]] = []
        w = 0

        def flush():
            order = list(range(len(window)))
            random.Random(f"{self.cfg.seed}:{epoch}:{w}").shuffle(order)
            return [window[i] for i in order]
        for conv in self._conversations(stats):
            ids = self._usable(conv, False, stats)
            if ids is None:
                continue
            if stats is not None:
                stats.sequences += 1
                stats.tokens += len(ids)
            window.append(ids)
            if len(window) == self.cfg.shuffle_window:
                yield from flush()
                window, w = [], w + 1
        yield from flush()

    def count(self) -> CorpusStats:
        """One pass: how many sequences and tokens the run can train on, and what was dropped."""
        stats = CorpusStats()
        for _ in self.epoch(0, stats):
            pass
        if stats.sequences == 0:
            raise SPDError(f"no training sequence in {', '.join(self.cfg.sources)}: "
                           f"{stats.summary()}")
        return stats

    # --- what a rank reads --------------------------------------------------------------------
    def stream(self, start: int = 0, rank: int = 0, world: int = 1
               ) -> Iterator[tuple[int, list[int]]]:
        """(global index, sequence) for rank `rank` of `world`, from global index `start` on,
        epoch after epoch without end."""
        g = 0
        epoch = 0
        while True:
            empty = True
            for ids in self.epoch(epoch):
                empty = False
                if g >= start and g % world == rank:
                    yield g, ids
                g += 1
            if empty:
                raise SPDError(f"no training sequence in {', '.join(self.cfg.sources)} "
                               f"(everything was held out, an evaluation prompt, or outside "
                               f"the length limits)")
            epoch += 1

    def held_out(self, count: int) -> list[list[int]]:
        """The first `count` held-out sequences, in source order (the run's evaluation set)."""
        out = []
        if count <= 0 or self.cfg.holdout <= 0:
            return out
        for conv in self._conversations(None):
            ids = self._usable(conv, True, None)
            if ids is not None:
                out.append(ids)
                if len(out) == count:
                    break
        return out


__all__ = ["AnswerMask", "Corpus", "CorpusConfig", "CorpusStats", "TOO_LONG",
           "encode_conversation"]
