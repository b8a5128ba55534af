"""The Pipeline Draft Module: a small decoder that drafts the next token from target features.

Input per position: g = P_e([h_{b_0}; ...; h_{b_e}]) (spd_kernels.anchor_projection), one
projection per aggregation type e that occurs at some depth. Then L_s Qwen3-style layers
(RMSNorm, GQA with per-head q/k norm, RoPE, SwiGLU), a final norm and an LM head over a reduced
draft vocabulary whose rows map to target ids (`draft_to_target`).

The draft step may read weight-only quantised copies of the weights (`quantize_("int8" | "fp8")`,
spd_kernels.quant: one scale per output row): half the bytes of bf16 per step, and since
verification is exact, SPD's output is unchanged; only the acceptance rate may move.

A checkpoint is a folder with `config.json` (names the target, its fingerprint, n, the split,
the anchors, L_s, the draft vocabulary size) and `model.safetensors`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from spd.draft.checkpoint import (
    CONFIG_NAME,
    SavedDrafter,
    check_target,
    find_checkpoint,
    load_weights,
    read_config,
)
from spd.errors import SPDError
from spd.model.layers import RMSNorm, decoder_layer_step, pack_layer_, rope_table
from spd.model.partition import DepthLayout
from spd_kernels import anchor_projection, pdm_step
from spd_kernels.pdm import (
    PDMWeights,
    pdm_batch_step,
    pdm_batch_tree_step,
    pdm_tree_step,
    quantize_group,
)
from spd_kernels.qkv_rope import back_to_back
from spd_kernels.quant import KINDS as QUANT_KINDS

# --draft-weights: "model" = the PDM's own dtype (today's path); int8 / fp8 = weight-only
# quantised copies for the draft step (spd_kernels.quant)
DRAFT_WEIGHTS = ("model", *QUANT_KINDS)


def check_draft_weights(value: str) -> str:
    if value not in DRAFT_WEIGHTS:
        raise SPDError(f"draft weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {value!r}")
    return value


# the layer weights the step reads, with the LayerWeights field of each one's scale
_LAYER_QUANT = (("wq", "wq_scale"), ("wk", "wk_scale"), ("wv", "wv_scale"), ("wo", "wo_scale"),
                ("w_gate", "gate_scale"), ("w_up", "up_scale"), ("w_down", "down_scale"))

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"  # spd/checkpoints


@dataclass
class PDMConfig:
    target_fingerprint: str
    target_num_layers: int
    target_hidden_size: int
    target_vocab_size: int
    n_stages: int
    stage_split: list[int]
    anchors: list[int]
    num_layers: int = 2
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    draft_vocab_size: int = 8192
    rms_eps: float = 1e-5
    rope_theta: float = 100000.0
    features: str = "pre-step"
    target_name: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        """Sizes are positive integers (a PDM has at least one layer), the heads divide into
        the KV heads and the draft vocabulary is part of the target's."""
        for name in ("target_num_layers", "target_hidden_size", "target_vocab_size", "n_stages",
                     "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "draft_vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SPDError(f"PDM {name} must be an integer >= 1, got {v!r}")
        for name in ("stage_split", "anchors"):
            v = getattr(self, name)
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                  for x in v):
                raise SPDError(f"PDM {name} must be a list of integers, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise SPDError(f"PDM num_heads ({self.num_heads}) must be a multiple of "
                           f"num_kv_heads ({self.num_kv_heads})")
        if self.draft_vocab_size > self.target_vocab_size:
            raise SPDError(f"PDM draft_vocab_size ({self.draft_vocab_size}) exceeds the "
                           f"target's vocabulary ({self.target_vocab_size})")

    @property
    def layout(self) -> DepthLayout:
        return DepthLayout.build(self.target_num_layers, self.n_stages, self.stage_split,
                                 self.anchors)


