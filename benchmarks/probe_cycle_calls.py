"""How deep one steady-state decode cycle goes: call levels and source files (CPU).

A reader follows a cycle from the code that launches it down to the ops. This probe profiles a
single-process SPD decode of a tiny random target with an untrained PDM (sys.setprofile) and,
for the deepest cycle after the fill (greedy: every draft accepted; sampled: the target's
greedy tokens drafted, so rejections and refills occur):

  levels  the deepest chain of project calls below `SPDEngine.generate`, the entry every
          version has (functions in python/spd and spd_kernels; frames of torch and the
          standard library are passed through, not counted);
  to ops  the same down to an op's entry (an `@op` public function of spd_kernels, where the
          kernel library's own dispatch begins): the runtime's layering alone;
  files   the project source files that cycle enters (its caller's and the entry's
          included).

A cycle begins at a call of `spd.runtime.cycle.Cycle.cycle` (the one decode cycle); on an older
checkout without it, at a call of its host loop's `SequenceDecode.draft` (spd/runtime/
sequence.py), so the probe runs against either:

    python benchmarks/probe_cycle_calls.py                      # this checkout
    python benchmarks/probe_cycle_calls.py --before /path/old   # and another one, same table

Prints the table and writes JSON (--json-out). Device: CPU (reference kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _project_file(path: str) -> str | None:
    """The file relative to its package root when it is project code, else None."""
    for root in (f"{os.sep}spd{os.sep}", f"{os.sep}spd_kernels{os.sep}"):
        i = path.rfind(root)
        if i >= 0 and f"{os.sep}site-packages{os.sep}" not in path[:i]:
            return path[i + 1:]
    return None


def cycle_boundary() -> tuple[str, str]:
    """(file, function) whose call begins a cycle in the measured checkout: Cycle.cycle, or an
    older checkout's SequenceDecode.draft."""
    import importlib.util
    if importlib.util.find_spec("spd.runtime.cycle") is not None:
        return os.path.join("spd", "runtime", "cycle.py"), "cycle"
    return os.path.join("spd", "runtime", "sequence.py"), "draft"


def measure(n: int, tokens: int, greedy: bool) -> dict:
    import torch

    import spd
    # the measured checkout's test helpers (its drafters' API)
    sys.path.insert(0, str(Path(spd.__file__).resolve().parents[2] / "tests"))
    from conftest import NoisyPDMDrafter, make_tiny_target

    from spd import SamplingParams, SPDEngine

    torch.set_num_threads(1)
    target = make_tiny_target(seed=3, vocab=32, layers=4)
    engine = SPDEngine(target, n_stages=n, warn_untrained=False)
    ar = engine.generate_ar(PROMPT, tokens).token_ids
    sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0, seed=1)
    # the real PDM step runs every cycle; the proposal is the target's greedy token
    drafter = NoisyPDMDrafter(engine.pdm, PROMPT + ar, 1.0, seed=0)
    engine.generate(PROMPT, 4, sampling, drafter=drafter)  # warm-up: first-call set-up

    cycles: list[dict] = []
    stack: list[tuple | None] = []  # per live frame: (file, function) of project code, or None
    entry = os.path.join("spd", "runtime", "engine.py")
    state = {"base": None, "cur": None}
    boundary = cycle_boundary()

    def prof(frame, event, arg):
        if event == "call":
            f = _project_file(frame.f_code.co_filename)
            if (f, frame.f_code.co_name) == boundary:
                # a new cycle: levels count from the engine's generate frame
                ours = [x for x in stack if x is not None]
                state["base"] = max(i for i, x in enumerate(ours)
                                    if x == (entry, "generate")) + 1
                state["cur"] = {"levels": 0, "to_ops": 0, "files": {entry}}
                caller = _project_file(frame.f_back.f_code.co_filename)
                state["cur"]["files"].add(caller)
                state["cur"]["caller"] = f"{caller}:{frame.f_back.f_code.co_name}"
                for a, _ in ours[state["base"]:]:  # frames between the entry and the cycle
                    state["cur"]["files"].add(a)
                cycles.append(state["cur"])
            stack.append(None if f is None else (f, frame.f_code.co_name))
            if f is not None and state["cur"] is not None:
                ours = [x for x in stack if x is not None]
                cur = state["cur"]
                if len(ours) - state["base"] > cur["levels"]:
                    cur["levels"] = len(ours) - state["base"]
                    cur["chain"] = [f"{a}:{b}" for a, b in ours[state["base"]:]]
                if f == os.path.join("spd_kernels", "opdef.py") and frame.f_code.co_name == "public":
                    cur["to_ops"] = max(cur["to_ops"], len(ours) - state["base"])
                cur["files"].add(f)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(prof)
    try:
        res = engine.generate(PROMPT, tokens, sampling, drafter=drafter)
    finally:
        sys.setprofile(None)
    if greedy:
        assert res.stats.K == res.stats.N + n - 1, "every draft accepted"
    # full-window cycles, not the first after the fill nor the end (sampled: rejections too)
    steady = cycles[n + 1:-2]
    worst = max(steady, key=lambda c: (c["levels"], len(c["files"])))
    return {"what": f"one process, n = {n}, {'greedy' if greedy else 'sampled'}",
            "caller": worst["caller"], "levels": worst["levels"],
            "to_ops": max(c["to_ops"] for c in steady), "files": len(worst["files"]),
            "file_list": sorted(worst["files"]), "deepest": worst.get("chain", [])}


def run_checkout(checkout: Path, n: int, tokens: int) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{checkout / 'python'}:{checkout}")
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "--stages",
                          str(n), "--tokens", str(tokens)], env=env, capture_output=True,
                         text=True, timeout=1800, cwd=checkout)
    if out.returncode != 0:
        raise SystemExit(f"probe failed on {checkout}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--before", type=Path, default=None, help="another checkout to compare")
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps([measure(args.stages, args.tokens, greedy)
                          for greedy in (True, False)]))
        return
    sys.path.insert(0, str(REPO / "benchmarks"))
    from harness import Table, run_meta, write_json
    results = {"after": run_checkout(REPO, args.stages, args.tokens)}
    if args.before is not None:
        results["before"] = run_checkout(args.before.resolve(), args.stages, args.tokens)
    table = Table([("what", "<30", "cycle (CPU)"), ("checkout", "<9"), ("caller", "<40", "cycle called from"),
                   ("levels", ">7"), ("to_ops", ">7", "to ops"), ("files", ">6")])
    table.print_header()
    for i, row in enumerate(results["after"]):
        for label in ("before", "after"):
            if label in results:
                r = results[label][i]
                table.print({"what": r["what"], "checkout": label, "caller": r["caller"],
                             "levels": r["levels"], "to_ops": r.get("to_ops"),
                             "files": r["files"]})
    if args.json_out:
        write_json(args.json_out, run_meta(), stages=args.stages, tokens=args.tokens,
                   before_checkout=str(args.before) if args.before else None, **results)


if __name__ == "__main__":
    main()
