"""One rank's whole life: device, target, handshake, its role's loop, and how it exits.
Also the rank-0 jobs tests and benchmarks run (run_requests, run_forever)."""
from __future__ import annotations

import sys
import traceback
from typing import Callable

import torch

from spd.distributed.batch_stage import BatchSession
from spd.distributed.config import DRAFT_RANK, DistConfig, GenerateRequest, use_placement
from spd.distributed.draft_rank import DistributedSPDEngine
from spd.distributed.faults import EXIT_ERROR, EXIT_INPUT, EXIT_INTERRUPTED, EXIT_OK
from spd.distributed.handshake import check_handshake, exchange_info, rank_info
from spd.distributed.stage_rank import StageWorker
from spd.distributed.transport import CommError, Runtime
from spd.draft.drafters import ReferenceDrafter
from spd.errors import SPDError
from spd.model.partition import DepthLayout
from spd.runtime.engine import GenerationResult, SPDEngine


def run_requests(requests: list[GenerateRequest], engine: DistributedSPDEngine,
                 progress=None) -> list[GenerationResult]:
    """A rank-0 job: run the requests in order (tests, benchmarks). `progress` (an Event) is set
    after the first token."""
    results = []

    def tick(_tok):
        if progress is not None and not progress.is_set():
            progress.set()
    for req in requests:
        drafter = None
        if req.reference is not None:
            drafter = ReferenceDrafter(req.reference, req.reference_accuracy, req.reference_seed)
        if req.drafter is not None:
            drafter = req.drafter(engine.engine)
        results.append(engine.generate(req.prompt_ids, req.max_new_tokens, req.sampling,
                                       drafter=drafter, on_token=tick,
                                       stop_token_ids=req.stop_token_ids))
    return results


def run_forever(request: GenerateRequest, engine: DistributedSPDEngine, progress=None,
                limit: int = 10_000):
    """A rank-0 job that keeps generating (fault tests kill a rank while it runs)."""
    for _ in range(limit):
        run_requests([request], engine, progress)
    return None


# --- one rank's whole life ---------------------------------------------------------------------
def _drop_unused_layers(target, keep: range) -> None:
    """Free the decoder layers this rank does not run (their weights move to the meta device)."""
    for lid in range(target.num_layers):
        if lid not in keep:
            target.layers[lid].to("meta")


def _load_own_part(config: DistConfig, roles: list[int], device: str):
    """The target as this process holds it, reading only that from the files: the draft rank
    the embedding, final norm and LM head (it drafts, embeds the committed tokens and judges
    sampled tokens); stage s its layers, stage 0 the embedding (it embeds the token it is sent)
    and the last stage the final norm and LM head (a tied head: the embedding), since it judges
    greedy drafts. A process of stage roles alone needs no tokenizer, and builds a Llama /
    Qwen2 / Qwen3 target without importing transformers (spd.model.plain_build: its modeling
    imports weigh more than a middle stage's layers of the default model)."""
    from spd.model.loading import load_target, model_config, resolve_model_path
    from spd.model.plain_build import read_plain_config
    stages = [r - 1 for r in roles if r != DRAFT_RANK]
    layers = range(0)
    folder = resolve_model_path(config.model)
    if stages:
        model_cfg = read_plain_config(folder) or model_config(folder)
        layers = DepthLayout.build(model_cfg.num_hidden_layers, config.n_stages, config.split,
                                   config.anchors).stages[stages[0]]
    if DRAFT_RANK in roles:
        return load_target(folder, device=device, dtype=config.dtype, layers=layers)
    s = stages[0]
    return load_target(folder, device=device, dtype=config.dtype, layers=layers, embed=s == 0,
                       head=s == config.n_stages - 1, tokenizer=False, plain=True)


def _rank_device(config: DistConfig, local_rank: int, local_world: int) -> str:
    if config.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SPDError("--device cuda was requested but no CUDA device is available")
        backend = config.backend or "nccl"
        if backend == "nccl" and config.device == "cuda" and \
                torch.cuda.device_count() < local_world:
            raise SPDError(f"NCCL needs one GPU per rank: {local_world} ranks on this node but "
                           f"{torch.cuda.device_count()} GPU(s); use more nodes or GPUs, or fewer "
                           "stages")
        if config.device == "cuda":
            dev = f"cuda:{local_rank % torch.cuda.device_count()}"
        else:
            dev = config.device
        torch.cuda.set_device(torch.device(dev))
        return dev
    return config.device


