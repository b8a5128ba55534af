"""Tensor-to-host reads per decode cycle (CPU): how often the host waits on a tensor's value.

A read is anything that brings a tensor's value into Python (item, int / bool / float of a
tensor, tolist, numpy) or makes the host wait on the data to size a result (nonzero and the
like): on a GPU each one stalls the host until the device has caught up. `ReadLog` logs them
with a TorchFunctionMode (methods) and a TorchDispatchMode (ops); the tests of host reads use it
too. Reads of host memory that wait on no device are logged apart, as ("host",): each cycle's
published state and, on a CPU, the cycle's look at its units (spd.runtime.driver.is_host_copy).
With copies=True it also logs the other direction: a tensor made from, or written with, Python
values (torch.tensor of a list, x[i] = 5: on a GPU a copy from pageable host memory, which holds
the host).

Reads per steady cycle are taken as a difference of two decodes of different lengths in one
process (m and 2m new tokens: (reads(2m) - reads(m)) / (K(2m) - K(m))), so the prefill and the
end cancel out and the probe needs no hook inside the code it measures: it runs on any checkout.
Both decodes must run to their length: the default model's EOS is cleared for the probe (its
decodes go on past an end of text; what a cycle reads does not depend on the token), and a row
whose 2m decode ran no more cycles than its m decode reports n/a rather than a ratio.

  * distributed (spd.runtime.cycle on rank 0, spd.distributed.stage_rank on the stage ranks),
    compute emulated (stage steps and drafts are fixed waits: the runtime's own reads, not the
    CPU reference kernels'), gloo, every draft right: rank 0 per cycle, each stage rank per
    cycle;
  * single process (SPDEngine.generate), the default model with its shipped PDM, n = 4, a chain
    and a token tree of width 4: reads of the CPU reference kernels included, and the reads
    made outside spd_kernels (its CPU-only value checks and reference paths aside: what a GPU
    run would pay);
  * the chains again under seeded sampling (temperature 1): drafts are then judged by rejection
    sampling on rank 0, and rejections roll every cache back.

Each row also gives rank 0's copies of Python values to the device per cycle, outside
spd_kernels (ReadLog(copies=True)).

    python benchmarks/probe_host_reads.py                      # this checkout
    python benchmarks/probe_host_reads.py --before /path/old   # and another checkout, same table

Prints the table and writes JSON (--json-out).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 3, 99, 42, 7, 11, 200]
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."
READ_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__"}
READ_OPS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique",
            "_unique2", "repeat_interleave"}
# Tensors made from a Python value (torch.tensor / as_tensor of a number, list or array: on a
# GPU built in pageable host memory and copied over, a copy that holds the host; full /
# full_like of a Python fill value: a new tensor each call from a value the host holds) or
# written with one (x[i] = 5, x[:2] = [1, 2]: torch makes a host tensor of the value and copies
# it in; a slice written with one number is a fill, counted too: fill_ says so). An in-place
# fill_ of a buffer made once (a cache's length, a graph's position) is not one: the value rides
# in the fill kernel's arguments, and no tensor is made.
COPY_FUNCS = {"tensor": 0, "as_tensor": 0, "full": 1, "full_like": 1, "__setitem__": 2}


# --- the read log ------------------------------------------------------------------------------
_HOST_CHECKS: list | None = None


def _host_kind(x) -> str | None:
    """"host" for host memory that reading waits on no device for (spd.runtime.driver's
    is_host_copy; an older checkout's spd.runtime.host_mirror), "header" for an older
    checkout's unit header (spd.distributed.protocol.is_header); None otherwise."""
    global _HOST_CHECKS
    if _HOST_CHECKS is None:  # those the measured checkout has, looked up once
        _HOST_CHECKS = []
        for kind, module, name in (("host", "spd.runtime.driver", "is_host_copy"),
                                   ("host", "spd.runtime.host_mirror", "is_host_copy"),
                                   ("header", "spd.distributed.protocol", "is_header")):
            try:
                _HOST_CHECKS.append((kind, getattr(importlib.import_module(module), name)))
            except (ImportError, AttributeError):
                continue
    return next((kind for kind, check in _HOST_CHECKS if check(x)), None)


def _caller() -> str:
    """'file:line function' of the innermost frame outside torch and this module: who read."""
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename == __file__
                             or f"{os.sep}torch{os.sep}" in f.f_code.co_filename):
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" if f is not None else "?"


