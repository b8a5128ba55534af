"""Point-to-point transport: the stores, the process groups, sends and receives with host staging."""
from __future__ import annotations

import datetime
import socket
import threading
from collections import Counter
from typing import NamedTuple

import torch
import torch.distributed as dist

from spd.distributed.config import DRAFT_RANK, DistConfig, role_name, role_of
from spd.distributed.faults import FaultHandling, Signer, short_error
from spd.distributed.protocol import GLOO_TAGS
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
    """A posted send, waited for once its epoch is old (see Runtime.flush_sends)."""
    work: object
    peer: int
    tensor: torch.Tensor | None  # kept alive until the send completes (None: a group's,
    # whose buffers their owner keeps)
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
        self.ctrl_group = None
        self.draft_groups = None  # (data, control) of the draft rank's messages
        self.backend = None
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
        self.draft_groups = (self.data_group, self.ctrl_group)
        if self.placement.draft_on_stage is not None:
            # Two roles of one process talk to the same peers from two threads: the draft rank's
            # messages get groups of their own, so each (group, pair of processes) carries one
            # role's messages in one order, as NCCL matches a pair's messages in posting order.
            data = dist.new_group(backend=backend)
            self.draft_groups = (data, dist.new_group(backend="gloo") if backend != "gloo"
                                 else data)

    def endpoint(self, role: int, mailbox: "Mailbox | None" = None) -> "Endpoint":
        """Role `role`'s messages from this process (Placement): see Endpoint."""
        roles = self.placement.roles_of(self.rank)
        if role not in roles:
            raise InternalError("a role this process does not run", role=role, rank=self.rank)
        # a second role has a store client of its own: an idle stage blocks in a store wait,
        # which would hold up the other role's requests on a shared client
        return Endpoint(self, role, mailbox, self.store if role == roles[0] else self._client())

    def close_groups(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

class Endpoint:
    """One role's point-to-point messages. The protocol addresses roles (config.Placement: 0 the
    draft rank, s + 1 stage s); an endpoint maps them to processes, and a role this same process
    runs (the draft on a stage) to the in-process Mailbox. It keeps its own pending sends: two
    roles of one process run on two threads. Also the role's view of the run (rank = its role,
    world = the roles; store, signer, config and backend are the process's)."""

    def __init__(self, rt: Runtime, role: int, mailbox: "Mailbox | None", store):
        self.rt, self.rank, self.store = rt, role, store
        self.world = rt.placement.roles
        self.config, self.signer, self.backend = rt.config, rt.signer, rt.backend  # (groups made)
        self.mailbox = mailbox
        self._outgoing: list[_PendingSend] = []
        # messages posted, by (direction, group): "send" / "recv", "data" / "control"
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

    def _process(self, peer: int) -> int | None:
        """The process of role `peer`; None when it is this one (the mailbox carries it)."""
        p = self.rt.placement.process_of(peer)
        if p != self.rt.rank:
            return p
        if self.mailbox is None:
            raise InternalError("a message to a role of this process without a mailbox",
                                role=self.rank, peer=peer)
        return None

    def _group(self, tag: int, peer: int):
        """(the group a message to or from role `peer` travels on, whether it is gloo)."""
        data, ctrl = self.rt.draft_groups if DRAFT_RANK in (self.rank, peer) else \
            (self.rt.data_group, self.rt.ctrl_group)
        if tag in GLOO_TAGS:
            return ctrl, True
        return data, self.rt.backend == "gloo"

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
        if isinstance(work, _LocalRecv):
            work.wait(self.rt.op_timeout.total_seconds(), f"{what} from {role_name(peer)}")
            return
        try:
            work.wait(self.rt.op_timeout)
        except Exception as exc:
            raise CommError(self.rt.placement.process_of(peer), what, exc) from exc

    def order(self, work, peer: int, what: str) -> None:
        """What follows on the current stream comes after a posted message. Under NCCL that is
        `work.wait()` with no timeout: the stream waits, the host does not (torch's Work.wait
        blocks the host until the message is in when given a timeout, as `wait` gives one). On
        gloo and the mailbox the message is host memory: the host waits, as in `wait`."""
        if self.rt.backend == "nccl" and not isinstance(work, (_LocalRecv, _StagedRecv)):
            try:
                work.wait()
            except Exception as exc:
                raise CommError(self.rt.placement.process_of(peer), what, exc) from exc
            return
        self.wait(work, peer, what)

    def irecv(self, tensor, src: int, tag: int):
        """A posted receive from role `src` (every receive names its sender)."""
        process = self._process(src)
        if process is None:
            return self.mailbox.post_recv((src, self.rank, tag), tensor)
        group, gloo = self._group(tag, src)
        self.messages["recv", "control" if tag in GLOO_TAGS else "data"] += 1
        if self._through_host(tensor, gloo):
            self.rt.host_staged += 1
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _StagedRecv(self._post(dist.irecv, host, process, group, tag,
                                          "posting a receive"), host, tensor)
        return self._post(dist.irecv, tensor, process, group, tag, "posting a receive")

    def isend(self, tensor, dst: int, tag: int, epoch: int = 0) -> None:
        process = self._process(dst)
        if process is None:  # copied (or queued to be, on this stream) now: nothing pending
            self.mailbox.send((self.rank, dst, tag), tensor)
            return
        group, gloo = self._group(tag, dst)
        self.messages["send", "control" if tag in GLOO_TAGS else "data"] += 1
        if self._through_host(tensor, gloo):
            tensor = tensor.to("cpu", copy=True)
        work = self._post(dist.isend, tensor, process, group, tag, "posting a send")
        self._outgoing.append(_PendingSend(work, process, tensor, epoch))

    def exchange(self, sends: list, recvs: list, epoch: int = 0) -> list:
        """Posts sends [(tensor, dst role, tag)] and receives [(tensor, src role, tag)] at once
        -> the receives' works, in order (`order` each; `flush_sends` the sends). Under NCCL
        they are one group (batch_isend_irecv): NCCL runs its messages in posting order on
        one stream and a send may wait for its peer's receive, so a receive posted after a
        send, as its own operation, could wait on a peer that waits on it. A group's messages
        progress together. (The group's communicator is made by the first group on it, which
        every process must post: each rank of the device cycle posts one in cycle 0. With the
        draft on a stage the draft's messages have groups of their own, which not every
        process uses: there each message is posted alone, on its pair's own communicator.)"""
        if self.rt.backend != "nccl" or self.rt.placement.draft_on_stage is not None:
            works = [self.irecv(t, src, tag) for t, src, tag in recvs]
            for t, dst, tag in sends:
                self.isend(t, dst, tag, epoch)
            return works
        ops = []
        for (t, peer, tag), op, way in [(m, dist.isend, "send") for m in sends] + \
                [(m, dist.irecv, "recv") for m in recvs]:
            self.messages[way, "data"] += 1
            ops.append(dist.P2POp(op, t, self._process(peer), self._group(tag, peer)[0], tag))
        first = self._process((sends or recvs)[0][1]) if ops else None
        try:
            works = dist.batch_isend_irecv(ops) if ops else []
        except RuntimeError as exc:
            raise CommError(first, "posting messages", exc) from exc
        for work in works:  # the sends complete with the group (NCCL coalesces it: one work)
            self._outgoing.append(_PendingSend(work, first, None, epoch))
        return [works[0]] * len(recvs) if len(works) == 1 else works[len(sends):]

    def sending(self, tensor: torch.Tensor | None) -> bool:
        """Whether a send from `tensor`'s memory is still pending (not flushed): it must not be
        written (protocol.Ring). A send staged through a host copy is not from it."""
        if tensor is None:
            return False
        ptr = tensor.data_ptr()
        return any(item.tensor is not None and item.tensor.data_ptr() == ptr
                   for item in self._outgoing)

    def flush_sends(self, before: int | None = None, host: bool = True) -> None:
        """Wait for the sends of epochs (cycles or units) < before (all when None). Waiting an
        epoch late keeps these waits off the critical path; a buffer is not reused while its
        send is pending (protocol.Ring asks `sending`). host=False under NCCL: the current
        stream waits, not the host (the buffers are rewritten on that stream)."""
        keep = []
        nccl_stream = not host and self.rt.backend == "nccl"
        for item in self._outgoing:
            if before is None or item.epoch < before:
                try:
                    item.work.wait() if nccl_stream else item.work.wait(self.rt.op_timeout)
                except Exception as exc:
                    raise CommError(item.peer, "completion of a send", exc) from exc
            else:
                keep.append(item)
        self._outgoing = keep


class Mailbox:
    """Messages between the two roles of one process (the draft rank and the stage whose device
    it shares), with a process group's matching: per (sender, receiver, tag), the k-th send goes
    to the k-th posted receive, whatever order they are waited in. A send copies into its
    receive's buffer when that is posted already (the steady state: receives are posted ahead),
    else into a copy the receive takes on its wait. On CUDA the copy runs on the sender's
    stream after the receive's posting (an event), and the receiver's stream waits for the copy
    (another): no host synchronisation, as with NCCL."""

    def __init__(self):
        self._cv = threading.Condition()
        self._sent: dict[tuple, int] = {}
        self._posted: dict[tuple, int] = {}
        self._early: dict[tuple, object] = {}   # (key, seq) -> (copy, event): sent first
        self._waiting: dict[tuple, "_LocalRecv"] = {}  # (key, seq) -> posted, not yet sent
        self.failed: str | None = None

    def fail(self, why: str) -> None:
        """The other role stopped: waits raise instead of hanging."""
        with self._cv:
            self.failed = why
            self._cv.notify_all()

    def post_recv(self, key: tuple, tensor: torch.Tensor) -> "_LocalRecv":
        with self._cv:
            seq = self._posted.get(key, 0)
            self._posted[key] = seq + 1
            recv = _LocalRecv(self, tensor)
            early = self._early.pop((key, seq), None)
            if early is not None:
                recv.source = early
            else:
                self._waiting[(key, seq)] = recv
            return recv

    def send(self, key: tuple, tensor: torch.Tensor) -> None:
        with self._cv:
            seq = self._sent.get(key, 0)
            self._sent[key] = seq + 1
            recv = self._waiting.pop((key, seq), None)
            if recv is None:
                self._early[(key, seq)] = (tensor.clone(), _record(tensor))
            else:
                if recv.posted is not None:  # its buffer is free from the receive's posting on
                    torch.cuda.current_stream(tensor.device).wait_event(recv.posted)
                if tuple(recv.tensor.shape) != tuple(tensor.shape):
                    raise InternalError("a local message of another shape than its receive",
                                        key=key, sent=tuple(tensor.shape),
                                        posted=tuple(recv.tensor.shape))
                recv.tensor.copy_(tensor)
                recv.source = (None, _record(tensor))
            self._cv.notify_all()


def _record(tensor: torch.Tensor):
    """An event after the work queued so far on the current stream (CUDA), else None."""
    if not tensor.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class _LocalRecv:
    """A posted receive of the Mailbox."""

    def __init__(self, box: Mailbox, tensor: torch.Tensor):
        self.box, self.tensor = box, tensor
        self.posted = _record(tensor)
        self.source = None  # (the copy to take, or None when written in place; its event)

    def wait(self, timeout_s: float, what: str) -> None:
        with self.box._cv:
            if not self.box._cv.wait_for(lambda: self.source is not None or self.box.failed,
                                         timeout_s):
                raise InternalError(f"no local message for the {what} within {timeout_s:g} s")
            if self.source is None:
                raise InternalError(f"the {what} never came: {self.box.failed}")
        copy, event = self.source
        if event is not None:
            torch.cuda.current_stream(self.tensor.device).wait_event(event)
        if copy is not None:
            self.tensor.copy_(copy)
            if copy.is_cuda:  # freed now: not reused before this stream has read it
                copy.record_stream(torch.cuda.current_stream(copy.device))
            self.source = (None, None)


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
