"""The cycle's control ops (spd_kernels.control): each Triton kernel against its reference, on
random batches of chain states, every branch drawn (filling, accepting, rejecting, a gap, the
end by a stop id or the budget, a finished sequence and a free slot beside live ones, the
context lookup's proposal and its gate, sampling's q ring with and without the lookup's one-hot),
outputs poisoned first; plus the argument checks.

On a CPU the kernels run in the Triton interpreter; on a GPU compiled (TRITON_DEVICE).
"""
from __future__ import annotations

import pytest
import torch
from conftest import needs_triton

from spd_kernels import SPDInputError
from spd_kernels.control import (
    CAND,
    COMMITTED,
    CONST,
    CYCLE,
    DONE,
    EMITTED,
    KEY,
    LIVE,
    LOOKUP_MAX,
    NEWEST,
    P_LENGTH,
    POS,
    STATE,
    UNIT,
    cycle_candidate,
    cycle_commit,
    cycle_open,
    plan_size,
    state_size,
)
from spd_kernels.philox import philox_uniform
from spd_kernels.testing import TRITON_DEVICE

C, M, D, V, VQ = 48, 3, 24, 40, 24


def _batch(n: int, B: int, seed: int, dev):
    """A batch of B random chain states for n stages (values that keep every index in range)."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=g)

    state = ints(0, 5, B, state_size(n))
    committed = ints(n + 2, C - n - 6, B)
    state[:, COMMITTED] = committed
    state[:, NEWEST] = committed - 1 + ints(0, n + 1, B)   # filling to full
    state[:, DONE] = (ints(0, 4, B) == 0).long()            # a finished one now and then
    state[:, EMITTED] = ints(0, 2, B)
    units = ints(0, 3, B, n, len(UNIT) + 1)
    units[:, :, POS] = state[:, NEWEST].view(B, 1) - torch.arange(n) + ints(-1, 2, B, n)
    units[:, :, LIVE] = ints(0, 2, B, n)
    units[:, :, -1] = ints(0, V, B, n)
    state[:, CYCLE] = ints(0, 2**40, B)  # (draw offsets past 2**32: Philox's high word)
    keys = ints(-2**63, 2**63 - 1, B)    # (the seed's 64 bits: negative keys too)
    consts = torch.stack([torch.full((B,), C - 1), committed + ints(-3, 4, B),
                          ints(0, 2, B) * 2, ints(0, 2, B), keys], 1)  # (greedy, sampled)
    # a short alphabet or a period in some rows, so the lookup finds matches of every length
    kind = ints(0, 3, B, 1)
    tokens = torch.where(kind == 0, ints(0, V, B, C), ints(0, 3, B, C))
    tokens = torch.where(kind == 2, torch.arange(C) % 3, tokens)
    anchors = torch.randn(B, M, C, D, generator=g)
    lanes = [ints(0, V, B, n + 1), ints(0, 2, B, n + 1).bool(), ints(0, 2, B, n + 1).bool(),
             ints(0, n + 1, B, n + 1)]
    tod = ints(0, 4, n + 1)
    on = lambda x: x.to(dev)  # noqa: E731
    return dict(state=on(state), units=on(units), consts=on(consts), tokens=on(tokens),
                anchors=on(anchors), lanes=[on(x) for x in lanes], tod=on(tod), g=g)


def _poison(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(float("nan") if x.is_floating_point() else -(2 ** 40))


def _open(b, n, backend, extra=0, draw: int = 0):
    """cycle_open's (plan, window, draws: [B, draw] uniforms, or None where draw is 0)."""
    dev, B = b["state"].device, b["state"].shape[0]
    plan = _poison(torch.empty(B, plan_size(n), dtype=torch.int64, device=dev))
    window = _poison(torch.empty(B, M, n + 1, D, device=dev))
    draws = _poison(torch.empty(B, draw, device=dev)) if draw else None
    cycle_open(b["state"], b["units"], b["consts"], b["tokens"], b["anchors"], b["tod"], plan,
               window, extra, draws, backend=backend)
    return plan, window, draws


pytestmark = needs_triton


@pytest.mark.parametrize("n", [1, 2, 4, 5])
@pytest.mark.parametrize("extra", [0, 1])
def test_open_matches_the_reference(n, extra):
    for seed in range(6):
        b = _batch(n, 5, seed, TRITON_DEVICE)
        draw = (seed % 3) * (n + 1)  # (none, or a chain's or a tree's count of uniforms)
        want = _open(b, n, "reference", extra, draw)
        got = _open(b, n, "triton", extra, draw)
        assert torch.equal(got[0], want[0]), (seed, got[0], want[0])
        if extra:  # post-step features: no window written
            assert got[1].isnan().all() and want[1].isnan().all()
        else:
            assert torch.equal(got[1], want[1])
        if draw:  # every slot's, greedy or not: Philox of its key at cycle * D + j
            at = b["state"][:, CYCLE:CYCLE + 1] * draw + torch.arange(draw, device=TRITON_DEVICE)
            assert torch.equal(want[2], philox_uniform(b["consts"][:, KEY], at))
            assert torch.equal(got[2], want[2])


