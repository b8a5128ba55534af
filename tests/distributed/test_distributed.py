"""Distributed runtime on CPU (gloo on 127.0.0.1): the launcher and the transport; faults end
every rank within the bound and name the failed rank; torchrun across two "nodes" on loopback;
bad input gets clear errors. (Decodes against the reference decoder in every runtime:
tests/runtime/test_cycle.py.)

Every launch is bounded (launch_local's timeout, subprocess timeouts) and every process group a
test starts is killed in a finally block, so a bug fails a test instead of hanging CI.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

import pytest
from conftest import make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd.cli import main
from spd.distributed.config import DistConfig, GenerateRequest, parse_fault
from spd.distributed.faults import RankFailedError
from spd.distributed.handshake import check_handshake
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_forever, run_requests
from spd.draft.drafters import ReferenceDrafter
from spd.errors import SPDError
from spd.model.prompt import encode_prompt
from spd.model.target import TargetModel

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
PY = sys.executable
REPO = Path(__file__).resolve().parents[2]


def tiny_factory(seed: int, rank: int, odd_rank: int | None = None):
    """The target every rank builds (identical weights from the seed); odd_rank gets another."""
    return make_tiny_target(seed=seed + (1000 if rank == odd_rank else 0), vocab=48, layers=4)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _group_members(pgid: int) -> list[str]:
    """'pid state cmdline' of every process in the group (zombies included): for messages."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(f"{entry} {fields[0]} {cmd}")
    return out


def _group_alive(pgid: int) -> bool:
    """Is any process of the group still running? (Zombies do not count: this container's init
    does not reap re-parented children, so their entries linger after they have died.)"""
    return any(m.split()[1] != "Z" for m in _group_members(pgid))


def _group_gone(pgid: int, within: float = 10.0) -> bool:
    """True once no process of the group is left (helpers such as multiprocessing's fork server
    leave a moment after their parent); polls a condition, bounded by `within` seconds."""
    deadline = time.monotonic() + within
    while _group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the launcher, the transport ------------------------------------------------------------------
# (every decode against the reference decoder, wherever the stages run: tests/runtime/test_cycle.py)
def _spd_env_of_rank0(engine) -> dict:
    return {k: v for k, v in os.environ.items() if k.startswith("SPD_TEST_")}


def test_ranks_take_the_launchers_spd_variables_at_each_launch(monkeypatch):
    """The ranks fork from a fork server started at this process's first launch; a variable
    set or removed after it still reaches (or leaves) the next launch's ranks."""
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 7), fault_timeout=5.0,
                        op_timeout=60.0)
    monkeypatch.setenv("SPD_TEST_GONE", "1")
    assert launch_local(config, _spd_env_of_rank0, timeout=120) == {"SPD_TEST_GONE": "1"}
    monkeypatch.delenv("SPD_TEST_GONE")
    monkeypatch.setenv("SPD_TEST_LATER", "on")
    assert launch_local(config, _spd_env_of_rank0, timeout=120) == {"SPD_TEST_LATER": "on"}


def test_host_staged_transport_is_exact():
    """The path that carries GPU tensors over gloo (host copies, copy back on wait), forced on
    CPU: same tokens and counts as the single-process engine."""
    t = make_tiny_target(seed=12, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=2)
    ref = PROMPT + eng.generate_ar(PROMPT, 20).token_ids
    want = eng.generate(PROMPT, 20, drafter=ReferenceDrafter(ref, 0.6, 4))
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 12), fault_timeout=5.0,
                        op_timeout=60.0, stage_through_host=True)
    one = eng.generate(PROMPT, 1)  # the prompt's pick alone: the ranks run to the end cycle
    got, got_one = launch_local(config, partial(run_requests, [GenerateRequest(
        PROMPT, 20, reference=ref, reference_accuracy=0.6, reference_seed=4),
        GenerateRequest(PROMPT, 1)]), timeout=120)
    assert got.token_ids == want.token_ids
    assert (got.stats.N, got.stats.K) == (want.stats.N, want.stats.K)
    assert got_one.token_ids == one.token_ids
    assert (got_one.stats.N, got_one.stats.K) == (one.stats.N, one.stats.K)
    assert got.stats.distributed["host_staged_receives"] > got.stats.K  # snaps and more


