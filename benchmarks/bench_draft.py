"""The draft step against the stage step, like for like: bytes read, and on a GPU both graphed.

SPD hides drafting only while one PDM step (anchor projection + L_s layers + draft LM head) is no
slower than one stage. bench_draft_hiding.py set the draft against Hugging Face-style eager
stages; here both sides are what a decode step must read, and on a GPU both are the CUDA-graph
replays the runtime uses. Per target shape (Qwen3-4B, Qwen3-8B), n, L_s and draft vocabulary Vd,
at --context cached positions:

  draft   bytes of one PDM step at fill n (spd.model.stage_costs.pdm_step_bytes): the anchor
          projections of the aggregation types that occur (DepthLayout.types), L_s layers at the
          target's widths, the draft head [Vd, d], the PDM's KV rows at the context; in bf16 and
          with int8 weights (one byte each plus an fp32 scale per output row, spd_kernels.quant).
  stage   bytes of the largest stage of the uniform split (its layers' weights and the KV rows
          they attend to); the final norm + LM head, which the last stage reads to verify
          greedy drafts, is the `head` column, apart.
  ratio   draft / stage: above 1 the draft rank, not the stages, sets the cycle.

Each figure is labelled: "projection (bytes)" is bytes / a stated bandwidth (--bandwidth-gbs,
default the H200's 4800 GB/s HBM3e nominal; the ratios do not depend on it), "measured" is the
median of CUDA-event-timed replays with L2 flushed (spd.draft.drafters.PDMDrafter with
cuda_graphs=True; spd.model.target.Stage's captured one-row graph, as in bench_stage.py), beside
its floor: bytes / the measured copy bandwidth. The measured draft rows are per weight format
(--draft-weights, default bf16,int8,fp8): the same random PDM, its draft step reading bf16
weights or weight-only int8 / fp8 copies (PipelineDraftModule.quantize_, spd_kernels.quant), each
against its own bytes. `--measure` measures on a CPU too (eager stage and draft, the reference
ops or, with TRITON_INTERPRET=1 and SPD_BACKEND=triton, the kernels in the interpreter): a smoke
check of these rows, not a timing.

"Draft on stage S" rows (n-device mode, no draft rank): the balanced split
(spd.model.partition.balanced_split) with the draft step charged to stage S and the head to the
last stage; how many layers stage S keeps, whether stage S + draft fits the others' cycle, and
that cycle against the n + 1 layout's (balanced, the draft on its own device).

    python benchmarks/bench_draft.py --device cpu                  # projection, every config
    TRITON_INTERPRET=0 python benchmarks/bench_draft.py            # GPU: measured + projection
    python benchmarks/bench_draft.py --device cpu --models smollm2-135m --stages 2 \\
        --pdm-layers 1 --draft-vocab 8192                          # a quick look

Prints a table and writes JSON (default benchmarks/results/<date>-draft-<device>.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when loaded by path
from bench_kernels import MODELS, Shape, copy_bandwidth  # noqa: E402,F401  (Shape: tests)
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
from spd.model.partition import DepthLayout, balanced_split, stage_times  # noqa: E402
from spd.model.stage_costs import pdm_step_bytes  # noqa: E402

H200_NOMINAL_GBS = 4800.0  # HBM3e nominal; the measured device-to-device copy is about 4230
PROJECTION, MEASURED = "projection (bytes)", "measured"


def layer_bytes(shape, el: int = 2) -> int:
    """Weights of one target decoder layer (Qwen3 / Llama: q/k/v/o, q/k norms where the shape
    has them, SwiGLU MLP, two norms)."""
    d, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    norms = 2 * d + (2 * shape.head_dim if shape.qk_norm else 0)
    return (d * q + 2 * d * kv + q * d + 3 * d * shape.intermediate + norms) * el


def kv_bytes(shape, layers: int, context: int, el: int = 2) -> int:
    """K and V rows one row's attention reads over `layers` layers at `context` positions."""
    return 2 * layers * shape.kv_heads * shape.head_dim * context * el


def head_bytes(shape, el: int = 2) -> int:
    """The final norm and the LM head [V, d]: what the last stage reads to verify."""
    return (shape.vocab * shape.hidden + shape.hidden) * el


def draft_bytes(shape, layout: DepthLayout, pdm_layers: int, draft_vocab: int, context: int,
                weights: str, el: int = 2) -> dict:
    """pdm_step_bytes of a PDM at the target's widths (MLP width too) at fill n."""
    return pdm_step_bytes(shape.hidden, shape.hidden, shape.heads, shape.kv_heads,
                          shape.head_dim, shape.intermediate, pdm_layers, draft_vocab,
                          layout.types, context, el=el, weights=weights)


