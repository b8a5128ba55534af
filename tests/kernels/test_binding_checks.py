"""The launch wrappers' buffer checks (csrc/bindings/checks.h), through the host emulation.

Handed tensors instead of bare addresses, every binding checks that each one holds the bytes
the kernel will touch given the size and stride arguments (the storage's bytes past the
tensor's offset, so views into bigger buffers stay legal), that its dtype is the one the dtype
code or index flag names, and that it is on the kernels' device. Each case below builds every
buffer as a flat tensor of exactly the elements the kernel reaches (this file's own count of
them): the call must run (and give the right answer), and one element fewer of any buffer, a
wrong stride or a wrong dtype must be a ValueError naming the binding and the argument. Under
tests/sanitize_emulation.sh (the names say "emulation") the exact sizes also show the kernels
reach no further than that count.
"""
from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import needs_simt

from spd_kernels import _cuda

pytestmark = needs_simt

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
CODE = {F32: 0, BF16: 1, F16: 2}
# A dtype of the same element size that no buffer of the kernels takes in its place.
OTHER = {F32: torch.int32, torch.int32: F32, BF16: F16, F16: BF16, torch.int64: torch.float64,
         torch.bool: torch.uint8}


def flat(dtype, n, fill="randn", seed=0):
    g = torch.Generator().manual_seed(seed)
    if fill == "randn":
        return torch.randn(n, generator=g).to(dtype)
    if fill == "nan":
        return torch.full((n,), float("nan"), dtype=dtype)
    return torch.zeros(n, dtype=dtype)


def view(t, shape, strides):
    return t.as_strided(shape, strides)


class Case:
    """A valid call: kwargs (buffers as flat tensors of exactly their extent), the extent and
    dtype of each buffer, the strides that place a buffer (stride argument -> buffer it
    moves), and check(kwargs) for the result."""

    def __init__(self, binding, kwargs, strides=(), check=None):
        self.binding, self.kwargs, self.strides, self.check = binding, kwargs, dict(strides), check

    def buffers(self):
        return [k for k, v in self.kwargs.items() if isinstance(v, torch.Tensor)]


