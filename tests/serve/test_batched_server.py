"""`spd serve --max-batch B` (SPD, `--mode ar` and `--mode pipeline`): requests decode together,
each in a slot of one batched cache. Through the real openai client on a loopback port (a tiny
random Llama with the default model's tokenizer): concurrent clients each get exactly their
serial answer (the pipeline's: AR's), streaming or not, greedy or seeded; a request whose context
cannot fit a slot gets a 400 naming it; a client that leaves mid-stream frees its slot. Then the
worker alone, on a stand-in batched backend: a burst of max_queue + B requests is accepted whole
and one more gets a 429; the pipeline with one slot."""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from spd import SamplingParams, SPDEngine  # noqa: E402
from spd.serve.backends import LocalBackend  # noqa: E402
from spd.serve.jobs import Job  # noqa: E402
from spd.serve.server import start_background  # noqa: E402
from spd.serve.worker import DoneEvent, EngineWorker, QueueFull  # noqa: E402

MODEL = "tiny"
QUESTIONS = ["Name three colours.", "What is two plus two?", "Say hello.", "Count to five.",
             "Name a fruit."]
SLOTS, CONTEXT = 3, 96


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from spd.model.loading import load_target, save_tiny_random_llama
    target = load_target(save_tiny_random_llama(tmp_path_factory.mktemp("tiny-llama")))
    return SPDEngine(target, n_stages=2, warn_untrained=False)


@pytest.fixture(scope="module", params=["spd", "ar", "pipeline"])
def served(tiny_engine, request):
    """(server, the serial decode of its mode, client)."""
    backend = LocalBackend(tiny_engine, request.param, max_batch=SLOTS, max_context=CONTEXT)
    server, thread = start_background(backend, model_name=MODEL, port=0, max_queue=4)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    serial = tiny_engine.generate if request.param == "spd" else tiny_engine.generate_ar
    assert f"{request.param} n={2 if request.param != 'ar' else 1}" in health(server)["backend"]
    try:
        yield server, serial, client
    finally:
        server.stop()
        thread.join(10)


def health(server) -> dict:
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def ask(client, q: str, max_tokens: int, stream: bool = False, **kw) -> str:
    args = dict(model=MODEL, messages=chat(q), max_tokens=max_tokens, **kw)
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in
                   client.chat.completions.create(stream=True, **args) if c.choices)


def test_concurrent_clients_each_get_their_serial_answer(served):
    server, serial, client = served
    assert health(server)["slots"] == SLOTS
    answers: dict[int, str] = {}

    def run(i: int) -> None:
        answers[i] = ask(client, QUESTIONS[i], 6 + 3 * i, stream=i % 2 == 1, temperature=0)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for i, q in enumerate(QUESTIONS):
        assert answers[i] == serial(chat(q), 6 + 3 * i).text, q
    seeded = ask(client, QUESTIONS[0], 10, temperature=1.0, seed=11)
    assert seeded == serial(chat(QUESTIONS[0]), 10, SamplingParams(temperature=1.0, seed=11)).text


def test_a_request_that_cannot_fit_a_slot_gets_400_naming_it(served):
    server, serial, client = served
    with pytest.raises(openai.BadRequestError, match=f"a slot holds {CONTEXT}"):
        ask(client, QUESTIONS[0], CONTEXT)
    assert ask(client, QUESTIONS[1], 4, temperature=0) == serial(
        chat(QUESTIONS[1]), 4).text  # the server serves on


