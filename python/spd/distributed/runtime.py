"""Distributed SPD: n stage ranks plus one draft rank on torch.distributed.

Roles (world size n + 1):
  rank 0      the draft rank: PDM, anchor buffers and feature aggregation, the verifier (final norm
              and LM head), the sampling generator, the pipeline schedule, and the control plane.
  rank s + 1  stage s: its decoder layers and their KV cache (stage 0 also embeds the token that
              enters the pipeline, from its id; stage 0 and rank 0 both keep the embedding table).

Why the verifier sits on the draft rank: judging a draft needs the draft distribution q and the
one random stream, both of which live where the draft is made, and the decision is what the
control message carries; on the last stage the LM head (vocab x d, larger than a layer of a small
model) would lengthen the slowest stage every cycle instead of running while the draft rank is
otherwise idle waiting for the pipeline. The last stage therefore sends its final hidden state
(one row) with its anchor states, and rank 0 applies norm + LM head.

One cycle, as `SPDEngine.generate` runs it (both drive the same `spd.runtime.sequence.SequenceDecode`:
same schedule, same draw order of the generator, so greedy tokens, N and K and seeded samples are
identical):
  rank 0: send control (window start/count, truncation, token entering stage 0) to every stage;
          post receives for this cycle's anchor snaps; wait for last cycle's snaps (pre-step
          features) and draft while the stages compute; if the window is full wait for the last
          stage's row and verify; the decision goes into the next cycle's control message.
  stage s: wait for control; truncate on rollback; if it has a token (s < count) take its input
          (the embedding, or the hidden state the previous stage sent last cycle), run its layers,
          send its anchor states (and, last stage, the output row) to rank 0 and the output to
          stage s + 1 with non-blocking sends.
Speculative control (SpeculationPolicy): in a full cycle rank 0 may send the next cycle's control
message right after drafting, as if the draft will be accepted, so the stages compute the next
cycle while rank 0 waits for the last stage and verifies. If the draft is rejected, rank 0 sends
that cycle's message again with the rollback (a stage sees the same cycle number twice and treats
the second as the cycle: truncate, discard the inputs the first attempt produced) and receives
and drops the first attempt's snaps. Control messages therefore alternate tags by their sequence
number, not by cycle; point-to-point order per peer and tag keeps the two attempts apart.
Gloo point-to-point sends complete only once the receiver has posted its receive, so every
receive is posted ahead of need (control one cycle ahead, hidden states when the sender's work is
announced) and sends are waited lazily: the protocol never waits in a cycle.

Requests (prefill header, shutdown) and statistics go through the rendezvous store, so idle ranks
wait there without a communication timeout. Failures: every rank heartbeats into the store; a rank
that raises writes a failure record first; a watchdog thread in every rank exits the process
(naming the failed rank) when a record appears or a heartbeat stops for `fault_timeout` seconds;
a dead peer also breaks gloo's connection, which surfaces at once. A rank stopped from outside
(SIGTERM: torchrun stops a node's other ranks when one of them fails) leaves a mark and exits with
status 143; the others then blame the rank that failed, not the ones its launcher stopped.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from spd.runtime.sequence import PhaseTimer, SequenceDecode, check_prompt
from spd.draft.drafters import ReferenceDrafter
from spd.runtime.engine import DecodeStats, GenerationResult, SamplingParams, SPDEngine
from spd.errors import SPDError
from spd.draft.lookup import DEFAULT_MIN_LEN as DEFAULT_LOOKUP
from spd.model.partition import DepthLayout
from spd.runtime.schedule import PipelineSchedule
from spd.model.target import Stage

DRAFT_RANK = 0
# Hidden states and snaps alternate between two tags by cycle parity, so that a receive for this
# cycle can be posted while last cycle's from the same peer is still outstanding.
TAG_CTRL, TAG_HIDDEN, TAG_SNAP = 10, 20, 30
OP_CYCLE, OP_STOP = 1, 2
CTRL_FIELDS = 6  # op, cycle, window start, window count, truncate to (-1: none), token entering
HEARTBEAT_DONE = 1 << 40  # added to a rank's heartbeat counter when it finished cleanly

EXIT_OK, EXIT_ERROR, EXIT_INPUT, EXIT_PEER, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_TERMINATED = 128 + signal.SIGTERM  # what a shell reports for a process SIGTERM ended


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def role_of(rank: int) -> str:
    return "draft rank" if rank == DRAFT_RANK else f"stage {rank - 1}"


# --- configuration ----------------------------------------------------------------------------
@dataclass
class DistConfig:
    """What every rank needs to build its piece. Picklable (sent to spawned ranks)."""
    n_stages: int = 4
    split: list[int] | None = None
    anchors: list[int] | None = None
    pdm: str | None = None
    pdm_layers: int | None = None
    model: str | None = None
    device: str = "cpu"
    # factory(rank) -> TargetModel; default: load_target(model, device). Tests pass tiny targets.
    target_factory: Callable | None = None
    fault_timeout: float = 10.0   # a silent rank is declared dead after this many seconds
    op_timeout: float = 300.0     # bound of any single wait inside a generation (hangs)
    threads: int | None = None    # torch threads per rank (None: leave torch's default)
    backend: str | None = None    # None: nccl for CUDA devices, gloo otherwise
    # Send data through host copies: None = when gloo carries GPU tensors; True forces it
    # (tests run that path on CPU).
    stage_through_host: bool | None = None
    # Test hook: {"rank": r, "cycle": c, "action": "raise" | "kill"} fails rank r at decode cycle c.
    fault: dict | None = None
    # Announce the next cycle before the current draft is judged: "auto" (while recent drafts
    # are mostly accepted), "on" or "off" (see SpeculationPolicy).
    speculative_control: str = "auto"
    # Context lookup's shortest match (spd.draft.lookup; 0: the PDM alone).
    lookup: int = DEFAULT_LOOKUP

    @property
    def world_size(self) -> int:
        return self.n_stages + 1

    def validate(self) -> None:
        if int(self.n_stages) != self.n_stages or self.n_stages < 2:
            raise SPDError(f"the distributed runtime needs at least 2 stages (n + 1 >= 3 ranks), "
                           f"got --stages {self.n_stages}; use the single-process engine for n=1")
        if not self.fault_timeout > 0:
            raise SPDError(f"fault timeout must be > 0 seconds, got {self.fault_timeout}")
        if not self.op_timeout > 0:
            raise SPDError(f"communication timeout must be > 0 seconds, got {self.op_timeout}")
        if self.speculative_control not in SPECULATION_MODES:
            raise SPDError(f"speculative control must be one of {', '.join(SPECULATION_MODES)}, "
                           f"got {self.speculative_control!r}")


SPECULATION_MODES = ("auto", "on", "off")


class SpeculationPolicy:
    """Whether rank 0 announces the next cycle before this cycle's draft is judged.

    An accepted guess takes verification and the control round trip off the critical path (the
    stages are already computing the next cycle); a rejected one makes the stages finish a wasted
    forward before they can start the correction, and costs an extra control message. It pays
    when acceptance is high, so "auto" speculates while a moving average of recent judgments
    (weight `decay` on the past) is at least `threshold`. Tokens never depend on it."""

    def __init__(self, mode: str, threshold: float = 0.5, decay: float = 0.8):
        self.mode, self.threshold, self.decay = mode, threshold, decay
        self.rate = threshold  # start neutral: speculate until rejections say otherwise

    def speculate(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and self.rate >= self.threshold)

    def record(self, accepted: bool) -> None:
        self.rate = self.decay * self.rate + (1.0 - self.decay) * float(accepted)


def parse_fault(text: str | None) -> dict | None:
    """'rank=2,cycle=5,action=kill' -> {'rank': 2, 'cycle': 5, 'action': 'kill'} (test hook)."""
    if not text:
        return None
    try:
        out = dict(kv.split("=", 1) for kv in text.split(",") if kv.strip())
        fault = {"rank": int(out["rank"]), "cycle": int(out.get("cycle", 1)),
                 "action": out.get("action", "raise")}
    except (KeyError, ValueError) as exc:
        raise SPDError(f"fault spec must look like rank=2,cycle=5,action=kill, got '{text}'") from exc
    if fault["action"] not in ("raise", "kill"):
        raise SPDError(f"fault action must be raise or kill, got '{fault['action']}'")
    return fault


@dataclass
class GenerateRequest:
    """One generation for `run_requests` (tests, benchmarks): reference=... uses the oracle."""
    prompt_ids: list[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reference: list[int] | None = None
    reference_accuracy: float = 1.0
    reference_seed: int = 0


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


class CommError(RuntimeError):
    """A point-to-point wait failed (peer gone, or no message within the op timeout)."""

    def __init__(self, peer: int, what: str, cause: BaseException):
        self.peer, self.what, self.cause = peer, what, short_error(cause)
        super().__init__(f"{what} with rank {peer} ({role_of(peer)}) failed: {self.cause}")


# --- per-process runtime: stores, heartbeat watchdog, communication helpers --------------------
class Runtime:
    def __init__(self, rank: int, world: int, config: DistConfig, host: str, port: int,
                 is_master: bool = False, prefix: str = "spd/"):
        self.rank, self.world, self.config = rank, world, config
        self.op_timeout = _td(config.op_timeout)
        self._exit_lock = threading.Lock()
        self._exiting = False
        timeout = _td(max(config.op_timeout, 30.0))
        # Two clients: the watchdog must never queue behind a blocking wait of the main thread.
        self.raw_store = dist.TCPStore(host, port, is_master=is_master, timeout=timeout,
                                       wait_for_workers=False)
        self.store = dist.PrefixStore(prefix, self.raw_store)
        self.wd_store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                               timeout=timeout))
        self.pg_store = dist.PrefixStore(prefix + "pg/", self.raw_store)
        for r in range(world):
            self.store.add(f"hb/{r}", 0)
        self.store.add(f"hb/{rank}", 1)
        self._term_fd = self._catch_sigterm()
        self.watchdog = _Watchdog(self)
        self.watchdog.start()
        self.data_group = None
        self.ctrl_group = None
        self.backend = None
        self._outgoing: list[tuple] = []
        self.host_staged = 0  # receives that went through a host buffer

    # failure handling ------------------------------------------------------------------------
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

    def blame_after_comm_error(self, exc: CommError, first_wait: float) -> dict:
        """The failure record to stop for after a failed wait on `exc.peer`. A rank that fails
        records why before it exits, so the record is normally there within `first_wait`; else
        the peer went silent. A peer its launcher stopped (SIGTERM mark) is a symptom of a
        failure elsewhere, so the watchdogs get a fault timeout to name the rank that went
        silent first; only then is the peer itself named."""
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
        # Control messages are host integers: keep them on gloo even when data moves over NCCL.
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

    def _through_host(self, tensor) -> bool:
        """gloo moves host memory only: device tensors go through a host copy."""
        forced = self.config.stage_through_host
        return forced if forced is not None else (tensor.is_cuda and self.backend == "gloo")

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
        group = self.ctrl_group if tag in (TAG_CTRL, TAG_CTRL + 1) else self.data_group
        if self._through_host(tensor):
            self.host_staged += 1
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            return _StagedRecv(self._post(dist.irecv, host, src, group, tag, "posting a receive"),
                               host, tensor)
        return self._post(dist.irecv, tensor, src, group, tag, "posting a receive")

    def isend(self, tensor, dst: int, tag: int, epoch: int = 0) -> None:
        group = self.ctrl_group if tag in (TAG_CTRL, TAG_CTRL + 1) else self.data_group
        if self._through_host(tensor):
            tensor = tensor.to("cpu", copy=True)
        work = self._post(dist.isend, tensor, dst, group, tag, "posting a send")
        self._outgoing.append((work, dst, tensor, epoch))

    def flush_sends(self, before: int | None = None) -> None:
        """Wait for the sends of epochs (cycles) < before (all when None). Waiting one cycle
        late keeps these waits off the critical path; parity tags keep at most one send per
        (peer, tag) outstanding."""
        keep = []
        for item in self._outgoing:
            if before is None or item[3] < before:
                self.wait(item[0], item[1], "completion of a send")
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


class _Watchdog(threading.Thread):
    """Heartbeats into the store and stops this process when another rank failed or went silent."""

    def __init__(self, rt: Runtime):
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


# --- consistency checks across ranks ------------------------------------------------------------
def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= 256 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:  # large files: head, tail and size
            h.update(f.read(8 << 20))
            f.seek(size - (8 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def pdm_digest(pdm) -> str | None:
    if pdm is None or pdm == "untrained":  # rank 0 resolves these the same way everywhere
        return None
    folder = Path(pdm).expanduser()
    files = [folder / "config.json", folder / "model.safetensors"]
    if not all(f.exists() for f in files):
        return f"missing: {folder}"
    return "+".join(file_digest(f) for f in files)


def rank_info(rank: int, world: int, config: DistConfig, target, layout: DepthLayout) -> dict:
    from spd import __version__
    return {"rank": rank, "world_size": world, "spd_version": __version__,
            "n_stages": layout.n, "stage_split": layout.split, "anchors": list(layout.anchors),
            "target_fingerprint": target.fingerprint(), "target_name": target.name,
            "dtype": str(target.dtype), "pdm": pdm_digest(config.pdm),
            "pdm_path": str(config.pdm) if config.pdm else None}


_CHECKED = (("world_size", "world size"), ("spd_version", "spd version"),
            ("n_stages", "number of stages"), ("stage_split", "stage split"),
            ("anchors", "anchor layers"), ("target_fingerprint", "target model"),
            ("dtype", "model dtype"), ("pdm", "PDM checkpoint"))


def check_handshake(infos: list[dict]) -> None:
    """Every rank must describe the same run as rank 0; raise SPDError naming the first that does not."""
    ref = infos[0]
    for info in infos[1:]:
        for key, what in _CHECKED:
            if info[key] != ref[key]:
                r = info["rank"]
                extra = ""
                if key == "target_fingerprint":
                    extra = f" (rank {r} loaded {info['target_name']}, rank 0 {ref['target_name']})"
                elif key == "pdm":
                    extra = f" (rank {r}: {info['pdm_path']}, rank 0: {ref['pdm_path']})"
                raise SPDError(f"rank {r} ({role_of(r)}) disagrees with rank 0 on the {what}: "
                               f"{info[key]!r} vs {ref[key]!r}{extra}. Every rank must be started "
                               "with the same model files, PDM checkpoint and stage options")


def exchange_info(rt: Runtime, info: dict) -> list[dict]:
    rt.store.set(f"hello/{rt.rank}", json.dumps(info))
    return [json.loads(rt.store.get(f"hello/{r}")) for r in range(rt.world)]


# --- stage ranks -------------------------------------------------------------------------------
class StageWorker:
    """Stage s = rank s + 1: its layers, its KV cache, and the cycle loop of one stage."""

    def __init__(self, rt: Runtime, target, layout: DepthLayout):
        self.rt, self.target, self.layout = rt, target, layout
        self.s = rt.rank - 1
        self.n = layout.n
        self.first = self.s == 0
        self.last = self.s == self.n - 1
        self.snap_idx = [b for _, b in layout.anchors_of_stage(self.s)]
        self.stage: Stage | None = None
        self.prev, self.next = rt.rank - 1, rt.rank + 1

    def serve(self) -> None:
        gen = 0
        while True:
            gen += 1
            req = wait_request(self.rt, gen)
            if req["op"] == "shutdown":
                return
            self.run(gen, req)

    def _forward(self, h: torch.Tensor, pos: int):
        snaps: dict[int, torch.Tensor] = {}
        want = set(self.snap_idx)

        def record(idx, x):
            if idx in want:
                snaps[idx] = x
        out = self.stage.forward(h, pos, record)
        rows = [snaps[b] for b in self.snap_idx] + ([out] if self.last else [])
        return out, (torch.stack(rows).contiguous() if rows else None)

    def _send(self, out, snap, cycle: int) -> None:
        if snap is not None:
            self.rt.isend(snap, DRAFT_RANK, TAG_SNAP + cycle % 2, cycle)
        if not self.last:
            self.rt.isend(out.contiguous(), self.next, TAG_HIDDEN + cycle % 2, cycle)

    @torch.no_grad()
    def run(self, gen: int, req: dict) -> None:
        rt, t = self.rt, self.target
        phases: dict[str, float] = {}
        timer = PhaseTimer(phases)
        cap = int(req["capacity"])
        if self.stage is None or self.stage.cache.capacity < cap:
            self.stage = Stage(t, self.s, self.layout.stages[self.s], cap)
        self.stage.cache.truncate(0)
        d, dev = t.hidden_size, t.device
        ctrl = torch.empty(CTRL_FIELDS, dtype=torch.int64)
        seq = 1  # control messages alternate tags by their sequence number (a cycle may be redone)
        ctrl_work = rt.irecv(ctrl, DRAFT_RANK, TAG_CTRL + seq % 2)
        # Prefill: the whole prompt through this stage as one chunk.
        t0 = time.perf_counter()
        if self.first:
            h = t.embed_tokens(torch.tensor(req["prompt_ids"], dtype=torch.int64, device=dev))
        else:
            h = torch.empty(int(req["prompt_len"]), d, dtype=t.dtype, device=dev)
            rt.wait(rt.irecv(h, self.prev, TAG_HIDDEN), self.prev, "prefill input")
        out, snap = self._forward(h, 0)
        self._send(out, snap, 0)
        rt.flush_sends()
        prefill_s = time.perf_counter() - t0
        fwd: list[float] = []  # per cycle (of a redone cycle, the attempt that counted)
        wasted = 0.0
        last_cycle = 0
        pending = None  # (work, buffer): the previous stage's output of the last cycle
        fault = rt.config.fault if rt.config.fault and rt.config.fault["rank"] == rt.rank else None
        t_dec = time.perf_counter()
        while True:
            with timer("wait_ctrl"):
                rt.wait(ctrl_work, DRAFT_RANK, "control message")
            op, cycle, start, count, trunc, token = ctrl.tolist()
            if op == OP_STOP:
                break
            ctrl = torch.empty(CTRL_FIELDS, dtype=torch.int64)  # the next one, posted ahead
            seq += 1
            ctrl_work = rt.irecv(ctrl, DRAFT_RANK, TAG_CTRL + seq % 2)
            redo = cycle == last_cycle  # rank 0 announced this cycle on an optimistic accept
            last_cycle = cycle          # and the draft was rejected: the same cycle, redone
            if fault and cycle == fault["cycle"]:
                inject_fault(fault)
            incoming = None  # the previous stage works this cycle: its output is ours next cycle
            if not self.first and self.s - 1 < count:
                buf = torch.empty(1, d, dtype=t.dtype, device=dev)
                incoming = (rt.irecv(buf, self.prev, TAG_HIDDEN + cycle % 2), buf)
            if trunc >= 0:
                with timer("rollback"):
                    self.stage.cache.truncate(trunc)
            if self.s < count:
                pos = start + count - 1 - self.s
                if self.first:
                    h = t.embed_tokens(torch.tensor([token], dtype=torch.int64, device=dev))
                else:
                    if pending is None:
                        raise SPDError(f"internal: stage {self.s} has work at cycle {cycle} but "
                                       "no input was announced")
                    with timer("wait_input"):
                        rt.wait(pending[0], self.prev, "hidden state")
                    h = pending[1]
                tf = time.perf_counter()
                out, snap = self._forward(h, pos)
                took = time.perf_counter() - tf
                with timer("send"):
                    self._send(out, snap, cycle)
            else:
                took = 0.0
                if pending is not None:  # dropped by a rollback: receive it and discard it
                    with timer("wait_input"):
                        rt.wait(pending[0], self.prev, "hidden state")
            if redo:  # the first attempt's forward was wasted work
                wasted += fwd[-1]
                fwd[-1] = took
            else:
                fwd.append(took)
            pending = incoming
            with timer("send"):
                rt.flush_sends(before=cycle)
        decode_s = time.perf_counter() - t_dec
        if pending is not None:
            rt.wait(pending[0], self.prev, "hidden state")
        rt.flush_sends()
        phases["forward"] = sum(fwd)
        phases["forward_redone"] = wasted
        rt.store.set(f"stats/{gen}/{rt.rank}", json.dumps(
            {"rank": rt.rank, "role": role_of(rt.rank),
             "layers": [self.stage.layer_ids.start, self.stage.layer_ids.stop],
             "prefill_s": prefill_s, "decode_s": decode_s, "phase_s": phases, "forward_s": fwd}))


def inject_fault(fault: dict) -> None:
    if fault["action"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected fault at cycle {fault['cycle']}")


def wait_request(rt: Runtime, gen: int) -> dict:
    """Idle stage ranks wait here (the store, no communication timeout); faults end the process
    through the watchdog."""
    key = f"req/{gen}"
    while True:
        try:
            rt.store.wait([key], _td(3600))
            return json.loads(rt.store.get(key))
        except Exception as exc:  # store wait timed out after an hour idle: keep waiting
            if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                raise


# --- the draft rank ----------------------------------------------------------------------------
@dataclass
class DistributedDecodeStats(DecodeStats):
    distributed: dict = field(default_factory=dict)

    def summary(self) -> str:
        d = self.distributed
        extra = ""
        if d:
            extra = (f" ranks={d['world_size']} cycle={d['cycle_ms']['median']:.2f} ms "
                     f"overhead={d['overhead_ms']['median']:.2f} ms")
        return super().summary() + extra


class DraftRankStreams:
    """Rank 0's CUDA streams: snaps are waited for and scattered into the anchor buffer on
    `recv`, the PDM drafts on `draft`, verification and bookkeeping stay on the default stream.
    Cross-stream order goes through wait_stream (recorded events), so the steady state never
    synchronises the device; the host waits only for the values it needs (the draft id for the
    control message, the verdict). With NCCL the receives themselves run on NCCL's streams and
    `work.wait()` orders `recv` after them. On a CPU every method is a no-op."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.recv = torch.cuda.Stream(device)
            self.draft = torch.cuda.Stream(device)

    def receiving(self):
        return torch.cuda.stream(self.recv) if self.cuda else nullcontext()

    def drafting(self):
        if not self.cuda:
            return nullcontext()
        self.draft.wait_stream(self.recv)  # the features received so far
        self.draft.wait_stream(self.main)  # tokens entered, rollbacks
        return torch.cuda.stream(self.draft)

    def after_receive(self, *tensors) -> None:
        """The default stream is about to read these received buffers."""
        if self.cuda:
            self.main.wait_stream(self.recv)
            for x in tensors:
                x.record_stream(self.main)

    def after_draft(self, draft) -> None:
        """The default stream is about to use the draft (its token enters the pipeline)."""
        if self.cuda:
            self.main.wait_stream(self.draft)
            for x in (draft.token, draft.q):
                if isinstance(x, torch.Tensor):
                    x.record_stream(self.main)


