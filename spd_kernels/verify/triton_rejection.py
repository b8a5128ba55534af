"""rejection_sample / rejection_sample_logits on Triton: one program a row (thresholds by
bisection), or the split-row plan (triton_split.py) on a GPU for long rows."""
from __future__ import annotations

import torch

from spd_kernels import _alloc, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, next_pow2, tl, triton
from spd_kernels.checks import check_kernel_float, last_dim_contiguous

if HAS_TRITON:

    from spd_kernels._triton import float_key

from spd_kernels.verify import target_to_draft_map

if HAS_TRITON:  # the shared @triton.jit helpers
    from spd_kernels.verify.triton_helpers import (
        _judge,
        _masked_exp_sum,
        _online_max,
        _p_chunk,
        _q_chunk,
        _walk,
        _x_chunk,
    )
from spd_kernels.verify.triton_split import _launch_split, _split_chunk

if HAS_TRITON:

    @triton.jit
    def _rejection_kernel(x_ptr, stride_x, q_ptr, stride_q, t2d_ptr, tok_ptr, u_ptr, stride_u,
                          seed_ptr, offset_ptr, out_tok_ptr, out_acc_ptr,
                          V, temperature, top_k, top_p,
                          FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
                          TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr, PHILOX: tl.constexpr,
                          BLOCK: tl.constexpr):
        """One program per row: p's statistics, the accept test, and on rejection the
        inverse-CDF draw from max(p - q, 0) (p itself if that is empty), as the reference does."""
        r = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + r * stride_x
        q_row = q_ptr + r * stride_q
        ar = tl.arange(0, BLOCK)
        mx = tl.zeros([], dtype=tl.float32) + float("-inf")
        z = tl.zeros([], dtype=tl.float32) + 1.0
        amax = tl.zeros([], dtype=tl.int32)
        tk = tl.zeros([], dtype=tl.int32)
        tp = tl.zeros([], dtype=tl.int32)
        if FROM_LOGITS:
            # Pass 1: max of x = logits / T (and its first index), the key range, and the online
            # normaliser sum(exp(x - max)).
            kmin = tl.zeros([], dtype=tl.int32) + 2147483647
            kmax = tl.zeros([], dtype=tl.int32) - 2147483647
            z = tl.zeros([], dtype=tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + ar
                mask = offs < V
                x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
                mx, amax, z = _online_max(x, offs, mx, amax, z, GREEDY)
                if TOP_K or TOP_P:
                    key = float_key(x)
                    kmin = tl.minimum(kmin, tl.min(tl.where(mask, key, 2147483647), axis=0))
                    kmax = tl.maximum(kmax, tl.max(tl.where(mask, key, -2147483647), axis=0))
            if not GREEDY:
                if TOP_K:
                    # Largest key t with #{key >= t} >= top_k: the k-th largest value. Then the
                    # kept set is {x >= kth}, ties included, exactly as the reference masks.
                    lo = kmin
                    hi = kmax
                    for _ in range(32):
                        if lo < hi:
                            mid = ((lo.to(tl.int64) + hi.to(tl.int64) + 1) >> 1).to(tl.int32)
                            cnt = tl.zeros([], dtype=tl.int32)
                            for v0 in range(0, V, BLOCK):
                                offs = v0 + ar
                                mask = offs < V
                                key = float_key(_x_chunk(x_row, offs, mask, temperature, GREEDY))
                                cnt += tl.sum((mask & (key >= mid)).to(tl.int32), axis=0)
                            ok = cnt >= top_k
                            lo = tl.where(ok, mid, lo)
                            hi = tl.where(ok, hi, mid - 1)
                    tk = lo
                    z = _masked_exp_sum(x_row, V, temperature, mx, tk, tk.to(tl.int64) - 1,
                                        GREEDY, TOP_K, BLOCK)
                if TOP_P:
                    # Smallest key t whose strictly-larger kept mass is < top_p: a token is kept
                    # iff the mass before it (in descending order) is < top_p.
                    if TOP_K:
                        lo64 = tk.to(tl.int64) - 1
                    else:
                        lo64 = kmin.to(tl.int64) - 1
                    hi64 = kmax.to(tl.int64)
                    bound = top_p * z
                    for _ in range(34):
                        if hi64 - lo64 > 1:
                            mid64 = (lo64 + hi64) >> 1
                            s = _masked_exp_sum(x_row, V, temperature, mx, tk, mid64, GREEDY,
                                                TOP_K, BLOCK)
                            ok = s < bound
                            hi64 = tl.where(ok, mid64, hi64)
                            lo64 = tl.where(ok, lo64, mid64)
                    tp = hi64.to(tl.int32)
                    if TOP_K:
                        tk2 = tl.maximum(tk, tp)
                    else:
                        tk2 = tp
                    z = _masked_exp_sum(x_row, V, temperature, mx, tk2, tk2.to(tl.int64) - 1,
                                        GREEDY, TOP_K, BLOCK)

        tok, accepted, u1 = _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax,
                                   tk, tp, z, u_ptr, stride_u, seed_ptr, offset_ptr, FROM_LOGITS,
                                   GREEDY, TOP_K, TOP_P, Q_MAPPED, PHILOX)
        out = tok
        if not accepted:
            # Residual mass and p's own mass (the fallback when p <= q everywhere).
            s_res = tl.zeros([], dtype=tl.float32)
            s_p = tl.zeros([], dtype=tl.float32)
            for v0 in range(0, V, BLOCK):
                offs = v0 + ar
                mask = offs < V
                p = _p_chunk(x_row, offs, mask, temperature, mx, amax, tk, tp, z,
                             FROM_LOGITS, GREEDY, TOP_K, TOP_P)
                q = _q_chunk(q_row, t2d_ptr, offs, mask, Q_MAPPED)
                s_res += tl.sum(tl.maximum(p - q, 0.0), axis=0)
                s_p += tl.sum(p, axis=0)
            use_p = s_res <= 0.0
            total = tl.where(use_p, s_p, s_res)
            # Inverse CDF: first index whose running mass exceeds u * total, clamped to the last
            # index with mass (guards the top end against rounding), as sample_from_probs does.
            carry = tl.zeros([], dtype=tl.float32)
            found, last = _walk(x_row, q_row, t2d_ptr, 0, V, u1 * total, carry, use_p,
                                temperature, mx, amax, tk, tp, z, FROM_LOGITS, GREEDY, TOP_K,
                                TOP_P, Q_MAPPED, BLOCK)
            out = tl.minimum(found, last)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, accepted.to(tl.int8))





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


