"""Kernel microbenchmarks: every spd_kernels op against its eager reference and torch.compile of
the reference, at the shapes of SmolLM2-135M, Qwen3-4B and Qwen3-8B.

For each (model, op, case) and each backend that can run here (reference, compile, triton, cuda;
for the PDM step and the cache attention also CUDA-graph replays of the eager reference,
cuda_graph, and of the Triton path, triton_cg, position read on the device; for the PDM step also
triton_attn(_cg): Triton QKV/RoPE/attention with the dense ops in torch, cuda_linear(_cg): the
same with the dense ops (and the QKV products) on the CUDA kernel, and cuda(_cg): every op of the
step on the CUDA kernels; for fused_linear / fused_swiglu
cuda_cg, the CUDA kernel's launches as a graph, and cuda_1split(_cg) / cuda_2x_split(_cg), the same
kernel with one K split or twice its plan's (to tune the plan); for the anchor projection
cuda_mma(_cg), the tensor-core variant (SPD_ANCHOR_VARIANT=mma); for the attention also
triton_1split and cuda_1split(_cg), the keys not split over programs; for sampling triton_1prog,
one program a row
instead of the split-row plan; for greedy verify cuda_kernel, its CUDA kernels through the binding
alone (no Python checks, dispatch or allocation), graphs of every backend, and each row's host
time per call (host_us); for every op with a CUDA kernel also cuda_pdl(_cg), the same
kernels as programmatic dependent launches, SPD_PDL=1, and triton_pdl(_cg) for the Triton kernels
of the PDM step's graph; "int8 ..." cases: fused_linear and the PDM step on weight-only int8
weights, spd_kernels.quant, reference and Triton, floor at one byte a weight) it prints the median
time per call, the bytes the op must move at least (weights it reads once, inputs, outputs), the
achieved GB/s, that as a percentage of this device's measured copy bandwidth, and the time over
the bytes-moved floor (floor = bytes / copy bandwidth). JSON goes to --json-out (default
benchmarks/results/<date>-kernels-<device>.json).

On a GPU it also sets each kernel registered on request only (not yet timed) against what the
automatic choice runs for the same case ("challenger" lines, JSON `challengers`: speedup > 1
argues for making it automatic), and checks the issue's targets (Qwen3-4B shapes): verify within
1.2x of reading the
LM head once; anchor projection within 1.25x of its floor; the PDM step (3 layers, 32k draft
vocabulary, 9 rows) within 1.5x of its weight-read floor and faster than a 4-layer stage; KV
truncation under 5 us with no host synchronisation.

A kernel never run on a GPU may fault there, and a fault takes the process's CUDA context with
it: the run then stops, naming the row that lost it (JSON `context_lost`, exit status 3), instead
of failing every later row with the same error. `--rows on-request` times only the rows of kernels
the automatic choice does not pick yet (registered on request only, the mma anchor variant,
programmatic dependent launch), `--rows automatic` the others, so the two can run in separate
processes; `--merge A.json B.json ... --json-out C.json` joins such runs into one result, targets
and challengers over all rows (benchmarks/device_session.sh does this, one op per process for the
on-request rows). The JSON is rewritten after every row, so a run that is killed keeps its rows.
Run it on a GPU with TRITON_INTERPRET unset:

    TRITON_INTERPRET=0 python benchmarks/bench_kernels.py                # GPU: all (compile: Qwen3-4B)
    TRITON_INTERPRET=0 python benchmarks/bench_kernels.py --models qwen3-4b --compile off \
        --iters 20                                                      # GPU, short device budget
    python benchmarks/bench_kernels.py --iters 3 --warmup 1 --threads 1  # CPU: reference (+ compile
                                                                         # on SmolLM2)
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when loaded by path
from harness import Timer, device_tag, run_meta  # noqa: E402

import spd_kernels
from spd.model.loading import describe_device
from spd_kernels import _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.attention import cache_attention_reference
from spd_kernels.attention.triton_kernel import attention_launch
from spd_kernels.features import anchor_projection_cuda_mma, anchor_projection_reference
from spd_kernels.kv_cache import truncate_kv_reference
from spd_kernels.linear import fused_linear_reference, fused_swiglu_reference
from spd_kernels.on_request.attention_cuda import attention_cuda_launch
from spd_kernels.on_request.linear_cuda import cuda_launch, cuda_plan
from spd_kernels.pdm import STEP_OPS, LayerWeights, PDMWeights, pdm_step, quantize_pdm_weights
from spd_kernels.qkv_rope import pack_qkv, qkv_rope_append_reference
from spd_kernels.quant import quantize_weight
from spd_kernels.testing import cuda_context_error
from spd_kernels.verify import (
    rejection_sample_logits_reference,
    target_to_draft_map,
    triton_rejection,
    verify_greedy_reference,
)
from spd_kernels.verify.tree import tree_rejection_sample_reference


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    vocab: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool


MODELS = {
    "smollm2-135m": Shape("smollm2-135m", 576, 49152, 30, 9, 3, 64, 1536, False),
    "qwen3-4b": Shape("qwen3-4b", 2560, 151936, 36, 32, 8, 128, 9728, True),
    "qwen3-8b": Shape("qwen3-8b", 4096, 151936, 36, 32, 8, 128, 12288, True),
}
# the dispatcher's ops (rejection_sample is timed through rejection_sample_logits; the DeltaNet
# ops by bench_deltanet.py; the cycle's control ops, a few scalars a sequence, inside the cycle
# by bench_cycle.py and counted by probe_cycle_launches.py), then the step
UNBENCHED_OPS = ("rejection_sample", "gated_delta_step", "conv_ring_step", "cycle_open",
                 "cycle_candidate", "cycle_commit", "tree_open", "tree_children", "tree_commit")
OPS = [op for op in dispatch.ops() if op not in UNBENCHED_OPS] + ["pdm_step"]
N_STAGES = 8          # pipeline depth the shapes assume (9 in-flight rows, staircase types)
N_ANCHORS = 5
DRAFT_VOCAB = 32768
PDM_LAYERS = 3
CONTEXT = 1024        # positions already in the caches for the attention-bearing ops
CACHE_CAPACITY = 4096


# --- timing -------------------------------------------------------------------------------------

def copy_bandwidth(device: torch.device, timer: Timer) -> float:
    """GB/s of a large device-to-device copy (bytes read + bytes written)."""
    n = (1024 if device.type == "cuda" else 256) * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    med, _ = timer(lambda: dst.copy_(src))
    src = dst = None  # free the buffers before the timed ops run
    return 2 * n / (med * 1e-6) / 1e9


def host_time(fn, iters: int) -> float:
    """Median host microseconds of one call, from its start until it returns, the GPU idle
    before it (CUDA only)."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def no_host_sync(fn, device) -> bool | None:
    """Whether fn runs without a device->host synchronisation (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


# --- workloads ------------------------------------------------------------------------------------

def staircase_types(device):
    return torch.tensor([min(N_ANCHORS - 1, (k * N_ANCHORS) // (N_STAGES + 1))
                         for k in range(N_STAGES + 1)][::-1], device=device)


def rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype)


def layer_weights(s: Shape, dtype, device) -> LayerWeights:
    """Random weights of one layer, q/k/v packed back to back as the runtime holds them."""
    d, hd = s.hidden, s.head_dim
    sc = d ** -0.5
    lw = LayerWeights(
        rand(d, dtype=dtype, device=device, scale=0.1) + 1,
        rand(s.heads * hd, d, dtype=dtype, device=device, scale=sc),
        rand(s.kv_heads * hd, d, dtype=dtype, device=device, scale=sc),
        rand(s.kv_heads * hd, d, dtype=dtype, device=device, scale=sc),
        (rand(hd, dtype=dtype, device=device, scale=0.1) + 1) if s.qk_norm else None,
        (rand(hd, dtype=dtype, device=device, scale=0.1) + 1) if s.qk_norm else None,
        rand(d, s.heads * hd, dtype=dtype, device=device, scale=sc),
        rand(d, dtype=dtype, device=device, scale=0.1) + 1,
        rand(s.intermediate, d, dtype=dtype, device=device, scale=sc),
        rand(s.intermediate, d, dtype=dtype, device=device, scale=sc),
        rand(d, s.intermediate, dtype=dtype, device=device, scale=s.intermediate ** -0.5))
    lw.wq, lw.wk, lw.wv = pack_qkv(lw.wq, lw.wk, lw.wv)
    return lw


def layer_bytes(lw: LayerWeights) -> int:
    return sum(t.numel() * t.element_size() for t in vars(lw).values() if t is not None)


def rope(s: Shape, dtype, device):
    from spd.model.layers import rope_table  # the runtime's table; any Llama-style table would do
    return rope_table(s.head_dim, CACHE_CAPACITY, 1e6, device=device, dtype=dtype)


def build_cases(op: str, s: Shape, dtype, device):
    """Yield (case name, {backend: callable}, bytes floor, extra) for one op at one shape."""
    d, V = s.hidden, s.vocab
    el = torch.tensor([], dtype=dtype).element_size()
    if op == "verify_greedy":
        hidden = rand(1, d, dtype=dtype, device=device)
        norm = rand(d, dtype=dtype, device=device, scale=0.1) + 1
        head = rand(V, d, dtype=dtype, device=device, scale=d ** -0.5)
        draft = torch.tensor([7], device=device)
        args = (hidden, norm, 1e-6, head, draft)
        fns = {"reference": (verify_greedy_reference, args)}
        fns.update({b: (lambda *a, b=b: spd_kernels.verify_greedy(*a, backend=b), args)
                    for b in ("triton", "cuda")})
        # Rows that separate the kernels from the host path around them (the eager rows' time
        # includes whatever part of that path outlasts the L2 flush before each call):
        # cuda_kernel, the binding called on buffers made once (its checks kept; no Python
        # checks, dispatch or allocation); graphs (cuda_graph, triton_cg, cuda_cg), no host path
        # at all, as the runtime runs verify inside the last stage's graph; host_us per row.
        fns["cuda_kernel"] = (verify_kernel_only(*args), ())
        yield "R=1", fns, V * d * el + 2 * d * el, {"graph": True, "host_time": True}
    elif op == "rejection_sample_logits":
        vd = min(DRAFT_VOCAB, V)
        logits = torch.randn(1, V, device=device) * 3
        q = torch.softmax(torch.randn(1, vd, device=device) * 2, -1)
        d2t = torch.randperm(V, device=device)[:vd]
        tok = d2t[:1].clone()
        u = torch.rand(1, 2, device=device)
        for case, (t, k, p) in {"T=0.8": (0.8, 0, 1.0), "T=0.8,k=50,p=0.9": (0.8, 50, 0.9)}.items():
            args = (logits, q, d2t, tok, u, t, k, p)
            fns = {"reference": (rejection_sample_logits_reference, args)}
            for b in ("triton", "cuda"):  # cuda: one block per row, one launch
                fns[b] = (lambda lg, qq, m, tk, uu, t_, k_, p_, b=b:
                          spd_kernels.rejection_sample_logits(lg, qq, m, tk, uu, temperature=t_,
                                                              top_k=k_, top_p=p_, backend=b), args)
            # the split-row plan's baseline (radix select with top-k / top-p): one program
            # per row (top-k / top-p by the pivot search, no sort)
            t2d = target_to_draft_map(d2t, V)
            fns["triton_1prog"] = (lambda lg, qq, m, tk, uu, t_, k_, p_:
                                   triton_rejection._launch_rejection_logits(
                                       lg, qq, t2d, tk, uu, None, None, t_, k_, p_, chunk=0),
                                   args)
            yield case, fns, V * 4 + vd * 4 + V * 4, {}
    elif op == "tree_rejection_sample":
        # one node's W = 4 candidate children against one row of target logits; the Triton
        # kernel is one program (the pivot-search thresholds of rejection_sample_logits')
        logits = torch.randn(V, device=device) * 3
        cand = torch.randperm(V, device=device)[:4]
        u = torch.rand(5, device=device)
        for case, (t, k, p) in {"W=4,T=0.8": (0.8, 0, 1.0),
                                "W=4,T=0.8,k=50,p=0.9": (0.8, 50, 0.9)}.items():
            args = (logits, cand, u, t, k, p)
            fns = {"reference": (tree_rejection_sample_reference, args)}
            fns["triton"] = (lambda lg, c, uu, t_, k_, p_:
                             spd_kernels.tree_rejection_sample(lg, c, uu, temperature=t_, top_k=k_,
                                                               top_p=p_, backend="triton"), args)
            yield case, fns, V * 4, {}
    elif op == "anchor_projection":
        types = staircase_types(device)
        rows = types.numel()
        store = rand(N_ANCHORS, CONTEXT, d, dtype=dtype, device=device)
        anchors = store[:, CONTEXT - rows:]  # in place: a window of the engine's anchor buffer
        weights = [rand(d, (e + 1) * d, dtype=dtype, device=device, scale=d ** -0.5)
                   for e in range(N_ANCHORS)]
        biases = [rand(d, dtype=dtype, device=device, scale=0.01) for _ in range(N_ANCHORS)]
        args = (anchors, types, weights, biases)
        fns = {"reference": (anchor_projection_reference, args)}
        fns.update({b: (lambda *a, b=b: spd_kernels.anchor_projection(*a, backend=b), args)
                    for b in ("triton", "cuda")})
        if dtype != torch.float32:  # the tensor-core variant (SPD_ANCHOR_VARIANT=mma)
            fns["cuda_mma"] = (anchor_projection_cuda_mma, args)
        present = set(types.tolist())
        floor = sum(weights[e].numel() * el + d * el for e in present)
        floor += sum((int(e) + 1) * d * el for e in types.tolist()) + rows * d * el
        # graphs of the kernels (two launches for cuda_mma); the reference syncs on the types
        yield f"rows={rows},m={N_ANCHORS}", fns, floor, {"graph": True, "graph_reference": False}
    elif op == "truncate_kv":
        C = math.ceil(s.layers / N_STAGES)
        lengths = torch.full((C,), CONTEXT, dtype=torch.int64, device=device)
        new = torch.tensor(CONTEXT, dtype=torch.int64, device=device)  # restored each call
        k = torch.empty(C, s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)

        def wrap(impl):
            def run(*_):
                impl(lengths, new, (k,), -2, False)
            return run
        fns = {"reference": (wrap(truncate_kv_reference), ())}
        fns.update({b: (wrap(lambda *a, b=b: spd_kernels.truncate_kv_(
            a[0], a[1], a[2], seq_dim=a[3], poison=a[4], backend=b)), ()) for b in ("triton", "cuda")})
        yield f"C={C} layers", fns, 2 * C * 8, {"sync_check": True}
    elif op == "qkv_rope_append":
        rows = N_STAGES + 1
        lw = layer_weights(s, dtype, device)
        cos, sin = rope(s, dtype, device)
        kc = torch.zeros(s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        x = rand(rows, d, dtype=dtype, device=device)
        start = torch.tensor([CONTEXT], device=device)
        args = (x, lw.input_norm, 1e-6, lw.wq, lw.wk, lw.wv, lw.q_norm, lw.k_norm, cos, sin,
                start, kc, vc, s.heads, s.kv_heads)
        fns = {"reference": (lambda *a: qkv_rope_append_reference(*a, None), args)}
        fns["triton"] = (lambda *a: spd_kernels.qkv_rope_append(*a, backend="triton"), args)
        fns["cuda"] = (lambda *a: spd_kernels.qkv_rope_append(*a, backend="cuda"), args)
        floor = (lw.wq.numel() + lw.wk.numel() + lw.wv.numel()) * el + rows * d * el * 2
        yield f"rows={rows}", fns, floor, {"graph": True}  # uncaptured, launches dominate
    elif op == "cache_attention":
        rows = N_STAGES + 1
        q = rand(s.heads, rows, s.head_dim, dtype=dtype, device=device)
        kc = rand(s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)
        vc = rand(s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)
        start = torch.tensor([CONTEXT], device=device)
        floor = 2 * s.kv_heads * (CONTEXT + rows) * s.head_dim * el + 2 * q.numel() * el
        fns = {"reference": (cache_attention_reference, (q, kc, vc, start, None)),
               "triton": (lambda *a: spd_kernels.cache_attention(*a, backend="triton"),
                          (q, kc, vc, start, None)),
               "triton_1split": (lambda *a: attention_launch(*a, splits=1),
                                 (q, kc, vc, start, None)),
               "cuda": (lambda *a: spd_kernels.cache_attention(*a, backend="cuda"),
                        (q, kc, vc, start, None)),
               "cuda_1split": (lambda *a: attention_cuda_launch(*a, splits=1),
                               (q, kc, vc, start, None))}
        # start on the device: no host read, the reference masks the whole cache
        yield f"rows={rows},start on device", fns, floor, {"graph": True}
        long_start = torch.tensor([CACHE_CAPACITY - rows], device=device)
        long_floor = 2 * s.kv_heads * CACHE_CAPACITY * s.head_dim * el + 2 * q.numel() * el
        yield (f"rows={rows},context {CACHE_CAPACITY}",
               {k: (f, (q, kc, vc, long_start, None)) for k, (f, _) in fns.items()}, long_floor,
               {"graph": True})
        # start on the host: the reference slices the cache (the eager runtime's path)
        yield (f"rows={rows},start on host",
               {"reference": (cache_attention_reference, (q, kc, vc, CONTEXT, None))}, floor, {})
    elif op == "fused_linear":
        rows = N_STAGES + 1
        vd = min(DRAFT_VOCAB, V)
        inner = s.heads * s.head_dim
        for case, n_rows, K, N, norm, res in (
                (f"o_proj+residual rows={rows}", rows, inner, d, False, True),
                (f"down+residual rows={rows}", rows, s.intermediate, d, False, True),
                (f"norm+head Vd={vd} rows=1", 1, d, vd, True, False)):
            x = rand(n_rows, K, dtype=dtype, device=device)
            w = rand(N, K, dtype=dtype, device=device, scale=K ** -0.5)
            g = rand(K, dtype=dtype, device=device, scale=0.1) + 1 if norm else None
            r = rand(n_rows, N, dtype=dtype, device=device) if res else None
            args = (x, w, g, 1e-6, r)
            fns = {"reference": (fused_linear_reference, args)}
            fns.update({b: (lambda xx, ww, gg, e, rr, b=b: spd_kernels.fused_linear(
                xx, ww, norm_weight=gg, eps=e, residual=rr, backend=b), args)
                for b in ("triton", "cuda")})
            fns.update(cuda_split_variants(N, K, 1, lambda xx, ww, gg, e, rr, split: cuda_launch(
                xx, ww, None, gg, e, rr, split_k=split), args))
            floor = (N * K + n_rows * K + n_rows * N * (2 if res else 1)) * el  # + residual read
            yield case, fns, floor, {"graph": True}
            # the draft step's weight-only int8 weights (spd_kernels.quant): the bytes floor
            # counts one byte a weight and the fp32 row scales; the CUDA kernel refuses them
            q, sc = quantize_weight(w, "int8")
            qargs = (x, q, g, 1e-6, r, sc)
            fns = {"reference": (fused_linear_reference, qargs),
                   "triton": (lambda xx, ww, gg, e, rr, ss: spd_kernels.fused_linear(
                       xx, ww, norm_weight=gg, eps=e, residual=rr, weight_scale=ss,
                       backend="triton"), qargs)}
            floor = N * K + 4 * N + (n_rows * K + n_rows * N * (2 if res else 1)) * el
            yield f"int8 {case}", fns, floor, {"graph": True}
    elif op == "fused_swiglu":
        rows = N_STAGES + 1
        x = rand(rows, d, dtype=dtype, device=device)
        wg = rand(s.intermediate, d, dtype=dtype, device=device, scale=d ** -0.5)
        wu = rand(s.intermediate, d, dtype=dtype, device=device, scale=d ** -0.5)
        g = rand(d, dtype=dtype, device=device, scale=0.1) + 1
        args = (x, g, 1e-6, wg, wu)
        fns = {"reference": (fused_swiglu_reference, args)}
        fns.update({b: (lambda *a, b=b: spd_kernels.fused_swiglu(*a, backend=b), args)
                    for b in ("triton", "cuda")})
        fns.update(cuda_split_variants(s.intermediate, d, 2, lambda xx, gg, e, wg_, wu_, split:
                                       cuda_launch(xx, wg_, wu_, gg, e, split_k=split), args))
        floor = (2 * s.intermediate * d + rows * d + rows * s.intermediate) * el
        yield f"norm+gate/up rows={rows}", fns, floor, {"graph": True}
    elif op == "pdm_step":
        rows = N_STAGES + 1
        vd = min(DRAFT_VOCAB, V)
        cos, sin = rope(s, dtype, device)
        for case, n_layers, head_rows in ((f"PDM {PDM_LAYERS} layers, Vd={vd}", PDM_LAYERS, vd),
                                          ("target stage, 4 layers, 1 row", 4, 1)):
            layers = [layer_weights(s, dtype, device) for _ in range(n_layers)]
            w = PDMWeights(layers, rand(d, dtype=dtype, device=device) + 1,
                           rand(head_rows, d, dtype=dtype, device=device, scale=d ** -0.5),
                           s.heads, s.kv_heads, s.head_dim, 1e-6)
            kc = rand(n_layers, s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)
            vc = rand(n_layers, s.kv_heads, CACHE_CAPACITY, s.head_dim, dtype=dtype, device=device)
            n_rows = rows if head_rows > 1 else 1
            x = rand(n_rows, d, dtype=dtype, device=device)
            args = (x, w, kc, vc, CONTEXT, cos, sin)
            fns = {"reference": (lambda *a: pdm_step(*a, backend="reference"), args)}
            start = torch.tensor([CONTEXT], device=device)  # read on the device by the kernels
            fns["triton"] = (lambda *a: pdm_step(*a, backend="triton"),
                             (x, w, kc, vc, start, cos, sin))
            fns["triton_attn"] = (triton_attention_only, (x, w, kc, vc, start, cos, sin))
            fns["cuda_linear"] = (cuda_linear_layers, (x, w, kc, vc, start, cos, sin))
            fns["cuda"] = (lambda *a: pdm_step(*a, backend="cuda"),
                           (x, w, kc, vc, start, cos, sin))
            floor = sum(layer_bytes(lw) for lw in layers) + w.lm_head.numel() * el
            floor += n_layers * 2 * s.kv_heads * (CONTEXT + n_rows) * s.head_dim * el
            yield case, fns, floor, {"graph": True}
            if head_rows == 1:
                continue
            # the PDM step on int8 weights (PipelineDraftModule.quantize_, --draft-weights int8)
            qw = quantize_pdm_weights(w, "int8")
            fns = {"reference": (lambda *a: pdm_step(*a, backend="reference"),
                                 (x, qw, kc, vc, CONTEXT, cos, sin)),
                   "triton": (lambda *a: pdm_step(*a, backend="triton"),
                              (x, qw, kc, vc, start, cos, sin))}
            floor = sum(layer_bytes(lw) for lw in qw.layers) + qw.lm_head.numel()
            floor += qw.lm_head_scale.numel() * 4
            floor += n_layers * 2 * s.kv_heads * (CONTEXT + n_rows) * s.head_dim * el
            yield f"int8 {case}", fns, floor, {"graph": True}


def takes_pdl(op: str, backend: str) -> bool:
    """Whether the op's `backend` kernels (all of them, for the step) take programmatic launch."""
    return all(dispatch.programmatic(o, backend) for o in real_ops(op))


