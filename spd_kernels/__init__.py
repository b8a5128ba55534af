"""Hot-path ops of Speculative Pipeline Decoding.

Each op has a plain PyTorch reference that is both the fallback and the specification of what
faster backends (Triton, CUDA C++) must compute. The runtime package `spd` calls only these
functions, so a backend can be swapped in behind them without touching the engine.
"""
from spd_kernels.checks import SPDInputError
from spd_kernels.features import anchor_projection
from spd_kernels.kv_cache import truncate_kv_
from spd_kernels.sampling import filtered_probs, sample_from_probs
from spd_kernels.verify import rejection_sample, verify_greedy

__all__ = [
    "SPDInputError",
    "anchor_projection",
    "filtered_probs",
    "rejection_sample",
    "sample_from_probs",
    "truncate_kv_",
    "verify_greedy",
]
