"""A Llama / Qwen2 / Qwen3 target built from plain torch modules, without transformers.

A stage rank of the distributed runtime holds a few decoder layers. Importing transformers for
them costs more resident memory than a middle stage's layers of the default model (its
generation code applies torch.compiler.disable, which imports torch._dynamo, sympy and triton).
Here config.json (and generation_config.json, for EOS ids) are read as JSON into a `PlainConfig`
with the fields spd reads and the defaults transformers' config classes give them, and the
model is plain modules with the names and attribute tree of transformers' *ForCausalLM
(model.embed_tokens, model.layers[i].self_attn.q_proj, ..., model.norm, model.rotary_emb,
lm_head), so spd.model.loading fills it from the files as it fills a Hugging Face model and
TargetModel reads it the same way. Stage ranks compute with spd_kernels.stage_step; the modules
here carry weights, plus the forwards the rest of spd calls (norm, MLP, rotary tables).

`read_plain_config` gives None for anything it does not know to build exactly as transformers
would: another model type, a hybrid, a RoPE type outside ROPE_TYPES, partial rotation, a field
of an unexpected type. The caller then builds the model with transformers instead (with its
memory cost): never computed differently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from spd.data.files import read_json_object
from spd.errors import SPDError
from spd.model.layers import RMSNorm

MODEL_TYPES = ("llama", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
# Per model type: the defaults of transformers' config class for the fields read here.
_DEFAULTS = {
    "llama": dict(max_position_embeddings=2048, eos_token_id=2, bos_token_id=1),
    "qwen2": dict(max_position_embeddings=32768, eos_token_id=None, bos_token_id=None,
                  num_key_value_heads=32),
    "qwen3": dict(max_position_embeddings=32768, eos_token_id=None, bos_token_id=None,
                  num_key_value_heads=32, head_dim=128),
}
_COMMON = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_bias=False, mlp_bias=False, pad_token_id=None, use_sliding_window=False)
_THETA = 10_000.0  # transformers' default rope_theta for these models
_RESERVED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")  # required here: transformers' defaults are a 7B model's,
# which no folder with weights omits; a config without them is left to transformers


@dataclass
class PlainConfig:
    """The fields of a Llama / Qwen2 / Qwen3 config that spd reads, as transformers gives them."""
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    use_sliding_window: bool
    sliding_window: int | None
    layer_types: list[str] | None
    rope_parameters: dict
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    pad_token_id: int | None
    extra: dict = field(default_factory=dict, repr=False)  # the rest of config.json

    def get_text_config(self) -> PlainConfig:
        return self


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _eos_ok(v) -> bool:
    return v is None or _is_int(v) or (isinstance(v, list) and all(map(_is_int, v)))


def _rope_parameters(raw: dict, max_pos: int) -> dict | None:
    """rope_parameters as transformers standardises them (legacy rope_scaling / rope_theta
    folded in), or None when this module does not compute that RoPE."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or "partial_rotary_factor" in raw \
            or "partial_rotary_factor" in params:
        return None
    params = dict(params)
    params.setdefault("rope_theta", raw.get("rope_theta", _THETA))
    params.setdefault("rope_type", params.get("type", "default"))
    kind = params["rope_type"]
    if kind not in ROPE_TYPES or not _is_number(params["rope_theta"]):
        return None
    if kind == "llama3":
        if "original_max_position_embeddings" in raw:  # a top-level value wins, as there
            params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_pos)
    needed = {"linear": ("factor",), "dynamic": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings")}.get(kind, ())
    if not all(_is_number(params.get(k)) for k in needed):
        return None  # transformers refuses (missing keys) or fails: let it say so
    return params


def read_plain_config(folder: str | Path) -> PlainConfig | None:
    """The config of the model folder `folder` (resolved, checked) as a PlainConfig, or None
    when the model must be built by transformers (see the module's docstring)."""
    folder = Path(folder)
    raw = read_json_object(folder / "config.json", "model config")
    kind = raw.get("model_type")
    if kind not in MODEL_TYPES or not all(_is_int(raw.get(k)) and raw[k] > 0 for k in _RESERVED):
        return None
    get = {**_COMMON, **_DEFAULTS[kind], **raw}.get
    heads = raw["num_attention_heads"]
    kv_heads = get("num_key_value_heads") if get("num_key_value_heads") is not None else heads
    head_dim = get("head_dim")
    if head_dim is None and "head_dim" not in raw:
        head_dim = raw["hidden_size"] // heads
    if not (_is_int(kv_heads) and _is_int(head_dim) and _is_int(get("max_position_embeddings"))
            and _is_number(get("rms_norm_eps")) and isinstance(get("hidden_act"), str)
            and _eos_ok(get("eos_token_id"))):
        return None
    if kind == "llama" and raw["hidden_size"] % heads:
        return None  # transformers refuses this config
    layer_types = get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or "linear_attention" in layer_types):
        return None  # a hybrid, or a malformed list: transformers' business
    rope = _rope_parameters(raw, get("max_position_embeddings"))
    if rope is None:
        return None
    sliding = get("sliding_window", 4096 if kind != "llama" else None)
    if kind != "llama" and not get("use_sliding_window"):
        sliding = None  # Qwen's configs drop the window when it is not used
    return PlainConfig(
        model_type=kind, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"], num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_act=get("hidden_act"), max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=float(get("rms_norm_eps")), tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=bool(get("attention_bias")), mlp_bias=bool(get("mlp_bias")),
        use_sliding_window=bool(get("use_sliding_window")), sliding_window=sliding,
        layer_types=layer_types, rope_parameters=rope, eos_token_id=get("eos_token_id"),
        bos_token_id=get("bos_token_id"), pad_token_id=get("pad_token_id"), extra=raw)