def with_programmatic_variant(op: str, fns: dict) -> dict:
    """fns plus cuda_pdl / triton_pdl: the cuda / triton entry with its kernels launched as
    programmatic dependent launches (a graph of it, *_pdl_cg, keeps the programmatic edges)."""
    def programmatic(fn):
        def run(*a):
            with _cuda.programmatic_launch():
                return fn(*a)
        return run
    return {**fns, **{f"{b}_pdl": (programmatic(fns[b][0]), fns[b][1])
                      for b in ("cuda", "triton") if b in fns and takes_pdl(op, b)}}


def cuda_split_variants(N, K, sets, launch, args) -> dict:
    """The CUDA dense kernel at other K-split counts than its plan's (one split, and twice the
    plan's), for tuning the plan on the GPU: {name: (fn, args)}."""
    planned, _ = cuda_plan(N, K, sets, torch.device("cuda") if torch.cuda.is_available()
                           else torch.device("cpu"))
    out = {}
    for name, split in (("cuda_1split", 1), ("cuda_2x_split", 2 * planned)):
        if split != planned:
            out[name] = (lambda *a, split=split: launch(*a, split), args)
    return out


def verify_kernel_only(hidden, norm, eps, head, draft):
    """verify_greedy's CUDA kernels through the extension's binding alone, as its launcher
    calls it (spd_kernels/verify/cuda.py), on outputs and scratch made at the first call: no
    Python checks, dispatch or allocation. Against the `cuda` row: what those cost."""
    state = {}

    def run():
        R, D = hidden.shape
        V = head.shape[0]
        if not state:
            ext = _cuda.ext()
            nb = ext.verify_greedy_num_blocks(V)
            dev = hidden.device
            state.update(ext=ext, bufs=(torch.empty(R, nb, dtype=torch.float32, device=dev),
                                        torch.empty(R, nb, dtype=torch.int32, device=dev),
                                        torch.empty(R, dtype=torch.int64, device=dev),
                                        torch.empty(R, dtype=torch.bool, device=dev)))
        pval, pidx, target, accepted = state["bufs"]
        state["ext"].verify_greedy(hidden, hidden.stride(0), norm, head, head.stride(0), draft,
                                   draft.dtype == torch.int64, pval.data_ptr(), pidx.data_ptr(),
                                   target.data_ptr(), accepted.data_ptr(), R, D, V, float(eps),
                                   0.0, dtype_code(hidden.dtype), _cuda.stream_of(hidden))
        return target, accepted
    return run


