"""Peak resident memory of each rank of the distributed runtime (CPU), against what it holds.

Self-launches n + 1 ranks on a model (launch_local, as `python -m spd generate --distributed`
does), decodes one short prompt, and polls every rank's VmHWM (/proc/<pid>/status) until it
exits. The base is a bare `import torch` process: "above torch" = peak - that, and "x held" =
(peak - bare torch) / the bytes of the weights the rank holds (its layers; stage 0 the embedding
too, the last stage the final norm and LM head (tied: the embedding); rank 0 the embedding,
final norm, an untied LM head and its PDM). A stage rank imports neither transformers nor
Triton (spd.model.plain_build, spd_kernels.dispatch.defer); rank 0 does (its tokenizer, the
engine), so its ratio is high by design. Also shown: each rank's peak on the tiny random Llama
(4 layers of hidden 64, same code path, almost no weights: the rank's fixed part), and a single
process loading the whole model.

A rank is forked from the launcher's forkserver (which has imported torch and spd): pages of
torch's libraries that the rank never touches are not in its resident set, while the bare
`import torch` process has touched them while importing, so "above torch" can be below the
bytes held (x held < 1).

    python benchmarks/probe_rank_memory.py --stages 4                     # this checkout
    python benchmarks/probe_rank_memory.py --stages 4 --before /work/main # and another one

With --before, every figure is also measured with the code of that checkout (its spd first on
PYTHONPATH) and the table shows both. Prints the table and writes JSON (--json-out).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20
PROMPT = [1, 504, 3458, 314, 260, 3164, 30, 2]  # a few ids of the default model's vocabulary


def vm_hwm_kb(pid: int | str = "self") -> int | None:
    """The process's peak resident set (kB), None once it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def process_peak_kb(code: str, env: dict | None = None) -> int:
    """VmHWM of a fresh `python -c code` process, read by itself at its end."""
    probe = f"{code}\nprint(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    return int(out.stdout.split()[-1])


def tiny_model_dir() -> str:
    """The tiny random Llama's folder (made once in the cache)."""
    from spd.model.loading import cache_dir, save_tiny_random_llama
    folder = cache_dir() / "models" / "tiny-random-llama"
    if not (folder / "config.json").exists():
        save_tiny_random_llama(folder)
    return str(folder)


def rank_parts(model, n: int, split=None) -> dict[int, dict]:
    """Rank -> {"bytes": weight bytes it holds (float32 here), "holds": what}."""
    from spd.model.loading import _weight_files, model_config, resolve_model_path
    from spd.model.partition import DepthLayout
    from spd.model.weight_files import WeightFiles

    cfg = model_config(model)
    files = WeightFiles(_weight_files(resolve_model_path(model)))

    def nbytes(names) -> int:  # in float32, the dtype this probe runs in
        return sum(files.entries[k].numel * 4 for k in names)
    embed = ["model.embed_tokens.weight"]
    head = ["model.norm.weight"] + (["lm_head.weight"] if "lm_head.weight" in files else [])
    layout = DepthLayout.build(cfg.num_hidden_layers, n, split, None)
    parts = {0: {"bytes": nbytes(embed + head) + _pdm_bytes(model, layout),
                 "target_bytes": nbytes(embed + head), "holds": "embedding, norm, head, PDM"}}
    for s, layers in enumerate(layout.stages):
        names = [k for k in files.names() if k.startswith("model.layers.")
                 and int(k.split(".")[2]) in layers]
        layer_bytes = nbytes(names)
        # stage 0 embeds its tokens; the last stage judges greedy drafts (norm + head, where a
        # tied head is the embedding: held once when stage 0 is also the last)
        extra = set(embed if s == 0 else [])
        if s == n - 1:
            extra |= set(head) | (set() if "lm_head.weight" in files else set(embed))
        parts[s + 1] = {"bytes": layer_bytes + nbytes(sorted(extra)),
                        "layer_bytes": layer_bytes,
                        "holds": f"layers {layers.start}-{layers.stop - 1}"
                                 + (" + embedding" if s == 0 else "")
                                 + (" + norm, head" if s == n - 1 else "")}
    return parts


def _pdm_bytes(model, layout) -> int:
    """Bytes of the untrained PDM rank 0 builds (float32)."""
    from spd.draft.pdm import PipelineDraftModule, pdm_config_for
    from spd.model.loading import load_target
    target = load_target(model, layers=range(0), embed=False, head=False, tokenizer=False)
    pdm = PipelineDraftModule(pdm_config_for(target, layout))
    return sum(p.numel() * 4 for p in pdm.parameters())


