"""Starting the distributed runtime: local self-launch and torchrun.

  python -m spd generate --distributed --stages N ...     spawns N + 1 local ranks (this module)
  torchrun --nproc-per-node N+1 -m spd generate ...       one rank per torchrun worker
  torchrun --nnodes 2 --node-rank {0,1} --master-addr A --master-port P --nproc-per-node K ...

The local launcher hosts the rendezvous store itself (a busy port fails here, before any rank
starts), watches its ranks, and on the first failure names the failed rank, kills it if it is
still there (a lost rank is frozen or hung), lets the others stop through their watchdogs (they
see the record within one watchdog interval) and kills what is left. SIGTERM or SIGINT to the
launcher stops the ranks (a record, then SIGTERM) and ends it with 143 or 130. It makes a random
per-run secret that signs the records able to stop the run; the ranks get it as an argument and
in their environment (SPD_RUN_SECRET), never through the store. Ranks fork from a fork server
that exits with the launcher, and die with it (PR_SET_PDEATHSIG); they take the launcher's SPD_*
variables as they are at launch (the fork server keeps those of its own start). A rank also
leaves by itself, with one line, when the launcher is gone or its store stops answering for the
fault timeout.

This module imports only the standard library at import time (the CLI imports it).
"""
from __future__ import annotations

import os
import signal
import sys
import time

from spd.errors import InternalError, SPDError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS)