def default_pdm_layers(num_layers: int, n_stages: int) -> int:
    """Rule of thumb L_s ~ L/n - 1 (so drafting hides behind a stage), kept within [1, 4]."""
    return max(1, min(4, num_layers // n_stages - 1))


def attention_shape_for(target) -> tuple[int, int, int]:
    """(heads, KV heads, head_dim) of a draft model's standard attention for `target`: the
    target's, except that a head size over 128 (Qwen3.5's 256) is split into heads of 128, which
    the draft kernels take; the projections keep their widths."""
    heads, kv, hd = target.num_heads, target.num_kv_heads, target.head_dim
    if hd > 128 and hd % 128 == 0:
        f = hd // 128
        return heads * f, kv * f, 128
    return heads, kv, hd


def pdm_config_for(target, layout: DepthLayout, num_layers: int | None = None,
                   draft_vocab_size: int = 8192) -> PDMConfig:
    cfg = target.config
    heads, kv_heads, head_dim = attention_shape_for(target)
    return PDMConfig(
        target_fingerprint=target.fingerprint(), target_num_layers=target.num_layers,
        target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
        n_stages=layout.n, stage_split=layout.split, anchors=list(layout.anchors),
        num_layers=num_layers if num_layers is not None else default_pdm_layers(
            target.num_layers, layout.n),
        hidden_size=target.hidden_size, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=cfg.intermediate_size,
        draft_vocab_size=min(draft_vocab_size, target.vocab_size), rms_eps=target.rms_eps,
        rope_theta=float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        target_name=Path(target.name).name)


class _Attention(nn.Module):
    def __init__(self, c: PDMConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)


class _MLP(nn.Module):
    def __init__(self, c: PDMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: PDMConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps)


class PipelineDraftModule(nn.Module, SavedDrafter):
    def __init__(self, config: PDMConfig):
        super().__init__()
        self.config = config
        layout = config.layout
        self.layout = layout
        d = config.target_hidden_size
        self.projections = nn.ModuleDict(
            {str(e): nn.Linear((e + 1) * d, config.hidden_size) for e in layout.types})
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target",
                             torch.arange(config.draft_vocab_size, dtype=torch.int64))
        self._rope = None
        self.draft_weights = "model"   # what the draft step reads (quantize_)
        # slot -> (key of the float tensors, [(q, scale), ...], quantised as one packed tensor)
        self._quant: dict = {}

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def untrained(cls, target, layout: DepthLayout, num_layers: int | None = None,
                  draft_vocab: torch.Tensor | None = None, seed: int = 0):
        """Random layers, LM head rows copied from the target. Drafts poorly; output stays exact."""
        cfg = pdm_config_for(target, layout, num_layers,
                             draft_vocab_size=len(draft_vocab) if draft_vocab is not None else 8192)
        gen = torch.Generator().manual_seed(seed)
        pdm = cls(cfg)
        with torch.no_grad():
            for name, p in pdm.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
                elif name.endswith(".bias"):
                    # zero, not nn.Linear's draw from the global generator: every process
                    # (a distributed rank 0 too) must build the same PDM for the same seed
                    p.zero_()
            ids = (draft_vocab if draft_vocab is not None
                   else torch.arange(cfg.draft_vocab_size)).to(torch.int64)
            pdm.draft_to_target.copy_(ids)
            pdm.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[ids])
        return pdm.to(device=target.device, dtype=target.dtype).eval()

    @classmethod
    def load(cls, folder, target=None, layout: DepthLayout | None = None):
        config = read_pdm_config(folder)
        if target is not None:
            check_compatible(config, target, layout, source=str(folder))
        return load_weights(cls(config), folder, target)

    # --- inference ------------------------------------------------------------------------
    def new_cache(self, capacity: int, poison: bool = False, buffers=None):
        from spd.model.cache import KVCache
        w = self.lm_head.weight
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, w.device, w.dtype,
                       poison_on_truncate=poison, buffers=buffers)

    def slot_caches(self, slots: int, capacity: int):
        """The caches of `slots` sequences in two tensors, k and v [slots, layers, kv_heads,
        capacity, head_dim] (what `batch_step` writes), and each slot's KVCache over its rows
        -> (k, v, [KVCache] a slot)."""
        c, w = self.config, self.lm_head.weight
        shape = (slots, c.num_layers, c.num_kv_heads, capacity, c.head_dim)
        k, v = (torch.zeros(shape, device=w.device, dtype=w.dtype) for _ in range(2))
        return k, v, [self.new_cache(capacity, buffers=(k[b], v[b])) for b in range(slots)]

    def features(self, anchors: torch.Tensor, types: torch.Tensor, *,
                 quantized: bool = True) -> torch.Tensor:
        """anchors [m, R, d_target], types [R] -> PDM inputs [R, hidden]. With quantize_ on, the
        projections' quantised copies (quantized=False: the float parameters, for training)."""
        m = len(self.layout.anchors)
        weights = [None] * m
        biases = [None] * m
        scales = None
        quant = quantized and self.draft_weights != "model"
        if quant:
            scales = [None] * m
        for key, proj in self.projections.items():
            e = int(key)
            if quant:
                [(weights[e], scales[e])] = self._quantized(f"proj{key}", [proj.weight])
            else:
                weights[e] = proj.weight
            biases[e] = proj.bias
        return anchor_projection(anchors, types, weights, biases, scales)

    def _rope_for(self, need: int, like: torch.Tensor):
        c = self.config
        if self._rope is None or self._rope[0].shape[0] < need or self._rope[0].dtype != like.dtype:
            self._rope = rope_table(c.head_dim, max(need, 2048), c.rope_theta,
                                    device=like.device, dtype=like.dtype)
        return self._rope

    def forward_train(self, anchors: torch.Tensor, tl, head: bool = True) -> torch.Tensor:
        """Training forward over a `train_layout.TrainLayout`: draft logits of the loss rows.

        anchors [m, T, d_target] of one sequence (or of several packed: spd.train.layout);
        returns [T, draft_vocab] (fp32), or with head=False the normed hidden states [T, hidden]
        the LM head reads (a trainer that applies the frozen head itself).
        """
        c = self.config
        x = self.features(anchors[:, tl.tokens], tl.types, quantized=False)
        cos, sin = self._rope_for(int(tl.position.max()) + 1, x)
        cos, sin = cos[tl.position], sin[tl.position]
        last = len(self.layers) - 1
        if last < 0:
            x = x[tl.loss_rows]
        for i, layer in enumerate(self.layers):
            # Only the loss rows' outputs matter after the last layer, so it computes queries,
            # output projection and MLP for those rows alone (the other copies stay keys).
            x = decoder_layer_step(layer, x, cos, sin, None, None, 0, c.num_heads,
                                   c.num_kv_heads, c.head_dim, mask=tl.mask,
                                   rows=tl.loss_rows if i == last else None)
        return self.lm_head(self.norm(x)).float() if head else self.norm(x)

    @torch.no_grad()
    def step(self, features: torch.Tensor, start, cache, last=None) -> torch.Tensor:
        """Run rows at positions start.. through the layers; return draft logits of the last row,
        or of row `last` (int64 [1] on the device). `start`: an int, or an int64 tensor [1] on
        the device (never read on the host: a decode cycle keeps its rows inside the cache by
        construction).

        Runs spd_kernels.pdm_step (backends per spd_kernels.dispatch): the layers of
        `forward_train`, cached (tests/kernels/test_pdm_step.py holds them equal)."""
        rows = features.shape[0]
        if isinstance(start, torch.Tensor):
            cos, sin = self._rope_for(cache.capacity, features)
            cache.set_length(start)
            cache.advance(rows)
        else:
            cos, sin = self._rope_for(start + rows, features)
            cache.reserve(start, rows)
        return pdm_step(features, self.kernel_weights(), cache.k, cache.v, start, cos, sin,
                        last=last)

    @torch.no_grad()
    def batch_step(self, features: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slots: torch.Tensor, positions: torch.Tensor,
                   last: torch.Tensor) -> torch.Tensor:
        """`step` over the windows of several sequences (spd_kernels.pdm_batch_step): features
        [T, hidden], row r of slot slots[r] at positions[r] ([T] int64 each) of the slot caches
        k, v (`slot_caches`) -> draft logits [U, Vd] of the rows `last` ([U] int64)."""
        cos, sin = self._rope_for(k.shape[3], features)
        return pdm_batch_step(features, self.kernel_weights(), k, v, slots, positions, cos, sin,
                              last)

    @torch.no_grad()
    def batch_tree_step(self, features: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: list[int], rows: torch.Tensor, positions: torch.Tensor,
                        prefix_len: torch.Tensor, tree_mask: torch.Tensor,
                        leaves: torch.Tensor) -> torch.Tensor:
        """`tree_step` over the token trees of several sequences (spd_kernels.pdm_batch_tree_step):
        features [U * R, hidden], tree u's rows in slot slots[u] (host ints) of the slot caches
        k, v (`slot_caches`) at cache rows rows[u] ([U, R] int64) and positions [U * R] (int64);
        prefix_len [U], tree_mask [U, R, R] -> draft logits [len(leaves), Vd] of the rows
        `leaves` (indices into the U * R rows)."""
        cos, sin = self._rope_for(k.shape[3], features)
        return pdm_batch_tree_step(features, self.kernel_weights(), k, v, slots, rows,
                                   prefix_len, tree_mask, cos.index_select(0, positions),
                                   sin.index_select(0, positions), leaves)

    @torch.no_grad()
    def tree_step(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  prefix_len, tree_mask: torch.Tensor, leaves: torch.Tensor,
                  cache) -> torch.Tensor:
        """`step` over the rows of a token tree (spd.runtime.drafting): features [R, hidden] at
        positions [R] (int64, on the device), row r into cache slot slots[r]; each row attends
        to the cache's rows [0, prefix_len) and to its ancestors and itself among the rows
        (tree_mask [R, R]) -> draft logits [len(leaves), Vd] of the rows `leaves` ([k] int64)."""
        cos, sin = self._rope_for(cache.capacity, features)
        return pdm_tree_step(features, self.kernel_weights(), cache.k, cache.v, slots,
                             prefix_len, tree_mask, cos.index_select(0, positions),
                             sin.index_select(0, positions), leaves)

    @torch.no_grad()
    def pack_qkv_(self) -> "PipelineDraftModule":
        """Put each layer's q, k and v projection weights back to back in one buffer, and gate
        and up (spd.model.layers.pack_layer_: the parameters become views of it; values
        unchanged), so the Triton step streams them as one product. For inference: an optimizer
        holding the old tensors would lose track."""
        for layer in self.layers:
            pack_layer_(layer)
        return self

    def kernel_weights(self) -> PDMWeights:
        """The layers as plain tensors for spd_kernels.pdm_step. Built on every call (a few
        microseconds: references, no copies), so replaced or moved parameters are never stale.
        With quantize_ on, the weights are the cached quantised copies with their scales."""
        weights = PDMWeights.from_pdm(self)
        if self.draft_weights == "model":
            return weights
        # one check of every tensor the step reads (address, version) returns the last result:
        # the per-group checks below cost more than building the weights
        key = tuple((t.data_ptr(), t._version) for lw in weights.layers
                    for t in vars(lw).values() if t is not None)
        key += ((weights.lm_head.data_ptr(), weights.lm_head._version),
                (weights.final_norm.data_ptr(), weights.final_norm._version))
        hit = self._quant.get("step")
        if hit is not None and hit[0] == key:
            return hit[1]
        for i, lw in enumerate(weights.layers):
            # q/k/v, then gate/up, quantised together so copies of packed weights stay packed
            groups = (_LAYER_QUANT[:3], _LAYER_QUANT[3:4], _LAYER_QUANT[4:6], _LAYER_QUANT[6:])
            for g, group in enumerate(groups):
                pairs = self._quantized(f"layer{i}.{g}", [getattr(lw, w) for w, _ in group])
                for (w_name, s_name), (q, scale) in zip(group, pairs):
                    setattr(lw, w_name, q)
                    setattr(lw, s_name, scale)
        [(weights.lm_head, weights.lm_head_scale)] = self._quantized("lm_head", [weights.lm_head])
        self._quant["step"] = (key, weights, None)
        return weights

    def draft_weight_addresses(self) -> tuple:
        """Addresses of the quantised copies the draft step reads (remade now if stale; () for
        float weights): a captured step (spd.draft.graphs) is stale when they change."""
        if self.draft_weights == "model":
            return ()
        w = self.kernel_weights()
        tensors = [w.lm_head, w.lm_head_scale]
        tensors += [getattr(lw, f) for lw in w.layers for pair in _LAYER_QUANT for f in pair]
        for key, proj in self.projections.items():
            tensors += self._quantized(f"proj{key}", [proj.weight])[0]
        return tuple(t.data_ptr() for t in tensors)

    @torch.no_grad()
    def quantize_(self, kind: str = "int8") -> "PipelineDraftModule":
        """Make the draft step (kernel_weights, features) read weight-only quantised copies of
        every weight it reads: "int8" or "fp8" (e4m3), one fp32 scale per output row
        (spd_kernels.quant.quantize_weight); "model" goes back to the float parameters. The
        parameters stay float (training reads them); the copies are made on first use and
        remade when a parameter is replaced or written in place (its address or version
        changes), into the same buffers when the shapes allow, so a captured draft step keeps
        reading them."""
        check_draft_weights(kind)
        if kind != self.draft_weights:
            self._quant.clear()
        self.draft_weights = kind
        return self

    @torch.no_grad()
    def _quantized(self, slot: str, tensors: list[torch.Tensor]) -> list[tuple]:
        """[(q, scale)] for float weights `tensors`, cached under `slot` until one of them
        changes. Tensors lying back to back (pack_qkv_) are quantised as one, so their copies
        and scales lie back to back too (one product in the step)."""
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        hit = self._quant.get(slot)
        if hit is not None and hit[0] == key:
            return hit[1]
        packed = len(tensors) > 1 and back_to_back(*tensors) is not None
        pairs = quantize_group(tensors, self.draft_weights)
        old = None if hit is None else hit[1]
        if old is not None and hit[2] == packed and len(old) == len(pairs) and all(
                a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                for (a, _), (b, _) in zip(old, pairs)):
            for (q_old, s_old), (q_new, s_new) in zip(old, pairs):  # same addresses
                q_old.copy_(q_new)
                s_old.copy_(s_new)
            pairs = old
        self._quant[slot] = (key, pairs, packed)
        return pairs


