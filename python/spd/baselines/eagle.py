"""An EAGLE-3-style draft head: the chain-drafting baseline SPD is compared against.

Features: three target hidden states (low, mid, high) fused into one vector per position,
f_i = fc([h_low_i; h_mid_i; h_high_i]). The row at position i reads
u_i = in_proj([embed(x_{i+1}); g_i]), where g_i is f_i where the target has run, or the head's
own previous output (the hidden state after its layer, before the final norm) inside a draft
chain. One Qwen3-style decoder layer with its own KV cache, the final norm and an LM head over
the draft vocabulary follow; row i predicts x_{i+2}.

Inference (after a verification round, x_t the last committed token): step 1 is the cached row
at position t-1 (target feature f_{t-1}, token x_t); step j >= 2 is a new row at position
t+j-2 fed the step j-1 output and the token drafted at step j-1.

Training-time test (`forward_ttt`) unrolls that chain over every position at once, so training
sees exactly what inference shows the head (tests/test_eagle.py checks this against the chain).

A checkpoint is a folder with `config.json` ("method": "eagle3", the target's fingerprint, the
feature layers, sizes) and `model.safetensors`, stored like a PDM's (spd.draft.pdm).
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
from spd.draft.pdm import SHIPPED_DIR, _Layer, attention_shape_for
from spd.errors import SPDError
from spd.model.layers import RMSNorm, _attend, _qkv, rope_table
from spd.model.partition import default_anchors
from spd_kernels.stage import LayerWeights, decoder_layer

METHOD = "eagle3"
DEFAULT_DRAFT_STEPS = 5


@dataclass
class EagleConfig:
    target_fingerprint: str
    target_num_layers: int
    target_hidden_size: int
    target_vocab_size: int
    feature_layers: list[int]          # hidden-state indices of the low, mid and high features
    method: str = METHOD
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    draft_vocab_size: int = 8192
    rms_eps: float = 1e-5
    rope_theta: float = 100000.0
    draft_steps: int = DEFAULT_DRAFT_STEPS  # drafts per verification round (decoder default)
    target_name: str = ""
    extra: dict = field(default_factory=dict)


def default_feature_layers(num_layers: int) -> list[int]:
    """Low, mid, high: entries 1, 2 and the last of default_anchors (so the PDM's feature caches
    hold them): [8, 15, 29] for 30 layers."""
    a = default_anchors(num_layers)
    if len(a) < 3:
        raise SPDError(f"a {num_layers}-layer target is too shallow for three feature layers")
    return [a[1], a[2], a[-1]]


def check_feature_layers(layers, num_layers: int) -> list[int]:
    layers = [int(b) for b in layers]
    if len(layers) != 3:
        raise SPDError(f"the EAGLE-3 head fuses exactly three feature layers (low, mid, high), "
                       f"got {layers}")
    if any(not 0 <= b <= num_layers for b in layers):
        raise SPDError(f"feature layers {layers} are out of range: hidden-state indices of a "
                       f"{num_layers}-layer model run from 0 to {num_layers}")
    return layers


def eagle_config_for(target, feature_layers=None, draft_vocab_size: int = 8192,
                     intermediate_size: int | None = None,
                     draft_steps: int = DEFAULT_DRAFT_STEPS) -> EagleConfig:
    cfg = target.config
    heads, kv_heads, head_dim = attention_shape_for(target)
    layers = default_feature_layers(target.num_layers) if feature_layers is None \
        else check_feature_layers(feature_layers, target.num_layers)
    return EagleConfig(
        target_fingerprint=target.fingerprint(), target_num_layers=target.num_layers,
        target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
        feature_layers=layers, hidden_size=target.hidden_size, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        draft_vocab_size=min(draft_vocab_size, target.vocab_size), rms_eps=target.rms_eps,
        rope_theta=float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        draft_steps=int(draft_steps), target_name=Path(target.name).name)


class EagleHead(nn.Module, SavedDrafter):
    def __init__(self, config: EagleConfig):
        super().__init__()
        self.config = config
        d, h = config.target_hidden_size, config.hidden_size
        self.fc = nn.Linear(3 * d, h, bias=False)          # fuse low/mid/high
        self.in_proj = nn.Linear(d + h, h, bias=False)     # [token embedding; feature] -> row
        self.layer = _Layer(config)
        self.norm = RMSNorm(h, config.rms_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target",
                             torch.arange(config.draft_vocab_size, dtype=torch.int64))
        self._rope = None

    # --- construction ---------------------------------------------------------------------
    @classmethod
    def initial(cls, target, vocab: torch.Tensor | None = None, feature_layers=None,
                intermediate_size: int | None = None, draft_steps: int = DEFAULT_DRAFT_STEPS,
                seed: int = 0):
        """The training start (fp32): reads the high feature through the target's final norm and
        head rows of the draft vocabulary (frozen); the layer starts as the identity (output
        projections zero), fc/in_proj start small and random plus an identity path high -> row.
        """
        vocab = (torch.arange(target.vocab_size) if vocab is None else vocab).to(torch.int64)
        cfg = eagle_config_for(target, feature_layers, len(vocab), intermediate_size, draft_steps)
        cfg.extra = {"head_from_target": True}
        gen = torch.Generator().manual_seed(seed)
        head = cls(cfg)
        d = cfg.target_hidden_size
        with torch.no_grad():
            for name, p in head.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
            if cfg.hidden_size == d:
                head.fc.weight[:, 2 * d:] += torch.eye(d)
                head.in_proj.weight[:, d:] += torch.eye(d)
            head.norm.weight.copy_(target.final_norm_weight().detach().float().cpu())
            head.draft_to_target.copy_(vocab)
            head.lm_head.weight.copy_(target.lm_head.weight.detach().float().cpu()[vocab])
        head.lm_head.weight.requires_grad_(False)
        return head.float()

    @classmethod
    def untrained(cls, target, draft_vocab: torch.Tensor | None = None, seed: int = 0,
                  draft_steps: int = DEFAULT_DRAFT_STEPS):
        """The training start, on the target's device and dtype: drafts poorly, output exact."""
        head = cls.initial(target, draft_vocab, draft_steps=draft_steps, seed=seed)
        return head.to(device=target.device, dtype=target.dtype).eval()

    @classmethod
    def load(cls, folder, target=None):
        raw = read_config(folder, "EAGLE-3 head")
        if raw.get("method") != METHOD:
            kind = "a PDM checkpoint" if "n_stages" in raw else "not an EAGLE-3 head"
            raise SPDError(f"{folder} is {kind} (its config has no \"method\": \"{METHOD}\"); "
                           "load it with the SPD engine, or pass an EAGLE-3 head folder")
        try:
            config = EagleConfig(**raw)
        except TypeError as exc:
            raise SPDError(f"{Path(folder) / CONFIG_NAME} is not a valid EAGLE-3 config: "
                           f"{exc}") from exc
        if target is not None:
            check_compatible(config, target, source=str(folder))
        return load_weights(cls(config), folder, target)

    # --- shared pieces --------------------------------------------------------------------
    def fuse(self, low_mid_high: torch.Tensor) -> torch.Tensor:
        """[3, R, d_target] target features -> [R, hidden]."""
        return self.fc(torch.cat(list(low_mid_high), dim=-1))

    def rows(self, token_embeddings: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Row inputs: embeddings [R, d_target] of x_{i+1}, features [R, hidden] -> [R, hidden]."""
        return self.in_proj(torch.cat([token_embeddings, g], dim=-1))

    def _rope_for(self, need: int, like: torch.Tensor):
        c = self.config
        r = self._rope
        if r is None or r[0].shape[0] < need or r[0].dtype != like.dtype \
                or r[0].device != like.device:
            self._rope = rope_table(c.head_dim, max(need, 2048), c.rope_theta,
                                    device=like.device, dtype=like.dtype)
        return self._rope

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head outputs [R, hidden] -> draft logits [R, draft_vocab] (fp32)."""
        return self.lm_head(self.norm(out)).float()

    # --- inference ------------------------------------------------------------------------
    def new_cache(self, capacity: int, poison: bool = False):
        from spd.model.cache import KVCache
        w = self.lm_head.weight
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_dim, capacity, w.device, w.dtype,
                       poison_on_truncate=poison)

    @torch.no_grad()
    def step(self, token_embeddings: torch.Tensor, g: torch.Tensor, start: int, cache):
        """Rows at positions start.. through the layer (cached): (outputs [R, hidden], draft
        logits of the last row [draft_vocab])."""
        c = self.config
        x = self.rows(token_embeddings, g)
        cos, sin = self._rope_for(start + x.shape[0], x)
        cache.reserve(start, x.shape[0])
        # the one cached decoder layer (spd_kernels.stage), on this head's weights
        out = decoder_layer(x, LayerWeights.from_module(self.layer), cache.k[0], cache.v[0],
                            start, cos, sin, c.num_heads, c.num_kv_heads, c.rms_eps)
        return out, self.logits(out[-1:])[0]

    # --- training-time test ---------------------------------------------------------------
    def forward_ttt(self, features: torch.Tensor, token_embeddings: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
        """The draft chain unrolled over every position at once.

        features [3, R, d_target] (positions 0..R-1), token_embeddings [R, d_target] (row i holds
        the embedding of x_{i+1}). Returns `steps` logits tensors [R, draft_vocab]: entry j-1,
        row i is the chain's step-j prediction of x_{i+2} for the chain whose step 1 sits at
        position i-j+1 (meaningless for i < j-1, where that chain would start before 0).

        The step-j row at i is fed the step-(j-1) output at i-1 and attends to step-1 keys at
        positions <= i-j+1 and to the step-m key at i-j+m for m = 2..j: what the chain sees.
        """
        c = self.config
        R = token_embeddings.shape[0]
        g = self.fuse(features)
        cos, sin = self._rope_for(R, g)
        cos, sin = cos[:R], sin[:R]
        pos = torch.arange(R, device=g.device)
        attn = self.layer.self_attn
        keys, values, out = [], [], []
        prev = g  # replaced by each step's output before it is read (from step 2 on)
        for j in range(1, steps + 1):
            if j > 1:  # feed the previous step's output one position back
                g = torch.cat([torch.zeros_like(prev[:1]), prev[:-1]], dim=0)
            x = self.rows(token_embeddings, g)
            h = self.layer.input_layernorm(x)
            q, k, v = _qkv(attn, h, cos, sin, c.num_heads, c.num_kv_heads, c.head_dim)
            keys.append(k)
            values.append(v)
            blocks = [pos[None, :] <= pos[:, None] - (j - 1)]           # step-1 keys
            blocks += [pos[None, :] == pos[:, None] - (j - m) for m in range(2, j + 1)]
            a = _attend(attn, q, torch.cat(keys, dim=1), torch.cat(values, dim=1),
                        torch.cat(blocks, dim=1), c.num_heads, c.num_kv_heads, c.head_dim)
            x = x + a
            prev = x + self.layer.mlp(self.layer.post_attention_layernorm(x))
            out.append(self.logits(prev))
        return out


def check_compatible(config: EagleConfig, target, source: str = "EAGLE-3 head") -> None:
    """Refuse a head built for another target."""
    check_target(config, target, source)


def find_eagle(target, search=(SHIPPED_DIR,)):
    """The first EAGLE-3 head for this target in the folders `search` (each holding one
    checkpoint folder per drafter), or None."""
    return find_checkpoint(search, lambda c: c.get("method") == METHOD
                           and c.get("target_fingerprint") == target.fingerprint())


def find_shipped_eagle(target):
    """The EAGLE-3 head shipped with the package for this target, or None."""
    return find_eagle(target, (SHIPPED_DIR,))
