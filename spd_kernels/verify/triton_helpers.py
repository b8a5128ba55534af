"""The @triton.jit helpers the rejection-sampling kernels share (the probs and logits kernels of
the one-program plan, and the split-row plan): p and q of a chunk, the accept test, the
inverse-CDF walk and the whole-row residual draw, the uniforms.

FROM_LOGITS / Q_MAPPED say where p and q come from: False for rejection_sample (both given on
target ids; the logits statistics mx, amax, tk, tp, z and t2d_ptr are then not read), True for
rejection_sample_logits (p from the logits, q on the draft vocabulary through t2d)."""
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
    def _p_chunk(x_row, offs, mask, temperature, mx, amax, tk, tp, z,
                 FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
                 TOP_P: tl.constexpr):
        """The target probabilities p of a chunk (0 outside the row)."""
        if FROM_LOGITS:
            if GREEDY:
                p = tl.where(mask & (offs == amax), 1.0, 0.0)
            else:
                x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
                keep = mask
                if TOP_K:
                    keep = keep & (float_key(x) >= tk)
                if TOP_P:
                    keep = keep & (float_key(x) >= tp)
                p = tl.where(keep, tl.exp(x - mx) / z, 0.0)
        else:
            p = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        return p

    @triton.jit
    def _online_max(x, offs, mx, amax, z, GREEDY: tl.constexpr):
        """One chunk into the running (max, first argmax, sum exp(x - max))."""
        cm = tl.max(x, axis=0)
        ci = tl.min(tl.where(x == cm, offs, 2147483647), axis=0)
        amax = tl.where(cm > mx, ci, amax)
        new_mx = tl.maximum(mx, cm)
        if not GREEDY:
            z = z * tl.exp(mx - new_mx) + tl.sum(tl.exp(x - new_mx), axis=0)
        return new_mx, amax, z

    @triton.jit
    def _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax, tk, tp, z, u_ptr,
               stride_u, seed_ptr, offset_ptr, FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr,
               TOP_K: tl.constexpr, TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr,
               PHILOX: tl.constexpr):
        """Row r's drafted token, whether it is accepted (u0 * q(x) < p(x)), and u1."""
        tok = tl.load(tok_ptr + r).to(tl.int64)
        valid = (tok >= 0) & (tok < V)
        tokc = tl.minimum(tl.maximum(tok, 0), V - 1)
        one = tl.arange(0, 1)
        px = tl.sum(_p_chunk(x_row, tokc + one, one < 1, temperature, mx, amax, tk, tp, z,
                             FROM_LOGITS, GREEDY, TOP_K, TOP_P), axis=0)
        px = tl.where(valid, px, 0.0)
        qx = tl.sum(_q_chunk(q_row, t2d_ptr, tokc + one, one < 1, Q_MAPPED), axis=0)
        u0, u1 = _row_uniforms(r, u_ptr, stride_u, seed_ptr, offset_ptr, PHILOX)
        return tok, u0 * qx < px, u1

    @triton.jit
    def _walk(x_row, q_row, t2d_ptr, lo, hi, goal, carry, use_p, temperature, mx, amax, tk, tp,
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
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, tk, tp, z, FROM_LOGITS, GREEDY,
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
    def _draw_residual(x_row, q_row, t2d_ptr, V, u1, temperature, mx, amax, tk, tp, z,
                       FROM_LOGITS: tl.constexpr, GREEDY: tl.constexpr, TOP_K: tl.constexpr,
                       TOP_P: tl.constexpr, Q_MAPPED: tl.constexpr, BLOCK: tl.constexpr):
        """The draw on rejection by one program over the whole row: inverse CDF at u1 of
        max(p - q, 0), or of p itself when that is empty (p <= q everywhere)."""
        s_res = tl.zeros([], dtype=tl.float32)
        s_p = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, tk, tp, z, FROM_LOGITS, GREEDY,
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
                            mx, amax, tk, tp, z, FROM_LOGITS, GREEDY, TOP_K, TOP_P, Q_MAPPED,
                            BLOCK)
        return tl.minimum(found, last)

    @triton.jit
    def _given_p_stats():
        """Placeholders for the logits statistics (temperature, mx, amax, tk, tp, z) that the
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
    def _masked_exp_sum(x_row, V, temperature, mx, tk, lo_key, GREEDY: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        """sum of exp(x - mx) over kept tokens whose key exceeds lo_key (int64)."""
        s = tl.zeros([], dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < V
            x = _x_chunk(x_row, offs, mask, temperature, GREEDY)
            key = float_key(x)
            keep = mask & (key.to(tl.int64) > lo_key)
            if TOP_K:
                keep = keep & (key >= tk)
            s += tl.sum(tl.where(keep, tl.exp(x - mx), 0.0), axis=0)
        return s
