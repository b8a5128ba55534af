"""Command line: `python -m spd generate|train|eval|serve ...` (each subcommand in its own module)."""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial

from spd.cli import eval as eval_cmd
from spd.cli import generate, serve, train
from spd.errors import InternalError, SPDError
from spd.version import __version__
from spd_kernels import SPDBackendError, _cuda


class HelpFormatter(argparse.HelpFormatter):
    """--help shows each option's default, unless its help text already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text.lower() or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    """argparse prints nothing for an option without help text: give those their default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _document_defaults(sub)
        elif action.help is None and action.option_strings and action.default is not None:
            action.help = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spd", formatter_class=HelpFormatter,
                                     description="Speculative Pipeline Decoding")
    parser.add_argument("--version", action="version", version=f"spd {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True,
        parser_class=partial(argparse.ArgumentParser, formatter_class=HelpFormatter))
    generate.add_generate(sub)
    train.add_train(sub)
    eval_cmd.add_eval(sub)
    serve.add_serve(sub)
    _document_defaults(parser)
    return parser



def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a usage error (status 2, message printed), --help or --version
        return exc.code if isinstance(exc.code, int) else 2
    try:
        _cuda.programmatic_launch_enabled()  # a bad SPD_PDL is refused up front, on any device
        return args.func(args)
    except (SPDError, SPDBackendError) as exc:  # bad input, or a backend forced where it can't run
        print(f"spd: error: {exc}", file=sys.stderr)
        return 2
    except InternalError as exc:  # the runtime's own fault: not a usage error
        print(f"spd: internal error: {exc}. This is a bug in spd: please report it with the "
              "command that gave it", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nspd: interrupted", file=sys.stderr)
        return 130

