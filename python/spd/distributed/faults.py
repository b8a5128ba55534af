"""Failures: exit statuses, failure records and blame, SIGTERM from outside, the watchdog.

Requests (prefill header, shutdown) and statistics go through the rendezvous store, so idle ranks
wait there without a communication timeout. Failures: every rank heartbeats into the store; a rank
that raises writes a failure record first; a watchdog thread in every rank exits the process
(naming the failed rank) when a record appears or a heartbeat stops for `fault_timeout` seconds;
a dead peer also breaks gloo's connection, which surfaces at once. A rank stopped from outside
(SIGTERM: torchrun stops a node's other ranks when one of them fails) leaves a mark and exits with
status 143; the others then blame the rank that failed, not the ones its launcher stopped.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from spd.distributed.config import role_of

HEARTBEAT_DONE = 1 << 40  # added to a rank's heartbeat counter when it finished cleanly

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


# --- failure records in the store ---------------------------------------------------------------
FAIL_KEY = "fail/first"


def write_failure(store, rank: int, kind: str, error: str, reporter: int) -> dict:
    """First writer wins; returns the record that is in the store afterwards."""
    rec = json.dumps({"rank": rank, "kind": kind, "error": error, "reporter": reporter})
    try:
        return json.loads(store.compare_set(FAIL_KEY, "", rec))
    except Exception:  # the store is gone: keep our own view
        return json.loads(rec)


def read_failure(store) -> dict | None:
    if not store.check([FAIL_KEY]):
        return None
    return json.loads(store.get(FAIL_KEY))


def term_key(rank: int) -> str:
    return f"term/{rank}"


def was_terminated(store, rank: int) -> bool:
    """Whether `rank` left because of a SIGTERM from outside (its launcher, most often because
    another rank on its node failed): a symptom, not the failure to report."""
    try:
        return bool(store.check([term_key(rank)]))
    except Exception:
        return False


def short_error(exc: BaseException) -> str:
    """First line of an error, without gloo's source-location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text[:300]


class FaultHandling:
    """Runtime's failure handling: heartbeat, reporting, leaving, SIGTERM, blame. Runtime sets
    rank, world, config, store and wd_store, then calls `_start_fault_handling`."""

    def _start_fault_handling(self) -> None:
        self._exit_lock = threading.Lock()
        self._exiting = False
        for r in range(self.world):
            self.store.add(f"hb/{r}", 0)
        self.store.add(f"hb/{self.rank}", 1)
        self._term_fd = self._catch_sigterm()
        self.watchdog = _Watchdog(self)
        self.watchdog.start()

    def report(self, kind: str, error: str, rank: int | None = None) -> dict:
        return write_failure(self.store, self.rank if rank is None else rank, kind, error,
                             self.rank)

    def exit_now(self, code: int, message: str | None) -> None:
        """Print once and leave at once (other threads may be blocked inside gloo)."""
        with self._exit_lock:
            if self._exiting:
                return
            self._exiting = True
        if message:
            print(f"spd: rank {self.rank} ({role_of(self.rank)}): {message}", file=sys.stderr)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)

    def _catch_sigterm(self) -> int | None:
        """Turn SIGTERM into `terminated()`. The main thread may sit inside gloo for long, where
        no Python handler runs, so the signal also wakes a pipe that the watchdog thread reads.
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
        """Whether SIGTERM arrived (read by the watchdog thread)."""
        if self._term_fd is None:
            return False
        try:
            data = os.read(self._term_fd, 64)
        except (BlockingIOError, OSError):
            return False
        return signal.SIGTERM in data

    def terminated(self, store) -> None:
        """Stopped from outside: mark it for the other ranks, then leave (status 143)."""
        try:
            store.set(term_key(self.rank), "1")
        except Exception:
            pass  # the store is gone: the others find out through their own watchdogs
        self.exit_now(EXIT_TERMINATED, "stopped by SIGTERM (its launcher or the system)")

    def blame_after_comm_error(self, exc, first_wait: float) -> dict:
        """The failure record to stop for after a failed wait on `exc.peer` (`exc`: a
        transport.CommError). A rank that fails records why before it exits, so the record is
        normally there within `first_wait`; else the peer went silent. A peer its launcher
        stopped (SIGTERM mark) is a symptom of a failure elsewhere, so the watchdogs get a fault
        timeout to name the rank that went silent first; only then is the peer itself named."""
        rec = self.wait_for_failure(first_wait)
        if rec is None and was_terminated(self.store, exc.peer):
            rec = self.wait_for_failure(self.config.fault_timeout + 2.0)
            if rec is None:
                return self.report("killed", "stopped by SIGTERM from outside (its launcher or "
                                             "the system)", rank=exc.peer)
        if rec is None:
            rec = self.report("lost", f"rank {self.rank} lost its connection while waiting for "
                                      f"the {exc.what}: {exc.cause}", rank=exc.peer)
        return rec

    def stop_for(self, rec: dict) -> None:
        """Leave because of someone else's failure record."""
        if rec.get("kind") == "interrupted":
            self.exit_now(EXIT_INTERRUPTED, None)
        self.exit_now(EXIT_PEER, f"stopping: {describe_failure(rec)}")

    def wait_for_failure(self, seconds: float) -> dict | None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                rec = read_failure(self.store)
            except Exception:
                return None
            if rec is not None or time.monotonic() >= deadline:
                return rec
            time.sleep(0.05)  # polling a store for another process's record, not synchronising

    def finish(self) -> None:
        self.watchdog.stop()
        if self._term_fd is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # no watchdog to act on it any more
            signal.set_wakeup_fd(-1)
        try:
            self.store.add(f"hb/{self.rank}", HEARTBEAT_DONE)
        except Exception:
            pass


class _Watchdog(threading.Thread):
    """Heartbeats into the store and stops this process when another rank failed or went silent."""

    def __init__(self, rt: FaultHandling):
        super().__init__(name=f"spd-watchdog-{rt.rank}", daemon=True)
        self.rt = rt
        self.interval = max(0.05, min(1.0, rt.config.fault_timeout / 10))
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5)

    def run(self) -> None:
        rt, store = self.rt, self.rt.wd_store
        keys = [f"hb/{r}" for r in range(rt.world)]
        seen: dict[int, tuple[int, float]] = {}
        while not self._stop_event.is_set():
            if rt.sigterm_pending():  # the main thread may be stuck inside gloo
                rt.terminated(store)
                return
            try:
                store.add(f"hb/{rt.rank}", 1)
                rec = read_failure(store)
                values = store.multi_get(keys)
            except Exception as exc:
                if self._stop_event.is_set():
                    return
                rt.exit_now(EXIT_PEER, f"stopping: lost the rendezvous store (its host, the "
                                       f"launcher or torchrun's node 0, is gone): {exc}")
                return
            if rec is not None and not (rec.get("rank") == rt.rank
                                        and rec.get("reporter") == rt.rank):
                rt.stop_for(rec)
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
                            and was_terminated(store, r)):
                        continue
                    rec = write_failure(store, r, "lost",
                                        f"no heartbeat for {rt.config.fault_timeout:g} s "
                                        "(killed, crashed or frozen)", rt.rank)
                    rt.stop_for(rec)
            self._stop_event.wait(self.interval)


def inject_fault(fault: dict) -> None:
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at cycle {fault['cycle']}")
