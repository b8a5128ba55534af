"""The decode cycle's own cost (spd.runtime.cycle) in one process: wall and host time per cycle.

SPDEngine.generate with every stage in this process (each on a CUDA stream of its own:
spd.runtime.engine.LocalStages), a chain (W = 1) or a token tree (--widths, e.g. 1,4), greedy
and sampled at temperature 1 with top-k 1 (the sampling path: draws, q, rejection sampling,
whose one outcome is the greedy token). The drafter runs the real draft step of an untrained PDM
(its cost, not its guesses), then proposes the target's own continuation, right always or about
half the time (`SteeredDrafter`: accepted cycles, and rejections with their refills). Every
decode is checked against plain AR decoding of the target: the benchmark exits on a difference.

Per row, from the host's reads of each cycle's published state (spd.runtime.driver.Published),
over the steady cycles (the first ahead + 1 and the last ahead intervals left out):
  cycle_us   median time between the host's reads of consecutive cycles: what a cycle takes
  host_us    the median of that time less the host's wait for the cycle's state: what the host
             spends launching and reading a cycle (on a CPU, where a launch runs the cycle: all)
  per_K_us   decode seconds / K (the first cycles, the graph's capture and the end included)
and K, N, drafts judged and accepted, `ahead` (cycles launched past the one read) and the
cycle graph's replays (the JSON says why a decode ran eagerly: `eager`).

On a GPU, `--spin-us F` adds a spin kernel of F microseconds (torch.cuda._sleep, calibrated)
after every stage step and every draft step, so each role's compute is F; the roles run on
streams of their own, so a cycle takes F plus the runtime's own cost: over_F_us = cycle_us - F
(goal: <= 15 us). With `--target qwen3-4b` (or qwen3-8b) the stages are real steps of that
model's shapes (random weights, --layers-per-stage layers each) sharing one GPU's bandwidth:
label such figures so. On a CPU there is no spin (F = 0) and everything runs in turn: the rows
give the cycle's Python and dispatch cost on a tiny random target (a dead unit's stage step is
skipped there: spd.runtime.cycle, "peek").

    python benchmarks/bench_cycle.py                                    # CPU, tiny target
    python benchmarks/bench_cycle.py --device cuda --spin-us 200,600 --n 2,4,8 --widths 1,4
    python benchmarks/bench_cycle.py --device cuda --target qwen3-4b --layers-per-stage 9

Prints the table and writes JSON (--json-out; default benchmarks/results/<date>-cycle-
<device>.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, Table, device_tag, run_meta, write_json  # noqa: E402

from spd import SamplingParams, SPDEngine  # noqa: E402
from spd.distributed.emulate import tiny_target  # noqa: E402
from spd.draft.drafters import Draft, PDMDrafter  # noqa: E402
from spd.draft.pdm import PipelineDraftModule  # noqa: E402
from spd.model.partition import DepthLayout  # noqa: E402
from spd.model.target import Stage  # noqa: E402
from spd.runtime.cycle import Cycle  # noqa: E402
from spd.runtime.driver import Published  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 11, 200, 13, 8, 21, 34]
GOAL_US = 15.0
# the work a spin follows: the chain's and the tree's stage steps and draft steps
SPUN = ((Stage, "step"), (Stage, "tree_run"), (PDMDrafter, "draft_logits"),
        (PDMDrafter, "tree_logits"))


def spin_clock_rate() -> float:
    """Clock cycles of torch.cuda._sleep per second on this GPU."""
    torch.cuda._sleep(10 ** 6)  # warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(10 ** 8)
    torch.cuda.synchronize()
    return 10 ** 8 / (time.perf_counter() - t0)


@contextlib.contextmanager
def spin(clocks: int):
    """While active, every method of SPUN spins `clocks` after its work (0: unchanged)."""
    saved = [(cls, name, cls.__dict__[name]) for cls, name in SPUN] if clocks else []
    for cls, name, real in saved:
        def spun(self, *args, _real=real, **kwargs):
            out = _real(self, *args, **kwargs)
            torch.cuda._sleep(clocks)
            return out
        setattr(cls, name, spun)
    try:
        yield
    finally:
        for cls, name, real in saved:
            setattr(cls, name, real)


class SteeredDrafter(PDMDrafter):
    """The real draft step, then the target's own continuation `reference` (prompt included,
    by position) proposed with probability `accuracy`, drawn on the device (a CUDA graph's
    replays draw anew), else a wrong token. A chain's draft is replaced (under sampling q is
    one-hot on it); a token tree's leaves get the reference's draft column on top, or, missed,
    at the bottom (absent from the children)."""

    def __init__(self, pdm, reference: list[int], accuracy: float):
        super().__init__(pdm, lookup=0)
        self.reference, self.accuracy = reference, accuracy

    def begin(self, capacity: int, vocab_size: int) -> None:
        super().begin(capacity, vocab_size)
        d2t = self.pdm.draft_to_target
        dev = d2t.device
        self.table = torch.tensor((self.reference + [0] * capacity)[:capacity], device=dev)
        self.ids = torch.arange(vocab_size, device=dev)
        self.column = torch.zeros(vocab_size, dtype=torch.int64, device=dev).index_copy_(
            0, d2t, torch.arange(d2t.numel(), device=dev))

    def _hit(self, shape, device) -> torch.Tensor:
        return torch.rand(shape, device=device) < self.accuracy

    def draft(self, anchors, types, start, position, sampling, uniform, last=None) -> Draft:
        super().draft(anchors, types, start, position, sampling, uniform, last)
        right = self.table.index_select(0, position.reshape(1)).reshape(())
        token = torch.where(self._hit((), right.device), right, (right + 1) % self.vocab_size)
        return Draft(token, None if sampling.greedy else (self.ids == token).float())

    def tree_logits(self, anchors, types, positions, slots, prefix_len, tree_mask, leaves):
        logits = super().tree_logits(anchors, types, positions, slots, prefix_len, tree_mask,
                                     leaves).float()
        drafted = positions.index_select(0, leaves) + 1  # each leaf's child's position
        col = self.column.index_select(0, self.table.index_select(0, drafted))
        mark = torch.where(self._hit(leaves.shape, logits.device), 1e4, -1e4)
        return logits.scatter(1, col.view(-1, 1), mark.view(-1, 1))


class Clock:
    """While active: when each of the host's reads of a cycle's published state began and ended
    (Published.read) and the decode's Cycle (its graph)."""

    def __enter__(self):
        self.reads: list[tuple[float, float]] = []
        self.cycle: Cycle | None = None
        self._saved = read, run = Published.read, Cycle.run
        clock = self

        def timed_read(published, step):
            t0 = time.perf_counter()
            try:
                return read(published, step)
            finally:
                clock.reads.append((t0, time.perf_counter()))

        def kept_run(cycle):
            clock.cycle = cycle
            return run(cycle)
        Published.read, Cycle.run = timed_read, kept_run
        return self

    def __exit__(self, *exc):
        Published.read, Cycle.run = self._saved

    def steady(self, ahead: int) -> tuple[float | None, float | None]:
        """(median cycle, median host) microseconds between consecutive reads, the first
        ahead + 1 and the last ahead intervals left out where enough remain."""
        ends = [b for _, b in self.reads]
        cycle = [b - a for a, b in zip(ends, ends[1:])]
        host = [c - (b - a) for c, (a, b) in zip(cycle, self.reads[1:])]
        lo, hi = ahead + 1, len(cycle) - ahead
        if hi - lo < 3:
            lo, hi = 0, len(cycle)
        if not cycle:
            return None, None
        return (statistics.median(cycle[lo:hi]) * 1e6, statistics.median(host[lo:hi]) * 1e6)


