"""The CUDA kernels at Qwen3-4B's shapes with an H200's launch plans (132 SMs), in the host
emulation: the grids, K splits, key splits and persistent blocks that the next GPU run launches,
checked against the references before any of them runs on the device. Outputs and scratch are
poisoned; the attention's cache past the chunk is NaN, so a key read too far shows."""
import pytest
import torch
from conftest import needs_simt

from spd_kernels import _cuda, attention, verify_greedy
from spd_kernels.features import (
    anchor_projection_cuda,
    anchor_projection_cuda_mma,
    anchor_projection_reference,
)
from spd_kernels.linear import fused_linear_reference, fused_swiglu_reference
from spd_kernels.on_request import attention_cuda
from spd_kernels.on_request.linear_cuda import cuda_launch
from spd_kernels.testing import poisoned_outputs
from spd_kernels.verify import final_logits

pytestmark = needs_simt

H200_SMS = 132
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 2560, 32, 8, 128, 9728   # Qwen3-4B
ROWS = 9                    # the PDM step's rows at n = 8
DRAFT_VOCAB, VOCAB = 8192, 151936  # the draft head: `spd train`'s default draft vocabulary
BF16_TOL = dict(rtol=2 * torch.finfo(torch.bfloat16).eps, atol=2 * torch.finfo(torch.bfloat16).eps)


def rand(g, *shape, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("what,R,K,N", [
    ("o_proj + residual", ROWS, HEADS * HEAD_DIM, HIDDEN),
    ("down + residual", ROWS, MLP, HIDDEN),
    ("norm + gate/up + SwiGLU", ROWS, HIDDEN, MLP),
    ("norm + draft head", 1, HIDDEN, DRAFT_VOCAB),
])
def test_dense_kernel_at_qwen3_4b_shapes(what, R, K, N):
    g = torch.Generator().manual_seed(K + N)
    x = rand(g, R, K, scale=2.0)
    w, w2 = rand(g, N, K, scale=K ** -0.5), rand(g, N, K, scale=K ** -0.5)
    norm = (torch.rand(K, generator=g) + 0.5).to(torch.bfloat16)
    res = rand(g, R, N)
    if what.startswith("norm + gate"):
        args, want = (x, w, w2, norm, 1e-6), fused_swiglu_reference(x, norm, 1e-6, w, w2)
    elif what.startswith("norm"):
        args, want = (x, w, None, norm, 1e-6), fused_linear_reference(x, w, norm, 1e-6, None)
    else:
        args, want = (x, w, None, None, 1e-6, res), fused_linear_reference(x, w, None, 1e-6, res)
    with _cuda.simulated(H200_SMS), poisoned_outputs("a"):
        got = cuda_launch(*args)
    torch.testing.assert_close(got, want, **BF16_TOL)


def test_attention_kernel_at_qwen3_4b_heads_and_a_4k_cache():
    """9 rows at position 1024 of a 4096-position cache: the plan's key splits cover the whole
    capacity (one graph for every position), so most of them hold no key of any row."""
    g = torch.Generator().manual_seed(7)
    start, S = 1024, 4096
    q = torch.randn(HEADS, ROWS, HEAD_DIM, generator=g) * 2
    k, v = (torch.randn(KV_HEADS, S, HEAD_DIM, generator=g) for _ in range(2))
    k[:, start + ROWS:] = float("nan")  # never written: a read past the chunk poisons the output
    v[:, start + ROWS:] = float("nan")
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    start_t = torch.tensor([start])
    want = attention.cache_attention_reference(q, k, v, start, None)
    with _cuda.simulated(H200_SMS), poisoned_outputs("a"):
        splits, _ = attention_cuda.attention_cuda_plan(KV_HEADS, ROWS * HEADS // KV_HEADS, S,
                                            torch.device("cpu"))
        got = attention_cuda.attention_cuda_launch(q, k, v, start_t, None)
    assert splits > 1
    tol = 2 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_verify_kernel_at_the_qwen3_4b_vocabulary():
    """The persistent grid of an H200 (every SM's resident blocks) over 151,936 rows."""
    g = torch.Generator().manual_seed(11)
    hidden = rand(g, 1, HIDDEN, scale=2.0)
    norm = (torch.rand(HIDDEN, generator=g) + 0.5).to(torch.bfloat16)
    head = rand(g, VOCAB, HIDDEN, scale=HIDDEN ** -0.5)
    logits = final_logits(hidden, norm, 1e-6, head).float()
    for draft in (logits.argmax(-1), torch.tensor([5])):  # accepted, rejected
        with _cuda.simulated(H200_SMS), poisoned_outputs("a"):
            t, ok = verify_greedy(hidden, norm, 1e-6, head, draft, backend="cuda")
        best = logits.max(-1).values
        ulp = torch.exp2(torch.floor(torch.log2(best.abs())) - 7)
        assert (logits.gather(1, t[:, None])[:, 0] >= best - ulp).all()  # the argmax or a near tie
        assert torch.equal(ok, t == draft)


@pytest.mark.parametrize("variant", ["ffma", "mma"])
def test_anchor_projection_at_qwen3_4b_width(variant):
    """The staircase of 9 in-flight rows over 5 anchors (types 4, 3, 3, 2, 2, 1, 1, 0, 0), every
    type's weights [2560, (e + 1) * 2560] read in place through a weight table."""
    g = torch.Generator().manual_seed(13)
    m = 5
    types = torch.tensor([min(m - 1, (k * m) // ROWS) for k in range(ROWS)][::-1])
    store = rand(g, m, ROWS + 4, HIDDEN)
    anchors = store[:, 2:2 + ROWS]  # a window of a larger buffer, as in the engine
    weights = [rand(g, HIDDEN, (e + 1) * HIDDEN, scale=HIDDEN ** -0.5) for e in range(m)]
    biases = [rand(g, HIDDEN, scale=0.1) for _ in range(m)]
    up = lambda t: t.float()  # the kernels accumulate in fp32 and round once
    want = anchor_projection_reference(up(anchors), types, [up(w) for w in weights],
                                       [up(b) for b in biases])
    fn = anchor_projection_cuda_mma if variant == "mma" else anchor_projection_cuda
    with _cuda.simulated(H200_SMS), poisoned_outputs("a"):
        got = fn(anchors, types, weights, biases)
    tol = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
