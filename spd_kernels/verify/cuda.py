"""The Python side of csrc/kernels/verify.cu: supports check and launcher of verify_greedy (the
CUDA rejection samplers are on request: spd_kernels.on_request.rejection_cuda)."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.verify.triton_greedy import _triton_greedy_supports

# ------------------------------------------------------------------------------------------------
# CUDA C++ (csrc/kernels/verify.cu)
# ------------------------------------------------------------------------------------------------

def _cuda_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens,
                          norm_offset=0.0):
    if not (hidden.dtype == norm_weight.dtype == lm_head_weight.dtype):
        return (f"the CUDA kernel needs one dtype for hidden, norm_weight and lm_head_weight, got "
                f"{hidden.dtype}, {norm_weight.dtype}, {lm_head_weight.dtype}")
    return _triton_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens)


@dispatch.register("verify_greedy", "cuda", supports=_cuda_greedy_supports)
def verify_greedy_cuda(hidden, norm_weight, eps, lm_head_weight, draft_tokens,
                       norm_offset=0.0):
    ext = _cuda.ext()
    R, D = hidden.shape
    V = lm_head_weight.shape[0]
    target = _alloc.empty(R, dtype=torch.int64, device=hidden.device)
    accepted = _alloc.empty(R, dtype=torch.bool, device=hidden.device)
    if R == 0:
        return target, accepted
    draft_tokens = draft_tokens.contiguous()
    nb = ext.verify_greedy_num_blocks(V)
    pval = _alloc.empty(R, nb, dtype=torch.float32, device=hidden.device)
    pidx = _alloc.empty(R, nb, dtype=torch.int32, device=hidden.device)
    # The caller's tensors go to the binding as tensors (dtype, device and bytes checked there);
    # the four buffers made just above, by this launcher at the binding's own block count, go
    # as addresses (null and alignment still checked): checking them again would re-read eight
    # Python attributes apiece on every call for nothing (host time, spd_kernels/README.md).
    ext.verify_greedy(hidden, hidden.stride(0), norm_weight,
                      lm_head_weight, lm_head_weight.stride(0),
                      draft_tokens, draft_tokens.dtype == torch.int64,
                      pval.data_ptr(), pidx.data_ptr(), target.data_ptr(), accepted.data_ptr(),
                      R, D, V, float(eps), float(norm_offset), dtype_code(hidden.dtype),
                      _cuda.stream_of(hidden))
    return target, accepted