def cuda_tiny_factory(seed: int, rank: int):
    t = make_tiny_target(seed=seed, vocab=48, layers=4)
    return TargetModel(t.hf.to("cuda"), None, name=t.name)


@pytest.mark.gpu
@needs_gpu
def test_gpu_ranks_sharing_one_gpu_match_single_process():
    """Every rank on one GPU (gloo through host memory): the stage forwards, truncation kernels
    and the CUDA-graph draft step on the device, exactly the single-process engine's output."""
    n = 3
    t = cuda_tiny_factory(20, 0)
    eng = SPDEngine(t, n_stages=n)
    ref = PROMPT + eng.generate_ar(PROMPT, 24).token_ids
    sp = SamplingParams(temperature=1.0, top_k=10, seed=3)
    cases = [(GenerateRequest(PROMPT, 24), {}),
             (GenerateRequest(PROMPT, 24, reference=ref, reference_accuracy=0.6, reference_seed=2),
              {"drafter": ReferenceDrafter(ref, 0.6, 2)}),
             (GenerateRequest(PROMPT, 24, sp), {"sampling": sp})]
    expected = [eng.generate(PROMPT, 24, **kw) for _, kw in cases]
    config = DistConfig(n_stages=n, target_factory=partial(cuda_tiny_factory, 20), device="cuda",
                        backend="gloo", fault_timeout=10.0, op_timeout=60.0)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=180)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert (g.stats.N, g.stats.K) == (e.stats.N, e.stats.K)
        assert g.stats.distributed["backend"] == "gloo"
        assert g.stats.distributed["host_staged_receives"] > 0


# --- faults -------------------------------------------------------------------------------------
def test_raising_draft_rank_stops_every_rank():
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 3), fault_timeout=3.0,
                        op_timeout=60.0, fault={"rank": 0, "cycle": 4, "action": "raise"})
    pids = {}
    with pytest.raises(RankFailedError) as info:
        launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 40)]),
                     on_spawn=pids.update, timeout=120)
    err = info.value
    assert err.rank == 0 and "draft rank" in str(err) and "injected fault at cycle 4" in str(err)
    # The draft rank exited with an error; the stage ranks stopped by themselves (status 3), i.e.
    # within the launcher's grace of fault_timeout + 2 s, before anything had to be killed.
    assert err.exitcodes[0] == 1
    assert all(err.exitcodes[r] == 3 for r in (1, 2)), err.exitcodes
    assert err.stopped_s < config.fault_timeout + 2.5
    assert not any(_alive(p) for p in pids.values())


def _run_forever_in_thread(config):
    """launch_local of a long generation in a thread: (thread, event set at rank 0's first
    token, {rank: pid}, {"error": what the launcher raised})."""
    started = mp.get_context("spawn").Event()
    pids, box = {}, {}

    def run():
        try:
            launch_local(config, partial(run_forever, GenerateRequest(PROMPT, 40),
                                         progress=started), on_spawn=pids.update, timeout=150)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, started, pids, box


def test_killed_stage_rank_ends_the_run_within_the_bound():
    config = DistConfig(n_stages=3, target_factory=partial(tiny_factory, 5), fault_timeout=3.0,
                        op_timeout=60.0)
    th, started, pids, box = _run_forever_in_thread(config)
    try:
        assert started.wait(120), "rank 0 never produced a token"
        t_kill = time.monotonic()
        os.kill(pids[2], signal.SIGKILL)  # stage 1, in the middle of the pipeline
        th.join(60)
        elapsed = time.monotonic() - t_kill
        assert not th.is_alive(), "the launcher did not return"
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    err = box.get("error")
    assert isinstance(err, RankFailedError), err
    assert err.rank == 2 and "stage 1" in str(err) and "SIGKILL" in str(err)
    assert elapsed < config.fault_timeout + 3.0
    assert err.exitcodes[2] == -signal.SIGKILL
    assert all(err.exitcodes[r] == 3 for r in (0, 1, 3)), err.exitcodes
    assert not any(_alive(p) for p in pids.values())