@dataclass
class PlainGenerationConfig:
    eos_token_id: int | list[int] | None


def read_generation_config(folder: str | Path) -> PlainGenerationConfig | None:
    """generation_config.json's EOS ids (None: no such file; config.json's then stand)."""
    path = Path(folder) / "generation_config.json"
    if not path.exists():
        return None
    eos = read_json_object(path, "generation config").get("eos_token_id")
    if not _eos_ok(eos):
        raise SPDError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return PlainGenerationConfig(eos)


# --- RoPE --------------------------------------------------------------------------------------
def inverse_frequencies(config: PlainConfig, seq_len: torch.Tensor | None = None,
                        device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, the scale of cos/sin) for the config's RoPE type;
    `seq_len` (a tensor: the longest position + 1) matters to dynamic NTK scaling only. The
    arithmetic follows transformers' step by step, so the tables are the same bits."""
    p = config.rope_parameters
    kind, base, dim = p["rope_type"], p["rope_theta"], config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    if kind == "dynamic":  # NTK: a larger base once the sequence outgrows the trained length
        factor, trained = p["factor"], config.max_position_embeddings
        if seq_len is None:
            seq_len = trained
        else:
            seq_len = torch.maximum(seq_len, torch.tensor(trained, dtype=seq_len.dtype,
                                                          device=seq_len.device))
        base = base * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
    inv_freq = 1.0 / (base ** steps)
    if kind == "linear":
        inv_freq = inv_freq / p["factor"]
    elif kind == "llama3":  # long wavelengths slowed by factor, short kept, a ramp between
        factor, old = p["factor"], p["original_max_position_embeddings"]
        low, high = p["low_freq_factor"], p["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        slow = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        ramp = (old / wavelen - low) / (high - low)
        blended = (1 - ramp) * slow / factor + ramp * slow
        between = ~(wavelen < old / high) * ~(wavelen > old / low)
        inv_freq = torch.where(between, blended, slow)
    return inv_freq, 1.0


class RotaryTables(nn.Module):
    """cos/sin of positions, called as transformers' rotary embedding is: (x, position_ids
    [1, S]) -> (cos, sin) [1, S, head_dim] in x's dtype."""

    def __init__(self, config: PlainConfig):
        super().__init__()
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = inverse_frequencies(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings

    def _dynamic_update(self, position_ids: torch.Tensor, device) -> None:
        """Dynamic NTK: frequencies for the longest sequence seen once past the trained length,
        the trained ones again for a sequence back within it."""
        seq_len = torch.max(position_ids) + 1
        cached = self.max_seq_len_cached
        if seq_len > cached:
            inv_freq, self.attention_scaling = inverse_frequencies(self.config, seq_len, device)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.max_seq_len_cached = seq_len
        if seq_len < self.original_max_seq_len and cached > self.original_max_seq_len:
            self.original_inv_freq = self.original_inv_freq.to(device)
            self.register_buffer("inv_freq", self.original_inv_freq, persistent=False)
            self.max_seq_len_cached = self.original_max_seq_len

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids, x.device)
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device,
                                                                   dtype=torch.float)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos() * self.attention_scaling
        sin = angles.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


# --- the module tree ---------------------------------------------------------------------------
# The weights are read from the files: no random initialisation (which on the meta device runs
# torch's Python decompositions, importing torch._dynamo and sympy).
class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class Attention(nn.Module):
    def __init__(self, c: PlainConfig):
        super().__init__()
        qkv_bias = True if c.model_type == "qwen2" else c.attention_bias
        o_bias = False if c.model_type == "qwen2" else c.attention_bias
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj = Linear(c.hidden_size, q, bias=qkv_bias)
        self.k_proj = Linear(c.hidden_size, kv, bias=qkv_bias)
        self.v_proj = Linear(c.hidden_size, kv, bias=qkv_bias)
        self.o_proj = Linear(q, c.hidden_size, bias=o_bias)
        if c.model_type == "qwen3":  # per-head norms of q and k before RoPE
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, c: PlainConfig):
        super().__init__()
        bias = c.mlp_bias if c.model_type == "llama" else False
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=bias)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=bias)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # SwiGLU; the config's act is checked
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: PlainConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Decoder(nn.Module):
    def __init__(self, c: PlainConfig):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, c.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class PlainCausalLM(nn.Module):
    """Weights under transformers' names (model.layers.0.self_attn.q_proj.weight, ...); a tied
    LM head is the embedding's parameter, listed under both names."""

    def __init__(self, config: PlainConfig, generation_config=None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def build_on_meta(folder: str | Path, config: PlainConfig, dtype: torch.dtype,
                  device) -> PlainCausalLM:
    """The model with every weight on the meta device in `dtype` (spd.model.loading reads the
    wanted ones in), its rotary tables computed on `device`."""
    with torch.device("meta"):
        model = PlainCausalLM(config, read_generation_config(folder)).to(dtype)
    model.model.rotary_emb = RotaryTables(config).to(device)
    return model
