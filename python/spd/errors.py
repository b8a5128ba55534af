"""The two kinds of error, told apart by whose fault they are.

SPDError       the caller's input was wrong (a prompt out of the vocabulary, a bad flag, a
               checkpoint for another target). The message names what and how to fix it. It is
               the ops' SPDInputError (a ValueError), so one class covers both. The server
               answers 400, the command line exits with status 2.
InternalError  the runtime broke one of its own rules (a KV cache overflow, a ring of buffers
               too shallow, a stage out of step with its units, an output that differs from
               autoregressive decoding): a bug, never the caller's. It carries the context a bug
               report needs. The server answers 500 and logs it with that context, the command
               line exits with status 1.
"""
from __future__ import annotations

from spd_kernels.checks import SPDInputError

SPDError = SPDInputError


class InternalError(RuntimeError):
    """A fault of the runtime itself. `context`: what a bug report needs (stage, position, ...),
    shown after the message."""

    def __init__(self, message: str, **context):
        self.message, self.context = message, context
        details = ", ".join(f"{k}={v!r}" for k, v in context.items())
        super().__init__(f"{message} ({details})" if details else message)


__all__ = ["InternalError", "SPDError"]
