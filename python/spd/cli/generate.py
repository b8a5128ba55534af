"""`spd generate`: decode one prompt in one process, or over n + 1 ranks (--distributed, torchrun)."""
from __future__ import annotations

import argparse
import logging
import sys
import time
from functools import partial

from spd import env
from spd.cli import plain_speed
from spd.cli.common import (
    MAX_SEED,
    Streamer,
    add_draft_weights_arg,
    add_lookup_arg,
    add_model_layout_args,
    add_tree_width_arg,
    check_lookup,
    check_prompt,
    int_in,
    parse_ints,
    precheck_pdm,
    print_generation,
    warn_untrained_pdm,
)
from spd.cli.logs import add_log_level_arg, setup_logging
from spd.distributed.launch import launch_local, run_torchrun, under_torchrun
from spd.errors import SPDError
from spd.model.prompt import encode_prompt
from spd.runtime.cycle import DEFAULT_AHEAD

log = logging.getLogger("spd.cli")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with SPD (or autoregressively)",
                       description="Decode one prompt with speculative pipeline decoding. The "
                       "output is exactly the target's own (greedy or sampled).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH",
                     help="read the prompt from a UTF-8 text file ('-': standard input)")
    p.add_argument("--system", default=None,
                   help="a system message for the chat template (with --chat)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help="sampling seed, in [0, 2**63 - 1]")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default: on)")
    add_engine_args(p)
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, stats) instead of streaming")
    p.add_argument("--quiet", action="store_true",
                   help="print only the generated text: no summary lines, no warnings")
    add_log_level_arg(p, "warning")
    add_distributed_args(p)
    add_lookup_arg(p)
    p.set_defaults(func=cmd_generate)


def add_engine_args(p, modes: tuple[str, ...] = ("spd", "ar")) -> None:
    """The target, its stages and the drafter: the flags `generate` and `serve` share (`modes`:
    the --mode choices; `serve` adds "pipeline")."""
    add_model_layout_args(p, "pipeline stages n (1 = autoregressive)")
    p.add_argument("--pdm", default=None,
                   help="PDM checkpoint folder, or \"untrained\" (default: the checkpoint shipped "
                        "for this target and n, else an untrained PDM)")
    p.add_argument("--pdm-layers", type=int_in(1), default=None,
                   help="layers of an untrained PDM (default: L/n - 1 within [1, 4])")
    p.add_argument("--mode", choices=modes, default="spd",
                   help="spd (default) or ar: plain autoregressive decoding on the same stages"
                        + ("; pipeline: the n stages without speculation, one token per "
                           "request per trip through them (docs/batching.md)"
                           if "pipeline" in modes else ""))
    p.add_argument("--threads", type=int_in(1), default=None,
                   help="torch CPU threads (per rank with --distributed; default: torch's)")
    p.add_argument("--ahead", type=int_in(0), default=DEFAULT_AHEAD, metavar="K",
                   help=f"cycles launched past the one the host has read (default "
                        f"{DEFAULT_AHEAD}; on a GPU the host runs that far ahead of the device)")
    # gone: every cycle is decided on the device now; accepted with a warning for old scripts
    p.add_argument("--device-loop", action="store_true", help=argparse.SUPPRESS)
    add_draft_weights_arg(p)
    add_tree_width_arg(p)


def build_engine(args):
    """The target and the one-process engine the engine flags describe: (target, engine)."""
    from spd.model.loading import load_target
    from spd.model.stage_costs import resolve_split, target_costs
    from spd.runtime.engine import SPDEngine

    t0 = time.perf_counter()
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    log.info("loaded %s (%d layers, %s) in %.1f s", target.name, target.num_layers,
             args.device, time.perf_counter() - t0)
    n = 1 if args.mode == "ar" else args.stages
    engine = SPDEngine(target, n_stages=n,
                       split=resolve_split(args.split, lambda: target_costs(target), n),
                       anchors=parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                       pdm_layers=args.pdm_layers, warn_untrained=False,
                       lookup=check_lookup(args.lookup),
                       draft_weights=getattr(args, "draft_weights", "model"),
                       tree_width=getattr(args, "tree_width", 1),
                       ahead=getattr(args, "ahead", DEFAULT_AHEAD))
    log.info("engine: n=%d, split %s, PDM %s", engine.n,
             ",".join(map(str, engine.layout.split)), engine.pdm_source)
    return target, engine


