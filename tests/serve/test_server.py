"""`spd serve` through the real openai client, on a loopback port, against a tiny random Llama
with the default model's tokenizer: the text at T = 0 is exactly `engine.generate`'s (streaming
or not, chat or text completion), stop strings and stop ids cut where the engine cuts, bad
requests get OpenAI-shaped 4xx errors, a full queue a 429, and a client that leaves mid-stream
stops its decode without disturbing the next request."""
from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from spd import SPDEngine  # noqa: E402
from spd.errors import InternalError, SPDError  # noqa: E402
from spd.model.prompt import encode_messages  # noqa: E402
from spd.serve.backends import LocalBackend  # noqa: E402
from spd.serve.server import start_background  # noqa: E402

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from spd.model.loading import load_target, save_tiny_random_llama
    folder = save_tiny_random_llama(tmp_path_factory.mktemp("tiny-llama"))
    target = load_target(folder)
    engine = SPDEngine(target, n_stages=2, warn_untrained=False)
    server, thread = start_background(LocalBackend(engine), model_name=MODEL, port=0,
                                      max_queue=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    try:
        yield server, engine, client
    finally:
        server.stop()
        thread.join(10)


class Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def _conn(server) -> http.client.HTTPConnection:
    u = urlsplit(server.url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=60)


def _request(server, method: str, path: str, body: str | None = None) -> Reply:
    conn = _conn(server)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        return Reply(r.status, r.read().decode())
    finally:
        conn.close()


def health(server) -> dict:
    return _request(server, "GET", "/health").json()


def assert_greedy_answer_is_the_engines(engine, client, max_tokens: int) -> None:
    """A greedy chat completion now returns exactly `engine.generate`'s text (the server is
    serving correctly after whatever the test did)."""
    ref = engine.generate(MESSAGES, max_tokens)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                          temperature=0)
    assert resp.choices[0].message.content == ref.text


def wait_idle(server, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while (h := health(server))["busy"] or h["queued"]:
        assert time.monotonic() < deadline, f"the server stayed busy: {h}"
        time.sleep(0.05)
    return h


def test_models_and_health(served):
    server, _, client = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert health(server)["status"] == "ok"


def test_chat_equals_generate_streaming_or_not(served):
    _, engine, client = served
    ref = engine.generate(MESSAGES, 24)
    assert ref.text  # the comparison below must compare something
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                          temperature=0)
    choice = resp.choices[0]
    assert choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    prompt_len = len(encode_messages(engine.target.tokenizer, MESSAGES))
    assert resp.usage.prompt_tokens == prompt_len
    assert resp.usage.completion_tokens == len(ref.token_ids)
    assert resp.usage.total_tokens == prompt_len + len(ref.token_ids)
    spd = resp.usage.model_extra["spd"]
    assert (spd["n"], spd["N"], spd["K"]) == (2, ref.stats.N, ref.stats.K)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert len([c for c in chunks if c.choices]) > 3  # it streamed, token by token


def test_completion_equals_generate_streaming_or_not(served):
    _, engine, client = served
    prompt = "The capital of France is"
    ref = engine.generate(prompt, 16)
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert resp.choices[0].text == ref.text
    assert resp.usage.prompt_tokens == len(engine.target.tokenizer(prompt)["input_ids"])
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    # token ids as the prompt decode the same
    ids = engine.target.tokenizer(prompt)["input_ids"]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=16,
                                     temperature=0).choices[0].text == ref.text


def test_seeded_sampling_equals_generate(served):
    from spd import SamplingParams
    _, engine, client = served
    ref = engine.generate(MESSAGES, 12, SamplingParams(temperature=0.8, top_k=50, top_p=0.9,
                                                       seed=5))
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                          temperature=0.8, top_p=0.9, seed=5,
                                          extra_body={"top_k": 50})
    assert resp.choices[0].message.content == ref.text