def make_target(name: str, n: int, layers_per_stage: int, device: str):
    """The tiny random Llama (fp32), or a model of bench_kernels' MODELS with random weights
    and n * layers_per_stage layers (bf16)."""
    if name == "tiny":
        return tiny_target(seed=0, layers=max(n, 2), device=device)
    from bench_draft_hiding import stage_target
    from bench_kernels import MODELS
    if name not in MODELS:
        sys.exit(f"--target: tiny or one of {sorted(MODELS)}, got {name!r}")
    return stage_target(MODELS[name], n * layers_per_stage, device, torch.bfloat16)


def untrained_pdm(target, n: int, reference: list[int]):
    """An untrained PDM whose draft vocabulary holds every token of `reference` (the tree's
    steering needs each one's column)."""
    vocab = sorted(set(range(min(target.vocab_size, 8192))) | set(reference))
    return PipelineDraftModule.untrained(target, DepthLayout.build(target.num_layers, n),
                                         draft_vocab=torch.tensor(vocab))


def run_row(target, pdm, n: int, width: int, ahead: int, sampling: SamplingParams,
            accuracy: float, tokens: int, reference: list[int]) -> dict:
    eng = SPDEngine(target, n_stages=n, pdm=pdm, lookup=0, tree_width=width, ahead=ahead)
    drafter = SteeredDrafter(pdm, PROMPT + reference, accuracy)
    eng.generate(PROMPT, tokens, sampling, drafter=drafter)  # warm: kernels, stage graphs
    torch.manual_seed(1)  # the drafter's hits
    with Clock() as clock:
        res = eng.generate(PROMPT, tokens, sampling, drafter=drafter)
    kind = "greedy" if sampling.greedy else "sampled"
    if list(res.token_ids) != reference:
        sys.exit(f"n={n} W={width} {kind} accuracy {accuracy}: tokens differ from AR decoding")
    st, graph = res.stats, clock.cycle.graph.describe()
    cycle_us, host_us = clock.steady(ahead)
    return dict(n=n, W=width, ahead=ahead, sampling=kind, accuracy=accuracy, K=st.K, N=st.N,
                judged=st.drafts_judged, accepted=st.drafts_accepted,
                cycles=clock.cycle.cycles, reads=len(clock.reads), cycle_us=cycle_us,
                host_us=host_us, per_K_us=st.decode_s / st.K * 1e6 if st.K else None,
                replays=graph["replays"], eager=graph["eager"])


