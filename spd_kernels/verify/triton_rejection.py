"""rejection_sample / rejection_sample_logits on Triton. Each op has its own one-program-a-row
kernel: `_rejection_probs_kernel` (p and q given on target ids, uniforms given: no flags) and
`_rejection_logits_kernel` (p from the target logits after temperature / top-k / top-p, thresholds
by bisection, the rules of spd_kernels.sampling; q on the draft vocabulary mapped to target
ids; uniforms given or Philox). On a GPU long rows take the split-row plan (triton_split.py) instead."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, next_pow2, tl, triton
from spd_kernels.checks import check_kernel_float, last_dim_contiguous
from spd_kernels.sampling import top_p_float32

if HAS_TRITON:

    from spd_kernels._triton import float_key

from spd_kernels.verify import target_to_draft_map

if HAS_TRITON:  # the shared @triton.jit helpers
    from spd_kernels.verify.triton_helpers import (
        _degenerate,
        _draw_residual,
        _given_p_stats,
        _judge,
        _key_counts,
        _key_value,
        _masked_exp_sum,
        _nth_tied_id,
        _online_max,
        _tie_keep,
        _x_chunk,
    )
from spd_kernels.verify.triton_split import _launch_split, _split_chunk

if HAS_TRITON:

    @triton.jit
    def _rejection_probs_kernel(p_ptr, stride_p, q_ptr, stride_q, tok_ptr, u_ptr, stride_u,
                                out_tok_ptr, out_acc_ptr, V, BLOCK: tl.constexpr):
        """rejection_sample, one program per row: accept the draft x iff u0 * q(x) < p(x); on
        rejection the inverse-CDF draw at u1 from max(p - q, 0) (p itself if that is empty), as
        the reference does."""
        r = tl.program_id(0).to(tl.int64)
        p_row = p_ptr + r * stride_p
        q_row = q_ptr + r * stride_q
        # p is read as given: no statistics; no target-to-draft map and no Philox, so tok_ptr
        # stands in for their pointers (never read)
        temperature, mx, amax, ck, ci, z = _given_p_stats()
        tok, accepted, u1 = _judge(p_row, q_row, tok_ptr, tok_ptr, r, V, temperature, mx, amax,
                                   ck, ci, z, u_ptr, stride_u, tok_ptr, tok_ptr,
                                   FROM_LOGITS=False, GREEDY=False, TOP_K=False, TOP_P=False,
                                   Q_MAPPED=False, PHILOX=False)
        out = tok
        if not accepted:
            out = _draw_residual(p_row, q_row, tok_ptr, V, u1, temperature, mx, amax, ck, ci, z,
                                 FROM_LOGITS=False, GREEDY=False, TOP_K=False, TOP_P=False,
                                 Q_MAPPED=False, BLOCK=BLOCK)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, accepted.to(tl.int8))

    @triton.jit
    def _rejection_logits_kernel(x_ptr, stride_x, q_ptr, stride_q, t2d_ptr, tok_ptr, u_ptr,
                                 stride_u, seed_ptr, offset_ptr, out_tok_ptr, out_acc_ptr, V,
                                 temperature, top_k, top_p, GREEDY: tl.constexpr,
                                 TOP_K: tl.constexpr, TOP_P: tl.constexpr, PHILOX: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """rejection_sample_logits, one program per row: p's statistics and thresholds, the
        accept test u0 * q(x) < p(x), and on rejection the inverse-CDF draw at u1 from
        max(p - q, 0) (p itself if that is empty), as the reference does. GREEDY: temperature
        0 (p one-hot at the first argmax; no top-k / top-p); PHILOX: u0, u1 from
        Philox(seed, offset + row) instead of u_ptr."""
        r = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + r * stride_x
        q_row = q_ptr + r * stride_q
        mx, amax, ck, ci, z = _logits_stats(x_row, V, temperature, top_k, top_p, GREEDY, TOP_K,
                                            TOP_P, BLOCK)
        tok, accepted, u1 = _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax,
                                   ck, ci, z, u_ptr, stride_u, seed_ptr, offset_ptr,
                                   FROM_LOGITS=True, GREEDY=GREEDY, TOP_K=TOP_K, TOP_P=TOP_P,
                                   Q_MAPPED=True, PHILOX=PHILOX)
        out = tok
        if not accepted:
            out = _draw_residual(x_row, q_row, t2d_ptr, V, u1, temperature, mx, amax, ck, ci, z,
                                 FROM_LOGITS=True, GREEDY=GREEDY, TOP_K=TOP_K, TOP_P=TOP_P,
                                 Q_MAPPED=True, BLOCK=BLOCK)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, accepted.to(tl.int8))

    @triton.jit
    def _logits_stats(x_row, V, temperature, top_k, top_p, GREEDY: tl.constexpr,
                      TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK: tl.constexpr):
        """Of x = logits / T over the row: the max mx and the argmax amax (torch.argmax's order),
        the kept set (ck, ci) of top-k / top-p (see triton_helpers) and the normaliser
        z = sum exp(x - mx) over it; z = 0 for a NaN / inf row (p one-hot at amax). The rules
        are spd_kernels.sampling's: top-k keeps the first k tokens of the order, top-p the tie
        group at its cut up to the count `_tie_keep` gives."""
        # Pass 1: the max (and its first index), the key range, and the online normaliser.
        ar = tl.arange(0, BLOCK)
        mx = tl.zeros([], dtype=tl.float32) + float("-inf")
        amax = tl.zeros([], dtype=tl.int32)
        nan_i = tl.zeros([], dtype=tl.int32) + 2147483647
        ck = tl.zeros([], dtype=tl.int32) - 2147483647 - 1
        ci = tl.zeros([], dtype=tl.int32) + 2147483647
        kmin = tl.zeros([], dtype=tl.int32) + 2147483647
        kmax = tl.zeros([], dtype=tl.int32) - 2147483647
        z = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + ar
            mask = offs < V
            x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
            mx, amax, z, nan_i = _online_max(x, offs, mx, amax, z, nan_i, GREEDY)
            if TOP_K or TOP_P:
                key = float_key(x)
                kmin = tl.minimum(kmin, tl.min(tl.where(mask, key, 2147483647), axis=0))
                kmax = tl.maximum(kmax, tl.max(tl.where(mask, key, -2147483647), axis=0))
        z, amax, deg = _degenerate(mx, amax, z, nan_i)
        if not GREEDY:
            if not deg:
                m_k = tl.zeros([], dtype=tl.int32)
                if TOP_K:
                    tk = _top_k_key(x_row, V, temperature, kmin, kmax, top_k, BLOCK)
                    gt, eq = _key_counts(x_row, 0, V, temperature, tk, BLOCK)
                    m_k = top_k - gt  # the tied tokens at tk that top-k keeps
                    ck = tk
                    ci = _nth_tied_id(x_row, 0, V, temperature, tk, m_k, 0, BLOCK)
                    z = _masked_exp_sum(x_row, V, temperature, mx, ck, ci,
                                        kmin.to(tl.int64) - 1, GREEDY, True, BLOCK)
                if TOP_P:
                    if TOP_K:
                        lo64 = ck.to(tl.int64) - 1
                    else:
                        lo64 = kmin.to(tl.int64) - 1
                    bound = (tl.zeros([], dtype=tl.float64) + top_p) * z.to(tl.float64)
                    tp = _top_p_key(x_row, V, temperature, mx, ck, ci, lo64, kmax.to(tl.int64),
                                    bound, TOP_K, BLOCK)
                    # the tie group at the cut: mass before it, its weight and size
                    s = _masked_exp_sum(x_row, V, temperature, mx, ck, ci, tp.to(tl.int64),
                                        GREEDY, TOP_K, BLOCK)
                    w = tl.exp(_key_value(tp) - mx)
                    gt, n = _key_counts(x_row, 0, V, temperature, tp, BLOCK)
                    if TOP_K:
                        n = tl.where(tp == ck, m_k, n)
                    keep = _tie_keep(s, w, bound, n)
                    ci = _nth_tied_id(x_row, 0, V, temperature, tp, keep, 0, BLOCK)
                    ck = tp
                    z = _masked_exp_sum(x_row, V, temperature, mx, ck, ci,
                                        kmin.to(tl.int64) - 1, GREEDY, True, BLOCK)
        return mx, amax, ck, ci, z

    @triton.jit
    def _top_k_key(x_row, V, temperature, kmin, kmax, top_k, BLOCK: tl.constexpr):
        """Largest key t with #{key >= t} >= top_k, by bisection over [kmin, kmax]: the k-th
        largest value (the tied tokens at it are then cut by id)."""
        lo = kmin
        hi = kmax
        for _ in range(32):
            if lo < hi:
                mid = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) >> 1).to(tl.int32)
                cnt = tl.zeros([], dtype=tl.int32)
                for v0 in range(0, V, BLOCK):
                    offs = v0 + tl.arange(0, BLOCK)
                    mask = offs < V
                    key = float_key(_x_chunk(x_row, offs, mask, temperature, False))
                    cnt += tl.sum((mask & (key >= mid)).to(tl.int32), axis=0)
                ok = cnt >= top_k
                lo = tl.where(ok, mid, lo)
                hi = tl.where(ok, hi, mid - 1)
        return lo

    @triton.jit
    def _top_p_key(x_row, V, temperature, mx, ck, ci, lo64, hi64, bound, TOP_K: tl.constexpr,
                   BLOCK: tl.constexpr):
        """Smallest key t in (lo64, hi64] whose strictly-larger mass (in the top-k set) is
        < bound = top_p * z (float64), by bisection: the key of the tie group at the cut."""
        for _ in range(34):
            if hi64 - lo64 > 1:
                mid64 = (lo64 + hi64) >> 1
                s = _masked_exp_sum(x_row, V, temperature, mx, ck, ci, mid64, False, TOP_K,
                                    BLOCK)
                ok = s.to(tl.float64) < bound
                hi64 = tl.where(ok, mid64, hi64)
                lo64 = tl.where(ok, lo64, mid64)
        return hi64.to(tl.int32)


def _rejection_block(V: int) -> tuple[int, int]:
    if INTERPRET:
        return min(next_pow2(V), 4096), 1
    return min(next_pow2(V), 2048), 8


def _float_ok(*named):
    for name, t in named:
        why = check_kernel_float(name, t) or last_dim_contiguous(name, t)
        if why:
            return why
    return None


def _rejection_outputs(x, tok):
    """A launcher's token [R] int64 and accepted [R] bool buffers, and the draft tokens made
    contiguous (the kernels index them by row)."""
    R = x.shape[0]
    return (_alloc.empty(R, dtype=torch.int64, device=x.device),
            _alloc.empty(R, dtype=torch.bool, device=x.device), tok.contiguous())


def _pick_chunk(chunk, x):
    """chunk: None picks the plan (`_split_chunk`: the split-row plan on a GPU for long rows),
    0 forces one program per row, > 0 forces the split-row plan with that chunk length (at
    least V / RADIX_MAX_CHUNKS with top-k or top-p)."""
    return _split_chunk(x.shape[1], x.device) if chunk is None else chunk


def _launch_rejection_probs(p, q, tok, uniforms, chunk=None):
    """rejection_sample: p, q [R, V] on target ids, uniforms [R, 2]. chunk: see `_pick_chunk`."""
    R, V = p.shape
    out, acc, tok = _rejection_outputs(p, tok)
    if R == 0:
        return out, acc
    chunk = _pick_chunk(chunk, p)
    if chunk:
        # tok stands in for the pointers the probs path does not read (t2d, seed, offset)
        _launch_split(p, q, tok, uniforms, uniforms.stride(0), tok, tok, tok, out, acc, 1.0,
                      from_logits=False, greedy=False, q_mapped=False, philox=False,
                      chunk=chunk)
    else:
        block, warps = _rejection_block(V)
        _rejection_probs_kernel[(R,)](p, p.stride(0), q, q.stride(0), tok, uniforms,
                                      uniforms.stride(0), out, acc.view(torch.int8), V,
                                      BLOCK=block, num_warps=warps)
    return out, acc


def _launch_rejection_logits(logits, q, t2d, tok, uniforms, philox_seed, philox_offset,
                             temperature, top_k, top_p, chunk=None):
    """rejection_sample_logits: logits [R, V], q [R, Vd] on the draft vocabulary, t2d [V] its
    column for each target id (`target_to_draft_map`); uniforms [R, 2], or None for Philox
    from philox_seed / philox_offset (which then advances by R). chunk: see `_pick_chunk`."""
    R, V = logits.shape
    out, acc, tok = _rejection_outputs(logits, tok)
    if R == 0:
        return out, acc
    greedy = temperature == 0.0
    use_top_k = not greedy and 0 < top_k < V
    use_top_p = not greedy and top_p < 1.0
    philox = uniforms is None
    # tok stands in for the pointers a launch does not read (the uniforms, or seed and offset)
    if philox:
        u, stride_u, seed, offset = tok, 0, philox_seed, philox_offset
    else:
        u, stride_u, seed, offset = uniforms, uniforms.stride(0), tok, tok
    temperature = temperature if temperature > 0 else 1.0
    chunk = _pick_chunk(chunk, logits)
    if chunk:
        _launch_split(logits, q, t2d, u, stride_u, seed, offset, tok, out, acc, temperature,
                      from_logits=True, greedy=greedy, q_mapped=True, philox=philox,
                      chunk=chunk, top_k=top_k, top_p=top_p, use_top_k=use_top_k,
                      use_top_p=use_top_p)
    else:
        block, warps = _rejection_block(V)
        _rejection_logits_kernel[(R,)](
            logits, logits.stride(0), q, q.stride(0), t2d, tok, u, stride_u, seed, offset, out,
            acc.view(torch.int8), V, temperature, int(top_k), top_p_float32(top_p), GREEDY=greedy,
            TOP_K=use_top_k, TOP_P=use_top_p, PHILOX=philox, BLOCK=block, num_warps=warps)
    if philox:
        philox_offset.add_(R)  # a separate tiny launch: every program above read the old value
    return out, acc


def _rs_supports(target_probs, draft_probs, draft_tokens, uniforms):
    return _float_ok(("target_probs", target_probs), ("draft_probs", draft_probs),
                     ("uniforms", uniforms))


@dispatch.register("rejection_sample", "triton", supports=_rs_supports)
def rejection_sample_triton(target_probs, draft_probs, draft_tokens, uniforms):
    return _launch_rejection_probs(target_probs, draft_probs, draft_tokens, uniforms)


def _rsl_supports(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms=None,
                  *args, **kwargs):
    named = [("target_logits", target_logits), ("draft_probs", draft_probs)]
    if uniforms is not None:
        named.append(("uniforms", uniforms))
    return _float_ok(*named)


@dispatch.register("rejection_sample_logits", "triton", supports=_rsl_supports)
def rejection_sample_logits_triton(target_logits, draft_probs, draft_to_target, draft_tokens,
                                   uniforms=None, temperature=1.0, top_k=0, top_p=1.0,
                                   philox_seed=None, philox_offset=None):
    t2d = target_to_draft_map(draft_to_target, target_logits.shape[1])
    return _launch_rejection_logits(target_logits, draft_probs, t2d, draft_tokens, uniforms,
                                    philox_seed, philox_offset, temperature, top_k, top_p)
