"""Building a Hugging Face model with its weights on the meta device, and putting the weights a
process keeps into it by name: what the per-rank loaders (spd.model.loading for Llama / Qwen2 /
Qwen3, spd.model.hybrid_loading for Qwen3.5 / Qwen3-Next) share."""
from __future__ import annotations

from pathlib import Path

from spd.errors import SPDError


def param_names(model) -> dict[str, list[str]]:
    """Each parameter's first name -> all its names (a tied LM head is the embedding too)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {ns[0]: ns for ns in names.values()}


def kept(name: str, layers: range | None, embed: bool, head: bool) -> bool:
    """Whether a process holding `layers`, the embedding (`embed`) and the final norm and LM
    head (`head`) needs the parameter `name` (anything else, e.g. a new module, is kept)."""
    if name.startswith("model.layers."):
        return layers is None or int(name.split(".")[2]) in layers
    if name == "model.embed_tokens.weight":
        return embed
    if name in ("model.norm.weight", "lm_head.weight"):
        return head
    return True


def set_param(model, name: str, param) -> None:
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = param


def hf_on_meta(folder: Path, config, dtype, device: str):
    """Hugging Face's model, its weights on the meta device, its rotary tables on `device`."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    inner = model.model
    # computed, not stored; from the text model's config (a vision-language config holds one)
    inner.rotary_emb = type(inner.rotary_emb)(config.get_text_config()).to(device)
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: the one derived from config.json stays
        pass
    return model


def check_loading_info(folder: Path, info: dict) -> None:
    """Weights missing from the files or left unused by the model mean config.json describes
    another model (e.g. a wrong num_hidden_layers): refuse instead of running it half random."""
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or []]
    if missing or unexpected or mismatched:
        parts = [f"{name} {len(keys)} ({', '.join(keys[:2])}{', ...' if len(keys) > 2 else ''})"
                 for name, keys in (("missing", missing), ("unexpected", unexpected),
                                    ("mismatched", mismatched)) if keys]
        raise SPDError(f"{folder}: the weights do not match config.json (check e.g. "
                       f"num_hidden_layers): {'; '.join(parts)}")