def triton_attention_only(*args):
    """The PDM step with Triton QKV/RoPE/append and attention, torch (cuBLAS) for the dense ops."""
    with dispatch.use_backend(qkv_rope_append="triton", cache_attention="triton",
                              fused_linear="reference", fused_swiglu="reference"):
        return pdm_step(*args)


def cuda_linear_layers(*args):
    """The PDM step with Triton QKV/RoPE/append and attention, the CUDA kernel for every dense
    product (the QKV products included: they follow fused_linear's backend on a GPU)."""
    with dispatch.use_backend("triton", fused_linear="cuda", fused_swiglu="cuda"):
        return pdm_step(*args)


# --- running ----------------------------------------------------------------------------------------

def real_ops(op: str) -> tuple[str, ...]:
    """The dispatcher's ops a benchmark op runs (the PDM step runs four of them)."""
    return STEP_OPS if op == "pdm_step" else (op,)


def on_request_row(op: str, backend: str) -> bool:
    """Whether a row runs a kernel that the automatic choice does not pick yet: one registered on
    request only (written and checked, not yet timed on a GPU), the tensor-core anchor variant,
    or programmatic dependent launch (off by default). On a GPU these are the rows most likely to
    fault, so the device session times them apart from the rest (--rows)."""
    if "_pdl" in backend or "_mma" in backend:
        return True
    if backend in ("reference", "compile", "cuda_graph"):
        return False
    if backend.startswith("cuda_linear"):  # the step's dense products on the CUDA kernel
        return any(dispatch.on_request(o, "cuda") for o in ("fused_linear", "fused_swiglu"))
    base = "triton" if backend.startswith("triton") else "cuda"
    return any(dispatch.on_request(o, base) for o in real_ops(op))


