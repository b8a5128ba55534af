"""The derived metrics, defined once (docs/definitions.md): every report computes them here.

N: tokens committed by decode cycles (the prefill's token excluded); K: pipeline cycles during
decode, refills included; n: pipeline stages.
"""
from __future__ import annotations


def alpha(N: int, K: int) -> float:
    """Tokens per cycle, N / K (0 before any cycle)."""
    return N / K if K else 0.0


def theoretical_speedup(N: int, K: int, n: int) -> float:
    """alpha * n: what n stage devices would give over autoregressive decoding."""
    return alpha(N, K) * n


def rate(hits: int, trials: int) -> float:
    """hits / trials, 0 when nothing was tried (acceptance, lookup share, coverage)."""
    return hits / trials if trials else 0.0


def tokens_per_s(tokens: int, seconds: float) -> float:
    """Decode throughput; 0 for a zero-length decode."""
    return tokens / seconds if seconds > 0 else 0.0
