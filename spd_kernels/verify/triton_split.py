"""The split-row plan of the rejection samplers (a GPU, from SPLIT_MIN_VOCAB entries a row):
chunk programs for the row statistics, top-k / top-p thresholds by radix select (then the id
that cuts the tie group at each threshold: chunk counts and one program a row), the residual
masses, then one program a row for the accept test and the draw. The rules are
spd_kernels.sampling's."""
from __future__ import annotations

import torch

from spd_kernels._triton import HAS_TRITON, INTERPRET, next_pow2, tl, triton
from spd_kernels.sampling import top_p_float32

if HAS_TRITON:

    from spd_kernels._triton import float_key

if HAS_TRITON:  # the shared @triton.jit helpers
    from spd_kernels.verify.triton_helpers import (
        _degenerate,
        _in_set,
        _judge,
        _key_value,
        _nth_tied_id,
        _online_max,
        _p_chunk,
        _q_chunk,
        _tie_keep,
        _walk,
        _x_chunk,
    )

if HAS_TRITON:
    # Split-row plan (no top-k / top-p): the row is cut into NB chunks, one program each, so a
    # 152k-entry row is read by ~75 SMs at once instead of walked by one.

    @triton.jit
    def _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, FROM_LOGITS: tl.constexpr,
                   GREEDY: tl.constexpr, NB_PAD: tl.constexpr):
        """Merge the chunks' (max, sum exp(x - max), argmax; a NaN max: the chunk's first NaN)
        into the row's (mx, amax, z), z = 0 for a NaN / inf row (placeholders when p is given as
        probabilities)."""
        mx = tl.zeros([], dtype=tl.float32)
        amax = tl.zeros([], dtype=tl.int32)
        z = tl.zeros([], dtype=tl.float32) + 1.0
        if FROM_LOGITS:
            b = tl.arange(0, NB_PAD)
            bm = b < NB
            cmax = tl.load(pmax_ptr + r * NB + b, mask=bm, other=float("-inf"))
            isnan = bm & (cmax != cmax)
            cmax = tl.where(isnan, float("-inf"), cmax)
            mx = tl.max(cmax, axis=0)
            carg = tl.load(parg_ptr + r * NB + b, mask=bm, other=2147483647)
            nan_i = tl.min(tl.where(isnan, carg, 2147483647), axis=0)
            amax = tl.min(tl.where(bm & (cmax == mx), carg, 2147483647), axis=0)
            if not GREEDY:
                csum = tl.load(psum_ptr + r * NB + b, mask=bm, other=0.0)
                z = tl.sum(tl.where(bm & (cmax > float("-inf")), csum * tl.exp(cmax - mx), 0.0),
                           axis=0)
            z, amax, deg = _degenerate(mx, amax, z, nan_i)
        return mx, amax, z

    @triton.jit
    def _split_stats_kernel(x_ptr, stride_x, pmax_ptr, psum_ptr, parg_ptr, V, CHUNK, NB,
                            temperature, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r, b): max, first argmax and sum exp(x - max) of x = logits / T over chunk b."""
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        x_row = x_ptr + r * stride_x
        lo = b * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        mx = tl.zeros([], dtype=tl.float32) + float("-inf")
        amax = tl.zeros([], dtype=tl.int32) + 2147483647
        nan_i = tl.zeros([], dtype=tl.int32) + 2147483647
        z = tl.zeros([], dtype=tl.float32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = _x_chunk(x_row, offs, offs < hi, temperature, GREEDY)
            mx, amax, z, nan_i = _online_max(x, offs, mx, amax, z, nan_i, GREEDY)
        has_nan = nan_i < 2147483647
        tl.store(pmax_ptr + r * NB + b, tl.where(has_nan, float("nan"), mx))
        tl.store(psum_ptr + r * NB + b, z)
        tl.store(parg_ptr + r * NB + b, tl.where(has_nan, nan_i, amax))

    @triton.jit
    def _split_residual_kernel(x_ptr, stride_x, q_ptr, stride_q, t2d_ptr, pmax_ptr, psum_ptr,
                               parg_ptr, thr_ptr, zsel_ptr, mass_ptr, V, CHUNK, NB, temperature,
                               FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr,
                               TOP_K: tl.constexpr, TOP_P: tl.constexpr,
                               Q_MAPPED: tl.constexpr, NB_PAD: tl.constexpr,
                               BLOCK: tl.constexpr):
        """Program (r, b): over chunk b, the residual mass sum max(p - q, 0) and p's own mass
        (mass [R, 2, NB])."""
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        x_row = x_ptr + r * stride_x
        q_row = q_ptr + r * stride_q
        mx, amax, z = _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, FROM_LOGITS, GREEDY, NB_PAD)
        ck, ci, z = _selected(thr_ptr, zsel_ptr, r, z, TOP_K, TOP_P)
        lo = b * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        s_res = tl.zeros([], dtype=tl.float32)
        s_p = tl.zeros([], dtype=tl.float32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, ck, ci, z, FROM_LOGITS,
                         GREEDY, TOP_K, TOP_P)
            s_res += tl.sum(tl.maximum(p - _q_chunk(q_row, t2d_ptr, offs, mask, Q_MAPPED), 0.0),
                            axis=0)
            s_p += tl.sum(p, axis=0)
        tl.store(mass_ptr + r * 2 * NB + b, s_res)
        tl.store(mass_ptr + r * 2 * NB + NB + b, s_p)

    @triton.jit
    def _split_finish_kernel(x_ptr, stride_x, q_ptr, stride_q, t2d_ptr, tok_ptr, u_ptr, stride_u,
                             seed_ptr, offset_ptr, pmax_ptr, psum_ptr, parg_ptr, thr_ptr,
                             zsel_ptr, mass_ptr, out_tok_ptr, out_acc_ptr, V, CHUNK, NB,
                             temperature, FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr,
                             TOP_K: tl.constexpr, TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr,
                             PHILOX: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """Program r: the accept test; on rejection the inverse-CDF draw from max(p - q, 0) (p
        itself if that is empty): the chunk holding u * total is found from the chunks' masses
        in order, then walked; the draw is clamped to that chunk's last index with mass (the
        chunk sums and the walk add in different orders, so the walk may end without a hit)."""
        r = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + r * stride_x
        q_row = q_ptr + r * stride_q
        mx, amax, z = _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, FROM_LOGITS, GREEDY, NB_PAD)
        ck, ci, z = _selected(thr_ptr, zsel_ptr, r, z, TOP_K, TOP_P)
        tok, accepted, u1 = _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax,
                                   ck, ci, z, u_ptr, stride_u, seed_ptr, offset_ptr, FROM_LOGITS,
                                   GREEDY, TOP_K, TOP_P, Q_MAPPED, PHILOX)
        out = tok
        if not accepted:
            bi = tl.arange(0, NB_PAD)
            bm = bi < NB
            m_res = tl.load(mass_ptr + r * 2 * NB + bi, mask=bm, other=0.0)
            m_p = tl.load(mass_ptr + r * 2 * NB + NB + bi, mask=bm, other=0.0)
            use_p = tl.sum(m_res, axis=0) <= 0.0
            m = tl.where(use_p, m_p, m_res)
            goal = u1 * tl.sum(m, axis=0)
            cum = tl.cumsum(m, axis=0)
            last_b = tl.max(tl.where(bm & (m > 0.0), bi, 0), axis=0)
            pick = tl.minimum(tl.min(tl.where(bm & (cum > goal), bi, NB_PAD), axis=0), last_b)
            carry = tl.sum(tl.where(bi < pick, m, 0.0), axis=0)
            lo = pick * CHUNK
            found, last = _walk(x_row, q_row, t2d_ptr, lo, tl.minimum(lo + CHUNK, V), goal,
                                carry, use_p, temperature, mx, amax, ck, ci, z, FROM_LOGITS,
                                GREEDY, TOP_K, TOP_P, Q_MAPPED, BLOCK)
            out = tl.minimum(found, last)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, accepted.to(tl.int8))

    @triton.jit
    def _selected(thr_ptr, zsel_ptr, r, z, TOP_K: tl.constexpr, TOP_P: tl.constexpr):
        """The row's kept set (ck, ci) (thr [R, 4]: top-k key and id, top-p key and id) and the
        kept mass the radix select stored (z unchanged without top-k / top-p; kept at 0 for a
        NaN / inf row)."""
        ck = tl.zeros([], dtype=tl.int32)
        ci = tl.zeros([], dtype=tl.int32)
        if TOP_K or TOP_P:
            z = tl.where(z == 0.0, 0.0, tl.load(zsel_ptr + r))
            if TOP_P:
                ck = tl.load(thr_ptr + 4 * r + 2)
                ci = tl.load(thr_ptr + 4 * r + 3)
            else:
                ck = tl.load(thr_ptr + 4 * r)
                ci = tl.load(thr_ptr + 4 * r + 1)
        return ck, ci, z

    # Radix select of the top-k / top-p thresholds over split rows. A logit's key (float_key,
    # shifted to [0, 2^32)) is chosen 8 bits at a time from the top, in four rounds a phase:
    # chunk programs histogram the keys that match the digits chosen so far (count and mass
    # exp(x - max) per next digit), then one program per row sums the chunks' histograms and
    # picks the next digit. Top-k picks the digit holding the k-th largest key; top-p (over the
    # top-k set) the digit where the mass from the top first reaches top_p * z. Four passes
    # over the row a phase instead of ~33 for bisection, each spread over the row's chunks.

    @triton.jit
    def _radix_hist_kernel(x_ptr, stride_x, pmax_ptr, psum_ptr, parg_ptr, prefix_ptr, thr_ptr,
                           cnt_ptr, mass_ptr, V, CHUNK, NB, temperature, SHIFT: tl.constexpr,
                           PHASE_P: tl.constexpr, TOP_K: tl.constexpr, NEED_MASS: tl.constexpr,
                           NB_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r, b): over chunk b, per value of the key's bits [SHIFT, SHIFT + 8), the
        count (and mass, when NEED_MASS) of the tokens whose higher bits match the row's prefix
        (and, for top-p after top-k, whose key is in the top-k set). cnt/mass [R, NB, 256]."""
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        x_row = x_ptr + r * stride_x
        mx, amax, z = _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, True, False, NB_PAD)
        prefix = tl.zeros([], dtype=tl.int64)
        if SHIFT < 24:
            prefix = tl.load(prefix_ptr + r)
        tk = tl.zeros([], dtype=tl.int32)
        ik = tl.zeros([], dtype=tl.int32)
        if PHASE_P and TOP_K:
            tk = tl.load(thr_ptr + 4 * r)
            ik = tl.load(thr_ptr + 4 * r + 1)
        bins = tl.arange(0, 256)
        cnt = tl.zeros([256], dtype=tl.int32)
        mass = tl.zeros([256], dtype=tl.float32)
        lo = b * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            x = _x_chunk(x_row, offs, mask, temperature, False)
            key = float_key(x)
            ukey = key.to(tl.int64) + 2147483648
            match = mask & ((ukey >> (SHIFT + 8)) == prefix)
            if PHASE_P and TOP_K:
                match = match & _in_set(key, offs, tk, ik)
            digit = ((ukey >> SHIFT) & 255).to(tl.int32)
            hit = match[:, None] & (digit[:, None] == bins[None, :])
            cnt += tl.sum(hit.to(tl.int32), axis=0)
            if NEED_MASS:
                mass += tl.sum(tl.where(hit, tl.exp(x - mx)[:, None], 0.0), axis=0)
        base = (r * NB + b) * 256
        tl.store(cnt_ptr + base + bins, cnt)
        if NEED_MASS:
            tl.store(mass_ptr + base + bins, mass)

    @triton.jit
    def _radix_select_kernel(pmax_ptr, psum_ptr, parg_ptr, cnt_ptr, mass_ptr, prefix_ptr,
                             above_ptr, above_mass_ptr, thr_ptr, zsel_ptr, tie_ptr, NB, top_k,
                             top_p,
                             SHIFT: tl.constexpr, PHASE_P: tl.constexpr, TOP_K: tl.constexpr,
                             NEED_MASS: tl.constexpr, NB_PAD: tl.constexpr):
        """Program r: the next digit of the threshold from the chunks' histograms. After the
        last round it stores the threshold key (thr [R, 2]: top-k, top-p) and the mass of the
        kept set (zsel [R]) and how many tokens of the tie group at the threshold are kept
        (tie [R]: top-k's k - #above, top-p's `_tie_keep` count); before, the prefix and the
        count / mass above it."""
        r = tl.program_id(0).to(tl.int64)
        prefix = tl.zeros([], dtype=tl.int64)
        above = tl.zeros([], dtype=tl.int32)
        above_m = tl.zeros([], dtype=tl.float32)
        if SHIFT < 24:
            prefix = tl.load(prefix_ptr + r)
            above = tl.load(above_ptr + r)
            above_m = tl.load(above_mass_ptr + r)
        i = tl.arange(0, 256)  # i-th digit from the top: digit 255 - i
        c = tl.zeros([256], dtype=tl.int32)
        m = tl.zeros([256], dtype=tl.float32)
        for b0 in range(0, NB, 8):  # 8 chunks' histograms at a time (no register spills)
            nb = b0 + tl.arange(0, 8)
            at = r * NB * 256 + nb[:, None] * 256 + (255 - i)[None, :]
            chunks = (nb < NB)[:, None]
            c += tl.sum(tl.load(cnt_ptr + at, mask=chunks, other=0), axis=0)
            if NEED_MASS:
                m += tl.sum(tl.load(mass_ptr + at, mask=chunks, other=0.0), axis=0)
        mx, amax, zr = _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, True, False, NB_PAD)
        zk = zr
        if PHASE_P:
            if TOP_K:  # z of the top-k set: everything this phase's first round counts
                if SHIFT == 24:
                    zk = tl.sum(m, axis=0)
                    tl.store(zsel_ptr + r, zk)
                else:
                    zk = tl.load(zsel_ptr + r)
            # the digit where the mass from the top first reaches top_p * z; if rounding keeps
            # it from being reached, the lowest digit present (keep everything), as bisection
            reach = tl.min(tl.where(above_m + tl.cumsum(m, axis=0) >= top_p * zk, i, 256),
                           axis=0)
            lowest = tl.max(tl.where(c > 0, i, 0), axis=0)
            sel = tl.where(reach < 256, reach, lowest)
        else:
            sel = tl.min(tl.where(above + tl.cumsum(c, axis=0) >= top_k, i, 255), axis=0)
        prefix = prefix * 256 + (255 - sel)
        above += tl.sum(tl.where(i < sel, c, 0), axis=0)
        above_m += tl.sum(tl.where(i < sel, m, 0.0), axis=0)
        if SHIFT > 0:
            tl.store(prefix_ptr + r, prefix)
            tl.store(above_ptr + r, above)
            tl.store(above_mass_ptr + r, above_m)
        else:
            key = (prefix - 2147483648).to(tl.int32)
            w = tl.exp(_key_value(key) - mx)  # the weight of each token tied at the threshold
            if PHASE_P:
                n = tl.sum(tl.where(i == sel, c, 0), axis=0)
                bound = (tl.zeros([], dtype=tl.float64) + top_p) * zk.to(tl.float64)
                keep = _tie_keep(above_m, w, bound, n)
                tl.store(thr_ptr + 4 * r + 2, key)
            else:
                keep = top_k - above
                tl.store(thr_ptr + 4 * r, key)
            tl.store(tie_ptr + r, keep)
            tl.store(zsel_ptr + r, above_m + keep.to(tl.float32) * w)

    @triton.jit
    def _tie_count_kernel(x_ptr, stride_x, thr_ptr, tcnt_ptr, V, CHUNK, NB, temperature,
                          SLOT: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r, b): how many keys of chunk b equal the threshold key thr[r, SLOT]."""
        r = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        key_c = tl.load(thr_ptr + 4 * r + SLOT)
        lo = b * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        eq = tl.zeros([], dtype=tl.int32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            key = float_key(_x_chunk(x_ptr + r * stride_x, offs, mask, temperature, False))
            eq += tl.sum((mask & (key == key_c)).to(tl.int32), axis=0)
        tl.store(tcnt_ptr + r * NB + b, eq)

    @triton.jit
    def _tie_pick_kernel(x_ptr, stride_x, thr_ptr, tcnt_ptr, tie_ptr, V, CHUNK, NB, temperature,
                         SLOT: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr):
        """Program r: the id of the tie[r]-th token whose key is thr[r, SLOT] (the chunk that
        holds it from the chunks' counts, then a walk of it) into thr[r, SLOT + 1]."""
        r = tl.program_id(0).to(tl.int64)
        key_c = tl.load(thr_ptr + 4 * r + SLOT)
        m = tl.load(tie_ptr + r)
        bi = tl.arange(0, NB_PAD)
        cnt = tl.load(tcnt_ptr + r * NB + bi, mask=bi < NB, other=0)
        cum = tl.cumsum(cnt, axis=0)
        pick = tl.minimum(tl.min(tl.where((bi < NB) & (cum >= m), bi, NB_PAD), axis=0), NB - 1)
        carry = tl.sum(tl.where(bi < pick, cnt, 0), axis=0)
        lo = pick * CHUNK
        found = _nth_tied_id(x_ptr + r * stride_x, lo, tl.minimum(lo + CHUNK, V), temperature,
                             key_c, m, carry, BLOCK)
        tl.store(thr_ptr + 4 * r + SLOT + 1, found)



SPLIT_MIN_VOCAB = 16384   # below this one program per row is quick enough on a GPU


def _split_chunk(V: int, device) -> int:
    """Chunk length of the split-row plan on this device, 0 for the one-program plan."""
    if device.type != "cuda" or V < SPLIT_MIN_VOCAB:
        return 0
    return max(2048, next_pow2(triton.cdiv(V, 1024)))  # at most 1024 chunks a row

def _split_row_stats(x, temperature, from_logits, greedy, chunk, top_k=0, top_p=1.0,
                     use_top_k=False, use_top_p=False):
    """The split-row plan's first launches: per-chunk (max, sum exp, argmax) of x / T (from
    logits), and the radix select of the top-k / top-p thresholds. Returns the chunking, the
    partials and thr [R, 4] (top-k key and id, top-p key and id), zsel [R] (mass exp(x - max)
    of the kept set)."""
    R, V = x.shape
    if use_top_k or use_top_p:  # each select program sums NB x 256 histogram entries
        chunk = max(chunk, next_pow2(triton.cdiv(V, RADIX_MAX_CHUNKS)))
    nb = triton.cdiv(V, chunk)
    nb_pad = next_pow2(nb)
    dev = x.device
    pmax = torch.empty(R, nb, dtype=torch.float32, device=dev)
    psum = torch.empty(R, nb, dtype=torch.float32, device=dev)
    parg = torch.empty(R, nb, dtype=torch.int32, device=dev)
    thr = torch.empty(R, 4, dtype=torch.int32, device=dev)
    zsel = torch.empty(R, dtype=torch.float32, device=dev)
    if from_logits:
        _split_stats_kernel[(R, nb)](x, x.stride(0), pmax, psum, parg, V, chunk, nb, temperature,
                                     GREEDY=greedy, BLOCK=_split_block(chunk),
                                     num_warps=SPLIT_WARPS)
    if use_top_k or use_top_p:
        _radix_select(x, pmax, psum, parg, thr, zsel, temperature, top_k, top_p, use_top_k,
                      use_top_p, chunk, nb, nb_pad)
    return chunk, nb, nb_pad, pmax, psum, parg, thr, zsel


def _split_block(chunk):
    return min(chunk, 4096 if INTERPRET else 1024)


SPLIT_WARPS = 1 if INTERPRET else 4  # every launch of the split-row plan


def _launch_split(x, q, t2d, u, stride_u, seed, offset, tok, out, acc, temperature,
                  from_logits, greedy, q_mapped, philox, chunk, top_k=0, top_p=1.0,
                  use_top_k=False, use_top_p=False):
    """The split-row plan: stats (from logits) and thresholds, per-chunk residual masses, then
    the finish."""
    R, V = x.shape
    chunk, nb, nb_pad, pmax, psum, parg, thr, zsel = _split_row_stats(
        x, temperature, from_logits, greedy, chunk, top_k, top_p, use_top_k, use_top_p)
    block = _split_block(chunk)
    mass = torch.empty(R, 2, nb, dtype=torch.float32, device=x.device)
    _split_residual_kernel[(R, nb)](x, x.stride(0), q, q.stride(0), t2d, pmax, psum, parg, thr,
                                    zsel, mass, V, chunk, nb, temperature,
                                    FROM_LOGITS=from_logits, GREEDY=greedy, TOP_K=use_top_k,
                                    TOP_P=use_top_p, Q_MAPPED=q_mapped, NB_PAD=nb_pad,
                                    BLOCK=block, num_warps=SPLIT_WARPS)
    _split_finish_kernel[(R,)](x, x.stride(0), q, q.stride(0), t2d, tok, u, stride_u, seed,
                               offset, pmax, psum, parg, thr, zsel, mass, out,
                               acc.view(torch.int8), V, chunk, nb, temperature,
                               FROM_LOGITS=from_logits, GREEDY=greedy, TOP_K=use_top_k,
                               TOP_P=use_top_p, Q_MAPPED=q_mapped, PHILOX=philox, NB_PAD=nb_pad,
                               BLOCK=block, num_warps=SPLIT_WARPS)


RADIX_MAX_CHUNKS = 128
RADIX_BLOCK = 32  # keys a step of a histogram program: a [BLOCK, 256] one-hot in registers


def _radix_select(x, pmax, psum, parg, thr, zsel, temperature, top_k, top_p, use_top_k,
                  use_top_p, chunk, nb, nb_pad):
    """Four histogram + select rounds for top-k, then four for top-p; fills thr and zsel."""
    R, V = x.shape
    dev = x.device
    prefix = torch.empty(R, dtype=torch.int64, device=dev)
    above = torch.empty(R, dtype=torch.int32, device=dev)
    above_mass = torch.empty(R, dtype=torch.float32, device=dev)
    cnt = torch.empty(R, nb, 256, dtype=torch.int32, device=dev)
    hmass = torch.empty(R, nb, 256, dtype=torch.float32, device=dev)
    tie = torch.empty(R, dtype=torch.int32, device=dev)
    tcnt = torch.empty(R, nb, dtype=torch.int32, device=dev)
    block = min(chunk, 256 if INTERPRET else RADIX_BLOCK)
    phases = ([False] if use_top_k else []) + ([True] if use_top_p else [])
    for phase_p in phases:
        for shift in (24, 16, 8, 0):
            # top-k needs masses only for the kept mass z; without top-p it takes them from
            # every round (the mass above the prefix), with top-p that phase measures z itself
            need_mass = phase_p or not use_top_p
            _radix_hist_kernel[(R, nb)](x, x.stride(0), pmax, psum, parg, prefix, thr, cnt,
                                        hmass, V, chunk, nb, temperature, SHIFT=shift,
                                        PHASE_P=phase_p, TOP_K=use_top_k, NEED_MASS=need_mass,
                                        NB_PAD=nb_pad, BLOCK=block, num_warps=SPLIT_WARPS)
            _radix_select_kernel[(R,)](pmax, psum, parg, cnt, hmass, prefix, above, above_mass,
                                       thr, zsel, tie, nb, int(top_k), top_p_float32(top_p),
                                       SHIFT=shift, PHASE_P=phase_p, TOP_K=use_top_k,
                                       NEED_MASS=need_mass, NB_PAD=nb_pad,
                                       num_warps=SPLIT_WARPS)
        # the id that cuts the tie group at the threshold (thr[:, slot + 1])
        slot = 2 if phase_p else 0
        tblock = _split_block(chunk)
        _tie_count_kernel[(R, nb)](x, x.stride(0), thr, tcnt, V, chunk, nb, temperature,
                                   SLOT=slot, BLOCK=tblock, num_warps=SPLIT_WARPS)
        _tie_pick_kernel[(R,)](x, x.stride(0), thr, tcnt, tie, V, chunk, nb, temperature,
                               SLOT=slot, NB_PAD=nb_pad, BLOCK=tblock, num_warps=SPLIT_WARPS)