def test_open_finds_lookups_of_several_lengths():
    """The random batches reach the lookup's branches (else the test above proves little)."""
    lengths = set()
    for seed in range(12):
        b = _batch(4, 5, seed, TRITON_DEVICE)
        plan = _open(b, 4, "triton")[0]
        lengths |= set(plan[:, P_LENGTH].tolist())
    assert {0, LOOKUP_MAX} <= lengths and len(lengths) >= 4, lengths


def _candidate(b, plan, n, backend, sampled: str | None, gate: bool):
    dev, B = plan.device, plan.shape[0]
    g = b["g"]
    draft = torch.randint(0, V, (B,), generator=g).to(dev)
    p = torch.rand(B, generator=g).to(dev) if gate else None
    trust = torch.rand(LOOKUP_MAX + 1, generator=g).to(dev) if gate else None
    q = q_ids = ring = judged = None
    if sampled:
        q = torch.rand(B, VQ, generator=g).to(dev)
        cols = V if sampled == "ids" else VQ
        q_ids = torch.randperm(V, generator=g)[:VQ].to(dev) if sampled == "ids" else None
        ring = torch.rand(B, n + 1, cols, generator=g).to(dev)
        judged = _poison(torch.empty(B, cols, device=dev))
    final = torch.randn(B, C, D, generator=g).to(dev)
    hidden = _poison(torch.empty(B, D, device=dev))
    cand = _poison(torch.empty(B, len(CAND), dtype=torch.int64, device=dev))
    cycle_candidate(plan, b["lanes"], draft, cand, p, trust, q, q_ids, ring, judged, final,
                    hidden, backend=backend)
    return cand, ring, judged, hidden


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("sampled", [None, "as_is", "ids"])
@pytest.mark.parametrize("gate", [False, True])
def test_candidate_matches_the_reference(n, sampled, gate):
    for seed in range(5):
        b = _batch(n, 6, seed, TRITON_DEVICE)
        plan = _open(b, n, "reference")[0]
        state = b["g"].get_state()
        want = _candidate(b, plan, n, "reference", sampled, gate)
        b["g"].set_state(state)
        got = _candidate(b, plan, n, "triton", sampled, gate)
        for x, y in zip(got, want):
            assert (x is None and y is None) or torch.equal(x, y), seed


