"""Kernel launches per steady decode cycle outside the stage and draft steps (CPU count).

On a GPU every op of a cycle's control is a launch, and they depend on one another: at about
1.3-2 us a dependent launch in a CUDA graph, the count sets the control's cost on the critical
path. This probe counts them on the CPU from a dispatch trace (a TorchDispatchMode):
  - every aten op that would launch a kernel counts one: views (their result aliases an
    input), allocations (`empty*`) and host reads of CPU values (`_local_scalar_dense`: a CPU's
    look at its units, which a GPU's cycle does not make) are left out;
  - a call of an spd_kernels op counts one (spd_kernels.opdef.called_as_ops: the dispatch
    mode sees the op, not its CPU reference's torch ops);
  - left out: the stage steps (LocalStages.run, BatchStages.run; on a stage rank
    StageStep.run), the draft step (the drafter's `draft` / `tree_top`: the PDM step and its
    pick, a chain's token or a tree's top children of each leaf, on its own stream beside the
    stages; a batch's one PDM step over every window and its picks, ChainBatch._draft and
    TreeBatch._draft)
    and a stage rank's messages (Endpoint.exchange, order, flush_sends). The publish copy of
    each cycle's state to the host counts.
It decodes a tiny random target (the counts do not depend on its size) with the engine's own
PDM drafter, and reports the steady cycles' count (every cycle after the first two: the eager
warm-up a graph capture follows).

    python benchmarks/probe_cycle_launches.py [--json-out PATH]

Prints a table (rank 0: one sequence and a batch, greedy, sampled, or "mixed": greedy sequences
and sampled ones of two temperatures, three judge groups; each stage rank) and writes JSON.
Device: CPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

REPO = Path(__file__).resolve().parents[1]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4, 1, 5]


class LaunchCount(TorchDispatchMode):
    """The ops of a cycle that would launch a kernel (module docstring)."""
    # (resize_ to a tensor's own size, as torch.rand(out=) does, launches nothing)
    FREE = ("empty", "empty_strided", "empty_like", "_local_scalar_dense", "resize_")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema
        view = any(r.alias_info is not None and not r.alias_info.is_write
                   for r in schema.returns)
        if not view and func.overloadpacket.__name__ not in self.FREE:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _uncounted(fn):
    def run(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    run._spd_uncounted = True
    return run


@contextlib.contextmanager
def patched(*targets):
    """Replace (owner, name, wrapper(fn)) for the block."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, wrap in targets:
            setattr(owner, name, wrap(getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _steps_left_out():
    """(owner, name, wrapper) for the stage and draft steps, which the count leaves out."""
    from spd.distributed.draft_rank import RemoteStages
    from spd.distributed.transport import Endpoint
    from spd.draft.drafters import PDMDrafter
    from spd.runtime.batch_spd import BatchStages
    from spd.runtime.chain_batch import ChainBatch
    from spd.runtime.engine import LocalStages
    from spd.runtime.tree_batch import TreeBatch
    from spd.runtime.unit import StageStep
    return [(LocalStages, "run", _uncounted), (BatchStages, "run", _uncounted),
            (RemoteStages, "run", _uncounted), (StageStep, "run", _uncounted),
            (PDMDrafter, "draft", _uncounted), (PDMDrafter, "tree_logits", _uncounted),
            (PDMDrafter, "tree_top", _uncounted), (ChainBatch, "_draft", _uncounted),
            (TreeBatch, "_draft", _uncounted), (Endpoint, "exchange", _uncounted),
            (Endpoint, "order", _uncounted), (Endpoint, "flush_sends", _uncounted)]


def _counting(per_cycle: list):
    """A wrapper that counts each call of the wrapped launch (one cycle) into per_cycle."""
    from spd_kernels.opdef import called_as_ops

    def wrap(fn):
        def launch(*args, **kwargs):
            mode = LaunchCount()
            with called_as_ops(), mode:
                out = fn(*args, **kwargs)
            per_cycle.append(mode.ops)
            return out
        return launch
    return wrap


def steady(per_cycle: list) -> list[str]:
    """The ops of a steady cycle: the same in every cycle after the warm-up, checked."""
    body = per_cycle[2:-1] or per_cycle[2:]
    if not body:
        raise RuntimeError("the decode ran too few cycles to count a steady one")
    counts = Counter(len(ops) for ops in body)
    return max(body, key=lambda ops: (counts[len(ops)], -len(ops)))


def _target():
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_target
    return make_tiny_target(seed=3, vocab=32, layers=4)


def _sampling(kind: str, count: int = 0):
    """greedy, sampled (one temperature and top-k), or for `count` sequences "mixed": greedy
    ones and sampled ones of two temperatures in turn (three judge groups)."""
    from spd import SamplingParams
    if kind == "mixed":
        kinds = [SamplingParams(), SamplingParams(temperature=1.0, top_k=20, seed=1),
                 SamplingParams(temperature=0.7, seed=2)]
        return [kinds[i % 3] for i in range(count)]
    return SamplingParams() if kind == "greedy" else SamplingParams(temperature=1.0, top_k=20,
                                                                    seed=1)


def count_one(kind: str, n: int = 4, width: int = 1, lookup: int = 0, tokens: int = 24,
              target=None) -> list[str]:
    """A steady cycle's ops at rank 0 of the one-process engine, one sequence."""
    from spd import SPDEngine
    from spd.runtime.cycle import Cycle
    target = target or _target()
    engine = SPDEngine(target, n_stages=n, tree_width=width, lookup=lookup,
                       warn_untrained=False)
    per_cycle: list = []
    with patched(*_steps_left_out(), (Cycle, "launch", _counting(per_cycle))):
        engine.generate(PROMPT, tokens, _sampling(kind))
    return steady(per_cycle)


def count_batch(kind: str, batch: int, n: int = 4, width: int = 1, tokens: int = 24,
                target=None, lookup: int = 0) -> list[str]:
    """A steady cycle's ops of the one-process batch (BatchedSPD.step's device work and
    publishes, without its prefills and reads), `batch` sequences decoding."""
    from spd import SPDEngine
    from spd.runtime.batch_spd import BatchedSPD
    target = target or _target()
    engine = SPDEngine(target, n_stages=n, tree_width=width, lookup=lookup,
                       warn_untrained=False)
    per_cycle: list = []
    prompts = [PROMPT[i % 5:] + [i % 7] for i in range(batch)]
    with patched(*_steps_left_out(), (BatchedSPD, "launch_cycle", _counting(per_cycle))):
        engine.generate(prompts, tokens, _sampling(kind, batch), max_batch=batch)
    return steady(per_cycle)


def count_stage_runs() -> None:
    """On a stage rank: count each generation's steady cycle's ops into the store (JSON under
    probe/launches/<generation>/<rank>, for rank 0's job to collect)."""
    from spd.distributed import stage_rank
    worker, cycles = stage_rank.StageWorker, stage_rank.StageCycles
    run = worker.run

    def counted_run(self, gen, req):
        per_cycle: list = []
        with patched(*_steps_left_out(), (cycles, "launch", _counting(per_cycle))):
            run(self, gen, req)
        self.rt.store.set(f"probe/launches/{gen}/{self.rt.rank}", json.dumps(steady(per_cycle)))
    worker.run = counted_run


def _stage_factory(rank: int):
    """Every rank's tiny target; a stage rank counts its cycles (count_stage_runs)."""
    if rank != 0:
        count_stage_runs()
    return _target()


def _stage_job(engine, request):
    from spd.distributed.rank import run_requests
    run_requests([request], engine)
    return [json.loads(engine.rt.store.get(f"probe/launches/1/{r}"))
            for r in range(1, engine.n + 1)]


def count_stage_ranks(kind: str, n: int = 3, width: int = 1, tokens: int = 20,
                      factory=_stage_factory) -> list:
    """A steady cycle's ops on each stage rank (n + 1 processes on this machine, gloo);
    factory(rank): each rank's target, a stage rank's counting (_stage_factory: a picklable
    function of an importable module)."""
    from functools import partial

    from spd.distributed.config import DistConfig, GenerateRequest
    from spd.distributed.launch import launch_local
    request = GenerateRequest(PROMPT, tokens, _sampling(kind))
    config = DistConfig(n_stages=n, target_factory=factory, lookup=0, tree_width=width,
                        fault_timeout=5.0, op_timeout=60.0, threads=1)
    return launch_local(config, partial(_stage_job, request=request), timeout=300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    target = _target()
    rows = []
    for width in (1, 3):
        for kind in ("greedy", "sampled"):
            for lookup in (0, 2):
                ops = count_one(kind, args.n, width, lookup, target=target)
                rows.append(dict(where="rank 0", batch=1, width=width, kind=kind,
                                 lookup=lookup, launches=len(ops), ops=Counter(ops)))
        for kind in ("greedy", "sampled", "mixed"):
            ops = count_batch(kind, args.batch, args.n, width, target=target)
            rows.append(dict(where="rank 0", batch=args.batch, width=width, kind=kind, lookup=0,
                             launches=len(ops), ops=Counter(ops)))
    for width in (1, 2):
        for kind in ("greedy", "sampled"):
            for s, ops in enumerate(count_stage_ranks(kind, 3, width)):
                rows.append(dict(where=f"stage {s} of 3", batch=1, width=width, kind=kind,
                                 lookup=0, launches=len(ops), ops=Counter(ops)))
    print(f"{'where':<12} {'batch':>5} {'W':>2} {'sampling':<8} {'lookup':>6} {'launches':>8}")
    for r in rows:
        print(f"{r['where']:<12} {r['batch']:>5} {r['width']:>2} {r['kind']:<8} "
              f"{r['lookup']:>6} {r['launches']:>8}")
    if args.json_out:
        args.json_out.write_text(json.dumps(dict(device="cpu", n=args.n, rows=rows), indent=1))


if __name__ == "__main__":
    main()
