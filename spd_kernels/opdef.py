"""Declaring an op once: `@op(...)` on its public function.

An op's public function (shape comments, host-side argument checks, then `dispatch.call`) is the
one declaration. From its signature the decorator makes:
  - the dispatcher's entry (`dispatch.declare`), which backends then register against;
  - the torch.library op `torch.ops.spd.<function name>`, whose schema is the same signature
    without `backend=` (keyword-only arguments become ordinary ones, defaults kept), so other
    runtimes can leave the optional arguments out;
  - the compile path: under torch.compile the function calls that custom op, which Dynamo treats
    as opaque, so the checks and the dispatcher never break the graph (`backend=` then does not
    apply). Inside `called_as_ops()` it calls the op too: a dispatch mode then sees one op per
    call, not the backend's own (spd.runtime.cycle_graph's replay check).
The fake (meta) implementation, which gives output shapes and dtypes for tracing, is declared
next to the op with `@<function>.register_fake`.

Schema types come from the annotations: Tensor, int, float, bool, str, `X | None`, sequences of
tensors (a list in the schema; a sequence cannot have a non-None default there, so an optional
sequence defaults to None), and `Position` (an int or an int64 tensor of one element; the custom
op always takes the tensor).
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import inspect
import threading
import types
import typing
from dataclasses import dataclass
from typing import Callable, Union

import torch

from spd_kernels import dispatch

LIB = "spd"

_AS_OPS = threading.local()  # called_as_ops() on this thread


@contextlib.contextmanager
def called_as_ops():
    """On this thread, public functions call their torch.ops.spd op (the compile path)."""
    before = getattr(_AS_OPS, "on", False)
    _AS_OPS.on = True
    try:
        yield
    finally:
        _AS_OPS.on = before


# A position given on the host (int) or on the device (int64 tensor of one element, no host read).
Position = Union[torch.Tensor, int]


@dataclass(frozen=True)
class OpSpec:
    name: str          # the dispatcher's key (SPD_BACKEND=<name>=triton)
    qualname: str      # "spd::<public function name>"
    schema: str        # "(Tensor x, Tensor weight, Tensor? norm_weight=None, ...) -> Tensor"
    mutates: tuple[str, ...]


SPECS: dict[str, OpSpec] = {}


def _is_optional(hint) -> tuple[bool, object]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return True, rest[0]
    return False, hint


def _schema_type(hint, where: str) -> str:
    if hint == Position:
        return "Tensor"
    optional, inner = _is_optional(hint)
    if optional:
        return _schema_type(inner, where) + "?"
    if inner is torch.Tensor:
        return "Tensor"
    if inner in (int, float, bool, str):
        return inner.__name__
    origin, args = typing.get_origin(inner), typing.get_args(inner)
    if origin in (list, tuple, collections.abc.Sequence) and args:
        element = _schema_type(args[0], where)
        if element in ("Tensor", "Tensor?"):
            return element + "[]"
    raise TypeError(f"{where}: annotation {hint!r} has no torch.library schema type")


def _default(value, where: str) -> str:
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    raise TypeError(f"{where}: default {value!r} cannot be written in a schema (sequences "
                    "default to None)")


def _returns(hint, where: str) -> str:
    if hint is None or hint is type(None):
        return "()"
    if typing.get_origin(hint) is tuple:
        return "(" + ", ".join(_schema_type(a, where) for a in typing.get_args(hint)) + ")"
    return _schema_type(hint, where)


def _schema(params, hints, mutates, returns, where) -> str:
    parts = []
    for i, p in enumerate(params):
        t = _schema_type(hints[p.name], f"{where}({p.name})")
        if p.name in mutates:  # Tensor(a0!) / Tensor(a0!)[]: written in place
            t = t.replace("Tensor", f"Tensor(a{i}!)", 1)
        text = f"{t} {p.name}"
        if p.default is not inspect.Parameter.empty:
            text += "=" + _default(p.default, f"{where}({p.name})")
        parts.append(text)
    return f"({', '.join(parts)}) -> {_returns(returns, where)}"


def op(name: str, *, mutates: tuple[str, ...] = (), returns_arg: str | None = None):
    """Declare the public function of dispatched op `name` (see the module docstring).

    mutates: the arguments written in place. returns_arg: the function returns this (mutated)
    argument, as in-place functions do; the custom op then returns nothing.
    """
    def deco(fn: Callable) -> Callable:
        where = f"spd_kernels op {name}"
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "backend"]
        if len(params) == len(sig.parameters):
            raise TypeError(f"{where}: the public function takes no backend= keyword")
        hints = typing.get_type_hints(fn)
        returns = None if returns_arg else hints.get("return", None)
        schema = _schema(params, hints, mutates, returns, where)
        lists = {p.name for p in params if "[]" in _schema_type(hints[p.name], where)}
        positions = {p.name for p in params if hints[p.name] == Position}
        bare = sig.replace(parameters=params)

        names = [p.name for p in params]

        def impl(*args, **kwargs):  # called with the schema's arguments, by position
            out = fn(**dict(zip(names, args)), **kwargs)
            return None if returns_arg else out

        qualname = f"{LIB}::{fn.__name__}"
        custom = torch.library.custom_op(qualname, impl, mutates_args=mutates, schema=schema)

        @functools.wraps(fn)
        def public(*args, **kwargs):
            if not (torch.compiler.is_compiling() or getattr(_AS_OPS, "on", False)):
                return fn(*args, **kwargs)
            kwargs.pop("backend", None)
            bound = bare.bind(*args, **kwargs)
            bound.apply_defaults()
            device = next(v.device for v in bound.arguments.values()
                          if isinstance(v, torch.Tensor))
            values = []
            for p in params:
                v = bound.arguments[p.name]
                if p.name in lists and v is not None:
                    v = list(v)
                elif p.name in positions and not isinstance(v, torch.Tensor):
                    v = torch.tensor(int(v), dtype=torch.int64, device=device)
                values.append(v)
            out = custom(*values)
            return bound.arguments[returns_arg] if returns_arg else out

        dispatch.declare(name)
        SPECS[name] = OpSpec(name, qualname, schema, tuple(mutates))
        public.register_fake = custom.register_fake
        public.custom_op = custom
        return public
    return deco