def test_frozen_stage_rank_ends_every_rank_within_the_timeout():
    """SIGSTOP on a stage rank: its heartbeat stops, a watchdog names it after the fault timeout,
    and the launcher kills the frozen rank at once (it cannot leave by itself): every rank is
    gone within the timeout plus a watchdog interval and the launcher's poll."""
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 6), fault_timeout=3.0,
                        op_timeout=60.0)
    th, started, pids, box = _run_forever_in_thread(config)
    try:
        assert started.wait(120), "rank 0 never produced a token"
        t_stop = time.monotonic()
        os.kill(pids[2], signal.SIGSTOP)  # the last stage, frozen
        th.join(60)
        elapsed = time.monotonic() - t_stop
        assert not th.is_alive(), "the launcher did not return"
    finally:
        for pid in pids.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGCONT)
    err = box.get("error")
    assert isinstance(err, RankFailedError), err
    assert err.rank == 2 and "stage 1" in str(err) and "no heartbeat" in str(err)
    assert elapsed < config.fault_timeout + 2.5, elapsed
    assert err.exitcodes[2] == -signal.SIGKILL
    assert all(err.exitcodes[r] == 3 for r in (0, 1)), err.exitcodes
    assert not any(_alive(p) for p in pids.values())


# --- bad input ----------------------------------------------------------------------------------
def test_mismatched_model_on_one_rank_is_refused():
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 4, odd_rank=2),
                        fault_timeout=3.0, op_timeout=60.0)
    with pytest.raises(SPDError, match=r"rank 2 \(stage 1\) disagrees with rank 0 on the target "
                                       r"model"):
        launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 4)]), timeout=120)


def test_handshake_checks_pdm_and_layout():
    base = {"rank": 0, "world_size": 3, "spd_version": "x", "n_stages": 2, "draft_on_stage": None,
            "stage_split": [2, 2], "anchors": [0, 2], "target_fingerprint": "f",
            "target_name": "m", "dtype": "float32", "pdm": "abc", "pdm_path": "/a"}
    check_handshake([base, dict(base, rank=1), dict(base, rank=2)])
    with pytest.raises(SPDError, match=r"rank 1 \(stage 0\).*PDM checkpoint.*/b"):
        check_handshake([base, dict(base, rank=1, pdm="def", pdm_path="/b"), dict(base, rank=2)])
    with pytest.raises(SPDError, match=r"rank 2 \(stage 1\).*stage split"):
        check_handshake([base, dict(base, rank=1), dict(base, rank=2, stage_split=[3, 1])])
    with pytest.raises(SPDError, match=r"rank 1 \(stage 0\).*draft's stage"):
        check_handshake([base, dict(base, rank=1, draft_on_stage=0), dict(base, rank=2)])


def test_busy_port_is_a_clear_error(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SPDError, match=f"port {port} on 127.0.0.1 is busy"):
            launch_local(DistConfig(n_stages=2), None, master_port=port)
        rc = main(["generate", "--distributed", "--stages", "2", "--prompt", "hi",
                   "--master-port", str(port)])
    assert rc == 2 and "is busy" in capsys.readouterr().err


def test_world_size_must_be_n_plus_1(monkeypatch, capsys):
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    rc = main(["generate", "--stages", "2", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "WORLD_SIZE=4" in err and "--nproc-per-node 3" in err


def test_bad_distributed_options(capsys):
    assert main(["generate", "--distributed", "--stages", "1", "--prompt", "hi"]) == 2
    assert "at least 2 stages" in capsys.readouterr().err
    assert main(["generate", "--distributed", "--mode", "ar", "--prompt", "hi"]) == 2
    assert "single-process only" in capsys.readouterr().err
    assert main(["generate", "--distributed", "--fault-timeout", "0", "--prompt", "hi"]) == 2
    assert "fault timeout" in capsys.readouterr().err
    assert parse_fault("rank=3,cycle=2,action=kill") == {"rank": 3, "cycle": 2, "action": "kill"}
    with pytest.raises(SPDError):
        parse_fault("cycle=2")


# --- command line: torchrun on two "nodes", self-launch, Ctrl-C ----------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama with the default model's tokenizer, as a local HF folder (fast to load)."""
    from spd.model.loading import save_tiny_random_llama
    folder = save_tiny_random_llama(tmp_path_factory.mktemp("tiny-llama"))
    return str(folder)


def _single_process(model_dir: str, n: int, prompt: str, max_new: int) -> list[int]:
    from spd.model.loading import load_target
    t = load_target(model_dir)
    ids = encode_prompt(t.tokenizer, prompt, True)
    return SPDEngine(t, n_stages=n).generate(ids, max_new).token_ids


def _torchrun(node_rank: int, port: int, extra_env: dict, args: list[str]) -> subprocess.Popen:
    cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
           "--monitor-interval", "0.5", "-m", "spd", "generate"] + args
    env = dict(os.environ, **extra_env)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, start_new_session=True)