def backend_ready(op: str, backend: str, device) -> str | None:
    if backend in ("reference", "compile", "cuda_graph"):
        return None
    if backend.startswith("cuda_linear"):  # the step with Triton attention, CUDA dense products
        needs = dict(qkv_rope_append="triton", cache_attention="triton", fused_linear="cuda",
                     fused_swiglu="cuda")
        if any(b not in dispatch.available(o, device) for o, b in needs.items()):
            return "not available here"
        return None if device.type == "cuda" else "Triton interpreter is not a speed path"
    if backend.startswith("triton"):  # triton_cg, triton_attn, triton_1split, ...: Triton kernels
        backend = "triton"
    elif backend.startswith("cuda"):  # cuda_cg: the CUDA kernel's launches as a graph
        backend = "cuda"
    if any(backend not in dispatch.available(real_op, device) for real_op in real_ops(op)):
        return "not available here"
    if backend == "triton" and device.type == "cpu":
        return "Triton interpreter is not a speed path"
    return None


def all_cases(models, ops, dtype, device):
    """(model, op, case, {backend: (fn, args)}, bytes floor, extra) for every model and op."""
    for m in models:
        for op in ops:
            for case, fns, floor_bytes, extra in build_cases(op, MODELS[m], dtype, device):
                yield m, op, case, fns, floor_bytes, extra


