"""Training throughput and memory: online distillation against the feature cache, 1 and 2 ranks.

Two kinds of rows:

- `--runs` (the default on a CPU): whole `spd train` runs on the default model (or --model),
  each in its own process (two ranks through torchrun on gloo): online, and cached (the
  built-in ShareGPT conversations, features extracted first). Training tokens/s is the median
  over the steps after the first (the first holds warm-up); the cached rows give the extraction's
  tokens/s apart, since it is paid once per data set. Peak memory is each rank's resident set
  (and GPU allocation), as `spd train` records it in OUT/memory.json.
- `--shapes qwen3-4b,qwen3-8b` (the GPU rows of benchmarks/device_train.sh): one process, a
  random target of that shape in bf16 and a PDM of the paper's size for it (hidden and MLP width
  of the target, 2 layers, 32k draft vocabulary), `--micro-batch` sequences of `--seq-len`
  random tokens: the online step (teacher forward, PDM forward and backward, optimiser) against
  the same step on features already in memory (what the cache would hand over). A projection of
  a GPU-scale run follows from these: tokens to train / tokens per second / GPUs.

    python benchmarks/bench_train.py                                   # CPU, default model
    python benchmarks/bench_train.py --shapes qwen3-4b,qwen3-8b --device cuda   # GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, Table, device_tag, run_meta, write_json  # noqa: E402

from spd.model.loading import describe_device  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


# --- whole runs -------------------------------------------------------------------------------
def _train_cmd(ranks: int, port: int) -> list[str]:
    if ranks == 1:
        return [sys.executable, "-m", "spd"]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
            "--master-port", str(port), "-m", "spd"]


def run_row(mode: str, ranks: int, args, work: Path) -> dict:
    out = work / f"{mode}-{ranks}"
    common = ["train", "--out", str(out), "--stages", str(args.stages), "--mode", mode,
              "--steps", str(args.steps), "--batch", str(args.batch), "--eval-every",
              str(args.steps), "--crop-len", str(args.crop_len), "--max-len", str(args.max_len),
              "--dtype", args.target_dtype, "--eval-sequences", "2", "--storage", "fp32",
              "--json"]
    if args.model:
        common += ["--model", args.model]
    if mode == "online":
        common += ["--data", *args.data]
    else:  # the built-in data: ShareGPT conversations, no self-distillation
        common += ["--conversations", str(args.conversations), "--self-distill", "0",
                   "--features", str(work / f"features-{ranks}")]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, args.threads // ranks)))
    t0 = time.perf_counter()
    r = subprocess.run(_train_cmd(ranks, 29400 + os.getpid() % 500) + common, cwd=ROOT,
                       capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    row = {"mode": mode, "ranks": ranks, "wall_s": wall}
    if r.returncode != 0:
        row["error"] = (r.stderr.strip().splitlines() or ["?"])[-1][:200]
        return row
    hist = json.loads((out / "history.json").read_text())
    times = [h["time_s"] for h in hist]
    steps = [b - a for a, b in zip(times, times[1:])]  # the first step holds the warm-up
    step_s = statistics.median(steps) if steps else times[0]
    tokens = statistics.median(h["tokens"] for h in hist)
    peaks = json.loads((out / "memory.json").read_text())["peak_per_rank"]
    row.update(step_s=step_s, tokens_per_step=tokens, tok_s=tokens / step_s,
               peak_rss_mb=max(p["rss_mb"] for p in peaks),
               peak_gpu_mb=max((p.get("gpu_mb", 0.0) for p in peaks), default=0.0),
               loop_s=times[-1], setup_s=wall - times[-1])
    if mode == "cached":  # extracted before training (setup_s holds it), once per data set
        from spd.train.distill import FeatureSet
        row["cache_tokens"] = FeatureSet(work / f"features-{ranks}").token_count()
    return row


# --- shapes (GPU) -----------------------------------------------------------------------------
def shape_rows(name: str, args, device) -> list[dict]:
    from bench_draft_hiding import stage_target
    from bench_kernels import MODELS

    from spd.model.partition import DepthLayout
    from spd.train.batches import Piece
    from spd.train.teacher import Teacher
    from spd.train.trainer import Distiller, TrainConfig, init_pdm

    shape = MODELS[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = stage_target(shape, shape.layers, device, dtype)
    layout = DepthLayout.build(shape.layers, args.stages, None, None)
    cfg = TrainConfig(n_stages=args.stages, anchors=list(layout.anchors), pdm_layers=2,
                      intermediate_size=shape.intermediate,
                      draft_vocab_size=min(32768, shape.vocab))
    vocab = torch.arange(cfg.draft_vocab_size)
    pdm = init_pdm(target, layout, cfg, vocab).to(device)
    teacher = Teacher(target, list(layout.anchors))
    distiller = Distiller(target, pdm, list(layout.anchors))
    opt = torch.optim.AdamW([p for p in pdm.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, shape.vocab, (args.seq_len,), generator=g).tolist()
            for _ in range(args.micro_batch)]
    fills = [args.stages if i % 2 else 1 + i % args.stages for i in range(args.micro_batch)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def pdm_step(items):
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss, valid, *_ = distiller.sums([Piece(x, f, i) for i, (x, f)
                                                in enumerate(zip(items, fills))], args.pack)
        (loss / max(valid, 1)).backward()
        opt.step()

    def online():
        pdm_step(teacher(seqs))

    cached_items = teacher(seqs)

    def cached():
        pdm_step(cached_items)

    rows = []
    for mode, fn in (("online", online), ("cached", cached)):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):
            fn()
        sync()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times)
        tokens = args.micro_batch * args.seq_len
        row = {"shape": name, "mode": mode, "ranks": 1, "step_s": step_s,
               "tokens_per_step": tokens, "tok_s": tokens / step_s}
        if device.type == "cuda":
            row["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
        rows.append(row)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        teacher(seqs)
    sync()
    rows.append({"shape": name, "mode": "teacher only", "ranks": 1,
                 "step_s": (time.perf_counter() - t0) / args.iters,
                 "tokens_per_step": args.micro_batch * args.seq_len})
    rows[-1]["tok_s"] = rows[-1]["tokens_per_step"] / rows[-1]["step_s"]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default=None, help="e.g. qwen3-4b,qwen3-8b (in-process rows)")
    ap.add_argument("--model", default=None, help="runs: the target (default: SmolLM2-135M)")
    ap.add_argument("--data", nargs="+", default=["sharegpt"], help="runs: online data")
    ap.add_argument("--target-dtype", default="bfloat16", help="runs: the teacher's dtype")
    ap.add_argument("--modes", default="online,cached")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="runs: sequences per step")
    ap.add_argument("--crop-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--conversations", type=int, default=64, help="runs: cached data size")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="runs: CPU threads in all (split between ranks)")
    ap.add_argument("--seq-len", type=int, default=2048, help="shapes: tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=4, help="shapes: sequences per step")
    ap.add_argument("--pack", type=int, default=0, help="shapes: --pack-tokens")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    tag = device_tag(device)
    out = Path(args.json_out or RESULTS / f"{time.strftime('%Y-%m-%d')}-train-{tag}.json")
    meta = run_meta(device, command=" ".join(sys.argv), target_dtype=args.target_dtype,
                    stages=args.stages)
    rows = []
    table = Table([("shape", "<14"), ("mode", "<14"), ("ranks", ">6"), ("tok_s", ">10.0f"),
                   ("step_s", ">9.2f"), ("tokens_per_step", ">9.0f", "tok/step"),
                   ("peak_rss_mb", ">9.0f", "RSS MB"), ("peak_gpu_mb", ">9.0f", "GPU MB"),
                   ("setup_s", ">9.1f"), ("cache_tokens", ">10.0f", "cache tok")])
    print(f"{describe_device(device)}")
    table.print_header()
    if args.shapes:
        for name in args.shapes.split(","):
            for r in shape_rows(name, args, device):
                table.print(r)
                rows.append(r)
                write_json(out, meta, rows=rows)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in args.modes.split(","):
                for ranks in (int(x) for x in args.ranks.split(",")):
                    r = run_row(mode, ranks, args, Path(tmp))
                    r["shape"] = Path(args.model).name if args.model else "smollm2-135m"
                    if "error" in r:
                        print(f"{mode} x{ranks}: {r['error']}")
                    else:
                        table.print(r)
                    rows.append(r)
                    write_json(out, meta, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