def test_torchrun_two_nodes_on_loopback(tiny_model_dir):
    prompt = "Name three colours."
    args = ["--model", tiny_model_dir, "--stages", "3", "--prompt", prompt,
            "--max-new-tokens", "16", "--json", "--fault-timeout", "5"]
    port = _free_port()
    procs = [_torchrun(i, port, {}, args) for i in (0, 1)]
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    result = json.loads(outs[0][0].strip().splitlines()[-1])  # rank 0 lives on node 0
    assert outs[1][0].strip() == ""                          # node 1 holds stages only
    assert result["stats"]["distributed"]["world_size"] == 4
    expected = _single_process(tiny_model_dir, 3, prompt, 16)
    assert result["token_ids"] == expected


def test_torchrun_killed_rank_on_other_node_stops_both_nodes(tiny_model_dir):
    args = ["--model", tiny_model_dir, "--stages", "3", "--prompt", "Count to one hundred.",
            "--max-new-tokens", "2000", "--json", "--fault-timeout", "3"]
    port = _free_port()
    fault = {"SPD_FAULT_INJECT": "rank=3,cycle=3,action=kill"}  # the last stage, on node 1
    procs = [_torchrun(i, port, fault, args) for i in (0, 1)]
    t0 = time.monotonic()
    try:
        outs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            _kill_group(p)
    assert procs[0].returncode != 0 and procs[1].returncode != 0
    # Node 0's ranks name the rank that died on the other node.
    assert "rank 3 (stage 2)" in outs[0][1], outs[0][1][-3000:]
    assert time.monotonic() - t0 < 120
    assert _group_gone(procs[0].pid) and _group_gone(procs[1].pid)


# A rank process on its own: rank `rank` of `world` against the test's store (its host is the test)
_RANK_SCRIPT = """
import json, os, sys, time
from datetime import timedelta
from spd.distributed.config import DistConfig
from spd.distributed.transport import CommError, Runtime
port, rank, world, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rt = Runtime(rank, world, DistConfig(n_stages=world - 1, fault_timeout=1.0), "127.0.0.1", port,
             secret=os.environ.get("SPD_RUN_SECRET"))
print("ready", flush=True)
if mode == "block":  # inside a C++ call, where no Python signal handler runs
    rt.store.wait(["never"], timedelta(seconds=60))
else:  # a failed wait on rank 2, as gloo reports a closed connection
    rec = rt.blame_after_comm_error(CommError(2, "hidden state", RuntimeError("Connection closed")),
                                    0.2)
    print(json.dumps(rec), flush=True)
"""


def _rank_process(port, rank, world, mode, env=None):
    proc = subprocess.Popen([PY, "-c", _RANK_SCRIPT, str(port), str(rank), str(world), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO / "python"), **(env or {})),
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready and proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
    return proc


def _test_store():
    import torch.distributed as dist
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return master, dist.PrefixStore("spd/", master)


def test_sigterm_marks_the_rank_and_ends_it_even_inside_a_blocking_call():
    """torchrun stops a node's other ranks with SIGTERM when one fails. A rank blocked in C++
    (gloo, the store) runs no Python handler, so its watchdog acts: it marks the store and the
    process ends with status 143 at once."""
    from spd.distributed.faults import EXIT_TERMINATED
    master, store = _test_store()
    proc = _rank_process(master.port, 1, 3, "block")
    try:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        assert time.monotonic() - t0 < 10
    finally:
        _kill_group(proc)
    assert proc.returncode == EXIT_TERMINATED, proc.stderr.read()[-2000:]
    assert store.check(["term/1"]) and not store.check(["fail/first"])
    assert "stopped by SIGTERM" in proc.stderr.read()


