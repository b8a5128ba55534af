"""The target model seen as pieces: embedding, stages of decoder layers, final norm + LM head.

A `Stage` owns a contiguous block of layers and its own `KVCache`, and runs them as
spd_kernels.stage_step over weights packed once at load; on a GPU its steps of up to
`GRAPH_MAX_ROWS` rows replay as CUDA graphs. Running a chunk of rows through every stage in order
gives the unpartitioned model's hidden states (exactly, on the reference backend).
"""
from __future__ import annotations

import hashlib

import torch

from spd.cuda_graphs import GraphSet, graphs_enabled
from spd.errors import InternalError, SPDError
from spd.model.cache import KVCache
from spd.model.hybrid import (
    HybridCache,
    full_width_rope,
    hybrid_stage_weights,
    is_hybrid,
    rotary_dim,
)
from spd.model.hybrid_layout import arrange_layer_, attention_dims, hf_rows, sample_hf_layout
from spd.model.layers import pack_layer_
from spd_kernels import fused_linear, verify_greedy
from spd_kernels.hybrid_stage import hybrid_stage_step
from spd_kernels.stage import LayerWeights, StageWeights, stage_step, tree_stage_step

# Steps of at most this many rows are graphed (decoding: 1 row; EAGLE-3 verifies k + 1); longer
# chunks (prefill) run eagerly, where launch gaps are small beside the work.
GRAPH_MAX_ROWS = 16
# Elements of each sampled weight that identify the target (TargetModel.fingerprint).
FINGERPRINT_SAMPLE = 4096


def _on_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def check_layers_supported(hf_model, name: str) -> None:
    """The stage step computes Llama / Qwen2 / Qwen3 layers: SwiGLU with SiLU, biases on q/k/v at
    most. Anything else is refused here rather than computed differently."""
    cfg = hf_model.config
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SPDError(f"{name}: hidden_act={act!r} is not supported (the stage step computes "
                       "SwiGLU with SiLU)")
    if is_hybrid(cfg):  # spd.model.hybrid checks its layers as it reads them
        return
    layer = hf_model.model.layers[0]
    a, m = layer.self_attn, layer.mlp
    for where, lin in (("o_proj", a.o_proj), ("gate_proj", m.gate_proj), ("up_proj", m.up_proj),
                       ("down_proj", m.down_proj)):
        if getattr(lin, "bias", None) is not None:
            raise SPDError(f"{name}: a bias on {where} is not supported (attention_bias / "
                           "mlp_bias); only q/k/v biases are")


