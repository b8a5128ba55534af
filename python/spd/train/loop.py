"""The optimisation loop shared by every drafter trainer (PDM, PPSD, EAGLE-3 head).

AdamW on the trainable parameters, linear warm-up then linear decay to zero, gradients clipped
to norm 1, sequences drawn in shuffled epochs and cropped to random windows, held-out evaluation
and a checkpoint every so many steps. A run started again on the same folder resumes exactly
where the last checkpoint left it (weights, optimiser, both RNGs and the rest of the epoch).
With `cfg.precision == "bf16"` the training loss runs under bf16 autocast (weights, optimiser
state and the held-out evaluation stay fp32): on a CPU with bf16 units a step is ~1.8x faster and
its gradients agree with fp32 to within a percent.
"""
from __future__ import annotations

import json
import pickle
import random
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from spd.data.files import atomic_write
from spd.errors import SPDError

STATE = "train_state.pt"
PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(requested: str, device) -> str:
    """'auto' -> 'bf16' where the device multiplies bf16 natively (a CUDA GPU that supports it,
    a CPU with AVX512-BF16 or AMX), else 'fp32'; 'fp32' and 'bf16' pass through."""
    if requested not in PRECISIONS:
        raise SPDError(f"precision must be one of {', '.join(PRECISIONS)}, got {requested!r}")
    if requested != "auto":
        return requested
    device = torch.device(device)
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    try:
        native = device.type == "cpu" and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        native = False
    return "bf16" if native else "fp32"


def crop(item: dict, length: int, rng: random.Random | None) -> dict:
    """A window of `length` tokens (random if rng is given, else the first ones)."""
    total = len(item["tokens"])
    if total <= length:
        return item
    a = rng.randint(0, total - length) if rng is not None else 0
    return {k: (v[:, a:a + length] if k == "anchors" else v[a:a + length]) for k, v in item.items()}


def lr_at(step: int, cfg) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * max(0.0, (cfg.steps - step) / max(1, cfg.steps - cfg.warmup))


def save_state(state: dict, path: Path) -> None:
    """Write a training checkpoint atomically: a kill mid-write keeps the previous one."""
    with atomic_write(path) as f:
        torch.save(state, f)


def load_state(path: Path) -> dict:
    """A training checkpoint: tensors and plain values only. A pickle of anything else is
    refused, never run (loading one could execute code, e.g. from a shared --out folder)."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "unsupported global" not in str(exc).lower():  # garbage, not a pickle of objects
            raise SPDError(f"{path} is not a readable training checkpoint ({exc}); delete it to "
                           f"start over, or use a fresh --out") from exc
        raise SPDError(f"{path} holds objects other than tensors and plain values; it was not "
                       f"loaded, since unpickling them could run code. Delete it (or use a "
                       f"fresh --out) if you do not trust where it came from") from exc
    except (EOFError, RuntimeError, OSError) as exc:
        raise SPDError(f"{path} is not a readable training checkpoint ({exc.__class__.__name__}: "
                       f"{str(exc).splitlines()[0] if str(exc) else 'empty'}); delete it to "
                       f"start over, or use a fresh --out") from exc


# Settings a run may change on resume (a longer run, other logging); any other difference would
# mix two runs in one checkpoint.
# (ranks, micro-batches and packing change only the order of floating-point sums)
RESUMABLE = ("steps", "eval_every", "save_every", "history", "peak_memory", "ranks",
             "micro_batch", "pack_tokens")


def check_resume(saved: dict, config: dict, out: Path) -> None:
    """Refuse to resume a run whose settings differ from the saved ones (the model's shape, the
    optimiser, the data); a changed step count is only reported."""
    changed = {k: (saved.get(k), v) for k, v in config.items()
               if k not in RESUMABLE and saved.get(k) != v}
    if changed:
        listing = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in sorted(changed.items()))
        raise SPDError(f"{out} holds a run with other settings ({listing}); resuming would mix "
                       f"the two: use a fresh --out, or the saved settings")
    if saved.get("steps") != config.get("steps"):
        warnings.warn(f"resuming {out} with --steps {config.get('steps')} (it was started with "
                      f"{saved.get('steps')})", stacklevel=3)


def _resume(model, opt, state_path: Path, config: dict, same_run: Callable) -> dict | None:
    """The saved state of the run in state_path's folder, loaded into model and opt (None when
    there is none); a run of another configuration or other settings is refused first."""
    if not state_path.exists():
        return None
    st = load_state(state_path)
    out = state_path.parent
    if not same_run(st["config"]):
        raise SPDError(f"{out} holds a run with another configuration; use a fresh --out")
    check_resume(st["config"], config, out)
    model.load_state_dict(st["model"] if "model" in st else st.get("pdm", st.get("head")))
    opt.load_state_dict(st["opt"])
    return st


def run_loop(model, cfg, out: Path, train_items: list, held_out: list, *,
             item_loss: Callable, evaluate: Callable, config: dict, same_run: Callable,
             desc: str, progress: bool = True) -> list[dict]:
    """Train `model` for cfg.steps steps; returns the history (also kept in cfg.history).

    item_loss(item, rng) -> (loss tensor, top-1 agreement) for one cropped sequence (it may draw
    more randomness from rng, e.g. a fill level); evaluate(held_out) -> dict of metrics;
    config: what the checkpoint records; same_run(saved config) -> whether a saved run may be
    resumed with this one.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = _autocast(params, getattr(cfg, "precision", "fp32"))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = 0
    rng = random.Random(cfg.seed)
    order: list[int] = []  # shuffled sequence indices left in this epoch
    state_path = out / STATE
    st = _resume(model, opt, state_path, config, same_run)
    if st is not None:
        step = st["step"]
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        order = list(st.get("order", []))
        cfg.history = st["history"]
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step", disable=not progress)
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        total, agree_sum = 0.0, 0.0
        for _ in range(cfg.batch_sequences):
            if not order:
                order = list(range(len(train_items)))
                rng.shuffle(order)
            item = crop(train_items[order.pop()], cfg.crop_len, rng)
            with autocast:
                loss, agree = item_loss(item, rng)
            (loss / cfg.batch_sequences).backward()
            total += loss.item() / cfg.batch_sequences
            agree_sum += agree / cfg.batch_sequences
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{total:.3f}", top1=f"{agree_sum:.2f}")
        record = {"step": step, "loss": total, "top1": agree_sum}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            model.eval()
            with torch.no_grad():
                record.update(evaluate(held_out))
            model.train()
            bar.write(json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                  for k, v in record.items()}))
        cfg.history.append(record)
        if step % cfg.save_every == 0 or step == cfg.steps:
            state = {"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                     "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                     "order": list(order), "history": cfg.history, "config": config}
            save_state(state, state_path)
    bar.close()
    model.eval()
    return cfg.history


