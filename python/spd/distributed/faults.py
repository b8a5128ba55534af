"""Failures: exit statuses, failure records and blame, SIGTERM from outside, the watchdog.

Requests (prefill header, shutdown) and statistics go through the rendezvous store, so idle ranks
wait there without a communication timeout. Failures: every rank heartbeats into the store; a rank
that raises writes a failure record first; a watchdog thread in every rank exits the process
(naming the failed rank) when a record appears or a heartbeat stops for `fault_timeout` seconds;
a dead peer also breaks gloo's connection, which surfaces at once. Under NCCL a leaving rank
aborts its communicators first (bounded), which ends a kernel waiting on a dead peer. A rank
stopped from outside (SIGTERM: torchrun stops a node's other ranks when one of them fails)
leaves a mark and exits with status 143; the others then blame the rank that failed, not the
ones its launcher stopped.

A rank also watches its launcher (the process that hosts the store: the local launcher, or
torchrun's agent): a guard thread ends the rank with one line when the launcher is gone, or when
the store has not answered for `fault_timeout` seconds (a frozen launcher). A rank that declares
a peer lost kills it when it is a sibling process on this host (a frozen rank cannot act on
anything else), so the run ends within the timeout under torchrun too.

Records that stop a run (failure records, SIGTERM marks, requests) are signed with HMAC-SHA256
under a per-run secret (`Signer`) that reaches the ranks through their environment, never the
store; a record without a valid signature is ignored (and logged once), so whoever reaches the
store's port cannot stop a run or make it blame a rank.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import socket
import sys
import threading
import time

from spd.distributed.config import role_of

HEARTBEAT_DONE = 1 << 40  # added to a rank's heartbeat counter when it finished cleanly
ABORT_BOUND_S = 5.0  # the longest a leaving rank waits for NCCL's communicators to abort

EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_PEER, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


class RankFailedError(RuntimeError):
    """A rank failed (raised, was killed, or stopped responding) and the run was stopped."""

    def __init__(self, rank: int, kind: str, reason: str, exitcodes: dict | None = None):
        self.rank, self.kind, self.reason = rank, kind, reason
        self.exitcodes = exitcodes or {}
        self.stopped_s = 0.0
        super().__init__(describe_failure({"rank": rank, "kind": kind, "error": reason}))


def describe_failure(rec: dict) -> str:
    rank, kind, err = rec.get("rank", -1), rec.get("kind", "error"), rec.get("error", "")
    if rank < 0:
        return f"the launcher stopped the run: {err}"
    verb = {"error": "failed", "input": "failed", "lost": "was lost",
            "killed": "was killed", "exited": "exited"}.get(kind, "failed")
    return f"rank {rank} ({role_of(rank)}) {verb}: {err}"


# --- signed records -------------------------------------------------------------------------------
class Signer:
    """Seals and opens the store records that can stop a run, with HMAC-SHA256 under the run's
    secret (bound to the record's key, so a record cannot be replayed under another key). Without
    a secret (torchrun with no SPD_RUN_SECRET) records are plain and every record is taken."""

    def __init__(self, secret: str | None, who: str = "launcher"):
        self.key = secret.encode() if secret else None
        self.who = who
        self._warned = False

    @property
    def signed(self) -> bool:
        return self.key is not None

    def _mac(self, key: str, body: dict) -> str:
        text = key + "\0" + json.dumps(body, sort_keys=True, separators=(",", ":"))
        return hmac.new(self.key, text.encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, body: dict) -> str:
        if self.key is None:
            return json.dumps(body)
        return json.dumps({"body": body, "mac": self._mac(key, body)})

    def open(self, key: str, raw) -> dict | None:
        """The record's body, or None (logged once) when it is not validly signed."""
        if isinstance(raw, bytes):
            raw = raw.decode(errors="replace")
        try:
            obj = json.loads(raw)
        except ValueError:
            obj = None
        if self.key is None:
            return obj if isinstance(obj, dict) else None
        if (isinstance(obj, dict) and isinstance(obj.get("body"), dict)
                and isinstance(obj.get("mac"), str)
                and hmac.compare_digest(obj["mac"], self._mac(key, obj["body"]))):
            return obj["body"]
        if not self._warned:
            self._warned = True
            print(f"spd: {self.who}: ignoring a record in the rendezvous store ({key}) that is "
                  "not signed with this run's secret (written by a process outside the run)",
                  file=sys.stderr, flush=True)
        return None


# --- failure records in the store ---------------------------------------------------------------
FAIL_KEY = "fail/first"


def write_failure(store, rank: int, kind: str, error: str, reporter: int,
                  signer: Signer) -> dict:
    """First valid writer wins (a forged record in the way is replaced); returns the record
    that is in the store afterwards."""
    rec = {"rank": rank, "kind": kind, "error": error, "reporter": reporter}
    sealed = signer.seal(FAIL_KEY, rec)
    try:
        cur = store.compare_set(FAIL_KEY, "", sealed)
        for _ in range(5):
            got = signer.open(FAIL_KEY, cur)
            if got is not None:
                return got
            cur = store.compare_set(FAIL_KEY, cur, sealed)  # replace the forged record
    except Exception:  # the store is gone: keep our own view
        pass
    return rec


def read_failure(store, signer: Signer) -> dict | None:
    """The run's failure record; None when there is none or it is not validly signed."""
    if not store.check([FAIL_KEY]):
        return None
    return signer.open(FAIL_KEY, store.get(FAIL_KEY))


def term_key(rank: int) -> str:
    return f"term/{rank}"


def was_terminated(store, rank: int, signer: Signer) -> bool:
    """Whether `rank` left because of a SIGTERM from outside (its launcher, most often because
    another rank on its node failed): a symptom, not the failure to report."""
    try:
        if not store.check([term_key(rank)]):
            return False
        if not signer.signed:  # unsigned run: any mark counts
            return True
        return signer.open(term_key(rank), store.get(term_key(rank))) is not None
    except Exception:
        return False


# --- processes: the launcher, sibling ranks -------------------------------------------------------
def proc_state(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) from /proc; None when there is no such
    process (Linux; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[19])


def host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def short_error(exc: BaseException) -> str:
    """First line of an error, without gloo's source-location prefix (C++ stack frames and the
    rest of a multi-line message are dropped)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:300]


class FaultHandling:
    """Runtime's failure handling: heartbeat, reporting, leaving, SIGTERM, blame, the launcher
    guard. Runtime sets rank, world, config, store, wd_store, signer and launcher_pid (None: the
    parent process, as under torchrun), then calls `_start_fault_handling`."""

    def _start_fault_handling(self) -> None:
        self._exit_lock = threading.Lock()
        self._exiting = False
        # called as hook(message) just before the process leaves (a server fails its request)
        self.exit_hooks: list = []
        self._parent = os.getppid()
        self._store_ok = time.monotonic()  # last answer of the store to the watchdog
        self._siblings: dict[int, dict] = {}
        for r in range(self.world):
            self.store.add(f"hb/{r}", 0)
        me = proc_state(os.getpid())
        self.store.set(proc_key(self.rank), self.signer.seal(proc_key(self.rank), {
            "host": host_id(), "pid": os.getpid(), "start": me[2] if me else -1}))
        self.store.add(f"hb/{self.rank}", 1)
        self._term_fd = self._catch_sigterm()
        self.watchdog = _Watchdog(self)
        self.guard = _LauncherGuard(self)
        self.watchdog.start()
        self.guard.start()

    def report(self, kind: str, error: str, rank: int | None = None) -> dict:
        return write_failure(self.store, self.rank if rank is None else rank, kind, error,
                             self.rank, self.signer)

    def exit_now(self, code: int, message: str | None) -> None:
        """Print once and leave at once (other threads may be blocked inside gloo)."""
        with self._exit_lock:
            if self._exiting:
                return
            self._exiting = True
        if message:
            # One write per line: ranks share the launcher's stderr, and print() writes the
            # text and its newline apart, so two ranks' lines could run together.
            line = f"spd: rank {self.rank} ({role_of(self.rank)}): {message}\n"
            try:
                sys.stderr.flush()
                os.write(sys.stderr.fileno(), line.encode(errors="replace"))
            except (OSError, ValueError):
                print(line, end="", file=sys.stderr)
        for hook in self.exit_hooks:
            try:
                hook(message or f"rank {self.rank} is stopping")
            except Exception:  # noqa: BLE001 - leaving regardless
                pass
        self.abort_communicators()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    def abort_communicators(self, bound_s: float | None = None) -> bool:
        """Under NCCL, aborts this process's communicators before it leaves: a kernel waiting
        in a receive from a dead peer (posted eagerly or replayed from a CUDA graph) spins on
        the device until ncclCommAbort, and a process may not finish leaving while it does.
        The abort runs on a thread of its own for at most `bound_s` seconds, so a hanging
        abort delays the exit, never stops it. gloo needs none: a dead peer closes its socket,
        and os._exit ends a rank blocked in gloo. -> whether an abort finished in time."""
        if getattr(self, "backend", None) != "nccl":
            return False
        done = threading.Event()

        def abort():
            try:
                from torch.distributed.distributed_c10d import _abort_process_group
                _abort_process_group()  # every group of this process, in one NCCL group
            except Exception:  # noqa: BLE001 - leaving regardless
                pass
            done.set()

        threading.Thread(target=abort, name="spd-abort-nccl", daemon=True).start()
        return done.wait(ABORT_BOUND_S if bound_s is None else bound_s)

    # the launcher ----------------------------------------------------------------------------
    def launcher_name(self) -> str:
        if self.launcher_pid is not None:
            return f"the launcher (pid {self.launcher_pid})"
        return f"the launcher (parent process {self._parent}, e.g. torchrun's agent)"

    def launcher_gone(self) -> bool:
        """Whether the process that started this rank has died (self-launch: the launcher;
        otherwise the parent, e.g. torchrun's agent: this rank was re-parented)."""
        if self.launcher_pid is None:
            return os.getppid() != self._parent
        if not os.path.isdir("/proc"):
            try:
                os.kill(self.launcher_pid, 0)
            except ProcessLookupError:
                return True
            except OSError:
                pass
            return False
        st = proc_state(self.launcher_pid)
        return st is None or st[0] in "ZXx"

    def leave_if_launcher_gone(self, settle: float = 0.0) -> None:
        """Exit with one line when the launcher is gone (polling up to `settle` seconds: its
        sockets close a moment before it is reaped)."""
        deadline = time.monotonic() + settle
        while True:
            if self.launcher_gone():
                self.exit_now(EXIT_PEER, f"stopping: {self.launcher_name()} is gone (killed or "
                                         "crashed), so the run cannot go on")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)  # polling another process's state

    def store_silent(self, silent_s: float) -> None:
        """The store has not answered the watchdog for `silent_s` seconds: leave."""
        st = proc_state(self.launcher_pid) if self.launcher_pid is not None else None
        frozen = " (frozen: stopped by a signal)" if st is not None and st[0] in "Tt" else \
            " (frozen or unreachable)"
        self.exit_now(EXIT_PEER, f"stopping: {self.launcher_name()} is not answering: the "
                                 f"rendezvous store it hosts has been silent for {silent_s:.0f} s"
                                 f"{frozen}")

    # SIGTERM from outside ----------------------------------------------------------------------
    def _catch_sigterm(self) -> int | None:
        """Turn SIGTERM into `terminated()`. The main thread may sit inside gloo for long, where
        no Python handler runs, so the signal also wakes a pipe that the guard thread reads.
        Only in a process's main thread, and never over a handler someone else installed.
        Returns the pipe's read end (None: not installed)."""
        if (threading.current_thread() is not threading.main_thread()
                or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
            return None
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            signal.set_wakeup_fd(w)
            signal.signal(signal.SIGTERM, lambda *_: self.terminated(self.store))
        except (ValueError, OSError):
            os.close(r)
            os.close(w)
            return None
        return r

    def sigterm_pending(self) -> bool:
        """Whether SIGTERM arrived (read by the guard thread)."""
        if self._term_fd is None:
            return False
        try:
            data = os.read(self._term_fd, 64)
        except (BlockingIOError, OSError):
            return False
        return signal.SIGTERM in data

    def terminated(self, store) -> None:
        """Stopped from outside: mark it for the other ranks, then leave (status 143). The mark
        is bounded: a frozen store must not keep this rank alive. A SIGTERM that comes because
        the launcher died (the parent-death signal) says so instead."""
        self.leave_if_launcher_gone()
        def mark():
            try:
                store.set(term_key(self.rank), self.signer.seal(term_key(self.rank),
                                                                {"rank": self.rank}))
            except Exception:
                pass  # the store is gone: the others find out through their own watchdogs
        th = threading.Thread(target=mark, daemon=True)
        th.start()
        th.join(1.0)
        self.exit_now(EXIT_TERMINATED, "stopped by SIGTERM (its launcher or the system)")

    # blame -------------------------------------------------------------------------------------
    def blame_after_comm_error(self, exc, first_wait: float) -> dict:
        """The failure record to stop for after a failed wait on `exc.peer` (`exc`: a
        transport.CommError). A rank that fails records why before it exits, so the record is
        normally there within `first_wait`; else the peer went silent. A peer its launcher
        stopped (SIGTERM mark) is a symptom of a failure elsewhere, so the watchdogs get a fault
        timeout to name the rank that went silent first; only then is the peer itself named.
        A connection that broke because the launcher is gone (its ranks die with it) is no
        peer's fault: this rank then leaves with that one line."""
        self.leave_if_launcher_gone(settle=0.2)
        rec = self.wait_for_failure(first_wait)
        if rec is None and was_terminated(self.store, exc.peer, self.signer):
            rec = self.wait_for_failure(self.config.fault_timeout + 2.0)
            if rec is None:
                return self.report("killed", "stopped by SIGTERM from outside (its launcher or "
                                             "the system)", rank=exc.peer)
        if rec is None:
            self.leave_if_launcher_gone(settle=0.3)
            rec = self.report("lost", f"rank {self.rank} lost its connection while waiting for "
                                      f"the {exc.what}: {exc.cause}", rank=exc.peer)
        return rec

    def stop_for(self, rec: dict, store=None) -> None:
        """Leave because of someone else's failure record (a lost peer on this host is killed
        first: a frozen process cannot leave by itself)."""
        if rec.get("kind") == "interrupted":
            self.exit_now(EXIT_INTERRUPTED, None)
        if rec.get("kind") == "lost" and rec.get("rank", -1) >= 0 and rec["rank"] != self.rank:
            self.kill_if_sibling(int(rec["rank"]), self.store if store is None else store)
        self.exit_now(EXIT_PEER, f"stopping: {describe_failure(rec)}")

    def kill_if_sibling(self, rank: int, store) -> bool:
        """SIGKILL rank `rank` if it runs on this host as a sibling of this process (same parent:
        the launcher's fork server, torchrun's agent) and is the process it registered."""
        try:
            if not store.check([proc_key(rank)]):
                return False
            info = self.signer.open(proc_key(rank), store.get(proc_key(rank)))
        except Exception:
            return False
        if not info or info.get("host") != host_id():
            return False
        pid = int(info.get("pid", -1))
        st = proc_state(pid)
        if pid <= 1 or pid == os.getpid() or st is None or st[1] != os.getppid() \
                or st[2] != info.get("start"):
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return False
        return True

    def wait_for_failure(self, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                rec = read_failure(self.store, self.signer)
            except Exception:
                self.leave_if_launcher_gone(settle=0.3)
                return None
            if rec is not None or time.monotonic() >= deadline:
                return rec
            time.sleep(0.05)  # polling a store for another process's record, not synchronising

    def finish(self) -> None:
        self.watchdog.stop()
        self.guard.stop()
        if self._term_fd is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no guard to act on it any more
            signal.set_wakeup_fd(-1)
        try:
            self.store.add(f"hb/{self.rank}", HEARTBEAT_DONE)
        except Exception:
            pass


def proc_key(rank: int) -> str:
    return f"proc/{rank}"


class _RankThread(threading.Thread):
    """A daemon thread of a rank that wakes every watchdog interval until stopped."""

    def __init__(self, rt: FaultHandling, name: str):
        super().__init__(name=f"spd-{name}-{rt.rank}", daemon=True)
        self.rt = rt
        self.interval = watchdog_interval(rt.config.fault_timeout)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)


class _Watchdog(_RankThread):
    """Heartbeats into the store and stops this process when another rank failed or went silent."""

    def __init__(self, rt: FaultHandling):
        super().__init__(rt, "watchdog")

    def run(self) -> None:
        rt, store = self.rt, self.rt.wd_store
        keys = [f"hb/{r}" for r in range(rt.world)]
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop_event.is_set():
            try:
                store.add(f"hb/{rt.rank}", 1)
                rec = read_failure(store, rt.signer)
                values = store.multi_get(keys)
            except Exception as exc:
                if self._stop_event.is_set():
                    return
                rt.leave_if_launcher_gone(settle=0.5)
                rt.exit_now(EXIT_PEER, "stopping: lost the rendezvous store (its host, the "
                                       f"launcher or torchrun's node 0, is gone): "
                                       f"{short_error(exc)}")
                return
            rt._store_ok = time.monotonic()
            if rec is not None and not (rec.get("rank") == rt.rank
                                        and rec.get("reporter") == rt.rank):
                rt.stop_for(rec, store)
            now = time.monotonic()
            for r, raw in enumerate(values):
                count = int(raw)
                if r == rt.rank or count == 0 or count >= HEARTBEAT_DONE:
                    continue  # not started yet (covered by the init timeout), or finished
                last = seen.get(r)
                if last is None or last[0] != count:
                    seen[r] = (count, now)
                elif now - last[1] > rt.config.fault_timeout:
                    # a rank its launcher stopped is named only if no other verdict comes
                    if (now - last[1] <= 2 * rt.config.fault_timeout
                            and was_terminated(store, r, rt.signer)):
                        continue
                    rec = write_failure(store, r, "lost",
                                        f"no heartbeat for {rt.config.fault_timeout:g} s "
                                        "(killed, crashed or frozen)", rt.rank, rt.signer)
                    rt.stop_for(rec, store)
            self._stop_event.wait(self.interval)


def watchdog_interval(fault_timeout: float) -> float:
    """How often a rank heartbeats and looks at the store (and its guard at the launcher)."""
    return max(0.05, min(1.0, fault_timeout / 10))


class _LauncherGuard(_RankThread):
    """Never touches the store, so it cannot block: ends the rank when SIGTERM arrived (the main
    thread may be inside gloo), when the launcher is gone, or when the store has not answered
    the watchdog for `fault_timeout` seconds (its host, the launcher, is frozen)."""

    def __init__(self, rt: FaultHandling):
        super().__init__(rt, "guard")

    def run(self) -> None:
        rt = self.rt
        while not self._stop_event.wait(self.interval):
            if rt.sigterm_pending():
                rt.terminated(rt.wd_store)
                return
            rt.leave_if_launcher_gone()
            silent = time.monotonic() - rt._store_ok
            if silent > rt.config.fault_timeout:
                rt.store_silent(silent)
                return


def inject_fault(fault: dict) -> None:
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at cycle {fault['cycle']}")
