"""Loader of the optional CUDA C++ extension `spd_kernels._spd_cuda` (built by setup.py with nvcc).

The extension takes raw device pointers and a stream handle, so it does not depend on torch's
C++ API; the op modules pass `tensor.data_ptr()` and the current stream. The package imports and
works (reference and Triton backends) whether or not the extension was built.
"""
from __future__ import annotations

import importlib

_ext = None
_error: str | None = None
_loaded = False


def load():
    """The extension module, or None when it is not built / cannot be imported."""
    global _ext, _error, _loaded
    if not _loaded:
        _loaded = True
        try:
            _ext = importlib.import_module("spd_kernels._spd_cuda")
        except ImportError as exc:
            _ext, _error = None, (f"the CUDA extension spd_kernels._spd_cuda is not built ({exc}); "
                                  "reinstall with nvcc on PATH (pip install -e .) and without "
                                  "SPD_SKIP_CUDA_BUILD=1")
    return _ext


def built() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _error


def ext():
    mod = load()
    if mod is None:
        raise RuntimeError(_error)
    return mod


def stream_of(t) -> int:
    """Raw cudaStream_t (as an int) of the current torch stream on t's device."""
    import torch
    return torch.cuda.current_stream(t.device).cuda_stream
