"""The sampling rules of spd_kernels.sampling on every backend (reference, Triton one program a
row and split-row in the interpreter, CUDA in the host emulation): ties at the top-k / top-p cut
go to the lower ids, top_k = 1 is greedy, a NaN / inf row is one-hot at its argmax, tiny top_p
keeps the first token. Bit for bit against the reference; with the top-p cut inside a tie group,
the drawn distribution against the rule written out independently."""
import math

import pytest
import torch
from conftest import needs_simt, needs_triton

from spd_kernels import _cuda, rejection_sample_logits
from spd_kernels.sampling import filtered_probs
from spd_kernels.testing import poisoned_outputs
from spd_kernels.verify import (
    rejection_sample_logits_reference,
    target_to_draft_map,
    triton_rejection,
)

INF, NAN = float("inf"), float("nan")
TIE_ROW = [1.0] * 10 + [0.0] * 10 + [-INF] * 4
ROWS = {"tie": TIE_ROW, "nan": [NAN, .5, 1, 2, -1, 0, .3, .7],
        "inf": [0, 1, INF, 2, INF, 0, -1, 0], "all_ninf": [-INF] * 8}
PARAMS = [(0, 1.0), (0, 0.5), (0, 0.3), (0, 0.9), (3, 1.0), (1, 1.0), (12, 0.6), (0, 1e-12)]


def run(backend, logits, q, d2t, tok, u, top_k, top_p, dtype=torch.float32):
    logits = logits.to(dtype)
    if backend == "reference":
        return rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
    if backend in ("triton", "split"):
        return triton_rejection._launch_rejection_logits(
            logits, q, target_to_draft_map(d2t, logits.shape[1]), tok, u, None, None, 1.0,
            top_k, top_p, chunk=8 if backend == "split" else 0)
    with _cuda.simulated():
        return rejection_sample_logits(logits, q, d2t, tok.int(), u, temperature=1.0,
                                       top_k=top_k, top_p=top_p, backend="cuda")


def case(row):
    """Every token drafted once, q uniform, u0 = 0.5 and u1 spread over [0, 1)."""
    V = len(row)
    logits = torch.tensor([row] * V)
    u = torch.stack([torch.full((V,), 0.5), torch.linspace(0, 0.999, V)], 1)
    return logits, torch.full((V, V), 1.0 / V), torch.arange(V), torch.arange(V), u


def test_reference_keeps_the_lower_ids_of_a_tie():
    row = torch.tensor([TIE_ROW])
    assert (filtered_probs(row, 1.0, 0, 0.5)[0] > 0).nonzero().flatten().tolist() == list(range(7))
    assert (filtered_probs(row, 1.0, 4, 1.0)[0] > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert (filtered_probs(row, 1.0, 0, 1e-12)[0] > 0).nonzero().flatten().tolist() == [0]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert filtered_probs(row.to(dtype), 1.0, 1, 1.0)[0].argmax() == 0
        assert filtered_probs(row.to(dtype), 1.0, 1, 1.0)[0, 0] == 1.0
    nan = filtered_probs(torch.tensor([ROWS["nan"]]), 1.0)
    assert nan[0, 0] == 1.0 and nan.sum() == 1.0
    assert filtered_probs(torch.tensor([ROWS["inf"]]), 1.0, 0, 0.5)[0, 2] == 1.0
    assert filtered_probs(torch.tensor([ROWS["all_ninf"]]), 1.0, 2, 0.5)[0, 0] == 1.0


BACKENDS = [pytest.param("triton", marks=needs_triton), pytest.param("split", marks=needs_triton),
            pytest.param("cuda", marks=needs_simt)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ROWS))
def test_backends_follow_the_rules_bit_for_bit(backend, name):
    logits, q, d2t, tok, u = case(ROWS[name])
    if backend == "split" and name == "tie":  # (the interpreter's split plan is slow: the
        # rows drafting the tie group's ends, both sides of its top-p cuts and the groups
        # below it, not all 24)
        at = torch.tensor([0, 3, 6, 7, 9, 10, 15, 19, 20, 23])
        logits, q, tok, u = logits[at], q[at], tok[at], u[at]
    for top_k, top_p in PARAMS:
        ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
        out = run(backend, logits, q, d2t, tok, u, top_k, top_p)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]), (top_k, top_p)
    if name == "nan":  # item 4: the draft 3 is rejected, the token is the NaN's id
        out = run(backend, logits[:1], q[:1], d2t, torch.tensor([3]), torch.tensor([[.5, .5]]),
                  0, 1.0)
        assert not bool(out[1][0]) and int(out[0][0]) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_top_k_one_on_tied_maxima_is_greedy(backend, dtype):
    logits, q, d2t, tok, u = case([0.5, 2.0, 2.0, 2.0, -1.0, 2.0, 0.0, 1.0])
    out = run(backend, logits, q, d2t, tok, u, 1, 1.0, dtype)
    assert (out[0] == 1).all() and torch.equal(out[1], tok == 1)


# --- top-p inside a tie group: the drawn distribution over many uniforms -----------------------

