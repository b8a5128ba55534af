"""spd_kernels.tree_control on Triton: one program a sequence (and, for tree_open, one a window
row).

As spd_kernels.control_triton's: each kernel is its reference's scalar logic read as one
program, the rows of a position (lanes) a vector, every choice a select, the writes in the
reference's order. A sort is a rank (an element's place: those before it in the order, counted),
a gather by a computed lane a select summed over the lanes. Where one program writes an address
that it, or another of its threads, then reads or writes again (the lanes' rows that the
accepted row's survivors and the entering rows share, the trash row written several times, a
shifted unit), a barrier between keeps the reference's order; where one store would write an
address twice (the dead rows all go to the trash row), its last writer alone writes, as
index_copy_'s last index wins.

The float outputs are exact: a child's score is one float32 add of its leaf's and its
log-probability, the lookup's its leaf's and log_trust's (the op takes the logs, so that no
transcendental runs here), then selects. NaN scores (in `top` or the lanes' scores) are not
supported: the ranks compare with > and ==, which NaN fails, where torch's sort puts it first.
"""
from __future__ import annotations

from spd_kernels import control, dispatch, tree_control
from spd_kernels._triton import HAS_TRITON, INTERPRET, next_pow2, tl, triton
from spd_kernels.control import LOOKUP_MAX, STATE, UNIT
from spd_kernels.control_triton import draw_args
from spd_kernels.tree_control import KID, TPLAN

ROW_BLOCK = 1024 if not INTERPRET else 4096  # elements a row copy moves per step