def warn_retired_flags(args) -> None:
    """Flags of the host-decided loops, which are gone: a warning, not an error, for scripts."""
    if getattr(args, "device_loop", False):
        log.warning("--device-loop is no longer needed: every cycle is decided on the device "
                    "(drop the flag; SPD_CUDA_GRAPHS=0 runs the same cycle eagerly)")
    if getattr(args, "speculative_control", None) is not None:
        log.warning("--speculative-control no longer has an effect: every draft enters the "
                    "pipeline before its verdict is read (drop the flag)")


def read_prompt(args) -> str:
    """--prompt, or --prompt-file's text (standard input for '-'), checked before any load."""
    if args.prompt_file is None:
        return check_prompt(args.prompt)
    path = args.prompt_file
    try:
        if path == "-":
            text = sys.stdin.buffer.read().decode("utf-8")
        else:
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
    except UnicodeDecodeError:
        raise SPDError(f"--prompt-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise SPDError(f"--prompt-file {path}: {exc.strerror or exc}") from None
    if not text.strip():
        raise SPDError(f"--prompt-file {path}: the prompt is empty")
    return text


def cmd_generate(args) -> int:
    args.prompt = read_prompt(args)  # before any model loads (that takes seconds)
    setup_logging(args.log_level)
    if args.quiet:
        import warnings
        warnings.simplefilter("ignore")
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    if args.max_new_tokens < 1:
        raise SPDError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    precheck_pdm(args.pdm)
    warn_retired_flags(args)
    if wants_distributed(args):
        return cmd_generate_distributed(args)
    require_distributed_for_draft_on_stage(args)
    import torch

    from spd.runtime.types import SamplingParams

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SPDError("--device cuda was requested but no CUDA device is available")
    target, engine = build_engine(args)
    if engine.pdm_source == "untrained" and not args.quiet:
        warn_untrained_pdm()
    prompt_ids = encode_prompt(target.tokenizer, args.prompt, args.chat, args.system)
    log.info("prompt: %d tokens", len(prompt_ids))
    streamer = None if args.json else Streamer(target.tokenizer)
    result = engine.generate(prompt_ids, args.max_new_tokens, sampling, on_token=streamer)
    print_generation(target.tokenizer, result, args.json, args.quiet)
    st = result.stats
    if st.mode == "ar" and st.N:
        plain_speed.record(target, args.device, st.decode_tok_s)
    elif st.mode == "spd" and not (args.json or args.quiet):
        print(plain_speed.explain(target, args.device, st.n))
    return 0


# --- distributed ---------------------------------------------------------------------------------
def add_distributed_args(p) -> None:
    g = p.add_argument_group("distributed runtime (n stage ranks + 1 draft rank, or n with "
                             "--draft-on-stage)")
    g.add_argument("--distributed", action="store_true",
                   help="run one process per stage plus a draft rank (spawned locally; under "
                        "torchrun this is automatic)")
    g.add_argument("--master-addr", default="127.0.0.1",
                   help="address of the rendezvous store for --distributed (default 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=0,
                   help="port of the rendezvous store for --distributed (default 0: a free one)")
    g.add_argument("--fault-timeout", type=float, default=10.0,
                   help="seconds after which a silent rank is declared dead (default 10)")
    g.add_argument("--comm-timeout", type=float, default=300.0,
                   help="bound in seconds of any single wait inside a generation (default 300)")
    g.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="data transport between ranks (default: nccl on CUDA devices, gloo "
                        "otherwise); gloo with --device cuda stages tensors through host memory, "
                        "so every rank may share one GPU")
    # gone with the unit protocol (every draft enters before its verdict is read); accepted
    # with a warning for old scripts
    g.add_argument("--speculative-control", default=None, help=argparse.SUPPRESS)
    g.add_argument("--draft-on-stage", type=int, default=None, metavar="S",
                   help="n devices instead of n + 1: the draft rank runs in stage S's process, "
                        "on its device and its own CUDA stream (S = 0..n-1; stage S should get "
                        "fewer layers, see --split). Default: a draft rank of its own")


def wants_distributed(args) -> bool:
    return bool(getattr(args, "distributed", False)) or under_torchrun()


