"""Backend choice per op and device: cuda (C++ extension), triton, or the PyTorch reference.

Automatic choice (the default):
  - CUDA tensors: the CUDA C++ kernel if the extension is built and the op has one that supports
    the arguments, else the Triton kernel, else the reference. A kernel registered with
    automatic=False (written and checked, not yet timed on a GPU) runs only when requested.
  - CPU tensors: the reference (the Triton interpreter is a correctness tool, not a speed path).

Forcing a backend:
  - `SPD_BACKEND=triton` (or cuda / reference / auto) forces one for every op;
    `SPD_BACKEND=verify_greedy=cuda,anchor_projection=triton` forces per op, and a bare name in the
    list sets the default for the others (`SPD_BACKEND=triton,truncate_kv=reference`).
  - `with spd_kernels.dispatch.use_backend("triton"): ...` does the same in-process (tests).
  - the `backend=` keyword of each public op, which wins over both.

A forced backend that cannot run (not built, wrong device, Triton on CPU without
`TRITON_INTERPRET=1`, unsupported arguments) raises `SPDBackendError` naming why; the automatic
choice never raises for that reason, it falls back to the next backend.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from spd_kernels import _cuda, env
from spd_kernels._host import INTERPRET

BACKENDS = ("cuda", "triton", "reference")


class SPDBackendError(RuntimeError):
    """A backend was requested explicitly but cannot run this op here."""


@dataclass
class _Impl:
    fn: Callable
    # supports(*args, **kwargs) -> None when the impl handles these arguments, else a reason.
    supports: Callable | None = None
    # False: runs only when asked for by name (a kernel not yet timed against the others on a
    # GPU); the automatic choice passes over it.
    automatic: bool = True
    # Its kernels take programmatic dependent launch (SPD_PDL=1); every CUDA kernel does.
    programmatic: bool = False


# op -> backend -> implementation; an op's entry is made by its declaration (spd_kernels.opdef).
_REGISTRY: dict[str, dict[str, _Impl]] = {}
# op -> backend -> the module whose import registers it, not imported yet (defer)
_DEFERRED: dict[str, dict[str, str]] = {}
_local = threading.local()
_import_lock = threading.RLock()


def defer(op: str, backend: str, module: str) -> None:
    """`op`'s `backend` is registered by importing `module`, done the first time the dispatcher
    may pick that backend (or is asked about it). Modules holding Triton kernels are deferred:
    importing Triton costs ~50 MB resident, which a process running the reference ops on the CPU
    never needs."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}: declare it before deferring its backends")
    _DEFERRED.setdefault(op, {})[backend] = module


def _import_kernels(module: str) -> None:
    """Import a kernel module as if at spd_kernels' import: Triton reads TRITON_INTERPRET when it
    decorates the kernels, so it sees the value INTERPRET was read from then."""
    with _import_lock:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if INTERPRET else "0"
        try:
            importlib.import_module(module)
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


def _has(op: str, backend: str) -> bool:
    """Whether `op` has `backend`, registered or deferred (nothing is imported)."""
    return backend in _REGISTRY[op] or backend in _DEFERRED.get(op, ())


has = _has  # public: tests ask whether an op has a kernel before they skip for its absence


def _impl(op: str, backend: str) -> _Impl | None:
    """`op`'s `backend` implementation, importing its module if it was deferred."""
    pending = _DEFERRED.get(op)
    if pending and backend in pending:
        _import_kernels(pending[backend])
        pending.pop(backend, None)
    return _REGISTRY[op].get(backend)


def load_deferred() -> None:
    """Import every deferred kernel module (reports, tests that walk the registry)."""
    for op in list(_DEFERRED):
        for backend in list(_DEFERRED.get(op, ())):
            _impl(op, backend)


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    """Whether Triton imports (it is imported here, on the first question)."""
    _import_kernels("spd_kernels._triton")
    from spd_kernels import _triton
    return _triton.HAS_TRITON


