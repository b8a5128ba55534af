"""One exception type for every user-facing error (the ops' SPDInputError), so callers and the
CLI catch a single class; the message says what was wrong and how to fix it."""
from spd_kernels.checks import SPDInputError

SPDError = SPDInputError