def test_stop_strings_and_stop_ids_cut_where_the_engine_cuts(served):
    _, engine, client = served
    full = engine.generate(MESSAGES, 24)
    words = full.text.split()
    assert len(words) >= 3
    stop = words[2]
    cut = full.text.find(stop)
    assert cut > 0
    ref = engine.generate(MESSAGES, 24, stop=stop)
    assert ref.text == full.text[:cut] and ref.finish_reason == "stop"
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                          temperature=0, stop=[stop, "never-in-this-text"])
    assert resp.choices[0].message.content == full.text[:cut]
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens == len(ref.token_ids) < len(full.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                                 temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.text[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # a stop token id ends the decode after that token
    stop_id = full.token_ids[4]
    upto = full.token_ids.index(stop_id) + 1
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                          temperature=0, extra_body={"stop_token_ids": [stop_id]})
    assert resp.usage.completion_tokens == upto
    assert resp.choices[0].finish_reason == "stop"


def _post(server, path: str, body, raw: bool = False) -> Reply:
    return _request(server, "POST", path, body if raw else json.dumps(body))


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4o", "messages": MESSAGES}, 404, "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, 400, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "n": 2}, 400, "n"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": MESSAGES, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ""}, 400, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "seed": -3}, 400, "seed"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 5000}]}, 400, "messages"),
])
def test_bad_chat_requests_get_openai_errors(served, body, status, param):
    server, _, client = served
    body = dict(body)
    for stream in (False, True):
        r = _post(server, "/v1/chat/completions", dict(body, stream=stream))
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["message"] and err["type"]
    if body.get("model") == MODEL and "messages" in body:  # the openai client sees the same
        extra = {k: body.pop(k) for k in ("stop_token_ids",) if k in body}
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**body, extra_body=extra)
        assert info.value.status_code == status


@pytest.mark.parametrize("role", ["wizard", "User", "", "tool", "function"])
def test_a_message_role_not_served_gets_400_naming_it(served, role):
    """As OpenAI's API: a role outside its set (case counts) is a 400 that names it, and so are
    its tool roles here (no tools are served); before any decode, streamed or not."""
    server, _, client = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": role, "content": "Hi"}]
    before = wait_idle(server)
    for stream in (False, True):
        r = _post(server, "/v1/chat/completions",
                  {"model": MODEL, "messages": messages, "stream": stream})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        assert err["message"].startswith("messages.1.role: ") and f"'{role}'" in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert f"'{role}'" in str(info.value)
    after = health(server)
    assert [after[k] for k in ("served", "cancelled", "failed")] == \
        [before[k] for k in ("served", "cancelled", "failed")]  # none reached the engine


def test_every_served_role_is_accepted(served):
    """system, developer, user and assistant messages reach the chat template."""
    server, engine, client = served
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "system", "content": "Answer in English."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                          temperature=0)
    assert resp.choices[0].message.content == engine.generate(messages, 4).text


def test_malformed_json_and_bad_completion_prompts(served):
    server, _, _ = served
    for raw in ("{not json", "[1, 2]", ""):
        r = _post(server, "/v1/chat/completions", raw, raw=True)
        assert r.status_code == 400 and r.json()["error"]["message"], (raw, r.text)
    for prompt in ("", ["a", "b"], [1, -2], []):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    long = _post(server, "/v1/completions", {"model": MODEL, "prompt": "x " * 5000})
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert _post(server, "/v1/nowhere", {}).status_code == 404


def _open_stream(server, max_tokens: int):
    """A streaming request left open after its first content chunk: (client, response)."""
    conn = _conn(server)
    conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                 body=json.dumps({"model": MODEL, "messages": MESSAGES,
                                  "max_tokens": max_tokens, "temperature": 0, "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 2:  # the role chunk, then one with content
        if resp.readline().startswith(b"data: "):
            seen += 1
    return conn, resp


def test_disconnect_mid_stream_stops_the_decode_and_the_next_request_is_right(served):
    server, engine, client = served
    wait_idle(server)
    before = health(server)["cancelled"]
    conn, resp = _open_stream(server, 3000)  # far longer than the test waits
    conn.close()
    t0 = time.monotonic()
    after = wait_idle(server)
    assert after["cancelled"] == before + 1
    assert time.monotonic() - t0 < 20
    assert_greedy_answer_is_the_engines(engine, client, 20)


def test_disconnect_while_waiting_for_a_whole_answer_stops_the_decode(served):
    server, engine, client = served
    wait_idle(server)
    before = health(server)["cancelled"]
    conn = _conn(server)
    conn.request("POST", "/v1/chat/completions", headers={"content-type": "application/json"},
                 body=json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 3000,
                                  "temperature": 0}))
    deadline = time.monotonic() + 20
    while not health(server)["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.close()
    t0 = time.monotonic()
    assert wait_idle(server)["cancelled"] == before + 1
    assert time.monotonic() - t0 < 20
    assert_greedy_answer_is_the_engines(engine, client, 12)


def test_full_queue_gets_429_and_the_waiting_request_still_completes(served):
    server, engine, client = served
    wait_idle(server)
    conn, resp = _open_stream(server, 3000)  # decoding: the worker is busy
    waiting: dict = {}

    def wait_in_queue():
        waiting["resp"] = client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                         max_tokens=8, temperature=0)
    th = threading.Thread(target=wait_in_queue)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while health(server)["queued"] < 1:  # max_queue=1: the queue is full now
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    finally:
        conn.close()
        th.join(30)
    assert waiting["resp"].choices[0].message.content == engine.generate(MESSAGES, 8).text