def floats(text: str, flag: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"{flag} takes comma-separated numbers, got {text!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target", default="tiny", help="tiny (random Llama), qwen3-4b or qwen3-8b")
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--n", default="2,4,8")
    ap.add_argument("--widths", default="1,4", help="tree widths W (1: a chain)")
    ap.add_argument("--spin-us", default="0", help="F per stage and draft step (GPU only)")
    ap.add_argument("--ahead", default="2", help="cycles launched past the one read")
    ap.add_argument("--accuracy", default="1,0.5", help="how often the drafter is right")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    ns, widths = [int(x) for x in floats(args.n, "--n")], [int(x) for x in
                                                           floats(args.widths, "--widths")]
    aheads = [int(x) for x in floats(args.ahead, "--ahead")]
    spins, accuracies = floats(args.spin_us, "--spin-us"), floats(args.accuracy, "--accuracy")
    if args.tokens < 2 or min(ns) < 2 or min(aheads) < 0 or not all(1 <= w <= 16 for w in widths):
        sys.exit("--tokens >= 2, --n >= 2, --ahead >= 0, --widths in 1..16")
    gpu = args.device.startswith("cuda")
    if not gpu and any(spins):
        sys.exit("--spin-us needs a GPU (torch.cuda._sleep)")
    rate = spin_clock_rate() if gpu and any(spins) else 0.0
    samplings = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=7)]
    table = Table([("n", ">3"), ("W", ">3"), ("F_us", ">6.0f"), ("ahead", ">6"),
                   ("sampling", ">9"), ("accuracy", ">9.2f"), ("K", ">5"), ("accepted", ">9"),
                   ("cycle_us", ">10.1f"), ("over_F_us", ">10.1f"), ("host_us", ">9.1f"),
                   ("per_K_us", ">10.1f"), ("replays", ">8")])
    out = Path(args.json_out or RESULTS / f"{time.strftime('%Y-%m-%d')}-cycle-"
               f"{device_tag(args.device)}.json")
    meta = run_meta(args.device, target=args.target, tokens=args.tokens,
                    layers_per_stage=args.layers_per_stage, goal_us=GOAL_US)
    print(f"the decode cycle in one process on {meta['device']}, {args.target} target, "
          f"{args.tokens} new tokens")
    table.print_header()
    rows = []
    for n in ns:
        target = make_target(args.target, n, args.layers_per_stage, args.device)
        ref = list(SPDEngine(target, n_stages=1).generate_ar(PROMPT, args.tokens).token_ids)
        pdm = untrained_pdm(target, n, PROMPT + ref)
        for F in spins:
            with spin(int(F * 1e-6 * rate)):
                for width in widths:
                    for sampling in samplings:
                        for accuracy in accuracies:
                            for ahead in aheads:
                                row = run_row(target, pdm, n, width, ahead, sampling, accuracy,
                                              args.tokens, ref)
                                row["F_us"] = F
                                if F and row["cycle_us"] is not None:
                                    row["over_F_us"] = row["cycle_us"] - F
                                table.print(row)
                                rows.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)  # after every n: kept if a later one is cut
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    spun = [r for r in rows if r["F_us"] and r.get("over_F_us") is not None]
    if spun:
        met = sum(r["over_F_us"] <= GOAL_US for r in spun)
        print(f"cycle - F <= {GOAL_US:g} us in {met} of {len(spun)} rows with a spin")
    write_json(out, meta, rows=rows)


if __name__ == "__main__":
    with torch.no_grad():
        main()
