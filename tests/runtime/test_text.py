"""Incremental text (spd.runtime.text) against decoding the whole sequence, with the default
model's byte-level tokenizer: characters split over tokens, stop strings, and a cost per token
that does not grow with the answer."""
from __future__ import annotations

import random

import pytest

from spd.runtime.stopping import StopRule
from spd.runtime.text import IncrementalText, StopText, TextPieces, find_stop

SAMPLES = ["Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9.",
           "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \U0001f642\U0001f680 done",
           "def add(a, b):\n    return a + b\n\n", "  spaces   and\ttabs \u2014 dashes \u2026"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from spd.model.loading import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path(None))


def _sequences(tok, count: int = 12, seed: int = 0) -> list[list[int]]:
    """Token ids of the samples, whole and cut up, plus random ids (special ones included)."""
    rng = random.Random(seed)
    out = [tok(s)["input_ids"] for s in SAMPLES]
    out.append(sum(out, []))
    for _ in range(count):
        out.append([rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))])
    return out


def _full(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def test_incremental_text_is_the_whole_decode(tok):
    """At every token the settled text is a prefix of the whole decode (a character split over
    tokens waits for its last one) and `final` is the whole decode; the pieces add up to the
    text."""
    for ids in _sequences(tok):
        inc, pieces = IncrementalText(tok), []
        for i, t in enumerate(ids):
            pieces.append(inc.add(t))
            full = _full(tok, ids[:i + 1])
            assert full.startswith(inc.text), (ids[:i + 1], inc.text, full)
            assert inc.final() == full
        assert "".join(pieces) == inc.text


def _old_safe_text(tok, ids, stops):
    """What each token's text was before: the whole sequence decoded, cut at a stop string,
    without a trailing partial character, a tail that may become a stop string held back."""
    text = _full(tok, ids)
    cut = find_stop(text, stops)
    if cut is not None:
        return text[:cut]
    if text.endswith("\ufffd"):
        text = text[:-1]
    hold = max((len(s) - 1 for s in stops), default=0)
    return text[:max(0, len(text) - hold)]  # (before: a text shorter than the hold lost a
    #                                          character from its end instead of all of it)


@pytest.mark.parametrize("stops", [(), ("\n\n",), ("cr\u00e8me", "b\n"), ("\u8a9e\u306e",),
                                   ("\U0001f680",), ("a + b", "zzz-never")])
def test_stop_text_cuts_where_the_whole_decode_does(tok, stops):
    """The stop rule ends at the same token as a search of the whole decode, and its text is
    the whole text cut there; a stream shows what the whole-decode rule showed, piece by
    piece, and never part of a stop string."""
    ids = sum((tok(s)["input_ids"] for s in SAMPLES), [])
    rule = StopRule(stop=list(stops) or None, tokenizer=tok)
    stream, shown = TextPieces(tok, stops), ""
    ended_at = None
    for i, t in enumerate(ids):
        shown += stream.add(t)
        want = _old_safe_text(tok, ids[:i + 1], stops)
        assert want.startswith(shown) and len(want) - len(shown) <= 1, (i, shown, want)
        if rule.feed(t):
            ended_at = i
            break
    first = next((i for i in range(len(ids)) if find_stop(_full(tok, ids[:i + 1]), stops)
                  is not None), None)
    assert ended_at == first
    full = _full(tok, ids[:len(rule.ids)])
    whole_cut = find_stop(full, stops)
    assert rule.text() == (full if whole_cut is None else full[:whole_cut])
    shown += stream.rest(rule.text())
    assert shown == rule.text()
    assert not any(s in shown for s in stops)


def test_text_costs_the_same_per_token_however_long_the_answer(tok):
    """Tokens decoded per new token stay a small constant (a window), where decoding the whole
    answer each time grows with its length: linear, not quadratic, in the answer."""
    class Counting:
        def __init__(self):
            self.decoded = 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return tok.decode(ids, **kw)
    ids = sum((tok(s)["input_ids"] for s in SAMPLES), []) * 40  # about 1500 tokens
    counting = Counting()
    stop = StopText(counting, ("never appears",))
    for t in ids:
        stop.add(t)
    assert stop.final() == _full(tok, ids)
    assert counting.decoded <= 12 * len(ids), counting.decoded  # whole-answer decoding: ~n^2/2
