"""What a batch of sequences would cost a stage: the stage step over B sequences against one.

Issue 54's premise: a stage step is bound by reading its weights, so B rows (one per sequence)
cost about what one row costs while B is small. This times `batch_stage_step` (B sequences, one
row each, every row against its own slot's `--context` keys: docs/batching.md) for B = 1, 2, 4,
8, 16 against the one-sequence `stage_step` of one row, on the default model's layers of one
stage at n = 4 and on all its layers, eagerly on this machine's kernels.

It also measures batch invariance: whether row r of a linear layer over B rows equals the same
row alone, bit for bit, for every linear shape of the model. Where it does not, B sequences
decoded together round differently from each alone (the issue's exactness question).

    python benchmarks/bench_batch_step.py --json-out out.json
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import Table, run_meta, write_json

from spd.model.loading import load_target
from spd_kernels.stage import batch_stage_step, stage_step

BATCHES = (1, 2, 4, 8, 16)


def median_s(step, iters: int) -> float:
    """Median seconds of `step()` over `iters` calls after two warm-up calls."""
    times = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def invariance(target, batches) -> list[dict]:
    """For each linear shape of a decoder layer and the LM head: the rows of a B-row product
    that differ from the same row computed alone (bitwise), and the largest difference."""
    layer = target.layers[0]
    weights = {"q_proj": layer.self_attn.q_proj.weight, "o_proj": layer.self_attn.o_proj.weight,
               "up_proj": layer.mlp.up_proj.weight, "down_proj": layer.mlp.down_proj.weight,
               "lm_head": target.lm_head.weight}
    gen = torch.Generator().manual_seed(0)
    out = []
    with torch.no_grad():
        for name, w in weights.items():
            x = torch.randn(max(batches), w.shape[1], generator=gen).to(w.dtype)
            alone = torch.cat([torch.nn.functional.linear(x[r:r + 1], w)
                               for r in range(x.shape[0])])
            for B in batches:
                together = torch.nn.functional.linear(x[:B], w)
                differ = (together != alone[:B]).any(1)
                out.append(dict(linear=name, shape=list(w.shape), B=B,
                                rows_differing=int(differ.sum()),
                                max_abs_diff=float((together - alone[:B]).abs().max())))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.context < 1 or args.iters < 1:
        ap.error("--context and --iters must be at least 1")

    target = load_target()
    L = target.num_layers
    rows = []
    table = Table([("layers", ">8"), ("B", ">4"), ("step", ">18"), ("step_ms", ">9.2f", "ms"),
                   ("per_row_ms", ">12.2f", "ms per row"), ("vs_one", ">10.2f", "x one row")])
    table.print_header()
    gen = torch.Generator().manual_seed(0)
    S = args.context + 1
    cos, sin = target.rope(0, S)
    for first, last in ((0, L // 4), (0, L)):
        weights = target.stage_weights(range(first, last))
        shape = (max(BATCHES), last - first, target.num_kv_heads, S, target.head_dim)
        k = torch.randn(shape, generator=gen).to(target.dtype)
        v = torch.randn(shape, generator=gen).to(target.dtype)
        x = torch.randn(max(BATCHES), target.hidden_size, generator=gen).to(target.dtype)
        at = torch.full((max(BATCHES),), args.context)
        with torch.no_grad():
            one = median_s(lambda: stage_step(x[:1], weights, k[0], v[0], args.context, cos,
                                              sin), args.iters)
            rows.append(dict(layers=f"{first}-{last - 1}", B=1, step="stage_step",
                             step_ms=1e3 * one, per_row_ms=1e3 * one, vs_one=1.0))
            table.print(rows[-1])
            for B in BATCHES:
                s = median_s(lambda: batch_stage_step(x[:B], weights, k[:B], v[:B],
                                                      torch.arange(B), at[:B], cos, sin),
                             args.iters)
                rows.append(dict(layers=f"{first}-{last - 1}", B=B, step="batch_stage_step",
                                 step_ms=1e3 * s, per_row_ms=1e3 * s / B, vs_one=s / one))
                table.print(rows[-1])
    inv = invariance(target, BATCHES)
    print("\nbatch invariance of the CPU's linear layers (rows of a B-row product that differ "
          "from the row alone):")
    for r in inv:
        if r["B"] > 1:
            print(f"  {r['linear']:>10} {str(r['shape']):>14} B={r['B']:>2}: "
                  f"{r['rows_differing']}/{r['B']} rows, max |diff| {r['max_abs_diff']:.2e}")
    if args.json_out:
        write_json(args.json_out, run_meta(target.device, model=target.name,
                                           context=args.context, iters=args.iters,
                                           threads=torch.get_num_threads()),
                   rows=rows, invariance=inv)


if __name__ == "__main__":
    main()
