"""A decode cycle as one CUDA graph, and the check that a replay would be the cycle.

Every process that decodes (rank 0 or the one process: spd.runtime.cycle; a stage rank:
spd.distributed.stage_rank) runs one fixed cycle again and again. On a GPU the first steady launch runs
eagerly (it warms every kernel up and makes lazy buffers), the second is captured as one CUDA
graph, and every launch from then on replays it. A replay repeats the captured launches on the
same memory: that is right only when every steady cycle is the same work, op for op, on the
same tensors, with no Python value that changes between cycles.

`SPD_REPLAY_CHECK=1` checks exactly that, on any device (the CPU tests): every steady cycle runs
eagerly under a dispatch mode that writes down each op, the address, shape and strides of every
tensor it touches that the cycle did not make, and its other arguments (a call of an
spd_kernels op is one op: its CPU reference may read the host, the GPU's kernel does not); from
the second steady cycle on, each one must equal the first. Point-to-point messages are ops too
(c10d send / recv), so a lock-step rank's cycle is checked with its messages.

Under NCCL the cycle's messages are recorded in the graph with it (NCCL 2.9+). Their
communicator exists by then (the eager first cycle's message group made it), and every
message of a cycle is waited for inside the cycle, so the NCCL stream joins the capture again.
A capture that fails warns and the cycles run eagerly, unless messages were recorded before it
failed: the peers may then disagree about what was sent, and the run stops with an error that
says to set SPD_CUDA_GRAPHS=0.
"""
from __future__ import annotations

import warnings
from collections import Counter
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spd import env
from spd.cuda_graphs import graphs_enabled
from spd.errors import InternalError, SPDError
from spd_kernels.opdef import called_as_ops


class CycleGraph:
    """Launches `cycle()` (a steady decode cycle): eagerly, then as one CUDA graph's
    replays where it is `replayable` (the same work every cycle: checked under
    SPD_REPLAY_CHECK), `capturable` (its device and transport can be recorded: not gloo, whose
    messages are host work) and graphs are on (spd.cuda_graphs.graphs_enabled).

    generators: the device generators the cycle draws from (they advance at every replay).
    messages: the endpoint's message counter (Endpoint.messages): a replay adds the captured
        cycle's messages, which Python posted once, at the capture.
    thread_local: capture in thread-local mode, where other threads of the process use the
        GPU meanwhile (NCCL's watchdog, the other role of a draft-on-stage process)."""

    def __init__(self, cycle: Callable[[], None], device: torch.device, what: str, *,
                 replayable: bool = True, capturable: bool = True, generators=(),
                 messages: Counter | None = None, thread_local: bool = False):
        self.cycle, self.what = cycle, what
        self.device = torch.device(device)
        self.generators, self.messages = tuple(generators), messages
        self.mode = "thread_local" if thread_local else "global"
        self.check = replayable and env.replay_check_enabled()
        self.failed: str | None = None  # why the cycles run eagerly
        if not replayable:
            self.failed = "not the same work every cycle"
        elif not capturable:
            self.failed = "its messages cannot be captured"
        elif not graphs_enabled(self.device) or self.check:
            self.failed = "off"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.per_replay: Counter = Counter()  # the messages of one replay
        self.launches = self.replays = self.checked = 0
        self.first: list | None = None  # the op trace every checked cycle must equal

    def launch(self) -> None:
        """One steady cycle."""
        self.launches += 1
        if self.graph is None and self.failed is None and self.launches >= 2:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            if self.messages is not None:
                self.messages.update(self.per_replay)
            return
        if self.check:
            self._checked()
        else:
            self.cycle()

    def describe(self) -> dict:
        """How the cycles ran: replays, cycles checked (SPD_REPLAY_CHECK), why eagerly."""
        return {"replays": self.replays, "checked": self.checked,
                "eager": None if self.graph is not None else self.failed}

    def _capture(self) -> None:
        """Records the cycle (it runs at the first replay, not here)."""
        before = Counter(self.messages or {})
        graph = torch.cuda.CUDAGraph()
        try:
            for gen in self.generators:
                graph.register_generator_state(gen)
            with torch.cuda.graph(graph, capture_error_mode=self.mode):
                self.cycle()
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager cycles
            self.failed = f"{type(exc).__name__}: {exc}"
            if self.messages is not None and Counter(self.messages) != before:
                raise SPDError(f"CUDA-graph capture of the {self.what} failed after it had "
                               f"recorded messages ({self.failed}); the ranks cannot go on in "
                               "step. Set SPD_CUDA_GRAPHS=0 to run the cycles eagerly") from exc
            warnings.warn(f"CUDA-graph capture of the {self.what} failed ({self.failed}); it "
                          "runs eagerly", RuntimeWarning, stacklevel=4)
            torch.cuda.synchronize(self.device)
            return
        if self.messages is not None:
            self.per_replay = Counter(self.messages)
            self.per_replay.subtract(before)
            self.messages.subtract(self.per_replay)  # counted at each replay, the first included
        self.graph = graph

    def _checked(self) -> None:
        """The cycle under SPD_REPLAY_CHECK: its trace against the first steady cycle's."""
        with called_as_ops(), _Trace() as trace:  # a kernel call is one op (its backend's own
            self.cycle()                           # reference may read the host: not the GPU's)
        if self.launches < 2:  # the warm-up: what a graph would not record
            return
        if self.first is None:
            self.first = trace.ops
            return
        self.checked += 1
        if trace.ops != self.first:
            raise InternalError(f"a steady {self.what} is not the one a CUDA graph would replay",
                                launch=self.launches, difference=_first_difference(
                                    self.first, trace.ops))