def rms_rows(x, g, eps, dtype):
    """The kernels' RMSNorm: (x * rstd) rounded to the model dtype, times g, rounded again."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (g.float() * (xf * rstd).to(dtype).float()).to(dtype)


def case_verify_greedy():
    R, D, V, sh = 2, 64, 40, 72
    nb = 5  # verify_greedy_num_blocks(40)
    kw = dict(hidden=flat(F32, (R - 1) * sh + D), stride_h=sh, norm_weight=flat(F32, D, seed=1),
              weight=flat(F32, V * D, seed=2), stride_w=D,
              draft=torch.tensor([3, 7], dtype=torch.int64), draft_i64=True,
              pval=flat(F32, R * nb, "zeros"), pidx=flat(torch.int32, R * nb, "zeros"),
              target=flat(torch.int64, R, "zeros"), accepted=flat(torch.bool, R, "zeros"),
              R=R, D=D, V=V, eps=1e-6, norm_offset=0.0, dtype=0, stream=0)

    def check(kw):
        h = view(kw["hidden"], (R, D), (sh, 1))
        logits = rms_rows(h, kw["norm_weight"], 1e-6, F32) @ kw["weight"].view(V, D).T
        want = logits.argmax(-1)
        assert kw["target"].tolist() == want.tolist()
        assert kw["accepted"].tolist() == (want == kw["draft"]).tolist()

    return Case("verify_greedy", kw, {"stride_h": "hidden", "stride_w": "weight"}, check)


def case_rejection_sample():
    R, V, sx = 2, 40, 48
    kw = dict(x=flat(F32, (R - 1) * sx + V), stride_x=sx, x_dtype=0,
              q=flat(F32, R * V, seed=1).abs(), stride_q=V, q_dtype=0, t2d=None,
              tok=torch.tensor([1, 5], dtype=torch.int64), tok_i64=True,
              u=torch.tensor([0.5, 0.25, 0.9, 0.1]), stride_u=2, seed=None, offset=None,
              out_tok=flat(torch.int64, R, "zeros"), out_acc=flat(torch.bool, R, "zeros"),
              R=R, V=V, temperature=1.0, top_k=0, top_p=1.0, from_logits=True, stream=0)

    def check(kw):
        tok, acc = kw["out_tok"], kw["out_acc"]
        assert all(0 <= t < V for t in tok.tolist())
        assert all(t == d for t, d, a in zip(tok.tolist(), [1, 5], acc.tolist()) if a)

    return Case("rejection_sample", kw, {"stride_x": "x", "stride_q": "q", "stride_u": "u"},
                check)


def case_rejection_sample_mapped():
    """q on a draft vocabulary of 10 through t2d, uniforms from Philox (seed, offset)."""
    R, V, vq = 2, 40, 10
    t2d = torch.full((V,), -1, dtype=torch.int32)
    t2d[torch.arange(0, 2 * vq, 2)] = torch.arange(vq, dtype=torch.int32)
    kw = dict(x=flat(F32, R * V), stride_x=V, x_dtype=0, q=flat(F32, R * vq, seed=1).abs(),
              stride_q=vq, q_dtype=0, t2d=t2d, tok=torch.tensor([2, 4], dtype=torch.int32),
              tok_i64=False, u=None, stride_u=0, seed=torch.tensor([7]),
              offset=torch.tensor([0]), out_tok=flat(torch.int64, R, "zeros"),
              out_acc=flat(torch.bool, R, "zeros"), R=R, V=V, temperature=0.7, top_k=5,
              top_p=0.9, from_logits=True, stream=0, q_cols=vq)

    def check(kw):
        assert all(0 <= t < V for t in kw["out_tok"].tolist())

    return Case("rejection_sample", kw, {"stride_x": "x", "stride_q": "q"}, check)


def case_mma_selftest():
    kw = dict(a=flat(BF16, 16 * 16), b=flat(BF16, 8 * 16, seed=1), c=flat(F32, 16 * 8, "zeros"),
              dtype=1, stream=0)

    def check(kw):
        want = kw["a"].view(16, 16).float() @ kw["b"].view(8, 16).float().T
        torch.testing.assert_close(kw["c"].view(16, 8), want, rtol=1e-4, atol=1e-4)

    return Case("mma_selftest", kw, (), check)


def _anchor_case(binding, dtype):
    M, R, D, N, sar = 2, 3, 64, 8, 72
    sam = R * sar
    weights = [flat(dtype, N * D, seed=3), flat(dtype, N * 2 * D, seed=4)]
    bias = flat(dtype, N, seed=5)
    table = torch.tensor([[w.data_ptr() for w in weights], [bias.data_ptr(), 0]])
    kw = dict(anchors=flat(dtype, (M - 1) * sam + (R - 1) * sar + D), stride_am=sam,
              stride_ar=sar, types=torch.tensor([1, 0, 1]), types_i64=True, table=table.view(-1),
              out=flat(dtype, R * N, "nan"), stride_or=N)
    if binding == "anchor_projection_mma":
        items = 3  # anchor_projection_items(2, 64, 64): 1 + 2 splits of 64 columns
        kw.update(ws=flat(F32, items * R * N, "zeros"), M=M, R=R, D=D, N=N, k_per=64,
                  dtype=CODE[dtype], stream=0)
    else:
        kw.update(M=M, R=R, D=D, N=N, dtype=CODE[dtype], vectorized=False, stream=0)

    def check(kw):
        keep = (weights, bias)  # the table holds their addresses
        a = view(kw["anchors"], (M, R, D), (sam, sar, 1)).float()
        for r, e in enumerate(kw["types"].tolist()):
            cat = torch.cat([a[j, r] for j in range(e + 1)])
            want = keep[0][e].view(N, (e + 1) * D).float() @ cat
            if e == 0:
                want = want + keep[1].float()
            torch.testing.assert_close(kw["out"][r * N:(r + 1) * N].float(), want,
                                       rtol=2e-2, atol=2e-2 * float(want.abs().max()))

    return Case(binding, kw, {"stride_am": "anchors", "stride_ar": "anchors"}, check)


def case_anchor_projection_mma():
    return _anchor_case("anchor_projection_mma", BF16)


def case_anchor_projection():
    return _anchor_case("anchor_projection", F32)


def case_fused_linear():
    R, N, K, sx = 2, 32, 64, 72
    kw = dict(x=flat(BF16, (R - 1) * sx + K), stride_x=sx, norm_weight=None, xn=None,
              w0=flat(BF16, N * K, seed=1), w1=None, residual=None, stride_res=0,
              out=flat(BF16, R * N, "nan"), stride_out=N, ws=None, R=R, N=N, K=K, splits=1,
              k_per=64, eps=1e-6, dtype=1, stream=0)

    def check(kw):
        x = view(kw["x"], (R, K), (sx, 1)).float()
        want = x @ kw["w0"].view(N, K).float().T
        torch.testing.assert_close(kw["out"].view(R, N).float(), want, rtol=2e-2,
                                   atol=2e-2 * float(want.abs().max()))

    return Case("fused_linear", kw, {"stride_x": "x"}, check)


def case_fused_swiglu_norm_residual():
    """Every buffer of the kernel: norm (xn), SwiGLU (w1), residual, two K splits (ws)."""
    R, N, K, sx, sres, sout = 2, 32, 64, 72, 40, 48
    kw = dict(x=flat(BF16, (R - 1) * sx + K), stride_x=sx, norm_weight=flat(BF16, K, seed=1),
              xn=flat(BF16, R * K, "zeros"), w0=flat(BF16, N * K, seed=2),
              w1=flat(BF16, N * K, seed=3), residual=flat(BF16, (R - 1) * sres + N, seed=4),
              stride_res=sres, out=flat(BF16, (R - 1) * sout + N, "nan"), stride_out=sout,
              ws=flat(F32, 2 * 2 * R * N, "zeros"), R=R, N=N, K=K, splits=2, k_per=32,
              eps=1e-6, dtype=1, stream=0)

    def check(kw):
        xn = rms_rows(view(kw["x"], (R, K), (sx, 1)), kw["norm_weight"], 1e-6, BF16).float()
        a = xn @ kw["w0"].view(N, K).float().T
        up = xn @ kw["w1"].view(N, K).float().T
        want = torch.nn.functional.silu(a) * up + view(kw["residual"], (R, N), (sres, 1)).float()
        got = view(kw["out"], (R, N), (sout, 1)).float()
        torch.testing.assert_close(got, want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))

    return Case("fused_linear", kw, {"stride_x": "x", "stride_res": "residual",
                                     "stride_out": "out"}, check)


def case_rope_append():
    rows, H, KVH, S, P, HD = 2, 4, 2, 8, 8, 64
    sq, sk, scs = H * HD + 8, KVH * HD + 8, HD + 8
    kw = dict(qp=flat(BF16, (rows - 1) * sq + H * HD), stride_qp=sq,
              kp=flat(BF16, (rows - 1) * sk + KVH * HD, seed=1), stride_kp=sk,
              vp=flat(BF16, (rows - 1) * sk + KVH * HD, seed=2), stride_vp=sk,
              q_norm=flat(BF16, HD, seed=3), k_norm=flat(BF16, HD, seed=4),
              cos=flat(BF16, (P - 1) * scs + HD, seed=5), sin=flat(BF16, (P - 1) * scs + HD, seed=6),
              stride_cs=scs, start=torch.tensor([3]), q_out=flat(BF16, H * rows * HD, "nan"),
              k_cache=flat(BF16, KVH * S * HD, "nan"), v_cache=flat(BF16, KVH * S * HD, "nan"),
              rows=rows, H=H, KVH=KVH, S=S, P=P, HD=HD, eps=1e-6, dtype=1, stream=0)

    def check(kw):
        vp = view(kw["vp"], (rows, KVH, HD), (sk, HD, 1))
        v = kw["v_cache"].view(KVH, S, HD)
        k = kw["k_cache"].view(KVH, S, HD)
        assert torch.equal(v[:, 3:5], vp.transpose(0, 1))
        assert not k[:, 3:5].isnan().any() and k[:, :3].isnan().all() and k[:, 5:].isnan().all()
        assert not kw["q_out"].isnan().any()

    return Case("rope_append", kw, {"stride_qp": "qp", "stride_kp": "kp", "stride_vp": "vp",
                                    "stride_cs": "cos"}, check)


def case_cache_attention():
    H, R, KVH, S, HD, start = 4, 2, 2, 64, 64, 40
    G = H // KVH
    sqr, sqh, scs, sch, sor = HD + 8, 2 * (HD + 8), HD, S * HD + 8, H * HD + 8
    kv = (KVH - 1) * sch + (S - 1) * scs + HD
    kw = dict(q=flat(BF16, (H - 1) * sqh + (R - 1) * sqr + HD), stride_qh=sqh, stride_qr=sqr,
              k=flat(BF16, kv, seed=1), v=flat(BF16, kv, seed=2), stride_ch=sch, stride_cs=scs,
              start=torch.tensor([start]), out=flat(BF16, (R - 1) * sor + H * HD, "nan"),
              stride_or=sor, ws=flat(F32, KVH * 2 * R * G * (HD + 2), "zeros"), H=H, R=R,
              KVH=KVH, S=S, HD=HD, splits=2, chunk=32, scale_log2=HD ** -0.5 * math.log2(math.e),
              dtype=1, stream=0)

    def check(kw):
        q = view(kw["q"], (H, R, HD), (sqh, sqr, 1)).float()
        k = view(kw["k"], (KVH, S, HD), (sch, scs, 1)).float()
        v = view(kw["v"], (KVH, S, HD), (sch, scs, 1)).float()
        out = view(kw["out"], (R, H, HD), (sor, HD, 1)).float()
        for r in range(R):
            for h in range(H):
                j, n = h // G, start + r + 1
                p = torch.softmax(k[j, :n] @ q[h, r] * HD ** -0.5, -1)
                torch.testing.assert_close(out[r, h], p @ v[j, :n], rtol=2e-2, atol=2e-2)

    return Case("cache_attention", kw, {"stride_qh": "q", "stride_qr": "q", "stride_ch": "k",
                                        "stride_cs": "k", "stride_or": "out"}, check)


def case_kv_truncate():
    kw = dict(lengths=torch.tensor([9, 9, 4]), new_lengths=torch.tensor([3, 12, -1]),
              new_stride=1, C=3, stream=0)

    def check(kw):
        assert kw["lengths"].tolist() == [3, 9, 0]

    return Case("kv_truncate", kw, (), check)


def case_kv_poison():
    C, outer, S, inner = 2, 2, 8, 4
    bufs = [flat(BF16, C * outer * S * inner, seed=i) for i in range(2)]
    before = [b.clone() for b in bufs]
    kw = dict(lengths=torch.tensor([6, 8]), new_lengths=torch.tensor([3]), new_stride=0,
              table=torch.tensor([b.data_ptr() for b in bufs]), n_buffers=2, C=C, outer=outer,
              S=S, inner=inner, dtype=1, stream=0)

    def check(kw):
        for b, old in zip(bufs, before):
            b, old = b.view(C, outer, S, inner), old.view(C, outer, S, inner)
            assert b[0, :, 3:6].isnan().all() and b[1, :, 3:8].isnan().all()
            assert torch.equal(b[0, :, :3], old[0, :, :3]) and torch.equal(b[0, :, 6:], old[0, :, 6:])
            assert torch.equal(b[1, :, :3], old[1, :, :3])

    return Case("kv_poison", kw, (), check)


def case_selftest():
    kw = dict(which=0, out=flat(torch.int32, 64 * 9, "zeros"))

    def check(kw):
        assert kw["out"].view(64, 9)[:, 8].tolist() == [64] * 64  # blockIdx * 100 + blockDim

    return Case("selftest", kw, (), check)


CASES = {f.__name__[len("case_"):]: f for f in (
    case_verify_greedy, case_rejection_sample, case_rejection_sample_mapped, case_mma_selftest,
    case_anchor_projection_mma, case_anchor_projection, case_fused_linear,
    case_fused_swiglu_norm_residual, case_rope_append, case_cache_attention, case_kv_truncate,
    case_kv_poison, case_selftest)}


def call(case: Case, **changes):
    kwargs = {**case.kwargs, **changes}
    with _cuda.simulated() as sim:
        getattr(sim, case.binding)(**kwargs)
    return kwargs


def refused(case: Case, message: str, **changes):
    with pytest.raises(ValueError, match=rf"spd_kernels\._spd_simt\.{case.binding}: {message}"):
        call(case, **changes)


def test_every_launching_binding_has_a_case():
    with _cuda.simulated() as sim:
        launching = {n for n in dir(sim) if not n.startswith("_")} - {
            "anchor_projection_items", "runtime_version", "verify_greedy_num_blocks",
            "host_emulation", "programmatic_launch", "set_programmatic_launch", "device_count",
            "set_multiprocessors"}
    assert launching == {f().binding for f in CASES.values()}


@pytest.mark.parametrize("name", CASES)
def test_emulation_valid_call_with_exact_buffers_runs(name):
    case = CASES[name]()
    kwargs = call(case)
    case.check(kwargs)


SHORT = [(name, arg) for name, f in CASES.items() for arg in f().buffers()]


@pytest.mark.parametrize("name,arg", SHORT, ids=[f"{n}-{a}" for n, a in SHORT])
def test_emulation_buffer_one_element_short_is_refused(name, arg):
    case = CASES[name]()
    t = case.kwargs[arg]
    n, size = t.numel(), t.element_size()
    # n - 1 elements past the offset of a view 16 bytes into its storage (aligned)
    short = torch.zeros(n - 1 + 16 // size, dtype=t.dtype)[16 // size:]
    if n == 1:  # torch gives an empty tensor the address 0: refused as a missing buffer
        refused(case, rf"(\w+, )?{arg}(, \w+)?: expected (a buffer address|both buffers).*(null|{arg}=0)",
                **{arg: short})
        return
    refused(case, rf"{arg} holds {(n - 1) * size} bytes past its offset but the kernel "
                  rf"(reads|writes|reads and writes) {n * size} \(", **{arg: short})


STRIDES = [(name, stride, buf) for name, f in CASES.items() for stride, buf in f().strides.items()]


@pytest.mark.parametrize("name,stride,buf", STRIDES, ids=[f"{n}-{s}" for n, s, _ in STRIDES])
def test_emulation_wrong_stride_is_refused(name, stride, buf):
    """A stride 8 elements too large (alignment kept) reaches past the buffer it places."""
    case = CASES[name]()
    bad = case.kwargs[stride] + 8
    refused(case, rf"{buf} holds \d+ bytes past its offset but the kernel "
                  rf"(reads|writes|reads and writes) \d+ \(.*{stride}={bad}", **{stride: bad})


DTYPES = SHORT


@pytest.mark.parametrize("name,arg", DTYPES, ids=[f"{n}-{a}" for n, a in DTYPES])
def test_emulation_buffer_of_another_dtype_is_refused(name, arg):
    """The same bytes in a dtype the kernel does not take there."""
    case = CASES[name]()
    t = case.kwargs[arg]
    other = torch.zeros(t.numel(), dtype=OTHER[t.dtype])
    refused(case, rf"{arg}: the kernel (reads|writes|reads and writes) \w+.* but the tensor is "
                  rf"{re.escape(str(other.dtype))}", **{arg: other})


# (case, dtype argument, a wrong value, the first buffer it contradicts, what the kernel reads)
CODES = [
    ("verify_greedy", "dtype", 1, "hidden", r"bfloat16 \(dtype=1\)"),
    ("rejection_sample", "x_dtype", 2, "x", r"float16 \(x_dtype=2\)"),
    ("rejection_sample", "q_dtype", 1, "q", r"bfloat16 \(q_dtype=1\)"),
    ("rejection_sample", "tok_i64", False, "tok", r"int32 \(tok_i64=False\)"),
    ("rejection_sample_mapped", "tok_i64", True, "tok", r"int64 \(tok_i64=True\)"),
    ("verify_greedy", "draft_i64", False, "draft", r"int32 \(draft_i64=False\)"),
    ("mma_selftest", "dtype", 2, "a", r"float16 \(dtype=2\)"),
    ("anchor_projection_mma", "dtype", 2, "anchors", r"float16 \(dtype=2\)"),
    ("anchor_projection_mma", "types_i64", False, "types", r"int32 \(types_i64=False\)"),
    ("anchor_projection", "dtype", 1, "anchors", r"bfloat16 \(dtype=1\)"),
    ("fused_linear", "dtype", 2, "x", r"float16 \(dtype=2\)"),
    ("fused_swiglu_norm_residual", "dtype", 2, "x", r"float16 \(dtype=2\)"),
    ("rope_append", "dtype", 2, "qp", r"float16 \(dtype=2\)"),
    ("cache_attention", "dtype", 2, "q", r"float16 \(dtype=2\)"),
]


@pytest.mark.parametrize("name,arg,bad,buf,reads", CODES, ids=[f"{c[0]}-{c[1]}" for c in CODES])
def test_emulation_dtype_code_contradicting_the_tensor_is_refused(name, arg, bad, buf, reads):
    case = CASES[name]()
    dtype = case.kwargs[buf].dtype
    refused(case, rf"{buf}: the kernel reads {reads} but the tensor is {re.escape(str(dtype))}",
            **{arg: bad})


def test_emulation_view_into_a_wider_buffer_is_accepted():
    """x as the first 64 columns of [2, 72] rows: fewer elements than the kernel reads from its
    start (numel 128 < 136), but its storage holds them."""
    case = CASES["fused_linear"]()
    wide = torch.randn(2, 72).to(BF16)
    x = wide[:, :64]
    assert x.numel() < (2 - 1) * 72 + 64
    kwargs = call(case, x=x)
    want = x.float() @ kwargs["w0"].view(32, 64).float().T
    torch.testing.assert_close(kwargs["out"].view(2, 32).float(), want, rtol=2e-2,
                               atol=2e-2 * float(want.abs().max()))
    # the same view one row further on: its storage ends 72 elements short of the second row
    refused(case, r"x holds 144 bytes past its offset but the kernel reads 272 ",
            x=wide[1:, :64])


def test_emulation_misaligned_16_byte_pieces_are_refused():
    case = CASES["cache_attention"]()
    q = case.kwargs["q"]
    shifted = torch.zeros(q.numel() + 1, dtype=q.dtype)[1:]
    refused(case, r"q: expected an address aligned to 16 bytes \(bfloat16, read in 16-byte "
                  r"pieces\), got \d+ \(2 past a multiple\)", q=shifted)
    refused(case, r"stride_qr: expected a multiple of 8 \(rows read in 16-byte pieces\), got 76",
            stride_qr=76)


def test_emulation_negative_counts_are_refused():
    refused(CASES["fused_linear"](), r"R: expected >= 0 \(rows of x\), got -1", R=-1)
    refused(CASES["cache_attention"](), r"R: expected >= 0 \(rows of q\), got -2", R=-2)
    refused(CASES["kv_poison"](), r"C: expected >= 0 \(caches\), got -1", C=-1)
    refused(CASES["selftest"](), r"which: expected 0, 1 or 2, got 3", which=3)


class _OnAGpu:
    """A tensor that says it lives on cuda:0 (the emulation must refuse it by name)."""

    def __init__(self, t):
        self._t = t
        self.dtype, self.is_cuda, self.is_cpu = t.dtype, True, False

    def data_ptr(self):
        return self._t.data_ptr()

    def storage_offset(self):
        return self._t.storage_offset()

    def element_size(self):
        return self._t.element_size()

    def untyped_storage(self):
        return self._t.untyped_storage()

    def get_device(self):
        return 0


def test_emulation_refuses_tensors_off_the_host():
    case = CASES["fused_linear"]()
    refused(case, r"w0: expected a CPU tensor \(the host emulation runs the kernels on host "
                  r"memory\), got one on cuda:0", w0=_OnAGpu(case.kwargs["w0"]))


def test_emulation_bare_addresses_and_none_still_work():
    """The Python launchers pass data_ptr() ints (and 0 or None for absent buffers): those are
    still accepted (their extent is theirs to check)."""
    case = CASES["fused_linear"]()
    kw = {k: (v.data_ptr() if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs.items()}
    kw.update(norm_weight=0, residual=None)
    with _cuda.simulated() as sim:
        sim.fused_linear(**kw)
        with pytest.raises(TypeError):
            sim.fused_linear(**{**kw, "x": -1})
        with pytest.raises(TypeError):
            sim.fused_linear(**{**kw, "w0": True})
    case.check(case.kwargs)
