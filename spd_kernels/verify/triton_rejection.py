"""rejection_sample / rejection_sample_logits on Triton. Each op has its own one-program-a-row
kernel: `_rejection_probs_kernel` (p and q given on target ids, uniforms given: no flags) and
`_rejection_logits_kernel` (p from the target logits after temperature / top-k / top-p, the rules
of spd_kernels.sampling; q on the draft vocabulary mapped to target ids; uniforms given or
Philox). On a GPU long rows take the split-row plan (triton_split.py) instead.

Top-k / top-p without a sort (`_logits_stats_passes`, shared with tree_rejection_sample): after
the stats pass, each threshold is a key (the fp32 value as an ordered int32) found by a pivot
search: a pass over the row counts, for PIVOTS keys spread over the interval that holds the
threshold, the tokens above each and their mass exp(x - max), and the smallest key above / the
largest not above each; the interval shrinks to the gap between two pivots and its ends move
onto keys present in the row. At most TOP_K_PASSES (top-k) and TOP_P_PASSES (top-p) passes, 2-4
each on logits; the last pass also gives the count and mass on each side of the threshold, so
the tie group at a cut costs a pass only when it is cut inside (the id of its last kept
token)."""
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
        _key_value,
        _nth_tied_id,
        _online_max,
        _tie_keep,
        _x_chunk,
    )
from spd_kernels.verify.triton_split import _launch_split, _split_chunk

# Pivots a pass of the top-k / top-p threshold searches (half spaced by key, half by value), and
# the passes that bound them: the key-spaced half leaves under 1/(PIVOTS / 2) (top-k) or at most
# 1/(PIVOTS / 2 + 1) (top-p) of the key interval, at most 2^32 keys wide at the start.
PIVOTS = 16
TOP_K_PASSES = 11  # d -> ceil(d / 8) - 1 reaches 0 from 2^32 in 11 steps
TOP_P_PASSES = 11  # d -> ceil(d / 9) reaches 1 from 2^32 in 11 steps
PIVOT_VALUE_SPAN = 64.0  # the value-spaced pivots cover at most the top 64 of x (e^-64 weights)