def _commit(b, plan, cand, n, backend, sampled: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    dev, B = plan.device, plan.shape[0]
    st, units = b["state"].clone(), b["units"].clone()
    lanes = [x.clone() for x in b["lanes"]]
    tokens = b["tokens"].clone()
    embedded = b["anchors"][:, 0].clone()
    weight = torch.randn(V, D, generator=g).to(dev)
    # the verdict: the candidate half the time (accepts), else another token
    other = torch.randint(0, V, (B,), generator=g).to(dev)
    verdict = torch.where(torch.rand(B, generator=g).to(dev) < 0.5, cand[:, 2], other)
    stops = torch.randint(0, V, (B, 3), generator=g).to(dev)
    stops[:, 0] = torch.where(torch.rand(B, generator=g).to(dev) < 0.3, verdict, -1)
    accepted = (torch.rand(B, generator=g) < 0.5).to(dev) if sampled else None
    cycle_commit(st, units, b["consts"], plan, cand, lanes, tokens, embedded, weight, stops,
                 verdict, accepted, 7, backend=backend)
    return [st, units, tokens, embedded, *lanes]


@pytest.mark.parametrize("n", [1, 2, 4, 5])
@pytest.mark.parametrize("sampled", [False, True])
def test_commit_matches_the_reference(n, sampled):
    seen = set()
    for seed in range(8):
        b = _batch(n, 6, seed, TRITON_DEVICE)
        plan = _open(b, n, "reference")[0]
        cand = _candidate(b, plan, n, "reference", None, True)[0]
        want = _commit(b, plan, cand, n, "reference", sampled, seed)
        got = _commit(b, plan, cand, n, "triton", sampled, seed)
        for i, (x, y) in enumerate(zip(got, want)):
            assert torch.equal(x, y), (seed, i, x, y)
        # which branches this batch took: accepted / rejected / filling / ended / finished
        s = want[0]
        seen |= {("ended", bool(d)) for d in (s[:, DONE] > b["state"][:, DONE]).tolist()}
        by, before = s[:, len(STATE):].view(-1, n + 1, 2), b["state"][:, len(STATE):]
        judged, acc = (by - before.view(-1, n + 1, 2)).sum(1).unbind(1)
        seen |= {("rejected", bool(r)) for r in (judged > acc).tolist()}
        seen |= {("accepted", bool(a)) for a in (acc > 0).tolist()}
    assert {("ended", True), ("ended", False), ("rejected", True), ("rejected", False),
            ("accepted", True)} <= seen, seen


def test_checks_name_what_is_wrong():
    b = _batch(2, 2, 0, "cpu")
    plan = torch.zeros(2, plan_size(2), dtype=torch.int64)
    window = torch.zeros(2, M, 3, D)
    with pytest.raises(SPDInputError, match="state must be"):
        cycle_open(b["state"][:, :-1], b["units"], b["consts"], b["tokens"], b["anchors"],
                   b["tod"], plan, window)
    with pytest.raises(SPDInputError, match="chain"):
        cycle_open(b["state"], torch.zeros(2, 2, 12, dtype=torch.int64), b["consts"],
                   b["tokens"], b["anchors"], b["tod"], plan, window)
    with pytest.raises(SPDInputError, match=f"consts must be \\[2, {len(CONST)}\\]"):
        cycle_open(b["state"], b["units"], b["consts"][:, :2], b["tokens"], b["anchors"],
                   b["tod"], plan, window)
    with pytest.raises(SPDInputError, match="window must be"):
        cycle_open(b["state"], b["units"], b["consts"], b["tokens"], b["anchors"], b["tod"],
                   plan, window[:, :, :2])
    for draws, what in ((torch.zeros(2, 3, dtype=torch.float64), "draws"),
                        (torch.zeros(3, 3), "draws must have the batch's 2"),
                        (torch.zeros(2, 0), "D >= 1")):
        with pytest.raises(SPDInputError, match=what):
            cycle_open(b["state"], b["units"], b["consts"], b["tokens"], b["anchors"],
                       b["tod"], plan, window, 0, draws)
    cand = torch.zeros(2, len(CAND), dtype=torch.int64)
    with pytest.raises(SPDInputError, match="trust"):
        cycle_candidate(plan, b["lanes"], torch.zeros(2, dtype=torch.int64), cand,
                        torch.zeros(2))
    with pytest.raises(SPDInputError, match="go together"):
        cycle_candidate(plan, b["lanes"], torch.zeros(2, dtype=torch.int64), cand,
                        q=torch.zeros(2, 4))
    with pytest.raises(SPDInputError, match="margin"):
        cycle_commit(b["state"], b["units"], b["consts"], plan, cand, b["lanes"], b["tokens"],
                     b["anchors"][:, 0], torch.zeros(V, D), torch.zeros(2, 1, dtype=torch.int64),
                     torch.zeros(2, dtype=torch.int64), None, 0)


# --- the runtime on the kernels (what a GPU runs), against the runtime on the references -------

def _decode(prompts, sampling, lookup: int, backend: str):
    from conftest import make_tiny_target

    from spd import SPDEngine
    from spd_kernels import use_backend
    engine = SPDEngine(make_tiny_target(seed=3, vocab=32, layers=4), n_stages=3, lookup=lookup,
                       warn_untrained=False)
    ops = dict.fromkeys(("cycle_open", "cycle_candidate", "cycle_commit"), backend)
    with use_backend(**ops):
        if len(prompts) == 1:
            results = [engine.generate(prompts[0], 16, sampling[0])]
        else:
            results = engine.generate(prompts, 16, sampling, max_batch=len(prompts))
    return [(r.token_ids, r.stats.N, r.stats.K, dict(r.stats.by_position),
             r.stats.lookup_judged, r.stats.lookup_accepted) for r in results]


@pytest.mark.skipif(TRITON_DEVICE != "cpu", reason="compares CPU decodes (the interpreter)")
def test_decodes_on_the_kernels_equal_those_on_the_references():
    """A batch (greedy and sampled sequences together, with the context lookup on a prompt
    that repeats) on the kernels and on the references: the same tokens, N, K, judged and
    accepted drafts. (One sequence runs the same ops over a batch of one.)"""
    batch, lookup = 3, 2
    from spd import SamplingParams
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 2, [2, 7, 1, 8, 2, 8], [1, 1, 2, 3, 5, 8, 13]][:batch]
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=4),
                SamplingParams(temperature=1.0, top_k=5, seed=2)][:batch]
    want = _decode(prompts, sampling, lookup, "reference")
    assert _decode(prompts, sampling, lookup, "triton") == want