def require_distributed_for_draft_on_stage(args) -> None:
    """One process runs every stage and the draft on one device already."""
    if getattr(args, "draft_on_stage", None) is not None:
        raise SPDError("--draft-on-stage places the draft rank of the distributed runtime: add "
                       "--distributed (or run under torchrun)")


def config_from_args(args, modes: tuple[str, ...] = ("spd",)):
    """The distributed runtime's DistConfig from the flags (`modes`: the --mode values the
    command runs across ranks)."""
    from spd.distributed.config import DistConfig, parse_fault
    from spd.draft.pdm import default_pdm_layers
    from spd.model.loading import model_config, resolve_dtype
    from spd.model.partition import AUTO, parse_split
    from spd.model.stage_costs import draft_step_cost, file_costs, resolve_split

    if args.mode not in modes:
        raise SPDError(f"--mode {args.mode} is single-process only here: drop --distributed "
                       "(or torchrun)")
    # --split auto is resolved here, from the model's files: every rank gets the same split
    # (with --draft-on-stage S, stage S also pays an estimated draft step)
    split, on_stage = parse_split(args.split), getattr(args, "draft_on_stage", None)
    if split == AUTO:
        dtype = resolve_dtype(args.dtype, args.device)
        draft = 0.0
        if on_stage is not None:
            n, config = args.stages, model_config(args.model)
            layers = args.pdm_layers or default_pdm_layers(config.num_hidden_layers, n)
            draft = draft_step_cost(config, n, layers, el=dtype.itemsize)
        split = resolve_split(split, file_costs(args.model, dtype), args.stages, on_stage, draft)
    return DistConfig(n_stages=args.stages, split=split,
                      anchors=parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                      pdm_layers=args.pdm_layers, model=args.model, device=args.device,
                      dtype=args.dtype, threads=getattr(args, "threads", None),
                      fault_timeout=args.fault_timeout, op_timeout=args.comm_timeout,
                      backend=getattr(args, "backend", None),
                      lookup=check_lookup(getattr(args, "lookup", None)),
                      draft_weights=getattr(args, "draft_weights", "model"),
                      tree_width=getattr(args, "tree_width", 1),
                      draft_on_stage=getattr(args, "draft_on_stage", None),
                      ahead=getattr(args, "ahead", DEFAULT_AHEAD),
                      fault=parse_fault(env.fault_injection()))


def cli_job(opts: dict, engine):
    """Rank 0's job for `generate`: encode, decode (streaming or --json), print."""
    from spd.runtime.types import SamplingParams

    setup_logging(opts.get("log_level", "warning"))  # this rank's process
    target = engine.target
    sampling = SamplingParams(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"])
    prompt_ids = encode_prompt(target.tokenizer, opts["prompt"], opts["chat"], opts["system"])
    if getattr(engine.engine, "pdm_source", "untrained" if opts["pdm"] is None else "") \
            == "untrained" and not opts["quiet"]:
        warn_untrained_pdm()
    streamer = None if opts["json"] else Streamer(target.tokenizer)
    result = engine.generate(prompt_ids, opts["max_new_tokens"], sampling, on_token=streamer)
    print_generation(target.tokenizer, result, opts["json"], opts["quiet"])
    if not (opts["json"] or opts["quiet"]) and result.stats.distributed.get("cycles"):
        print(plain_speed.explain_distributed(target, opts["device"], result.stats))
    return {"token_ids": result.token_ids}


def cmd_generate_distributed(args) -> int:
    from spd.distributed.faults import RankFailedError

    if args.max_new_tokens < 1:
        raise SPDError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt:
        raise SPDError("the prompt is empty: pass --prompt TEXT")
    config = config_from_args(args)
    opts = {k: getattr(args, k) for k in ("prompt", "chat", "system", "temperature", "top_k",
                                          "top_p", "seed", "max_new_tokens", "json", "pdm",
                                          "quiet", "log_level", "device")}
    job = partial(cli_job, opts)
    if under_torchrun():
        return run_torchrun(config, job)
    try:
        launch_local(config, job, master_addr=args.master_addr, master_port=args.master_port)
    except RankFailedError as exc:
        print(f"spd: error: {exc}", file=sys.stderr)
        return 1
    return 0

