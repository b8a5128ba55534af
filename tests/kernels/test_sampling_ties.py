"""The sampling rules of spd_kernels.sampling on every backend (reference, Triton one program a
row and split-row in the interpreter, CUDA in the host emulation): ties at the top-k / top-p cut
go to the lower ids, top_k = 1 is greedy, a NaN / inf row is one-hot at its argmax, tiny top_p
keeps the first token. Bit for bit against the reference."""
import pytest
import torch
from conftest import needs_simt, needs_triton

from spd_kernels import _cuda, rejection_sample_logits
from spd_kernels.sampling import filtered_probs
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