# A tie group of six at 1.0 with ids interleaved among lower values, so keeping the wrong ids (or
# the whole group) moves mass to tokens the rule drops; id 9 (-inf) is the rejected draft.
CUT_ROW = [0.0, 1.0, 0.0, 1.0, 2.5, 1.0, -0.5, 1.0, 1.0, -INF, 0.0, 1.0, -1.0, 0.0]
CUT_TIE = [1, 3, 5, 7, 8, 11]
N_UNIFORMS = 240


def rule_probs(row, top_k, top_p):
    """The target distribution by the rule of spd_kernels.sampling, written out on the sorted row
    in float64 (the cuts below lie far from rounding): x descending with ties by lower id, the
    first top_k kept, then the shortest prefix whose mass reaches top_p."""
    e = [math.exp(v - max(row)) for v in row]
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:top_k or len(row)]
    z = sum(e[i] for i in order)
    kept, before = [], 0.0
    for i in order:
        if kept and before >= top_p * z:
            break
        kept.append(i)
        before += e[i]
    total = sum(e[i] for i in kept)
    return torch.tensor([e[i] / total if i in kept else 0.0 for i in range(len(row))],
                        dtype=torch.float64)


def cut_params():
    """(top_k, top_p) with the top-p cut after the m-th tied token, top_p half a token's mass
    past that point: m = 1, 3, 5 without top-k, and m = 2 under top_k = 5."""
    e = [math.exp(v - max(CUT_ROW)) for v in CUT_ROW]
    order = sorted(range(len(CUT_ROW)), key=lambda i: (-CUT_ROW[i], i))
    out = []
    for top_k, m in ((0, 1), (0, 3), (0, 5), (5, 2)):
        z = sum(e[i] for i in order[:top_k or len(order)])
        before = sum(e[i] for i in order if CUT_ROW[i] > 1.0)  # the mass ahead of the tie
        out.append((top_k, (before + (m - 0.5) * e[CUT_TIE[0]]) / z))
    return out


def edge_uniforms(expected, delta=1e-4):
    """expected [V] float64 -> u1 [M] float32, want [M]: u1 just inside both ends of each kept
    token's interval of the inverse CDF (ids in order), and that token. A draw that matches at
    every edge follows `expected` to within delta a token."""
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), expected.cumsum(0)])
    u, want = [], []
    for t in (expected > 0).nonzero().flatten().tolist():
        u += [cdf[t] + delta, cdf[t + 1] - delta]
        want += [t, t]
    return torch.tensor(u, dtype=torch.float32), torch.tensor(want)


def reject_draft_rows(n):
    """logits [n, V], q [n, V], draft_to_target [V], draft tokens [n]: n rows of CUT_ROW whose
    draft (the -inf id, p = 0, q = 1) is always rejected, so the token is the inverse-CDF draw
    from p itself."""
    V, draft = len(CUT_ROW), CUT_ROW.index(-INF)
    q = torch.zeros(n, V).index_fill_(1, torch.tensor([draft]), 1.0)
    return torch.tensor([CUT_ROW] * n), q, torch.arange(V), torch.full((n,), draft)


def test_reference_draws_the_rule_distribution_with_a_cut_in_a_tie():
    """At N stratified u1 each token takes N times its rule probability draws, give or take
    one: the kept set is exactly the rule's (the lower ids of the tie)."""
    N = 20000
    logits, q, d2t, tok = reject_draft_rows(N)
    u = torch.stack([torch.full((N,), 0.5), (torch.arange(N) + 0.5) / N], 1)
    for top_k, top_p in cut_params():
        expected = rule_probs(CUT_ROW, top_k, top_p)
        assert 0 < sum(expected[i] > 0 for i in CUT_TIE) < len(CUT_TIE)  # the cut is in the tie
        out, acc = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
        counts = torch.bincount(out, minlength=len(CUT_ROW)).double()
        assert not acc.any() and counts.numel() == len(CUT_ROW)
        assert ((counts - N * expected).abs() <= 1.0 + 1e-6).all(), (top_k, top_p, counts)
        assert torch.equal(counts > 0, expected > 0), (top_k, top_p)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_draw_the_rule_distribution_with_a_cut_in_a_tie(backend):
    """At both edges of every kept token's inverse-CDF interval the backend draws that token
    (and the reference's), so its distribution is the rule's to within 1e-4 a token and no
    dropped token is drawn."""
    for top_k, top_p in cut_params():
        u1, want = edge_uniforms(rule_probs(CUT_ROW, top_k, top_p))
        logits, q, d2t, tok = reject_draft_rows(len(u1))
        u = torch.stack([torch.full_like(u1, 0.5), u1], 1)
        with poisoned_outputs():
            out, acc = run(backend, logits, q, d2t, tok, u, top_k, top_p)
        assert not acc.any() and torch.equal(out.long(), want), (top_k, top_p, out)
        ref = rejection_sample_logits_reference(logits, q, d2t, tok, u, 1.0, top_k, top_p)
        assert torch.equal(ref[0], want), (top_k, top_p)