def projection_rows(shape, n: int, pdm_layers: list[int], vocabs: list[int], context: int,
                    gbs: float) -> list[dict]:
    """The bytes-only rows of one (shape, n): draft / stage per L_s, Vd and weight format."""
    layout = DepthLayout.build(shape.layers, n)
    stage_layers = max(layout.split)
    per_layer = layer_bytes(shape) + kv_bytes(shape, 1, context)
    stage = stage_layers * per_layer
    head = head_bytes(shape)
    us = lambda b: b / (gbs * 1e3)  # noqa: E731  (bytes / (GB/s) in microseconds)
    rows = []
    for ls in pdm_layers:
        for vd in vocabs:
            for weights in ("bf16", "int8"):
                d = draft_bytes(shape, layout, ls, vd, context, weights)
                rows.append(dict(
                    what="draft vs stage", kind=PROJECTION, model=shape.name, n=n,
                    pdm_layers=ls, draft_vocab=vd, draft_weights=weights, context=context,
                    split=layout.split, stage_layers=stage_layers, types=layout.types,
                    draft_bytes=d["total"], draft_parts=d, stage_bytes=stage,
                    layer_bytes=per_layer, head_bytes=head,
                    draft_layers_worth=d["total"] / per_layer,
                    draft_us=us(d["total"]), stage_us=us(stage), head_us=us(head),
                    bandwidth_gb_s=gbs, ratio=d["total"] / stage))
    return rows


def on_stage_rows(shape, n: int, pdm_layers: list[int], vocabs: list[int], context: int,
                  stages_s: list[int], gbs: float) -> list[dict]:
    """n-device mode: the balanced split with the draft on stage S (bf16 and int8 drafts)."""
    layout = DepthLayout.build(shape.layers, n)
    per_layer = layer_bytes(shape) + kv_bytes(shape, 1, context)
    costs, head = [float(per_layer)] * shape.layers, float(head_bytes(shape))
    base = balanced_split(costs, n, head)  # n + 1 layout: the draft on its own device
    base_cycle = max(stage_times(costs, base, head))
    rows = []
    for S in [s for s in stages_s if s < n]:
        for ls in pdm_layers:
            for vd in vocabs:
                for weights in ("bf16", "int8"):
                    d = draft_bytes(shape, layout, ls, vd, context, weights)["total"]
                    split = balanced_split(costs, n, head, {S: d})
                    t = stage_times(costs, split, head, {S: d})
                    others = max(t[:S] + t[S + 1:]) if n > 1 else 0.0
                    rows.append(dict(
                        what="draft on stage S", kind=PROJECTION, model=shape.name, n=n,
                        stage=S, pdm_layers=ls, draft_vocab=vd, draft_weights=weights,
                        context=context, split=split, uniform_split=layout.split,
                        stage_layers=split[S], draft_bytes=d, cycle_bytes=max(t),
                        n1_split=base, n1_cycle_bytes=base_cycle,
                        fits=t[S] <= others * (1 + 1e-12), cycle_us=max(t) / (gbs * 1e3),
                        cycle_over_n1=max(t) / base_cycle, bandwidth_gb_s=gbs))
    return rows


