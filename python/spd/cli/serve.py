"""`spd serve`: an OpenAI-compatible HTTP server on one persistent engine (one process, or rank 0
of the distributed runtime with --distributed / torchrun)."""
from __future__ import annotations

import logging
import os
import sys
from functools import partial
from pathlib import Path

from spd.cli.common import (
    add_lookup_arg,
    int_in,
    precheck_pdm,
    warn_untrained_pdm,
)
from spd.cli.generate import (
    add_distributed_args,
    add_engine_args,
    build_engine,
    require_distributed_for_draft_on_stage,
    wants_distributed,
)
from spd.cli.logs import add_log_level_arg, setup_logging
from spd.errors import SPDError

log = logging.getLogger("spd.serve")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (docs/serve.md)",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models and "
                       "/health on one persistent engine. Requests queue for a decode slot "
                       "(--max-batch decode together); the output is the target's own.")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="port to listen on (0: any free one)")
    p.add_argument("--max-queue", type=int_in(1), default=16,
                   help="requests that may wait for a decode slot; more get HTTP 429")
    p.add_argument("--max-batch", type=int_in(1), default=None,
                   help="requests decoded at once, each with its own speculation (default 8; "
                        "docs/batching.md)")
    p.add_argument("--max-context", type=int_in(2), default=2048,
                   help="rows of context (prompt and new tokens) a batch slot holds; its KV "
                        "memory is allocated at start-up (default 2048)")
    p.add_argument("--prefill-chunk", type=int_in(1), default=256,
                   help="a joining prompt is prefilled this many rows a decode step (with "
                        "--distributed: a pause of the ranks), so the requests already "
                        "decoding wait one chunk at a time, not a whole prompt (default 256; "
                        "with --max-batch > 1)")
    p.add_argument("--max-tokens", type=int_in(1), default=256,
                   help="new tokens of a request that gives no max_tokens")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients pass (default: the model folder's name, the repo "
                        "id, or SmolLM2-135M-Instruct)")
    add_engine_args(p, ("spd", "ar", "pipeline"))
    add_log_level_arg(p, "info")
    add_distributed_args(p)
    add_lookup_arg(p)
    p.set_defaults(func=cmd_serve)


def setup_serve_logging(level: str) -> None:
    """spd's messages at `level` (each request at info); uvicorn's at warning and above (its
    start-up lines repeat ours), debug included when asked."""
    setup_logging(level, ("uvicorn",))
    logging.getLogger("uvicorn").setLevel(max(logging.WARNING, logging.getLevelName(
        level.upper())) if level != "debug" else logging.DEBUG)


def model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model is None:
        from spd.model.loading import DEFAULT_MODEL_NAME
        return DEFAULT_MODEL_NAME
    path = Path(args.model).expanduser()
    return path.name if path.is_dir() else args.model


def server_opts(args) -> dict:
    return {"model_name": model_name(args), "host": args.host, "port": args.port,
            "max_queue": args.max_queue, "default_max_tokens": args.max_tokens}


DEFAULT_MAX_BATCH = 8


def default_max_batch(engine, mode: str) -> int:
    """8 slots: every mode batches requests, on every target (docs/batching.md)."""
    return DEFAULT_MAX_BATCH


def _announce(server) -> None:
    print(f"[spd] serving {server.model_name} on {server.url}/v1 (backend: "
          f"{server.worker.backend.describe()}); Ctrl-C stops it", file=sys.stderr, flush=True)


def cmd_serve(args) -> int:
    from spd.serve.deps import require_serve_deps
    from spd.serve.server import bind_socket

    require_serve_deps()
    setup_serve_logging(args.log_level)
    if os.environ.get("RANK", "0") == "0":  # the rank that will listen (torchrun: rank 0)
        bind_socket(args.host, args.port).close()  # a busy port: refused before loading
    precheck_pdm(args.pdm)
    if wants_distributed(args):
        return cmd_serve_distributed(args)
    require_distributed_for_draft_on_stage(args)
    import torch

    from spd.serve.backends import LocalBackend
    from spd.serve.server import Server

    if args.threads:
        torch.set_num_threads(args.threads)
    target, engine = build_engine(args)
    if target.tokenizer is None:
        raise SPDError("serving needs the model's tokenizer")
    if engine.pdm_source == "untrained":
        warn_untrained_pdm()
    max_batch = args.max_batch or default_max_batch(engine, args.mode)
    context = min(args.max_context, target.max_context)
    backend = LocalBackend(engine, args.mode, max_batch, context, args.prefill_chunk)
    server = Server(backend, **server_opts(args))
    server.start_http()
    _announce(server)
    server.run()
    return 0


# --- distributed: rank 0 serves HTTP, the stage ranks wait for each request ----------------------
def serve_job(opts: dict, engine):
    """Rank 0's job: the HTTP server over DistributedSPDEngine until it stops. A rank that dies
    fails the request in flight (5xx) and stops the server; this rank then leaves naming it."""
    from spd.serve.backends import DistributedBackend
    from spd.serve.server import Server

    opts = dict(opts)
    setup_serve_logging(opts.pop("log_level"))
    if getattr(engine.engine, "pdm_source", "") == "untrained":
        warn_untrained_pdm()
    max_batch, context = opts.pop("max_batch"), opts.pop("max_context")
    mode = opts.pop("mode", "spd")
    if max_batch is None:  # (several at once where the distributed batch runs)
        max_batch = default_max_batch(engine.engine, mode)
    backend = DistributedBackend(engine, max_batch, context, opts.pop("prefill_chunk"), mode)
    server = Server(backend, **opts)
    # the watchdog may end this process first (a peer's failure record): answer before leaving
    engine.process.exit_hooks.append(lambda msg: server.fail(msg.removeprefix("stopping: ")))
    server.start_http()
    _announce(server)
    server.run()
    if backend.failure is not None:
        engine.process.stop_for(backend.failure)  # leaves the process, naming the failed rank
    if server.fatal_error is not None:
        raise RuntimeError(server.fatal_error)
    return dict(server.worker.counts)


def cmd_serve_distributed(args) -> int:
    from spd.cli.generate import config_from_args
    from spd.distributed.faults import RankFailedError
    from spd.distributed.launch import launch_local, run_torchrun, under_torchrun

    if args.mode == "pipeline" and getattr(args, "draft_on_stage", None) is not None:
        raise SPDError("--mode pipeline drafts nothing: it runs on the n stage ranks with rank 0 "
                       "apart; drop --draft-on-stage")
    config = config_from_args(args, ("spd", "pipeline"))
    job = partial(serve_job, {**server_opts(args), "log_level": args.log_level,
                              "mode": args.mode,
                              "prefill_chunk": args.prefill_chunk,
                              "max_batch": args.max_batch, "max_context": args.max_context})
    if under_torchrun():
        return run_torchrun(config, job)
    try:
        launch_local(config, job, master_addr=args.master_addr, master_port=args.master_port)
    except RankFailedError as exc:
        print(f"spd: error: the server stopped: {exc}", file=sys.stderr)
        return 1
    return 0
