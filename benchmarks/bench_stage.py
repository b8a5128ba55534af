"""The target's stage step and the autoregressive step against their weight-read floors.

Per model shape (random weights, `--context` tokens already cached, one row: the steady state,
where each stage runs exactly one token per cycle):
- `stage`: spd.model.target.Stage's one-row step over 3, 5 and 9 layers, time per layer. On a GPU
  the captured graph is replayed bare (`graph`), beside the eager step (`eager`).
- `attention`: spd_kernels.cache_attention at one row over the context, alone in a graph.
- `ar`: spd.runtime.ar_decode.ARDecoder's step over every layer (embedding, stages, final norm +
  LM head + greedy choice): the single-device autoregressive baseline, one graph per token.
- `batch`: the stage step over B rows of B sequences (`--batches`, default 1, 2, 4, 8, 16), each
  row against its own slot's `--context` cached keys (spd_kernels.stage.batch_stage_step, as a
  batch's cycle runs it: docs/batching.md), over the largest `--layers`; on a GPU one captured
  graph per B (`graph`) beside the eager step. Its floor reads the weights once and every
  row's keys and values.
Each against its floor: the bytes it must read (weights, the KV rows it attends to) over the
measured device-to-device copy bandwidth. Prints a table and writes JSON.

    TRITON_INTERPRET=0 python benchmarks/bench_stage.py --models qwen3-4b,qwen3-8b   # GPU
    python benchmarks/bench_stage.py --models smollm2-135m --layers 2 --context 64 \
        --iters 3 --warmup 1                                                          # CPU
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when loaded by path
from bench_draft_hiding import stage_target  # noqa: E402
from bench_kernels import MODELS, copy_bandwidth, layer_bytes  # noqa: E402
from harness import (  # noqa: E402
    RESULTS,
    Table,
    Timer,
    add_device_args,
    device_setup,
    device_tag,
    run_meta,
    write_json,
)

from spd.model.loading import describe_device  # noqa: E402
from spd.model.target import Stage  # noqa: E402
from spd.runtime.ar_decode import ARDecoder  # noqa: E402
from spd.runtime.types import SamplingParams  # noqa: E402
from spd_kernels import _cuda, cache_attention  # noqa: E402

# The H200 targets of the stage-graphs issue (microseconds), checked where the device is one.
H200_TARGETS = {("qwen3-4b", "stage"): 63.0, ("qwen3-8b", "stage"): 120.0,
                ("qwen3-4b", "ar"): 2520.0, ("qwen3-4b", "attention"): 6.0,
                ("qwen3-8b", "attention"): 6.0}


def kv_bytes(stage: Stage, context: int) -> int:
    """K and V rows read by one row's attention at `context`, over the stage's layers."""
    c = stage.cache
    return 2 * c.k.shape[0] * c.k.shape[1] * context * c.k.shape[3] * c.k.element_size()


def stage_rows(target, layers: int, context: int, timer: Timer, gpu: bool) -> list[dict]:
    """The one-row step of a stage of `layers` layers: eager, and on a GPU the bare graph."""
    room = context + timer.iters + timer.warmup + 8
    h = torch.randn(1, target.hidden_size, device=target.device, dtype=target.dtype)
    floor_bytes = sum(layer_bytes(lw) for lw in target.stage_weights(range(layers)).layers)
    rows = []
    for mode in ("eager", "graph") if gpu else ("eager",):
        stage = Stage(target, 0, range(layers), room, cuda_graphs=mode == "graph")
        stage.cache.reserve(0, context)  # cached rows (their values do not change the cost)

        def eager_step():
            stage.cache.truncate(context)
            stage.forward(h, context)

        fn = eager_step
        if mode == "graph":
            stage.forward(h, context)  # captures; later replays advance the device length
            if stage.graphs.failed is not None:
                rows.append(dict(what="stage", mode="graph", layers=layers,
                                 error=stage.graphs.failed))
                continue
            fn = stage.graphs.graphs[1].graph.replay
        us, _ = timer(fn)
        rows.append(dict(what="stage", mode=mode, layers=layers, us=us, us_per_layer=us / layers,
                         floor_bytes=floor_bytes + kv_bytes(stage, context)))
    return rows


def batch_rows(target, layers: int, context: int, batches: list[int], timer: Timer,
               gpu: bool) -> list[dict]:
    """The stage step of `layers` layers over B rows, one a sequence (module docstring), for
    each B: eager, and on a GPU a captured graph per B."""
    from spd_kernels.stage import batch_stage_step

    t, dev, most = target, target.device, max(batches)
    weights = t.stage_weights(range(layers))
    S = context + 1
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(most, layers, t.num_kv_heads, S, t.head_dim, generator=gen).to(dev, t.dtype)
    v = torch.randn(k.shape, generator=gen).to(dev, t.dtype)
    x = torch.randn(most, t.hidden_size, generator=gen).to(dev, t.dtype)
    cos, sin = t.rope(0, S)
    slots = torch.arange(most, device=dev)
    at = torch.full((most,), context, dtype=torch.int64, device=dev)
    weight_bytes = sum(layer_bytes(lw) for lw in weights.layers)
    row_kv = 2 * layers * t.num_kv_heads * S * t.head_dim * k.element_size()
    rows = []
    for mode in ("eager", "graph") if gpu else ("eager",):
        for B in batches:
            def call(B=B):
                return batch_stage_step(x[:B], weights, k, v, slots[:B], at[:B], cos, sin)
            fn = call
            if mode == "graph":
                call()  # compiles and warms up outside the capture
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph):
                        call()
                except Exception as exc:  # noqa: BLE001 - reported as the row's error
                    rows.append(dict(what=f"batch{B}", B=B, mode=mode, layers=layers,
                                     error=f"{type(exc).__name__}: {exc}"))
                    continue
                fn = graph.replay
            us, _ = timer(fn)
            rows.append(dict(what=f"batch{B}", B=B, mode=mode, layers=layers, us=us,
                             us_per_layer=us / layers, us_per_row=us / B,
                             floor_bytes=weight_bytes + B * row_kv))
    for r in rows:  # each B against one row in the same mode
        one = next((o for o in rows if o["mode"] == r["mode"] and o["B"] == 1 and "us" in o),
                   None)
        if one is not None and "us" in r:
            r["vs_one_row"] = r["us"] / one["us"]
    return rows


def attention_row(target, context: int, timer: Timer, gpu: bool) -> dict:
    """One row's attention over `context` cached positions (one layer's cache)."""
    stage = Stage(target, 0, range(1), context + 1, cuda_graphs=False)
    dev = target.device
    q = torch.randn(target.num_heads, 1, target.head_dim, device=dev, dtype=target.dtype)
    start = torch.tensor([context], device=dev)  # the last cached row is the query's own

    def call():
        return cache_attention(q, stage.cache.k[0], stage.cache.v[0], start)

    fn, mode = call, "eager"
    if gpu:
        call()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        fn, mode = graph.replay, "graph"
    us, _ = timer(fn)
    return dict(what="attention", mode=mode, layers=1, us=us, us_per_layer=us,
                floor_bytes=kv_bytes(stage, context + 1) + q.numel() * q.element_size() * 2)


def ar_row(target, context: int, timer: Timer, gpu: bool) -> dict:
    """The autoregressive step over every layer of `target`: one graph per token on a GPU."""
    room = context + timer.iters + timer.warmup + 8
    stage = Stage(target, 0, range(target.num_layers), room)
    stage.cache.reserve(0, context)
    ar = ARDecoder(target, [stage])
    ar.sampling = SamplingParams()  # greedy: the fused norm + LM head + argmax
    token = torch.zeros(1, dtype=torch.int64, device=target.device)

    def eager_step():
        stage.cache.truncate(context)
        ar._step(token, context)

    fn, mode = eager_step, "eager"
    if gpu:
        ar._step(token, context)  # captures
        if ar.graphs.failed is not None:
            return dict(what="ar", mode="graph", layers=target.num_layers, error=ar.graphs.failed)
        fn, mode = ar.graphs.graphs[True].graph.replay, "graph"
    us, _ = timer(fn)
    t = target
    head_bytes = t.lm_head.weight.numel() * t.lm_head.weight.element_size()
    layers = sum(layer_bytes(lw) for lw in stage.weights.layers)
    return dict(what="ar", mode=mode, layers=t.num_layers, us=us, us_per_layer=us / t.num_layers,
                tok_s=1e6 / us, floor_bytes=layers + head_bytes + kv_bytes(stage, context))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--layers", default="3,5,9", help="stage sizes, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the caches")
    ap.add_argument("--no-ar", action="store_true", help="skip the whole-model AR step")
    ap.add_argument("--rows", default="stage,attention,ar",
                    help="which rows, comma-separated: stage, attention, ar, batch (e.g. the AR "
                         "step alone once the CUDA extension is built, its verify being CUDA)")
    ap.add_argument("--batches", default="1,2,4,8,16",
                    help="the B of the batch rows (sequences, one row each)")
    add_device_args(ap)
    args = ap.parse_args()
    kinds = {r for r in args.rows.split(",") if r}
    if not kinds or kinds - {"stage", "attention", "ar", "batch"}:
        sys.exit(f"--rows takes stage, attention, ar and batch, got {args.rows!r}")
    try:
        batches = sorted({int(x) for x in args.batches.split(",")})
    except ValueError:
        sys.exit(f"--batches takes comma-separated integers, got {args.batches!r}")
    if min(batches) < 1:
        sys.exit("--batches must be >= 1")
    batches = sorted({1, *batches})  # (each B against one row)
    if args.no_ar:
        kinds.discard("ar")
    # on a GPU, L2 flushed between calls: weights come from HBM as in a real decode step
    device, dtype, timer = device_setup(args, flush=True)
    gpu = device.type == "cuda"
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    try:
        layer_counts = [int(x) for x in args.layers.split(",")]
    except ValueError:
        sys.exit(f"--layers takes comma-separated integers, got {args.layers!r}")
    if unknown or min(layer_counts) < 1 or args.context < 1:
        sys.exit(f"--models from {', '.join(MODELS)}; --layers and --context >= 1")
    bandwidth = copy_bandwidth(device, Timer(device, 10, 2))
    tag = device_tag(device)
    print(f"{describe_device(device)}, {str(dtype)[6:]}, context {args.context}, copy bandwidth "
          f"{bandwidth:.0f} GB/s; floor = bytes read / that bandwidth")
    table = Table([("model", "<14"), ("what", "<10"), ("mode", "<6"), ("layers", ">7"),
                   ("us", ">10.1f"), ("us_per_layer", ">12.1f", "us/layer"),
                   ("vs_one_row", ">8.2f", "x 1 row"),
                   ("floor_us", ">10.1f", "floor us"), ("x_floor", ">8.2f"),
                   ("target_us", ">10.1f", "target us"), ("ok", ">5")])
    table.print_header()
    rows = []
    out = args.json_out or RESULTS / f"{args.date}-stage-{tag}.json"
    meta = run_meta(device, date=args.date, dtype=str(dtype), context=args.context,
                    copy_bandwidth_gb_s=bandwidth, iters=timer.iters,
                    programmatic_launch=_cuda.programmatic_launch_enabled(),
                    shapes={m: vars(MODELS[m]) for m in models})
    with torch.no_grad():
        for m in models:
            shape = MODELS[m]
            built = max(layer_counts) if "ar" not in kinds else max(shape.layers,
                                                                     max(layer_counts))
            target = stage_target(shape, built, device, dtype)
            found = []
            if "stage" in kinds:
                found += [r for L in layer_counts
                          for r in stage_rows(target, L, args.context, timer, gpu)]
            if "attention" in kinds:
                found.append(attention_row(target, args.context, timer, gpu))
            if "ar" in kinds:
                found.append(ar_row(target, args.context, timer, gpu))
            if "batch" in kinds:
                found += batch_rows(target, max(layer_counts), args.context, batches, timer,
                                    gpu)
            for r in found:
                r.update(model=m, context=args.context, dtype=str(dtype))
                if "us" in r:
                    r["floor_us"] = r["floor_bytes"] / (bandwidth * 1e3)
                    r["x_floor"] = r["us"] / r["floor_us"]
                    limit = H200_TARGETS.get((m, r["what"])) if tag == "h200" else None
                    if limit is not None and r["mode"] == "graph":
                        key = "us" if r["what"] == "ar" else "us_per_layer"
                        r.update(target_us=limit, ok=str(r[key] <= limit).lower())
                if "us" in r:
                    table.print(r)
                else:
                    print(f"{m:<14}{r['what']:<10} {r['error']}")
                rows.append(r)
            write_json(out, meta, rows=rows)  # after each model: a run cut short keeps its rows
            del target
            if gpu:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
