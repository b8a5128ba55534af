"""Point-to-point transport: the stores, the process groups, sends and receives with host staging."""
from __future__ import annotations

import datetime
import socket
from typing import NamedTuple

import torch
import torch.distributed as dist

from spd.distributed.config import DistConfig, role_of
from spd.distributed.faults import FaultHandling, Signer, short_error
from spd.distributed.protocol import GLOO_TAGS
from spd.errors import SPDError

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
    """A posted send, waited for once its epoch is old (see Runtime.flush_sends)."""
    work: object
    peer: int
    tensor: torch.Tensor  # kept alive until the send completes
    epoch: int


class Runtime(FaultHandling):
    """One rank's runtime: the stores, its failure handling (FaultHandling) and the process
    groups, with waits that turn a peer's failure into CommError."""

    def __init__(self, rank: int, world: int, config: DistConfig, host: str, port: int,
                 is_master: bool = False, prefix: str = "spd/", secret: str | None = None,
                 launcher_pid: int | None = None):
        """`secret`: the run's secret that signs the records able to stop it (None: unsigned);
        `launcher_pid`: the local launcher (None: the parent process is the launcher)."""
        self.rank, self.world, self.config = rank, world, config
        self.signer = Signer(secret, f"rank {rank} ({role_of(rank)})")
        self.launcher_pid = launcher_pid
        self.op_timeout = _td(config.op_timeout)
        timeout = _td(max(config.op_timeout, 30.0))
        # Two clients: the watchdog must never queue behind a blocking wait of the main thread.
        self.raw_store = (master_store(host, port, timeout) if is_master else
                          dist.TCPStore(host, port, is_master=False, timeout=timeout))
        self.store = dist.PrefixStore(prefix, self.raw_store)
        self.wd_store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                               timeout=timeout))
        self.pg_store = dist.PrefixStore(prefix + "pg/", self.raw_store)
        self._start_fault_handling()
        self.data_group = None
        self.ctrl_group = None
        self.backend = None
        self._outgoing: list[_PendingSend] = []
        self.host_staged = 0  # receives that went through a host buffer

    # process group ---------------------------------------------------------------------------
    def init_groups(self, device: torch.device) -> None:
        backend = self.config.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and not dist.is_nccl_available():
            raise SPDError("NCCL is not available in this torch build: pass backend gloo")
        if not dist.is_gloo_available():
            raise SPDError("this torch build has no gloo backend (needed for the control plane)")
        dist.init_process_group(backend, store=self.pg_store, rank=self.rank,
                                world_size=self.world, timeout=self.op_timeout)
        self.backend = backend
        self.data_group = dist.group.WORLD
        # The units' host headers (protocol) travel on gloo, their payloads on the data group.
        self.ctrl_group = dist.new_group(backend="gloo") if backend != "gloo" else self.data_group

    def close_groups(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # point to point --------------------------------------------------------------------------
    def wait(self, work, peer: int, what: str) -> None:
        try:
            work.wait(self.op_timeout)
        except Exception as exc:
            raise CommError(peer, what, exc) from exc

    def _group(self, tag: int):
        """(the group a tag's messages travel on, whether that group is gloo)."""
        if tag in GLOO_TAGS:
            return self.ctrl_group, True
        return self.data_group, self.backend == "gloo"

    def _through_host(self, tensor, gloo: bool) -> bool:
        """gloo moves host memory only: device tensors go through a host copy."""
        forced = self.config.stage_through_host
        return forced if forced is not None else (tensor.is_cuda and gloo)

    @staticmethod
    def _post(op, tensor, peer: int, group, tag: int, what: str):
        """dist.isend / dist.irecv. gloo raises at posting too when the pair's connection is
        already gone (the peer died): that is a CommError about the peer, like a failed wait,
        not this rank's own failure."""
        try:
            return op(tensor, peer, group=group, tag=tag)
        except RuntimeError as exc:
            raise CommError(peer, what, exc) from exc

    def irecv(self, tensor, src: int, tag: int):
        """A posted receive from rank `src` (every receive names its sender)."""
        group, gloo = self._group(tag)
        if self._through_host(tensor, gloo):
            self.host_staged += 1
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _StagedRecv(self._post(dist.irecv, host, src, group, tag, "posting a receive"),
                               host, tensor)
        return self._post(dist.irecv, tensor, src, group, tag, "posting a receive")

    def isend(self, tensor, dst: int, tag: int, epoch: int = 0) -> None:
        group, gloo = self._group(tag)
        if self._through_host(tensor, gloo):
            tensor = tensor.to("cpu", copy=True)
        work = self._post(dist.isend, tensor, dst, group, tag, "posting a send")
        self._outgoing.append(_PendingSend(work, dst, tensor, epoch))

    def sending(self, tensor: torch.Tensor | None) -> bool:
        """Whether a send from `tensor`'s memory is still pending (not flushed): it must not be
        written (protocol.Ring). A send staged through a host copy is not from it."""
        if tensor is None:
            return False
        ptr = tensor.data_ptr()
        return any(item.tensor.data_ptr() == ptr for item in self._outgoing)

    def flush_sends(self, before: int | None = None) -> None:
        """Wait for the sends of epochs (cycles or units) < before (all when None). Waiting an
        epoch late keeps these waits off the critical path; a buffer is not reused while its
        send is pending (protocol.Ring asks `sending`)."""
        keep = []
        for item in self._outgoing:
            if before is None or item.epoch < before:
                self.wait(item.work, item.peer, "completion of a send")
            else:
                keep.append(item)
        self._outgoing = keep


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
