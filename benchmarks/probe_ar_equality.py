"""Greedy SPD against `--mode ar` on the default model, token for token: one process (the host
loop and the device loop) and distributed (the unit protocol and the device loop across ranks),
chain and tree, several n and W, the shipped PDMs with the context lookup on. CPU, about 5 min
on 2 cores; exits 1 on a mismatch.

    python benchmarks/probe_ar_equality.py
"""
import sys
import time
from functools import partial

from spd import SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.model.loading import load_target
from spd.model.prompt import encode_prompt

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain how a CPU cache works."]
NEW = 48


def main() -> int:
    t = load_target()
    ids = [encode_prompt(t.tokenizer, p, True) for p in PROMPTS]
    ar = [SPDEngine(t, n_stages=1).generate_ar(i, NEW).token_ids for i in ids]
    ok = True

    def report(what, got):
        nonlocal ok
        good = [g.token_ids == a for g, a in zip(got, ar)]
        ok = ok and all(good)
        nk = [(g.stats.N, g.stats.K, getattr(g.stats, "loop", "")) for g in got]
        print(f"{what:52s} equal={good} N/K/loop={nk}", flush=True)

    for n in (2, 3, 4, 6, 8):
        e = SPDEngine(t, n_stages=n)
        report(f"one process chain host loop n={n}", [e.generate(i, NEW) for i in ids])
    for n in (2, 4, 8):
        e = SPDEngine(t, n_stages=n, device_loop=True)
        report(f"one process chain device loop n={n}", [e.generate(i, NEW) for i in ids])
    for n, w in ((2, 4), (4, 2), (4, 3), (6, 2)):
        e = SPDEngine(t, n_stages=n, tree_width=w)
        report(f"one process tree n={n} W={w}", [e.generate(i, NEW) for i in ids])
    for n, w, dl in ((2, 1, False), (4, 1, False), (2, 1, True), (4, 1, True), (3, 1, True),
                     (2, 4, False), (4, 3, False)):
        cfg = DistConfig(n_stages=n, tree_width=w, device_loop=dl, fault_timeout=30.0,
                         op_timeout=300.0)
        t0 = time.time()
        reqs = [GenerateRequest(list(i), NEW) for i in ids]
        got = launch_local(cfg, partial(run_requests, reqs), timeout=1200)
        report(f"distributed n={n} W={w} device_loop={dl} ({time.time() - t0:.0f} s)", got)
    print("ALL EQUAL" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