def figures(graph: CycleGraph | None) -> Counter:
    """A graph's replays, checked cycles and whether it was captured (0 / 1), to add up."""
    if graph is None:
        return Counter()
    return Counter(replays=graph.replays, checked=graph.checked,
                   captured=int(graph.graph is not None))


class BatchGraphs:
    """A batch's cycle as CycleGraphs by key (FusedBatch.key): a bucket's key names the slots
    the cycle runs over and the kinds of judgement in it, not its members, so one graph serves
    every set of sequences that fits it (free slots its bubbles) and is replayed across joins
    and leaves; a key of members (a batch that cannot run over free slots) has a graph for as
    long as those members decode together. `kwargs` go to each CycleGraph. `describe`: the
    graphs made, captured, their replays and checked cycles, added up."""

    def __init__(self, device, what: str, **kwargs):
        self.device, self.what, self.kwargs = torch.device(device), what, kwargs
        self.graphs: dict[tuple, CycleGraph] = {}
        self.members: tuple = ()  # the members of the cycle being launched
        self.totals = Counter()

    def launch(self, key: tuple, members: tuple, cycle: Callable[[tuple], None]) -> None:
        """One cycle(members), through the graph of `key`."""
        self.members = members
        graph = self.graphs.get(key)
        if graph is None:
            if key[0] == "members":  # (those members will not decode together again)
                for old in [k for k in self.graphs if k[0] == "members"]:
                    self.totals.update(figures(self.graphs.pop(old)))
            graph = self.graphs[key] = CycleGraph(lambda: cycle(self.members), self.device,
                                                  self.what, **self.kwargs)
            self.totals["made"] += 1
        graph.launch()

    def close(self) -> None:
        """Every graph's figures into the totals; the graphs are dropped."""
        for graph in self.graphs.values():
            self.totals.update(figures(graph))
        self.graphs.clear()

    def describe(self) -> dict:
        got = Counter(self.totals)
        for graph in self.graphs.values():
            got.update(figures(graph))
        return dict(got)


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


class _Trace(TorchDispatchMode):
    """Every op: its name, then each argument as the cycle's own tensor (by the op that made
    it), an outside tensor (by address, offset, shape, strides, dtype), or its value."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.made: dict[int, int] = {}  # storage address -> the op that made it, this cycle

    def _arg(self, x):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            where = ("made", self.made[ptr]) if ptr in self.made else ("outside", ptr)
            return (*where, x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)
        if isinstance(x, (list, tuple)):
            return tuple(self._arg(y) for y in x)
        if isinstance(x, dict):
            return tuple((k, self._arg(v)) for k, v in sorted(x.items()))
        if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device,
                          torch.layout, torch.memory_format)):
            return x
        return type(x).__name__  # a generator, a process group: the same objects every cycle

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _LIFTS:  # a tensor made of a Python constant (x[i] = False): its value
            entry = (str(func), tuple(a.tolist() for a in args), ())
        else:
            entry = (str(func), self._arg(args), self._arg(kwargs))
        out = func(*args, **kwargs)
        index = len(self.ops)
        self.ops.append(entry)
        for y in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(y, torch.Tensor):
                ptr = y.untyped_storage().data_ptr()
                if not any(ptr == a[1] and a[0] == "outside" for a in _tensors(entry)):
                    self.made[ptr] = index  # a new tensor (not an op writing in place)
        return out


def _tensors(entry):
    """The tensor descriptions in an op's entry."""
    stack = [entry[1], entry[2]]
    while stack:
        x = stack.pop()
        if isinstance(x, tuple) and x and x[0] in ("made", "outside") and len(x) == 6:
            yield x
        elif isinstance(x, tuple):
            stack.extend(x)


def _first_difference(a: list, b: list) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x[0]} then, {y[0]} now ({x[1:]} != {y[1:]})"
    return f"{len(a)} ops then, {len(b)} now"