# --- local launcher -----------------------------------------------------------------------------
def _set_pdeathsig() -> None:
    """Linux: this process gets SIGTERM when its parent (the fork server, which leaves with the
    launcher) dies. Not SIGKILL: the fork server can leave before the rank's guard has seen the
    launcher gone, and a killed rank could not say why it stopped; its SIGTERM handling (the
    guard thread, see faults) prints one line naming the launcher and leaves."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LauncherTerminated(BaseException):
    """The launcher got SIGTERM."""


def _local_rank_main(rank, world, config, job, host, port, conn, launcher_pid, secret,
                     spd_env):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher handles Ctrl-C for everyone
    # The launcher's SPD_* settings as they are now: the fork server holds the environment of
    # the first launch of this process, which a later launch may have changed.
    for name in [k for k in os.environ if k.startswith("SPD_") and k not in spd_env]:
        del os.environ[name]
    os.environ.update(spd_env)
    from spd import env
    os.environ[env.RUN_SECRET.name] = secret  # for what this rank starts; never in the store
    # Our parent is the fork server, which exits when the launcher does; die with it.
    parent = os.getppid()
    _set_pdeathsig()
    if os.getppid() != parent or not _pid_alive(launcher_pid):  # gone before prctl took effect
        os._exit(1)
    from spd.distributed.rank import run_rank

    def sink(result):
        conn.send(("result", result))
    code = 1
    try:
        code = run_rank(rank, world, config, job, host, port, local_rank=rank, result_sink=sink,
                        secret=secret, launcher_pid=launcher_pid)
    except BaseException as exc:  # failed before the store existed: tell the launcher directly
        try:
            kind = "input" if isinstance(exc, SPDError) else "error"
            conn.send(("failure", {"rank": rank, "kind": kind,
                                   "error": f"{exc}" if kind == "input" else
                                   f"{type(exc).__name__}: {exc}"}))
        except Exception:
            pass
        code = 2 if isinstance(exc, SPDError) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _open_store(host: str, port: int, timeout_s: float):
    from spd.distributed.transport import _td, master_store
    try:
        return master_store(host, port, _td(timeout_s))
    except Exception as exc:  # OSError from the bind, DistNetworkError and friends
        text = str(exc)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise SPDError(f"port {port} on {host} is busy (another process listens there): pass "
                           "--master-port with a free port, or 0 to pick one") from exc
        raise SPDError(f"cannot listen on {host}:{port} for the rendezvous store: "
                       f"{text.splitlines()[0] if text else exc}") from exc


def _exit_reason(code: int) -> tuple[str, str]:
    from spd.distributed.faults import EXIT_TERMINATED
    if code == EXIT_TERMINATED:  # a rank's own SIGTERM handler (it marks the store, then leaves)
        return "killed", "stopped by SIGTERM"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return "killed", f"killed by {name}"
    return "exited", f"exited with status {code} before reporting an error"


def launch_local(config, job, *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 on_spawn=None, timeout: float | None = None):
    """Run `job(engine)` on rank 0 of n + 1 local ranks; return its result.

    Raises SPDError for bad input (a busy port, a mismatch between ranks, a bad prompt) and
    spd.distributed.faults.RankFailedError when a rank fails; every rank is gone when this returns.
    `on_spawn({rank: pid})` is called once the ranks are started; `timeout` bounds the whole run.
    """
    import multiprocessing as mp
    import secrets
    from multiprocessing.connection import wait as mp_wait

    from spd.distributed import faults
    from spd.distributed.faults import RankFailedError, Signer, read_failure, write_failure

    config.validate()
    from spd.distributed.config import use_placement
    use_placement(config)  # failures name the roles each process runs
    secret = secrets.token_hex(32)  # this run's: signs the records that can stop it
    signer = Signer(secret, "launcher")
    world = config.world_size
    if config.threads is None:
        config.threads = max(1, (os.cpu_count() or 1) // world)
    import torch.distributed as dist
    master = _open_store(master_addr, int(master_port), max(config.op_timeout, 30.0))
    port = master.port
    store = dist.PrefixStore("spd/", master)  # the ranks' default prefix
    # Ranks fork from a fork server that imported torch once (per launcher process), instead of
    # n + 1 interpreters importing it each: seconds per launch on a small machine.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["spd.distributed.rank"])
    # c10d logs a C++ warning with its stack frames when a store connection drops (a heartbeat in
    # flight as the launcher dies); the rank's own one-line message says what happened. Read by
    # the fork server when it starts, so set before the first rank; an explicit choice is kept.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    spd_env = {k: v for k, v in os.environ.items() if k.startswith("SPD_")}
    recv_conn, send_conn = ctx.Pipe(duplex=False)
    procs = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    old_term = _catch_launcher_sigterm()
    try:
        for r in range(world):
            p = ctx.Process(target=_local_rank_main, name=f"spd-rank{r}",
                            args=(r, world, config, job if r == 0 else None, master_addr, port,
                                  send_conn, os.getpid(), secret, spd_env))
            p.start()
            procs[r] = p
        send_conn.close()
        if on_spawn is not None:
            on_spawn({r: p.pid for r, p in procs.items()})
        result, have_result, failure = None, False, None
        while True:
            wait_s = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
            ready = mp_wait([recv_conn] + [p.sentinel for p in procs.values()
                                           if p.exitcode is None], timeout=wait_s)
            if recv_conn in ready:
                try:
                    tag, payload = recv_conn.recv()
                except EOFError:  # every rank closed its end
                    tag, payload = None, None
                if tag == "result":
                    result, have_result = payload, True
                    # the others only have to leave now: bound that
                    finish_by = time.monotonic() + config.fault_timeout + 5.0
                    deadline = finish_by if deadline is None else min(deadline, finish_by)
                elif tag == "failure" and failure is None:
                    failure = payload
            for r, p in procs.items():
                if p.exitcode not in (None, 0) and failure is None:
                    failure = _failure_of(store, r, p.exitcode,
                                          lambda st: read_failure(st, signer))
            if failure is not None:
                break
            if all(p.exitcode == 0 for p in procs.values()):
                if not have_result:
                    raise InternalError("the ranks finished but rank 0 returned no result")
                return result
            if deadline is not None and time.monotonic() >= deadline:
                if have_result:  # the answer is in; a rank that lingers at shutdown is killed
                    _reap(procs, 0.0)
                    return result
                failure = {"rank": -1, "kind": "timeout",
                           "error": f"the run did not finish within {timeout:g} s"}
                break
        # A rank failed: kill it if it is still there (lost: frozen or hung), let the others
        # stop themselves (their watchdogs see the record within an interval), then kill what
        # is left.
        t_fail = time.monotonic()
        write_failure(store, failure["rank"], failure["kind"], failure["error"], -1, signer)
        lost = procs.get(failure["rank"])
        if lost is not None and lost.exitcode is None and failure["kind"] in ("lost", "timeout"):
            lost.kill()
        grace = config.fault_timeout + 2.0
        if failure["kind"] == "lost":  # the others already know: no reason to wait long
            grace = min(grace, 3 * faults.watchdog_interval(config.fault_timeout) + 1.0)
        _reap(procs, grace)
        codes = {r: p.exitcode for r, p in procs.items()}
        if failure["kind"] == "input":
            raise SPDError(failure["error"])
        err = RankFailedError(failure["rank"], failure["kind"], failure["error"], codes)
        err.stopped_s = time.monotonic() - t_fail  # detection to the last rank gone
        raise err
    except KeyboardInterrupt:
        write_failure(store, -1, "interrupted", "interrupted (Ctrl-C)", -1, signer)
        _reap(procs, 2.0)
        raise
    except LauncherTerminated:
        # Stopped from outside: tell the ranks (record), forward the signal, clean up, leave.
        write_failure(store, -1, "terminated", "it got SIGTERM", -1, signer)
        _reap(procs, 2 * faults.watchdog_interval(config.fault_timeout) + 0.2, kill=False)
        for p in procs.values():
            if p.exitcode is None and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGTERM)
                except OSError:
                    pass
        _reap(procs, 2.0)
        print("spd: stopped by SIGTERM: the ranks were stopped", file=sys.stderr, flush=True)
        raise SystemExit(faults.EXIT_TERMINATED) from None
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        _reap(procs, 0.0)
        recv_conn.close()
        del store, master


def _catch_launcher_sigterm():
    """SIGTERM to the launcher raises LauncherTerminated (main thread, default handler only);
    returns the handler to restore, or None."""
    import threading
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def on_term(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one is enough: let the cleanup run
        raise LauncherTerminated()
    signal.signal(signal.SIGTERM, on_term)
    return signal.SIG_DFL


def _failure_of(store, rank: int, code: int, read_failure) -> dict:
    """The failure to report when rank `rank` exited with `code` (prefer the recorded cause)."""
    rec = None
    for _ in range(20):  # the record is written before the rank exits; allow the store a moment
        try:
            rec = read_failure(store)
        except Exception:
            rec = None
        if rec is not None or code < 0:
            break
        time.sleep(0.05)
    # A rank killed from outside is reported as killed, not as the "lost" its peers may have
    # recorded on the broken connection; but a rank the watchdogs had declared silent (and a
    # sibling then killed, as it was frozen) stays "lost: no heartbeat".
    if code < 0 and (rec is None or (rec.get("kind") == "lost" and rec.get("rank") == rank
                                     and not rec.get("error", "").startswith("no heartbeat"))):
        kind, why = _exit_reason(code)
        return {"rank": rank, "kind": kind, "error": why}
    if rec is not None:
        return rec
    kind, why = _exit_reason(code)
    return {"rank": rank, "kind": kind, "error": why}


def _reap(procs: dict, grace: float, kill: bool = True) -> None:
    """Wait up to `grace` seconds for the ranks to exit, then kill the rest (our own children)."""
    deadline = time.monotonic() + grace
    for p in procs.values():
        if p.exitcode is None:
            p.join(max(0.0, deadline - time.monotonic()))
    if not kill:
        return
    for p in procs.values():
        if p.exitcode is None:
            p.kill()
    for p in procs.values():
        p.join(5)


# --- torchrun -----------------------------------------------------------------------------------
def run_torchrun(config, job) -> int:
    """This process is one torchrun worker: run its rank; return the exit status."""
    from spd import env
    from spd.distributed.rank import run_rank

    config.validate()
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise SPDError(f"torchrun environment is incomplete or malformed: {exc}") from exc
    if world != config.world_size:
        raise SPDError(f"torchrun started {world} ranks (WORLD_SIZE={world}) but --stages "
                       f"{config.n_stages} needs {config.describe_world()}: use "
                       f"--nproc-per-node {config.world_size} on one node, or nodes whose "
                       "--nproc-per-node add up to that")
    # torchrun's agent hosts the store on node 0; otherwise rank 0 does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    prefix = (f"spd/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    secret, name = env.run_secret(), env.RUN_SECRET.name
    if secret is None and local_world < world and rank == 0:
        print(f"spd: warning: several nodes and no {name}: anyone who reaches "
              f"{host}:{port} can stop this run or make it blame a rank; set {name} to "
              "the same random value on every node (see docs/distributed.md)", file=sys.stderr)
    return run_rank(rank, world, config, job, host, port,
                    is_master=(not agent_store and rank == 0), prefix=prefix,
                    local_rank=local_rank, local_world=local_world, secret=secret)
