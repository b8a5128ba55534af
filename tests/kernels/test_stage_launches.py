"""Kernel launches per decoder layer of the graphed one-row stage step, with a GPU's choices.

Why: on an H200 the graphed stage step sat ~43 us per layer above its weight-read floor, a fixed
cost per layer: launches, not bandwidth. This test counts what one `decoder_layer` (the body of
spd_kernels.stage_step, which spd.model.target.Stage captures in a CUDA graph) launches, and fails
when the count grows.

How it counts, and why that is what a GPU launches:
- The backends are the GPU's automatic choice. On a CUDA tensor the dispatcher takes an
  automatic CUDA kernel, else Triton; the four ops of a layer have CUDA kernels on request only
  (checked below), so a GPU runs their Triton kernels. The test forces Triton and runs it in the
  interpreter on CPU tensors.
- The plans are the GPU's: the launchers choose K splits (fused_linear) and key splits
  (cache_attention) by device, one split on a CPU. The test wraps both planners so they plan as
  on an H200 (132 SMs, `GPU_SMS`), which decides whether a second (reduce / combine) launch runs.
- Every Triton launch (`kernel[grid](...)`: the interpreter's InterpretedFunction.run) counts
  one, and while it runs nothing else is counted (the interpreter copies tensors around).
- Every torch op outside a Triton launch that would run a CUDA kernel counts one: an aten op
  seen by a TorchDispatchMode (benchmarks/probe_cycle_launches.py's LaunchCount), except views
  (their result aliases an input: no kernel), allocations (`empty*`, `resize_`: no kernel),
  and host reads of CPU values (`_local_scalar_dense`: the argument checks read `start` only
  when it is on the CPU; on a GPU they do not, and the graph capture would refuse it).
The position is an int64 tensor, as in the graph.
"""
import pytest
import torch
from conftest import bench_module, needs_triton_interpreter
from torch.utils._python_dispatch import _disable_current_modes

from spd_kernels import dispatch, use_backend
from spd_kernels.qkv_rope import pack_qkv
from spd_kernels.stage import LayerWeights, decoder_layer

pytestmark = needs_triton_interpreter

GPU_SMS = 132  # an H200
# What one layer launches now, per kernel, at the shapes below (every product K-split, as at the
# Qwen3 4B / 8B shapes on an H200; attention split over keys):
#   QKV product (RMSNorm fused, one packed product, K-split partial sums)        1
#   fixed-order sum of those partials + bias + q/k norm + RoPE + cache append     1
#   attention, split over keys                                                    1
#   combine of the key splits                                                     1
#   o_proj partial sums, then reduce + residual                                   2
#   RMSNorm + gate/up partial sums, then reduce + SwiGLU                          2
#   down partial sums, then reduce + residual                                     2
# Before the QKV partials' sum moved into the RoPE kernel it was 11 (a reduce launch of its own).
LAUNCHES_PER_LAYER = 10
STAGE_OPS = ("qkv_rope_append", "cache_attention", "fused_linear", "fused_swiglu")


