"""`spd serve --distributed --stages 3` on gloo and the CPU, as a user starts it: two requests in
a row give exactly the single-process engine's text, a client that leaves mid-stream frees the
ranks for the next request, four clients at once (one batch session) get theirs (also with the
draft on a stage), and a stage
rank that dies fails the request in flight with a 500 naming it and stops the server (exit
status 1, the same message). Without HTTP: rank 0's `generate` ends a cancelled decode at its
next token and a stop id where the single-process engine does, and the next decode is whole.

Every server is started in its own process group and killed in a finally block."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import make_tiny_target  # noqa: E402

from spd import SPDEngine  # noqa: E402
from spd.distributed.config import DistConfig  # noqa: E402
from spd.distributed.launch import launch_local  # noqa: E402
from spd.model.prompt import encode_messages  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from spd.model.loading import save_tiny_random_llama
    return save_tiny_random_llama(tmp_path_factory.mktemp("tiny-llama"))


def _start(tiny_dir, port: int, env_extra: dict | None = None,
           extra: tuple = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spd", "serve", "--distributed", "--stages", "3",
           "--backend", "gloo", "--model", str(tiny_dir), "--served-model-name", MODEL,
           "--port", str(port), "--threads", "1", "--fault-timeout", "5", *extra]
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)


def _wait_up(proc: subprocess.Popen, port: int, timeout: float = 150.0) -> None:
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the server exited with {proc.returncode}: {err[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.loads(r.read())["status"] == "ok":
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail("the distributed server did not come up in time")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate(timeout=30)


def _client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def _slots(port: int) -> int:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return json.loads(r.read())["slots"]


def _at_once(port: int, chats: list, max_tokens: int) -> list:
    """Every chat from its own client thread at once (greedy) -> the responses, in order."""
    client = _client(port)
    with ThreadPoolExecutor(len(chats)) as pool:
        return list(pool.map(lambda m: client.chat.completions.create(
            model=MODEL, messages=m, max_tokens=max_tokens, temperature=0), chats))


def test_two_requests_equal_the_single_process_engine_and_a_disconnect(tiny_dir):
    from spd.model.loading import load_target
    target = load_target(tiny_dir)
    engine = SPDEngine(target, n_stages=3, warn_untrained=False)
    asks = [[{"role": "user", "content": "Name three colours."}],
            [{"role": "user", "content": "What is a CPU cache?"}]]
    refs = [engine.generate(m, 16) for m in asks]
    port = _free_port()
    proc = _start(tiny_dir, port)
    try:
        _wait_up(proc, port)
        client = _client(port)
        for messages, ref in zip(asks, refs):
            resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                                  temperature=0)
            assert resp.choices[0].message.content == ref.text
            assert resp.usage.completion_tokens == len(ref.token_ids)
            assert resp.usage.prompt_tokens == len(encode_messages(target.tokenizer, messages))
            spd = resp.usage.model_extra["spd"]
            assert (spd["n"], spd["N"], spd["K"]) == (3, ref.stats.N, ref.stats.K)
        # a client that leaves mid-stream: the ranks finish that decode early and serve on
        stream = client.chat.completions.create(model=MODEL, messages=asks[0], max_tokens=2000,
                                                temperature=0, stream=True)
        for i, _chunk in enumerate(stream):
            if i == 2:
                break
        stream.close()
        chunks = list(client.chat.completions.create(model=MODEL, messages=asks[1],
                                                     max_tokens=16, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == refs[1].text
        # four clients at once share the ranks (a batch session: each its own speculation)
        many = asks + [[{"role": "user", "content": q}] for q in ("Hi.", "Count to five.")]
        want = [engine.generate(m, 16).text for m in many]
        got = _at_once(port, many, 16)
        assert [r.choices[0].message.content for r in got] == want
    finally:
        _kill_group(proc)


def test_clients_at_once_with_the_draft_on_a_stage(tiny_dir):
    """`--draft-on-stage 1` (3 processes for 3 stages): three clients at once share one batch
    session, stage 1 running in rank 0's process; each gets the single-process engine's text,
    and /health counts the slots (8 by default)."""
    from spd.model.loading import load_target
    engine = SPDEngine(load_target(tiny_dir), n_stages=3, warn_untrained=False)
    many = [[{"role": "user", "content": q}] for q in ("Hi.", "Count to five.",
                                                       "Name three colours.")]
    want = [engine.generate(m, 12).text for m in many]
    port = _free_port()
    proc = _start(tiny_dir, port, extra=("--draft-on-stage", "1"))
    try:
        _wait_up(proc, port)
        assert _slots(port) == 8
        got = _at_once(port, many, 12)
        assert [r.choices[0].message.content for r in got] == want
    finally:
        _kill_group(proc)


def test_the_pipeline_without_speculation_served_across_ranks(tiny_dir):
    """`--mode pipeline --max-batch 2` on 3 stage ranks: the baseline as a server. Three
    clients at once (one waits for a slot) each get AR's text; /health counts the slots."""
    from spd.model.loading import load_target
    engine = SPDEngine(load_target(tiny_dir), n_stages=3, warn_untrained=False)
    many = [[{"role": "user", "content": q}] for q in ("Hi.", "Count to five.",
                                                       "Name three colours.")]
    want = [engine.generate_ar(m, 12).text for m in many]
    port = _free_port()
    proc = _start(tiny_dir, port, extra=("--mode", "pipeline", "--max-batch", "2"))
    try:
        _wait_up(proc, port)
        assert _slots(port) == 2
        got = _at_once(port, many, 12)
        assert [r.choices[0].message.content for r in got] == want
        assert all(r.usage.model_extra["spd"]["mode"] == "pp" for r in got)
    finally:
        _kill_group(proc)


