"""rejection_sample / rejection_sample_logits on csrc/kernels/sampling.cu (the sampling rules of
spd_kernels.sampling; on request: see
spd_kernels.on_request): one launch, one block per row doing every pass; the same Philox stream
as the Triton kernels."""
from __future__ import annotations

import torch

from spd_kernels import _cuda, dispatch
from spd_kernels._host import dtype_code
from spd_kernels.sampling import top_p_float32
from spd_kernels.verify import target_to_draft_map
from spd_kernels.verify.triton_rejection import _rejection_outputs, _rs_supports, _rsl_supports


def _launch_rejection_cuda(x, q, t2d, tok, uniforms, philox_seed, philox_offset, temperature,
                           top_k, top_p, from_logits):
    """One block per row does every pass (csrc/kernels/sampling.cu); same arguments as the Triton plan."""
    ext = _cuda.ext()
    R, V = x.shape
    out, acc, tok = _rejection_outputs(x, tok)
    if R == 0:
        return out, acc
    philox = uniforms is None
    if not philox:
        uniforms = uniforms.float()
        if uniforms.stride(1) != 1:
            uniforms = uniforms.contiguous()
    ext.rejection_sample(x, x.stride(0), dtype_code(x.dtype), q, q.stride(0),
                         dtype_code(q.dtype), t2d,
                         tok, tok.dtype == torch.int64,
                         None if philox else uniforms, 0 if philox else uniforms.stride(0),
                         philox_seed if philox else None,
                         philox_offset if philox else None, out,
                         acc, R, V, float(temperature), int(top_k), top_p_float32(top_p),
                         from_logits, _cuda.stream_of(x), q_cols=q.shape[1])
    if philox:
        philox_offset.add_(R)  # after the launch: every block read the old value
    return out, acc


# The CUDA sampler is checked in the host emulation but not yet timed on a GPU against the
# Triton plans: until it is, it runs only when asked for (backend="cuda", SPD_BACKEND).
@dispatch.register("rejection_sample", "cuda", supports=_rs_supports, automatic=False)
def rejection_sample_cuda(target_probs, draft_probs, draft_tokens, uniforms):
    return _launch_rejection_cuda(target_probs, draft_probs, None, draft_tokens, uniforms, None,
                                  None, 1.0, 0, 1.0, from_logits=False)


@dispatch.register("rejection_sample_logits", "cuda", supports=_rsl_supports, automatic=False)
def rejection_sample_logits_cuda(target_logits, draft_probs, draft_to_target, draft_tokens,
                                 uniforms=None, temperature=1.0, top_k=0, top_p=1.0,
                                 philox_seed=None, philox_offset=None):
    t2d = target_to_draft_map(draft_to_target, target_logits.shape[1])
    return _launch_rejection_cuda(target_logits, draft_probs, t2d, draft_tokens, uniforms,
                                  philox_seed, philox_offset, temperature, top_k, top_p,
                                  from_logits=True)
