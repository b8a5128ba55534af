"""What one decode step of each target layer costs, in bytes read, and `--split auto` built on it.

At batch 1 a decode step is bound by memory reads: a layer's cost is the bytes of its weights
plus the cache it attends to at the context (full attention: K and V rows of every cached
position; a hybrid target's linear-attention layer: its recurrent state, read and written, and
its convolution history; a mixture-of-experts MLP: the experts a token is routed to). The last
stage also reads the final norm and the LM head (greedy, it verifies after its layers). These
are the weight-read floors of docs/results.md, not measurements: a stage that runs at a constant
multiple of its floor balances the same. The measured per-stage times of the evaluation's cost
model (spd.evaluation.cost_model.Costs.layer_costs) are the other source.

    costs = target_costs(target, context=1024)           # a loaded (or partly meta) target
    costs = file_costs(model_folder, dtype)              # config + safetensors headers only
    split = balanced_split(costs.layers, n, costs.head)  # spd.model.partition
    split = resolve_split("auto", costs, n)              # what --split auto does
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from spd.errors import SPDError
from spd.model.partition import AUTO, balanced_split, parse_split, stage_times

DEFAULT_CONTEXT = 1024  # positions cached when the split is chosen (the benchmarks' context)


@dataclass(frozen=True)
class StepCosts:
    """Bytes one decode step reads: per layer (`layers`) and for the final norm + LM head."""
    layers: list[float]
    head: float

    def stage_times(self, split: Sequence[int], extra: dict[int, float] | None = None
                    ) -> list[float]:
        """Bytes each stage of `split` reads per step (the last with the head)."""
        return stage_times(self.layers, split, self.head, extra)


def _linear_attention(config, i: int) -> bool:
    types = getattr(config, "layer_types", None) or ()
    return i < len(types) and types[i] == "linear_attention"


def _expert_share(config) -> float:
    """Fraction of a mixture-of-experts layer's expert weights one token reads (1 if dense)."""
    experts = getattr(config, "num_experts", None) or 0
    routed = getattr(config, "num_experts_per_tok", None) or 0
    return routed / experts if experts and routed else 1.0


def cache_bytes(config, i: int, context: int, el: int) -> float:
    """Bytes of layer i's cache one step reads at `context` cached positions (el: bytes per
    element of the model dtype)."""
    if _linear_attention(config, i):
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        conv = (config.linear_conv_kernel_dim - 1) * (2 * hk * dk + hv * dv) * el
        return 2 * hv * dk * dv * 4 + conv  # the fp32 state is read and written back
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * kv * hd * context * el


def _weight_bytes(named: Sequence[tuple[str, int]], share: float) -> float:
    """Bytes of (name, bytes) weights, the routed experts' counted at `share`."""
    return sum(b * (share if ".experts." in name else 1.0) for name, b in named)


def target_costs(target, context: int = DEFAULT_CONTEXT) -> StepCosts:
    """The step costs of a loaded spd.model.target.TargetModel (weights on the meta device
    count too: a stage rank's target knows every layer's shapes)."""
    cfg, el = target.config, target.dtype.itemsize
    share = _expert_share(cfg)
    layers = []
    for i, layer in enumerate(target.layers):
        named = [(n, p.numel() * p.element_size()) for n, p in layer.named_parameters()]
        layers.append(_weight_bytes(named, share) + cache_bytes(cfg, i, context, el))
    head = sum(p.numel() * p.element_size() for p in (target.norm.weight,
                                                      target.lm_head.weight))
    return StepCosts(layers, float(head))


def file_costs(model=None, dtype=None, context: int = DEFAULT_CONTEXT) -> StepCosts:
    """The step costs from a model folder's config and safetensors headers alone (no weights
    read): what a launcher knows before its ranks load. dtype: the dtype the weights will run
    in (default: each tensor's stored dtype)."""
    import torch

    from spd.model.loading import model_config, resolve_model_path
    from spd.model.weight_files import WeightFiles

    folder = resolve_model_path(model)
    cfg = model_config(folder)
    cfg = getattr(cfg, "text_config", None) or cfg  # a vision-language checkpoint's text model
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SPDError(f"{folder}: no *.safetensors files to size the stages from")
    weights = WeightFiles(files)
    el_run = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None

    def nbytes(name: str) -> int:
        e = weights.entries[name]
        return e.numel * (el_run or e.dtype.itemsize)

    el = el_run or next(iter(weights.entries.values())).dtype.itemsize
    share, L = _expert_share(cfg), cfg.num_hidden_layers
    per_layer: list[list[tuple[str, int]]] = [[] for _ in range(L)]
    head = 0
    for name in weights.names():
        bare = name.removeprefix("model.").removeprefix("language_model.")
        if bare.startswith("layers."):
            i = int(bare.split(".")[1])
            if i < L:
                per_layer[i].append((bare, nbytes(name)))
        elif bare in ("norm.weight", "lm_head.weight"):
            head += nbytes(name)
    if not any(k.endswith("lm_head.weight") for k in weights.names()):  # tied to the embedding
        embed = next((k for k in weights.names() if k.endswith("embed_tokens.weight")), None)
        head += nbytes(embed) if embed else 0
    layers = [_weight_bytes(named, share) + cache_bytes(cfg, i, context, el)
              for i, named in enumerate(per_layer)]
    return StepCosts(layers, float(head))


