"""The decode cycle's own cost: the device loop (spd.runtime.device_loop) against the host loop.

One process, the chain, a drafter that proposes the target's own continuation right always or
half the time (ReferenceDrafter: accepted cycles, and rejections with their refills); greedy,
and sampled at temperature 1 with top-k 1 (the sampling path, whose one outcome is the greedy
token, so the drafter is right as planned). Per row:
cycles K, wall time per cycle, and for the device loop the host's time per cycle outside its
waits for a cycle's published state (what the host spends launching and reading), the replays
of the captured cycle (a GPU), and `ahead` (cycles launched past the one read).

On a GPU, `--spin-us F` adds a spin kernel of F microseconds (torch.cuda._sleep, calibrated) to
every stage step and every draft step, so the stages' and the drafter's compute are F each:
the device loop runs each role on its own stream (the in-process transport), so its cycle
minus F is the runtime's own cost (goal: <= 15 us). The host loop runs the stages one after
another (n F a cycle): its row is the one-process baseline, not a pipeline. With
`--target qwen3-4b` the stages are real steps of Qwen3-4B's shapes (random weights, L_s layers
each), sharing one GPU's bandwidth: label such figures so.

On a CPU there is no spin (F = 0) and everything runs in turn: the rows show the host loop's
and the device loop's Python and dispatch cost per cycle on the tiny emulated target, and the
device loop's extra work (bubbles during refills, a fixed n + 1 draft rows).

    python benchmarks/bench_device_loop.py                               # CPU, tiny target
    python benchmarks/bench_device_loop.py --device cuda --spin-us 200,600 --n 2,4,8
    python benchmarks/bench_device_loop.py --device cuda --target qwen3-4b --layers-per-stage 9

Prints the table and writes JSON (--json-out; default benchmarks/results/<date>-device-loop-
<device>.json).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, Table, device_tag, run_meta, write_json  # noqa: E402

from spd import SamplingParams, SPDEngine  # noqa: E402
from spd.distributed.emulate import tiny_target  # noqa: E402
from spd.draft.drafters import PDMDrafter, ReferenceDrafter  # noqa: E402
from spd.model.target import Stage  # noqa: E402
from spd.runtime.device_loop import DeviceLoop  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 11, 200, 13, 8, 21, 34]


def spin_clock_rate() -> float:
    """Clock cycles of torch.cuda._sleep per second on this GPU."""
    torch.cuda._sleep(10 ** 6)  # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10 ** 8)
    torch.cuda.synchronize()
    return 10 ** 8 / (time.perf_counter() - t0)


def with_spin(spin_cycles: int):
    """Patches Stage.step and PDMDrafter.draft_logits to spin `spin_cycles` after their work
    (0: unpatched); returns an undo callable."""
    if not spin_cycles:
        return lambda: None
    step, logits = Stage.step, PDMDrafter.draft_logits

    def spun_step(self, *args):
        out = step(self, *args)
        torch.cuda._sleep(spin_cycles)
        return out

    def spun_logits(self, *args):
        out = logits(self, *args)
        torch.cuda._sleep(spin_cycles)
        return out
    Stage.step, PDMDrafter.draft_logits = spun_step, spun_logits

    def undo():
        Stage.step, PDMDrafter.draft_logits = step, logits
    return undo


class WaitClock:
    """Sums the device loop's waits for published state (DeviceLoop._read) and keeps the last
    loop (its replays)."""

    def __init__(self):
        self.wait_s, self.loop = 0.0, None

    def __enter__(self):
        read, clock = DeviceLoop._read, self

        def timed(loop, cycle):
            clock.loop = loop
            t0 = time.perf_counter()
            try:
                return read(loop, cycle)
            finally:
                clock.wait_s += time.perf_counter() - t0
        self._read, DeviceLoop._read = read, timed
        return self

    def __exit__(self, *exc):
        DeviceLoop._read = self._read


def make_target(name: str, n: int, layers_per_stage: int, device: str):
    """The tiny emulated Llama (fp32), or a model of bench_kernels' MODELS with random weights
    and n * layers_per_stage layers (bf16)."""
    if name == "tiny":
        return tiny_target(seed=0, layers=max(n, 2), device=device)
    from bench_draft_hiding import stage_target
    from bench_kernels import MODELS
    if name not in MODELS:
        sys.exit(f"--target: tiny or one of {sorted(MODELS)}, got {name!r}")
    return stage_target(MODELS[name], n * layers_per_stage, device, torch.bfloat16)


def run_row(target, n: int, loop: str, ahead: int, sampling: SamplingParams, accuracy: float,
            tokens: int, reference: list[int]) -> dict:
    eng = SPDEngine(target, n_stages=n, lookup=0, warn_untrained=False,
                    device_loop=loop == "device", ahead=ahead)
    make = lambda: ReferenceDrafter(PROMPT + reference, accuracy, seed=1)  # noqa: E731
    eng.generate(PROMPT, tokens, sampling, drafter=make())  # warm: kernels, graphs
    with WaitClock() as clock:
        res = eng.generate(PROMPT, tokens, sampling, drafter=make())
    st = res.stats
    cycle_us = st.decode_s / st.K * 1e6
    row = dict(loop=loop, n=n, ahead=ahead if loop == "device" else None,
               sampling="greedy" if sampling.greedy else "sampled", accuracy=accuracy, K=st.K,
               N=st.N, accepted=st.drafts_accepted, judged=st.drafts_judged, cycle_us=cycle_us)
    if loop == "device":
        row["host_us"] = (st.decode_s - clock.wait_s) / st.K * 1e6
        row["replays"] = clock.loop.replays if clock.loop is not None else 0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default="tiny", help="tiny (emulated Llama) or qwen3-4b")
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--n", default="2,4,8")
    ap.add_argument("--spin-us", default="0", help="F per stage and draft step (GPU only)")
    ap.add_argument("--ahead", default="1,2,8", help="device loop: cycles launched ahead")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = args.device.startswith("cuda")
    spins = [float(x) for x in args.spin_us.split(",")]
    if not gpu and any(spins):
        sys.exit("--spin-us needs a GPU (torch.cuda._sleep)")
    rate = spin_clock_rate() if gpu and any(spins) else 0.0
    # sampled: top-k 1 at temperature 1 takes the sampling path (draws, q, rejection sampling)
    # with the greedy continuation as its only outcome, so a drafter of it is right as planned
    samplings = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=7)]
    table = Table([("loop", "<7"), ("n", ">3"), ("F_us", ">6.0f"), ("ahead", ">6"),
                   ("sampling", ">9"), ("accuracy", ">9.1f"), ("K", ">5"), ("accepted", ">9"),
                   ("cycle_us", ">10.1f"), ("over_F_us", ">10.1f"), ("host_us", ">9.1f"),
                   ("replays", ">8")])
    table.print_header()
    rows = []
    out = Path(args.json_out or RESULTS / f"{time.strftime('%Y-%m-%d')}-device-loop-"
               f"{device_tag(args.device)}.json")
    meta = run_meta(args.device, target=args.target, tokens=args.tokens,
                    layers_per_stage=args.layers_per_stage)
    for n in (int(x) for x in args.n.split(",")):
        target = make_target(args.target, n, args.layers_per_stage, args.device)
        for F in spins:
            undo = with_spin(int(F * 1e-6 * rate))
            try:
                for sampling in samplings:
                    ref = SPDEngine(target, n_stages=n, lookup=0, warn_untrained=False) \
                        .generate_ar(PROMPT, args.tokens).token_ids
                    for accuracy in (1.0, 0.5):
                        plan = [("host", 0)] + [("device", int(a))
                                                for a in args.ahead.split(",")]
                        for loop, ahead in plan:
                            row = run_row(target, n, loop, ahead, sampling, accuracy,
                                          args.tokens, ref)
                            row["F_us"] = F
                            if loop == "device":
                                row["over_F_us"] = row["cycle_us"] - F
                            table.print(row)
                            rows.append(row)
            finally:
                undo()
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            write_json(out, meta, rows=rows)  # after every n (kept if a later one is cut)
    print(f"wrote {out}")


if __name__ == "__main__":
    with torch.no_grad():
        main()
