"""What every benchmark shares: the timer, the run's metadata, the printed table and the JSON file.

    timer = Timer(device, iters=50, warmup=5)      # (median, min) microseconds per call
    table = Table([("method", "<20"), ("tok/s", ">8.1f")]); table.print_header(); table.print(row)
    write_json(path, run_meta(device, model=...), rows=rows)   # {"meta": {...}, "rows": [...]}

Figures name their device (`run_meta`'s `device`: the GPU's name, or the CPU and its threads),
and a JSON file records the command that produced it.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from spd.model.loading import describe_device

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Timer:
    """Times a callable: CUDA events on a GPU (optionally flushing L2 first, so weights are read
    from HBM as in a real decode step), perf_counter on a CPU."""

    L2_FLUSH_BYTES = 256 * 2 ** 20  # larger than an H200's 50 MB L2

    def __init__(self, device, iters: int, warmup: int, flush: bool = False):
        self.device, self.iters, self.warmup = torch.device(device), iters, warmup
        self.flush_buf = None
        if flush and self.device.type == "cuda":
            self.flush_buf = torch.empty(self.L2_FLUSH_BYTES, dtype=torch.uint8,
                                         device=self.device)

    def __call__(self, fn) -> tuple[float, float]:
        """(median, min) microseconds per call."""
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(self.iters):
                if self.flush_buf is not None:
                    self.flush_buf.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
        else:
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times), min(times)


def device_tag(device) -> str:
    """Short device name for result file names: cpu, h200, h100, ..."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "a100", "l40s", "b200"):
        if key in name:
            return key
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def run_meta(device="cpu", **extra) -> dict:
    """The metadata every result file carries, plus `extra` (which may override a field, e.g.
    the date a device session names its files with)."""
    return dict(date=str(date.today()), device=describe_device(device),
                device_type=torch.device(device).type, platform=platform.platform(),
                cores=os.cpu_count(), threads=torch.get_num_threads(),
                load_avg=list(os.getloadavg()), torch=torch.__version__, commit=_commit(),
                command="python " + " ".join(sys.argv)) | extra


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (0 <= q <= 1), the nearest of them (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def write_json(path, meta: dict, **payload) -> Path:
    """{"meta": meta, **payload} to `path` (folders made); prints where it went."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, **payload}, indent=1))
    print(f"wrote {path}")
    return path


class Table:
    """A fixed-width text table: columns of (key, format spec), headed by the key or a label
    given as (key, spec, label). Missing values print as '-'."""

    def __init__(self, columns):
        self.columns = [(c[0], c[1], c[2] if len(c) > 2 else c[0]) for c in columns]

    def _width(self, spec: str) -> int:
        digits = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return int(digits) if digits else 0

    def header(self) -> str:
        line = "".join(f"{label:{spec[0] if spec[0] in '<>^' else '>'}{self._width(spec)}}"
                       for _, spec, label in self.columns)
        return line + "\n" + "-" * len(line)

    def line(self, row: dict) -> str:
        out = []
        for key, spec, _ in self.columns:
            v = row.get(key)
            if v is None:
                align = spec[0] if spec[0] in "<>^" else ">"
                out.append(f"{'-':{align}{self._width(spec)}}")
            else:
                out.append(f"{v:{spec}}")
        return "".join(out)

    def print_header(self) -> None:
        print(self.header())

    def print(self, row: dict) -> None:
        print(self.line(row), flush=True)


def add_device_args(ap) -> None:
    """The options every device benchmark takes: device, dtype, timing, threads, output."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="default bf16 on a GPU, fp32 on the CPU")
    ap.add_argument("--iters", type=int, default=None, help="timed calls (default 50 GPU, 5 CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls (default 5 GPU, 1 CPU)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--date", default=str(date.today()))
    ap.add_argument("--json-out", default=None)


def device_setup(args, flush: bool = False) -> tuple[torch.device, torch.dtype, Timer]:
    """(device, dtype, timer) from add_device_args' options; exits with a message when the
    device asked for is missing. flush: the timer flushes L2 between calls on a GPU."""
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if gpu and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    timer = Timer(device, args.iters or (50 if gpu else 5),
                  args.warmup if args.warmup is not None else (5 if gpu else 1), flush=flush)
    return device, dtype, timer
