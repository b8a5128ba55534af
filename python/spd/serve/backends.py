"""What decodes a job. Both have `target` and `generate(job, on_token) -> GenerationResult`; a
cancelled job ends early (DecodeCancelled, or a result cut short) and leaves the backend ready
for the next one. `fatal`: errors after which the backend cannot serve again."""
from __future__ import annotations

from spd.errors import InternalError, SPDError
from spd.runtime.batch_ar import BatchedAR
from spd.runtime.batch_pipeline import BatchedPipeline
from spd.runtime.batch_spd import BatchedSPD
from spd.serve.jobs import Job


class DecodeCancelled(Exception):
    """The job's client left: raised from the token callback to stop the decode."""


class LocalBackend:
    """The one-process engine (SPDEngine): stages, PDM and caches are reused across requests.
    mode "ar": plain autoregressive decoding on the same stages; "pipeline": the pipeline
    without speculation on the n stages (spd.runtime.batch_pipeline, a batch of one slot when
    max_batch is 1). max_batch > 1: that many requests decode together (spd.runtime.batch_spd,
    batch_ar or batch_pipeline), each slot holding up to
    `max_context` rows (prompt, new tokens and, for SPD, the rows in flight; a request that
    needs more gets a 400), through `join`, `step`, `leave` and `result` instead of
    `generate`; a joining prompt is prefilled `prefill_chunk` rows a step while the others
    decode (None: at once)."""

    fatal: tuple[type[BaseException], ...] = ()

    def __init__(self, engine, mode: str = "spd", max_batch: int = 1, max_context: int = 2048,
                 prefill_chunk: int | None = None):
        self.engine, self.target, self.mode = engine, engine.target, mode
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise SPDError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.slots = max_batch
        if mode not in ("spd", "ar", "pipeline"):
            raise SPDError(f"mode must be 'spd', 'ar' or 'pipeline', got {mode!r}")
        self.batch = None
        if mode == "pipeline":
            self.batch = BatchedPipeline(engine, max_batch, max_context, prefill_chunk)
        elif max_batch > 1:
            spd = mode == "spd" and engine.n >= 2
            self.batch = (BatchedSPD(engine, max_batch, max_context,
                                     prefill_chunk=prefill_chunk) if spd else
                          BatchedAR(engine.target, max_batch, max_context, prefill_chunk))

    def describe(self) -> str:
        what = f"one process, {self.mode} n={self.engine.n if self.mode != 'ar' else 1}"
        return what + (f", {self.slots} slots" if self.slots > 1 else "")

    def join(self, job: Job, on_token):
        """A job into a free slot: its prefill and first token (on_token) -> its sequence."""
        ids, max_new, rule = self.engine.prepare_request(job.prompt_ids, job.max_new, job.stop,
                                                         job.stop_token_ids)
        return self.batch.join(ids, max_new, job.sampling, rule, on_token)

    def step(self) -> None:
        self.batch.step()

    def leave(self, seq) -> None:
        self.batch.leave(seq)

    def result(self, seq):
        return self.engine.build_result(seq.out, seq.stats, seq.rule)

    def generate(self, job: Job, on_token):
        def tick(token: int) -> None:
            if job.cancel.is_set():  # the engine leaves at once; its next call starts afresh
                raise DecodeCancelled()
            on_token(token)
        if self.mode == "pipeline":  # its batch of one slot
            seq = self.join(job, tick)
            try:
                while not seq.done:
                    self.step()
            finally:
                self.leave(seq)
            return self.result(seq)
        run = self.engine.generate if self.mode == "spd" else self.engine.generate_ar
        return run(job.prompt_ids, job.max_new, job.sampling, on_token=tick, stop=job.stop,
                   stop_token_ids=job.stop_token_ids)


class RankFailure(Exception):
    """A rank of the distributed runtime failed mid-decode: the runtime cannot serve again."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record


class DistributedBackend:
    """Rank 0 of the distributed runtime (DistributedSPDEngine); the stage ranks wait for the
    next request between jobs, their caches reused. A cancelled job ends at its next token as
    EOS would, so every rank stays in step. Any failure mid-decode is fatal: the stages may be
    mid-cycle. `failure` keeps the blame record of a lost rank for the caller to leave with.
    max_batch > 1: one batch session on the ranks for the server's life
    (spd.distributed.batch_draft), jobs through `join`, `step`, `leave` and `result`.
    mode "pipeline": the pipeline without speculation on the stage ranks
    (spd.distributed.batch_pipeline), a session of `max_batch` slots (one slot included)."""

    fatal: tuple[type[BaseException], ...] = (Exception,)

    def __init__(self, engine, max_batch: int = 1, max_context: int = 2048,
                 prefill_chunk: int | None = None, mode: str = "spd"):
        self.engine, self.target, self.mode = engine, engine.target, mode
        self.failure: dict | None = None
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise SPDError(f"max_batch must be a positive integer, got {max_batch!r}")
        if mode not in ("spd", "pipeline"):
            raise SPDError(f"the distributed runtime serves mode 'spd' or 'pipeline', got "
                           f"{mode!r}")
        self.slots = max_batch
        self.batch = (engine.batch(max_batch, max_context, prefill_chunk=prefill_chunk,
                                   mode=mode)
                      if max_batch > 1 or mode == "pipeline" else None)

    @property
    def batched(self) -> bool:
        """Jobs go through join / step / leave (a batch session), not `generate`."""
        return self.batch is not None

    def describe(self) -> str:
        S = self.engine.rt.config.draft_on_stage
        what = (f"distributed, {self.engine.n} stage ranks + 1 draft rank" if S is None else
                f"distributed, {self.engine.n} processes, the draft rank beside stage {S}")
        if self.mode == "pipeline":
            what = f"distributed pipeline without speculation, {self.engine.n} stage ranks"
        return what + (f", {self.slots} slots" if self.slots > 1 else "")

    def _guarded(self, call, *args):
        """call(*args); a communication error names the rank that failed (RankFailure)."""
        from spd.distributed.faults import describe_failure
        from spd.distributed.transport import CommError
        try:
            return call(*args)
        except CommError as exc:  # usually a peer died: name it, as run_rank would
            rt = self.engine.process
            self.failure = rt.blame_after_comm_error(exc, min(1.0, rt.config.fault_timeout))
            raise RankFailure(describe_failure(self.failure), self.failure) from exc

    def generate(self, job: Job, on_token):
        if self.batch is not None:
            raise InternalError("a batch session's backend serves through join and step")
        return self._guarded(lambda: self.engine.generate(
            job.prompt_ids, job.max_new, job.sampling, on_token=on_token, stop=job.stop,
            stop_token_ids=job.stop_token_ids, cancel=job.cancel))

    def join(self, job: Job, on_token):
        """A job into the batch: it takes a slot at the session's next pause."""
        ids, max_new, rule = self.engine.engine.prepare_request(
            job.prompt_ids, job.max_new, job.stop, job.stop_token_ids)
        return self.batch.join(ids, max_new, job.sampling, rule, on_token)

    def step(self) -> None:
        self._guarded(self.batch.step)

    def leave(self, seq) -> None:
        self.batch.leave(seq)

    def result(self, seq):
        return self.engine.engine.build_result(seq.out, seq.stats, seq.rule)