def rank_peaks(n: int, model=None, max_new: int = 8, timeout: float = 600) -> dict[int, int]:
    """Self-launch n + 1 CPU ranks on `model`, decode PROMPT, and return each rank's VmHWM
    (kB), polled until it exits."""
    from spd.distributed.config import DistConfig, GenerateRequest
    from spd.distributed.launch import launch_local
    from spd.distributed.rank import run_requests

    pids: dict[int, int] = {}
    peaks: dict[int, int] = {}
    done = threading.Event()

    def poll():
        while not done.is_set():
            for r, pid in list(pids.items()):
                kb = vm_hwm_kb(pid)
                if kb is not None:
                    peaks[r] = max(peaks.get(r, 0), kb)
            done.wait(0.02)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    config = DistConfig(n_stages=n, model=model, device="cpu", pdm="untrained")
    try:
        launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, max_new)]),
                     on_spawn=pids.update, timeout=timeout)
    finally:
        done.set()
        poller.join()
    return peaks


def _measure(args) -> None:
    """One checkout's figures (run in a child with that checkout's spd first on the path)."""
    import spd
    out = {"spd": str(Path(spd.__file__).parent),
           "ranks": rank_peaks(args.stages, args.model, args.max_new_tokens),
           "tiny_ranks": rank_peaks(args.stages, tiny_model_dir(), args.max_new_tokens),
           "single_process": process_peak_kb(
               "import spd.distributed.rank; from spd.model.loading import load_target; "
               f"load_target({args.model!r})")}
    print("RESULT " + json.dumps(out))


def _run_checkout(python_path: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=python_path)
    cmd = [sys.executable, __file__, "--measure", "--stages", str(args.stages),
           "--max-new-tokens", str(args.max_new_tokens)] + (
        ["--model", args.model] if args.model else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"measuring with {python_path} failed:\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    for key in ("ranks", "tiny_ranks"):
        res[key] = {int(r): kb for r, kb in res[key].items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--model", default=None, help="model folder (default: the default model)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--before", default=None,
                    help="another checkout (e.g. /work/main) measured the same way")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        return _measure(args)

    from harness import RESULTS, Table, run_meta, write_json
    this = f"{REPO / 'python'}:{REPO}"
    runs = {"after": _run_checkout(this, args)}
    if args.before:
        runs["before"] = _run_checkout(f"{Path(args.before) / 'python'}:{args.before}", args)
    env = dict(os.environ, PYTHONPATH=this)
    base_torch = process_peak_kb("import torch", env)
    parts = rank_parts(args.model, args.stages)
    rows = []
    for r in range(args.stages + 1):
        row = {"rank": r, "role": "draft rank" if r == 0 else f"stage {r - 1}",
               "holds": parts[r]["holds"], "holds_mb": parts[r]["bytes"] / MB}
        for label, res in runs.items():
            kb = res["ranks"].get(r)
            above = (kb - base_torch) * 1024 if kb else None
            row[f"{label}_peak_mb"] = kb / 1024 if kb else None
            row[f"{label}_tiny_peak_mb"] = res["tiny_ranks"].get(r, 0) / 1024 or None
            row[f"{label}_above_torch_mb"] = above / MB if above is not None else None
            row[f"{label}_ratio"] = above / parts[r]["bytes"] if above is not None else None
        rows.append(row)
    total = parts[0]["target_bytes"] + sum(parts[r]["layer_bytes"]
                                           for r in range(1, args.stages + 1))
    single = {"rank": None, "role": "single process", "holds": "the whole model",
              "holds_mb": total / MB}
    for label, res in runs.items():
        kb = res["single_process"]
        single.update({f"{label}_peak_mb": kb / 1024,
                       f"{label}_above_torch_mb": (kb - base_torch) / 1024})
    rows.append(single)
    cols = [("role", "<16"), ("holds", "<28"), ("holds_mb", ">9.1f", "held MB")]
    for label in runs:
        cols += [(f"{label}_peak_mb", ">12.1f", f"{label} peak"),
                 (f"{label}_above_torch_mb", ">12.1f", "above torch"),
                 (f"{label}_ratio", ">8.2f", "x held"),
                 (f"{label}_tiny_peak_mb", ">10.1f", "tiny peak")]
    print(f"peak resident memory (VmHWM, MB), CPU, n = {args.stages}, fp32; base = a bare "
          f"`import torch` process: {base_torch / 1024:.1f} MB; x held = (peak - base) / held; "
          "tiny peak = the same rank on the tiny model")
    table = Table(cols)
    table.print_header()
    for row in rows:
        table.print(row)
    out = args.json_out or RESULTS / "2026-12-03-rank-memory-bare-cpu.json"
    write_json(out, run_meta("cpu", model=args.model or "default", stages=args.stages,
                             baseline_torch_mb=base_torch / 1024,
                             note="base = a bare `import torch` process (baseline_torch_mb); "
                                  "x held = (peak - base) / the bytes the rank holds; "
                                  "tiny_peak = the same rank on the tiny random Llama",
                             spd_paths={k: v["spd"] for k, v in runs.items()}), rows=rows)


if __name__ == "__main__":
    main()
