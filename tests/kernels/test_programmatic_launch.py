"""Programmatic dependent launch (SPD_PDL=1, `spd_kernels._cuda.programmatic_launch`).

With it on, every kernel of the CUDA extension, and the Triton kernels of the PDM step's graph,
may start before the kernel ahead of it on the stream has finished, and waits for that one
(pdl_wait in csrc/kernels/common.cuh, pdl_enter in _triton.py) before it touches memory. A kernel that
read or wrote too early would race with its predecessor. The host emulation checks that every
thread of every CUDA kernel reaches the wait (tests/test_kernels_cuda_ext.py), the sm_90
compile check that the Triton kernels wait exactly when PDL is set
(tests/kernels/test_gpu_compile.py); on a GPU
these tests check that long back-to-back chains of every op give the same bits with and without
it, eagerly and replayed from one CUDA graph, on each backend. Every kernel sums in a fixed
order, so any difference is a race, not rounding.
"""
from contextlib import nullcontext

import pytest
import torch
from conftest import needs_gpu

from spd.model.layers import rope_table
from spd_kernels import (
    _cuda,
    anchor_projection,
    dispatch,
    pdm_step,
    rejection_sample_logits,
    truncate_kv_,
    verify_greedy,
)
from spd_kernels.pdm import LayerWeights, PDMWeights
from spd_kernels.testing import SIMT_SKIP_REASON, TRITON_DEVICE, TRITON_SKIP_REASON

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
gpu = pytest.mark.gpu
QWEN3_4B = dict(d=2560, H=32, KVH=8, hd=128, inter=9728, vd=32000, V=151936, S=2048, start=1000)
SMALL = dict(d=64, H=4, KVH=2, hd=64, inter=96, vd=200, V=300, S=80, start=20)

OPS = ("anchor_projection", "qkv_rope_append", "cache_attention", "fused_linear", "fused_swiglu",
       "verify_greedy", "rejection_sample_logits", "truncate_kv")


def _require_backend(backend="cuda", device="cuda"):
    missing = [op for op in OPS if backend not in dispatch.available(op, device)]
    if missing:
        pytest.skip(f"no {backend} backend here for {', '.join(missing)}")


class Chain:
    """One draft-rank cycle's worth of kernels (2 PDM layers, 9 rows; Qwen3-4B widths on a GPU),
    every op on one backend, each consuming what the one before wrote: anchor projection ->
    PDM step (QKV / RoPE / append, attention, o_proj, SwiGLU, down, head) -> greedy verify of
    the features -> rejection sampling from the draft logits -> KV truncation with poison."""

    def __init__(self, seed=0, device="cuda", dims=QWEN3_4B, backend="cuda"):
        dev, dt, self.backend = device, torch.bfloat16, backend
        g = torch.Generator(device=dev).manual_seed(seed)
        r = lambda *s, sc=1.0: (torch.randn(*s, generator=g, device=dev) * sc).to(dt)
        one = lambda n: (torch.rand(n, generator=g, device=dev) + 0.5).to(dt)
        d, H, KVH, hd, inter, vd, V = (dims[k] for k in ("d", "H", "KVH", "hd", "inter", "vd", "V"))
        L, m, p0 = 2, 5, dims["start"]
        self.R, self.S, self.p0 = 9, dims["S"], p0
        self.anchors = r(m, self.R, d)
        self.types = torch.tensor([4, 4, 4, 4, 4, 3, 2, 1, 0], device=dev)
        self.proj = [r(d, (e + 1) * d, sc=((e + 1) * d) ** -0.5) for e in range(m)]
        self.bias = [r(d, sc=0.1) for _ in range(m)]
        layers = [LayerWeights(one(d), r(H * hd, d, sc=d ** -0.5), r(KVH * hd, d, sc=d ** -0.5),
                               r(KVH * hd, d, sc=d ** -0.5), one(hd), one(hd),
                               r(d, H * hd, sc=d ** -0.5), one(d), r(inter, d, sc=d ** -0.5),
                               r(inter, d, sc=d ** -0.5), r(d, inter, sc=inter ** -0.5))
                  for _ in range(L)]
        self.w = PDMWeights(layers, one(d), r(vd, d, sc=d ** -0.5), H, KVH, hd, 1e-6)
        self.cos, self.sin = (t.to(device=dev, dtype=dt) for t in rope_table(hd, self.S, 1e6))
        self.k0, self.v0 = r(L, KVH, self.S, hd), r(L, KVH, self.S, hd)
        self.start = torch.tensor([p0], device=dev)
        self.head = r(V, d, sc=d ** -0.5)
        self.final_norm = one(d)
        self.draft = torch.randint(0, V, (self.R,), generator=g, device=dev)
        self.q = torch.softmax(torch.randn(1, vd, generator=g, device=dev), -1)
        self.d2t = torch.arange(vd, device=dev)
        self.seed = torch.tensor([11], device=dev)
        self.offset = torch.zeros(1, dtype=torch.int64, device=dev)
        self.k, self.v = self.k0.clone(), self.v0.clone()
        self.lengths = torch.empty(L, dtype=torch.int64, device=dev)
        self.new_lengths = torch.full((L,), p0 + self.R, device=dev)
        self.reset()

    def reset(self):
        """The starting state, in place (a captured graph keeps these addresses)."""
        self.k.copy_(self.k0)
        self.v.copy_(self.v0)
        self.lengths.fill_(self.p0 + self.R + 8)  # truncation poisons 8 rows past the chunk
        self.offset.zero_()

    def __call__(self):
        feats = anchor_projection(self.anchors, self.types, self.proj, self.bias,
                                  backend=self.backend)
        logits = pdm_step(feats, self.w, self.k, self.v, self.start, self.cos, self.sin,
                          backend=self.backend)
        target, accepted = verify_greedy(feats, self.final_norm, 1e-6, self.head, self.draft,
                                         backend=self.backend)
        token, taken = rejection_sample_logits(
            logits[None], self.q, self.d2t, target[-1:] % self.q.shape[1], temperature=0.8,
            top_k=50, top_p=0.9, philox_seed=self.seed, philox_offset=self.offset,
            backend=self.backend)
        truncate_kv_(self.lengths, self.new_lengths, [self.k, self.v], poison=True,
                     backend=self.backend)
        return [feats, logits, target, accepted, token, taken, self.k, self.v, self.lengths]