def _leave_for(rt: Runtime, exc: BaseException, config: DistConfig) -> None:
    """Record why this process stops and leave (exit_now: every thread of it goes)."""
    if isinstance(exc, SPDError):
        rt.leave_if_launcher_gone(settle=0.3)
        rt.report("input", str(exc))
        rt.exit_now(EXIT_INPUT, f"error: {exc}")
    elif isinstance(exc, CommError):
        # Usually a symptom: the peer died or failed (see blame_after_comm_error).
        rt.stop_for(rt.blame_after_comm_error(exc, min(1.0, config.fault_timeout)))
    elif isinstance(exc, KeyboardInterrupt):
        rt.report("interrupted", "interrupted (Ctrl-C)")
        rt.exit_now(EXIT_INTERRUPTED, None)
    else:
        # a store or connection error because the launcher died is not this rank's failure
        rt.leave_if_launcher_gone(settle=0.3)
        tb = "".join(traceback.format_exception(exc))
        rt.report("error", f"{type(exc).__name__}: {exc}")
        print(tb, file=sys.stderr)
        rt.exit_now(EXIT_ERROR, f"failed: {type(exc).__name__}: {exc}")


def run_rank(rank: int, world: int, config: DistConfig, job: Callable | None, host: str,
             port: int, *, is_master: bool = False, prefix: str = "spd/", local_rank: int = 0,
             local_world: int | None = None, result_sink: Callable | None = None,
             secret: str | None = None, launcher_pid: int | None = None) -> int:
    """Everything one rank does; returns its exit status (failures are reported in the store).
    `secret` signs the store records that can stop the run; `launcher_pid`: the local launcher
    (None: the parent process, e.g. torchrun's agent)."""
    rt = None
    try:
        use_placement(config)
        if world != config.world_size:
            raise SPDError(f"{world} ranks were started but --stages {config.n_stages} needs "
                           f"{config.describe_world()}")
        rt = Runtime(rank, world, config, host, port, is_master=is_master, prefix=prefix,
                     secret=secret, launcher_pid=launcher_pid)
        if config.threads:
            torch.set_num_threads(int(config.threads))
        device = _rank_device(config, local_rank, local_world or world)
        roles = config.placement.roles_of(rank)
        if config.target_factory is not None:
            target = config.target_factory(rank)
        else:
            target = _load_own_part(config, roles, device)
        layout = DepthLayout.build(target.num_layers, config.n_stages, config.split,
                                   config.anchors)
        target.fingerprint()
        engine = None
        if DRAFT_RANK in roles:
            engine = SPDEngine(target, n_stages=config.n_stages, split=config.split,
                               anchors=config.anchors, pdm=config.pdm,
                               pdm_layers=config.pdm_layers, warn_untrained=False,
                               lookup=config.lookup, draft_weights=config.draft_weights,
                               tree_width=config.tree_width)
        check_handshake(exchange_info(rt, rank_info(rank, world, config, target, layout)))
        stage_roles = [r for r in roles if r != DRAFT_RANK]
        _drop_unused_layers(target, layout.stages[stage_roles[0] - 1] if stage_roles else range(0))
        rt.init_groups(torch.device(target.device))
        if engine is None:
            StageWorker(rt.endpoint(), target, layout, sessions=BatchSession).serve()
        else:  # (with the draft on a stage, that stage runs inside rank 0's cycle)
            deng = DistributedSPDEngine(rt.endpoint(), engine)
            result = job(deng) if job is not None else None
            deng.shutdown()
            if result_sink is not None:
                result_sink(result)
        rt.finish()
        rt.close_groups()
        return EXIT_OK
    except BaseException as exc:  # noqa: BLE001 - any error: record it, then leave
        if rt is None:
            raise
        _leave_for(rt, exc, config)
    return EXIT_ERROR  # not reached: exit_now leaves the process