def test_a_client_that_leaves_mid_stream_frees_its_slot(served):
    server, _, client = served
    before = health(server)["cancelled"]
    u = urlsplit(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                 body=json.dumps({"model": MODEL, "messages": chat(QUESTIONS[2]),
                                  "max_tokens": CONTEXT - 50, "stream": True,
                                  "temperature": 0}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    conn.close()
    deadline = time.monotonic() + 30
    while (h := health(server))["cancelled"] == before or h["slots_in_use"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.02)


class GatedBatch:
    """A stand-in batched backend: a job joins with its first token; `step` gives every job in
    a slot one more token, only once the test opens `gate`; two tokens end a job."""

    fatal = ()
    slots = 2
    target = type("Target", (), {"tokenizer": None})()

    def __init__(self):
        self.gate = threading.Event()
        self.running = []

    def join(self, job, on_token):
        seq = type("Seq", (), {})()
        seq.out, seq.done, seq.on_token = [1], False, on_token
        on_token(1)
        self.running.append(seq)
        return seq

    def step(self):
        assert self.gate.wait(20), "the test never opened the gate"
        for seq in self.running:
            seq.out.append(2)
            seq.on_token(2)
            seq.done = True
        self.running.clear()

    def leave(self, seq):
        seq.done = True

    def result(self, seq):
        r = type("Result", (), {})()
        r.token_ids, r.text, r.finish_reason = seq.out, "", "length"
        r.stats = type("Stats", (), {"summary": lambda self: ""})()
        return r


def test_a_burst_of_max_queue_plus_slots_is_accepted_and_one_more_refused(monkeypatch):
    import spd.serve.worker as worker_module

    class Pieces:  # (the stand-in has no tokenizer)
        def __init__(self, *_):
            pass

        def add(self, _tok):
            return ""

        def rest(self, _text):
            return ""
    monkeypatch.setattr(worker_module, "TextPieces", Pieces)
    backend = GatedBatch()
    worker = EngineWorker(backend, max_queue=3)
    events = [[] for _ in range(5)]
    for ev in events:  # 3 waiting + 2 slots, before the worker takes any
        worker.submit(Job("j", [1], 2, SamplingParams(), emit=ev.append))
    with pytest.raises(QueueFull):
        worker.submit(Job("j", [1], 2, SamplingParams()))
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while worker.slots_in_use < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert worker.slots_in_use == 2 and worker.queued == 3
        with pytest.raises(QueueFull):
            worker.submit(Job("j", [1], 2, SamplingParams()))
        backend.gate.set()
        while not all(ev and isinstance(ev[-1], DoneEvent) for ev in events):
            assert time.monotonic() < deadline, events
            time.sleep(0.01)
    finally:
        worker.stop()
        thread.join(10)
    assert worker.counts["served"] == 5 and worker.queued == 0


def test_serve_defaults_to_eight_slots_token_trees_included(tiny_engine):
    from spd.cli.serve import default_max_batch
    tree = SPDEngine(tiny_engine.target, n_stages=2, warn_untrained=False, tree_width=2)
    assert default_max_batch(tiny_engine, "spd") == 8
    assert default_max_batch(tree, "spd") == 8 and default_max_batch(tree, "ar") == 8
    assert default_max_batch(tree, "pipeline") == 8
    backend = LocalBackend(tree, "spd", max_batch=2, prefill_chunk=4)
    assert backend.batch.width == 2 and backend.batch.prefill_chunk == 4
    from conftest import make_tiny_hybrid  # (a hybrid target batches on every path)
    hybrid = SPDEngine(make_tiny_hybrid(seed=1, vocab=32), n_stages=2, warn_untrained=False)
    assert all(default_max_batch(hybrid, m) == 8 for m in ("spd", "ar", "pipeline"))
    assert LocalBackend(hybrid, "spd", max_batch=2, max_context=64).batch.slots == 2


def test_the_pipeline_with_one_slot_serves_through_its_batch_and_a_cancel_frees_it(tiny_engine):
    """`--mode pipeline --max-batch 1`: the worker's `generate` runs the job in the batch's one
    slot (AR's tokens); a job cancelled mid-decode leaves it free for the next."""
    from spd.serve.backends import DecodeCancelled
    backend = LocalBackend(tiny_engine, "pipeline", max_batch=1, max_context=CONTEXT)
    ids = [5, 9, 2, 7]
    seen = []
    result = backend.generate(Job("a", ids, 6, SamplingParams()), seen.append)
    assert result.token_ids == seen == tiny_engine.generate_ar(ids, 6).token_ids
    job = Job("b", ids, 6, SamplingParams())
    with pytest.raises(DecodeCancelled):
        backend.generate(job, lambda tok: job.cancel.set())
    assert not backend.batch.running and backend.batch.free == [0]
    assert backend.generate(Job("c", ids, 6, SamplingParams()), lambda _t: None).token_ids == seen