@pytest.mark.parametrize("marked", [True, False])
def test_a_lost_connection_blames_the_silent_rank_not_the_one_its_launcher_stopped(marked):
    """Ranks 2 and 3 are silent (heartbeats stopped); rank 2 was stopped by its launcher
    (marked) after rank 3 died. The wait on rank 2 failed, yet the record names rank 3, from the
    watchdog. Unmarked, rank 2 is named at once: the mark is what makes the difference."""
    import json as _json
    master, store = _test_store()
    for r, count in ((1, 1 << 40), (2, 5), (3, 5)):  # rank 1 finished; 2 and 3 went silent
        store.add(f"hb/{r}", count)
    if marked:
        store.set("term/2", "1")
    proc = _rank_process(master.port, 0, 4, "blame")
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        _kill_group(proc)
    rec = _json.loads(store.get("fail/first"))
    # marked: only the watchdog's verdict (no heartbeat from rank 3) can name anyone in time;
    # unmarked: the failed wait names rank 2 at once (or, on a stalled machine, the watchdog does)
    assert (rec["rank"], rec["kind"]) == ((3 if marked else 2), "lost"), (rec, err[-2000:])
    if marked:
        assert "no heartbeat" in rec["error"]


@pytest.mark.slow
def test_cli_self_launch_default_model_matches_single_process(default_target):
    prompt = "Explain how a CPU cache works."
    cmd = [PY, "-m", "spd", "generate", "--distributed", "--stages", "2", "--prompt", prompt,
           "--max-new-tokens", "12", "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        _kill_group(proc)
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    ids = encode_prompt(default_target.tokenizer, prompt, True)
    expected = SPDEngine(default_target, n_stages=2).generate(ids, 12)
    assert result["token_ids"] == expected.token_ids
    st = result["stats"]
    assert (st["N"], st["K"]) == (expected.stats.N, expected.stats.K)
    assert st["distributed"]["ranks"][2]["forward_ms"]["mean"] > 0
    assert _group_gone(proc.pid)


def test_ctrl_c_stops_the_self_launched_ranks(tiny_model_dir):
    cmd = [PY, "-m", "spd", "generate", "--distributed", "--stages", "2", "--model",
           tiny_model_dir, "--prompt", "Tell me a long story.", "--max-new-tokens", "3500",
           "--no-chat"]
    # A shell without job control starts background jobs with SIGINT ignored, and Python then
    # never raises KeyboardInterrupt: give the launcher the default, as a terminal's job has.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)  # bounded wait for output
        first = proc.stdout.read(1) if ready else b""  # streaming has begun: ranks are decoding
        assert first, "no output within 120 s"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # say which processes hung and what they printed
            alive = _group_members(proc.pid)
            _kill_group(proc)
            pytest.fail(f"still running 30 s after Ctrl-C: {alive}\nstderr:\n"
                        f"{proc.stderr.read().decode()[-3000:]}")
        elapsed = time.monotonic() - t0
        err = proc.stderr.read().decode()
    finally:
        _kill_group(proc)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err
    assert elapsed < 10
    assert _group_gone(proc.pid)


def test_forged_failure_record_is_ignored_and_a_signed_one_stops_the_run():
    """Whoever reaches the store's port can write a failure record; ranks take only records
    signed with the run's secret (which travels in the environment, never the store)."""
    from spd.distributed.faults import EXIT_PEER, Signer, write_failure
    secret = "s3cret-for-this-test"
    master, store = _test_store()
    proc = _rank_process(master.port, 1, 3, "block", env={"SPD_RUN_SECRET": secret})
    try:
        store.set("fail/first", json.dumps({"rank": 2, "kind": "error", "error": "forged",
                                            "reporter": 2}))
        time.sleep(1.5)  # 15 watchdog intervals (fault timeout 1 s)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert secret not in "".join(store.get(k).decode(errors="replace")
                                     for k in ("hb/1", "proc/1", "fail/first"))
        t0 = time.monotonic()
        rec = write_failure(store, 2, "error", "genuine failure", 2, Signer(secret))
        assert rec["error"] == "genuine failure"  # it replaced the forged record
        proc.wait(10)
        assert time.monotonic() - t0 < 5
    finally:
        _kill_group(proc)
    err = proc.stderr.read()
    assert proc.returncode == EXIT_PEER, err[-2000:]
    assert "not signed with this run's secret" in err and err.count("not signed") == 1
    assert "stopping: rank 2 (stage 1) failed: genuine failure" in err and "forged" not in err