class TargetModel:
    """A Hugging Face Llama/Qwen2/Qwen3 causal LM (or spd.model.plain_build's plain modules
    under the same names: a stage rank's), or a hybrid Qwen3.5 / Qwen3-Next one
    (spd.model.hybrid), exposed layer by layer."""

    def __init__(self, hf_model, tokenizer, name: str = "target", weight_files=None):
        """weight_files: the model's files (spd.model.weight_files.WeightFiles) when a part of it is
        on the meta device (a distributed rank's): the fingerprint reads its sample there."""
        cfg = hf_model.config
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            raise SPDError(f"{name}: sliding-window attention is not supported")
        check_layers_supported(hf_model, name)
        # Hybrid targets: DeltaNet layers with state rings, zero-centred norms x * (1 + w)
        self.hybrid = is_hybrid(cfg)
        for layer in hf_model.model.layers:  # one buffer per q/k/v and per gate/up group
            if _on_meta(layer):
                continue
            if self.hybrid:  # the stage layout, in place (a partial load reads it so)
                arrange_layer_(layer, attention_dims(cfg))
            else:
                pack_layer_(layer)
        self.weight_files = weight_files
        self.hf = hf_model
        self.tokenizer = tokenizer
        self.name = name
        self.config = cfg
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.rotary = inner.rotary_emb
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary_dim = rotary_dim(cfg, self.head_dim) if self.hybrid else self.head_dim
        # the final norm's weight is used as norm_offset + w (1 on hybrid targets)
        self.norm_offset = 1.0 if self.hybrid else 0.0
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_context = getattr(cfg, "max_position_embeddings", 4096)
        self.rms_eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
        # the device of what this process holds (a stage rank may hold no embedding)
        self.device = next((p.device for p in hf_model.parameters() if not p.is_meta),
                           self.embed.weight.device)
        self.dtype = self.embed.weight.dtype
        self.eos_token_ids = self._eos_ids()
        self._rope_cache = None
        self._fingerprint = None

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (getattr(self.hf, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else list(eos))
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # --- pieces -------------------------------------------------------------------------------
    @torch.no_grad()
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(token_ids.to(self.device))

    @torch.no_grad()
    def rope(self, start: int, rows: int):
        """cos/sin [rows, head_dim] for positions start..start+rows-1 (from the model's own rotary)."""
        need = start + rows
        if self._rope_cache is None or self._rope_cache[0].shape[0] < need:
            size = max(need, 2048)
            pos = torch.arange(size, device=self.device)[None]
            dummy = torch.zeros(1, 1, self.head_dim, device=self.device, dtype=self.dtype)
            cos, sin = self.rotary(dummy, pos)
            self._rope_cache = (cos[0], sin[0])
        cos, sin = self._rope_cache
        return cos[start:need], sin[start:need]

    def stage_weights(self, layer_ids: range) -> StageWeights:
        """Layers `layer_ids` as plain tensors for spd_kernels.stage_step (views, no copies;
        on a hybrid target spd_kernels.hybrid_stage's layers)."""
        if self.hybrid:
            return hybrid_stage_weights(self, layer_ids)
        return StageWeights([LayerWeights.from_module(self.layers[i]) for i in layer_ids],
                            self.num_heads, self.num_kv_heads, self.head_dim, self.rms_eps)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()

    @torch.no_grad()
    def judge_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`logits` of final rows hidden [R, d] -> [R, V] as one op (the final norm fused into
        the LM head's product: spd_kernels.fused_linear), in the model's dtype: the samplers
        compute in float32 from it, as from `logits`. Where the target's norm or head does not
        allow it (a hybrid target's offset norm, a head with a bias or quantised weights):
        `logits`."""
        head = self.lm_head
        if (self.hybrid or type(head) is not torch.nn.Linear or head.bias is not None
                or getattr(self.norm, "weight", None) is None):
            return self.logits(hidden)
        return fused_linear(hidden, head.weight, norm_weight=self.norm.weight, eps=self.rms_eps)

    @torch.no_grad()
    def verify_greedy(self, hidden: torch.Tensor, draft: torch.Tensor):
        """The target's greedy judgement of final rows hidden [R, d]: (argmax token [R] int64,
        whether each equals draft [R] int64; -1: no draft), the final norm, LM head and argmax
        fused in one op (spd_kernels.verify_greedy)."""
        return verify_greedy(hidden, self.norm.weight, self.rms_eps, self.lm_head.weight, draft,
                             self.norm_offset)

    def fingerprint(self) -> str:
        """Short hash of the architecture and a sample of weights: identifies the target.

        The sample is rounded to bf16 first, so the same model loaded in fp32 (CPU) or bf16
        (GPU) has the same fingerprint and a PDM trained on one loads on the other."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(repr((self.config.model_type, self.num_layers, self.hidden_size,
                           self.vocab_size, self.num_heads, self.num_kv_heads)).encode())
            first, last = self.layers[0], self.layers[-1].mlp
            mixer = (first.self_attn.q_proj if hasattr(first, "self_attn")
                     else first.linear_attn.out_proj)  # hybrid targets
            down = last.down_proj if hasattr(last, "down_proj") else last.shared_expert.down_proj
            for m in (self.embed, mixer, down, self.norm):
                sample = self._sample(m.weight, FINGERPRINT_SAMPLE, hf_rows(m))
                h.update(sample.to(torch.bfloat16).float().cpu().numpy().tobytes())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def _sample(self, w: torch.Tensor, count: int, rows=None) -> torch.Tensor:
        """flat[::max(1, numel // count)][:count] of a weight in Hugging Face's layout (`rows`:
        how a hybrid layer's rearranged rows map to it, spd.model.hybrid_layout); of one this
        process does not hold (meta), the same elements read from the model's files by name."""
        if rows is not None and not w.is_meta:
            return sample_hf_layout(w, rows, count)
        if not w.is_meta:
            flat = w.detach().reshape(-1)
            return flat[::max(1, flat.numel() // count)][:count]
        name = next((n for n, p in self.hf.named_parameters(remove_duplicate=False)
                     if p is w), None)
        key = (None if self.weight_files is None or name is None
               else self.weight_files.key(name))
        if key is None:
            raise InternalError("a fingerprint sample of a weight not loaded here, with no "
                                "model file to read it from", target=self.name, weight=name)
        return self.weight_files.sample(key, count)

    def final_norm_weight(self) -> torch.Tensor:
        """The final norm's effective weight w, or 1 + w on hybrid targets (computed once): for
        draft heads that start from the target's norm. The verifier takes w and norm_offset."""
        if not self.hybrid:
            return self.norm.weight
        if getattr(self, "_final_norm", None) is None:
            w = self.norm.weight.detach()
            self._final_norm = (self.norm_offset + w.float()).to(w.dtype)
        return self._final_norm

    def new_cache(self, layers: int, capacity: int, poison: bool = False,
                  layer_ids: range | None = None, ring: int = 2, buffers=None) -> KVCache:
        """The cache of a stage of `layers` layers (`layer_ids` on a hybrid target, whose
        DeltaNet layers keep `ring` states: rollbacks of up to ring - 1 positions); `buffers`:
        the (k, v) it lives in (a dense target's batch slot)."""
        if self.hybrid:
            if buffers is not None:
                raise InternalError("a hybrid target's cache on given buffers")
            return HybridCache(self, layer_ids, capacity, ring, poison)
        return KVCache(layers, self.num_kv_heads, self.head_dim, capacity, self.device,
                       self.dtype, poison_on_truncate=poison, buffers=buffers)


class Stage:
    """Layers [first, last) of the target plus their KV cache.

    `run` is the one way through the stage: rows at a position, given on the host (an int) or
    on the device (an int64 tensor [1], a stage rank's unit: never read on the host). The cache
    first holds exactly that many rows (a lower position is a rollback), then the rows are
    written and it holds position + rows; on a GPU a step of up to GRAPH_MAX_ROWS rows is one
    CUDA-graph replay that does all of this on the device."""

    def __init__(self, target: TargetModel, index: int, layer_ids: range, capacity: int,
                 poison: bool = False, cuda_graphs: bool = True, max_rollback: int = 8,
                 buffers=None):
        """max_rollback: on a hybrid target, the deepest truncation the stage's DeltaNet state
        rings must allow (a ring of max_rollback + 1 states; the engines give n). buffers: the
        (k, v) [layers, kv_heads, capacity, head_dim] its cache lives in (a batch slot)."""
        self.target = target
        self.index = index
        self.layer_ids = layer_ids
        self.cache = target.new_cache(len(layer_ids), capacity, poison, layer_ids,
                                      ring=max_rollback + 1, buffers=buffers)
        self.weights = target.stage_weights(layer_ids)
        # Full tables for every position the cache holds: a graph keeps them by address.
        self.cos, self.sin = target.rope(0, capacity)
        if target.hybrid:  # partial rotation as full-width RoPE (spd.model.hybrid)
            self.cos, self.sin = full_width_rope(self.cos, self.sin, target.head_dim)
        # a host position on the device, for a graph's replay (filled in place: no copy)
        self._position = torch.zeros(1, dtype=torch.int64, device=target.device)
        self.graphs = self.verify_graphs = None
        if cuda_graphs and graphs_enabled(target.device):
            self.graphs = GraphSet(target.device, f"stage {index} step", self._device_step)
            self.verify_graphs = GraphSet(target.device, f"stage {index} step + verify",
                                          self._device_verify)

    def step(self, hidden: torch.Tensor, start) -> list[torch.Tensor]:
        """The kernel step: every layer's output for rows hidden [T, d] at positions start..
        (the cache's length is the caller's: `run` keeps it)."""
        if self.target.hybrid:
            c = self.cache
            return hybrid_stage_step(hidden, self.weights, c.k, c.v, c.conv, c.state, start,
                                     self.cos, self.sin)
        return stage_step(hidden, self.weights, self.cache.k, self.cache.v, start, self.cos,
                          self.sin)

    @torch.no_grad()
    def tree_run(self, hidden: torch.Tensor, position, slots: torch.Tensor, prefix_len,
                 tree_slots: torch.Tensor, tree_mask: torch.Tensor) -> list[torch.Tensor]:
        """The rows of a token tree at `position` (spd.runtime.unit): hidden [R, d], row r's
        K/V into cache slot slots[r] ([R] int64); each row attends to the cache's rows
        [0, prefix_len) and to tree_slots[m] ([M] int64) where tree_mask[r, m] ([R, M] bool)
        -> every layer's output [R, d]. position and prefix_len: ints, or int64 tensors [1] on
        the device (a stage rank's unit: never read on the host). Eager (no graphs yet)."""
        if self.target.hybrid:
            raise InternalError("a hybrid target's stage has no tree step", stage=self.index)
        rows = hidden.shape[0]
        if isinstance(position, torch.Tensor):
            at = position.reshape(1).expand(rows)
        else:
            at = torch.full((rows,), position, dtype=torch.int64, device=hidden.device)
        return tree_stage_step(hidden, self.weights, self.cache.k, self.cache.v, slots,
                               prefix_len, tree_slots, tree_mask, self.cos.index_select(0, at),
                               self.sin.index_select(0, at))

    @torch.no_grad()
    def commit_rows(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Accepted tree rows: every layer's K/V copied from slots [C] to positions [C] (int64,
        on the device)."""
        for buf in (self.cache.k, self.cache.v):
            buf.index_copy_(2, positions, buf.index_select(2, slots))

    def _device_step(self, hidden: torch.Tensor, position: torch.Tensor) -> list[torch.Tensor]:
        # Everything on the device, so a graph of it replays at any position, and its warm-up
        # and capture leave the cache as one step does.
        self.cache.set_length(position)
        outs = self.step(hidden, position)
        self.cache.advance(hidden.shape[0])
        return outs

    def _device_verify(self, hidden: torch.Tensor, position: torch.Tensor, draft: torch.Tensor):
        outs = self._device_step(hidden, position)
        return outs, self._verify(outs[-1], draft)

    def _verify(self, last: torch.Tensor, draft: torch.Tensor):
        return self.target.verify_greedy(last, draft)

    @torch.no_grad()
    def run(self, hidden: torch.Tensor, position, draft: torch.Tensor | None = None):
        """hidden [T, d] at positions position.. -> (every layer's output [T, d], verdict).
        draft [T] int64 (the last stage only): also judge the token proposed after each row by
        final norm + LM head + argmax (spd_kernels.verify_greedy) where the hidden state
        already is -> verdict (the target's token [T] int64, accepted [T] bool); else None.
        Copy what you keep of a replay's outputs (the next replay rewrites them)."""
        rows = hidden.shape[0]
        on_host = not isinstance(position, torch.Tensor)
        if on_host:
            self.cache.check_room(position, rows)
        if draft is not None:
            self._check_last()
        graphs = self.graphs if draft is None else self.verify_graphs
        if graphs is not None and rows <= GRAPH_MAX_ROWS:
            pos = self._position.fill_(position) if on_host else position
            res = graphs.run(rows, hidden, pos, *(() if draft is None else (draft,)))
            if res is not None:
                return (res, None) if draft is None else res
        # eagerly (a CPU, a prefill chunk, or a capture that failed): a host position stays on
        # the host, where the reference kernels take it as it is
        self.cache.set_length(position)
        outs = self.step(hidden, position)
        self.cache.advance(rows)
        return outs, (None if draft is None else self._verify(outs[-1], draft))

    def forward(self, hidden: torch.Tensor, start: int, record=None) -> torch.Tensor:
        """`run` without a verdict -> the stage's output [T, d]; `record(hidden_index, rows)`
        is called with each layer's output (hidden index layer_id + 1)."""
        outs, _ = self.run(hidden, start)
        if record is not None:
            for lid, h in zip(self.layer_ids, outs):
                record(lid + 1, h)
        return outs[-1]

    def _check_last(self) -> None:
        if self.layer_ids.stop != self.target.num_layers:
            raise InternalError("only the last stage can verify", stage=self.index,
                                layers=f"{self.layer_ids.start}..{self.layer_ids.stop - 1}")
