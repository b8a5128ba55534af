"""Point-to-point transport: the stores, the process groups, sends and receives with host staging."""
from __future__ import annotations

import datetime
import socket
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from spd.distributed.config import DistConfig, role_of
from spd.distributed.faults import FaultHandling, Signer, short_error
from spd.errors import InternalError, SPDError

# The listening sockets of the store servers this process hosts: the server uses the descriptor,
# so the socket must outlive it (for the process's life; one per launch).
_LISTENERS: list[socket.socket] = []


def master_store(host: str, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store's server, listening on `host` only. TCPStore alone listens on every
    interface whatever address it is given, so anyone who reached the port could stop a run or
    blame a rank; here it takes a socket bound to the master address (loopback for one node).
    port 0 picks a free port (the store's .port). OSError when the address cannot be bound."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        store = dist.TCPStore(host, sock.getsockname()[1], is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    _LISTENERS.append(sock)
    return store


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


class CommError(RuntimeError):
    """A point-to-point wait failed (peer gone, or no message within the op timeout)."""

    def __init__(self, peer: int, what: str, cause: BaseException):
        self.peer, self.what, self.cause = peer, what, short_error(cause)
        super().__init__(f"{what} with rank {peer} ({role_of(peer)}) failed: {self.cause}")


class _PendingSend(NamedTuple):
    """A posted send, waited for by Endpoint.flush_sends."""
    work: object
    peer: int
    tensor: torch.Tensor | None  # kept alive until the send completes (None: a group's,
    # whose buffers their owner keeps)


class Runtime(FaultHandling):
    """One rank's runtime: the stores, its failure handling (FaultHandling) and the process
    groups, with waits that turn a peer's failure into CommError."""

    def __init__(self, rank: int, world: int, config: DistConfig, host: str, port: int,
                 is_master: bool = False, prefix: str = "spd/", secret: str | None = None,
                 launcher_pid: int | None = None):
        """`secret`: the run's secret that signs the records able to stop it (None: unsigned);
        `launcher_pid`: the local launcher (None: the parent process is the launcher)."""
        self.rank, self.world, self.config = rank, world, config
        self.signer = Signer(secret, f"rank {rank} ({config.placement.describe(rank)})")
        self.launcher_pid = launcher_pid
        self.op_timeout = _td(config.op_timeout)
        timeout = _td(max(config.op_timeout, 30.0))
        # Two clients: the watchdog must never queue behind a blocking wait of the main thread.
        self.raw_store = (master_store(host, port, timeout) if is_master else
                          dist.TCPStore(host, port, is_master=False, timeout=timeout))
        self.store = dist.PrefixStore(prefix, self.raw_store)
        self._client = lambda: dist.PrefixStore(prefix, dist.TCPStore(  # noqa: E731
            host, port, is_master=False, timeout=timeout))
        self.wd_store = self._client()
        self.pg_store = dist.PrefixStore(prefix + "pg/", self.raw_store)
        self._start_fault_handling()
        self.placement = config.placement
        self.data_group = None
        self.backend = None
        self.host_staged = 0  # receives that went through a host buffer

    # process group ---------------------------------------------------------------------------
    def init_groups(self, device: torch.device) -> None:
        backend = self.config.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and not dist.is_nccl_available():
            raise SPDError("NCCL is not available in this torch build: pass backend gloo")
        if backend == "gloo" and not dist.is_gloo_available():
            raise SPDError("this torch build has no gloo backend")
        dist.init_process_group(backend, store=self.pg_store, rank=self.rank,
                                world_size=self.world, timeout=self.op_timeout)
        self.backend = backend
        self.data_group = dist.group.WORLD

    def endpoint(self) -> "Endpoint":
        """This process's messages (Placement: the roles it runs)."""
        return Endpoint(self, self.placement.roles_of(self.rank)[0], self.store)

    def close_groups(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Endpoint:
    """A process's point-to-point messages, addressed by role (config.Placement: 0 the draft
    rank, s + 1 stage s), which it maps to processes. Also the role's view of the run (rank =
    its first role, world = the roles; store, signer, config and backend are the process's)."""

    def __init__(self, rt: Runtime, role: int, store):
        self.rt, self.rank, self.store = rt, role, store
        self.world = rt.placement.roles
        self.config, self.signer, self.backend = rt.config, rt.signer, rt.backend  # (groups made)
        self._outgoing: list[_PendingSend] = []
        # messages posted, by (direction, group): "send" / "recv", "data"
        self.messages: Counter[tuple[str, str]] = Counter()

    @property
    def host_staged(self) -> int:
        return self.rt.host_staged

    def fault_here(self) -> dict | None:
        """The test hook's fault (DistConfig.fault) when it names this process and this role
        (its "role", by default the process's first)."""
        fault, rt = self.rt.config.fault, self.rt
        if not fault or fault["rank"] != rt.rank:
            return None
        return fault if fault.get("role", rt.placement.roles_of(rt.rank)[0]) == self.rank else None

    def _process(self, peer: int) -> int:
        """The process of role `peer` (never this one: a process runs its roles' messages
        between them itself)."""
        p = self.rt.placement.process_of(peer)
        if p == self.rt.rank:
            raise InternalError("a message to a role of this process", role=self.rank, peer=peer)
        return p

    def _through_host(self, tensor, gloo: bool) -> bool:
        """gloo moves host memory only: device tensors go through a host copy."""
        forced = self.rt.config.stage_through_host
        return forced if forced is not None else (tensor.is_cuda and gloo)

    @staticmethod
    def _post(op, tensor, process: int, group, tag: int, what: str):
        """dist.isend / dist.irecv. gloo raises at posting too when the pair's connection is
        already gone (the peer died): that is a CommError about the peer, like a failed wait,
        not this rank's own failure."""
        try:
            return op(tensor, process, group=group, tag=tag)
        except RuntimeError as exc:
            raise CommError(process, what, exc) from exc

    def wait(self, work, peer: int, what: str) -> None:
        """Wait for a posted message of role `peer` (CommError names its process)."""
        try:
            work.wait(self.rt.op_timeout)
        except Exception as exc:
            raise CommError(self.rt.placement.process_of(peer), what, exc) from exc

    def order(self, work, peer: int, what: str) -> None:
        """What follows on the current stream comes after a posted message. Under NCCL that is
        `work.wait()` with no timeout: the stream waits, the host does not (torch's Work.wait
        blocks the host until the message is in when given a timeout, as `wait` gives one). On
        gloo the message is host memory: the host waits, as in `wait`."""
        if self.rt.backend == "nccl" and not isinstance(work, _StagedRecv):
            try:
                work.wait()
            except Exception as exc:
                raise CommError(self.rt.placement.process_of(peer), what, exc) from exc
            return
        self.wait(work, peer, what)

    def irecv(self, tensor, src: int, tag: int):
        """A posted receive from role `src` (every receive names its sender)."""
        process = self._process(src)
        group, gloo = self.rt.data_group, self.rt.backend == "gloo"
        self.messages["recv", "data"] += 1
        if self._through_host(tensor, gloo):
            self.rt.host_staged += 1
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _StagedRecv(self._post(dist.irecv, host, process, group, tag,
                                          "posting a receive"), host, tensor)
        return self._post(dist.irecv, tensor, process, group, tag, "posting a receive")

    def isend(self, tensor, dst: int, tag: int) -> None:
        process = self._process(dst)
        group, gloo = self.rt.data_group, self.rt.backend == "gloo"
        self.messages["send", "data"] += 1
        if self._through_host(tensor, gloo):
            tensor = tensor.to("cpu", copy=True)
        work = self._post(dist.isend, tensor, process, group, tag, "posting a send")
        self._outgoing.append(_PendingSend(work, process, tensor))

    def exchange(self, sends: list, recvs: list) -> list:
        """Posts sends [(tensor, dst role, tag)] and receives [(tensor, src role, tag)] at once
        -> the receives' works, in order (`order` each; `flush_sends` the sends). Under NCCL
        they are one group (batch_isend_irecv): NCCL runs its messages in posting order on
        one stream and a send may wait for its peer's receive, so a receive posted after a
        send, as its own operation, could wait on a peer that waits on it. A group's messages
        progress together. (The group's communicator is made by the first group on it, which
        every process must post: each rank posts one in cycle 0.)"""
        if self.rt.backend != "nccl":
            works = [self.irecv(t, src, tag) for t, src, tag in recvs]
            for t, dst, tag in sends:
                self.isend(t, dst, tag)
            return works
        ops = []
        for (t, peer, tag), op, way in [(m, dist.isend, "send") for m in sends] + \
                [(m, dist.irecv, "recv") for m in recvs]:
            self.messages[way, "data"] += 1
            ops.append(dist.P2POp(op, t, self._process(peer), self.rt.data_group, tag))
        first = self._process((sends or recvs)[0][1]) if ops else None
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:
            raise CommError(first, "posting messages", exc) from exc
        for work in works:  # the sends complete with the group (NCCL coalesces it: one work)
            self._outgoing.append(_PendingSend(work, first, None))
        return [works[0]] * len(recvs) if len(works) == 1 else works[len(sends):]

    def flush_sends(self, host: bool = True) -> None:
        """Wait for every posted send. host=False under NCCL: the current stream waits, not the
        host (a cycle's buffers are rewritten on that stream, after its sends)."""
        nccl_stream = not host and self.rt.backend == "nccl"
        for item in self._outgoing:
            try:
                item.work.wait() if nccl_stream else item.work.wait(self.rt.op_timeout)
            except Exception as exc:
                raise CommError(item.peer, "completion of a send", exc) from exc
        self._outgoing = []


class _StagedRecv:
    """A receive of a device tensor through a host buffer (gloo moves host memory only): the
    copy to the device happens when it is waited for. This is what lets every rank share one
    GPU with --backend gloo (tests, single-GPU machines); NCCL moves device memory itself."""

    def __init__(self, work, host: torch.Tensor, device_tensor: torch.Tensor):
        self.work, self.host, self.device_tensor = work, host, device_tensor

    def wait(self, timeout=None) -> bool:
        ok = self.work.wait(timeout) if timeout is not None else self.work.wait()
        self.device_tensor.copy_(self.host)
        return ok
