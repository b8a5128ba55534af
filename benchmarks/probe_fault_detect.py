"""Fault-detection probe: how long a self-launched run takes to end after a fault from outside.

Starts `python -m spd generate --distributed --stages N` on the tiny random Llama, waits for
streaming to begin (the ranks are decoding), then applies one fault and times how long until
every rank process has gone (and the launcher, when it is not the frozen one):

  freeze-rank       SIGSTOP on the last stage rank          (the run must end within --timeout)
  freeze-launcher   SIGSTOP on the launcher itself          (the ranks must notice and leave)
  sigterm-launcher  SIGTERM to the launcher                 (forwarded to the ranks, one line each)
  sigkill-launcher  SIGKILL of the launcher                 (the ranks die with it)

    python benchmarks/probe_fault_detect.py freeze-rank freeze-launcher --timeout 5 --give-up 30

Prints a table (seconds from the fault until the last rank is gone, the rank exit reasons seen
in stderr, the number of stderr lines) and writes JSON (--json-out). A run still alive after
--give-up seconds is reported as such and killed.
"""
from __future__ import annotations

import argparse
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import RESULTS, Table, run_meta, write_json

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("freeze-rank", "freeze-launcher", "sigterm-launcher", "sigkill-launcher")


def tiny_model_dir() -> str:
    from spd.model.loading import cache_dir, save_tiny_random_llama

    folder = cache_dir() / "models" / "tiny-random-llama"
    if not (folder / "config.json").exists():
        save_tiny_random_llama(folder)
    return str(folder)


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rank_pids(launcher: int) -> list[int]:
    """The rank processes: children of the launcher's fork server, in start order."""
    procs = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        st = _stat(int(entry))
        if st is not None and st[0] != "Z":
            procs[int(entry)] = int(st[1])
    servers = [p for p, ppid in procs.items() if ppid == launcher and "forkserver" in _cmdline(p)]
    return sorted(p for p, ppid in procs.items() if ppid in servers)


def probe(fault: str, model: str, stages: int, timeout: float, give_up: float) -> dict:
    cmd = [sys.executable, "-m", "spd", "generate", "--distributed", "--stages", str(stages),
           "--model", model, "--prompt", "Tell me a long story.", "--max-new-tokens", "100000",
           "--no-chat", "--fault-timeout", f"{timeout:g}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            start_new_session=True)
    row = {"fault": fault, "timeout_s": timeout}
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 180)
        if not ready or not proc.stdout.read(1):
            raise RuntimeError("no output within 180 s: " + proc.stderr.read().decode()[-2000:])
        ranks = rank_pids(proc.pid)
        if len(ranks) != stages + 1:
            raise RuntimeError(f"found {len(ranks)} rank processes, expected {stages + 1}")
        t0 = time.monotonic()
        if fault == "freeze-rank":
            os.kill(ranks[-1], signal.SIGSTOP)
        elif fault == "freeze-launcher":
            os.kill(proc.pid, signal.SIGSTOP)
        elif fault == "sigterm-launcher":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        gone = None
        while time.monotonic() - t0 < give_up:
            if not any(_alive(p) for p in ranks):
                gone = time.monotonic() - t0
                break
            time.sleep(0.05)
        row["ranks_gone_s"] = gone
        if fault != "freeze-launcher" and gone is not None:
            try:  # the launcher itself must leave too
                proc.wait(max(0.1, give_up - (time.monotonic() - t0)))
                row["launcher_gone_s"] = time.monotonic() - t0
                row["launcher_status"] = proc.returncode
            except subprocess.TimeoutExpired:
                pass
    finally:
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        proc.wait(10)
    err = proc.stderr.read().decode(errors="replace")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    row["stderr_lines"] = len(lines)
    row["messages"] = [ln for ln in lines if ln.startswith("spd:")][:8]
    row["cpp_frames"] = sum("frame #" in ln for ln in lines)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("faults", nargs="+", choices=FAULTS)
    ap.add_argument("--model", default=None, help="local HF folder (default: the tiny Llama)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0, help="--fault-timeout of the run")
    ap.add_argument("--give-up", type=float, default=30.0,
                    help="seconds after the fault after which a run still alive is killed")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    model = args.model or tiny_model_dir()
    table = Table([("fault", "<18"), ("timeout_s", ">9.1f", "timeout"),
                   ("ranks_gone_s", ">12.1f", "ranks gone"), ("launcher_gone_s", ">14.1f",
                                                              "launcher gone"),
                   ("launcher_status", ">8d", "status"), ("stderr_lines", ">7d", "lines"),
                   ("cpp_frames", ">7d", "frames")])
    table.print_header()
    rows = []
    for fault in args.faults:
        row = probe(fault, model, args.stages, args.timeout, args.give_up)
        rows.append(row)
        table.print(row)
    for row in rows:
        for msg in row["messages"]:
            print(f"  {row['fault']}: {msg[:160]}")
    out = args.json_out or RESULTS / f"{time.strftime('%Y-%m-%d')}-fault-detect-cpu.json"
    write_json(out, run_meta("cpu", model=model, stages=args.stages, give_up_s=args.give_up),
               rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
