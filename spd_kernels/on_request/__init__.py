"""Kernels that run only when asked for by name, until a GPU has timed them.

Each is written, checked against its op's reference (in the CUDA kernels' host emulation on the
CPU) and registered with `automatic=False`: `backend="cuda"`, `SPD_BACKEND=<op>=cuda` or
`use_backend(<op>="cuda")` runs it; the automatic choice passes over it. When
`benchmarks/bench_kernels.py` on a GPU shows one faster than what the automatic choice runs (its
`challengers` table), it moves next to its op and registers as automatic.
"""
from spd_kernels import dispatch, verify  # noqa: F401  (verify declares the rejection ops)
from spd_kernels.on_request import attention_cuda, linear_cuda, qkv_rope_cuda  # noqa: F401

# It shares its checks with the Triton kernel (whose module imports Triton): registered when
# first needed.
dispatch.defer("rejection_sample", "cuda", "spd_kernels.on_request.rejection_cuda")
dispatch.defer("rejection_sample_logits", "cuda", "spd_kernels.on_request.rejection_cuda")
