"""What a drafter's held-out top-1 agreement projects for decoding, without decoding.

A drafter whose drafts made at fill level f (f = 1..n tokens in flight) are accepted with
probability a(f), independently, gives the pipeline (spd.runtime.cycle) a renewal process:
after a rejection the pipeline refills, so the next judged drafts were made at fills 1, 2, ...,
n, n, ...; each judgment commits one token and each rejection costs n - 1 cycles without one.
With R the judgments from one refill to the next rejection (that one included),
E[R] = sum_j prod_{i<j} a(min(i, n)), alpha = E[R] / (E[R] + n - 1), and the share of judged
drafts accepted is 1 - 1 / E[R]. Greedy, PDM alone (no context lookup), prefill left out: an
estimate that training tracks, not a measurement (spd eval decodes).
"""
from __future__ import annotations


def expected_run(accept_by_fill: list[float]) -> float:
    """E[R] for acceptance accept_by_fill[f - 1] at fill f; inf if never rejected at full fill."""
    n = len(accept_by_fill)
    if n == 0 or not all(0.0 <= a <= 1.0 for a in accept_by_fill):
        raise ValueError(f"acceptance by fill level must be n >= 1 values in [0, 1], got "
                         f"{accept_by_fill}")
    expected, survive = 0.0, 1.0
    for i in range(1, n):  # judgments 1..n-1 (fills 1..n-1), then a geometric tail at fill n
        expected += survive
        survive *= accept_by_fill[i - 1]
    if survive == 0.0:
        return expected
    a_full = accept_by_fill[-1]
    return float("inf") if a_full >= 1.0 else expected + survive / (1.0 - a_full)


def projected_alpha(accept_by_fill: list[float]) -> float:
    """Long-run alpha, E[R] / (E[R] + n - 1)."""
    run = expected_run(accept_by_fill)
    return 1.0 if run == float("inf") else run / (run + len(accept_by_fill) - 1)


def projected_acceptance(accept_by_fill: list[float]) -> float:
    """Share of judged drafts accepted, 1 - 1 / E[R]."""
    return 1.0 - 1.0 / expected_run(accept_by_fill)


__all__ = ["expected_run", "projected_acceptance", "projected_alpha"]
