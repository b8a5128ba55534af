"""The @triton.jit helpers the rejection-sampling kernels share (the probs and logits kernels of
the one-program plan, and the split-row plan): p and q of a chunk, the accept test, the
inverse-CDF walk and the whole-row residual draw, the uniforms.

FROM_LOGITS / Q_MAPPED say where p and q come from: False for rejection_sample (both given on
target ids; the logits statistics mx, amax, ck, ci, z and t2d_ptr are then not read), True for
rejection_sample_logits (p from the logits, q on the draft vocabulary through t2d).

The logits statistics follow the rules of spd_kernels.sampling (its module docstring): mx is the
largest non-NaN x, amax the argmax in torch.argmax's order (a NaN first); the kept set is
{key > ck} + {key == ck, id <= ci} (the first tokens of the total order "x descending, lower id
first"); z == 0 marks a row whose argmax is NaN or +-inf (or every x is -inf), whose p is the
one-hot of amax."""
from __future__ import annotations

from spd_kernels._triton import HAS_TRITON, tl, triton

if HAS_TRITON:
    from triton.language.random import uint_to_uniform_float

    from spd_kernels._triton import float_key

if HAS_TRITON:

    @triton.jit
    def _q_chunk(q_row, t2d_ptr, offs, mask, Q_MAPPED: tl.constexpr):
        if Q_MAPPED:
            col = tl.load(t2d_ptr + offs, mask=mask, other=-1)
            q = tl.load(q_row + col, mask=mask & (col >= 0), other=0.0).to(tl.float32)
        else:
            q = tl.load(q_row + offs, mask=mask, other=0.0).to(tl.float32)
        return q

    @triton.jit
    def _x_chunk(x_row, offs, mask, temperature, GREEDY: tl.constexpr):
        lg = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if GREEDY:
            return lg
        else:
            return tl.div_rn(lg, temperature)  # IEEE division: GPU "/" is approximate

    @triton.jit
    def _in_set(key, offs, ck, ci):
        """Whether a token is among the first of the total order up to (ck, ci): key > ck, or
        key == ck and id <= ci."""
        return (key > ck) | ((key == ck) & (offs <= ci))

    @triton.jit
    def _p_chunk(x_row, offs, mask, temperature, mx, amax, ck, ci, z,
                 FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
                 TOP_P: tl.constexpr):
        """The target probabilities p of a chunk (0 outside the row): the kept set is
        _in_set(ck, ci) with top-k or top-p; z == 0: the one-hot of amax (NaN / inf rows)."""
        if FROM_LOGITS:
            one_hot = tl.where(mask & (offs == amax), 1.0, 0.0)
            if GREEDY:
                p = one_hot
            else:
                x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
                keep = mask
                if TOP_K or TOP_P:
                    keep = keep & _in_set(float_key(x), offs, ck, ci)
                p = tl.where(keep, tl.exp(x - mx) / z, 0.0)
                p = tl.where(z == 0.0, one_hot, p)
        else:
            p = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        return p

    @triton.jit
    def _online_max(x, offs, mx, amax, z, nan_i, GREEDY: tl.constexpr):
        """One chunk into the running (max of the non-NaN x, its first index, sum exp(x - max),
        first NaN index or 2^31 - 1). A chunk of -inf adds nothing (no -inf - -inf = NaN)."""
        isnan = x != x
        nan_i = tl.minimum(nan_i, tl.min(tl.where(isnan, offs, 2147483647), axis=0))
        x = tl.where(isnan, float("-inf"), x)
        cm = tl.max(x, axis=0)
        ci = tl.min(tl.where(x == cm, offs, 2147483647), axis=0)
        amax = tl.where(cm > mx, ci, amax)
        new_mx = tl.maximum(mx, cm)
        if not GREEDY:
            scale = tl.where(mx == float("-inf"), 0.0, tl.exp(mx - new_mx))
            add = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - new_mx)), axis=0)
            z = z * scale + add
        return new_mx, amax, z, nan_i

    @triton.jit
    def _degenerate(mx, amax, z, nan_i):
        """The rule for rows whose argmax is not finite: amax moves to the first NaN, z to 0
        (p is then the one-hot of amax); an all -inf row keeps amax 0."""
        deg = (nan_i < 2147483647) | (mx == float("inf")) | (mx == float("-inf"))
        amax = tl.where(nan_i < 2147483647, nan_i, amax)
        amax = tl.where(amax == 2147483647, 0, amax)
        return tl.where(deg, 0.0, z), amax, deg

    @triton.jit
    def _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax, ck, ci, z, u_ptr,
               stride_u, seed_ptr, offset_ptr, FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr,
               TOP_K: tl.constexpr, TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr,
               PHILOX: tl.constexpr):
        """Row r's drafted token, whether it is accepted (u0 * q(x) < p(x)), and u1."""
        tok = tl.load(tok_ptr + r).to(tl.int64)
        valid = (tok >= 0) & (tok < V)
        tokc = tl.minimum(tl.maximum(tok, 0), V - 1)
        one = tl.arange(0, 1)
        px = tl.sum(_p_chunk(x_row, tokc + one, one < 1, temperature, mx, amax, ck, ci, z,
                             FROM_LOGITS, GREEDY, TOP_K, TOP_P), axis=0)
        px = tl.where(valid, px, 0.0)
        qx = tl.sum(_q_chunk(q_row, t2d_ptr, tokc + one, one < 1, Q_MAPPED), axis=0)
        u0, u1 = _row_uniforms(r, u_ptr, stride_u, seed_ptr, offset_ptr, PHILOX)
        return tok, u0 * qx < px, u1

    @triton.jit
    def _walk(x_row, q_row, t2d_ptr, lo, hi, goal, carry, use_p, temperature, mx, amax, ck, ci,
              z, FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
              TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr, BLOCK: tl.constexpr):
        """Inverse CDF over [lo, hi) of w = p (use_p) or max(p - q, 0), starting at mass carry:
        the first index whose running mass exceeds goal and that has mass, and the last index
        with mass (the clamp against rounding at the top end); hi when none."""
        found = tl.zeros([], dtype=tl.int64) + hi
        last = tl.zeros([], dtype=tl.int64)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, ck, ci, z, FROM_LOGITS, GREEDY,
                         TOP_K, TOP_P)
            q = _q_chunk(q_row, t2d_ptr, offs, mask, Q_MAPPED)
            w = tl.where(use_p, p, tl.maximum(p - q, 0.0))
            cdf = carry + tl.cumsum(w, axis=0)
            hit = mask & (cdf > goal) & (w > 0.0)
            found = tl.minimum(found, tl.min(tl.where(hit, offs, hi), axis=0).to(tl.int64))
            last = tl.maximum(last, tl.max(tl.where(w > 0.0, offs, 0), axis=0).to(tl.int64))
            carry += tl.sum(w, axis=0)
        return found, last

    @triton.jit
    def _draw_residual(x_row, q_row, t2d_ptr, V, u1, temperature, mx, amax, ck, ci, z,
                       FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
                       TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr, BLOCK: tl.constexpr):
        """The draw on rejection by one program over the whole row: inverse CDF at u1 of
        max(p - q, 0), or of p itself when that is empty (p <= q everywhere)."""
        s_res = tl.zeros([], dtype=tl.float32)
        s_p = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, ck, ci, z, FROM_LOGITS, GREEDY,
                         TOP_K, TOP_P)
            q = _q_chunk(q_row, t2d_ptr, offs, mask, Q_MAPPED)
            s_res += tl.sum(tl.maximum(p - q, 0.0), axis=0)
            s_p += tl.sum(p, axis=0)
        use_p = s_res <= 0.0
        total = tl.where(use_p, s_p, s_res)
        # First index whose running mass exceeds u1 * total, clamped to the last index with mass
        # (guards the top end against rounding), as sample_from_probs does.
        carry = tl.zeros([], dtype=tl.float32)
        found, last = _walk(x_row, q_row, t2d_ptr, 0, V, u1 * total, carry, use_p, temperature,
                            mx, amax, ck, ci, z, FROM_LOGITS, GREEDY, TOP_K, TOP_P, Q_MAPPED,
                            BLOCK)
        return tl.minimum(found, last)

    @triton.jit
    def _given_p_stats():
        """Placeholders for the logits statistics (temperature, mx, amax, ck, ci, z) that the
        helpers take but do not read when p is given (FROM_LOGITS False)."""
        f = tl.zeros([], dtype=tl.float32)
        i = tl.zeros([], dtype=tl.int32)
        return f + 1.0, f, i, i, i, f + 1.0

    @triton.jit
    def _row_uniforms(r, u_ptr, stride_u, seed_ptr, offset_ptr, PHILOX: tl.constexpr):
        """Row r's two uniforms (accept test, residual draw): given, or Philox(seed, offset + r)."""
        if PHILOX:
            seed = tl.load(seed_ptr)
            offset = tl.load(offset_ptr) + r
            c0, c1, _, _ = tl.randint4x(seed, offset + tl.arange(0, 1))
            u0 = tl.sum(uint_to_uniform_float(c0), axis=0)
            u1 = tl.sum(uint_to_uniform_float(c1), axis=0)
        else:
            u0 = tl.load(u_ptr + r * stride_u).to(tl.float32)
            u1 = tl.load(u_ptr + r * stride_u + 1).to(tl.float32)
        return u0, u1

    @triton.jit
    def _masked_exp_sum(x_row, V, temperature, mx, ck, ci, lo_key, GREEDY: tl.constexpr,
                        IN_SET: tl.constexpr, BLOCK: tl.constexpr):
        """sum of exp(x - mx) over the tokens whose key exceeds lo_key (int64), and with IN_SET
        that are in _in_set(ck, ci)."""
        s = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
            key = float_key(x)
            keep = mask & (key.to(tl.int64) > lo_key)
            if IN_SET:
                keep = keep & _in_set(key, offs, ck, ci)
            s += tl.sum(tl.where(keep, tl.exp(x - mx), 0.0), axis=0)
        return s

    @triton.jit
    def _key_counts(x_row, lo, hi, temperature, key_c, BLOCK: tl.constexpr):
        """Over [lo, hi): how many keys exceed key_c, how many equal it."""
        gt = tl.zeros([], dtype=tl.int32)
        eq = tl.zeros([], dtype=tl.int32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            key = float_key(_x_chunk(x_row, offs, mask, temperature, False))
            gt += tl.sum((mask & (key > key_c)).to(tl.int32), axis=0)
            eq += tl.sum((mask & (key == key_c)).to(tl.int32), axis=0)
        return gt, eq

    @triton.jit
    def _nth_tied_id(x_row, lo, hi, temperature, key_c, m, carry, BLOCK: tl.constexpr):
        """The id of the m-th token (from 1, in id order, `carry` of them before lo) whose key
        is key_c, over [lo, hi); 2^31 - 1 when there is none."""
        found = tl.zeros([], dtype=tl.int32) + 2147483647
        carry = tl.zeros([], dtype=tl.int32) + carry  # a tensor: a literal 0 cannot be carried
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            tie = mask & (float_key(_x_chunk(x_row, offs, mask, temperature, False)) == key_c)
            cnt = carry + tl.cumsum(tie.to(tl.int32), axis=0)
            found = tl.minimum(found, tl.min(tl.where(tie & (cnt == m), offs, 2147483647),
                                             axis=0))
            carry += tl.sum(tie.to(tl.int32), axis=0)
        return found

    @triton.jit
    def _key_value(key):
        """The fp32 value of a float_key."""
        bits = tl.where(key < 0, key ^ 0x7FFFFFFF, key)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _tie_keep(s, w, bound, n):
        """How many of the n tokens of the tie group at the top-p cut are kept (at least 1):
        token j is dropped iff s + j * w >= bound, in float64 (spd_kernels.sampling's rule 3;
        j * w is exact there, so fused or not the sum rounds once)."""
        s64 = s.to(tl.float64)
        w64 = w.to(tl.float64)
        nf = n.to(tl.float64)
        est = tl.where(w64 > 0.0, (bound - s64) / tl.where(w64 > 0.0, w64, 1.0), nf)
        est = tl.minimum(tl.maximum(est, 1.0), nf)
        est = tl.where(est == est, est, 1.0)
        c = est.to(tl.int32)
        for _ in range(2):
            c = tl.where((c < n) & (s64 + c.to(tl.float64) * w64 < bound), c + 1, c)
        for _ in range(2):
            c = tl.where((c > 1) & (s64 + (c - 1).to(tl.float64) * w64 >= bound), c - 1, c)
        return c
