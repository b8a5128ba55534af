"""EngineWorker's admission: max_queue counts the requests waiting for a slot, whether or not the
worker has taken them off its queue yet (a burst that fits is accepted whole)."""
from __future__ import annotations

import threading
import time

import pytest

from spd.errors import SPDError
from spd.runtime.types import SamplingParams
from spd.serve.jobs import Job
from spd.serve.worker import DoneEvent, EngineWorker, ErrorEvent, QueueFull


class Tokenizer:
    def decode(self, ids, **_):
        return "".join(f"<{i}>" for i in ids)


class Result:
    def __init__(self, ids):
        self.token_ids, self.text, self.finish_reason = ids, "", "length"
        self.stats = type("Stats", (), {"summary": lambda self: ""})()


class GatedBackend:
    """Decodes a job only once `gate` is set, two tokens each."""

    fatal = ()
    target = type("Target", (), {"tokenizer": Tokenizer()})()

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Event()

    def generate(self, job, on_token):
        self.started.set()
        assert self.gate.wait(20), "the test never opened the gate"
        for t in (1, 2):
            on_token(t)
        return Result([1, 2])


def job(events: list) -> Job:
    return Job("j", [1, 2, 3], 2, SamplingParams(), emit=events.append)


def test_a_burst_of_max_queue_plus_one_is_accepted_and_one_more_is_refused():
    backend = GatedBackend()
    worker = EngineWorker(backend, max_queue=4)
    events = [[] for _ in range(5)]
    # the worker has not started: nothing is off the queue yet, as in a burst that beats it
    for ev in events:
        worker.submit(job(ev))
    assert worker.queued == 5 and worker.slots_in_use == 0
    with pytest.raises(QueueFull, match="4 requests are waiting"):
        worker.submit(job([]))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        assert backend.started.wait(20)
        assert worker.slots_in_use == 1 and worker.queued == 4
        with pytest.raises(QueueFull):  # 4 waiting + 1 decoding: still full
            worker.submit(job([]))
        backend.gate.set()
        deadline = time.monotonic() + 20
        while not all(ev and isinstance(ev[-1], DoneEvent) for ev in events):
            assert time.monotonic() < deadline, events  # every accepted job completes
            time.sleep(0.02)
        assert worker.queued == 0
        worker.submit(job(after := []))  # room again
    finally:
        worker.stop()
        thread.join(10)
    assert after and isinstance(after[-1], (DoneEvent, ErrorEvent))
    assert worker.counts["served"] >= 5


def test_jobs_left_when_the_worker_stops_get_503_and_free_their_places():
    worker = EngineWorker(GatedBackend(), max_queue=1)
    events = [[], []]
    for ev in events:
        worker.submit(job(ev))
    worker.stop()
    worker.run()  # returns at once: stopping, it drains the queue
    assert [ev[-1].status for ev in events] == [503, 503]
    assert worker.queued == 0
    with pytest.raises(QueueFull, match="stopping"):
        worker.submit(job([]))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_max_queue_is_refused(bad):
    with pytest.raises(SPDError, match="max_queue"):
        EngineWorker(GatedBackend(), max_queue=bad)
