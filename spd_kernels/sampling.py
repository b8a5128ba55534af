"""Logit processing and inverse-CDF sampling shared by autoregressive decoding and verification.

The target distribution under sampling is softmax(logits / T) restricted by top-k and top-p (the
same rules as Hugging Face's warpers: top-k keeps the k largest, top-p keeps the smallest prefix
of the sorted distribution whose mass reaches p). Randomness enters only as explicit uniforms in
[0, 1), so a reference and a kernel given the same uniforms draw the same token.
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


def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> float32 probabilities after temperature, top-k and top-p.

    temperature == 0 gives the one-hot distribution of the argmax (greedy).
    """
    check_tensor("logits", logits, floating=True)
    check_sampling_params(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


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
