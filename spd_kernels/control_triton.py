"""spd_kernels.control on Triton: one program a sequence (and, for cycle_open, one a window row).

Each kernel is its reference's scalar logic read as one program: the fields are loaded once,
every choice is a select, and the writes follow in the reference's order. Where one program
writes an address that it, or another of its threads, then reads or writes again (a queued
row read back, a shifted unit, the trash row written twice), a barrier between keeps the
reference's order.
"""
from __future__ import annotations

from spd_kernels import control, dispatch
from spd_kernels._triton import HAS_TRITON, INTERPRET, next_pow2, tl, triton
from spd_kernels.control import CAND, LOOKUP_MAX, PLAN, STATE

ROW_BLOCK = 1024 if not INTERPRET else 4096  # elements a row copy moves per step

if HAS_TRITON:
    # the fields' indices as constants (a compiled kernel reads no other global)
    (COMMITTED, NEWEST, DONE, K, N, STAGE_ROWS, EMITTED, TOKEN, CYCLE, END_CYCLE,
     LOOKUP_JUDGED, LOOKUP_ACCEPTED) = map(tl.constexpr, (
         control.COMMITTED, control.NEWEST, control.DONE, control.K, control.N,
         control.STAGE_ROWS, control.EMITTED, control.TOKEN, control.CYCLE, control.END_CYCLE,
         control.LOOKUP_JUDGED, control.LOOKUP_ACCEPTED))
    POS, LIVE = map(tl.constexpr, (control.POS, control.LIVE))
    TRASH, MAX_NEW, LOOKUP_MIN, GREEDY, KEY = map(tl.constexpr, (
        control.TRASH, control.MAX_NEW, control.LOOKUP_MIN, control.GREEDY, control.KEY))
    (P_COMMITTED, P_NEWEST, P_LIVE, P_FULL, P_FINAL, P_W0, P_LAST, P_CHILD, P_FOUND,
     P_LENGTH) = map(tl.constexpr, (
         control.P_COMMITTED, control.P_NEWEST, control.P_LIVE, control.P_FULL, control.P_FINAL,
         control.P_W0, control.P_LAST, control.P_CHILD, control.P_FOUND, control.P_LENGTH))
    C_CHILD, C_CHILD_LOOK, C_TOK, C_ALIVE, C_LOOK, C_FILL = map(tl.constexpr, (
        control.C_CHILD, control.C_CHILD_LOOK, control.C_TOK, control.C_ALIVE, control.C_LOOK,
        control.C_FILL))

    @triton.jit
    def draw_uniforms(draws, dr_b, D, b, st, key, BLOCK: tl.constexpr):
        """Sequence b's D uniforms this cycle (spd_kernels.philox): Triton's Philox of its key
        at cycle * D + j."""
        j = tl.arange(0, BLOCK).to(tl.int64)
        u = tl.rand(key, tl.load(st + CYCLE) * D + j)
        tl.store(draws + b * dr_b + j, u, mask=j < D)

    @triton.jit
    def _open_kernel(state, s_b, units, u_b, u_n, consts, c_b, tokens, t_b, C, anchors, a_b,
                     a_m, a_c, window, w_b, w_m, w_k, d, tod, plan, p_b, draws, dr_b, D,
                     NS: tl.constexpr, EXTRA: tl.constexpr, MAXL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_D: tl.constexpr, HEAD: tl.constexpr, HAS_DRAWS: tl.constexpr,
                     BLOCK_DR: tl.constexpr):
        """Program (b, 0): sequence b's plan; program (b, 1 + r): row r of its window."""
        b = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        st = state + b * s_b
        committed = tl.load(st + COMMITTED)
        newest = tl.load(st + NEWEST)
        start = committed - 1
        final = start - tl.load(st + EMITTED)
        w0 = tl.maximum(tl.maximum(newest - NS, final), 0)
        if which == 0:
            live = tl.load(st + DONE) == 0
            trash = tl.load(consts + b * c_b + TRASH)
            lmin = tl.load(consts + b * c_b + LOOKUP_MIN)
            k = tl.arange(0, BLOCK_N)
            kin = k < NS
            ub = units + b * u_b + k * u_n
            upos = tl.load(ub + POS, mask=kin, other=0)
            ulive = (tl.load(ub + LIVE, mask=kin, other=0) == 1) & live & kin
            occ = tl.where(ulive, upos, -1)
            full = tl.sum(tl.where(k == NS - 1, occ, 0), axis=0) >= 0
            pl = plan + b * p_b
            tl.store(pl + HEAD + k, tl.where(ulive, upos, trash), mask=kin)
            # the window: a row's depth is NS below the rows in flight, else its stage's
            o = tl.arange(0, BLOCK_N)
            oin = o < NS + 1
            pos = w0 + o
            at = (occ[None, :] == pos[:, None]) & kin[None, :]
            depth = tl.where(pos < start, NS, tl.sum(tl.where(at, k[None, :], 0), axis=1))
            types = tl.load(tod + tl.minimum(depth + EXTRA, NS), mask=oin, other=0)
            tl.store(pl + HEAD + NS + o, pos, mask=oin)
            tl.store(pl + HEAD + 2 * NS + 1 + o, types, mask=oin)
            # the context lookup: for each match length l + 1, the latest end j of an earlier
            # occurrence (with a committed successor) of the last l + 1 tokens
            tb = tokens + b * t_b
            lv = tl.arange(0, BLOCK_L)
            last = tl.full([BLOCK_L], -1, tl.int64)
            for j0 in range(0, C, BLOCK_C):
                j = j0 + tl.arange(0, BLOCK_C).to(tl.int64)
                run = j < C
                for i in tl.static_range(MAXL):
                    here = tl.load(tb + tl.maximum(j - i, 0), mask=j < C, other=-1)
                    back = tl.load(tb + tl.maximum(newest - i, 0))
                    run = run & (here == back)
                    ok = run & (j + 1 < committed) & (j >= i)
                    best = tl.max(tl.where(ok, j, -1), axis=0)
                    last = tl.where(lv == i, tl.maximum(last, best), last)
            held = tl.minimum(committed, MAXL) + newest + 1 - committed
            kk = lv + 1
            usable = (last >= 0) & (kk >= lmin) & (kk <= held) & (lv < MAXL)
            length = tl.max(tl.where(usable, kk, 0), axis=0)
            end = tl.sum(tl.where(lv == tl.maximum(length - 1, 0), last, 0), axis=0)
            found = tl.load(tb + tl.minimum(end + 1, C - 1))
            on = lmin > 0
            tl.store(pl + P_COMMITTED, committed)
            tl.store(pl + P_NEWEST, newest)
            tl.store(pl + P_LIVE, live.to(tl.int64))
            tl.store(pl + P_FULL, full.to(tl.int64))
            tl.store(pl + P_FINAL, final)
            tl.store(pl + P_W0, w0)
            tl.store(pl + P_LAST, newest - w0)
            tl.store(pl + P_CHILD, newest + 1)
            tl.store(pl + P_FOUND, tl.where(on, found, 0))
            tl.store(pl + P_LENGTH, tl.where(on, length, 0))
            if HAS_DRAWS:
                draw_uniforms(draws, dr_b, D, b, st, tl.load(consts + b * c_b + KEY), BLOCK_DR)
        else:  # (names of their own: a name both branches set must be of one type)
            r = which - 1
            m = r // (NS + 1)
            r_pos = w0 + r % (NS + 1)
            src = anchors + b * a_b + m * a_m + r_pos * a_c
            dst = window + b * w_b + m * w_m + (r % (NS + 1)) * w_k
            for c0 in range(0, d, BLOCK_D):
                cols = c0 + tl.arange(0, BLOCK_D)
                tl.store(dst + cols, tl.load(src + cols, mask=cols < d), mask=cols < d)

    @triton.jit
    def _candidate_kernel(plan, p_b, draft, draft_p, trust, l_tok, l_alive, l_look, l_fill,
                          l_b, cand, c_b, q, q_b, q_ids, Vq, ring, r_b, r_r, Vr, judged, j_b,
                          final, f_b, f_c, hidden, h_b, d, NS: tl.constexpr,
                          HAS_P: tl.constexpr, HAS_Q: tl.constexpr, HAS_IDS: tl.constexpr,
                          HAS_FINAL: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        pl = plan + b * p_b
        committed = tl.load(pl + P_COMMITTED)
        newest = tl.load(pl + P_NEWEST)
        found = tl.load(pl + P_FOUND)
        length = tl.load(pl + P_LENGTH)
        used = length > 0
        if HAS_P:  # the gate: the lookup's token where the drafter is less sure
            used = used & (tl.load(draft_p + b).to(tl.float32) < tl.load(trust + length))
        child = tl.where(used, found, tl.load(draft + b))
        rj = committed % (NS + 1)
        in_flight = committed <= newest
        at = b * l_b + rj
        cb = cand + b * c_b
        tl.store(cb + C_CHILD, child)
        tl.store(cb + C_CHILD_LOOK, used.to(tl.int64))
        tl.store(cb + C_TOK, tl.where(in_flight, tl.load(l_tok + at), child))
        tl.store(cb + C_ALIVE, tl.where(in_flight, tl.load(l_alive + at).to(tl.int64), 1))
        tl.store(cb + C_LOOK, tl.where(in_flight, tl.load(l_look + at).to(tl.int64),
                                        used.to(tl.int64)))
        tl.store(cb + C_FILL, tl.where(in_flight, tl.load(l_fill + at), newest - committed + 2))
        if HAS_Q:  # the draft's q at its position's row, then the judged row copied out
            row = ring + b * r_b + ((newest + 1) % (NS + 1)) * r_r
            for c0 in range(0, Vr, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                onehot = (cols == found).to(tl.float32)
                if HAS_IDS:
                    keep = tl.zeros([BLOCK], tl.float32)
                else:
                    keep = tl.load(q + b * q_b + cols, mask=cols < Vr, other=0.0)
                tl.store(row + cols, tl.where(used, onehot, keep), mask=cols < Vr)
            if HAS_IDS:  # q's columns to their target ids (where the lookup's one-hot is not)
                tl.debug_barrier()
                for c0 in range(0, Vq, BLOCK):
                    cols = c0 + tl.arange(0, BLOCK)
                    ids = tl.load(q_ids + cols, mask=cols < Vq, other=0)
                    val = tl.load(q + b * q_b + cols, mask=cols < Vq, other=0.0)
                    tl.store(row + ids, val, mask=(cols < Vq) & (used == 0))
            tl.debug_barrier()
            src = ring + b * r_b + rj * r_r
            for c0 in range(0, Vr, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                tl.store(judged + b * j_b + cols, tl.load(src + cols, mask=cols < Vr),
                         mask=cols < Vr)
        if HAS_FINAL:
            src = final + b * f_b + tl.maximum(committed - 1, 0) * f_c
            for c0 in range(0, d, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                tl.store(hidden + b * h_b + cols, tl.load(src + cols, mask=cols < d),
                         mask=cols < d)

    @triton.jit
    def commit_state(st, committed, full, new_newest, done, live, made, rows, token, cycle,
                     end):
        """A commit's state fields (spd_kernels.control.STATE) at st: a chain's and a token
        tree's (spd_kernels.tree_control_triton)."""
        tl.store(st + COMMITTED, committed + full.to(tl.int64))
        tl.store(st + NEWEST, new_newest)
        tl.store(st + DONE, done.to(tl.int64))
        tl.store(st + K, tl.load(st + K) + live.to(tl.int64))
        tl.store(st + N, made)
        tl.store(st + STAGE_ROWS, tl.load(st + STAGE_ROWS) + tl.where(live, rows, 0))
        tl.store(st + EMITTED, full.to(tl.int64))
        tl.store(st + TOKEN, token)
        tl.store(st + CYCLE, cycle)
        tl.store(st + END_CYCLE, end)

    @triton.jit
    def shift_units(ub, u_n, bound, done, NS: tl.constexpr, H: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
        """A commit's units at ub [NS, H] (rows u_n apart): each of stages 0 .. NS - 2 moves a
        stage on, dead past position `bound` or when the sequence is `done`; stage 0's row is
        then the caller's to write (a chain's and a token tree's commit)."""
        k = tl.arange(0, BLOCK_N)
        h = tl.arange(0, BLOCK_H)
        grid = (k[:, None] < NS - 1) & (h[None, :] < H)
        cur = tl.load(ub + k[:, None] * u_n + h[None, :], mask=grid, other=0)
        upos = tl.sum(tl.where(h[None, :] == POS, cur, 0), axis=1)
        alive = (tl.sum(tl.where(h[None, :] == LIVE, cur, 0), axis=1) == 1) & (upos <= bound) \
            & (done == 0)
        cur = tl.where(h[None, :] == LIVE, alive.to(tl.int64)[:, None], cur)
        tl.debug_barrier()
        tl.store(ub + (k[:, None] + 1) * u_n + h[None, :], cur, mask=grid)

    @triton.jit
    def _commit_kernel(state, s_b, units, u_b, u_n, consts, c_b, plan, p_b, cand, ca_b,
                       l_tok, l_alive, l_look, l_fill, l_b, tokens, t_b, emb, e_b, e_c,
                       weight, w_v, d, stops, st_b, T, verdict, accepted, margin,
                       NS: tl.constexpr, H: tl.constexpr, HAS_ACC: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr, HEAD: tl.constexpr, FIELDS: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        st = state + b * s_b
        pl = plan + b * p_b
        cb = cand + b * ca_b
        trash = tl.load(consts + b * c_b + TRASH)
        max_new = tl.load(consts + b * c_b + MAX_NEW)
        lookup = tl.load(consts + b * c_b + LOOKUP_MIN) > 0
        committed = tl.load(pl + P_COMMITTED)
        newest = tl.load(pl + P_NEWEST)
        live = tl.load(pl + P_LIVE) == 1
        full = (tl.load(pl + P_FULL) == 1) & live
        j = committed
        count = newest - committed + 2
        in_flight = j <= newest
        c_tok = tl.load(cb + C_TOK)
        c_alive = tl.load(cb + C_ALIVE) == 1
        c_look = tl.load(cb + C_LOOK) == 1
        token = tl.load(verdict + b)
        ok = c_alive & (c_tok == token)
        if HAS_ACC:
            greedy = tl.load(consts + b * c_b + GREEDY) == 1
            ok = tl.where(greedy, ok, tl.load(accepted + b) != 0)
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
        draft_in = going & ((full == 0) | acc_in)
        commit_in = going & (rejected | acc_gap)
        enters = draft_in | commit_in
        new_newest = tl.where(draft_in, newest + 1, tl.where(commit_in, j, newest))
        enter = tl.where(commit_in, j, tl.where(draft_in, newest + 1, new_newest + 1))
        e_tok = tl.where(commit_in, token, tl.load(cb + C_CHILD))
        r = b * l_b + enter % (NS + 1)
        tl.store(l_tok + r, e_tok)
        tl.store(l_alive + r, enters)
        tl.store(l_look + r, (tl.load(cb + C_CHILD_LOOK) == 1) & (commit_in == 0))
        tl.store(l_fill + r, count)
        # the committed token, then the entering one (the trash row may take both: in order)
        tb = tokens + b * t_b
        tl.store(tb + tl.where(full, j, trash), token)
        tl.debug_barrier()
        e_row = tl.where(enters, enter, trash)
        tl.store(tb + e_row, e_tok)
        for c0 in range(0, d, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            tl.store(emb + b * e_b + e_row * e_c + cols,
                     tl.load(weight + e_tok * w_v + cols, mask=cols < d), mask=cols < d)
        # the counts
        fill = tl.load(cb + C_FILL)
        tl.store(st + FIELDS + 2 * fill, tl.load(st + FIELDS + 2 * fill) + full.to(tl.int64))
        tl.store(st + FIELDS + 2 * fill + 1,
                 tl.load(st + FIELDS + 2 * fill + 1) + ok.to(tl.int64))
        looked = tl.where(ok, c_look, c_look & c_alive) & full & lookup
        tl.store(st + LOOKUP_JUDGED, tl.load(st + LOOKUP_JUDGED) + looked.to(tl.int64))
        tl.store(st + LOOKUP_ACCEPTED,
                 tl.load(st + LOOKUP_ACCEPTED) + (looked & ok).to(tl.int64))
        done = (live == 0) | ended
        cycle = tl.load(st + CYCLE) + 1
        end0 = tl.load(st + END_CYCLE)
        end = tl.where((end0 == 0) & ended, cycle + margin, end0)
        k = tl.arange(0, BLOCK_N)
        rows = tl.sum(((tl.load(pl + HEAD + k, mask=k < NS, other=0) != trash)
                       & (k < NS)).to(tl.int64), axis=0)
        commit_state(st, committed, full, new_newest, done, live, made, rows, token, cycle, end)
        # the units: each moves a stage on (dead past the bound), the entering one at stage 0
        ub = units + b * u_b
        h = tl.arange(0, BLOCK_H)
        shift_units(ub, u_n, tl.where(rejected, -1, newest), done, NS, H, BLOCK_N, BLOCK_H)
        head = tl.where(h == 0, enter, tl.where(h == 1, end, tl.where(
            h == 2, enters.to(tl.int64), tl.where(h == 3, tl.where(commit_in, j, committed
                                                                    + full.to(tl.int64)),
                                                   tl.where(h == H - 1, e_tok, trash)))))
        tl.store(ub + h, head, mask=h < H)


def _contiguous_rows(**tensors):
    """None when each tensor's last axis is contiguous (the kernels step along it), else why."""
    for name, x in tensors.items():
        if x is not None and x.dim() and x.stride(-1) != 1 and x.shape[-1] > 1:
            return f"{name}'s last axis must be contiguous for the Triton kernel"
    return None


def _open_supports(state, units, consts, tokens, anchors, type_of_depth, plan, window, extra,
                   draws):
    return _contiguous_rows(state=state, units=units, consts=consts, tokens=tokens,
                            anchors=anchors, type_of_depth=type_of_depth, plan=plan,
                            window=window, draws=draws)


def draw_args(draws, plan) -> tuple:
    """The open kernels' draw arguments (draws, its row stride, D; plan: a stand-in pointer)."""
    return (plan, 0, 1) if draws is None else (draws, draws.stride(0), draws.shape[1])


@dispatch.register("cycle_open", "triton", supports=_open_supports)
def cycle_open_triton(state, units, consts, tokens, anchors, type_of_depth, plan, window,
                      extra, draws):
    B, n = units.shape[:2]
    m, C, d = anchors.shape[1:]
    rows = 0 if extra else m * (n + 1)
    _open_kernel[(B, 1 + rows)](
        state, state.stride(0), units, units.stride(0), units.stride(1), consts, consts.stride(0),
        tokens, tokens.stride(0), C, anchors, anchors.stride(0), anchors.stride(1),
        anchors.stride(2), window, window.stride(0), window.stride(1), window.stride(2), d,
        type_of_depth, plan, plan.stride(0), *draw_args(draws, plan), NS=n, EXTRA=extra,
        MAXL=LOOKUP_MAX, BLOCK_N=next_pow2(n + 1), BLOCK_L=next_pow2(LOOKUP_MAX),
        BLOCK_C=min(next_pow2(C), 256), BLOCK_D=min(next_pow2(d), ROW_BLOCK), HEAD=len(PLAN),
        HAS_DRAWS=draws is not None, BLOCK_DR=next_pow2(1 if draws is None else draws.shape[1]))


def _candidate_supports(plan, lanes, draft, cand, draft_p, trust, q, q_ids, q_ring, q_judged,
                        final, judged_hidden):
    if any(x.stride(1) != 1 for x in lanes) or len({x.stride(0) for x in lanes}) != 1:
        return "the Triton kernel takes lanes of one layout, each row contiguous"
    return _contiguous_rows(plan=plan, cand=cand, q=q, q_ids=q_ids, q_ring=q_ring,
                            q_judged=q_judged, final=final, judged_hidden=judged_hidden,
                            draft=draft, draft_p=draft_p, trust=trust)


@dispatch.register("cycle_candidate", "triton", supports=_candidate_supports)
def cycle_candidate_triton(plan, lanes, draft, cand, draft_p, trust, q, q_ids, q_ring,
                           q_judged, final, judged_hidden):
    B = plan.shape[0]
    n = (plan.shape[1] - len(PLAN) - 2) // 3
    tok, alive, look, fill = lanes
    dummy = plan  # (an unused pointer argument)
    has_q, has_final = q is not None, final is not None
    Vq, Vr = (q.shape[1], q_ring.shape[2]) if has_q else (0, 0)
    d = final.shape[2] if has_final else 0
    _candidate_kernel[(B,)](
        plan, plan.stride(0), draft, dummy if draft_p is None else draft_p,
        dummy if trust is None else trust, tok, alive, look, fill, tok.stride(0), cand,
        cand.stride(0), q if has_q else dummy, q.stride(0) if has_q else 0,
        dummy if q_ids is None else q_ids, Vq, q_ring if has_q else dummy,
        q_ring.stride(0) if has_q else 0, q_ring.stride(1) if has_q else 0, Vr,
        q_judged if has_q else dummy, q_judged.stride(0) if has_q else 0,
        final if has_final else dummy, final.stride(0) if has_final else 0,
        final.stride(1) if has_final else 0, judged_hidden if has_final else dummy,
        judged_hidden.stride(0) if has_final else 0, d, NS=n, HAS_P=draft_p is not None,
        HAS_Q=has_q, HAS_IDS=q_ids is not None, HAS_FINAL=has_final, BLOCK=ROW_BLOCK)


def _commit_supports(state, units, consts, plan, cand, lanes, tokens, embedded, embed_weight,
                     stop_ids, verdict, accepted, margin):
    if any(x.stride(1) != 1 for x in lanes) or len({x.stride(0) for x in lanes}) != 1:
        return "the Triton kernel takes lanes of one layout, each row contiguous"
    return _contiguous_rows(state=state, units=units, consts=consts, plan=plan, cand=cand,
                            tokens=tokens, embedded=embedded, embed_weight=embed_weight,
                            stop_ids=stop_ids)


@dispatch.register("cycle_commit", "triton", supports=_commit_supports)
def cycle_commit_triton(state, units, consts, plan, cand, lanes, tokens, embedded,
                        embed_weight, stop_ids, verdict, accepted, margin):
    B, n, H = units.shape
    d = embedded.shape[2]
    tok, alive, look, fill = lanes
    _commit_kernel[(B,)](
        state, state.stride(0), units, units.stride(0), units.stride(1), consts,
        consts.stride(0), plan, plan.stride(0), cand, cand.stride(0), tok, alive, look, fill,
        tok.stride(0), tokens, tokens.stride(0), embedded, embedded.stride(0),
        embedded.stride(1), embed_weight, embed_weight.stride(0), d, stop_ids,
        stop_ids.stride(0), stop_ids.shape[1], verdict,
        verdict if accepted is None else accepted, margin, NS=n, H=H,
        HAS_ACC=accepted is not None, BLOCK_N=next_pow2(n), BLOCK_H=next_pow2(H),
        BLOCK_T=next_pow2(stop_ids.shape[1]), BLOCK_D=min(next_pow2(d), ROW_BLOCK),
        HEAD=len(PLAN), FIELDS=len(STATE))


__all__ = ["CAND", "cycle_candidate_triton", "cycle_commit_triton", "cycle_open_triton"]
