"""The `spd` logger's set-up for the command line: --log-level, one handler on standard error.

Library code logs to `logging.getLogger("spd.<module>")` and configures nothing; the CLI
attaches the handler (and, for `serve`, uvicorn's loggers to the same one)."""
from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error")


def add_log_level_arg(p, default: str) -> None:
    p.add_argument("--log-level", choices=LEVELS, default=default,
                   help=f"messages of the spd logger at this level and above go to standard "
                        f"error (default: {default})")


def setup_logging(level: str, extra_loggers: tuple[str, ...] = ()) -> None:
    """Messages of `spd` (and `extra_loggers`) at `level` and above to standard error. Called
    again (a rank of --distributed), it replaces its own handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(name)s] %(levelname)s %(message)s",
                                           "%H:%M:%S"))
    handler._spd = True  # ours: replaced, never stacked
    for name in ("spd",) + extra_loggers:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if getattr(h, "_spd", False)]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False
