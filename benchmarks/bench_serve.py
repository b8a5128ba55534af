"""`spd serve` against a fresh `spd generate` launch, and the server's own cost per token.

Three measurements, all greedy on the same prompt and token budget, --threads 1:

  fresh launch   `python -m spd generate` as a new process (what every prompt costs without a
                 server): time to first token from the launch (imports, model load, engine,
                 prefill), decode tok/s from its summary line, and the whole run's wall time.
  server         `python -m spd serve` as a new process; the second streamed request is timed
                 from the client (openai): time to first token from the request, decode tok/s
                 between the first and the last token, and the server's own figure (usage.spd).
  overhead       in one process: the same engine decoding alone, then behind the HTTP server
                 (streaming and not; the client in this process's main thread), interleaved
                 over --reps. ovh ms/tok = (fastest server wall - fastest engine wall) / new
                 tokens; out ms/tok = the client's wall time beyond the engine's own prefill +
                 decode clock (HTTP, JSON, queue, prompt encoding) / new tokens, median.

With --distributed the first two run again with `--distributed --stages N` (local ranks, gloo).

    python benchmarks/bench_serve.py --json-out benchmarks/results/2026-12-03-serve-cpu.json

With --clients (instead of the three above): C concurrent clients (openai, streamed chat
completions, one thread each, all sent at t = 0; held-out prompts, greedy) against one
`spd serve --max-batch B` process per path, for each C of --clients:

  spd        --mode spd: SPD, each request with its own speculation in the pipeline
  ar         --mode ar: autoregressive, continuous batching
  pipeline   --mode pipeline: the pipeline without speculation on the same n stages, one token
             per request per trip through them
  spd-ranks, pipeline-ranks
             the same two with --distributed (gloo): n stage ranks and rank 0, each a process
             (on a machine of fewer cores than n + 1 processes they share them)

Per C and path: total tokens/s (all completion tokens over the wall time to the last one),
per-request tokens/s (median of each request's tokens over its time from t = 0 to its last
token), time to first token (p50 and max, from t = 0: waiting included) and time between tokens
(p50 and p99 over all requests' gaps between streamed text chunks: one a token, except where the
server holds text back, e.g. a partial character). Every answer is compared with its serial
one (each prompt alone, one at a time, on the first path's server; --no-check skips it): a
mismatch is counted in the row and named, not fatal (on a CPU, batched rows round differently).
The server's stages run one after another in its one process (docs/batching.md).

    python benchmarks/bench_serve.py --clients 1,2,4,8,16 --paths spd,ar,pipeline \
        --max-batch 16 --max-new-tokens 64 --json-out benchmarks/results/<date>-serve-clients-cpu.json

CPU figures: the machine may be shared (the load average is in the JSON's meta).
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from harness import Table, percentile, run_meta, write_json

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Explain in detail how a CPU cache works."
SUMMARY = re.compile(r"decode=([0-9.]+) tok/s")


def _env(threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), str(REPO)]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_launch(args, distributed: bool) -> dict:
    """One `spd generate` process: first streamed byte of text, summary, exit."""
    cmd = [sys.executable, "-m", "spd", "generate", "--prompt", PROMPT, "--max-new-tokens",
           str(args.max_new_tokens), "--threads", str(args.threads), "--stages",
           str(args.stages)]
    if distributed:
        cmd += ["--distributed", "--backend", "gloo"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=_env(args.threads), cwd=REPO)
    first = None
    out = b""
    while chunk := proc.stdout.read1(4096):
        if first is None:
            first = time.perf_counter() - t0
        out += chunk
    proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with {proc.returncode}")
    m = SUMMARY.search(out.decode(errors="replace"))
    return {"setup": "fresh launch", "ttft_s": first, "decode_tok_s": float(m.group(1)) if m
            else None, "wall_s": wall}


def _stream_once(client, model: str, max_tokens: int) -> dict:
    """One streamed chat request: client-side TTFT and decode rate, and the server's figures."""
    t0 = time.perf_counter()
    stamps, usage = [], None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=max_tokens,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    wall = time.perf_counter() - t0
    n = usage.completion_tokens
    decode = (n - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else None
    return {"ttft_s": stamps[0] - t0, "decode_tok_s": decode, "wall_s": wall,
            "server_decode_tok_s": usage.model_extra["spd"]["decode_tok_s"], "new_tokens": n}


@contextmanager
def spd_server(args, extra: list[str]):
    """A `spd serve` process (--threads, --stages and `extra`) on a free port, up and answering
    -> (openai client, model id, start-up seconds); stopped (SIGINT, then SIGKILL) on exit."""
    import openai
    port = _free_port()
    cmd = [sys.executable, "-m", "spd", "serve", "--port", str(port), "--threads",
           str(args.threads), "--stages", str(args.stages), "--log-level", "warning", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(args.threads), cwd=REPO, start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=600)
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(0.2)
        yield client, model, time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served(args, distributed: bool) -> dict:
    """A `spd serve` process: its start-up, then the second of two requests."""
    with spd_server(args, ["--distributed", "--backend", "gloo"] if distributed else []) as (
            client, model, startup):
        _stream_once(client, model, args.max_new_tokens)  # the first request
        row = _stream_once(client, model, args.max_new_tokens)
    return {"setup": "server, 2nd request", "startup_s": startup, **row}


# --- C concurrent clients against one server per path -------------------------------------------
CLIENT_PATHS = ("spd", "ar", "pipeline", "spd-ranks", "pipeline-ranks")


def path_flags(path: str) -> list[str]:
    """A path's `spd serve` flags: its --mode, across ranks for a "-ranks" path."""
    mode, _, ranks = path.partition("-")
    return ["--mode", mode] + (["--distributed", "--backend", "gloo"] if ranks else [])


def _health(client) -> dict:
    """The server's /health (its backend described there)."""
    import json
    import urllib.request
    url = str(client.base_url).rstrip("/").removesuffix("/v1") + "/health"
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _client(client, model: str, messages: list, max_tokens: int, t0: float) -> dict:
    """One streamed greedy chat request: its text, completion tokens and the time (s from t0)
    of each streamed text chunk."""
    times, text, usage = [], "", None
    for chunk in client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter() - t0)
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return {"text": text, "tokens": usage.completion_tokens, "times": times}


