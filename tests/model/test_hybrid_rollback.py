"""Hybrid stages roll back by length: after random accept / reject sequences (poisoned dropped
slots and rows) every stage's state equals a fresh prefill of the committed tokens, and a
truncation deeper than the state ring holds is an InternalError that changes nothing."""
import pytest
import torch
from conftest import make_tiny_hybrid

from spd.errors import InternalError
from spd.model.target import Stage

VOCAB = 40


def _state(stage, length):
    """What a stage holds for `length` committed tokens: KV rows, the ring slot's conv history
    and recurrent state."""
    c = stage.cache
    slot = length % c.ring
    return [c.k[:, :, :length], c.v[:, :, :length], c.conv[:, slot], c.state[:, slot]]


def _fresh(t, ranges, ids, n):
    stages = [Stage(t, i, r, capacity=64, max_rollback=n) for i, r in enumerate(ranges)]
    h = t.embed_tokens(ids)
    for st in stages:
        h = st.forward(h, 0)
    return stages


@pytest.mark.parametrize("model_type,pattern", [
    ("qwen3_5", ("linear_attention", "full_attention", "linear_attention", "linear_attention")),
    ("qwen3_next", ("full_attention", "linear_attention", "linear_attention", "full_attention")),
])
@pytest.mark.parametrize("n", [2, 3])
def test_random_rollbacks_equal_a_fresh_prefill(model_type, pattern, n):
    t = make_tiny_hybrid(seed=4, vocab=VOCAB, model_type=model_type, layer_types=pattern)
    ranges = [range(0, 1), range(1, 3), range(3, 4)]
    g = torch.Generator().manual_seed(n)
    stages = [Stage(t, i, r, capacity=64, poison=True, max_rollback=n)
              for i, r in enumerate(ranges)]
    seq = torch.randint(0, VOCAB, (64,), generator=g)
    length = 6
    h = t.embed_tokens(seq[:length])
    for st in stages:
        h = st.forward(h, 0)
    raised = restored = 0
    for _ in range(30):
        rows = int(torch.randint(1, n + 2, (), generator=g))  # up to n + 1 rows (a verify)
        seq[length:length + rows] = torch.randint(0, VOCAB, (rows,), generator=g)  # new tokens
        h = t.embed_tokens(seq[length:length + rows])
        for st in stages:
            h = st.forward(h, length)
        length += rows
        back = int(torch.randint(0, n + 2, (), generator=g))
        if back and length - back < stages[0].cache.restorable_from:
            before = [[x.clone() for x in _state(st, length)] for st in stages]
            with pytest.raises(InternalError, match="rolled back deeper than its ring"):
                stages[0].cache.truncate(length - back)
            for st, b in zip(stages, before):  # the refused truncation changed nothing
                assert st.cache.length == length
                for x, y in zip(_state(st, length), b):
                    torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
            raised += 1
            back = length - stages[0].cache.restorable_from
        length -= back
        for st in stages:
            st.cache.truncate(length)
        restored += back > 0
        fresh = _fresh(t, ranges, seq[:length], n)
        for st, ref in zip(stages, fresh):
            for got, want in zip(_state(st, length), _state(ref, length)):
                assert not got.isnan().any()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert raised and restored  # both paths were taken


def test_truncate_to_zero_resets_and_poison_marks_dropped_slots():
    t = make_tiny_hybrid(seed=1, vocab=VOCAB)
    st = Stage(t, 0, range(0, 4), capacity=16, poison=True, max_rollback=2)
    ids = torch.arange(7) % VOCAB
    st.forward(t.embed_tokens(ids), 0)
    st.cache.truncate(5)  # lengths 6 and 7 dropped: their slots poisoned
    assert st.cache.state[:, 6 % 3].isnan().all() and st.cache.state[:, 7 % 3].isnan().all()
    assert not st.cache.state[:, 5 % 3].isnan().any()
    with pytest.raises(InternalError):
        st.cache.truncate(4)
    st.cache.truncate(0)
    out = st.forward(t.embed_tokens(ids[:3]), 0)
    assert not out.isnan().any()


def test_chunked_prefill_leaves_its_last_lengths_restorable():
    """A prefill of 9 rows with a ring of 4: lengths 6, 7 and 8 restore exactly (as a fresh
    prefill of that many tokens, then the same next step); length 5 is refused."""
    t = make_tiny_hybrid(seed=5, vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(9))
    for length in (6, 7, 8):
        st = Stage(t, 0, range(4), capacity=16, poison=True, max_rollback=3)
        st.forward(t.embed_tokens(ids[:9]), 0)
        st.cache.truncate(length)
        ref = _fresh(t, [range(4)], ids[:length], 3)[0]
        for got, want in zip(_state(st, length), _state(ref, length)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        nxt = t.embed_tokens(ids[length:length + 1])
        torch.testing.assert_close(st.forward(nxt, length), ref.forward(nxt, length),
                                   rtol=1e-5, atol=1e-6)
    st = Stage(t, 0, range(4), capacity=16, max_rollback=3)
    st.forward(t.embed_tokens(ids[:9]), 0)
    with pytest.raises(InternalError, match="restorable='6..9'"):
        st.cache.truncate(5)