def test_missing_fastapi_says_how_to_install(monkeypatch):
    import sys

    from spd.serve.deps import require_serve_deps
    monkeypatch.setitem(sys.modules, "fastapi", None)
    with pytest.raises(SPDError, match=r"pip install 'spd\[serve\]'"):
        require_serve_deps()


def test_cli_refuses_a_busy_port_before_loading(capsys):
    from spd.cli import main
    from spd.serve.server import bind_socket
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert main(["serve", "--port", str(sock.getsockname()[1])]) == 2
    finally:
        sock.close()
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_chat_equals_generate(default_target):
    engine = SPDEngine(default_target, n_stages=4)
    server, thread = start_background(LocalBackend(engine), model_name=MODEL, port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        ref = engine.generate(MESSAGES, 24)
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                              temperature=0)
        assert resp.choices[0].message.content == ref.text and ref.text.strip()
    finally:
        server.stop()
        thread.join(10)


def test_each_request_is_logged_with_its_id_and_token_counts(served, caplog):
    import logging
    _, engine, client = served
    with caplog.at_level(logging.INFO, logger="spd.serve"):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                              temperature=0)
        deadline = time.monotonic() + 10
        while not any(resp.id in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no log line for the request"
            time.sleep(0.02)
    line = next(r.getMessage() for r in caplog.records if resp.id in r.getMessage())
    assert f"prompt={resp.usage.prompt_tokens} new={resp.usage.completion_tokens}" in line
    assert "time=" in line


def test_log_level_flag(tmp_path):
    import logging

    from spd.cli.logs import setup_logging
    from spd.cli.main import build_parser
    p = build_parser()
    assert p.parse_args(["serve"]).log_level == "info"
    assert p.parse_args(["generate", "--prompt", "x"]).log_level == "warning"
    spd = logging.getLogger("spd")
    try:
        setup_logging("error")
        assert spd.getEffectiveLevel() == logging.ERROR
        setup_logging("debug")
        assert len([h for h in spd.handlers if getattr(h, "_spd", False)]) == 1
    finally:  # leave the logger as the other tests expect it
        for h in [h for h in spd.handlers if getattr(h, "_spd", False)]:
            spd.removeHandler(h)
        spd.setLevel(logging.NOTSET)
        spd.propagate = True


def test_a_fatal_engine_error_fails_the_request_and_stops_the_server(served):
    from spd.serve.backends import RankFailure

    _, engine, _ = served

    class Dying(LocalBackend):
        """Fails as the distributed backend does when a rank dies mid-decode."""
        fatal = (RankFailure,)

        def generate(self, job, on_token):
            on_token(engine.generate(MESSAGES, 1).token_ids[0])
            raise RankFailure("rank 2 (stage 1) was killed: killed by SIGKILL")

    server, thread = start_background(Dying(engine), model_name=MODEL, port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert info.value.status_code == 500
        assert "rank 2 (stage 1) was killed" in info.value.message
        thread.join(15)
        assert not thread.is_alive() and not server._http_thread.is_alive()
        assert server.fatal_error == "rank 2 (stage 1) was killed: killed by SIGKILL"
    finally:
        server.stop()
        thread.join(10)


def test_input_errors_are_400_and_internal_faults_500_logged_with_context(served, caplog):
    """An SPDError from the engine is the request's fault (400); an InternalError is the
    engine's (500, logged with its context), and the server goes on serving after either."""
    import logging
    _, engine, _ = served

    class Faulty(LocalBackend):
        def generate(self, job, on_token):
            if job.max_new == 3:
                raise SPDError("stop strings need the target's tokenizer")
            if job.max_new == 4:
                raise InternalError("KV cache overflow", rows=9, capacity=8)
            return super().generate(job, on_token)

    server, thread = start_background(Faulty(engine), model_name=MODEL, port=0)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert bad.value.status_code == 400 and "tokenizer" in bad.value.message
        with caplog.at_level(logging.ERROR, logger="spd.serve"):
            with pytest.raises(openai.InternalServerError) as fault:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        assert fault.value.status_code == 500
        assert "internal error: KV cache overflow (rows=9, capacity=8)" in fault.value.message
        logged = [r for r in caplog.records if "inside the engine" in r.getMessage()]
        assert logged and "'capacity': 8" in logged[0].getMessage() and logged[0].exc_info
        assert_greedy_answer_is_the_engines(engine, client, 5)  # still serving
        assert health(server)["status"] == "ok"
    finally:
        server.stop()
        thread.join(10)
