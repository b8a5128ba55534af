"""Hot-path ops of Speculative Pipeline Decoding.

Each op has a plain PyTorch reference that is both the fallback and the specification of what
faster backends (Triton, CUDA C++) must compute; `spd_kernels.dispatch` picks the backend per op
and device (`SPD_BACKEND` forces one). The runtime package `spd` calls only these functions, so a
backend can be swapped in behind them without touching the engine. The ops are also registered
with torch.library as `torch.ops.spd.*` (with fake implementations) for torch.compile and other
runtimes; each op is declared once, on its public function (spd_kernels.opdef).
"""
from importlib import metadata as _metadata

from spd_kernels import on_request  # noqa: F401  (registers the on-request kernels)
from spd_kernels.attention import cache_attention
from spd_kernels.attention.slots import slot_attention
from spd_kernels.attention.tree import tree_attention
from spd_kernels.checks import SPDInputError
from spd_kernels.control import cycle_candidate, cycle_commit, cycle_open
from spd_kernels.deltanet import conv_ring_step, gated_delta_step
from spd_kernels.dispatch import SPDBackendError, use_backend
from spd_kernels.features import anchor_projection
from spd_kernels.kv_cache import truncate_kv_
from spd_kernels.linear import fused_linear, fused_swiglu
from spd_kernels.pdm import pdm_step
from spd_kernels.qkv_rope import qkv_rope_append
from spd_kernels.sampling import filtered_probs, sample_from_probs
from spd_kernels.stage import stage_step
from spd_kernels.tree_control import tree_children, tree_commit, tree_open
from spd_kernels.verify import rejection_sample, rejection_sample_logits, verify_greedy
from spd_kernels.verify.tree import tree_rejection_sample

try:
    __version__ = _metadata.version("spd")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.1.0"

__all__ = [
    "SPDBackendError",
    "SPDInputError",
    "anchor_projection",
    "cache_attention",
    "conv_ring_step",
    "cycle_candidate",
    "cycle_commit",
    "cycle_open",
    "filtered_probs",
    "fused_linear",
    "fused_swiglu",
    "gated_delta_step",
    "pdm_step",
    "qkv_rope_append",
    "rejection_sample",
    "rejection_sample_logits",
    "sample_from_probs",
    "slot_attention",
    "stage_step",
    "tree_children",
    "tree_commit",
    "tree_open",
    "tree_attention",
    "tree_rejection_sample",
    "truncate_kv_",
    "use_backend",
    "verify_greedy",
]
