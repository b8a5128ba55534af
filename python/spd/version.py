"""The installed version of spd (one number for the runtime and the kernels)."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("spd")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.1.0"