def clients_at_once(client, model: str, chats: list, max_tokens: int,
                    serial: list[str] | None) -> dict:
    """Every chat from its own thread at t = 0 -> the row's figures (and its mismatches with
    `serial`, each chat's answer alone)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(chats)) as pool:
        got = list(pool.map(lambda m: _client(client, model, m, max_tokens, t0), chats))
    wall = max(g["times"][-1] for g in got if g["times"])
    tokens = sum(g["tokens"] for g in got)
    gaps = [b - a for g in got for a, b in zip(g["times"], g["times"][1:])]
    firsts = [g["times"][0] for g in got if g["times"]]
    wrong = None if serial is None else [i for i, g in enumerate(got) if g["text"] != serial[i]]
    return dict(total_tok_s=tokens / wall, wall_s=wall, tokens=tokens,
                per_request_tok_s=statistics.median(g["tokens"] / g["times"][-1]
                                                    for g in got if g["times"]),
                ttft_p50_s=percentile(firsts, 0.5), ttft_max_s=max(firsts),
                tbt_p50_ms=1e3 * percentile(gaps, 0.5) if gaps else None,
                tbt_p99_ms=1e3 * percentile(gaps, 0.99) if gaps else None,
                mismatches=None if wrong is None else len(wrong), mismatched=wrong)


def concurrent_clients(args, clients: list[int], paths: list[str]) -> list[dict]:
    """Per path one server (`--mode path --max-batch B`), warmed by one request, then C clients
    at once for each C; the serial answers come first, from the first path's server."""
    from spd.data.datasets import load_dataset
    questions = load_dataset("heldout")
    if max(clients) > len(questions):
        sys.exit(f"--clients: at most {len(questions)} (the held-out prompts)")
    chats = [[{"role": "user", "content": q["turns"][0]}] for q in questions[:max(clients)]]
    table = Table([("clients", ">7"), ("path", ">15"), ("total_tok_s", ">9.2f", "tok/s"),
                   ("per_request_tok_s", ">10.2f", "req tok/s"),
                   ("ttft_p50_s", ">9.2f", "TTFT p50"), ("ttft_max_s", ">9.2f", "TTFT max"),
                   ("tbt_p50_ms", ">9.1f", "TBT p50"), ("tbt_p99_ms", ">9.1f", "TBT p99"),
                   ("mismatches", ">6", "diff")])
    print(f"CPU, server --threads {args.threads}, n={args.stages}, --max-batch "
          f"{args.max_batch}, default model, {args.max_new_tokens} new tokens, greedy; "
          f"ms for TBT, s for TTFT")
    table.print_header()
    rows, serial = [], None
    for path in paths:
        extra = [*path_flags(path), "--max-batch", str(args.max_batch), "--max-context",
                 str(args.max_context), "--max-queue", str(max(16, max(clients)))]
        with spd_server(args, extra) as (client, model, startup):
            backend = _health(client)["backend"]
            _client(client, model, chats[0], 4, time.perf_counter())  # warm-up
            if serial is None and args.check:
                serial = [_client(client, model, m, args.max_new_tokens,
                                  time.perf_counter())["text"] for m in chats]
            for c in clients:
                row = dict(clients=c, path=path, backend=backend, startup_s=startup,
                           **clients_at_once(client, model, chats[:c], args.max_new_tokens,
                                             serial))
                rows.append(row)
                table.print(row)
                if row["mismatched"]:
                    print(f"  differs from its serial answer: prompts {row['mismatched']}")
    return rows