def _launch_rejection(x, q, t2d, tok, uniforms, philox_seed, philox_offset, temperature, top_k,
                      top_p, from_logits, q_mapped, chunk=None):
    """chunk: None picks the plan (`_split_chunk`), 0 forces one program per row, > 0 forces
    the split-row plan with that chunk length (at least V / RADIX_MAX_CHUNKS with top-k or
    top-p)."""
    R, V = x.shape
    out, acc, tok = _rejection_outputs(x, tok)
    if R == 0:
        return out, acc
    greedy = from_logits and temperature == 0.0
    use_top_k = from_logits and not greedy and 0 < top_k < V
    use_top_p = from_logits and not greedy and top_p < 1.0
    philox = uniforms is None
    dummy = tok  # placeholder pointer for arguments a variant does not read
    # (t2d, uniforms, their row stride, seed, offset): what every kernel variant takes
    rand = (t2d if q_mapped else dummy, dummy if philox else uniforms,
            0 if philox else uniforms.stride(0), philox_seed if philox else dummy,
            philox_offset if philox else dummy)
    temperature = temperature if temperature > 0 else 1.0
    if chunk is None:
        chunk = _split_chunk(V, x.device)
    if chunk:
        _launch_split(x, q, *rand, tok, out, acc, temperature, from_logits, greedy, q_mapped,
                      philox, chunk, top_k, top_p, use_top_k, use_top_p)
    else:
        block, warps = _rejection_block(V)
        t2d_arg, u_arg, stride_u, seed_arg, offset_arg = rand
        _rejection_kernel[(R,)](
            x, x.stride(0), q, q.stride(0), t2d_arg, tok, u_arg, stride_u, seed_arg, offset_arg,
            out, acc.view(torch.int8), V, temperature, int(top_k), float(top_p),
            FROM_LOGITS=from_logits, GREEDY=greedy, TOP_K=use_top_k, TOP_P=use_top_p,
            Q_MAPPED=q_mapped, PHILOX=philox, BLOCK=block, num_warps=warps)
    if philox:
        philox_offset.add_(R)  # a separate tiny launch: every program above read the old value
    return out, acc


def _rs_supports(target_probs, draft_probs, draft_tokens, uniforms):
    return _float_ok(("target_probs", target_probs), ("draft_probs", draft_probs),
                     ("uniforms", uniforms))


@dispatch.register("rejection_sample", "triton", supports=_rs_supports)
def rejection_sample_triton(target_probs, draft_probs, draft_tokens, uniforms):
    return _launch_rejection(target_probs, draft_probs, None, draft_tokens, uniforms, None, None,
                             1.0, 0, 1.0, from_logits=False, q_mapped=False)


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
    return _launch_rejection(target_logits, draft_probs, t2d, draft_tokens, uniforms,
                             philox_seed, philox_offset, temperature, top_k, top_p,
                             from_logits=True, q_mapped=True)
