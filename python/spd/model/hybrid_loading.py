"""Reading a part of a hybrid target (Qwen3.5, its vision-language form, Qwen3-Next) from its
safetensors files: the model built on the meta device, then only the tensors a rank keeps read
into their final buffers, already in the stage step's layout (spd.model.hybrid_layout), so each
weight exists once. The visual tower's tensors (and the multi-token-prediction head's) are never
read; Qwen3-Next's experts, stored one tensor per expert, are read into the model's fused
[experts, ...] parameters.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from spd.model.hybrid_layout import attention_dims, check_layer, layer_groups, set_hf_rows_
from spd.model.meta_build import check_loading_info, hf_on_meta, kept, param_names, set_param

_FUSED_EXPERTS = ".mlp.experts."


def _sources(name: str, param, weights) -> list[tuple[str, tuple]] | None:
    """Where parameter `name` is stored: [(stored name, index into the parameter)], or None.
    A fused expert parameter (gate_up_proj [E, 2I, d], down_proj [E, d, I]) stored per expert
    comes from E (or 2E) tensors."""
    key = weights.key(name)
    if key is not None:
        return [(key, ())]
    prefix, _, attr = name.rpartition(".")
    if not prefix.endswith(_FUSED_EXPERTS[:-1]) or attr not in ("gate_up_proj", "down_proj"):
        return None
    out = []
    for e in range(param.shape[0]):
        if attr == "down_proj":
            parts = [(f"{prefix}.{e}.down_proj.weight", (e,))]
        else:
            half = param.shape[1] // 2
            parts = [(f"{prefix}.{e}.gate_proj.weight", (e, slice(0, half))),
                     (f"{prefix}.{e}.up_proj.weight", (e, slice(half, None)))]
        for stored, index in parts:
            key = weights.key(stored)
            if key is None:
                return None
            out.append((key, index))
    return out


def _check_sources(folder: Path, model, aliases: dict[str, list[str]], weights) -> dict:
    """Every parameter in the files with the shape config.json implies, and no other tensor
    but those the model ignores (the visual tower, mtp.*): from the headers, nothing read."""

    sources, missing, mismatched = {}, [], []
    for name, names in aliases.items():
        param = model.get_parameter(name)
        src = next((s for s in (_sources(a, param, weights) for a in names) if s), None)
        if src is None:
            missing.append(name)
            continue
        sources[name] = src
        meta = torch.empty(param.shape, device="meta")
        mismatched += [k for k, index in src if weights.entries[k].shape != meta[index].shape]
    used = {k for src in sources.values() for k, _ in src}
    for names in aliases.values():  # a tied head may be stored too: not unexpected
        used.update(k for k in map(weights.key, names) if k is not None)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected",
                                              None) or ()]
    unexpected = [k for k in weights.names()
                  if k not in used and not any(p.search(k) for p in ignored)]
    check_loading_info(folder, {"missing_keys": missing, "unexpected_keys": unexpected,
                                 "mismatched_keys": mismatched})
    return sources


def _read(weights, sources, dst: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Fill dst from its stored tensors; with `rows` (stored row -> file row) in that order, via
    one temporary of the tensor (the file's rows are read in their order)."""
    if rows is None:
        for key, index in sources:
            weights.read_into(key, dst[index])
        return
    tmp = torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    for key, index in sources:
        weights.read_into(key, tmp[index])
    torch.index_select(tmp, 0, rows.to(dst.device), out=dst)


def load_hybrid_part(folder: Path, config, weights, device: str, dtype, layers, embed: bool,
                     head: bool):
    """The model built on the meta device, then the parameters a process holding `layers`,
    the embedding (`embed`) and the final norm + LM head (`head`) needs read from `weights`
    (spd.model.weight_files.WeightFiles), its layers in the stage layout."""
    model = hf_on_meta(folder, config, dtype, device)
    text, inner = model.config, model.model
    aliases = param_names(model)
    sources = _check_sources(folder, model, aliases, weights)
    wanted = [n for n, ns in aliases.items() if any(kept(a, layers, embed, head) for a in ns)]
    dims = attention_dims(text)
    groups, grouped = [], set()
    for i in (range(text.num_hidden_layers) if layers is None else layers):
        check_layer(inner.layers[i])
        for group in layer_groups(inner.layers[i], dims):
            named = [(f"model.layers.{i}.{n}", rows) for n, rows in group]
            groups.append(named)
            grouped.update(n for n, _ in named)
    groups += [[(n, None)] for n in wanted if n not in grouped]
    for group in groups:
        metas = [model.get_parameter(n) for n, _ in group]
        sizes = [m.shape[0] if m.dim() else 1 for m in metas]
        buf = torch.empty((sum(sizes), *metas[0].shape[1:]), dtype=metas[0].dtype, device=device)
        for (n, rows), m, view in zip(group, metas, buf.split(sizes)):
            view = view.view(m.shape)
            _read(weights, sources[n], view, rows)
            param = torch.nn.Parameter(view)
            for a in aliases[n]:
                set_param(model, a, param)
            if rows is not None:
                set_hf_rows_(model.get_submodule(n.rpartition(".")[0]), rows)
    return model