def read_pdm_config(folder) -> PDMConfig:
    raw = read_config(folder, "PDM")
    if raw.get("method") not in (None, "spd", "ppsd"):
        raise SPDError(f"{folder} holds a {raw['method']} draft head, not a PDM: use it with "
                       f"its own method (e.g. spd eval --methods {raw['method']})")
    try:
        return PDMConfig(**raw)
    except (TypeError, SPDError) as exc:
        raise SPDError(f"{Path(folder) / CONFIG_NAME} is not a PDM config: {exc}") from exc


def check_pdm_folder(folder) -> PDMConfig:
    """The checkpoint's config (validated) and its weights file's header, without the target:
    what can be refused before a model loads."""
    from spd.data.files import check_safetensors
    from spd.draft.checkpoint import WEIGHTS_NAME
    config = read_pdm_config(folder)
    check_safetensors(Path(folder) / WEIGHTS_NAME)
    return config


def check_compatible(config: PDMConfig, target, layout: DepthLayout | None, source: str = "PDM"):
    """Refuse a checkpoint built for another target, stage count, split or anchor set."""
    check_target(config, target, source)
    if layout is not None:
        if config.n_stages != layout.n:
            raise SPDError(f"{source} was built for n={config.n_stages} stages but "
                           f"n={layout.n} was requested; pass --stages {config.n_stages} or a "
                           "PDM trained for this n")
        if list(config.stage_split) != layout.split:
            raise SPDError(f"{source} was built for the stage split {config.stage_split}, "
                           f"not {layout.split}")
        if list(config.anchors) != list(layout.anchors):
            raise SPDError(f"{source} was built for anchors {config.anchors}, not "
                           f"{list(layout.anchors)}")


def find_shipped_pdm(target, layout: DepthLayout, num_layers: int | None = None,
                     method: str = "spd", search=(SHIPPED_DIR,)):
    """The checkpoint for this target, n, split and anchors (and L_s, method if given) found in
    the folders `search` (default: those shipped with the package), or None."""
    def accept(c: dict) -> bool:
        return (c.get("target_fingerprint") == target.fingerprint()
                and c.get("n_stages") == layout.n and c.get("stage_split") == layout.split
                and c.get("anchors") == list(layout.anchors)
                and (c.get("extra") or {}).get("method", "spd") == method
                and num_layers in (None, c.get("num_layers")))
    return find_checkpoint(search, accept)