def declare(op: str) -> None:
    """Make `op`'s entry (called once, by spd_kernels.opdef.op on the op's public function)."""
    if op in _REGISTRY:
        raise ValueError(f"op {op!r} is declared twice")
    _REGISTRY[op] = {}


def ops() -> tuple[str, ...]:
    """The dispatched ops, in declaration order (benchmarks and tests take the list from here)."""
    return tuple(_REGISTRY)


def register(op: str, backend: str, supports: Callable | None = None, automatic: bool = True,
             programmatic: bool | None = None):
    """Decorator: `fn` implements `op` on `backend` (same signature as the public op).
    automatic=False keeps the automatic choice from picking it (it runs when requested);
    programmatic: its kernels take programmatic dependent launch (default: CUDA kernels do)."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}: declare it (spd_kernels.opdef.op) before its "
                         "backends")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")

    def deco(fn):
        pdl = backend == "cuda" if programmatic is None else programmatic
        _REGISTRY[op][backend] = _Impl(fn, supports, automatic, pdl)
        _DEFERRED.get(op, {}).pop(backend, None)  # imported directly: no longer pending
        return fn
    return deco


def backend_unavailable(backend: str, device: torch.device) -> str | None:
    """Why `backend` cannot run on `device` at all (None when it can)."""
    if backend == "reference":
        return None
    if backend == "triton":
        if not triton_installed():
            return "Triton is not installed"
        if device.type == "cuda":
            if INTERPRET:
                return ("TRITON_INTERPRET=1 was set when spd_kernels was imported, so the Triton "
                        "kernels run in the CPU interpreter and cannot take CUDA tensors")
            return None
        if device.type == "cpu":
            if INTERPRET:
                return None
            return ("Triton kernels run on CPU tensors only in the interpreter: set "
                    "TRITON_INTERPRET=1 before importing spd_kernels")
        return f"Triton kernels do not run on {device.type} tensors"
    if backend == "cuda":
        if device.type == "cpu" and _cuda.simulating():
            return None  # the kernels' host emulation (tests): _cuda.simulated()
        if device.type != "cuda":
            return f"the CUDA C++ kernels need CUDA tensors, got {device.type} tensors"
        if not _cuda.built():
            return _cuda.unavailable_reason()
        return None
    return f"unknown backend {backend!r} (expected one of {', '.join(BACKENDS)} or auto)"


@functools.lru_cache(maxsize=8)  # read on every op call: parse each value once
def _parse_env(value: str) -> tuple[str | None, dict[str, str]]:
    default, per_op = None, {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        if "=" in part:
            op, name = (s.strip() for s in part.split("=", 1))
            if op not in _REGISTRY:
                raise SPDBackendError(f"SPD_BACKEND names unknown op {op!r} "
                                      f"(ops: {', '.join(_REGISTRY)})")
            per_op[op] = name
        else:
            default = part
    return default, per_op


def requested_backend(op: str, explicit: str | None = None) -> str:
    """The backend asked for (explicit > use_backend context > SPD_BACKEND > auto)."""
    if explicit is not None:
        return explicit
    forced = getattr(_local, "forced", None)
    if forced is not None:
        default, per_op = forced
        if op in per_op:
            return per_op[op]
        if default is not None:
            return default
    default, per_op = _parse_env(env.BACKEND.get())
    return per_op.get(op, default) or "auto"


@contextlib.contextmanager
def use_backend(default: str | None = None, **per_op: str):
    """Force backends inside a block: use_backend("triton") or use_backend(verify_greedy="cuda")."""
    for op in per_op:
        if op not in _REGISTRY:
            raise SPDBackendError(f"unknown op {op!r} (ops: {', '.join(_REGISTRY)})")
    old = getattr(_local, "forced", None)
    _local.forced = (default, dict(per_op))
    try:
        yield
    finally:
        _local.forced = old


def _auto_order(device: torch.device) -> tuple[str, ...]:
    if device.type == "cuda":
        return ("cuda", "triton", "reference")
    return ("reference",)


def select(op: str, device: torch.device, args=None, kwargs=None,
           backend: str | None = None) -> tuple[str, Callable]:
    """(backend name, implementation) for a call with these arguments; with args=None the
    arguments are not considered (a query: which backend would this op use on this device)."""
    check_args = args is not None
    args, kwargs = args or (), kwargs or {}
    name = requested_backend(op, backend)
    if name != "auto":
        if name not in BACKENDS:
            raise SPDBackendError(f"unknown backend {name!r} for {op} (expected one of "
                                  f"{', '.join(BACKENDS)} or auto)")
        impl = _impl(op, name)
        if impl is None:
            have = ", ".join(b for b in BACKENDS if b in _REGISTRY[op])
            raise SPDBackendError(f"{op} has no {name} implementation (available: {have})")
        why = backend_unavailable(name, device)
        if why is None and impl.supports is not None and check_args:
            why = impl.supports(*args, **kwargs)
        if why is not None:
            raise SPDBackendError(f"{op}: the {name} backend was requested but cannot run: {why}")
        return name, impl.fn
    passed_over = []  # (backend, why): kernels that could run here but not these arguments
    for cand in _auto_order(device):
        if not _has(op, cand) or backend_unavailable(cand, device) is not None:
            continue
        impl = _impl(op, cand)
        if impl is None or not impl.automatic:
            continue
        why = impl.supports(*args, **kwargs) if check_args and impl.supports else None
        if why is not None:
            passed_over.append((cand, why))
            continue
        _report_fallback(op, cand, passed_over)
        return cand, impl.fn
    _report_fallback(op, "reference", passed_over)
    return "reference", _REGISTRY[op]["reference"].fn


_REPORTED: set = set()


def _report_fallback(op: str, chosen: str, passed_over: list) -> None:
    """Say once per (op, kernel) why the automatic choice passed over a kernel that runs on this
    device (a silent fallback hides a slow path): the first reason met."""
    for backend, why in passed_over:
        key = (op, backend)
        if key in _REPORTED:
            continue
        _REPORTED.add(key)
        warnings.warn(f"spd_kernels: {op} runs on {chosen}, not its {backend} kernel: {why}",
                      stacklevel=4)


def call(op: str, device: torch.device, *args, backend: str | None = None, **kwargs):
    _, fn = select(op, device, args, kwargs, backend)
    return fn(*args, **kwargs)


def available(op: str, device) -> list[str]:
    """Backends that can run `op` on `device` here (argument support aside)."""
    device = torch.device(device)
    return [b for b in BACKENDS if _has(op, b) and backend_unavailable(b, device) is None]


def on_request(op: str, backend: str) -> bool:
    """Whether `op`'s `backend` kernel runs only when asked for (registered automatic=False)."""
    impl = _impl(op, backend)
    return impl is not None and not impl.automatic


def programmatic(op: str, backend: str) -> bool:
    """Whether `op`'s `backend` kernels take programmatic dependent launch."""
    impl = _impl(op, backend)
    return impl is not None and impl.programmatic


def describe() -> dict:
    """What is registered and available, for logs and benchmarks (imports every kernel)."""
    load_deferred()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    return {
        "triton": triton_installed(), "triton_interpret": INTERPRET, "cuda_extension": _cuda.built(),
        "cuda_extension_error": _cuda.unavailable_reason(),
        "programmatic_launch": _cuda.programmatic_launch_enabled(),
        "ops": {op: {"implemented": [b for b in BACKENDS if b in _REGISTRY[op]],
                     "on_request_only": [b for b in BACKENDS if on_request(op, b)],
                     "programmatic": [b for b in BACKENDS if programmatic(op, b)],
                     **{str(d): available(op, d) for d in devices}} for op in _REGISTRY},
    }
