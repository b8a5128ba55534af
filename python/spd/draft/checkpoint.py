"""Drafter checkpoint files, shared by the PDM and the EAGLE-3 head.

A checkpoint is a folder with `config.json` (the drafter's config dataclass) and
`model.safetensors`. Storage fp32, fp16, or int8 (2-D weights as int8 with one fp16 scale per
row, the rest fp16: a quarter of the fp32 size, for checkpoints shipped in the repo). A drafter
whose config says `extra.head_from_target` does not store its LM head: it is the target's rows
of the draft vocabulary (`draft_to_target`), rebuilt at load.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from spd.data.files import (
    check_safetensors,
    read_json_object,
    save_safetensors,
    write_text_atomic,
)
from spd.errors import SPDError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_SCALE = ".int8_scale"
STORAGES = ("fp32", "fp16", "int8")


def _head_from_target(module) -> bool:
    return bool(module.config.extra.get("head_from_target"))


class SavedDrafter:
    """Mixin for drafter modules with a `config` dataclass: checkpoint saving."""

    @property
    def head_from_target(self) -> bool:
        """The LM head is the target's rows of the draft vocabulary: rebuilt at load, not stored."""
        return _head_from_target(self)

    def save(self, folder, storage: str = "fp32") -> None:
        """storage: fp32, fp16 or int8 (see spd.draft.checkpoint)."""
        save_drafter(self, folder, storage)


def save_drafter(module, folder, storage: str = "fp32") -> None:
    """Write `module.config` and its weights (see the module docstring for `storage`); both
    atomically, with the umask's permissions (spd.data.files)."""
    if storage not in STORAGES:
        raise SPDError(f"storage must be fp32, fp16 or int8, got {storage}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / CONFIG_NAME, json.dumps(asdict(module.config), indent=2))
    state = {}
    for k, v in module.state_dict().items():
        if k == "lm_head.weight" and _head_from_target(module):
            continue
        v = v.detach().float().contiguous().cpu() if v.is_floating_point() else v.cpu()
        if storage == "int8" and v.is_floating_point() and v.dim() == 2:
            scale = (v.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
            state[k] = torch.round(v / scale).to(torch.int8).contiguous()
            state[k + _SCALE] = scale.half().contiguous()
        elif storage != "fp32" and v.is_floating_point():
            state[k] = v.half()
        else:
            state[k] = v
    save_safetensors(state, folder / WEIGHTS_NAME)


def dequantise(raw: dict) -> dict:
    """A stored state dict (int8 rows with scales, fp16 or fp32) as fp32 tensors."""
    state = {}
    for k, v in raw.items():
        if k.endswith(_SCALE):
            continue
        if k + _SCALE in raw:  # int8 storage
            v = v.float() * raw[k + _SCALE].float()
        state[k] = v.float() if v.is_floating_point() else v
    return state


def read_weights(folder) -> dict:
    from safetensors.torch import load_file
    path = Path(folder) / WEIGHTS_NAME
    check_safetensors(path)
    try:
        return dequantise(load_file(str(path)))
    except Exception as exc:  # safetensors' own error type for what the header check missed
        raise SPDError(f"{path} is not a readable safetensors file ({exc})") from exc


def check_draft_map(module, source) -> None:
    """draft_to_target must name distinct target ids in range: a repeated id would give one
    target token two draft rows, and rejection sampling would lose probability mass."""
    ids = module.draft_to_target.detach().cpu()
    vocab = module.config.target_vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise SPDError(f"{source}: draft_to_target holds ids outside the target vocabulary "
                       f"[0, {vocab}) (from {int(ids.min())} to {int(ids.max())})")
    if ids.unique().numel() != ids.numel():
        raise SPDError(f"{source}: draft_to_target holds {ids.numel() - ids.unique().numel()} "
                       "duplicate target id(s); each target token needs one draft row at most")


def load_weights(module, folder, target=None):
    """Fill `module` from `folder`'s weights (rebuilding a target-derived LM head) and move it
    to the target's device and dtype; returns it in eval mode."""
    try:
        missing, unexpected = module.load_state_dict(read_weights(folder), strict=False)
    except RuntimeError as exc:  # size mismatches: the config lies about a shape
        detail = " ".join(str(exc).split("\n\t")[1:2]).strip()
        raise SPDError(f"{Path(folder) / WEIGHTS_NAME}: weights of other shapes than "
                       f"{CONFIG_NAME} implies ({detail})") from exc
    if hasattr(module, "draft_to_target") and "draft_to_target" not in missing:
        check_draft_map(module, Path(folder) / WEIGHTS_NAME)
    if _head_from_target(module) and missing == ["lm_head.weight"]:
        if target is None:
            raise SPDError(f"{folder}: the draft LM head is rebuilt from the target's rows; "
                           "pass the target to load it")
        with torch.no_grad():
            module.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[
                module.draft_to_target.cpu()])
        missing = []
    if missing or unexpected:
        raise SPDError(f"{folder}: weights do not match its config (missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]})")
    if target is not None:
        module = module.to(device=target.device, dtype=target.dtype)
    return module.eval()


def check_target(config, target, source: str) -> None:
    """Refuse a drafter built for another target (shape first, then the weights' fingerprint)."""
    if config.target_num_layers != target.num_layers or \
            config.target_hidden_size != target.hidden_size or \
            config.target_vocab_size != target.vocab_size:
        raise SPDError(
            f"{source} was built for a target with {config.target_num_layers} layers, hidden "
            f"{config.target_hidden_size}, vocab {config.target_vocab_size}; this target "
            f"({target.name}) has {target.num_layers} layers, hidden {target.hidden_size}, vocab "
            f"{target.vocab_size}")
    if config.target_fingerprint != target.fingerprint():
        raise SPDError(f"{source} was trained on another target ({config.target_name or 'unknown'}, "
                       f"fingerprint {config.target_fingerprint}); this target's fingerprint is "
                       f"{target.fingerprint()}")


def find_checkpoint(search, accept):
    """The first checkpoint folder under the folders `search` (each holding one subfolder per
    drafter) whose config.json, as a dict, satisfies `accept`; None if there is none.
    Unreadable configs are passed over."""
    for root in map(Path, search):
        for cfg_path in sorted(root.glob(f"*/{CONFIG_NAME}")) if root.is_dir() else []:
            try:
                c = json.loads(cfg_path.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if accept(c):
                return cfg_path.parent
    return None


def read_config(folder, what: str) -> dict:
    """config.json of a checkpoint folder as a dict; a clear error when the folder is not one."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).exists() or not (folder / WEIGHTS_NAME).exists():
        raise SPDError(f"{what} checkpoint {folder} not found (expected {CONFIG_NAME} and "
                       f"{WEIGHTS_NAME} in that folder)")
    return read_json_object(folder / CONFIG_NAME, f"{what} config")


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "SavedDrafter", "check_draft_map", "check_target", "dequantise",
           "find_checkpoint", "load_weights", "read_config", "read_weights", "save_drafter"]
