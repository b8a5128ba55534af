"""What decodes a job. Both have `target` and `generate(job, on_token) -> GenerationResult`; a
cancelled job ends early (DecodeCancelled, or a result cut short) and leaves the backend ready
for the next one. `fatal`: errors after which the backend cannot serve again."""
from __future__ import annotations

from spd.serve.jobs import Job


class DecodeCancelled(Exception):
    """The job's client left: raised from the token callback to stop the decode."""


class LocalBackend:
    """The one-process engine (SPDEngine): stages, PDM and caches are reused across requests.
    mode "ar": plain autoregressive decoding on the same stages."""

    fatal: tuple[type[BaseException], ...] = ()

    def __init__(self, engine, mode: str = "spd"):
        self.engine, self.target, self.mode = engine, engine.target, mode

    def describe(self) -> str:
        return f"one process, {self.mode} n={self.engine.n if self.mode == 'spd' else 1}"

    def generate(self, job: Job, on_token):
        def tick(token: int) -> None:
            if job.cancel.is_set():  # the engine leaves at once; its next call starts afresh
                raise DecodeCancelled()
            on_token(token)
        run = self.engine.generate if self.mode == "spd" else self.engine.generate_ar
        return run(job.prompt_ids, job.max_new, job.sampling, on_token=tick, stop=job.stop,
                   stop_token_ids=job.stop_token_ids)