class ContextLost(Exception):
    """A row faulted a kernel and the process's CUDA context went with it."""


def run(args, save=None) -> dict:
    """Time every (model, op, case, backend) asked for; `save(result)` after each row keeps
    what was timed if the process is stopped later (the device session caps each step)."""
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timer = Timer(device, args.iters, args.warmup, flush=not args.no_flush)
    torch.manual_seed(0)
    bw = copy_bandwidth(device, timer)
    print(f"device {describe_device(device)}: copy bandwidth {bw:.1f} GB/s; dtype {dtype}; "
          f"iters {args.iters}; rows {args.rows}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    # torch.compile takes tens of seconds per op and shape: by default only one model is compiled
    # (the target shapes on a GPU, the smallest on a CPU).
    compile_models = set(models) if args.compile == "on" else (
        set() if args.compile == "off" else
        ({"qwen3-4b"} if device.type == "cuda" else {"smollm2-135m"}) & set(models))
    rows = []
    result = dict(meta=meta(args, device, dtype, bw), rows=rows, context_lost=[])

    def wanted(op, backend):
        return args.rows == "all" or on_request_row(op, backend) == (args.rows == "on-request")

    def keep(row):
        rows.append(row)
        if save is not None:
            save(result)

    def failed(row, error):  # record and go on: one broken backend != no table
        row["error"] = error[:300]
        keep(row)
        print(f"  {row['model']} {row['op']} {row['case']} {row['backend']}: ERROR {row['error']}")
        lost = cuda_context_error()  # unless the fault took the context with it
        if lost is not None:
            raise ContextLost(f"{row['model']} {row['op']} [{row['case']}] {row['backend']}: "
                              f"{lost}")

    try:
        for m, op, case, fns, floor_bytes, extra in all_cases(models, ops, dtype, device):
            fns = with_programmatic_variant(op, fns)
            entries = dict(fns)
            if m in compile_models:
                ref_fn, ref_args = fns["reference"]
                entries["compile"] = (torch.compile(ref_fn, dynamic=False), ref_args)
            if extra.get("graph") and device.type == "cuda":
                graphed = ([("cuda_graph", "reference")] if extra.get("graph_reference", True)
                           else [])
                if "triton" in fns and backend_ready(op, "triton", device) is None:
                    graphed += [("triton_cg", "triton"), ("triton_attn_cg", "triton_attn"),
                                ("triton_pdl_cg", "triton_pdl")]
                if "cuda" in fns and backend_ready(op, "cuda", device) is None:
                    graphed += [(f"{b}_cg", b) for b in fns if b.startswith("cuda")
                                and not b.startswith("cuda_linear")]
                if "cuda_linear" in fns and backend_ready(op, "cuda_linear", device) is None:
                    graphed.append(("cuda_linear_cg", "cuda_linear"))
                for name, src in graphed:
                    if src not in fns or not wanted(op, name):
                        continue
                    try:
                        entries[name] = graph_of(*fns[src])
                    except Exception as exc:  # a capture failure is a row, not the end
                        failed(dict(model=m, op=op, case=case, backend=name, bytes=floor_bytes),
                               f"capture: {type(exc).__name__}: {exc}")
            for backend, entry in entries.items():
                row = dict(model=m, op=op, case=case, backend=backend, bytes=floor_bytes)
                if not wanted(op, backend) or backend_ready(op, backend, device):
                    continue
                fn, fargs = entry
                try:
                    t0 = time.perf_counter()
                    med, best = timer(lambda: fn(*fargs))
                    row["wall_s"] = round(time.perf_counter() - t0, 3)
                except Exception as exc:
                    failed(row, f"{type(exc).__name__}: {exc}")
                    continue
                row.update(us=med, us_min=best, gb_s=floor_bytes / (med * 1e-6) / 1e9)
                row["pct_copy_bw"] = 100 * row["gb_s"] / bw
                row["floor_us"] = floor_bytes / (bw * 1e9) * 1e6
                row["x_floor"] = med / row["floor_us"]
                if extra.get("sync_check"):
                    row["no_host_sync"] = no_host_sync(lambda: fn(*fargs), device)
                if extra.get("host_time") and device.type == "cuda":
                    row["host_us"] = host_time(lambda: fn(*fargs), args.iters)
                keep(row)
                print_row(row)
            del entries, fns
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except ContextLost as exc:
        result["context_lost"].append(str(exc))
        print(f"CUDA context lost at {exc}: no later row can be timed in this process")
    result.update(targets=targets(rows, device.type == "cuda"), challengers=challengers(rows))
    return result


def merge(paths: list[str]) -> dict:
    """One result from several runs of this script (the device session times the on-request rows
    in processes of their own, so a faulting kernel costs only its own op's rows): rows
    concatenated, targets and challengers over all of them. A run stopped early counts with the
    rows it saved."""
    parts = []
    for p in paths:
        try:
            parts.append((p, json.loads(Path(p).read_text())))
        except (OSError, ValueError) as exc:
            print(f"merge: skipping {p}: {exc}", file=sys.stderr)
    if not parts:
        raise SystemExit("merge: none of the files could be read")
    rows = [r for _, part in parts for r in part["rows"]]
    on_gpu = any(part["meta"].get("device_type") == "cuda" for _, part in parts)
    return dict(meta=dict(parts[0][1]["meta"], command=" ".join(sys.argv),
                          merged_from=[dict(file=Path(p).name, rows=len(part["rows"]),
                                            command=part["meta"].get("command"),
                                            complete="targets" in part)
                                       for p, part in parts]),
                rows=rows, context_lost=[m for _, part in parts for m in part["context_lost"]],
                targets=targets(rows, on_gpu), challengers=challengers(rows))


def graph_of(fn, fargs):
    """The eager reference captured once as a CUDA graph (launch overhead gone)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*fargs)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*fargs)
    return (lambda: graph.replay(), ())


def targets(rows, on_gpu: bool) -> list[dict]:
    if not on_gpu:
        return [dict(target="GPU targets", status="not evaluated on CPU")]

    def best(op, model="qwen3-4b", case=None,
             backends=("triton", "cuda", "cuda_graph", "triton_cg", "triton_attn_cg", "cuda_cg",
                       "cuda_linear_cg", "cuda_mma", "cuda_mma_cg", "cuda_pdl", "cuda_pdl_cg",
                       "triton_pdl", "triton_pdl_cg")):
        cands = [r for r in rows if r["op"] == op and r["model"] == model and "us" in r
                 and r["backend"] in backends and (case is None or r["case"].startswith(case))]
        return min(cands, key=lambda r: r["us"]) if cands else None
    out = []
    # judged on the eager op, as on 2026-11-30 and 2026-12-04; "graphed": the kernels alone
    v = best("verify_greedy", backends=("triton", "cuda"))
    vg = best("verify_greedy", backends=("triton_cg", "cuda_cg"))
    out.append(dict(target="verify (Qwen3-4B) <= 1.2x LM-head read", value=v and v["x_floor"],
                    backend=v and v["backend"], ok=bool(v and v["x_floor"] <= 1.2),
                    graphed=vg and vg["x_floor"], graphed_backend=vg and vg["backend"]))
    a = best("anchor_projection")
    out.append(dict(target="anchor projection (Qwen3-4B) <= 1.25x bytes floor",
                    value=a and a["x_floor"], backend=a and a["backend"],
                    ok=bool(a and a["x_floor"] <= 1.25)))
    p = best("pdm_step", case="PDM")
    # like for like: the stage on the same kernels, launched the same way (a graph of torch ops
    # would flatter the PDM step: 0.48x against 0.98x on the H200, 2026-11-30)
    st = p and best("pdm_step", case="target stage", backends=(p["backend"],))
    out.append(dict(target="PDM step (Qwen3-4B) <= 1.5x weight floor", value=p and p["x_floor"],
                    backend=p and p["backend"], ok=bool(p and p["x_floor"] <= 1.5)))
    out.append(dict(target="PDM step faster than a 4-layer Qwen3-4B stage (same kernels)",
                    value=p and st and p["us"] / st["us"], backend=p and p["backend"],
                    ok=bool(p and st and p["us"] < st["us"])))
    k = best("truncate_kv")
    out.append(dict(target="KV truncation < 5 us, no host sync", value=k and k["us"],
                    backend=k and k["backend"],
                    ok=bool(k and k["us"] < 5 and k.get("no_host_sync"))))
    return out


def challengers(rows) -> list[dict]:
    """Per (model, op, case), graph rows against graph rows: the best kernel the automatic choice
    does not pick yet (on_request_row: registered on request, a variant, PDL) against the best it
    does pick, and each programmatic launch (*_pdl) against the same kernels launched plainly.
    speedup > 1 means the challenger was faster (a case for making it automatic)."""
    timed = [r for r in rows if "us" in r and r["backend"] not in ("reference", "compile",
                                                                    "cuda_graph")]
    groups: dict = {}
    for r in timed:
        key = (r["model"], r["op"], r["case"], r["backend"].endswith("_cg"))
        groups.setdefault(key, {})[r["backend"]] = r
    out = []

    def add(key, a, b):
        if a is not None and b is not None:
            out.append(dict(model=key[0], op=key[1], case=key[2], challenger=a["backend"],
                            challenger_us=a["us"], incumbent=b["backend"], incumbent_us=b["us"],
                            speedup=b["us"] / a["us"]))

    fastest = lambda rs: min(rs, key=lambda r: r["us"], default=None)
    for key in sorted(groups):
        by_name = groups[key]
        new = [r for name, r in by_name.items() if on_request_row(key[1], name)]
        old = [r for name, r in by_name.items() if not on_request_row(key[1], name)]
        add(key, fastest(new), fastest(old))
        for name, r in sorted(by_name.items()):
            if "_pdl" in name:
                add(key, r, by_name.get(name.replace("_pdl", "")))
    return out


def meta(args, device, dtype, bw) -> dict:
    """The shared run metadata (benchmarks/harness.py) plus what this benchmark ran with."""
    import triton
    return run_meta(device, date=args.date, rows=args.rows,
                    triton=getattr(triton, "__version__", None),
                    cuda_extension=dispatch.describe()["cuda_extension"], dtype=str(dtype),
                    copy_bandwidth_gb_s=bw, iters=args.iters, warmup=args.warmup,
                    l2_flush=not args.no_flush and device.type == "cuda",
                    triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
                    shapes={k: vars(v) for k, v in MODELS.items()},
                    settings=dict(n_stages=N_STAGES, anchors=N_ANCHORS, draft_vocab=DRAFT_VOCAB,
                                  pdm_layers=PDM_LAYERS, context=CONTEXT,
                                  cache=CACHE_CAPACITY))


HEADER = (f"{'model':<14}{'op':<24}{'case':<32}{'backend':<11}{'us':>11}{'GB/s':>9}"
          f"{'%copy':>7}{'x floor':>9}")


def print_row(r):
    extra = "" if r.get("no_host_sync") is None else ("  no-sync" if r["no_host_sync"] else "  SYNC")
    print(f"{r['model']:<14}{r['op']:<24}{r['case'][:31]:<32}{r['backend']:<11}{r['us']:>11.1f}"
          f"{r['gb_s']:>9.2f}{r['pct_copy_bw']:>7.1f}{r['x_floor']:>9.2f}{extra}", flush=True)


def report(result) -> None:
    """The targets and the challenger lines, after the table (the device session greps them)."""
    for lost in result["context_lost"]:
        print(f"context lost: {lost}")
    for t in result["targets"]:
        print("target:", json.dumps(t))
    for c in result["challengers"]:  # on-request kernels against the automatic choice
        print(f"challenger: {c['model']} {c['op']} [{c['case']}] {c['challenger']} "
              f"{c['challenger_us']:.1f} us vs {c['incumbent']} {c['incumbent_us']:.1f} us: "
              f"{c['speedup']:.2f}x")


def write(result, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")  # never a half-written file, even when killed
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default 50 GPU, 3 CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5 GPU, 1 CPU)")
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                    help="torch.compile the references (auto: Qwen3-4B on GPU, SmolLM2 on CPU)")
    ap.add_argument("--rows", default="all", choices=["all", "automatic", "on-request"],
                    help="on-request: only the rows of kernels the automatic choice does not pick "
                         "yet (on request only, the mma anchor variant, PDL); automatic: the rest")
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="time nothing: merge these results of earlier runs into --json-out, "
                         "with targets and challengers over all their rows")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--date", default=str(date.today()))
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.merge:
        if not args.json_out:
            ap.error("--merge needs --json-out")
        result = merge(args.merge)
        report(result)
        write(result, Path(args.json_out))
        print(f"wrote {args.json_out} ({len(result['rows'])} rows from "
              f"{len(result['meta']['merged_from'])} files)")
        return 0
    for flag, given, valid in (("--models", args.models, MODELS), ("--ops", args.ops, OPS)):
        unknown = [x.strip() for x in given.split(",") if x.strip() and x.strip() not in valid]
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(unknown)} (valid: {', '.join(valid)})")
    gpu = args.device.startswith("cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._logging.set_logs(dynamo=logging.ERROR)  # graph breaks in the references are expected
    args.iters = args.iters or (50 if gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (5 if gpu else 1)
    if os.environ.get("TRITON_INTERPRET") == "1" and gpu:
        print("TRITON_INTERPRET=1 is set: the Triton backend will be skipped on the GPU",
              file=sys.stderr)
    out = Path(args.json_out or Path(__file__).parent / "results" /
               f"{args.date}-kernels-{device_tag(torch.device(args.device))}.json")
    print(HEADER)
    result = run(args, save=lambda partial: write(partial, out))
    print("-" * len(HEADER))
    report(result)
    write(result, out)
    print(f"wrote {out}")
    return 3 if result["context_lost"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
