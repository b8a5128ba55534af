"""Logit processing and inverse-CDF sampling shared by autoregressive decoding and verification.

The target distribution under sampling is softmax(x) restricted by top-k and top-p, where
x = logits / T (fp32, IEEE division). Randomness enters only as explicit uniforms in [0, 1), so
a reference and a kernel given the same uniforms draw the same token.

Sampling rules (every backend follows them: this reference, the Triton kernels of
spd_kernels.verify and csrc/kernels/sampling.cu):

1. Order. Tokens are ranked by one total order: x descending, ties broken by the lower token id
   first (a stable descending sort). The first token is the argmax (the lowest id among tied
   maxima, as torch.argmax).
2. Top-k keeps exactly the first k tokens of that order (a tie group at the k-th value is cut
   by id), so top_k = 1 is always the greedy token.
3. Top-p keeps the shortest prefix of that order (over the top-k set) whose mass reaches top_p:
   a token is dropped when the mass strictly before it already reaches top_p, so inside a tie
   group the lower ids are kept. The first token is always kept. Exactly: with
   e = exp(x - max x) (fp32) over the top-k set, z = sum e (fp32), B = top_p * z in float64 with
   top_p read as float32 (at least 2^-126), the token at position j of a tie group of weight w
   whose predecessors in the order hold mass S (fp32) is dropped iff S + j * w >= B, evaluated
   in float64 (j * w is exact there). A kernel finds the tie group at the cut by a threshold on
   the value, then keeps its first tied tokens by this formula from the same S, w, B and a count,
   so the decision inside a tie group is the same on every backend.
4. NaN / inf. A row whose argmax value (torch.argmax's order: NaN above every number, ties, NaN
   ties too, to the lowest id) is not finite -- it holds a NaN or a +inf x, or every x is -inf --
   has the one-hot distribution of that argmax, with or without top-k / top-p, as under
   temperature 0 (greedy verification follows the same argmax). So a NaN logit takes all the
   mass at its first NaN id, an all -inf row all of it at id 0.
"""
from __future__ import annotations

import torch

from spd_kernels.checks import SPDInputError, check_tensor

# Below this a temperature is refused, not sampled: logits / T overflow to inf and the
# probabilities to NaN (T = 1e-45 gave token 0). 0 means greedy.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2 ** 31 - 1  # the kernels take top_k as int32


def check_sampling_params(temperature: float, top_k: int, top_p: float) -> None:
    if not (temperature >= 0.0) or temperature != temperature or temperature == float("inf"):
        raise SPDInputError(f"temperature must be a finite number >= 0, got {temperature}")
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise SPDInputError(f"temperature {temperature} is too small to sample with (below "
                            f"{MIN_TEMPERATURE}): use 0 for greedy decoding")
    if isinstance(top_k, bool) or int(top_k) != top_k or not 0 <= top_k <= MAX_TOP_K:
        raise SPDInputError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it), "
                            f"got {top_k}")
    if not (0.0 < top_p <= 1.0):
        raise SPDInputError(f"top_p must lie in (0, 1], got {top_p}")


def top_p_float32(top_p: float) -> float:
    """top_p as every backend reads it: rounded to float32 and at least 2^-126 (a smaller top_p
    keeps only the first token as well, for any vocabulary below 2^126 tokens)."""
    return max(float(torch.tensor(top_p, dtype=torch.float32)), 2.0 ** -126)


def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities after temperature, top-k and top-p (the rules of
    this module's docstring).

    temperature == 0, and a row whose argmax is NaN or +-inf, give the one-hot distribution of
    the argmax (greedy).
    """
    check_tensor("logits", logits, floating=True)
    check_sampling_params(temperature, top_k, top_p)
    x = logits.float()
    if temperature != 0.0:
        x = x / temperature
    vocab = x.shape[-1]
    amax = x.argmax(-1, keepdim=True)
    greedy = torch.zeros_like(x).scatter_(-1, amax, 1.0)
    if temperature == 0.0:
        return greedy
    degenerate = ~torch.isfinite(x.gather(-1, amax))
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    if use_k or use_p:
        vals, order = torch.sort(x, dim=-1, descending=True, stable=True)
        keep = torch.ones_like(vals, dtype=torch.bool)
        if use_k:
            keep[..., top_k:] = False
        if use_p:
            e = torch.where(keep, torch.exp(vals - vals[..., :1]), 0.0)
            z = e.sum(-1, keepdim=True)
            cum = e.cumsum(-1)
            before = torch.cat([torch.zeros_like(cum[..., :1]), cum[..., :-1]], -1)
            pos = torch.arange(vocab, device=x.device).expand_as(vals)
            first = torch.ones_like(keep)
            first[..., 1:] = vals[..., 1:] != vals[..., :-1]
            start = torch.where(first, pos, 0).cummax(-1).values  # first position of the group
            mass = (before.gather(-1, start).double()
                    + (pos - start).double() * e.double())
            bound = top_p_float32(top_p) * z.double()
            keep &= mass < bound
        x = x.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), float("-inf"))
    return torch.where(degenerate, greedy, x.softmax(-1))


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [..., V] (need not be normalised), u [...] uniforms in [0, 1).

    Returns the first index whose cumulative mass exceeds u * total (int64). Zero-mass tokens are
    never drawn.
    """
    check_tensor("probs", probs, floating=True)
    check_tensor("u", u, floating=True, device=probs.device)
    if u.shape != probs.shape[:-1]:
        raise SPDInputError(f"u must have shape {tuple(probs.shape[:-1])}, got {tuple(u.shape)}")
    cdf = probs.float().cumsum(-1)
    target = u.float().unsqueeze(-1) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # Guard against rounding at the top end: clamp to the last token with mass.
    last_nonzero = (probs > 0).float().cumsum(-1).argmax(-1)
    return torch.minimum(idx, last_nonzero)
