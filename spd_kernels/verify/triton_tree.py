"""tree_rejection_sample on Triton: one program a row (grid (B,); the 1-D form is one row), each
row read through its stride (the semantics and terms are in spd_kernels.verify.tree). p's
statistics and the top-k / top-p kept set come from rejection_sample_logits' one-program helpers
(`_logits_stats`: thresholds by a pivot search, no sort; see triton_rejection); then the
candidates' masses, N (p's mass off the candidates, also the residual's total), the accept tests
u_i * R_i < p(c_i) in the reference's order, and on rejection of all an inverse-CDF walk over p
with the candidates' entries set to 0."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, next_pow2, tl, triton
from spd_kernels.checks import check_kernel_float, last_dim_contiguous
from spd_kernels.sampling import top_p_float32
from spd_kernels.verify.triton_rejection import _rejection_block

if HAS_TRITON:
    from spd_kernels.verify.triton_helpers import _p_chunk
    from spd_kernels.verify.triton_rejection import _logits_stats

    @triton.jit
    def _off_candidates(offs, cand, real):
        """Whether each id of the chunk is not a real candidate ([BLOCK] against [KB])."""
        hit = (offs.to(tl.int64)[:, None] == cand[None, :]) & real[None, :]
        return tl.sum(hit.to(tl.int32), axis=1) == 0

    @triton.jit
    def _tree_kernel(x_ptr, stride_x, cand_ptr, stride_c, u_ptr, stride_u, out_tok_ptr,
                     out_acc_ptr, V, K, temperature, top_k, top_p, TOP_K: tl.constexpr,
                     TOP_P: tl.constexpr, KB: tl.constexpr, BLOCK: tl.constexpr):
        # row r's logits, candidates and uniforms (the 1-D form: r = 0 only)
        r = tl.program_id(0).to(tl.int64)
        x_ptr = x_ptr + r * stride_x
        cand_ptr = cand_ptr + r * stride_c
        u_ptr = u_ptr + r * stride_u
        mx, amax, ck, ci, z = _logits_stats(x_ptr, V, temperature, top_k, top_p, False, TOP_K,
                                            TOP_P, BLOCK)
        kk = tl.arange(0, KB)
        kmask = kk < K
        cand = tl.load(cand_ptr + kk, mask=kmask, other=-1).to(tl.int64)
        real = kmask & (cand >= 0) & (cand < V)  # anything else is padding
        p_c = _p_chunk(x_ptr, tl.where(real, cand, 0), real, temperature, mx, amax, ck, ci, z,
                       True, False, TOP_K, TOP_P)
        p_c = tl.where(real, p_c, 0.0)
        # N: p's mass off the candidates (the unnormalised residual after rejecting them all)
        n = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            p = _p_chunk(x_ptr, offs, mask, temperature, mx, amax, ck, ci, z, True, False, TOP_K,
                         TOP_P)
            n += tl.sum(tl.where(_off_candidates(offs, cand, real), p, 0.0), axis=0)
        # R_i = N + (p(c_i) + (p(c_{i+1}) + ...)), from the last candidate back (the reference's
        # order; the entries past K and the padding add 0)
        tail = tl.zeros([], dtype=tl.float32)
        mass = tl.zeros([KB], dtype=tl.float32)
        for s in tl.static_range(KB):
            sel = kk == (KB - 1 - s)
            tail = tail + tl.sum(tl.where(sel, p_c, 0.0), axis=0)
            mass = tl.where(sel, n + tail, mass)
        u = tl.load(u_ptr + kk, mask=kmask, other=0.0)
        accept = real & ((u * mass < p_c) | ((p_c > 0.0) & (p_c >= mass)))
        first = tl.min(tl.where(accept, kk, KB), axis=0)
        out = tl.sum(tl.where(kk == first, cand, 0), axis=0)
        if first == KB:
            # inverse CDF at u_k of p with the candidates' entries 0: the first index whose
            # running mass exceeds u_k * N, clamped to the last index with mass
            goal = tl.load(u_ptr + K) * n
            found = tl.zeros([], dtype=tl.int64) + V
            last = tl.zeros([], dtype=tl.int64)
            carry = tl.zeros([], dtype=tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                mask = offs < V
                p = _p_chunk(x_ptr, offs, mask, temperature, mx, amax, ck, ci, z, True, False,
                             TOP_K, TOP_P)
                w = tl.where(_off_candidates(offs, cand, real), p, 0.0)
                cdf = carry + tl.cumsum(w, axis=0)
                hit = mask & (cdf > goal) & (w > 0.0)
                found = tl.minimum(found, tl.min(tl.where(hit, offs, V), axis=0).to(tl.int64))
                last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs, 0), axis=0).to(tl.int64))
                carry += tl.sum(w, axis=0)
            out = tl.minimum(found, last)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, tl.where(first < KB, first, -1).to(tl.int64))


def _tree_supports(target_logits, candidates, uniforms, *args, **kwargs):
    # Rows are read through their stride (a row slice of a wider tensor is fine), the ids within
    # a row at stride 1; candidates and uniforms are made contiguous by the launcher.
    return check_kernel_float("target_logits", target_logits) or last_dim_contiguous(
        "target_logits", target_logits)


@dispatch.register("tree_rejection_sample", "triton", supports=_tree_supports)
def tree_rejection_sample_triton(target_logits, candidates, uniforms, temperature=1.0, top_k=0,
                                 top_p=1.0):
    # [V] is one row; [B, V] is B rows, one program each
    batched = target_logits.dim() == 2
    rows = target_logits.shape[0] if batched else 1
    V, k = target_logits.shape[-1], candidates.shape[-1]
    dev = target_logits.device
    tok = _alloc.empty(rows, dtype=torch.int64, device=dev)
    acc = _alloc.empty(rows, dtype=torch.int64, device=dev)
    if rows == 0:
        return tok, acc
    cand, u = candidates.contiguous(), uniforms.contiguous()
    strides = ((target_logits.stride(0), cand.stride(0), u.stride(0)) if batched
               else (0, 0, 0))
    block, warps = _rejection_block(V)
    _tree_kernel[(rows,)](target_logits, strides[0], cand, strides[1], u, strides[2], tok, acc,
                          V, k, float(temperature), int(top_k), top_p_float32(top_p),
                          TOP_K=0 < top_k < V, TOP_P=top_p < 1.0, KB=next_pow2(max(k, 1)),
                          BLOCK=block, num_warps=warps)
    return tok, acc