def _python_value(func: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call of COPY_FUNCS' `func` takes its data from Python rather than a tensor (and,
    for __setitem__, writes it into a tensor that is not host memory by design: _host_kind)."""
    at = COPY_FUNCS[func]
    value = args[at] if len(args) > at else kwargs.get("data" if at == 0 else "fill_value")
    if isinstance(value, torch.Tensor):
        return False
    return not (func == "__setitem__" and _host_kind(args[0]) is not None)


class _Methods(TorchFunctionMode):
    def __init__(self, log: list, where: bool, copies: bool = False):
        super().__init__()
        self.log, self.where, self.copies, self.depth = log, where, copies, 0

    def record(self, name: str, kind: str = "read") -> None:
        self.log.append((kind, name, _caller()) if self.where else (kind, name))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if (self.copies and name in COPY_FUNCS
                and _python_value(name, args, kwargs or {})):
            self.record(name, "copy")
        if name not in READ_METHODS:
            return func(*args, **(kwargs or {}))
        kind = _host_kind(args[0]) if args else None
        if kind is not None:  # host memory on every device: logged apart, not as a read
            self.log.append((kind,))
        else:
            self.record(name)
        self.depth += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.depth -= 1


class _Ops(TorchDispatchMode):
    def __init__(self, methods: _Methods):
        super().__init__()
        self.methods = methods

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in READ_OPS and self.methods.depth == 0:  # not already counted as a method
            self.methods.record(name)
        return func(*args, **(kwargs or {}))


class ReadLog:
    """Appends ("read", what) to `log` for every tensor-to-host read in this thread (("host",)
    for a read of host memory that waits on no device: _host_kind); `where`: ("read", what,
    "file:line function" of the code that read). `copies`: also ("copy", what[, where]) for every
    tensor made from or written with Python values (COPY_FUNCS; on a CPU every tensor counts,
    as each one would be on the device, but a write into host memory of _host_kind's)."""

    def __init__(self, log: list, where: bool = False, copies: bool = False):
        self.methods = _Methods(log, where, copies)
        self.ops = _Ops(self.methods)

    def __enter__(self):
        self.methods.__enter__()
        self.ops.__enter__()
        return self

    def __exit__(self, *exc):
        self.ops.__exit__(*exc)
        self.methods.__exit__(*exc)


class CallLog:
    """Appends (name,) to `log` on every call of each given method (`(cls, name)` pairs) while
    active, so that reads can be placed between the calls: a cycle (spd.runtime.cycle.Cycle
    .cycle), a draft, the end of a decode."""

    def __init__(self, log: list, *methods: tuple[type, str]):
        self.log, self.methods, self.saved = log, methods, []

    def _logged(self, name: str, real):
        log = self.log

        def method(obj, *args):
            log.append((name,))
            return real(obj, *args)
        return method

    def __enter__(self):
        for cls, name in self.methods:
            self.saved.append((cls, name, cls.__dict__.get(name)))  # None: inherited
            setattr(cls, name, self._logged(name, getattr(cls, name)))
        return self

    def __exit__(self, *exc):
        for cls, name, own in reversed(self.saved):
            if own is None:
                delattr(cls, name)
            else:
                setattr(cls, name, own)
        self.saved.clear()


def reads(log: list, outside_kernels: bool = False, kind: str = "read") -> int:
    """The reads in `log` (kind="copy": the copies of Python values); `outside_kernels`: only
    those not made inside spd_kernels (its CPU value checks and reference paths, which a GPU run
    does not take). Needs ReadLog(where=True)."""
    return sum(1 for e in log if e[0] == kind
               and not (outside_kernels and f"{os.sep}spd_kernels{os.sep}" in e[2]))


# --- distributed, emulated compute ---------------------------------------------------------------
def log_stage_runs(tag: str, **log_options) -> None:
    """On a stage rank: log each generation's cycles (ReadLog(**log_options), plus a ("unit",)
    entry as each cycle begins to run its unit: a call of StageCycles.cycle, which a replayed
    CUDA graph does not make) and put the log into the store as JSON under
    test/<tag>/<generation>/<rank>, for rank 0's job to collect (the tests' counting
    factories)."""
    import json

    from spd.distributed import stage_rank
    worker, cycles = stage_rank.StageWorker, stage_rank.StageCycles
    run, cycle = worker.run, cycles.cycle

    def counted_cycle(self, *args, **kwargs):
        self.w._test_log.append(("unit",))
        return cycle(self, *args, **kwargs)

    def counted_run(self, gen, req):
        self._test_log = log = []
        with ReadLog(log, **log_options):
            run(self, gen, req)
        self.rt.store.set(f"test/{tag}/{gen}/{self.rt.rank}", json.dumps(log))
    worker.run, cycles.cycle = counted_run, counted_cycle


def _counting_factory(rank: int):
    """Every rank's tiny target; a stage rank logs the reads of each generation into the store."""
    from spd.distributed.emulate import tiny_target
    if rank != 0:
        from spd.distributed import stage_rank
        run = stage_rank.StageWorker.run

        def counted_run(self, gen, req):
            log: list = []
            with ReadLog(log):
                run(self, gen, req)
            self.rt.store.set(f"probe/reads/{gen}/{self.rt.rank}", str(reads(log)))
        stage_rank.StageWorker.run = counted_run
    return tiny_target(4, 6)


def _counts(log: list, K: int) -> dict:
    """A decode's counts: rank 0's reads, those outside spd_kernels, its copies; K cycles."""
    return {"K": K, "rank0": reads(log), "outside": reads(log, outside_kernels=True),
            "copies": reads(log, outside_kernels=True, kind="copy")}


def per_cycle(what: str, a: dict, b: dict) -> dict:
    """The row of the m decode's counts `a` and the 2m decode's `b`: (b - a) per cycle more that
    b ran; n/a (None) when it ran none more."""
    dk = b["K"] - a["K"]
    rate = (lambda x, y: (y - x) / dk) if dk > 0 else (lambda x, y: None)
    row = {"what": what, "cycles": dk, "rank 0": rate(a["rank0"], b["rank0"]),
           "outside spd_kernels": rate(a["outside"], b["outside"]),
           "copies": rate(a["copies"], b["copies"]),
           "stage ranks": [rate(x, y) for x, y in zip(a.get("stages", []), b.get("stages", []))]}
    if dk <= 0:
        row["note"] = "n/a: the 2m decode ran no more cycles than the m decode"
    return row


def _distributed_job(engine, lengths, refs, sampling):
    from spd.distributed.config import GenerateRequest
    from spd.distributed.rank import run_requests
    out = []
    for gen, m in enumerate(lengths, start=1):
        log: list = []
        with ReadLog(log, where=True, copies=True):
            res = run_requests([GenerateRequest(PROMPT, m, sampling, reference=refs)],
                               engine)[0]
        out.append(dict(_counts(log, res.stats.K),
                        stages=[int(engine.rt.store.get(f"probe/reads/{gen}/{r}"))
                                for r in range(1, engine.n + 1)]))
    return out


def _sampling(sampled: bool):
    from spd.runtime.types import SamplingParams
    return SamplingParams(temperature=1.0, seed=1) if sampled else SamplingParams()


def distributed_row(n: int, m: int, sampled: bool = False) -> dict:
    """Greedy: every draft right. Sampled: the same drafts (the emulated target's greedy
    continuation) judged by rejection sampling, so some are rejected and roll back. The
    emulated target has no EOS: both decodes run to their length."""
    from spd.distributed.config import DistConfig
    from spd.distributed.emulate import reference_tokens, tiny_target
    from spd.distributed.launch import launch_local
    ref = reference_tokens(tiny_target(4, 6), PROMPT, 4 * m + n + 2)
    config = DistConfig(n_stages=n, target_factory=_counting_factory, fault_timeout=10.0,
                        op_timeout=120.0, lookup=0, emulate_s=0.002)
    a, b = launch_local(config, partial(_distributed_job, lengths=(m, 2 * m), refs=ref,
                                        sampling=_sampling(sampled)), timeout=600)
    return per_cycle(f"distributed, n = {n}{', sampled' if sampled else ''}", a, b)


# --- single process, default model ---------------------------------------------------------------
def single_row(n: int, m: int, sampled: bool = False, width: int = 1) -> dict:
    """The default model with its EOS cleared (module docstring), n stages, tree width `width`."""
    from spd.model.loading import load_target
    from spd.model.prompt import encode_prompt
    from spd.runtime.engine import SPDEngine
    target = load_target(None)
    target.eos_token_ids = set()
    engine = SPDEngine(target, n_stages=n, tree_width=width)
    ids = torch.tensor(encode_prompt(target.tokenizer, DEFAULT_PROMPT, chat=True))
    sampling = _sampling(sampled)
    engine.generate(ids, 4, sampling)  # warm-up: first-call work is not a cycle's
    runs = []
    for length in (m, 2 * m):
        log: list = []
        with ReadLog(log, where=True, copies=True):
            res = engine.generate(ids, length, sampling)
        runs.append(_counts(log, res.stats.K))
    tree = f", W = {width}" if width > 1 else ""
    return per_cycle(f"one process, default model, n = {n}{tree}{', sampled' if sampled else ''}",
                     *runs)


def measure(m: int) -> list[dict]:
    torch.set_num_threads(1)
    return [distributed_row(2, m), distributed_row(4, m), single_row(4, m),
            single_row(4, m, width=4), distributed_row(2, m, sampled=True),
            distributed_row(4, m, sampled=True), single_row(4, m, sampled=True)]


# --- driver -------------------------------------------------------------------------------------------
def run_checkout(checkout: Path, m: int) -> list[dict]:
    """This script's measurement with `checkout`'s spd (a child process)."""
    env = dict(os.environ, PYTHONPATH=f"{checkout / 'python'}:{checkout}",
               TORCH_CPP_LOG_LEVEL="ERROR")
    out = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(m)], env=env,
                         capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"probe failed on {checkout}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=24, help="m: decodes of m and 2m new tokens")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to compare")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.tokens)))
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import Table, run_meta, write_json
    results = {"after": run_checkout(REPO, args.tokens)}
    if args.before is not None:
        results["before"] = run_checkout(args.before.resolve(), args.tokens)
    table = Table([("what", "<47", "decode"), ("checkout", "<9"), ("cycles", ">7"),
                   ("rank0", ">10.2f", "rank 0"), ("outside", ">22.2f", "outside spd_kernels"),
                   ("copies", ">8.2f"),
                   ("stages", ">24", "each stage rank")])
    table.print_header()
    for i, row in enumerate(results["after"]):
        for label in ("before", "after"):
            if label in results:
                r = results[label][i]
                what = r["what"] + (" (n/a)" if r.get("note") else "")
                table.print({"what": what, "checkout": label, "cycles": r["cycles"],
                             "rank0": r["rank 0"], "outside": r.get("outside spd_kernels"),
                             "copies": r.get("copies"),
                             "stages": " ".join("n/a" if x is None else f"{x:.2f}"
                                                for x in r["stage ranks"]) or None})
    if args.json_out:
        write_json(args.json_out, run_meta(), tokens=args.tokens,
                   before_checkout=str(args.before) if args.before else None, **results)


if __name__ == "__main__":
    main()
