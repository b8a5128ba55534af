"""EngineWorker: the one thread that owns the backend. Jobs wait for a decode slot (the backend
decodes `slots` at once: one today) and are decoded in order; each new token goes to its
request as a TokenEvent (the id and the text it adds, nothing of a stop string), then a
DoneEvent or an ErrorEvent.

Admission counts every job the worker holds, taken off the queue or not: a job is refused
(QueueFull, a 429) only when `slots` are decoding and `max_queue` wait already. Counting the
queue's length instead would refuse a burst that fits, while the worker has not yet taken the
first job off the queue."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from spd.errors import InternalError, SPDError
from spd.runtime.text import TextPieces
from spd.serve.backends import DecodeCancelled, RankFailure
from spd.serve.jobs import Job

log = logging.getLogger("spd.serve")


@dataclass
class TokenEvent:
    token_id: int
    text: str       # the text it adds (may be empty: a partial character, held-back text)


@dataclass
class DoneEvent:
    result: object  # GenerationResult
    tail: str       # text held back until the end (never part of a stop string)


@dataclass
class ErrorEvent:
    status: int
    message: str


class QueueFull(Exception):
    pass


class EngineWorker:
    """Call `run()` on the thread that owns the backend (it returns after `stop()` or a fatal
    backend error, which `on_fatal(message)` is told); `submit` from any thread."""

    def __init__(self, backend, max_queue: int = 16,
                 on_fatal: Callable[[str], None] | None = None):
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise SPDError(f"max_queue is a number of requests >= 0, got {max_queue!r}")
        self.backend = backend
        self.slots = getattr(backend, "slots", 1)  # jobs decoded at once
        # join / step / leave for several slots, or where the backend says so (a session on
        # the ranks of one slot), else one `generate` a job
        self.batched = self.slots > 1 or bool(getattr(backend, "batched", False))
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._held = 0  # jobs submitted and not finished (waiting or decoding)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.on_fatal = on_fatal
        self.fatal_error: str | None = None
        self.counts = {"served": 0, "cancelled": 0, "failed": 0}
        self._active: dict[int, tuple] = {}  # a batched backend's jobs in their slots, by id
        self.busy = False
        self._current: Job | None = None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stop.is_set():
                raise QueueFull("the server is stopping")
            if self._held >= self.max_queue + self.slots:
                raise QueueFull(f"{self.max_queue} requests are waiting already")
            self._held += 1
            self._queue.put_nowait(job)  # (under the lock: a stopping worker drains it)

    def _release(self) -> None:
        """A job the worker held is finished (served, failed, cancelled or drained)."""
        with self._lock:
            self._held -= 1

    def stop(self) -> None:
        self._stop.set()

    @property
    def queued(self) -> int:
        """Jobs waiting for a slot."""
        with self._lock:
            return max(self._held - self.slots_in_use, 0)

    @property
    def slots_in_use(self) -> int:
        return len(self._active) if self.batched else int(self.busy)

    def run(self) -> None:
        if self.batched:
            return self._run_batched()
        try:
            while not self._stop.is_set():
                try:
                    job = self._queue.get(timeout=0.2)
                except queue.Empty:
                    continue
                self.busy = True  # it holds the slot from here on, no longer waiting
                try:
                    self._run_job(job)
                finally:
                    self.busy, self._current = False, None
                    self._release()
        finally:
            self._stop.set()
            self._drain()

    def _drain(self) -> None:
        """Jobs still queued when the worker stops get a 503."""
        why = self.fatal_error or "the server is stopping"
        with self._lock:  # a submit under way has queued its job, later ones are refused
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    return
                self._release()
                job.emit(ErrorEvent(503, why))

    def _run_job(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while it waited
            self.counts["cancelled"] += 1
            return
        # (stop strings were checked when the job was made)
        pieces = TextPieces(self.backend.target.tokenizer, tuple(job.stop or ()))
        count = 0

        def on_token(token: int) -> None:
            nonlocal count
            count += 1
            job.emit(TokenEvent(token, pieces.add(token)))

        t0 = time.perf_counter()
        self._current = job
        try:
            result = self.backend.generate(job, on_token)
        except DecodeCancelled:
            self.counts["cancelled"] += 1
            log.info("%s cancelled (client left) after %d tokens, %.2f s", job.id, count,
                     time.perf_counter() - t0)
            return
        except Exception as exc:
            self._failed(job, exc)
            return
        self._done(job, result, pieces, t0)

    def _failed(self, job: Job, exc: Exception) -> None:
        """`job` failed with `exc`: its error event (400 the request's fault, 500 the engine's),
        or, where the backend cannot serve again, the server stops."""
        if isinstance(exc, SPDError):  # the request's fault
            self.counts["failed"] += 1
            job.emit(ErrorEvent(400, str(exc)))
        elif isinstance(exc, InternalError):  # the engine's fault: logged with its context
            self.counts["failed"] += 1
            log.error("%s failed inside the engine: %s; context %s", job.id, exc.message,
                      exc.context, exc_info=exc)
            job.emit(ErrorEvent(500, f"internal error: {exc}"))
        elif isinstance(exc, self.backend.fatal):
            self._fail(job, str(exc) if isinstance(exc, RankFailure)
                       else f"{type(exc).__name__}: {exc}")
        else:  # a bug: this request fails, the next one starts afresh
            self.counts["failed"] += 1
            log.error("%s failed", job.id, exc_info=exc)
            job.emit(ErrorEvent(500, f"internal error: {type(exc).__name__}: {exc}"))

    def _done(self, job: Job, result, pieces: TextPieces, t0: float) -> None:
        if job.cancel.is_set():
            self.counts["cancelled"] += 1
        else:
            self.counts["served"] += 1
        job.emit(DoneEvent(result, pieces.rest(result.text)))
        st = result.stats
        log.info("%s prompt=%d new=%d finish=%s time=%.2f s (queued %.2f s) %s", job.id,
                 len(job.prompt_ids), len(result.token_ids), result.finish_reason,
                 time.perf_counter() - t0, t0 - job.queued_at, st.summary())

    # --- a batched backend: up to `slots` jobs decode together ----------------------------------
    def _run_batched(self) -> None:
        """Between steps: jobs join free slots (their prefill and first token), jobs whose
        client left leave theirs; then one step for every job in a slot."""
        try:
            while not self._stop.is_set():
                self._admit()
                self.busy = bool(self._active)
                for key, (job, seq, _, t0) in list(self._active.items()):
                    if job.cancel.is_set():  # the client left: its slot is free next step
                        self.backend.leave(seq)
                        self._active.pop(key)
                        self.counts["cancelled"] += 1
                        log.info("%s cancelled (client left) after %d tokens, %.2f s",
                                 job.id, len(seq.out), time.perf_counter() - t0)
                        self._release()
                if not self._active:
                    continue
                try:
                    self.backend.step()
                except Exception as exc:  # every job in a slot fails with it
                    if isinstance(exc, self.backend.fatal):  # every job told why; it stops
                        message = (str(exc) if isinstance(exc, RankFailure)
                                   else f"{type(exc).__name__}: {exc}")
                        for job, _, _, _ in self._active.values():
                            self.counts["failed"] += 1
                            job.emit(ErrorEvent(500, f"the engine failed: {message}"))
                            self._release()
                        self._active.clear()
                        self._fail(None, message)
                        break
                    for key, (job, seq, _, _) in list(self._active.items()):
                        self.backend.leave(seq)
                        self._active.pop(key)
                        self._failed(job, exc)
                        self._release()
                    continue
                self._finish_ended()
        finally:
            self.busy = False
            for job, seq, _, _ in self._active.values():  # stopping: those in slots get a 503
                job.emit(ErrorEvent(503, self.fatal_error or "the server is stopping"))
                self._release()
            self._active.clear()
            self._stop.set()
            self._drain()

    def _admit(self) -> None:
        """Waiting jobs into the free slots (blocking briefly for one when none decodes)."""
        while len(self._active) < self.slots and not self._stop.is_set():
            try:
                job = (self._queue.get_nowait() if self._active
                       else self._queue.get(timeout=0.2))
            except queue.Empty:
                return
            if job.cancel.is_set():  # the client left while it waited
                self.counts["cancelled"] += 1
                self._release()
                continue
            pieces = TextPieces(self.backend.target.tokenizer, tuple(job.stop or ()))
            t0 = time.perf_counter()
            try:
                seq = self.backend.join(job, lambda tok, job=job, pieces=pieces: job.emit(
                    TokenEvent(tok, pieces.add(tok))))
            except Exception as exc:
                self._failed(job, exc)
                self._release()
                continue
            self._active[id(job)] = (job, seq, pieces, t0)
            self._finish_ended()

    def _finish_ended(self) -> None:
        for key, (job, seq, pieces, t0) in list(self._active.items()):
            if seq.done:
                self._active.pop(key)
                self._done(job, self.backend.result(seq), pieces, t0)
                self._release()

    def _fail(self, job: Job | None, message: str) -> None:
        """The backend cannot serve again (a rank died): fail this job, stop the server."""
        if self.fatal_error is not None:  # told already (the rank's exit hook, then the error)
            return
        self.fatal_error = message
        log.error("the engine failed; stopping the server: %s", message)
        if job is not None:
            self.counts["failed"] += 1
            job.emit(ErrorEvent(500, f"the engine failed: {message}"))
        self._stop.set()
        self._drain()
        if self.on_fatal is not None:
            self.on_fatal(message)

    def fail_in_flight(self, message: str) -> None:
        """From another thread, when the backend is known to be dead (the process is leaving):
        the request being decoded and those waiting get their error now."""
        self._fail(self._current, message)