class DistributedSPDEngine:
    """Rank 0's side of the distributed engine: `generate` has `SPDEngine.generate`'s contract."""

    def __init__(self, rt: Runtime, engine: SPDEngine):
        self.rt = rt
        self.engine = engine
        self.target = engine.target
        self.layout = engine.layout
        self.n = engine.n
        self._gen = 0
        lay = self.layout
        # Rows of stage s's snap message: its anchors (slots), then (last stage) its output.
        self.snap_slots = [[j for j, _ in lay.anchors_of_stage(s)] for s in range(self.n)]
        self.snap_rows = [len(sl) + (1 if s == self.n - 1 else 0)
                          for s, sl in enumerate(self.snap_slots)]
        self._ctrl_seq = 0

    def _request(self, payload: dict) -> int:
        self._gen += 1
        self.rt.store.set(f"req/{self._gen}", json.dumps(payload))
        return self._gen

    def shutdown(self) -> None:
        self._request({"op": "shutdown"})

    def _send_ctrl(self, values: list[int]) -> None:
        rt, cycle = self.rt, values[1]
        rt.flush_sends(before=cycle - 1)  # the stages posted those receives long ago
        self._ctrl_seq += 1
        for s in range(self.n):
            rt.isend(torch.tensor(values, dtype=torch.int64), s + 1,
                     TAG_CTRL + self._ctrl_seq % 2, cycle)

    def _announce(self, cycle: int, sched: PipelineSchedule, trunc: int, token: int) -> list:
        """Send cycle `cycle`'s control message for window `sched` and post receives for the
        snaps its work will send."""
        self._send_ctrl([OP_CYCLE, cycle, sched.start, sched.count, trunc, token])
        return self._post_snaps(sorted(sched.stage_work()), cycle)

    def _post_snaps(self, work: list[tuple[int, int]], cycle: int, rows: int = 1) -> list:
        """Post receives for the snaps of (stage, first position) pairs; rows per position."""
        t = self.target
        out = []
        for s, pos in work:
            if self.snap_rows[s]:
                buf = torch.empty(self.snap_rows[s], rows, t.hidden_size, dtype=t.dtype,
                                  device=t.device)
                out.append((s, pos, buf, self.rt.irecv(buf, s + 1, TAG_SNAP + cycle % 2)))
        return out

    def _take_snap(self, item, anchors) -> None:
        s, pos, buf, work = item
        if work is None:  # already received and stored
            return
        self.rt.wait(work, s + 1, "anchor states")
        if pos < 0:  # work of a cycle announced ahead and then redone: received, discarded
            return
        for i, j in enumerate(self.snap_slots[s]):
            anchors[j, pos:pos + buf.shape[1]] = buf[i]

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        rt, t, n = self.rt, self.target, self.n
        ids, max_new = check_prompt(t, prompt_ids, max_new_tokens)
        drafter = drafter or self.engine.drafter
        dec = SequenceDecode(t, self.layout, drafter, ids, max_new, sampling,
                             DistributedDecodeStats(mode="spd", n=n), on_token)
        prompt_len = dec.prompt_len
        gen_id = self._request({"op": "generate", "prompt_ids": ids.tolist(),
                                "prompt_len": prompt_len, "capacity": dec.capacity})
        stats, timer, anchors = dec.stats, dec.timer, dec.anchors
        streams = DraftRankStreams(torch.device(t.device))
        staged_before = rt.host_staged
        fault = rt.config.fault if rt.config.fault and rt.config.fault["rank"] == rt.rank else None

        # Prefill: every stage runs the prompt; rank 0 gets every anchor and the last row.
        t0 = time.perf_counter()
        snaps = self._post_snaps([(s, 0) for s in range(n)], 0, rows=prompt_len)
        anchors[0, :prompt_len] = t.embed_tokens(ids)
        for item in snaps:
            self._take_snap(item, anchors)
        dec.start(snaps[-1][2][-1][-1:], t0)
        pending: list = []   # last cycle's snaps still to receive (pre-step features)
        trunc = -1           # the committed length every stage truncates to next cycle
        announced = None     # snaps of the next cycle, announced before its draft was judged
        policy = SpeculationPolicy(rt.config.speculative_control)
        spec = {"announced": 0, "redone": 0}
        cycle_s: list[float] = []
        self._ctrl_seq = 0
        while not dec.done:
            tc = time.perf_counter()
            stats.K += 1
            if fault and stats.K == fault["cycle"]:
                inject_fault(fault)
            sched = dec.sched
            if announced is None:
                token = int(dec.tokens[sched.newest])
                with timer("control_send"), streams.receiving():
                    current = self._announce(stats.K, sched, trunc, token)
                trunc = -1
            else:  # announced last cycle on an optimistic accept, which held
                current, announced = announced, None
            with timer("wait_snaps"), streams.receiving():
                for item in pending:
                    self._take_snap(item, anchors)
            # 1. Draft the successor of the newest token from pre-step features, overlapping
            #    the stages' forwards of this cycle. (Post-step drafting, an ablation, waits for
            #    this cycle's snaps and sees every in-flight token one stage deeper.)
            if dec.post_step:
                with timer("wait_stage"), streams.receiving():
                    for item in current:
                        self._take_snap(item, anchors)
                current = [item[:3] + (None,) for item in current]  # received already
            with streams.drafting():
                draft = dec.draft(1 if dec.post_step else 0)
            streams.after_draft(draft)
            if not sched.full:  # filling: nothing leaves the pipeline this cycle
                dec.fill(draft)
                pending = current
            else:
                # 2. Speculative control: announce the next cycle as if the draft will be
                #    accepted, so the stages start it while this one is verified; verification
                #    and the control round trip leave the critical path. On a rejection the
                #    next cycle is announced again (the stages roll back and redo it).
                ahead = None
                if policy.speculate() and len(dec.out) + 1 < dec.max_new:
                    nxt = replace(sched)
                    nxt.accept()
                    token = int(draft.token)  # on the default stream, which waited for it
                    with timer("control_send"), streams.receiving():
                        ahead = self._announce(stats.K + 1, nxt, -1, token)
                    spec["announced"] += 1
                # 3. The oldest token leaves the last stage; its row judges the next token.
                last = current[-1]
                assert last[0] == n - 1
                with timer("wait_stage"), streams.receiving():
                    self._take_snap(last, anchors)
                streams.after_receive(last[2])
                pending = current[:-1]
                accepted, token = dec.judge(last[2][-1])
                policy.record(accepted)
                # 4. On rejection every stage truncates at the start of the next cycle.
                rollback_to = dec.commit(accepted, token, draft)
                if rollback_to is not None:
                    trunc = rollback_to
                if ahead is not None:
                    if accepted and not dec.done:
                        announced = ahead
                    else:  # its snaps still arrive: receive and drop them
                        pending += [(s, -1, buf, work) for s, _, buf, work in ahead]
                        spec["redone"] += int(not dec.done)
            cycle_s.append(time.perf_counter() - tc)
        dec.finish()
        # Stop: every stage leaves its loop; drain what is still in flight.
        self._send_ctrl([OP_STOP, stats.K + 1, 0, 0, -1, 0])
        with streams.receiving():
            for item in pending:
                self._take_snap(item, anchors)
        rt.flush_sends()
        stage_stats = [json.loads(rt.store.get(f"stats/{gen_id}/{r}"))
                       for r in range(1, rt.world)]
        for r in range(1, rt.world):
            rt.store.delete_key(f"stats/{gen_id}/{r}")
        stats.distributed = breakdown(rt, stats, cycle_s, dec.draft_s, stage_stats)
        stats.distributed["speculative_control"] = dict(mode=policy.mode, **spec)
        stats.distributed["host_staged_receives"] = rt.host_staged - staged_before  # this one
        return GenerationResult(dec.out, stats)