def measured_rows(shape, n: int, pdm_layers: list[int], vocabs: list[int], context: int,
                  device, timer: Timer, bandwidth: float,
                  kinds: tuple[str, ...] = ("bf16", "int8", "fp8")) -> list[dict]:
    """The graphed stage step of the largest stage and the graphed draft step per weight format
    in `kinds` (bf16, int8, fp8). On a CPU (a smoke check) both run eagerly."""
    from bench_draft_hiding import random_pdm, stage_target

    from spd.draft.drafters import PDMDrafter
    from spd.model.target import Stage
    from spd.runtime.types import SamplingParams

    gpu = device.type == "cuda"
    dtype = torch.bfloat16
    layout = DepthLayout.build(shape.layers, n)
    stage_layers = max(layout.split)
    target = stage_target(shape, stage_layers, device, dtype)
    room = context + timer.iters + timer.warmup + 8
    h = torch.randn(1, shape.hidden, device=device, dtype=dtype)
    stage = Stage(target, 0, range(stage_layers), room, cuda_graphs=gpu)
    stage.cache.reserve(0, context)
    stage.forward(h, context)  # captures; later replays advance the device length
    floor = lambda b: b / (bandwidth * 1e3)  # noqa: E731
    stage_b = stage_layers * (layer_bytes(shape) + kv_bytes(shape, 1, context))
    rows = []
    if gpu and stage.graphs.failed is not None:
        return [dict(what="stage", kind=MEASURED, model=shape.name, n=n,
                     error=str(stage.graphs.failed))]
    if gpu:
        stage_us, _ = timer(stage.graphs.graphs[1].graph.replay)
    else:  # eager, at a fixed position: the cache length is reset each call
        stage_us, _ = timer(lambda: stage.run(h, context))
    stage = None  # free the graph and caches before the drafts
    greedy = SamplingParams()
    types_of_depth = [layout.agg_type(k) for k in range(n + 1)]
    # steady state at fill n: rows [C - n, C] hold depths n, n-1, ..., 0
    types = torch.tensor([types_of_depth[n - i] for i in range(n + 1)], device=device)
    anchors = torch.randn(len(layout.anchors), n + 1, shape.hidden, device=device, dtype=dtype)
    cap = context + n + 8
    # the window's first position and the drafted one, on the device as the cycle passes them
    start = torch.tensor([context - n], device=device)
    position = torch.tensor(context + 1, device=device)
    for ls in pdm_layers:
        for vd in vocabs:
            pdm = random_pdm(shape, layout, ls, vd, None, device, dtype)
            for kind in kinds:
                # one PDM, its step reading bf16 weights or quantised copies of them
                pdm.quantize_("model" if kind == "bf16" else kind)
                drafter = PDMDrafter(pdm, cuda_graphs=gpu)
                drafter.begin(cap, shape.vocab)
                drafter.cache.reserve(0, context - n)
                draft_us, _ = timer(lambda: drafter.draft(anchors, types, start, position,
                                                          greedy, None))
                mode = "graph" if gpu else "eager (CPU smoke)"
                if gpu and (drafter.graphs is None or drafter.graphs.failed):
                    mode = "eager (graph capture failed)"
                # fp8 reads as many bytes as int8 (one byte a weight, an fp32 scale a row)
                d = draft_bytes(shape, layout, ls, vd, context,
                                "bf16" if kind == "bf16" else "int8")["total"]
                rows.append(dict(
                    what="draft vs stage", kind=MEASURED, draft_mode=mode, model=shape.name,
                    n=n, pdm_layers=ls, draft_vocab=vd, draft_weights=kind, context=context,
                    split=layout.split, stage_layers=stage_layers, draft_bytes=d,
                    stage_bytes=stage_b, draft_us=draft_us, stage_us=stage_us,
                    draft_floor_us=floor(d), stage_floor_us=floor(stage_b),
                    draft_x_floor=draft_us / floor(d), stage_x_floor=stage_us / floor(stage_b),
                    bandwidth_gb_s=bandwidth, ratio=draft_us / stage_us))
                drafter = None  # free the graphs before the next config
            pdm = None
    del target
    torch.cuda.empty_cache()
    return rows


