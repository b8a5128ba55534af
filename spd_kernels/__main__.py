"""`python -m spd_kernels`: which backend each op runs here, and why the others do not.

Prints, per op, the backends implemented, those that run only when asked for, and for each device
(the CPU, and the GPU when there is one) the backend the dispatcher picks with the current
SPD_BACKEND and those that could run; then the state of Triton and of the CUDA extension.
`--json` prints the same as JSON (spd_kernels.dispatch.describe() plus the picks).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from spd_kernels import _cuda, dispatch, env


def _pick(op: str, device: torch.device) -> str:
    try:
        return dispatch.select(op, device)[0]
    except dispatch.SPDBackendError as exc:  # SPD_BACKEND forces one that cannot run here
        return f"error: {exc}"


def report() -> dict:
    info = dispatch.describe()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for op, row in info["ops"].items():
        row["picked"] = {str(d): _pick(op, d) for d in devices}
    info["spd_backend_env"] = env.BACKEND.get() or None
    info["host_emulation_error"] = _cuda.simt_unavailable_reason()
    info["devices"] = [str(d) for d in devices]
    return info


def print_table(info: dict, out=sys.stdout) -> None:
    devices = info["devices"]
    head = ["op", "implemented", "on request only"] + [f"{d}: picked / can run" for d in devices]
    rows = [[op, ",".join(r["implemented"]), ",".join(r["on_request_only"]) or "-"]
            + [f"{r['picked'][d]} / {','.join(r[d])}" for d in devices]
            for op, r in info["ops"].items()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for line in [head] + rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip(), file=out)
    print(file=out)
    print(f"SPD_BACKEND: {info['spd_backend_env'] or '(unset: automatic)'}", file=out)
    print(f"Triton: {'installed' if info['triton'] else 'not installed'}"
          f"{' (interpreter: TRITON_INTERPRET=1)' if info['triton_interpret'] else ''}", file=out)
    print(f"CUDA extension: {'built' if info['cuda_extension'] else info['cuda_extension_error']}",
          file=out)
    print(f"programmatic dependent launch (SPD_PDL): "
          f"{'on' if info['programmatic_launch'] else 'off'}", file=out)
    print(f"host emulation of the CUDA kernels (tests): "
          f"{'built' if info['host_emulation_error'] is None else info['host_emulation_error']}",
          file=out)
    if "cuda" not in devices:
        print("no CUDA device: every op runs its PyTorch reference (Triton only in the "
              "interpreter, the CUDA kernels only in the tests' emulation)", file=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spd_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    info = report()
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        print_table(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