@pytest.fixture
def counted(monkeypatch):
    """(launches, torch ops) lists filled while the GPU's plans are in force."""
    from triton.runtime.interpreter import InterpretedFunction

    from spd_kernels.attention import triton_kernel as attn
    from spd_kernels.linear import triton_kernel as lin
    launches, mode = [], bench_module("probe_cycle_launches").LaunchCount()
    run = InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        launches.append(getattr(self.fn, "__name__", repr(self.fn)))
        with _disable_current_modes():
            return run(self, *args, **kwargs)

    plan = lin.plan

    def gpu_plan(rows, N, K, device, split_k=None, **kw):
        if split_k is None:  # as plan() on a GPU: about two programs per SM
            split_k = -(-2 * GPU_SMS // -(-N // lin.GPU_BLOCK_N))
        return plan(rows, N, K, device, split_k, **kw)

    splits = attn.attention_splits

    def gpu_splits(rows, kv_heads, S, block_n, device, splits_=None):
        return splits(rows, kv_heads, S, block_n, device, 64 if splits_ is None else splits_)

    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    monkeypatch.setattr(lin, "plan", gpu_plan)
    monkeypatch.setattr(attn, "attention_splits", gpu_splits)
    return launches, mode


def _layer(g, d=512, heads=8, kv_heads=2, hd=64, inter=1024, dtype=torch.float32):
    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    wq, wk, wv = pack_qkv(w(heads * hd, d), w(kv_heads * hd, d), w(kv_heads * hd, d))
    return LayerWeights(norm(d), wq, wk, wv, norm(hd), norm(hd), w(d, heads * hd), norm(d),
                        w(inter, d), w(inter, d), w(d, inter))


def test_gpu_runs_the_triton_kernels_of_a_layer():
    """The premise of the count: no automatic CUDA kernel for a layer's ops."""
    for op in STAGE_OPS:
        assert dispatch.has(op, "triton")
        if dispatch.has(op, "cuda"):
            assert dispatch.on_request(op, "cuda"), f"{op}'s CUDA kernel became automatic"


def test_launches_per_layer_of_the_one_row_stage_step(counted):
    launches, mode = counted
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, hd, S, pos = 8, 2, 64, 256, 200
    lw = _layer(g, heads=heads, kv_heads=kv_heads, hd=hd)
    x = torch.randn(1, 512, generator=g)
    k_cache = torch.randn(kv_heads, S, hd, generator=g)
    v_cache = torch.randn(kv_heads, S, hd, generator=g)
    cos, sin = torch.randn(S, hd, generator=g), torch.randn(S, hd, generator=g)
    start = torch.tensor([pos])
    with use_backend("triton"), mode:
        out = decoder_layer(x, lw, k_cache, v_cache, start, cos, sin, heads, kv_heads, 1e-6)
    assert out.shape == x.shape and torch.isfinite(out).all()
    total = len(launches) + len(mode.ops)
    print(f"launches per layer: {total} (Triton {launches}, torch {mode.ops})")
    assert not mode.ops, f"torch ops that would launch CUDA kernels: {mode.ops}"
    assert total <= LAUNCHES_PER_LAYER, (
        f"one decoder layer launches {total} kernels, more than {LAUNCHES_PER_LAYER}: "
        f"{launches}")


def _qkv_inputs(g, dtype, bias, quant, T=3, d=512, heads=8, kv_heads=2, hd=64, S=64):
    from spd_kernels.qkv_rope import pack_back_to_back
    from spd_kernels.quant import quantize_weight
    wq, wk, wv = pack_qkv(*(torch.randn(n * hd, d, generator=g) * d ** -0.5
                            for n in (heads, kv_heads, kv_heads)))
    scales = (None, None, None)
    if quant:  # one quantisation of the packed weight: its scales lie back to back too
        q, s = quantize_weight(torch.cat([wq, wk, wv]), quant)
        wq, wk, wv = q.split([wq.shape[0], wk.shape[0], wv.shape[0]])
        scales = tuple(pack_back_to_back(*s.split([wq.shape[0], wk.shape[0], wv.shape[0]])))
    else:
        wq, wk, wv = pack_qkv(wq.to(dtype), wk.to(dtype), wv.to(dtype))
    x = (torch.randn(T, d, generator=g) * 2).to(dtype)
    norm = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    qn, kn = ((1 + 0.1 * torch.randn(hd, generator=g)).to(dtype) for _ in range(2))
    b = (0.1 * torch.randn((heads + 2 * kv_heads) * hd, generator=g)).to(dtype) if bias else None
    ang = torch.randn(S, hd // 2, generator=g)
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    caches = [torch.randn(kv_heads, S, hd, generator=g).to(dtype) for _ in range(2)]
    return (x, norm, 1e-6, wq, wk, wv, qn, kn, cos, sin, torch.tensor([S - T - 5]), *caches,
            heads, kv_heads, b, *scales)


@pytest.mark.parametrize("dtype,bias,quant", [(torch.float32, True, None),
                                               (torch.bfloat16, False, None),
                                               (torch.bfloat16, True, "int8"),
                                               (torch.float32, False, "fp8")])
def test_qkv_split_sums_in_the_rope_kernel(counted, monkeypatch, dtype, bias, quant):
    """The QKV product's K-split sums added up by the RoPE kernel (the GPU's plan, several
    splits) give bit for bit what the product's own reduce launch followed by the RoPE kernel
    gives, and match the reference. Outputs and caches' new rows poisoned first."""
    from spd_kernels.qkv_rope import qkv_rope_append_reference
    from spd_kernels.qkv_rope import triton_kernel as qk
    from spd_kernels.testing import poisoned_outputs
    launches, _ = counted
    args = _qkv_inputs(torch.Generator().manual_seed(3), dtype, bias, quant)
    T, pos = args[0].shape[0], int(args[10])
    results = []
    for fused in (True, False):
        k_cache, v_cache = args[11].clone(), args[12].clone()
        k_cache[:, pos:pos + T] = float("nan")
        v_cache[:, pos:pos + T] = float("nan")
        a = (*args[:11], k_cache, v_cache, *args[13:])
        launches.clear()
        with monkeypatch.context() as m:
            if not fused:  # the product through fused_linear's own reduce launch
                m.setattr(qk, "_packed_product", lambda *a, **k: None)
            with poisoned_outputs("a"):
                q = qk.qkv_rope_append_triton(*a)
        assert launches.count("_reduce_kernel") == (0 if fused else 1), launches
        results.append((q, k_cache, v_cache))
    for got, want in zip(results[0], results[1]):
        assert torch.equal(got, want)
    k_ref, v_ref = args[11].clone(), args[12].clone()
    q_ref = qkv_rope_append_reference(*args[:11], k_ref, v_ref, *args[13:])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][0], q_ref, **tol)
    torch.testing.assert_close(results[0][1], k_ref, **tol)
    torch.testing.assert_close(results[0][2], v_ref, **tol)