def _launch_cli(model_dir: str, *extra: str) -> tuple[subprocess.Popen, list[int], set[int]]:
    """The self-launcher on the tiny model, decoding (first output seen); its rank pids and its
    fork server's (the ranks' parent)."""
    cmd = [PY, "-m", "spd", "generate", "--distributed", "--stages", "2", "--model", model_dir,
           "--prompt", "Tell me a long story.", "--max-new-tokens", "100000", "--no-chat",
           "--fault-timeout", "3", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    if not ready or not proc.stdout.read(1):
        _kill_group(proc)
        pytest.fail("no output within 120 s: " + proc.stderr.read().decode()[-3000:])
    members = [m.split(None, 2) for m in _group_members(proc.pid)]
    servers = {int(pid) for pid, state, cmd in members if "forkserver" in cmd}
    ranks = []
    for pid, state, _ in members:
        with open(f"/proc/{pid}/stat") as f:
            if int(f.read().rsplit(")", 1)[1].split()[1]) in servers and state != "Z":
                ranks.append(int(pid))
    assert len(ranks) == 3, members
    return proc, ranks, servers - set(ranks)  # the ranks were forked from it: same command


def _wait_gone(pids: list[int], within: float) -> float | None:
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - t0 > within:
            return None
        time.sleep(0.05)
    return time.monotonic() - t0


def test_frozen_launcher_ends_its_ranks_within_the_timeout(tiny_model_dir):
    """SIGSTOP on the self-launcher freezes the store it hosts: each rank's guard sees the store
    silent for the fault timeout and leaves with one line saying the launcher is frozen."""
    proc, ranks, _ = _launch_cli(tiny_model_dir)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        gone = _wait_gone(ranks, 3.0 + 4.0)
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        _kill_group(proc)
    err = proc.stderr.read().decode(errors="replace")
    assert gone is not None, f"ranks still running 7 s after the launcher froze\n{err[-2000:]}"
    for r in range(3):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"spd: rank {r} ")]
        assert len(lines) == 1 and "launcher" in lines[0] and "not answering" in lines[0] \
            and "frozen" in lines[0], err[-3000:]


@pytest.mark.parametrize("sig,then_fork_server", [(signal.SIGTERM, False),
                                                  (signal.SIGKILL, False),
                                                  (signal.SIGKILL, True)])
def test_stopped_launcher_ends_its_ranks_with_one_line_each(tiny_model_dir, sig,
                                                            then_fork_server):
    """SIGTERM to the launcher is forwarded (record, then SIGTERM) and it leaves with 143;
    after a SIGKILL the ranks see it gone. Either way each rank prints one clear line (no C++
    stack frames, no rank blamed) and every process is gone promptly. `then_fork_server`: the
    ranks' parent (multiprocessing's fork server, which leaves when the launcher does) dies at
    once too, as it may before any rank has looked at its launcher: the parent-death signal
    must still let each rank say why it stops."""
    proc, ranks, servers = _launch_cli(tiny_model_dir)
    try:
        os.kill(proc.pid, sig)
        for pid in servers if then_fork_server else ():
            os.kill(pid, signal.SIGKILL)
        gone = _wait_gone(ranks, 10.0)
        proc.wait(10)
        assert _group_gone(proc.pid)
    finally:
        _kill_group(proc)
    err = proc.stderr.read().decode(errors="replace")
    assert gone is not None and gone < 5.0, err[-3000:]
    assert proc.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
    assert "frame #" not in err and "Traceback" not in err, err[-3000:]
    for r in range(3):
        lines = [ln for ln in err.splitlines() if ln.startswith(f"spd: rank {r} ")]
        assert len(lines) == 1, err[-3000:]
        assert "launcher" in lines[0] or "SIGTERM" in lines[0], lines[0]
        assert "was lost" not in lines[0] and "failed" not in lines[0], lines[0]
