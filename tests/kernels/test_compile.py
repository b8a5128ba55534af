"""The exported ops under torch.compile(fullgraph=True) on CPU, and torch.ops.spd.* with the
optional arguments left out (the schemas carry the Python functions' defaults)."""
from __future__ import annotations

import torch

import spd_kernels
from spd_kernels import (
    anchor_projection,
    cache_attention,
    filtered_probs,
    fused_linear,
    fused_swiglu,
    qkv_rope_append,
    rejection_sample,
    rejection_sample_logits,
    sample_from_probs,
    truncate_kv_,
    verify_greedy,
)


def compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def same(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    else:
        assert torch.equal(a, b), (a, b)


def greedy_inputs(R=3, d=16, V=40):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(R, d, generator=g), torch.rand(d, generator=g) + 0.5, 1e-6,
            torch.randn(V, d, generator=g), torch.randint(0, V, (R,), generator=g))


def test_verify_greedy_fullgraph():
    args = greedy_inputs()
    same(compiled(verify_greedy)(*args), verify_greedy(*args))


def test_fused_linear_and_swiglu_fullgraph():
    g = torch.Generator().manual_seed(1)
    x, w, nw = torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g), torch.rand(16)
    res = torch.randn(3, 8, generator=g)
    fn = lambda x, w, nw, res: fused_linear(x, w, norm_weight=nw, eps=1e-6, residual=res)
    same(compiled(fn)(x, w, nw, res), fn(x, w, nw, res))
    same(compiled(lambda x, w: fused_linear(x, w))(x, w), fused_linear(x, w))
    wg, wu = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    same(compiled(fused_swiglu)(x, nw, 1e-6, wg, wu), fused_swiglu(x, nw, 1e-6, wg, wu))


def test_anchor_projection_fullgraph():
    g = torch.Generator().manual_seed(2)
    m, R, d, d_out = 3, 4, 8, 6
    anchors = torch.randn(m, R, d, generator=g)
    types = torch.tensor([0, 1, 2, 1])
    weights = [torch.randn(d_out, (e + 1) * d, generator=g) for e in range(m)]
    biases = [torch.randn(d_out, generator=g), None, torch.randn(d_out, generator=g)]
    fn = lambda a, t, ws, bs: anchor_projection(a, t, ws, bs)
    same(compiled(fn)(anchors, types, weights, biases), fn(anchors, types, weights, biases))


def test_sampling_fullgraph():
    g = torch.Generator().manual_seed(3)
    logits, u = torch.randn(4, 30, generator=g), torch.rand(4, generator=g)

    def fn(logits, u):
        return sample_from_probs(filtered_probs(logits, 0.7, 5, 0.9), u)
    same(compiled(fn)(logits, u), fn(logits, u))


def test_rejection_fullgraph():
    g = torch.Generator().manual_seed(4)
    R, V, Vd = 3, 20, 12
    p = torch.rand(R, V, generator=g).softmax(-1)
    q = torch.rand(R, V, generator=g).softmax(-1)
    tok = torch.randint(0, V, (R,), generator=g)
    u = torch.rand(R, 2, generator=g)
    same(compiled(rejection_sample)(p, q, tok, u), rejection_sample(p, q, tok, u))
    logits = torch.randn(R, V, generator=g)
    qd = torch.rand(R, Vd, generator=g).softmax(-1)
    d2t = torch.randperm(V, generator=g)[:Vd]
    fn = lambda lg, qd, d2t, tok, u: rejection_sample_logits(lg, qd, d2t, tok, u, temperature=0.8,
                                                             top_k=6, top_p=0.95)
    same(compiled(fn)(logits, qd, d2t, tok, u), fn(logits, qd, d2t, tok, u))


def test_truncate_kv_fullgraph():
    lengths = torch.tensor([5, 3, 7])
    buf = torch.zeros(3, 2, 8, 4)

    def fn(lengths, new, buf):
        truncate_kv_(lengths, new, [buf], seq_dim=-2, poison=True)
        return lengths + 0
    want_len, want_buf = lengths.clone(), buf.clone()
    fn(want_len, torch.tensor(4), want_buf)
    got = compiled(fn)(lengths, torch.tensor(4), buf)
    same(got, want_len)
    same(lengths, want_len)
    assert torch.equal(buf.isnan(), want_buf.isnan())


def test_cache_attention_and_qkv_fullgraph():
    g = torch.Generator().manual_seed(5)
    H, KVH, hd, S, T, d = 4, 2, 8, 16, 3, 16
    x = torch.randn(T, d, generator=g)
    nw = torch.rand(d, generator=g) + 0.5
    wq, wk, wv = (torch.randn(n * hd, d, generator=g) for n in (H, KVH, KVH))
    cos, sin = torch.randn(S, hd, generator=g), torch.randn(S, hd, generator=g)
    start = torch.tensor(2)

    def fn(x, kc, vc):
        q = qkv_rope_append(x, nw, 1e-6, wq, wk, wv, None, None, cos, sin, start, kc, vc, H, KVH)
        return cache_attention(q, kc, vc, start)
    kc, vc = torch.zeros(KVH, S, hd), torch.zeros(KVH, S, hd)
    kc2, vc2 = kc.clone(), vc.clone()
    same(compiled(fn)(x, kc, vc), fn(x, kc2, vc2))
    same((kc, vc), (kc2, vc2))


# --- torch.ops.spd.* with optional arguments omitted ---------------------------------------------

def test_ops_defaults_fused_linear():
    x, w, nw = torch.randn(2, 16), torch.randn(8, 16), torch.rand(16)
    same(torch.ops.spd.fused_linear(x, w, norm_weight=nw, eps=1e-6),
         fused_linear(x, w, norm_weight=nw))
    same(torch.ops.spd.fused_linear(x, w), fused_linear(x, w))


def test_ops_defaults_rejection_sample_logits():
    g = torch.Generator().manual_seed(6)
    logits, qd = torch.randn(2, 10, generator=g), torch.rand(2, 6, generator=g).softmax(-1)
    d2t, tok, u = torch.arange(6), torch.tensor([1, 3]), torch.rand(2, 2, generator=g)
    same(torch.ops.spd.rejection_sample_logits(logits, qd, d2t, tok, u),
         rejection_sample_logits(logits, qd, d2t, tok, u))


def test_ops_defaults_truncate_kv_anchor_attention():
    lengths = torch.tensor([4, 6])
    torch.ops.spd.truncate_kv_(lengths, torch.tensor(5), [])
    same(lengths, torch.tensor([4, 5]))
    anchors, types = torch.randn(2, 3, 4), torch.tensor([0, 1, 1])
    weights = [torch.randn(5, 4), torch.randn(5, 8)]
    same(torch.ops.spd.anchor_projection(anchors, types, weights, [None, None]),
         anchor_projection(anchors, types, weights))
    q, kc, vc = torch.randn(2, 3, 8), torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    start = torch.tensor(1)
    same(torch.ops.spd.cache_attention(q, kc, vc, start), cache_attention(q, kc, vc, start))


def test_version_and_py_typed():
    assert isinstance(spd_kernels.__version__, str) and spd_kernels.__version__
    from importlib import resources
    assert resources.files("spd_kernels").joinpath("py.typed").is_file()