def _run_eagerly(chain, pdl, times):
    chain.reset()
    outs = []
    with _cuda.programmatic_launch(pdl):
        for _ in range(times):  # back to back on one stream, no sync in between
            outs.append([t.clone() for t in chain()])
    if chain.k.is_cuda:
        torch.cuda.synchronize()
    return outs


def _assert_same_bits(got, want):
    for step, (a, b) in enumerate(zip(got, want)):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                               y.view(torch.uint8) if y.is_floating_point() else y), (step, i)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_chain_on_the_cpu(backend):
    """The chain below at small widths, in the host emulation (cuda: every kernel in it reaches
    its pdl_wait(), the emulation fails the launch otherwise) or the Triton interpreter (which
    never launches programmatically), so the GPU tests' own code runs here too."""
    if backend == "cuda" and SIMT_SKIP_REASON is not None:
        pytest.skip(str(SIMT_SKIP_REASON))
    if backend == "triton" and TRITON_DEVICE != "cpu":
        pytest.skip(TRITON_SKIP_REASON or "the Triton interpreter is not active")
    with _cuda.simulated() if backend == "cuda" else nullcontext():
        _require_backend(backend, "cpu")
        chain = Chain(device="cpu", dims=SMALL, backend=backend)
        outs = _run_eagerly(chain, True, 2)
    assert not torch.isnan(outs[-1][1]).any()
    assert torch.isnan(outs[0][6][:, :, chain.p0 + chain.R:chain.p0 + chain.R + 8]).all()
    assert (outs[0][8] == chain.p0 + chain.R).all()


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_every_op_gives_the_same_bits_with_programmatic_launch(backend):
    _require_backend(backend)
    chain = Chain(backend=backend)
    plain = _run_eagerly(chain, False, 6)
    assert not torch.isnan(plain[-1][1]).any()  # the draft logits are real numbers
    _assert_same_bits(_run_eagerly(chain, True, 6), plain)


@gpu
@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_graph_captured_with_programmatic_launch_replays_the_same_bits(backend):
    """The runtime's case: the chain captured once as a CUDA graph with programmatic edges,
    replayed back to back, against the same replays of a graph captured without them."""
    _require_backend(backend)
    chain = Chain(seed=1, backend=backend)
    results = {}
    for pdl in (False, True):
        with _cuda.programmatic_launch(pdl):
            chain.reset()
            chain()  # compile / plan outside the capture
            torch.cuda.synchronize()
            chain.reset()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = chain()
        chain.reset()
        replays = []
        for _ in range(8):
            graph.replay()
            replays.append([t.clone() for t in outs])
        torch.cuda.synchronize()
        results[pdl] = replays
        del graph
    _assert_same_bits(results[True], results[False])
    assert torch.isnan(results[True][0][6][:, :, chain.p0 + chain.R:chain.p0 + chain.R + 8]).all()