def test_a_stage_rank_that_dies_fails_the_request_and_stops_the_server(tiny_dir):
    port = _free_port()
    proc = _start(tiny_dir, port, {"SPD_FAULT_INJECT": "rank=2,cycle=20,action=kill"})
    try:
        _wait_up(proc, port)
        with pytest.raises(openai.InternalServerError) as info:
            _client(port).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=200,
                temperature=0)
        assert info.value.status_code == 500
        assert "rank 2 (stage 1)" in info.value.message
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "the server stopped: rank 2 (stage 1) was killed" in err
    finally:
        if proc.poll() is None:
            _kill_group(proc)


# --- DistributedSPDEngine.generate's serving contract, without HTTP -------------------------------
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _tiny(rank: int):
    return make_tiny_target(seed=5, vocab=48, layers=4)


def _cancel_stop_then_continue(stop_id: int, engine):
    """Rank 0's job: a decode cancelled at its 5th token, one ended by a stop id, a whole one."""
    cancel, seen = threading.Event(), []

    def tick(token):
        seen.append(token)
        if len(seen) == 5:
            cancel.set()
    cut = engine.generate(PROMPT, 40, on_token=tick, cancel=cancel)
    stopped = engine.generate(PROMPT, 40, stop_token_ids=[stop_id])
    whole = engine.generate(PROMPT, 40)
    return [(r.token_ids, r.finish_reason) for r in (cut, stopped, whole)]


def test_distributed_cancel_and_stop_ids_keep_the_ranks_in_step():
    full = SPDEngine(_tiny(0), n_stages=3, warn_untrained=False).generate(PROMPT, 40).token_ids
    stop_id = full[9]
    config = DistConfig(n_stages=3, target_factory=_tiny, fault_timeout=5.0, op_timeout=60.0)
    cut, stopped, whole = launch_local(config, partial(_cancel_stop_then_continue, stop_id),
                                       timeout=150)
    assert cut == (full[:6], "stop")  # ends at the token after the one that cancelled
    assert stopped == (full[:full.index(stop_id) + 1], "stop")
    assert whole == (full, "length")


def test_modes_the_ranks_do_not_serve_are_refused_before_launching(tiny_dir, capsys):
    """`--mode ar` stays single-process, and the pipeline drafts nothing, so it takes no
    `--draft-on-stage`: each a one-line error (exit status 2) before any rank starts."""
    from spd.cli.main import main
    base = ["serve", "--distributed", "--stages", "2", "--model", str(tiny_dir), "--port", "0"]
    assert main([*base, "--mode", "ar"]) == 2
    assert "single-process only" in capsys.readouterr().err
    assert main([*base, "--mode", "pipeline", "--draft-on-stage", "1"]) == 2
    assert "drop --draft-on-stage" in capsys.readouterr().err
