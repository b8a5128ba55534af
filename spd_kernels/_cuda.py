"""Loader of the optional CUDA C++ extension `spd_kernels._spd_cuda` (built by setup.py with nvcc).

The extension takes raw device pointers and a stream handle, so it does not depend on torch's
C++ API; the op modules pass `tensor.data_ptr()` and the current stream. The package imports and
works (reference and Triton backends) whether or not the extension was built.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys

from spd_kernels import env

_ext = None
_error: str | None = None
_loaded = False
_simt = None  # spd_kernels._spd_simt while `simulated()` is active


def load():
    """The extension module, or None when it is not built / cannot be imported."""
    global _ext, _error, _loaded
    if not _loaded:
        _loaded = True
        try:
            _ext = importlib.import_module("spd_kernels._spd_cuda")
            _ext.set_programmatic_launch(programmatic_launch_enabled())
        except ImportError as exc:
            _ext, _error = None, (f"the CUDA extension spd_kernels._spd_cuda is not built ({exc}); "
                                  "reinstall with nvcc on PATH (pip install -e .) and without "
                                  "SPD_SKIP_CUDA_BUILD=1")
    return _ext


def built() -> bool:
    return _simt is not None or load() is not None


def unavailable_reason() -> str | None:
    if _simt is not None:
        return None
    load()
    return _error


def ext():
    if _simt is not None:
        return _simt
    mod = load()
    if mod is None:
        raise RuntimeError(_error)
    return mod


def simulating() -> bool:
    return _simt is not None


def _load_simt():
    """(the host emulation module, None) or (None, why it is not there). SPD_SIMT_LIBRARY names
    another build of it to load instead (the sanitized one: tests/sanitize_emulation.sh)."""
    name, path = "spd_kernels._spd_simt", env.SIMT_LIBRARY.get() or None
    if path and name not in sys.modules:
        try:
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or not os.path.isfile(path):
                raise ImportError("not an extension module file")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sys.modules[name] = mod
        except ImportError as exc:
            return None, f"SPD_SIMT_LIBRARY={path} could not be loaded ({exc})"
    try:
        return importlib.import_module(name), None
    except ImportError as exc:
        return None, (f"spd_kernels._spd_simt is not built ({exc}): it is built with the CUDA "
                      "extension when nvcc and the CUDA headers are present and neither "
                      "SPD_SKIP_CUDA_BUILD=1 nor SPD_SKIP_SIMT_BUILD=1 is set")


def simt_unavailable_reason() -> str | None:
    """Why `simulated()` cannot run here (None when it can)."""
    return _load_simt()[1]


@contextlib.contextmanager
def simulated(multiprocessors: int | None = None):
    """Inside this block the cuda backend runs the same CUDA C++ kernels in the host emulation
    (`spd_kernels._spd_simt`, csrc/emulation/) on CPU tensors: the tests' way of checking the
    kernels on machines without a GPU. Slow (every CUDA thread is a fiber) and not thread-safe:
    for small test shapes only. `multiprocessors` sets the emulated device's SM count (default
    3), which the launch plans read: 132 runs the plans of an H100 / H200. Raises ImportError
    when the emulation was not built."""
    global _simt, _emulated_sms
    mod, why = _load_simt()
    if mod is None:
        raise ImportError(why)
    if multiprocessors is not None and multiprocessors < 1:
        raise ValueError(f"multiprocessors must be >= 1, got {multiprocessors}")
    old, old_sms = _simt, _emulated_sms
    _simt, _emulated_sms = mod, multiprocessors or EMULATED_SMS
    mod.set_multiprocessors(_emulated_sms)
    try:
        yield mod
    finally:
        _simt, _emulated_sms = old, old_sms
        mod.set_multiprocessors(old_sms)


EMULATED_SMS = 3  # the emulated device's SMs by default (g_sms, csrc/emulation/simt_host.cpp)
_emulated_sms = EMULATED_SMS
MMA_CHUNK = 32    # K columns per warp step of the tensor-core kernels (kMmaChunk, mma_stream.cuh)


def multiprocessors(device) -> int:
    """SMs of a CUDA device, or of the emulated one (CPU tensors inside `simulated()`): the
    launchers size their grids with it."""
    if device.type == "cuda":
        import torch
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _emulated_sms


def stream_of(t) -> int:
    """Raw cudaStream_t (as an int) of the current torch stream on t's device."""
    if t.device.type == "cpu" and _simt is not None:
        return 0  # the emulation runs synchronously
    import torch
    return torch.cuda.current_stream(t.device).cuda_stream


# --- programmatic dependent launch -------------------------------------------------------------
# On sm_90+ a kernel launched programmatically may start while the one before it on the stream
# is still running; it waits for that one inside (csrc/kernels/common.cuh pdl_wait, the Triton kernels'
# pdl_enter), so back-to-back launches (the PDM step's 30-40 in one CUDA graph) lose less time
# between kernels. Process-wide, for the CUDA extension's kernels and the Triton kernels of the
# PDM step's graph; off by default until timed on a GPU. SPD_PDL=1 turns it on; a CUDA graph
# keeps what was set when it was captured.

_programmatic: bool | None = None  # None: SPD_PDL not read yet


def programmatic_launch_enabled() -> bool:
    """Whether kernels are launched as programmatic dependent launches (SPD_PDL, read at the
    first call; a bad value raises SPDInputError naming it)."""
    global _programmatic
    if _programmatic is None:
        raw = env.PDL.get().strip().lower()
        if raw not in ("0", "1", "", "false", "true", "off", "on"):
            from spd_kernels.checks import SPDInputError
            raise SPDInputError(f"SPD_PDL={raw!r}: use 1 (programmatic dependent launch) or 0 "
                                "(plain launches, the default)")
        _programmatic = raw in ("1", "true", "on")
    return _programmatic


@contextlib.contextmanager
def programmatic_launch(on: bool = True):
    """Inside this block kernels are (or, with on=False, are not) programmatic dependent
    launches; a CUDA graph captured inside keeps that."""
    global _programmatic
    old, _programmatic = programmatic_launch_enabled(), bool(on)
    mod = load()  # the real extension also inside simulated(): the emulation runs synchronously
    if mod is not None:
        mod.set_programmatic_launch(_programmatic)
    try:
        yield
    finally:
        _programmatic = old
        if mod is not None:
            mod.set_programmatic_launch(old)