HISTORY = "history.json"


def _autocast(params, precision: str):
    if precision not in ("fp32", "bf16"):
        raise SPDError(f"training precision must be fp32 or bf16 (resolve 'auto' first), "
                       f"got {precision!r}")
    return torch.autocast(params[0].device.type, dtype=torch.bfloat16,
                          enabled=precision == "bf16")


def _rounded(record: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in record.items()}


def run_steps(model, cfg, out: Path, batches, *, batch_loss: Callable, evaluate: Callable,
              config: dict, same_run: Callable, desc: str, group=None,
              progress: bool = True) -> list[dict]:
    """Train `model` for cfg.steps optimiser steps on streamed micro-batches; returns the
    history (also kept in cfg.history and, on rank 0, in out/history.json).

    batches.step(s) -> this rank's micro-batches of step s (spd.train.batches);
    batch_loss(micro_batch) -> (sum of the loss over its loss tokens [scalar tensor], loss tokens,
    rows whose draft equals the target's argmax, rows that count, tokens); evaluate() -> dict
    of held-out
    metrics (rank 0 only). The loss of a step is the sum over the global batch divided by its
    loss tokens, over every rank (group: spd.train.ranks.RankGroup) and micro-batch: the same
    step on 1 or N ranks, with any accumulation. A run started again on the same folder resumes
    from its last checkpoint (weights, optimiser, step; the data position follows from the step).
    """
    from spd.train.ranks import RankGroup, fault_now
    group = group or RankGroup()
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = _autocast(params, cfg.precision)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    step = 0
    state_path = out / STATE
    st = _resume(model, opt, state_path, config, same_run)
    if st is not None:
        step = st["step"]
        cfg.history = st["history"]
    model.train()
    bar = tqdm(total=cfg.steps, initial=step, desc=desc, unit="step",
               disable=not (progress and group.main), dynamic_ncols=True)
    start, done_tokens, last_eval = time.perf_counter(), 0.0, {}
    while step < cfg.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        sums = [0.0] * 5  # loss, loss tokens, agreeing rows, rows that count, tokens
        for micro in batches.step(step):
            with autocast:
                loss_sum, *counts = batch_loss(micro)
            loss_sum.backward()
            fault_now(group.rank, step + 1)
            for i, v in enumerate([float(loss_sum.detach())] + counts):
                sums[i] += v
        loss_sum, valid, agree, counted, tokens = group.sum_floats(sums, "the step's loss")
        group.sum_gradients_(params, 1.0 / max(valid, 1.0))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        done_tokens += tokens
        rate = done_tokens / max(time.perf_counter() - start, 1e-9)
        record = {"step": step, "loss": loss_sum / max(valid, 1.0),
                  "top1": agree / max(counted, 1.0), "tokens": int(tokens),
                  "lr": lr_at(step - 1, cfg),
                  "time_s": round(time.perf_counter() - start, 3)}  # since this process began
        if group.main and (step % cfg.eval_every == 0 or step == cfg.steps):
            model.eval()
            with torch.no_grad():
                last_eval = evaluate()
            model.train()
            record.update(last_eval)
            bar.write(json.dumps(_rounded(record)))
        cfg.history.append(record)
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:,.0f}",
                        **({"accept": f"{last_eval['accept']:.3f}"} if "accept" in last_eval
                           else {}))
        if step % cfg.save_every == 0 or step == cfg.steps:
            if group.main:
                save_state({"step": step, "model": model.state_dict(), "opt": opt.state_dict(),
                            "history": cfg.history, "config": config}, state_path)
                write_history(out, cfg.history)
            # No rank runs ahead of a checkpoint still being written: a rank lost in the next
            # step then cannot take rank 0 down with its save half done.
            group.sum_floats([0.0], "the checkpoint")
    bar.close()
    model.eval()
    return cfg.history


def write_history(out: Path, history: list[dict]) -> None:
    from spd.data.files import write_text_atomic
    write_text_atomic(out / HISTORY, json.dumps(history))


__all__ = ["HISTORY", "PRECISIONS", "STATE", "crop", "load_state", "lr_at", "resolve_precision",
           "run_loop", "run_steps", "write_history"]