def _summary(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0}
    srt = sorted(xs)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs),
            "p90": srt[min(len(srt) - 1, int(0.9 * len(srt)))]}


def breakdown(rt: Runtime, stats: DecodeStats, cycle_s: list[float], draft_s: list[float],
              stage_stats: list[dict]) -> dict:
    """Per-cycle breakdown: each rank's phases, stage forwards, waits, and the overhead.

    overhead of a cycle = its wall time on rank 0 minus the longest computation that had to fit
    in it (the draft or the slowest stage forward of that cycle): communication, control,
    verification and rollback, i.e. what n devices could not hide.
    """
    K = len(cycle_s)
    ms = 1e3
    per_cycle = lambda total: total / K * ms if K else 0.0  # noqa: E731
    overhead, comm = [], []
    verify_total = stats.phase_s.get("verify", 0.0) + stats.phase_s.get("rollback", 0.0)
    for c in range(K):
        slowest = max([st["forward_s"][c] for st in stage_stats if c < len(st["forward_s"])]
                      + [draft_s[c]])
        overhead.append((cycle_s[c] - slowest) * ms)
    verify_per_cycle = per_cycle(verify_total)
    comm = [o - verify_per_cycle for o in overhead]
    ranks = [{"rank": 0, "role": role_of(0),
              "phase_ms_per_cycle": {k: per_cycle(v) for k, v in stats.phase_s.items()}}]
    for st in stage_stats:
        worked = [f for f in st["forward_s"] if f > 0]
        ranks.append({"rank": st["rank"], "role": st["role"], "layers": st["layers"],
                      "cycles_worked": len(worked),
                      "forward_ms": _summary([f * ms for f in worked]),
                      "phase_ms_per_cycle": {k: per_cycle(v) for k, v in st["phase_s"].items()},
                      "prefill_ms": st["prefill_s"] * ms})
    return {"world_size": rt.world, "backend": rt.backend, "draft_rank": DRAFT_RANK,
            "cycles": K, "cycle_ms": _summary([c * ms for c in cycle_s]),
            "draft_ms": _summary([d * ms for d in draft_s]),
            "overhead_ms": _summary(overhead),
            "comm_control_ms": _summary(comm),
            "verify_rollback_ms_per_cycle": verify_per_cycle,
            "ranks": ranks}


