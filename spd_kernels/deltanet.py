"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) over a ring of past states.

A linear-attention layer's state after position p cannot be recovered by truncation, so each
layer keeps a ring of R states: slot (length mod R) holds the state after the first `length`
tokens. A step of T rows at position `start` reads slot start mod R and writes, for each of its
last min(T, R) rows t, the state after it into slot (start + t + 1) mod R. Rolling back to any
of the last R - 1 lengths is then just lowering the length: nothing is copied.

  conv_ring_step     the causal depthwise conv (kernel K) + SiLU over the q/k/v channels; its
                     ring holds the last K - 1 input rows per slot.
  gated_delta_step   the gated delta rule, recurrent form, one row after another (so T rows give
                     exactly T single steps): q/k L2-normalised, S <- S * exp(g),
                     S <- S + k (beta (v - S^T k))^T, out = S^T q / sqrt(dk); state in fp32.

`start` is an int or an int64 tensor of one element read on the device (a CUDA graph replays
the step at any position). `live` (optional, one element on the device, 0 or 1): 0 leaves the
ring as it was, the rows still computed: a batch's dead row (a bubble of a parked slot, at its
trash row) would otherwise write entry (trash + 1) mod R, which a live row of that slot may read
next (docs/batching.md). Backends: reference (PyTorch, as transformers' torch fallback) |
triton (spd_kernels.deltanet_triton).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spd_kernels import dispatch
from spd_kernels.cache_positions import positions
from spd_kernels.checks import SPDInputError, check_tensor
from spd_kernels.opdef import Position, op


def ring_slots(start, rows: int, ring: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot read [1], slots written [min(rows, ring)]) for rows at positions start..: the
    written slot of row t is that of length start + t + 1."""
    keep = min(rows, ring)
    pos = positions(start, rows + 1, device)
    return pos[:1] % ring, pos[rows + 1 - keep:] % ring


def _check_start(start, device):
    if isinstance(start, torch.Tensor):
        check_tensor("start", start, dtype=torch.int64, device=device)
        if start.numel() != 1:
            raise SPDInputError(f"start must hold one position, got shape {tuple(start.shape)}")


def _check_live(live, device):
    if live is not None:
        check_tensor("live", live, device=device)
        if live.dtype not in (torch.int64, torch.bool) or live.numel() != 1:
            raise SPDInputError(f"live must be one int64 or bool element, got "
                                f"{live.dtype} of shape {tuple(live.shape)}")


def _kept(live, new: torch.Tensor, ring: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """What entries `at` of `ring` get: `new`, or where `live` is 0 what they hold (no host
    read of `live`)."""
    if live is None:
        return new
    return torch.where(live.reshape(-1)[:1].bool(), new, ring.index_select(0, at))


# --- conv ring ------------------------------------------------------------------------------------
def _check_conv(x, conv_ring, weight, start, live):
    check_tensor("x", x, dim=2, floating=True)
    check_tensor("conv_ring", conv_ring, dim=3, floating=True, device=x.device)
    check_tensor("weight", weight, dim=2, floating=True, device=x.device)
    C, K = weight.shape
    if x.shape[1] != C or conv_ring.shape[1:] != (K - 1, C):
        raise SPDInputError(f"conv shapes disagree: x {tuple(x.shape)}, conv_ring "
                            f"{tuple(conv_ring.shape)} (want [R, {K - 1}, {C}]), weight "
                            f"{tuple(weight.shape)}")
    _check_start(start, x.device)
    _check_live(live, x.device)


@op("conv_ring_step", mutates=("conv_ring",))
def conv_ring_step(x: torch.Tensor, conv_ring: torch.Tensor, weight: torch.Tensor,
                   start: Position, *, live: torch.Tensor | None = None,
                   backend: str | None = None) -> torch.Tensor:
    """x [T, C] (conv inputs of rows at positions start..), conv_ring [R, K-1, C] (the K-1
    inputs before each length, by slot), weight [C, K] -> silu(causal depthwise conv) [T, C];
    writes the inputs before lengths start+t+1 of the last min(T, R) rows into their slots
    (live [1] int64 / bool of 0: writes nothing, module docstring)."""
    _check_conv(x, conv_ring, weight, start, live)
    return dispatch.call("conv_ring_step", x.device, x, conv_ring, weight, start, live,
                         backend=backend)


@conv_ring_step.register_fake
def _(x, conv_ring, weight, start, live=None):
    return torch.empty_like(x)


@dispatch.register("conv_ring_step", "reference")
def conv_ring_step_reference(x, conv_ring, weight, start, live=None):
    T, C = x.shape
    R, Km1 = conv_ring.shape[:2]
    read, write = ring_slots(start, T, R, x.device)
    full = torch.cat([conv_ring.index_select(0, read)[0], x.to(conv_ring.dtype)])  # [K-1+T, C]
    # as transformers' causal_conv1d_update: conv1d over [history | rows], in the weight's dtype
    out = F.conv1d(full.t()[None].to(weight.dtype), weight[:, None], groups=C)[0, :, -T:]
    keep = write.shape[0]
    # state after row t = inputs t+1 .. t+K-1 of `full` (rows T-keep .. T-1)
    hist = full.unfold(0, Km1, 1)[T - keep + 1:] if Km1 else full.new_zeros(keep, C, 0)
    hist = hist.transpose(1, 2).to(conv_ring.dtype)
    conv_ring.index_copy_(0, write, _kept(live, hist, conv_ring, write))
    return F.silu(out).t().to(x.dtype)


# --- gated delta rule -----------------------------------------------------------------------------
def _check_delta(q, k, v, g, beta, state_ring, start, live):
    check_tensor("q", q, dim=3, floating=True)
    for name, t, dim in (("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2),
                         ("state_ring", state_ring, 4)):
        check_tensor(name, t, dim=dim, floating=True, device=q.device)
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise SPDInputError(f"delta rule shapes disagree: q {tuple(q.shape)}, k "
                            f"{tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta "
                            f"{tuple(beta.shape)}")
    if Hv % Hk or state_ring.shape[1:] != (Hv, dk, dv):
        raise SPDInputError(f"state_ring {tuple(state_ring.shape)} must be [R, {Hv}, {dk}, {dv}] "
                            f"and value heads ({Hv}) a multiple of key heads ({Hk})")
    if state_ring.dtype != torch.float32:
        raise SPDInputError(f"state_ring must be float32, got {state_ring.dtype}")
    _check_start(start, q.device)
    _check_live(live, q.device)


@op("gated_delta_step", mutates=("state_ring",))
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state_ring: torch.Tensor, start: Position, *,
                     live: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """q, k [T, Hk, dk], v [T, Hv, dv], g (log decay) and beta [T, Hv], state_ring
    [R, Hv, dk, dv] fp32 -> out [T, Hv, dv] in v's dtype; reads the state of slot start mod R
    and writes the states after the last min(T, R) rows into their slots (live [1] int64 /
    bool of 0: writes nothing, module docstring)."""
    _check_delta(q, k, v, g, beta, state_ring, start, live)
    return dispatch.call("gated_delta_step", q.device, q, k, v, g, beta, state_ring, start,
                         live, backend=backend)


@gated_delta_step.register_fake
def _(q, k, v, g, beta, state_ring, start, live=None):
    return torch.empty_like(v)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@dispatch.register("gated_delta_step", "reference")
def gated_delta_step_reference(q, k, v, g, beta, state_ring, start, live=None):
    T, Hk, dk = q.shape
    R, Hv = state_ring.shape[:2]
    read, write = ring_slots(start, T, R, q.device)
    rep = Hv // Hk
    out_dtype = v.dtype
    # the operations of transformers' torch_recurrent_gated_delta_rule, one row at a time
    q = l2norm(q.repeat_interleave(rep, dim=1).float())
    k = l2norm(k.repeat_interleave(rep, dim=1).float())
    q = q / (dk ** 0.5)
    v, g, beta = v.float(), g.float(), beta.float()
    state = state_ring.index_select(0, read)[0]
    out = torch.empty(T, Hv, v.shape[-1], dtype=torch.float32, device=q.device)
    first_kept = T - write.shape[0]
    for t in range(T):
        state = state * g[t].exp()[:, None, None]
        kv_mem = (state * k[t][..., None]).sum(dim=-2)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None, :]
        out[t] = (state * q[t][..., None]).sum(dim=-2)
        if t >= first_kept:  # straight into its slot (the slot read was copied out first)
            at = write[t - first_kept:t - first_kept + 1]
            state_ring.index_copy_(0, at, _kept(live, state[None], state_ring, at))
    return out.to(out_dtype)


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("gated_delta_step", "triton", "spd_kernels.deltanet_triton")
dispatch.defer("conv_ring_step", "triton", "spd_kernels.deltanet_triton")
