"""spd_kernels reference ops against brute-force constructions, on fresh random inputs."""
import math

import pytest
import torch

from spd_kernels import (
    SPDInputError,
    anchor_projection,
    filtered_probs,
    rejection_sample,
    sample_from_probs,
    truncate_kv_,
    verify_greedy,
)
from spd_kernels.testing import chi2_pvalue as chi2_test
from spd_kernels.verify import final_logits, scatter_draft_probs


@pytest.mark.parametrize("rows,d,d_out", [(1, 8, 8), (7, 16, 12), (33, 5, 9)])
def test_anchor_projection_matches_concat(rows, d, d_out):
    g = torch.Generator().manual_seed(rows)
    m = 4
    anchors = torch.randn(m, rows, d, generator=g)
    types = torch.randint(0, m, (rows,), generator=g)
    types[0] = m - 1  # make sure mixed types appear
    weights = [torch.randn(d_out, (e + 1) * d, generator=g) for e in range(m)]
    biases = [torch.randn(d_out, generator=g) for _ in range(m)]
    out = anchor_projection(anchors, types, weights, biases)
    for r in range(rows):
        e = int(types[r])
        concat = torch.cat([anchors[j, r] for j in range(e + 1)])
        ref = weights[e] @ concat + biases[e]
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


def test_anchor_projection_bad_input():
    a = torch.randn(3, 4, 8)
    w = [torch.randn(8, 8), None, torch.randn(8, 24)]
    with pytest.raises(SPDInputError, match="no projection for it"):
        anchor_projection(a, torch.tensor([0, 1, 0, 2]), w)
    with pytest.raises(SPDInputError, match=r"types must lie in \[0, 2\]"):
        anchor_projection(a, torch.tensor([0, 3, 0, 2]), w)
    with pytest.raises(SPDInputError, match="input columns"):
        anchor_projection(a, torch.tensor([2, 2, 2, 2]), [None, None, torch.randn(8, 16)])
    with pytest.raises(SPDInputError, match="types has 3 rows"):
        anchor_projection(a, torch.tensor([0, 0, 0]), w)


def test_truncate_in_place_and_poison():
    k = torch.randn(3, 2, 10, 4)
    v = torch.randn(3, 2, 10, 4)
    keep_k, keep_v = k[:, :, :6].clone(), v[:, :, :6].clone()
    lengths = torch.full((3,), 9, dtype=torch.int64)
    ptr = k.data_ptr()
    truncate_kv_(lengths, torch.tensor(6), (k, v), poison=True)
    assert lengths.tolist() == [6, 6, 6] and k.data_ptr() == ptr
    assert torch.equal(k[:, :, :6], keep_k) and torch.equal(v[:, :, :6], keep_v)
    assert torch.isnan(k[:, :, 6:9]).all() and torch.isnan(v[:, :, 6:9]).all()
    assert not torch.isnan(k[:, :, 9:]).any()  # rows never written stay as they were
    truncate_kv_(lengths, torch.tensor(8))      # never grows
    assert lengths.tolist() == [6, 6, 6]
    with pytest.raises(SPDInputError, match="non-negative"):
        truncate_kv_(lengths, torch.tensor(-1))
    with pytest.raises(SPDInputError, match="int64"):
        truncate_kv_(lengths.int(), torch.tensor(1))


def test_verify_greedy_matches_logits_argmax():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 16, generator=g)
    w = torch.randn(16, generator=g)
    head = torch.randn(50, 16, generator=g)
    ref = final_logits(h, w, 1e-6, head).argmax(-1)
    drafts = ref.clone()
    drafts[[1, 3]] = (drafts[[1, 3]] + 1) % 50
    tgt, ok = verify_greedy(h, w, 1e-6, head, drafts)
    assert torch.equal(tgt, ref)
    assert ok.tolist() == [True, False, True, False, True]
    with pytest.raises(SPDInputError, match="hidden size mismatch"):
        verify_greedy(h, w, 1e-6, torch.randn(50, 8), drafts)


def test_filtered_probs_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 100, generator=g) * 3
    for temp, k, p in [(0.7, 0, 1.0), (1.0, 10, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.5)]:
        x = TemperatureLogitsWarper(temp)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1.0:
            x = TopPLogitsWarper(p)(None, x)
        torch.testing.assert_close(filtered_probs(logits, temp, k, p), x.softmax(-1))
    one_hot = filtered_probs(logits, 0.0)
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(4))
    for bad in [dict(temperature=-1.0), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)]:
        with pytest.raises(SPDInputError):
            filtered_probs(logits, **bad)


def test_sample_from_probs_frequencies():
    g = torch.Generator().manual_seed(3)
    probs = torch.rand(12, generator=g)
    probs[4] = 0.0
    n = 20000
    draws = sample_from_probs(probs.expand(n, -1), torch.rand(n, generator=g))
    counts = torch.bincount(draws, minlength=12)
    assert counts[4] == 0
    assert chi2_test(counts, probs / probs.sum()) > 1e-3


@pytest.mark.parametrize("overlap", ["random", "identical", "disjoint_support"])
def test_rejection_sampling_follows_target(overlap):
    """Exact speculative sampling: the output must be distributed as p whatever q is.

    Significance 1e-3 per case with a fixed seed: a correct sampler fails with probability 0.001.
    """
    g = torch.Generator().manual_seed(4)
    V, n = 10, 40000
    p = torch.rand(V, generator=g) ** 2
    p[7] = 0.0
    p /= p.sum()
    if overlap == "identical":
        q = p.clone()
    else:
        q = torch.rand(V, generator=g)
        if overlap == "disjoint_support":
            q[p > 0.12] = 0.0  # the draft never proposes the target's likeliest tokens
        q /= q.sum()
    drafts = sample_from_probs(q.expand(n, -1), torch.rand(n, generator=g))
    tokens, acc = rejection_sample(p.expand(n, -1), q.expand(n, -1), drafts,
                                   torch.rand(n, 2, generator=g))
    counts = torch.bincount(tokens, minlength=V)
    assert chi2_test(counts, p) > 1e-3
    # Acceptance rate equals sum(min(p, q)) (the overlap), another exact identity.
    expect = min(1.0, torch.minimum(p, q).sum().item())
    assert abs(acc.float().mean().item() - expect) < 4 * math.sqrt(expect * (1 - expect) / n) + 1e-9
    if overlap == "identical":
        assert acc.all()


def test_scatter_draft_probs_and_range_check():
    q = torch.tensor([[0.5, 0.3, 0.2]])
    full = scatter_draft_probs(q, torch.tensor([4, 0, 2]), 6)
    assert full.tolist() == [[0.30000001192092896, 0.0, 0.20000000298023224, 0.0, 0.5, 0.0]]
    with pytest.raises(SPDInputError, match="outside the target vocabulary"):
        scatter_draft_probs(q, torch.tensor([4, 0, 6]), 6)
