"""Command line: `python -m spd generate|train|eval ...` (each subcommand in its own module)."""
from __future__ import annotations

import argparse
import os
import sys

from spd.cli import eval as eval_cmd
from spd.cli import generate, train
from spd.errors import SPDError
from spd_kernels import SPDBackendError, _cuda


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spd",
                                     description="Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_generate(sub)
    train.add_train(sub)
    eval_cmd.add_eval(sub)
    return parser



def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        _cuda.programmatic_launch_enabled()  # a bad SPD_PDL is refused up front, on any device
        return args.func(args)
    except (SPDError, SPDBackendError) as exc:  # bad input, or a backend forced where it can't run
        print(f"spd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspd: interrupted", file=sys.stderr)
        return 130