def pdm_step_bytes(hidden: int, target_hidden: int, heads: int, kv_heads: int, head_dim: int,
                   intermediate: int, layers: int, draft_vocab: int, types: Sequence[int],
                   context: int, el: int = 2, weights: str = "bf16") -> dict[str, float]:
    """Bytes one PDM draft step reads (spd.draft.pdm.PipelineDraftModule at fill n): the anchor
    projections of the aggregation `types` that occur (type e: [(e+1) * target_hidden ->
    hidden] + bias), `layers` decoder layers (q/k/v/o, q/k norms, SwiGLU MLP, two norms), the
    final norm and the draft head [draft_vocab, hidden], and the PDM's own KV rows at
    `context`. weights: "bf16" (el bytes each) or "int8" (the 2-D weights one byte each plus
    one fp32 scale per output row, spd_kernels.quant; norms and biases stay in the model dtype).
    Returns the parts and their "total"."""
    if weights not in ("bf16", "int8"):
        raise SPDError(f"weights must be bf16 or int8, got {weights!r}")

    def matrix(rows: int, cols: int) -> float:  # [rows, cols], rows = output features
        return rows * cols * el if weights == "bf16" else rows * cols + 4 * rows

    q, kv = heads * head_dim, kv_heads * head_dim
    anchor = sum(matrix(hidden, (e + 1) * target_hidden) + hidden * el for e in types)
    layer = (matrix(q, hidden) + 2 * matrix(kv, hidden) + matrix(hidden, q)
             + 2 * head_dim * el                          # q and k norms
             + 2 * matrix(intermediate, hidden) + matrix(hidden, intermediate)
             + 2 * hidden * el)                           # input and post-attention norms
    head = matrix(draft_vocab, hidden) + hidden * el
    cache = layers * 2 * kv * context * el
    parts = dict(anchor=anchor, layers=layers * layer, head=head, kv=cache)
    return parts | {"total": sum(parts.values())}


def draft_step_cost(config, n: int, pdm_layers: int, draft_vocab: int = 8192,
                    context: int = DEFAULT_CONTEXT, el: int = 2) -> float:
    """Bytes of the step of a PDM at the target's widths (spd.draft.pdm.pdm_config_for's
    shape), `pdm_layers` layers, over the aggregation types of the uniform n-stage layout with
    the default anchors: what --split auto charges the stage that hosts the draft."""
    from spd.model.partition import DepthLayout

    cfg = getattr(config, "text_config", None) or config
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    types = DepthLayout.build(L, n).types
    return pdm_step_bytes(d, d, cfg.num_attention_heads, kv, hd, cfg.intermediate_size,
                          pdm_layers, min(draft_vocab, cfg.vocab_size), types, context,
                          el)["total"]


def resolve_split(text, costs, n: int, draft_on_stage: int | None = None,
                  draft_cost: float = 0.0) -> list[int] | None:
    """A --split value as a list of layers per stage: None (uniform), 'a,b,...', or 'auto':
    the balanced split of `costs` (a StepCosts, or a callable returning one, called only for
    'auto') over n stages, the last stage paying the head and, with `draft_on_stage` S, stage S
    paying `draft_cost` (the n-device mode: the draft step shares that stage's device)."""
    split = parse_split(text) if isinstance(text, str) or text is None else list(text)
    if split != AUTO:
        return split
    if draft_on_stage is not None and not (0 <= draft_on_stage < n):
        raise SPDError(f"--draft-on-stage {draft_on_stage}: stages are numbered 0..{n - 1}")
    c = costs() if callable(costs) else costs
    extra = {draft_on_stage: draft_cost} if draft_on_stage is not None else None
    return balanced_split(c.layers, n, c.head, extra)


__all__ = ["DEFAULT_CONTEXT", "StepCosts", "cache_bytes", "draft_step_cost", "file_costs",
           "pdm_step_bytes",
           "resolve_split", "target_costs"]