if HAS_TRITON:
    NPIV = tl.constexpr(PIVOTS)
    K_SEARCH_PASSES = tl.constexpr(TOP_K_PASSES)
    P_SEARCH_PASSES = tl.constexpr(TOP_P_PASSES)
    VALUE_SPAN = tl.constexpr(PIVOT_VALUE_SPAN)
    # a pivot pass steps over BLOCK / PIVOT_STEP_DIV tokens: the interpreter takes whole blocks
    # (fewer interpreted steps), a GPU a block split over the pivots (the same registers)
    PIVOT_STEP_DIV = tl.constexpr(1 if INTERPRET else PIVOTS)

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
        """`_logits_stats_passes` without the pass count."""
        mx, amax, ck, ci, z, npass = _logits_stats_passes(x_row, V, temperature, top_k, top_p,
                                                          GREEDY, TOP_K, TOP_P, BLOCK)
        return mx, amax, ck, ci, z

    @triton.jit
    def _logits_stats_passes(x_row, V, temperature, top_k, top_p, GREEDY: tl.constexpr,
                             TOP_K: tl.constexpr, TOP_P: tl.constexpr, BLOCK: tl.constexpr):
        """Of x = logits / T over the row: the max mx and the argmax amax (torch.argmax's order),
        the kept set (ck, ci) of top-k / top-p (see triton_helpers) and the normaliser
        z = sum exp(x - mx) over it; z = 0 for a NaN / inf row (p one-hot at amax); and how
        many passes over the row that took. The rules are spd_kernels.sampling's: top-k keeps
        the first k tokens of the order, top-p the tie group at its cut up to the count
        `_tie_keep` gives. No sort: each threshold is found by a pivot search (`_top_k_search`,
        `_top_p_search`), NPIV pivots a pass, whose last passes also give the count and the
        mass on each side of the threshold, so the tie group at a cut costs a pass only when
        it is cut inside (to find the id of its last kept token)."""
        # a pivot pass's step: [PBLOCK, NPIV] compares, on a GPU the registers of a plain step
        PBLOCK: tl.constexpr = BLOCK // PIVOT_STEP_DIV
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
        npass = tl.zeros([], dtype=tl.int32) + 1
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
                cnt_k = tl.zeros([], dtype=tl.int32) + V  # tokens with key >= the cut
                if TOP_K:
                    tk, gt, cnt_k, above, n_k = _top_k_search(x_row, V, temperature, mx, kmin,
                                                              kmax, top_k, PBLOCK)
                    npass += n_k
                    m_k = top_k - gt  # the tied tokens at tk that top-k keeps
                    ck = tk
                    w = tl.exp(_key_value(tk) - mx)  # the weight of each of them
                    z = above + m_k.to(tl.float32) * w
                    if m_k < cnt_k - gt:  # the tie group is cut: the id of its last kept token
                        ci = _nth_tied_id(x_row, 0, V, temperature, tk, m_k, 0, BLOCK)
                        npass += 1
                if TOP_P:
                    if TOP_K:
                        lo = ck.to(tl.int64) - 1
                    else:
                        lo = kmin.to(tl.int64) - 1
                    bound = (tl.zeros([], dtype=tl.float64) + top_p) * z.to(tl.float64)
                    tp, s, n, n_p = _top_p_search(x_row, V, temperature, mx, lo,
                                                  kmax.to(tl.int64), cnt_k, bound, PBLOCK)
                    npass += n_p
                    # the tie group at the cut: s the mass before it, w each token's weight,
                    # n its size (in the top-k set)
                    w = tl.exp(_key_value(tp) - mx)
                    if TOP_K:
                        n = tl.where(tp == ck, m_k, n)
                    keep = _tie_keep(s, w, bound, n)
                    if keep < n:
                        ci = _nth_tied_id(x_row, 0, V, temperature, tp, keep, 0, BLOCK)
                        npass += 1
                    elif tp != ck:
                        ci = tl.zeros([], dtype=tl.int32) + 2147483647
                    ck = tp
                    z = s + keep.to(tl.float32) * w
        return mx, amax, ck, ci, z, npass

    @triton.jit
    def _pivot_pass(x_row, V, temperature, mx, piv, PBLOCK: tl.constexpr):
        """One pass over the row for the pivot keys piv [NPIV] (int64): per pivot, the count
        and the mass sum exp(x - mx) of the tokens whose key exceeds it, the smallest such key
        (2^31 - 1 if none) and the largest key not above it (-2^31 if none)."""
        offs0 = tl.arange(0, PBLOCK)
        cnt = tl.zeros([NPIV], dtype=tl.int32)
        mass = tl.zeros([NPIV], dtype=tl.float32)
        up = tl.zeros([NPIV], dtype=tl.int32) + 2147483647
        down = tl.zeros([NPIV], dtype=tl.int32) - 2147483647 - 1
        for v0 in range(0, V, PBLOCK):
            offs = v0 + offs0
            mask = offs < V
            x = _x_chunk(x_row, offs, mask, temperature, False)
            key = float_key(x)
            e = tl.exp(x - mx)
            above = key.to(tl.int64)[:, None] > piv[None, :]  # [PBLOCK, NPIV]
            inside = mask[:, None]
            cnt += tl.sum((inside & above).to(tl.int32), axis=0)
            mass += tl.sum(tl.where(inside & above, e[:, None], 0.0), axis=0)
            up = tl.minimum(up, tl.min(tl.where(inside & above, key[:, None], 2147483647),
                                       axis=0))
            down = tl.maximum(down, tl.max(tl.where(inside & ~above, key[:, None],
                                                    -2147483647 - 1), axis=0))
        return cnt, mass, up, down

    @triton.jit
    def _pivots(lo, hi, j, INSIDE: tl.constexpr):
        """NPIV pivot keys [NPIV] (int64) in (lo, hi] (INSIDE: in (lo, hi)): the even slots
        evenly spaced over the keys, which bounds the passes whatever the values; the odd slots
        evenly spaced in value over the top VALUE_SPAN of the interval, where logits lie (keys
        follow the exponent, so one key-spaced pass over a row of logits mostly splits empty
        binades)."""
        jj = (j // 2 + 1).to(tl.int64)  # 1 .. NPIV / 2 for each kind
        d = hi - lo
        if INSIDE:
            by_key = lo + (jj * d) // (NPIV // 2 + 1)
            top = hi - 1
        else:
            by_key = lo + (jj * d + NPIV // 2 - 1) // (NPIV // 2)  # the last one is hi
            top = hi
        v_hi = _key_value(hi.to(tl.int32)).to(tl.float64)
        v_lo = tl.maximum(_key_value((lo + 1).to(tl.int32)).to(tl.float64), v_hi - VALUE_SPAN)
        v = (v_lo + jj.to(tl.float64) / (NPIV // 2 + 1) * (v_hi - v_lo)).to(tl.float32)
        by_value = tl.where(v == v, float_key(tl.where(v == v, v, 0.0)).to(tl.int64), by_key)
        piv = tl.where(j % 2 == 0, by_key, by_value)
        return tl.minimum(tl.maximum(piv, lo + 1), top)

    @triton.jit
    def _top_k_search(x_row, V, temperature, mx, kmin, kmax, top_k, PBLOCK: tl.constexpr):
        """The k-th largest key t (the largest t with #{key >= t} >= top_k), by a search over
        [kmin, kmax] with NPIV pivots a pass (`_pivots`): each pass leaves the gap between two
        pivots that holds t, its ends moved onto the nearest keys present; the key-spaced half
        leaves under 1/(NPIV / 2) of the interval, so at most TOP_K_PASSES passes, usually 2-4.
        Returns t, #{key > t}, #{key >= t}, the mass of {key > t} and the number of passes."""
        lo = kmin.to(tl.int64)  # #{key >= lo} >= top_k
        hi = kmax.to(tl.int64)  # #{key > hi} < top_k
        gt = tl.zeros([], dtype=tl.int32)         # #{key > hi}
        above = tl.zeros([], dtype=tl.float32)    # its mass
        ge = tl.zeros([], dtype=tl.int32) + V     # #{key >= lo}
        npass = tl.zeros([], dtype=tl.int32)
        j = tl.arange(0, NPIV)
        for _ in range(K_SEARCH_PASSES):
            if lo < hi:
                m = _pivots(lo, hi, j, False)
                cnt, mass, up, down = _pivot_pass(x_row, V, temperature, mx, m - 1, PBLOCK)
                npass += 1
                ok = cnt >= top_k  # every passing pivot lies below every failing one
                if tl.sum(ok.to(tl.int32), axis=0) > 0:
                    # t >= the highest passing pivot: lo moves up to the smallest key there
                    sel = ok & (m == tl.max(tl.where(ok, m, lo), axis=0))
                    lo = tl.max(tl.where(sel, up, -2147483647 - 1), axis=0).to(tl.int64)
                    ge = tl.max(tl.where(sel, cnt, 0), axis=0)
                if tl.sum((~ok).to(tl.int32), axis=0) > 0:
                    # t < the lowest failing pivot: hi moves down to the largest key below it
                    sel = ~ok & (m == tl.min(tl.where(ok, hi + 1, m), axis=0))
                    hi = tl.max(tl.where(sel, down, -2147483647 - 1), axis=0).to(tl.int64)
                    gt = tl.max(tl.where(sel, cnt, 0), axis=0)
                    above = tl.max(tl.where(sel, mass, 0.0), axis=0)
        return lo.to(tl.int32), gt, ge, above, npass

    @triton.jit
    def _top_p_search(x_row, V, temperature, mx, lo, hi, cnt_lo, bound, PBLOCK: tl.constexpr):
        """The smallest key t in (lo, hi] whose strictly-larger mass S(t) = sum exp(x - mx) over
        {key > t} is < bound = top_p * z (float64): the key of the tie group at the top-p cut.
        lo is just below the top-k cut (or the smallest key), so every key above it is in the
        top-k set; cnt_lo = #{key > lo}. NPIV pivots a pass strictly inside (lo, hi)
        (`_pivots`), the ends moved onto the keys present; the key-spaced half leaves at most
        1/(NPIV / 2 + 1) of the interval, so at most TOP_P_PASSES passes. Returns t, S(t),
        #{key == t} and the number of passes."""
        s_hi = tl.zeros([], dtype=tl.float32)  # S(hi): kmax has nothing above it
        cnt_hi = tl.zeros([], dtype=tl.int32)  # #{key > hi}
        npass = tl.zeros([], dtype=tl.int32)
        j = tl.arange(0, NPIV)
        for _ in range(P_SEARCH_PASSES):
            if hi - lo > 1:
                c = _pivots(lo, hi, j, True)
                cnt, mass, up, down = _pivot_pass(x_row, V, temperature, mx, c, PBLOCK)
                npass += 1
                # S never grows with the pivot (fp32 rounding is monotone), so every pivot
                # that fails lies below every one that passes
                bad = mass.to(tl.float64) >= bound
                if tl.sum(bad.to(tl.int32), axis=0) > 0:
                    # t > the highest failing pivot: lo moves to just below the next key present
                    sel = bad & (c == tl.max(tl.where(bad, c, lo), axis=0))
                    lo = tl.max(tl.where(sel, up, -2147483647 - 1), axis=0).to(tl.int64) - 1
                    cnt_lo = tl.max(tl.where(sel, cnt, 0), axis=0)
                if tl.sum((~bad).to(tl.int32), axis=0) > 0:
                    # t <= the lowest passing pivot: hi moves down to the largest key there
                    sel = ~bad & (c == tl.min(tl.where(bad, hi, c), axis=0))
                    hi = tl.max(tl.where(sel, down, -2147483647 - 1), axis=0).to(tl.int64)
                    cnt_hi = tl.max(tl.where(sel, cnt, 0), axis=0)
                    s_hi = tl.max(tl.where(sel, mass, 0.0), axis=0)
        return hi.to(tl.int32), s_hi, cnt_lo - cnt_hi, npass


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