if HAS_TRITON:
    # the fields' indices as constants (a compiled kernel reads no other global): the state's
    # and the constants' as the chain's kernels bind them
    from spd_kernels.control_triton import (  # noqa: F401 (the kernels read them)
        COMMITTED,
        CYCLE,
        DONE,
        EMITTED,
        END_CYCLE,
        GREEDY,
        KEY,
        LIVE,
        LOOKUP_ACCEPTED,
        LOOKUP_JUDGED,
        LOOKUP_MIN,
        MAX_NEW,
        NEWEST,
        POS,
        STAGE_ROWS,
        TOKEN,
        TRASH,
        K,
        N,
        commit_state,
        draw_uniforms,
        shift_units,
    )
    END, PREFIX, CPOS, CSLOT = map(tl.constexpr, (
        control.END, control.PREFIX, control.CPOS, control.CSLOT))
    (T_COMMITTED, T_NEWEST, T_LIVE, T_FULL, T_FINAL, T_W0, T_LAST, T_BEST, T_FOUND,
     T_LENGTH) = map(tl.constexpr, (
         tree_control.T_COMMITTED, tree_control.T_NEWEST, tree_control.T_LIVE,
         tree_control.T_FULL, tree_control.T_FINAL, tree_control.T_W0, tree_control.T_LAST,
         tree_control.T_BEST, tree_control.T_FOUND, tree_control.T_LENGTH))
    K_TOK, K_PAR, K_ALIVE, K_LOOK = map(tl.constexpr, (
        tree_control.K_TOK, tree_control.K_PAR, tree_control.K_ALIVE, tree_control.K_LOOK))
    K_ANC = tl.constexpr(len(KID))  # (kids' anc [R] follow KID's fields)

    @triton.jit
    def _ring(x, R: tl.constexpr):
        """x mod R as torch's % (never negative): a position's row in the lanes."""
        return (x % R + R) % R

    @triton.jit
    def _context(tb, ltok, branch, q, start, w0, last, Lc, ok, R: tl.constexpr,
                 W: tl.constexpr):
        """The lookup's context at positions q (a scalar or a vector; `ok` masks the loads):
        the committed tokens, overlaid with the best leaf's branch at the positions in flight
        (start < q <= newest, in the window): the lane `branch` [R] (L_anc's row of the
        window's last position, at the best leaf) names at Lc - (q - w0) positions back."""
        o = q - w0
        over = (q > start) & (o >= 0) & (o <= last) & ok
        lane = tl.load(branch + tl.maximum(Lc - o, 0), mask=over, other=0)
        mine = tl.load(ltok + _ring(q, R) * W + lane, mask=over, other=0)
        return tl.where(over, mine, tl.load(tb + q, mask=ok & (over == 0), other=0))

    @triton.jit
    def _open_kernel(state, s_b, units, u_b, u_n, consts, c_b, l_tok, l_alive, l_score, l_b,
                     l_anc, la_b, l_clane, lc_b, tokens, t_b, C, anchors, a_b, a_m, a_c,
                     window, w_b, w_m, w_k, d, tod, tplan, p_b, mask, m_b, m_r, draws, dr_b, D,
                     NS: tl.constexpr, W: tl.constexpr, EXTRA: tl.constexpr,
                     MAXL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                     BLOCK_RW: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_D: tl.constexpr, HEAD: tl.constexpr, HAS_DRAWS: tl.constexpr,
                     BLOCK_DR: tl.constexpr):
        """Program (b, 0): sequence b's tplan and mask; program (b, 1 + r): row r of its
        window's anchors."""
        R: tl.constexpr = NS + 1
        RW: tl.constexpr = (NS + 1) * W
        b = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        st = state + b * s_b
        committed = tl.load(st + COMMITTED)
        newest = tl.load(st + NEWEST)
        start = committed - 1
        final = start - tl.load(st + EMITTED)
        w0 = tl.maximum(tl.maximum(newest - NS, final), 0)
        trash = tl.load(consts + b * c_b + TRASH)
        capacity = trash - R * W  # (the tree slots: the R W rows before the trash row)
        if which == 0:
            live = tl.load(st + DONE) == 0
            lmin = tl.load(consts + b * c_b + LOOKUP_MIN)
            pl = tplan + b * p_b
            # where each stage's rows land: a live row's slot, or its position where it was
            # committed since its unit was sent, else trash
            k = tl.arange(0, BLOCK_N)
            kin = k < NS
            ub = units + b * u_b + k * u_n
            upos = tl.load(ub + POS, mask=kin, other=0)
            ulive = (tl.load(ub + LIVE, mask=kin, other=0) == 1) & live & kin
            occ = tl.where(ulive, upos, -1)
            full = tl.sum(tl.where(k == NS - 1, occ, 0), axis=0) >= 0
            lw = tl.arange(0, BLOCK_W)
            win = lw < W
            ur = _ring(upos, R)
            grid = kin[:, None] & win[None, :]
            u_alive = (tl.load(l_alive + b * l_b + ur[:, None] * W + lw[None, :], mask=grid,
                               other=0) != 0) & ulive[:, None]
            clane = tl.load(l_clane + b * lc_b + ur, mask=kin, other=-1)
            at_pos = (upos < committed)[:, None] & (lw[None, :] == clane[:, None])
            rows = tl.where(u_alive, tl.where(at_pos, upos[:, None],
                                              capacity + ur[:, None] * W + lw[None, :]), trash)
            tl.store(pl + HEAD + k[:, None] * W + lw[None, :], rows, mask=grid)
            # the window: R positions from w0, W rows each (a = offset * W + lane); a row's
            # depth is NS below the rows in flight, else its stage's
            a = tl.arange(0, BLOCK_RW)
            ain = a < RW
            o = a // W
            lane = a % W
            pos = w0 + o
            at = (occ[None, :] == pos[:, None]) & kin[None, :]
            depth = tl.where(pos < start, NS, tl.sum(tl.where(at, k[None, :], 0), axis=1))
            types = tl.load(tod + tl.minimum(depth + EXTRA, NS), mask=ain, other=0)
            last = tl.minimum(tl.maximum(newest - w0, 0), NS)  # (a finished one's: in range)
            rw = _ring(pos, R)
            crow = pos <= start  # committed: lane 0 alone, its ancestors too
            alive = tl.where(crow, lane == 0,
                             tl.load(l_alive + b * l_b + rw * W + lane, mask=ain, other=0) != 0)
            alive = alive & (pos <= newest) & ain
            buf = tl.where(alive, tl.where(crow, pos, capacity + rw * W + lane), trash)
            pdm = tl.where(alive, tl.where(crow, pos, capacity + o * W + lane), trash)
            at_w = pl + HEAD + NS * W
            tl.store(at_w + a, pos, mask=ain)
            tl.store(at_w + RW + a, types, mask=ain)
            tl.store(at_w + 2 * RW + a, buf, mask=ain)
            tl.store(at_w + 3 * RW + a, pdm, mask=ain)
            tl.store(at_w + 4 * RW + lw, last * W + lw, mask=win)
            # the mask: row a sees column c (offset k', lane l') where its ancestor k' - o back
            # is l' and both live; every row sees itself
            grid2 = ain[:, None] & ain[None, :]
            back = tl.maximum(o[:, None] - o[None, :], 0)
            anc = tl.load(l_anc + b * la_b + rw[:, None] * (W * R) + lane[:, None] * R + back,
                          mask=grid2, other=0)
            anc = tl.where(crow[None, :], 0, anc)
            seen = ((o[None, :] <= o[:, None]) & (anc == lane[None, :]) & alive[:, None]
                    & alive[None, :]) | (a[:, None] == a[None, :])
            tl.store(mask + b * m_b + a[:, None] * m_r + a[None, :], seen, mask=grid2)
            # the best leaf: the newest position's most probable live row (the first of equals)
            r_new = _ring(newest, R)
            la = tl.where(newest <= start, lw == 0,
                          tl.load(l_alive + b * l_b + r_new * W + lw, mask=win, other=0) != 0)
            base = tl.where(newest > start,
                            tl.load(l_score + b * l_b + r_new * W + lw, mask=win, other=0.0), 0.0)
            base = tl.where(la & win, base, float("-inf"))
            top = tl.max(base, axis=0)
            best = tl.min(tl.where(win & (base == top), lw, BLOCK_W), axis=0).to(tl.int64)
            # the context lookup, as cycle_open's, on the committed tokens overlaid with the
            # best leaf's branch (read through, never copied). Only the context's end (`newest`
            # back) and the found token's row (<= start) can be in the overlay: an earlier
            # occurrence ends before start. (The reference's overlay writes its dead rows to the
            # trash row, past every position read here.)
            tb = tokens + b * t_b
            ltok = l_tok + b * l_b
            Lc = tl.minimum(tl.maximum(last, 0), NS)
            branch = l_anc + b * la_b + _ring(w0 + Lc, R) * (W * R) + best * R
            lv = tl.arange(0, BLOCK_L)
            ends = _context(tb, ltok, branch, tl.maximum(newest - lv, 0), start, w0, last, Lc,
                            lv < MAXL, R, W)
            found_at = tl.full([BLOCK_L], -1, tl.int64)
            for j0 in range(0, C, BLOCK_C):
                j = j0 + tl.arange(0, BLOCK_C).to(tl.int64)
                run = j < C
                for i in tl.static_range(MAXL):
                    here = tl.load(tb + tl.maximum(j - i, 0), mask=j < C, other=-1)
                    run = run & (here == tl.sum(tl.where(lv == i, ends, 0), axis=0))
                    ok = run & (j + 1 < committed) & (j >= i)
                    latest = tl.max(tl.where(ok, j, -1), axis=0)
                    found_at = tl.where(lv == i, tl.maximum(found_at, latest), found_at)
            held = tl.minimum(committed, MAXL) + newest + 1 - committed
            kk = lv + 1
            usable = (found_at >= 0) & (kk >= lmin) & (kk <= held) & (lv < MAXL)
            length = tl.max(tl.where(usable, kk, 0), axis=0)
            end = tl.sum(tl.where(lv == tl.maximum(length - 1, 0), found_at, 0), axis=0)
            at_end = tl.minimum(end + 1, C - 1)
            found = _context(tb, ltok, branch, at_end, start, w0, last, Lc, at_end >= 0, R, W)
            on = lmin != 0
            tl.store(pl + T_COMMITTED, committed)
            tl.store(pl + T_NEWEST, newest)
            tl.store(pl + T_LIVE, live.to(tl.int64))
            tl.store(pl + T_FULL, full.to(tl.int64))
            tl.store(pl + T_FINAL, final)
            tl.store(pl + T_W0, w0)
            tl.store(pl + T_LAST, last)
            tl.store(pl + T_BEST, best)
            tl.store(pl + T_FOUND, tl.where(on, found, 0))
            tl.store(pl + T_LENGTH, tl.where(on, length, 0))
            if HAS_DRAWS:
                draw_uniforms(draws, dr_b, D, b, st, tl.load(consts + b * c_b + KEY), BLOCK_DR)
        else:  # (names of their own: a name both branches set must be of one type)
            row = (which - 1) % RW
            r_m = (which - 1) // RW
            r_pos = w0 + row // W
            r_lane = row % W
            r_rw = _ring(r_pos, R)
            r_crow = r_pos <= start
            r_alive = tl.where(r_crow, r_lane == 0,
                               tl.load(l_alive + b * l_b + r_rw * W + r_lane) != 0)
            r_alive = r_alive & (r_pos <= newest)
            r_buf = tl.where(r_alive, tl.where(r_crow, r_pos, capacity + r_rw * W + r_lane),
                             trash)
            src = anchors + b * a_b + r_m * a_m + r_buf * a_c
            dst = window + b * w_b + r_m * w_m + row * w_k
            for c0 in range(0, d, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                tl.store(dst + cols, tl.load(src + cols, mask=cols < d), mask=cols < d)

    @triton.jit
    def _children_kernel(tplan, p_b, l_tok, l_alive, l_look, l_score, l_b, l_anc, la_b, l_fill,
                         lf_b, top, tp_b, tp_w, top_ids, ti_b, ti_w, pmax, pm_b, trust,
                         log_trust, kids, k_b, k_w, kid_score, ks_b, judge, j_b, final, f_b,
                         f_c, hidden, h_b, d, NS: tl.constexpr, W: tl.constexpr,
                         KC: tl.constexpr, HAS_FINAL: tl.constexpr, BLOCK_W: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        R: tl.constexpr = NS + 1
        S: tl.constexpr = 1 + W * KC
        b = tl.program_id(0).to(tl.int64)
        pl = tplan + b * p_b
        committed = tl.load(pl + T_COMMITTED)
        newest = tl.load(pl + T_NEWEST)
        best = tl.load(pl + T_BEST)
        length = tl.load(pl + T_LENGTH)
        found = tl.load(pl + T_FOUND)
        start = committed - 1
        lrow = l_b * b + _ring(newest, R) * W  # the leaves' row
        # every leaf's KC children (element i = 1 + leaf * KC + c), the lookup's first (i = 0)
        i = tl.arange(0, BLOCK_S)
        iin = i < S
        child = (i >= 1) & iin
        q = tl.maximum(i - 1, 0)
        par = q // KC
        la = tl.where(newest <= start, par == 0,
                      tl.load(l_alive + lrow + par, mask=child, other=0) != 0)
        base = tl.where(newest > start, tl.load(l_score + lrow + par, mask=child, other=0.0), 0.0)
        tp = tl.load(top + b * tp_b + par * tp_w + q % KC, mask=child, other=0.0)
        score = tl.where(la, base + tp, float("-inf"))
        tok = tl.load(top_ids + b * ti_b + par * ti_w + q % KC, mask=child, other=0)
        # the lookup's token at its trust, at the best leaf's score plus log_trust
        la_best = tl.where(newest <= start, best == 0, tl.load(l_alive + lrow + best) != 0)
        base_best = tl.where(la_best, tl.where(newest > start, tl.load(l_score + lrow + best),
                                               0.0), float("-inf"))
        trusted = tl.load(trust + length)
        use = (length > 0) & ((trusted >= 1.0) | (tl.load(pmax + b * pm_b + best) < trusted))
        look_score = tl.where(use, base_best + tl.load(log_trust + length), float("-inf"))
        score = tl.where(use & (par == best) & (tok == found), float("-inf"), score)
        score = tl.where(i == 0, look_score, score)
        tok = tl.where(i == 0, found, tok)
        par = tl.where(i == 0, best, par)
        # torch.sort(descending, stable): an element's rank is the number of those greater,
        # then of the earlier equal ones (-inf among them)
        ahead = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None])
                                                     & (i[None, :] < i[:, None]))
        rank = tl.sum((ahead & iin[None, :]).to(tl.int32), axis=1)
        r = tl.arange(0, BLOCK_W)
        rin = r < W
        sel = (rank[None, :] == r[:, None]) & iin[None, :]  # [W, S]: the r-th best
        order = tl.sum(tl.where(sel, i[None, :], 0), axis=1)
        k_score = tl.max(tl.where(sel, score[None, :], float("-inf")), axis=1)
        k_tok = tl.sum(tl.where(sel, tok[None, :], 0), axis=1)
        k_par = tl.sum(tl.where(sel, par[None, :], 0), axis=1)
        alive = k_score > float("-inf")
        look = order == 0
        kb = kids + b * k_b + r * k_w
        tl.store(kb + K_TOK, k_tok, mask=rin)
        tl.store(kb + K_PAR, k_par, mask=rin)
        tl.store(kb + K_ALIVE, alive.to(tl.int64), mask=rin)
        tl.store(kb + K_LOOK, look.to(tl.int64), mask=rin)
        # each child's ancestors: itself, then its leaf's
        col = tl.arange(0, BLOCK_R)
        grid = rin[:, None] & (col < R)[None, :]
        anc = tl.load(l_anc + la_b * b + _ring(newest, R) * (W * R) + k_par[:, None] * R
                      + col[None, :] - 1, mask=grid & (col >= 1)[None, :], other=0)
        anc = tl.where(col[None, :] == 0, r[:, None].to(tl.int64), anc)
        tl.store(kb[:, None] + K_ANC + col[None, :], anc, mask=grid)
        tl.store(kid_score + b * ks_b + r, k_score, mask=rin)
        # the judged position's candidates: its rows in flight, or after a gap the children
        rj = _ring(committed, R)
        in_flight = committed <= newest
        jrow = l_b * b + rj * W + r
        c_tok = tl.where(in_flight, tl.load(l_tok + jrow, mask=rin, other=0), k_tok)
        c_alive = tl.where(in_flight, tl.load(l_alive + jrow, mask=rin, other=0) != 0,
                           alive) & rin
        c_look = tl.where(in_flight, tl.load(l_look + jrow, mask=rin, other=0) != 0, look)
        fill = tl.where(in_flight, tl.load(l_fill + lf_b * b + rj), newest - start + 1)
        # the verifier's order (a stable sort of ~alive: the live rows, then the dead, each in
        # lane order) and the candidates in it, a token live earlier repeated: -1
        dead = (c_alive == 0).to(tl.int32)
        ahead = (dead[None, :] < dead[:, None]) | ((dead[None, :] == dead[:, None])
                                                   & (r[None, :] < r[:, None]))
        place = tl.sum((ahead & rin[None, :]).to(tl.int32), axis=1)
        sel = (place[None, :] == r[:, None]) & rin[None, :]
        by = tl.sum(tl.where(sel, r[None, :], 0), axis=1)
        tok_o = tl.sum(tl.where(sel, c_tok[None, :], 0), axis=1)
        live_o = tl.sum(tl.where(sel, c_alive[None, :].to(tl.int32), 0), axis=1) > 0
        repeat = tl.sum(((tok_o[None, :] == tok_o[:, None]) & live_o[None, :]
                         & (r[None, :] < r[:, None]) & rin[None, :]).to(tl.int32), axis=1) > 0
        cands = tl.where(live_o & (repeat == 0), tok_o, -1)
        jb = judge + b * j_b
        tl.store(jb, fill)
        tl.store(jb + 1 + r, c_tok, mask=rin)
        tl.store(jb + 1 + W + r, c_alive.to(tl.int64), mask=rin)
        tl.store(jb + 1 + 2 * W + r, c_look.to(tl.int64), mask=rin)
        tl.store(jb + 1 + 3 * W + r, cands, mask=rin)
        tl.store(jb + 1 + 4 * W + r, by.to(tl.int64), mask=rin)
        if HAS_FINAL:
            src = final + b * f_b + tl.maximum(start, 0) * f_c
            for c0 in range(0, d, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                tl.store(hidden + b * h_b + cols, tl.load(src + cols, mask=cols < d),
                         mask=cols < d)

    @triton.jit
    def _commit_kernel(state, s_b, units, u_b, u_n, consts, c_b, tplan, p_b, kids, k_b, k_w,
                       kid_score, ks_b, judge, j_b, l_tok, l_par, l_score, l_alive, l_look, l_b,
                       l_anc, la_b, l_clane, l_fill, lc_b, tokens, t_b, anchors, a_b, a_m, a_c,
                       m, weight, w_v, d, stops, st_b, T, verdict, accepted, margin,
                       NS: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                       HAS_ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_NW: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr,
                       FIELDS: tl.constexpr, UH: tl.constexpr):
        R: tl.constexpr = NS + 1
        b = tl.program_id(0).to(tl.int64)
        st = state + b * s_b
        pl = tplan + b * p_b
        jb = judge + b * j_b
        kb = kids + b * k_b
        trash = tl.load(consts + b * c_b + TRASH)
        capacity = trash - R * W  # (the tree slots: the R W rows before the trash row)
        max_new = tl.load(consts + b * c_b + MAX_NEW)
        lookup = tl.load(consts + b * c_b + LOOKUP_MIN) > 0
        committed = tl.load(pl + T_COMMITTED)
        newest = tl.load(pl + T_NEWEST)
        live = tl.load(pl + T_LIVE) == 1
        full = (tl.load(pl + T_FULL) == 1) & live
        j = committed
        rj = _ring(j, R)
        count = newest - committed + 2
        in_flight = j <= newest
        w = tl.arange(0, BLOCK_W)
        win = w < W
        first = w == 0
        c_tok = tl.load(jb + 1 + w, mask=win, other=0)
        c_alive = (tl.load(jb + 1 + W + w, mask=win, other=0) == 1) & win
        c_look = (tl.load(jb + 1 + 2 * W + w, mask=win, other=0) == 1) & win
        # 3. the verdict: a greedy target's token against the live candidates (the first
        #    match), or the sampled one's accepted candidate
        token = tl.load(verdict + b)
        match = c_alive & (c_tok == token)
        ok = tl.sum(match.to(tl.int32), axis=0) > 0
        lane = tl.where(ok, tl.min(tl.where(match, w, BLOCK_W), axis=0), 0).to(tl.int64)
        if HAS_ACC:
            which = tl.load(accepted + b)
            sampled = tl.load(consts + b * c_b + GREEDY) == 0
            ok = tl.where(sampled, which >= 0, ok)
            lane = tl.where(sampled, tl.load(jb + 1 + 4 * W + tl.maximum(which, 0)), lane)
        ok = ok & full
        rejected = full & (ok == 0)
        acc_in = ok & in_flight
        acc_gap = ok & (in_flight == 0)
        made = tl.load(st + N) + full.to(tl.int64)
        t = tl.arange(0, BLOCK_T)
        stop = tl.sum(((tl.load(stops + b * st_b + t, mask=t < T, other=-1) == token)
                       & (t < T)).to(tl.int32), axis=0) > 0
        ended = full & (stop | (made + 1 >= max_new))
        going = live & (ended == 0)
        # 4. what survives an accepted row: its descendants at j + 1 + s, up to `keep`
        chosen = w == lane
        s = tl.arange(0, BLOCK_N)
        sin = s < NS - 1
        later = j + 1 + s
        rl = _ring(later, R)
        grid = sin[:, None] & win[None, :]
        was = tl.load(l_alive + l_b * b + rl[:, None] * W + w[None, :], mask=grid, other=0) != 0
        descends = tl.load(l_anc + la_b * b + rl[:, None] * (W * R) + w[None, :] * R
                           + (s + 1)[:, None], mask=grid, other=-1) == lane
        kept = was & descends & (later <= newest)[:, None] & grid
        any_kept = tl.sum(kept.to(tl.int32), axis=1) > 0
        keep = tl.where(acc_in, tl.max(tl.where(any_kept & sin, later, j), axis=0), newest)
        at_leaf = (s[:, None] == tl.maximum(newest - j - 1, 0)) & grid
        leaf = tl.where(newest == j, chosen,
                        tl.sum(tl.where(at_leaf, kept.to(tl.int32), 0), axis=0) > 0)
        ch = kb + w * k_w
        ch_tok = tl.load(ch + K_TOK, mask=win, other=0)
        ch_par = tl.load(ch + K_PAR, mask=win, other=0)
        ch_alive = tl.load(ch + K_ALIVE, mask=win, other=0) == 1
        ch_look = tl.load(ch + K_LOOK, mask=win, other=0) == 1
        leaf_of = tl.sum(tl.where((ch_par[:, None] == w[None, :]) & win[None, :],
                                  leaf[None, :].to(tl.int32), 0), axis=1) > 0
        child_ok = ch_alive & (leaf_of | (acc_in == 0)) & win
        any_child = tl.sum(child_ok.to(tl.int32), axis=0) > 0
        draft_in = going & ((full == 0) | (acc_in & (keep == newest))) & any_child
        commit_in = going & (rejected | acc_gap)
        enters = draft_in | commit_in
        new_newest = tl.where(draft_in, newest + 1,
                              tl.where(commit_in, j, tl.where(acc_in, keep, newest)))
        enter = tl.where(commit_in, j, tl.where(draft_in, newest + 1, new_newest + 1))
        e_tok = tl.where(commit_in, tl.where(first, token, 0), ch_tok)
        e_alive = tl.where(commit_in, first, child_ok) & enters & win
        re = _ring(enter, R)
        # the lanes: the accepted row alone at j and its survivors, then the entering rows
        # (at a position past `keep`: maybe one of those rows, so after them)
        tl.store(l_alive + l_b * b + rj * W + w, chosen, mask=win & acc_in)
        tl.store(l_clane + lc_b * b + rj, lane, mask=acc_in)
        tl.store(l_alive + l_b * b + rl[:, None] * W + w[None, :], kept, mask=grid & acc_in)
        tl.debug_barrier()
        er = l_b * b + re * W + w
        tl.store(l_tok + er, e_tok, mask=win)
        tl.store(l_alive + er, e_alive, mask=win)
        tl.store(l_look + er, ch_look & (commit_in == 0), mask=win)
        tl.store(l_fill + lc_b * b + re, count)
        tl.store(l_par + er, ch_par, mask=win)
        tl.store(l_score + er, tl.where(commit_in, 0.0, tl.load(kid_score + ks_b * b + w,
                                                                 mask=win, other=0.0)), mask=win)
        tl.store(l_clane + lc_b * b + re, tl.where(commit_in, 0, -1).to(tl.int64))
        col = tl.arange(0, BLOCK_R)
        grid_r = win[:, None] & (col < R)[None, :]
        ch_anc = tl.load(ch[:, None] + K_ANC + col[None, :], mask=grid_r, other=0)
        tl.store(l_anc + la_b * b + re * (W * R) + w[:, None] * R + col[None, :],
                 tl.where(commit_in, 0, ch_anc), mask=grid_r)
        # the buffers: the committed token at its position, then the entering rows' tokens
        # (the dead ones' at the trash row: the last lane's stands)
        tb = tokens + b * t_b
        tl.store(tb + tl.where(full, j, trash), token)
        tl.debug_barrier()
        e_rows = tl.where(e_alive, tl.where(commit_in & first, enter, capacity + re * W + w),
                          trash)
        last_of = tl.sum(((e_rows[None, :] == e_rows[:, None]) & (w[None, :] > w[:, None])
                          & win[None, :]).to(tl.int32), axis=1) == 0
        writes = win & last_of
        tl.store(tb + e_rows, e_tok, mask=writes)
        # the accepted row's anchors move to its position, then the entering rows' embeddings
        # into slot 0
        # (trash to trash where nothing was accepted: a free slot's zero constants name no slot)
        src = tl.where(acc_in, capacity + rj * W + lane, trash)
        dst = tl.where(acc_in, j, trash)
        for mm in range(0, m):
            ab = anchors + b * a_b + mm * a_m
            for c0 in range(0, d, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                tl.store(ab + dst * a_c + cols, tl.load(ab + src * a_c + cols, mask=cols < d),
                         mask=cols < d)
        tl.debug_barrier()
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            g = writes[:, None] & (cols < d)[None, :]
            row = tl.load(weight + e_tok[:, None] * w_v + cols[None, :], mask=g)
            tl.store(anchors + b * a_b + e_rows[:, None] * a_c + cols[None, :], row, mask=g)
        # the counts: the judged draft by draft position, the lookup's, N, K, the stage rows
        fill = tl.load(jb)
        tl.store(st + FIELDS + 2 * fill, tl.load(st + FIELDS + 2 * fill) + full.to(tl.int64))
        tl.store(st + FIELDS + 2 * fill + 1,
                 tl.load(st + FIELDS + 2 * fill + 1) + ok.to(tl.int64))
        look_lane = tl.sum(tl.where(w == lane, c_look.to(tl.int32), 0), axis=0) > 0
        look_any = tl.sum((c_look & c_alive).to(tl.int32), axis=0) > 0
        looked = tl.where(ok, look_lane, look_any) & full & lookup
        tl.store(st + LOOKUP_JUDGED, tl.load(st + LOOKUP_JUDGED) + looked.to(tl.int64))
        tl.store(st + LOOKUP_ACCEPTED,
                 tl.load(st + LOOKUP_ACCEPTED) + (looked & ok).to(tl.int64))
        done = (live == 0) | ended
        cycle = tl.load(st + CYCLE) + 1
        end0 = tl.load(st + END_CYCLE)
        end = tl.where((end0 == 0) & ended, cycle + margin, end0)
        x = tl.arange(0, BLOCK_NW)
        rows = tl.sum(((tl.load(pl + HEAD + x, mask=x < NS * W, other=0) != trash)
                       & (x < NS * W)).to(tl.int64), axis=0)
        commit_state(st, committed, full, new_newest, done, live, made, rows, token, cycle, end)
        # the units: each moves a stage on (dead past the bound), the entering one at stage 0
        ub = units + b * u_b
        shift_units(ub, u_n, tl.where(rejected, -1, tl.where(acc_in, keep, newest)), done, NS,
                    H, BLOCK_N, BLOCK_H)
        # the entering unit (spd_kernels.tree_control.tree_unit): header, tokens, slots, the
        # keys [NS, W] k positions back, the mask [W, NS W]
        prefix = tl.where(commit_in, j, committed + full.to(tl.int64))
        tl.store(ub + POS, enter)
        tl.store(ub + END, end)
        tl.store(ub + LIVE, enters.to(tl.int64))
        tl.store(ub + PREFIX, prefix)
        tl.store(ub + CPOS, tl.where(acc_in, j, trash))
        tl.store(ub + CSLOT, tl.where(acc_in, src, trash))
        tl.store(ub + UH + w, e_tok, mask=win)
        tl.store(ub + UH + W + w, e_rows, mask=win)
        kb_ = s  # (k positions back)
        key_pos = enter - kb_
        valid = (key_pos >= prefix) & (commit_in == 0)
        keys = tl.where(valid[:, None], capacity + _ring(key_pos, R)[:, None] * W + w[None, :],
                        trash)
        keys = tl.where((kb_ == 0)[:, None] & (commit_in & first)[None, :], enter, keys)
        tl.store(ub + UH + 2 * W + kb_[:, None] * W + w[None, :], keys,
                 mask=(kb_ < NS)[:, None] & win[None, :])
        x_k = x // W
        x_l = x % W
        xin = x < NS * W
        x_valid = (enter - x_k >= prefix) & (commit_in == 0)
        grid_m = win[:, None] & xin[None, :]
        x_anc = tl.load(ch[:, None] + K_ANC + x_k[None, :], mask=grid_m, other=-1)
        sees = ((x_k == 0)[None, :] & (w[:, None] == x_l[None, :])) \
            | (x_valid[None, :] & (x_anc == x_l[None, :]))
        sees = sees & e_alive[:, None]
        tl.store(ub + UH + 2 * W + NS * W + w[:, None] * (NS * W) + x[None, :],
                 sees.to(tl.int64), mask=grid_m)


def _rows_contiguous(x) -> bool:
    """Whether x's axes after the first are laid out as a contiguous tensor's (the kernels
    step through a sequence's rows with the first axis' stride alone)."""
    expect = 1
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        if size > 1 and stride != expect:
            return False
        expect *= size
    return True


def _contiguous_rows(**tensors):
    """None when each tensor's last axis is contiguous (the kernels step along it), else why."""
    for name, x in tensors.items():
        if x is not None and x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
            return f"{name}'s last axis must be contiguous for the Triton kernel"
    return None


def _lanes_layout(lanes):
    """None when the lanes take the kernels' addressing (each sequence's rows contiguous; tok,
    par, score, alive and look of one layout, clane and fill of one), else why."""
    if not all(_rows_contiguous(x) for x in lanes) or \
            len({x.stride(0) for x in lanes[:5]}) != 1 or \
            len({x.stride(0) for x in lanes[6:]}) != 1:
        return "the Triton kernel takes lanes of one layout, each sequence's rows contiguous"
    return None


def _open_supports(state, units, consts, lanes, tokens, anchors, type_of_depth, tplan, mask,
                   window, extra, draws):
    if not _rows_contiguous(mask):
        return "mask's rows must be contiguous for the Triton kernel"
    return _lanes_layout(lanes) or _contiguous_rows(
        state=state, units=units, consts=consts, tokens=tokens, anchors=anchors,
        type_of_depth=type_of_depth, tplan=tplan, window=window, draws=draws)


@dispatch.register("tree_open", "triton", supports=_open_supports)
def tree_open_triton(state, units, consts, lanes, tokens, anchors, type_of_depth, tplan, mask,
                     window, extra, draws):
    B, n = units.shape[:2]
    W = lanes[0].shape[2]
    m, C, d = anchors.shape[1:]
    RW = (n + 1) * W
    tok, _, score, alive, _, anc, clane, _ = lanes
    rows = 0 if extra else m * RW
    _open_kernel[(B, 1 + rows)](
        state, state.stride(0), units, units.stride(0), units.stride(1), consts, consts.stride(0),
        tok, alive, score, tok.stride(0), anc, anc.stride(0), clane, clane.stride(0), tokens,
        tokens.stride(0), C, anchors, anchors.stride(0), anchors.stride(1), anchors.stride(2),
        window, window.stride(0), window.stride(1), window.stride(2), d, type_of_depth, tplan,
        tplan.stride(0), mask, mask.stride(0), mask.stride(1), *draw_args(draws, tplan), NS=n,
        W=W, EXTRA=extra, MAXL=LOOKUP_MAX, BLOCK_N=next_pow2(n + 1), BLOCK_W=next_pow2(W),
        BLOCK_RW=next_pow2(RW), BLOCK_L=next_pow2(LOOKUP_MAX), BLOCK_C=min(next_pow2(C), 256),
        BLOCK_D=min(next_pow2(d), ROW_BLOCK), HEAD=len(TPLAN), HAS_DRAWS=draws is not None,
        BLOCK_DR=next_pow2(1 if draws is None else draws.shape[1]))


def _children_supports(tplan, lanes, top, top_ids, pmax, trust, log_trust, kids, kid_score,
                       judge, final, judged_hidden):
    return _lanes_layout(lanes) or _contiguous_rows(
        tplan=tplan, top=top, top_ids=top_ids, pmax=pmax, trust=trust, log_trust=log_trust,
        kids=kids, kid_score=kid_score, judge=judge, final=final, judged_hidden=judged_hidden)


@dispatch.register("tree_children", "triton", supports=_children_supports)
def tree_children_triton(tplan, lanes, top, top_ids, pmax, trust, log_trust, kids, kid_score,
                         judge, final, judged_hidden):
    B, W, k = top.shape
    n = lanes[0].shape[1] - 1
    tok, _, score, alive, look, anc, _, fill = lanes
    has_final = final is not None
    dummy = tplan  # (an unused pointer argument)
    _children_kernel[(B,)](
        tplan, tplan.stride(0), tok, alive, look, score, tok.stride(0), anc, anc.stride(0),
        fill, fill.stride(0), top, top.stride(0), top.stride(1), top_ids, top_ids.stride(0),
        top_ids.stride(1), pmax, pmax.stride(0), trust, log_trust, kids, kids.stride(0),
        kids.stride(1), kid_score, kid_score.stride(0), judge, judge.stride(0),
        final if has_final else dummy, final.stride(0) if has_final else 0,
        final.stride(1) if has_final else 0, judged_hidden if has_final else dummy,
        judged_hidden.stride(0) if has_final else 0, final.shape[2] if has_final else 0,
        NS=n, W=W, KC=k, HAS_FINAL=has_final, BLOCK_W=next_pow2(W),
        BLOCK_S=next_pow2(1 + W * k), BLOCK_R=next_pow2(n + 1), BLOCK=ROW_BLOCK)


def _commit_supports(state, units, consts, tplan, kids, kid_score, judge, lanes, tokens,
                     anchors, embed_weight, stop_ids, verdict, accepted, margin):
    return _lanes_layout(lanes) or _contiguous_rows(
        state=state, units=units, consts=consts, tplan=tplan, kids=kids, kid_score=kid_score,
        judge=judge, tokens=tokens, anchors=anchors, embed_weight=embed_weight,
        stop_ids=stop_ids, verdict=verdict, accepted=accepted)


@dispatch.register("tree_commit", "triton", supports=_commit_supports)
def tree_commit_triton(state, units, consts, tplan, kids, kid_score, judge, lanes, tokens,
                       anchors, embed_weight, stop_ids, verdict, accepted, margin):
    B, n, H = units.shape
    W = lanes[0].shape[2]
    m, _, d = anchors.shape[1:]
    tok, par, score, alive, look, anc, clane, fill = lanes
    _commit_kernel[(B,)](
        state, state.stride(0), units, units.stride(0), units.stride(1), consts,
        consts.stride(0), tplan, tplan.stride(0), kids, kids.stride(0), kids.stride(1),
        kid_score, kid_score.stride(0), judge, judge.stride(0), tok, par, score, alive, look,
        tok.stride(0), anc, anc.stride(0), clane, fill, clane.stride(0), tokens,
        tokens.stride(0), anchors, anchors.stride(0), anchors.stride(1), anchors.stride(2), m,
        embed_weight, embed_weight.stride(0), d, stop_ids, stop_ids.stride(0),
        stop_ids.shape[1], verdict, verdict if accepted is None else accepted, margin,
        NS=n, W=W, H=H, HAS_ACC=accepted is not None, BLOCK_N=next_pow2(n + 1),
        BLOCK_W=next_pow2(W), BLOCK_R=next_pow2(n + 1), BLOCK_NW=next_pow2(n * W),
        BLOCK_H=next_pow2(H), BLOCK_T=next_pow2(stop_ids.shape[1]),
        BLOCK_D=min(next_pow2(d), ROW_BLOCK), HEAD=len(TPLAN), FIELDS=len(STATE),
        UH=len(UNIT))


__all__ = ["tree_children_triton", "tree_commit_triton", "tree_open_triton"]