def coverage(counts_path: str | None, vocabs: list[int]) -> dict | None:
    """Share of the target's argmax counts (a saved tensor [V]) the top-Vd ids cover."""
    if not counts_path:
        return None
    counts = torch.load(counts_path).to(torch.int64)
    top = torch.sort(counts, descending=True).values.cumsum(0)
    total = max(int(counts.sum()), 1)
    return {str(v): float(top[min(v, len(top)) - 1]) / total for v in vocabs}


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"{flag} takes comma-separated integers, got {text!r}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-4b,qwen3-8b")
    ap.add_argument("--stages", default="4,8", help="comma-separated n")
    ap.add_argument("--pdm-layers", default="1,2,3", help="comma-separated L_s")
    ap.add_argument("--draft-vocab", default="16384,32768", help="comma-separated Vd")
    ap.add_argument("--draft-stage", default="0",
                    help="stages S that host the draft in the n-device rows (comma-separated)")
    ap.add_argument("--context", type=int, default=1024, help="tokens already in the caches")
    ap.add_argument("--bandwidth-gbs", type=float, default=H200_NOMINAL_GBS,
                    help="bandwidth of the projection, GB/s (default the H200's 4800 nominal; "
                         "e.g. 4230 for its measured copy)")
    ap.add_argument("--projection-only", action="store_true", help="no measurement on a GPU")
    ap.add_argument("--draft-weights", default="bf16,int8,fp8",
                    help="weight formats of the measured draft rows (bf16, int8, fp8)")
    ap.add_argument("--measure", action="store_true",
                    help="measure on a CPU too (eager, tiny shapes: a smoke check of the "
                         "measured rows, not a timing)")
    ap.add_argument("--argmax-counts", default=None,
                    help="a torch-saved tensor [V] of the target's argmax counts: report the "
                         "share the top-Vd ids cover")
    add_device_args(ap)
    args = ap.parse_args()
    device, _, timer = device_setup(args, flush=True)
    gpu = device.type == "cuda" and not args.projection_only
    measure = gpu or (args.measure and not args.projection_only)
    kinds = tuple(k for k in args.draft_weights.split(",") if k)
    if not kinds or any(k not in ("bf16", "int8", "fp8") for k in kinds):
        sys.exit(f"--draft-weights takes bf16, int8 and fp8, got {args.draft_weights!r}")
    models = [m for m in args.models.split(",") if m]
    stages = _ints(args.stages, "--stages")
    pdm_layers = _ints(args.pdm_layers, "--pdm-layers")
    vocabs = _ints(args.draft_vocab, "--draft-vocab")
    on_stages = _ints(args.draft_stage, "--draft-stage")
    unknown = [m for m in models if m not in MODELS]
    if unknown or not stages or min(pdm_layers) < 1 or min(vocabs) < 1 or args.context < 1:
        sys.exit(f"--models from {', '.join(MODELS)}; --pdm-layers, --draft-vocab and "
                 "--context >= 1")
    bad = [n for m in models for n in stages if not 1 <= n <= MODELS[m].layers]
    if bad or args.bandwidth_gbs <= 0:
        sys.exit(f"--stages must lie in 1..L (got {bad}); --bandwidth-gbs > 0")
    measured_bw = copy_bandwidth(device, Timer(device, 10, 2)) if gpu else None
    if measure and not gpu:  # CPU smoke: floors against the projection bandwidth
        measured_bw = args.bandwidth_gbs
    print(f"{describe_device(device)}; context {args.context}; projection at "
          f"{args.bandwidth_gbs:.0f} GB/s"
          + (f"; measured copy bandwidth {measured_bw:.0f} GB/s" if gpu else
             " (no GPU here: every figure is a projection from bytes)"))
    table = Table([("model", "<10"), ("n", ">3"), ("pdm_layers", ">4", "L_s"),
                   ("draft_vocab", ">7", "Vd"), ("draft_weights", ">6", "w"),
                   ("kind", ">19"), ("stage_layers", ">7", "stage"),
                   ("draft_mb", ">9.1f", "draft MB"), ("stage_mb", ">9.1f", "stage MB"),
                   ("draft_us", ">9.1f", "draft us"), ("stage_us", ">9.1f", "stage us"),
                   ("ratio", ">12.2f", "draft/stage"), ("draft_x_floor", ">8.2f", "d xfl"),
                   ("stage_x_floor", ">8.2f", "s xfl")])
    nd_table = Table([("model", "<10"), ("n", ">3"), ("stage", ">3", "S"),
                      ("pdm_layers", ">4", "L_s"), ("draft_vocab", ">7", "Vd"),
                      ("draft_weights", ">6", "w"), ("split_text", ">22", "auto split"),
                      ("stage_layers", ">8", "S keeps"), ("fits", ">6"),
                      ("cycle_over_n1", ">14.2f", "cycle / n+1's")])
    out = args.json_out or RESULTS / f"{args.date}-draft-{device_tag(device)}.json"
    meta = run_meta(device, date=args.date, context=args.context,
                    projection_bandwidth_gb_s=args.bandwidth_gbs,
                    copy_bandwidth_gb_s=measured_bw, iters=timer.iters,
                    shapes={m: vars(MODELS[m]) for m in models},
                    note="projection rows: bytes / projection_bandwidth_gb_s, computed without "
                         "a GPU; the ratios are bandwidth-free. int8: 1-byte weights + an fp32 "
                         "scale per output row (norms, biases and KV stay bf16)")
    rows = []
    table.print_header()
    for m in models:
        shape = MODELS[m]
        for n in stages:
            found = projection_rows(shape, n, pdm_layers, vocabs, args.context,
                                    args.bandwidth_gbs)
            if measure:
                with torch.no_grad():
                    found += measured_rows(shape, n, pdm_layers, vocabs, args.context, device,
                                           timer, measured_bw, kinds)
            for r in found:
                if "error" in r:
                    print(f"{m:<10}{n:>3} stage graph failed: {r['error']}")
                else:
                    table.print(dict(r, draft_mb=r["draft_bytes"] / 1e6,
                                     stage_mb=r["stage_bytes"] / 1e6))
                rows.append(r)
            write_json(out, meta, rows=rows)  # after each (model, n): a cut run keeps its rows
    print("\nn-device mode: the draft on stage S, the balanced split (head on the last stage)")
    nd_table.print_header()
    for m in models:
        for n in stages:
            for r in on_stage_rows(MODELS[m], n, pdm_layers, vocabs, args.context, on_stages,
                                   args.bandwidth_gbs):
                nd_table.print(dict(r, split_text=",".join(map(str, r["split"])),
                                    fits=str(r["fits"]).lower()))
                rows.append(r)
    cov = coverage(args.argmax_counts, vocabs)
    if cov:
        print("argmax coverage of the top-Vd ids: "
              + ", ".join(f"{v}: {c:.4f}" for v, c in cov.items()))
    write_json(out, dict(meta, argmax_coverage=cov), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