def run_requests(requests: list[GenerateRequest], engine: DistributedSPDEngine,
                 progress=None) -> list[GenerationResult]:
    """A rank-0 job: run the requests in order (tests, benchmarks). `progress` (an Event) is set
    after the first token."""
    results = []

    def tick(_tok):
        if progress is not None and not progress.is_set():
            progress.set()
    for req in requests:
        drafter = None
        if req.reference is not None:
            drafter = ReferenceDrafter(req.reference, req.reference_accuracy, req.reference_seed)
        results.append(engine.generate(req.prompt_ids, req.max_new_tokens, req.sampling,
                                       drafter=drafter, on_token=tick))
    return results


def run_forever(request: GenerateRequest, engine: DistributedSPDEngine, progress=None,
                limit: int = 10_000):
    """A rank-0 job that keeps generating (fault tests kill a rank while it runs)."""
    for _ in range(limit):
        run_requests([request], engine, progress)
    return None


# --- one rank's whole life ---------------------------------------------------------------------
def _drop_unused_layers(target, keep: range) -> None:
    """Free the decoder layers this rank does not run (their weights move to the meta device)."""
    for lid in range(target.num_layers):
        if lid not in keep:
            target.layers[lid].to("meta")


def _rank_device(config: DistConfig, local_rank: int, local_world: int) -> str:
    if config.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SPDError("--device cuda was requested but no CUDA device is available")
        backend = config.backend or "nccl"
        if backend == "nccl" and config.device == "cuda" and \
                torch.cuda.device_count() < local_world:
            raise SPDError(f"NCCL needs one GPU per rank: {local_world} ranks on this node but "
                           f"{torch.cuda.device_count()} GPU(s); use more nodes or GPUs, or fewer "
                           "stages")
        if config.device == "cuda":
            dev = f"cuda:{local_rank % torch.cuda.device_count()}"
        else:
            dev = config.device
        torch.cuda.set_device(torch.device(dev))
        return dev
    return config.device


