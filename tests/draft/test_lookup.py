"""Context lookup (spd.draft.lookup): the index against a brute-force search, and decoding with it
stays exactly the target's while its drafts are used."""
import random

import pytest
import torch
from conftest import make_tiny_target

from spd import SPDEngine
from spd.draft.drafters import PDMDrafter
from spd.draft.lookup import DEFAULT_MIN_LEN, TRUST, NgramLookup, propose_on_device


def brute_force(committed, context, min_len, max_len):
    """Longest suffix of context (min_len..max_len) that occurs in committed with a committed
    successor; the successor of its latest occurrence."""
    for k in range(min(max_len, len(context)), min_len - 1, -1):
        suffix = context[-k:]
        for s in range(len(committed) - k - 1, -1, -1):
            if committed[s:s + k] == suffix:
                return committed[s + k], k
    return None


@pytest.mark.parametrize("min_len,max_len", [(1, 4), (2, 6), (3, 6)])
def test_index_matches_brute_force(min_len, max_len):
    rng = random.Random(min_len * 10 + max_len)
    for trial in range(40):
        vocab = rng.choice([3, 5, 9])  # small vocabularies repeat often
        committed = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
        idx = NgramLookup(min_len, max_len)
        idx.extend(committed)
        assert len(idx) == len(committed)
        for _ in range(10):
            tail = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]  # in flight
            context = (committed + tail)[-max_len:]
            assert idx.propose(context) == brute_force(committed, context, min_len, max_len), \
                (committed, tail)


@pytest.mark.parametrize("min_len,max_len", [(1, 4), (2, 6), (3, 6)])
def test_device_proposal_matches_the_index(min_len, max_len):
    """propose_on_device (the device loop's lookup) on a buffer of committed tokens, then those
    in flight, then stale ones past the newest: the index's proposal, or none."""
    rng = random.Random(7 * min_len + max_len)
    for trial in range(300):
        vocab = rng.choice([2, 3, 5])
        tokens = [rng.randrange(vocab) for _ in range(40)]
        committed = rng.randrange(1, 32)
        newest = rng.randrange(committed - 1, committed + 8)  # none to 8 in flight
        idx = NgramLookup(min_len, max_len)
        idx.extend(tokens[:committed])
        want = idx.propose(idx.context(tokens[committed:newest + 1]))
        token, length = propose_on_device(torch.tensor(tokens), torch.tensor(committed),
                                          torch.tensor(newest), min_len, max_len)
        assert (None if int(length) == 0 else (int(token), int(length))) == want, \
            (tokens, committed, newest)


def test_index_examples_and_bad_lengths():
    idx = NgramLookup(2, 4)
    idx.extend([7, 1, 2, 3, 9, 1, 2, 4])
    assert idx.propose([5, 1, 2]) == (4, 2)       # the latest occurrence of "1 2" wins
    assert idx.propose([9, 1, 2]) == (4, 3)       # a longer match is more specific
    assert idx.propose([3, 9, 1, 2]) == (4, 4)
    assert idx.propose([8, 2]) is None            # "8 2" never occurred; 1-token matches are off
    assert idx.propose([1, 2, 4]) is None         # "2 4" has no successor yet
    assert idx.context([5, 6]) == [9, 1, 2, 4, 5, 6]  # the last max_len committed, then in flight
    with pytest.raises(ValueError, match="min_len <= max_len"):
        NgramLookup(0, 4)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        NgramLookup(5, 4)
    with pytest.raises(ValueError, match="match length"):
        PDMDrafter(None, lookup=-1)


REPEATING = [3, 9, 4, 1, 3, 9, 4, 1, 3, 9]


@pytest.mark.parametrize("n", [2, 4])
def test_greedy_with_lookup_is_lossless_and_uses_its_drafts(n):
    """A random tiny target falls into loops under greedy decoding: the lookup proposes most
    drafts there and they are accepted far more often than the untrained PDM's."""
    t = make_tiny_target(seed=30 + n, vocab=24, layers=4)
    ar = SPDEngine(t, n_stages=n).generate_ar(REPEATING, 48).token_ids
    on = SPDEngine(t, n_stages=n, lookup=2).generate(REPEATING, 48)
    off = SPDEngine(t, n_stages=n, lookup=0).generate(REPEATING, 48)
    assert on.token_ids == ar and off.token_ids == ar
    assert off.stats.lookup_judged == 0
    st = on.stats
    assert st.lookup_judged > st.drafts_judged / 2 and st.lookup_accepted > 0
    assert st.lookup_accepted <= st.lookup_judged <= st.drafts_judged
    assert st.acceptance_rate > off.stats.acceptance_rate and st.K < off.stats.K
    rejects = st.drafts_judged - st.drafts_accepted  # the cycle accounting still holds
    assert st.N + (n - 1) * rejects <= st.K <= st.N + (n - 1) * (rejects + 1)
    assert f"lookup={st.lookup_accepted}/{st.lookup_judged}" in st.summary()


def test_engine_lookup_flag_reaches_the_drafter():
    t = make_tiny_target(seed=1, vocab=24, layers=4)
    assert SPDEngine(t, n_stages=2).drafter.lookup == DEFAULT_MIN_LEN  # on by default
    assert SPDEngine(t, n_stages=2, lookup=0).drafter.lookup == 0


class _FixedConfidence(PDMDrafter):
    """The PDM's drafts with a confidence set by the test (None: no confidence at all)."""

    def __init__(self, pdm, p, lookup):
        super().__init__(pdm, cuda_graphs=False, lookup=lookup)
        self.fixed = p

    def draft(self, *args):
        d = super().draft(*args)
        d.p = None if self.fixed is None else torch.tensor(self.fixed)
        return d


def _decode_with(eng, p, lookup):
    eng.drafter = _FixedConfidence(eng.drafter.pdm, p, lookup)  # one PDM for every run
    return eng.generate(REPEATING, 48)


@pytest.mark.parametrize("n", [2, 4])
def test_gate_trusts_the_lookup_as_far_as_its_hit_rate(n):
    """The lookup's token is used only where the PDM's top probability is below TRUST[match]:
    a sure PDM never yields, an unsure one always does (as a drafter with no confidence), and in
    between only matches long enough to be trusted more count, i.e. a longer shortest match."""
    assert list(TRUST) == sorted(TRUST) and TRUST[0] == 0.0 and TRUST[-1] < 1.0
    assert TRUST[3] < 0.55 < TRUST[4]
    t = make_tiny_target(seed=30 + n, vocab=24, layers=4)
    eng = SPDEngine(t, n_stages=n)
    ar = eng.generate_ar(REPEATING, 48).token_ids
    sure = _decode_with(eng, 1.0, 2)
    unsure, ungated = _decode_with(eng, 0.0, 2), _decode_with(eng, None, 2)
    middle, long_only = _decode_with(eng, 0.55, 2), _decode_with(eng, None, 4)
    for r in (sure, unsure, ungated, middle, long_only):
        assert r.token_ids == ar
    assert sure.stats.lookup_judged == 0
    assert unsure.stats.lookup_judged > 0
    assert (unsure.stats.K, unsure.stats.lookup_judged, unsure.stats.lookup_accepted) == \
        (ungated.stats.K, ungated.stats.lookup_judged, ungated.stats.lookup_accepted)
    assert (middle.stats.K, middle.stats.lookup_judged, middle.stats.lookup_accepted) == \
        (long_only.stats.K, long_only.stats.lookup_judged, long_only.stats.lookup_accepted)
    assert 0 < long_only.stats.lookup_judged < ungated.stats.lookup_judged  # short ones yield