def overhead(args) -> list[dict]:
    """The engine alone, then behind the server in this process (same engine, same prompt)."""
    import openai
    import torch

    from spd import SPDEngine
    from spd.model.loading import load_target
    from spd.serve.backends import LocalBackend
    from spd.serve.server import start_background

    torch.set_num_threads(args.threads)
    target = load_target(None)
    engine = SPDEngine(target, n_stages=args.stages, warn_untrained=False)
    messages = [{"role": "user", "content": PROMPT}]
    engine.generate(messages, args.max_new_tokens)  # warm: caches allocated, kernels picked
    server, thread = start_background(LocalBackend(engine), model_name="m", port=0)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)

    def via_server(stream: bool) -> tuple[str, float]:
        """(text, seconds the engine itself reported: prefill + decode)."""
        kw = dict(model="m", messages=messages, temperature=0, max_tokens=args.max_new_tokens)
        if stream:
            text, usage = "", None
            for c in client.chat.completions.create(stream=True, stream_options={
                    "include_usage": True}, **kw):
                if c.choices:
                    text += c.choices[0].delta.content or ""
                usage = c.usage or usage
        else:
            resp = client.chat.completions.create(**kw)
            text, usage = resp.choices[0].message.content, resp.usage
        spd = usage.model_extra["spd"]
        return text, spd["prefill_s"] + spd["decode_s"]

    walls: dict = {"alone": [], False: [], True: []}
    outside: dict = {False: [], True: []}  # client wall - the engine's own time
    try:
        for _ in range(args.reps):  # interleaved, so a change in the machine's load hits all
            t0 = time.perf_counter()
            ref = engine.generate(messages, args.max_new_tokens)
            walls["alone"].append(time.perf_counter() - t0)
            for stream in (False, True):
                t0 = time.perf_counter()
                text, engine_s = via_server(stream)
                wall = time.perf_counter() - t0
                walls[stream].append(wall)
                outside[stream].append(wall - engine_s)
                assert text == ref.text, "the server's text differs from the engine's"
    finally:
        server.stop()
        thread.join(10)
    n = len(ref.token_ids)
    rows = [{"setup": "engine alone (in process)", "wall_s": statistics.median(walls["alone"]),
             "wall_min_s": min(walls["alone"]), "walls_s": walls["alone"], "new_tokens": n}]
    for stream in (False, True):
        rows.append({
            "setup": f"same engine, server ({'stream' if stream else 'no stream'})",
            "wall_s": statistics.median(walls[stream]), "wall_min_s": min(walls[stream]),
            "walls_s": walls[stream], "new_tokens": n,
            # both are noisy on a shared CPU: the difference of the fastest runs ...
            "overhead_ms_per_token": (min(walls[stream]) - min(walls["alone"])) / n * 1e3,
            # ... and, steadier, what the client waited beyond the engine's own clock
            "outside_ms_per_token": statistics.median(outside[stream]) / n * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--distributed", action="store_true",
                    help="also the fresh launch and the server with --distributed (gloo)")
    ap.add_argument("--clients", default=None, metavar="C,...",
                    help="instead of the above: C concurrent clients per path, e.g. 1,2,4,8,16")
    ap.add_argument("--paths", default=",".join(CLIENT_PATHS),
                    help=f"with --clients: the servers' --mode, some of "
                         f"{','.join(CLIENT_PATHS)}")
    ap.add_argument("--max-batch", type=int, default=16, help="with --clients: --max-batch")
    ap.add_argument("--max-context", type=int, default=512,
                    help="with --clients: the server's --max-context (rows a slot holds)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="with --clients: no serial answers to compare with")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    if args.clients is not None:
        clients = [int(c) for c in args.clients.split(",")]
        paths = args.paths.split(",")
        if any(c < 1 for c in clients) or any(p not in CLIENT_PATHS for p in paths):
            ap.error(f"--clients: positive integers; --paths: some of "
                     f"{', '.join(CLIENT_PATHS)}")
        rows = concurrent_clients(args, clients, paths)
        if args.json_out:
            write_json(args.json_out, run_meta(
                "cpu", model="SmolLM2-135M-Instruct", prompts="heldout", stages=args.stages,
                threads=args.threads, max_batch=args.max_batch, max_context=args.max_context,
                max_new_tokens=args.max_new_tokens, paths=paths, clients=clients), rows=rows)
        return

    rows = []
    for distributed in ((False, True) if args.distributed else (False,)):
        mode = f"distributed n={args.stages}" if distributed else f"one process n={args.stages}"
        for row in (fresh_launch(args, distributed), served(args, distributed)):
            rows.append({"mode": mode, **row})
    rows += [{"mode": f"one process n={args.stages}", **r} for r in overhead(args)]

    table = Table([("mode", "<22"), ("setup", "<34"), ("startup_s", ">9.1f", "start s"),
                   ("ttft_s", ">9.2f", "TTFT s"), ("decode_tok_s", ">10.2f", "tok/s"),
                   ("server_decode_tok_s", ">11.2f", "srv tok/s"), ("wall_s", ">9.1f", "wall s"),
                   ("wall_min_s", ">9.1f", "min s"),
                   ("overhead_ms_per_token", ">12.2f", "ovh ms/tok"),
                   ("outside_ms_per_token", ">12.2f", "out ms/tok")])
    print(f"CPU, --threads {args.threads}, default model, {args.max_new_tokens} new tokens, "
          "greedy")
    table.print_header()
    for row in rows:
        table.print(row)
    if args.json_out:
        write_json(args.json_out, run_meta("cpu", model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                           stages=args.stages, threads=args.threads,
                                           max_new_tokens=args.max_new_tokens, reps=args.reps),
                   rows=rows)


if __name__ == "__main__":
    main()