def run_rank(rank: int, world: int, config: DistConfig, job: Callable | None, host: str,
             port: int, *, is_master: bool = False, prefix: str = "spd/", local_rank: int = 0,
             local_world: int | None = None, result_sink: Callable | None = None) -> int:
    """Everything one rank does; returns its exit status (failures are reported in the store)."""
    rt = None
    try:
        if world != config.world_size:
            raise SPDError(f"{world} ranks were started but --stages {config.n_stages} needs "
                           f"{config.world_size} ({config.n_stages} stage ranks + 1 draft rank)")
        rt = Runtime(rank, world, config, host, port, is_master=is_master, prefix=prefix)
        if config.threads:
            torch.set_num_threads(int(config.threads))
        device = _rank_device(config, local_rank, local_world or world)
        if config.target_factory is not None:
            target = config.target_factory(rank)
        else:
            from spd.model.loading import load_target
            target = load_target(config.model, device=device)
        layout = DepthLayout.build(target.num_layers, config.n_stages, config.split,
                                   config.anchors)
        target.fingerprint()
        engine = None
        if rank == DRAFT_RANK:
            engine = SPDEngine(target, n_stages=config.n_stages, split=config.split,
                               anchors=config.anchors, pdm=config.pdm,
                               pdm_layers=config.pdm_layers, warn_untrained=False,
                               lookup=config.lookup)
        check_handshake(exchange_info(rt, rank_info(rank, world, config, target, layout)))
        _drop_unused_layers(target, range(0) if rank == DRAFT_RANK else layout.stages[rank - 1])
        rt.init_groups(torch.device(target.device))
        if rank == DRAFT_RANK:
            deng = DistributedSPDEngine(rt, engine)
            result = job(deng) if job is not None else None
            deng.shutdown()
            if result_sink is not None:
                result_sink(result)
        else:
            StageWorker(rt, target, layout).serve()
        rt.finish()
        rt.close_groups()
        return EXIT_OK
    except SPDError as exc:
        if rt is None:
            raise
        rt.report("input", str(exc))
        rt.exit_now(EXIT_INPUT, f"error: {exc}")
    except CommError as exc:
        if rt is None:
            raise
        # Usually a symptom: the peer died or failed (see blame_after_comm_error).
        rt.stop_for(rt.blame_after_comm_error(exc, min(1.0, config.fault_timeout)))
    except KeyboardInterrupt:
        if rt is None:
            raise
        rt.report("interrupted", "interrupted (Ctrl-C)")
        rt.exit_now(EXIT_INTERRUPTED, None)
    except BaseException as exc:  # noqa: BLE001 - any error: record it, then leave
        if rt is None:
            raise
        tb = traceback.format_exc()
        rt.report("error", f"{type(exc).__name__}: {exc}")
        print(tb, file=sys.stderr)
        rt.exit_now(EXIT_ERROR, f"failed: {type(exc).__name__}: {exc}")
    return EXIT_ERROR  # not reached: exit_now leaves the process
