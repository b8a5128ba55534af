"""A token tree's cycle control as three ops: lay the cycle out, pick the children, commit.

The token tree's twin of spd_kernels.control (a chain's), in the same terms: a cycle of B
sequences, W rows a position (lanes), n stages, R = n + 1 positions in flight at most. The
PyTorch reference of each op is the cycle's own code and the specification; the Triton kernels
(spd_kernels.tree_control_triton) run one program a sequence.

Terms beyond spd_kernels.control's.
  lanes   a tree's rows in flight by position mod R and lane: tok [B, R, W] int64, par
          [B, R, W] int64 (the parent's lane), score [B, R, W] float32 (cumulative draft
          log-probability), alive and look [B, R, W] bool, anc [B, R, W, R] int64 (the lane of
          each row's ancestor k positions back), clane [B, R] int64 (the committed lane, -1:
          none) and fill [B, R] int64 (the draft position).
  slot    a tree row's buffer row and K/V slot (spd.runtime.unit): its position once committed,
          else capacity + (position mod R) * W + lane, where capacity = trash - R W (the tree
          slots are the R W rows before each sequence's trash row); the drafter's cache keeps
          a window row at capacity + offset * W + lane.
  tplan   int64 [B, TP]: what `tree_open` lays out (`TPLAN`, then rows [n, W]: where each
          stage's unit rows land, and the drafter's window of R * W rows: positions, feature
          types, buffer rows, drafter cache slots, then the leaves [W]: the newest position's
          rows in the window); tree_open also writes the window's mask [B, R W, R W] bool (a row
          sees its ancestors and itself) and, pre-step, its anchors [B, m, R W, d].
  top     the draft step's (spd.draft.drafters.PDMDrafter.tree_top) W most probable children
          of each leaf: log-probabilities top [B, W, k] float32 (descending), their target ids
          [B, W, k] int64 and each leaf's top probability pmax [B, W] float32 (the lookup's
          gate).
  kids    int64 [B, W, 4 + R]: the children that may enter (`KID`, then anc [R]: each child's
          ancestor lanes, itself first) and kid_score [B, W] float32 their scores.
  judge   int64 [B, 1 + 5 W]: the judged position's draft position (fill), then its
          candidates' tokens, liveness and lookup flags [W] each by lane, then the candidates
          in the order the verifier checks them [W] (live first in lane order, repeats -1) and
          their lanes [W].
"""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels.checks import SPDInputError, check_tensor
from spd_kernels.control import (
    COMMITTED,
    CYCLE,
    DONE,
    EMITTED,
    END_CYCLE,
    GREEDY,
    LIVE,
    LOOKUP_ACCEPTED,
    LOOKUP_JUDGED,
    LOOKUP_MAX,
    LOOKUP_MIN,
    MAX_NEW,
    NEWEST,
    POS,
    STAGE_ROWS,
    STATE,
    TRASH,
    UNIT,
    K,
    N,
    _check_rows,
    _check_state,
    check_draws,
    draw_reference,
    lookup_proposal,
)
from spd_kernels.opdef import op

TPLAN = ("committed", "newest", "live", "full", "final", "w0", "last", "best", "found", "length")
(T_COMMITTED, T_NEWEST, T_LIVE, T_FULL, T_FINAL, T_W0, T_LAST, T_BEST, T_FOUND,
 T_LENGTH) = range(len(TPLAN))
KID = ("tok", "par", "alive", "look")
K_TOK, K_PAR, K_ALIVE, K_LOOK = range(len(KID))
LANES = ("tok", "par", "score", "alive", "look", "anc", "clane", "fill")
NEG_INF = float("-inf")


def tree_unit_size(n: int, W: int) -> int:
    """A tree unit's header: the fixed fields, tokens [W], slots [W], keys [n W], mask
    [W, n W] (spd.runtime.unit.UnitFormat)."""
    return len(UNIT) + 2 * W + n * W + W * n * W


def tplan_size(n: int, W: int) -> int:
    return len(TPLAN) + n * W + 4 * (n + 1) * W + W


def tplan_fields(tplan: torch.Tensor, n: int, W: int) -> dict:
    """Views of tplan [..., TP]: rows [..., n, W], then the window's pos, types, buf, pdm
    [..., R W] and leaves [..., W]."""
    RW, at = (n + 1) * W, len(TPLAN)
    lead = tplan.shape[:-1]
    out = {"rows": tplan[..., at:at + n * W].view(*lead, n, W)}
    at += n * W
    for name in ("pos", "types", "buf", "pdm"):
        out[name] = tplan[..., at:at + RW]
        at += RW
    out["leaves"] = tplan[..., at:at + W]
    return out


def judge_size(W: int) -> int:
    return 1 + 5 * W


def judge_fields(judge: torch.Tensor, W: int) -> dict:
    """Views of judge [..., 1 + 5 W]: fill, then tok, alive, look, cands, order [..., W]."""
    out = {"fill": judge[..., 0]}
    for i, name in enumerate(("tok", "alive", "look", "cands", "order")):
        out[name] = judge[..., 1 + i * W:1 + (i + 1) * W]
    return out


# ------------------------------------------------------------------------------------------------
# shared pieces of the references (per sequence)
# ------------------------------------------------------------------------------------------------

def tree_slot(capacity, position, lane, R: int, W: int):
    """The buffer row (and K/V slot) of an uncommitted tree row."""
    return capacity + (position % R) * W + lane


def tree_unit(pos, end, live, committed_unit, tok, alive, prefix, cpos, cslot, trash,
              capacity, n: int, anc=None) -> torch.Tensor:
    """A tree unit's header [H] (spd.runtime.unit) of device values: its position and end
    (0-d), whether it is live and committed (one row at its position: the first token, a
    correction), the rows' tokens and liveness [W], the committed prefix (0-d), the commit it
    carries (0-d each) and, for children, anc [W, n]: each row's lane k positions back."""
    W, dev = tok.shape[0], tok.device
    R = n + 1
    lane_ids = torch.arange(W, device=dev)
    key_back = torch.arange(n, device=dev)  # a unit's keys: k positions back
    first = lane_ids == 0
    at_pos = committed_unit & first
    slots = torch.where(alive, torch.where(at_pos, pos, tree_slot(capacity, pos, lane_ids, R, W)),
                        trash)
    back = pos - key_back                                                  # [n]
    valid = (back >= prefix) & ~committed_unit
    keys = torch.where(valid.view(-1, 1), tree_slot(capacity, back.view(-1, 1), lane_ids, R, W),
                       trash)
    keys = torch.where((key_back == 0).view(-1, 1) & at_pos, pos, keys)
    own = (key_back == 0).view(1, -1, 1) & (lane_ids.view(-1, 1, 1) == lane_ids.view(1, 1, -1))
    mask = own
    if anc is not None:
        mask = mask | (valid.view(1, -1, 1) & (anc.view(W, n, 1) == lane_ids))
    mask = mask & alive.view(-1, 1, 1)
    head = [pos.view(1), end.view(1), live.view(1).to(torch.int64), prefix.view(1),
            cpos.view(1), cslot.view(1), tok.view(-1), slots, keys.view(-1),
            mask.view(-1).to(torch.int64)]
    return torch.cat(head)


def _leaf_base(lanes, b, newest, start, W):
    """(alive [W], base score [W]: -inf where dead) of the newest position's rows, the leaves
    the children hang from; a committed newest position is lane 0 alone."""
    R = lanes[0].shape[1]
    r_new = newest % R
    lane_ids = torch.arange(W, device=newest.device)
    alive = torch.where(newest <= start, lane_ids == 0, lanes[3][b, r_new])
    base = torch.where(newest > start, lanes[2][b, r_new], 0.0)
    return alive, torch.where(alive, base, NEG_INF)


# ------------------------------------------------------------------------------------------------
# argument checks (shapes, dtypes, devices: never a value, which would read the device)
# ------------------------------------------------------------------------------------------------

def _check_tree_batch(state, units, consts, W: int):
    check_tensor("state", state, dim=2, dtype=torch.int64)
    dev, B = state.device, state.shape[0]
    check_tensor("units", units, dim=3, dtype=torch.int64, device=dev)
    n = units.shape[1]
    if n < 2 or units.shape[0] != B or units.shape[2] != tree_unit_size(n, W):
        raise SPDInputError(f"units must be [B={B}, n, {len(UNIT)} + 2 W + n W + W n W] with "
                            f"n >= 2 stages (fewer decode autoregressively) for W = {W} rows a "
                            f"unit, got {tuple(units.shape)}")
    _check_state(state, consts, B, n, dev)
    return B, n, dev


def _check_tree_lanes(lanes, B, n, W, dev):
    R = n + 1
    if len(lanes) != len(LANES):
        raise SPDInputError(f"lanes must be {LANES}, got {len(lanes)} tensors")
    specs = {"tok": (torch.int64, (R, W)), "par": (torch.int64, (R, W)),
             "score": (torch.float32, (R, W)), "alive": (torch.bool, (R, W)),
             "look": (torch.bool, (R, W)), "anc": (torch.int64, (R, W, R)),
             "clane": (torch.int64, (R,)), "fill": (torch.int64, (R,))}
    for name, x in zip(LANES, lanes):
        dtype, shape = specs[name]
        _check_rows(f"lanes.{name}", x, B, dev, dtype, dim=1 + len(shape))
        if tuple(x.shape[1:]) != shape:
            raise SPDInputError(f"lanes.{name} must be [{B}, {', '.join(map(str, shape))}], "
                                f"got {tuple(x.shape)}")


def _check_tplan(tplan, B, n, W, dev):
    _check_rows("tplan", tplan, B, dev, torch.int64)
    if tplan.shape[1] != tplan_size(n, W):
        raise SPDInputError(f"tplan must be [{B}, {tplan_size(n, W)}] for n = {n}, W = {W}, "
                            f"got {tuple(tplan.shape)}")


def _check_kids(kids, kid_score, judge, B, n, W, dev):
    _check_rows("kids", kids, B, dev, torch.int64, dim=3)
    if tuple(kids.shape[1:]) != (W, len(KID) + n + 1):
        raise SPDInputError(f"kids must be [{B}, {W}, {len(KID) + n + 1}], got "
                            f"{tuple(kids.shape)}")
    _check_rows("kid_score", kid_score, B, dev, torch.float32)
    if tuple(kid_score.shape) != (B, W):
        raise SPDInputError(f"kid_score must be [{B}, {W}], got {tuple(kid_score.shape)}")
    _check_rows("judge", judge, B, dev, torch.int64)
    if judge.shape[1] != judge_size(W):
        raise SPDInputError(f"judge must be [{B}, {judge_size(W)}], got {tuple(judge.shape)}")


def _width(lanes) -> int:
    if not lanes or lanes[0].dim() != 3:
        raise SPDInputError("lanes must start with tok [B, R, W]")
    return lanes[0].shape[2]


# ------------------------------------------------------------------------------------------------
# tree_open: the cycle's layout before its stage and draft steps
# ------------------------------------------------------------------------------------------------

@op("tree_open", mutates=("tplan", "mask", "window", "draws"))
def tree_open(state: torch.Tensor, units: torch.Tensor, consts: torch.Tensor,
              lanes: list[torch.Tensor], tokens: torch.Tensor, anchors: torch.Tensor,
              type_of_depth: torch.Tensor, tplan: torch.Tensor, mask: torch.Tensor,
              window: torch.Tensor, extra: int = 0, draws: torch.Tensor | None = None, *,
              backend: str | None = None) -> None:
    """Lay out a cycle of B token trees (module docstring). state [B, S], units [B, n, H],
    consts [B, 5], lanes (LANES, [B, R, W] ...), tokens [B, C] int64, anchors [B, m, C, d]:
    each sequence's buffers; type_of_depth [n + 1] int64. Writes tplan [B, TP], mask
    [B, R W, R W] bool, window [B, m, R W, d] (the window's anchors; nothing where `extra`:
    post-step features, read after the stage steps) and, given draws [B, D] float32, every
    sequence's uniforms this cycle (spd_kernels.control's). extra: 1 when the drafter reads
    features one stage deeper. The context lookup (consts' lookup_min > 0) matches the
    committed tokens and the branch of the best leaf (tplan's found, length)."""
    W = _width(lanes)
    B, n, dev = _check_tree_batch(state, units, consts, W)
    _check_tree_lanes(list(lanes), B, n, W, dev)
    _check_rows("tokens", tokens, B, dev, torch.int64)
    _check_rows("anchors", anchors, B, dev, dim=4, floating=True)
    C = tokens.shape[1]
    if anchors.shape[2] != C:
        raise SPDInputError(f"anchors [B, m, C, d] must have tokens' C = {C} rows, got "
                            f"{tuple(anchors.shape)}")
    check_tensor("type_of_depth", type_of_depth, dim=1, dtype=torch.int64, device=dev)
    if type_of_depth.shape[0] != n + 1:
        raise SPDInputError(f"type_of_depth must be [{n + 1}], got {tuple(type_of_depth.shape)}")
    _check_tplan(tplan, B, n, W, dev)
    RW = (n + 1) * W
    _check_rows("mask", mask, B, dev, torch.bool, dim=3)
    if tuple(mask.shape) != (B, RW, RW):
        raise SPDInputError(f"mask must be [{B}, {RW}, {RW}], got {tuple(mask.shape)}")
    want = (B, anchors.shape[1], RW, anchors.shape[3])
    _check_rows("window", window, B, dev, dim=4, floating=True)
    if tuple(window.shape) != want or window.dtype != anchors.dtype:
        raise SPDInputError(f"window must be {list(want)} {anchors.dtype} like the anchors, got "
                            f"{list(window.shape)} {window.dtype}")
    if extra not in (0, 1):
        raise SPDInputError(f"extra must be 0 or 1, got {extra!r}")
    check_draws(draws, B, dev)
    dispatch.call("tree_open", dev, state, units, consts, list(lanes), tokens, anchors,
                  type_of_depth, tplan, mask, window, extra, draws, backend=backend)


@tree_open.register_fake
def _(state, units, consts, lanes, tokens, anchors, type_of_depth, tplan, mask, window,
      extra=0, draws=None):
    return None


@dispatch.register("tree_open", "reference")
def tree_open_reference(state, units, consts, lanes, tokens, anchors, type_of_depth, tplan,
                        mask, window, extra, draws):
    if draws is not None:
        draw_reference(state, consts, draws)
    n, W, dev = units.shape[1], lanes[0].shape[2], state.device
    R = n + 1
    L_tok, _, _, L_alive, _, L_anc, L_clane, _ = lanes
    offsets = torch.arange(R, device=dev)
    stage_ids = torch.arange(n, device=dev)
    lane_ids = torch.arange(W, device=dev)
    back = (offsets.view(-1, 1) - offsets.view(1, -1)).clamp(min=0)   # [k, k']: k - k' back
    back = back.view(R, 1, R).expand(R, W, R)
    before = offsets.view(-1, 1) >= offsets.view(1, -1)                 # k' <= k
    eye = torch.eye(R * W, dtype=torch.bool, device=dev)
    for b in range(state.shape[0]):
        st, u, c = state[b], units[b], consts[b]
        trash = c[TRASH]
        capacity = trash - R * W
        live = st[DONE] == 0
        committed, newest = st[COMMITTED], st[NEWEST]
        start = committed - 1
        final = start - st[EMITTED]  # the last cycle's start (the drafter's window)
        ulive = (u[:, LIVE] == 1) & live
        occ = torch.where(ulive, u[:, POS], -1)  # the position at each depth
        # where each stage's rows land: a live row's slot, or its position where it was
        # committed since its unit was sent, else trash
        upos = u[:, POS]
        ur = upos % R
        u_alive = L_alive[b].index_select(0, ur) & ulive.view(-1, 1)
        at_pos = ((upos < committed).view(-1, 1)
                  & (lane_ids == L_clane[b].index_select(0, ur).view(-1, 1)))
        rows = torch.where(u_alive, torch.where(at_pos, upos.view(-1, 1),
                                                tree_slot(capacity, upos.view(-1, 1), lane_ids,
                                                          R, W)), trash)
        # the window: R positions from w0, W rows each; depth as for a chain
        w0 = torch.maximum(newest - n, final).clamp(min=0)
        pos = w0 + offsets
        at = (occ.view(1, n) == pos.view(-1, 1)).to(torch.int64)
        depth = torch.where(pos < start, n, (at * stage_ids).sum(1))
        types = type_of_depth[(depth + extra).clamp(max=n)]
        # (in range for a finished sequence too, whose newest may lie below its window)
        last = (newest - w0).clamp(0, n)
        # each row's ancestors (a committed row is lane 0, its ancestors too)
        rw = pos % R
        committed_row = pos <= start
        alive = torch.where(committed_row.view(-1, 1), lane_ids == 0, L_alive[b].index_select(0, rw))
        alive = alive & (pos <= newest).view(-1, 1)
        anc = L_anc[b].index_select(0, rw).gather(2, back)                # [k, l, k']
        anc = torch.where(committed_row.view(1, 1, -1), 0, anc)
        seen = (before.view(R, 1, R, 1) & (anc.unsqueeze(-1) == lane_ids)  # [k, l, k', l']
                & alive.view(R, W, 1, 1) & alive.view(1, 1, R, W))
        # a dead row sees itself alone (never NaN; no live row sees it)
        mask[b] = seen.reshape(R * W, R * W) | eye
        at_own = committed_row.view(-1, 1)
        buf = torch.where(alive, torch.where(at_own, pos.view(-1, 1),
                                             tree_slot(capacity, pos.view(-1, 1), lane_ids, R, W)),
                          trash)
        pdm = torch.where(alive, torch.where(at_own, pos.view(-1, 1),
                                             capacity + offsets.view(-1, 1) * W + lane_ids), trash)
        leaves = last * W + lane_ids
        # the context lookup on the best leaf's branch: committed tokens, then its ancestors
        _, base = _leaf_base(lanes, b, newest, start, W)
        best = base.argmax()
        found = length = torch.zeros((), dtype=torch.int64, device=dev)
        if int(c[LOOKUP_MIN]):  # (the reference reads the host; the kernel does not)
            branch = anc[last, best]                                        # [k']
            mine = L_tok[b].index_select(0, rw).gather(1, branch.view(-1, 1)).view(-1)
            where_ = torch.where((pos > start) & (offsets <= last), pos, trash)
            ctx = tokens[b].clone().index_copy_(0, where_, mine)
            found, length = lookup_proposal(ctx, committed, newest, int(c[LOOKUP_MIN]))
        head = torch.stack([committed, newest, live.long(), (occ[n - 1] >= 0).long(), final, w0,
                            last, best, found, length])
        tplan[b].copy_(torch.cat([head, rows.view(-1), pos.repeat_interleave(W),
                                  types.repeat_interleave(W), buf.view(-1), pdm.view(-1), leaves]))
        if not extra:
            window[b].copy_(anchors[b].index_select(1, buf.view(-1)))


# ------------------------------------------------------------------------------------------------
# tree_children: after the draft step, the children and the judged position's candidates
# ------------------------------------------------------------------------------------------------

@op("tree_children", mutates=("kids", "kid_score", "judge", "judged_hidden"))
def tree_children(tplan: torch.Tensor, lanes: list[torch.Tensor], top: torch.Tensor,
                  top_ids: torch.Tensor, pmax: torch.Tensor, trust: torch.Tensor,
                  log_trust: torch.Tensor, kids: torch.Tensor, kid_score: torch.Tensor,
                  judge: torch.Tensor, final: torch.Tensor | None = None,
                  judged_hidden: torch.Tensor | None = None, *,
                  backend: str | None = None) -> None:
    """The children of each tree's newest position and its judged position's candidates
    (module docstring): tplan [B, TP] (tree_open's), lanes, the draft step's top [B, W, k]
    float32, top_ids [B, W, k] int64 and pmax [B, W] float32 -> kids [B, W, 4 + R],
    kid_score [B, W], judge [B, 1 + 5 W]. A child's score is its leaf's plus its
    log-probability; the W best of them (ties: the earlier leaf, then the more probable child)
    enter, with the context lookup's token (tplan's found, where length > 0 and the best leaf's
    pmax is below trust [L + 1] float32 at the match's length, or that trust is 1) competing
    at the best leaf's score plus log_trust [L + 1] (trust's logs), in first place among equals,
    and replacing the same child of the best leaf.

    final [B, C, d] (each sequence's last-stage rows): the row before the judged position,
    whose logits judge it, is copied to judged_hidden [B, d]."""
    check_tensor("tplan", tplan, dim=2, dtype=torch.int64)
    B, dev = tplan.shape[0], tplan.device
    W = _width(lanes)
    n = lanes[0].shape[1] - 1
    _check_tplan(tplan, B, n, W, dev)
    _check_tree_lanes(list(lanes), B, n, W, dev)
    _check_rows("top", top, B, dev, torch.float32, dim=3)
    k = top.shape[2]
    if top.shape[1] != W or not 1 <= k <= W:
        raise SPDInputError(f"top must be [{B}, {W}, k] with 1 <= k <= {W}, got "
                            f"{tuple(top.shape)}")
    _check_rows("top_ids", top_ids, B, dev, torch.int64, dim=3)
    if top_ids.shape != top.shape:
        raise SPDInputError(f"top_ids must be {tuple(top.shape)} like top, got "
                            f"{tuple(top_ids.shape)}")
    _check_rows("pmax", pmax, B, dev, torch.float32)
    if tuple(pmax.shape) != (B, W):
        raise SPDInputError(f"pmax must be [{B}, {W}], got {tuple(pmax.shape)}")
    for name, t in (("trust", trust), ("log_trust", log_trust)):
        check_tensor(name, t, dim=1, dtype=torch.float32, device=dev)
        if t.shape[0] != LOOKUP_MAX + 1:
            raise SPDInputError(f"{name} must be [{LOOKUP_MAX + 1}], got {tuple(t.shape)}")
    _check_kids(kids, kid_score, judge, B, n, W, dev)
    if (final is None) != (judged_hidden is None):
        raise SPDInputError("final and judged_hidden go together")
    if final is not None:
        _check_rows("final", final, B, dev, dim=3, floating=True)
        _check_rows("judged_hidden", judged_hidden, B, dev, final.dtype)
        if judged_hidden.shape[1] != final.shape[2]:
            raise SPDInputError(f"judged_hidden must be [{B}, {final.shape[2]}] like final's "
                                f"rows, got {tuple(judged_hidden.shape)}")
    dispatch.call("tree_children", dev, tplan, list(lanes), top, top_ids, pmax, trust,
                  log_trust, kids, kid_score, judge, final, judged_hidden, backend=backend)


@tree_children.register_fake
def _(tplan, lanes, top, top_ids, pmax, trust, log_trust, kids, kid_score, judge, final=None,
      judged_hidden=None):
    return None


@dispatch.register("tree_children", "reference")
def tree_children_reference(tplan, lanes, top, top_ids, pmax, trust, log_trust, kids,
                            kid_score, judge, final, judged_hidden):
    W, k, dev = top.shape[1], top.shape[2], top.device
    R = lanes[0].shape[1]
    n = R - 1
    L_tok, _, _, L_alive, L_look, L_anc, _, L_fill = lanes
    lane_ids = torch.arange(W, device=dev)
    earlier = lane_ids.view(1, -1) < lane_ids.view(-1, 1)  # [i, j]: j before i
    for b in range(tplan.shape[0]):
        p = tplan[b]
        committed, newest = p[T_COMMITTED], p[T_NEWEST]
        start, best, length = committed - 1, p[T_BEST], p[T_LENGTH]
        leaf_alive, base = _leaf_base(lanes, b, newest, start, W)
        # every leaf's k children, scored; the lookup's token at its trust
        scores = torch.where(leaf_alive.view(W, 1), base.view(W, 1) + top[b], NEG_INF).view(-1)
        parents = lane_ids.view(W, 1).expand(W, k).reshape(-1)
        tokens = top_ids[b].reshape(-1)
        trusted = trust[length]
        use = (length > 0) & ((trusted >= 1.0) | (pmax[b, best] < trusted))
        look_tok = p[T_FOUND]
        look_score = torch.where(use, base[best] + log_trust[length], NEG_INF)
        # (the lookup's token replaces the same child of the same leaf)
        scores = torch.where(use & (parents == best) & (tokens == look_tok), NEG_INF, scores)
        all_scores = torch.cat([look_score.view(1), scores])
        all_tok = torch.cat([look_tok.view(1), tokens])
        all_par = torch.cat([best.view(1), parents])
        order = torch.sort(all_scores, descending=True, stable=True).indices[:W]
        score, par = all_scores[order], all_par[order]
        # each child's ancestors: itself, then its leaf's (kept with the leaf's row)
        leaf_rows = L_anc[b, newest % R]                                    # [W, R]
        anc = torch.cat([lane_ids.view(W, 1), leaf_rows.index_select(0, par)[:, :n]], 1)
        alive = score > NEG_INF
        look = order == 0
        kids[b].copy_(torch.cat([torch.stack([all_tok[order], par, alive.long(), look.long()], 1),
                                 anc], 1))
        kid_score[b].copy_(score)
        # the judged position's candidates: its rows in flight, or after a gap the children
        j = committed
        rj = j % R
        in_flight = j <= newest
        c_tok = torch.where(in_flight, L_tok[b, rj], all_tok[order])
        c_alive = torch.where(in_flight, L_alive[b, rj], alive)
        c_look = torch.where(in_flight, L_look[b, rj], look)
        fill = torch.where(in_flight, L_fill[b, rj], newest - start + 1)
        # the verifier's order: live rows first, in lane order (their scores' order); a judged
        # position's rows share one parent, so their tokens differ, but a cycle that judges
        # nothing (filling, past the end) may see stale rows: a repeated token is padding there
        by = torch.sort((~c_alive).to(torch.int64), stable=True).indices
        tok_o, live_o = c_tok[by], c_alive[by]
        repeat = ((tok_o.view(-1, 1) == tok_o.view(1, -1)) & live_o.view(1, -1) & earlier).any(1)
        cands = torch.where(live_o & ~repeat, tok_o, -1)
        judge[b].copy_(torch.cat([fill.view(1), c_tok, c_alive.long(), c_look.long(), cands,
                                  by]))
        if final is not None:
            judged_hidden[b].copy_(final[b, start.clamp(min=0)])


# ------------------------------------------------------------------------------------------------
# tree_commit: judge, commit and lay out the next cycle's units
# ------------------------------------------------------------------------------------------------

@op("tree_commit", mutates=("state", "units", "lanes", "tokens", "anchors"))
def tree_commit(state: torch.Tensor, units: torch.Tensor, consts: torch.Tensor,
                tplan: torch.Tensor, kids: torch.Tensor, kid_score: torch.Tensor,
                judge: torch.Tensor, lanes: list[torch.Tensor], tokens: torch.Tensor,
                anchors: torch.Tensor, embed_weight: torch.Tensor, stop_ids: torch.Tensor,
                verdict: torch.Tensor, accepted: torch.Tensor | None = None,
                margin: int = 0, *, backend: str | None = None) -> None:
    """Judge and commit a cycle of B token trees, and lay out the next (module docstring; the
    runtime's README, "How a cycle works", steps 3 and 4). verdict [B] int64: the target's
    token for the judged position: a greedy sequence's argmax, matched here against the
    candidates; a sampled one's from the tree's recursive rejection, with accepted [B] int64
    the index of the accepted candidate in judge's order (-1: none; None: every sequence is
    greedy, else consts' `greedy` says which are). The accepted row's descendants live on,
    the others die; the children enter (unless the accepted branch ends before the newest
    position: then nothing does, a gap), or after a rejection the correction alone.
    Writes state, units, lanes, tokens [B, C] and anchors [B, m, C, d] (the accepted row's
    anchors move to its position; slot 0 gets the entering rows' embeddings, rows of
    embed_weight [V, d]); stop_ids [B, T] int64 (-1: none) end a decode, as its budget does;
    margin: the cycles from the end's to the last one
    launched (spd.runtime.cycle.Cycle)."""
    W = _width(lanes)
    B, n, dev = _check_tree_batch(state, units, consts, W)
    _check_tplan(tplan, B, n, W, dev)
    _check_kids(kids, kid_score, judge, B, n, W, dev)
    _check_tree_lanes(list(lanes), B, n, W, dev)
    _check_rows("tokens", tokens, B, dev, torch.int64)
    _check_rows("anchors", anchors, B, dev, dim=4, floating=True)
    check_tensor("embed_weight", embed_weight, dim=2, dtype=anchors.dtype, device=dev)
    if anchors.shape[2] != tokens.shape[1] or anchors.shape[3] != embed_weight.shape[1]:
        raise SPDInputError(f"anchors must be [{B}, m, {tokens.shape[1]}, "
                            f"{embed_weight.shape[1]}], got {tuple(anchors.shape)}")
    _check_rows("stop_ids", stop_ids, B, dev, torch.int64)
    _check_rows("verdict", verdict, B, dev, torch.int64, dim=1)
    if accepted is not None:
        _check_rows("accepted", accepted, B, dev, torch.int64, dim=1)
    if margin < 1:
        raise SPDInputError(f"margin must be at least 1 cycle, got {margin!r}")
    dispatch.call("tree_commit", dev, state, units, consts, tplan, kids, kid_score, judge,
                  list(lanes), tokens, anchors, embed_weight, stop_ids, verdict, accepted,
                  margin, backend=backend)


@tree_commit.register_fake
def _(state, units, consts, tplan, kids, kid_score, judge, lanes, tokens, anchors,
      embed_weight, stop_ids, verdict, accepted=None, margin=0):
    return None


@dispatch.register("tree_commit", "reference")
def tree_commit_reference(state, units, consts, tplan, kids, kid_score, judge, lanes, tokens,
                          anchors, embed_weight, stop_ids, verdict, accepted, margin):
    n, dev = units.shape[1], state.device
    W = lanes[0].shape[2]
    R = n + 1
    L_tok, L_par, L_score, L_alive, L_look, L_anc, L_clane, L_fill = lanes
    lane_ids = torch.arange(W, device=dev)
    first = lane_ids == 0
    steps = torch.arange(1, n, device=dev)  # the positions after a judged one
    steps_back = steps.view(-1, 1, 1).expand(n - 1, W, 1)
    for b in range(state.shape[0]):
        st, u, c, p, J = state[b], units[b], consts[b], tplan[b], judge_fields(judge[b], W)
        trash = c[TRASH]
        capacity = trash - R * W
        ch = kids[b]
        ch_tok, ch_par = ch[:, K_TOK], ch[:, K_PAR]
        ch_alive, ch_look, ch_anc = ch[:, K_ALIVE] == 1, ch[:, K_LOOK] == 1, ch[:, len(KID):]
        committed, newest = p[T_COMMITTED], p[T_NEWEST]
        live, full = p[T_LIVE] == 1, (p[T_FULL] == 1) & (p[T_LIVE] == 1)
        start, j = committed - 1, committed
        rj = j % R
        count = newest - start + 1
        in_flight = j <= newest
        c_tok, c_alive, c_look = J["tok"], J["alive"] == 1, J["look"] == 1
        # 3. the verdict: a greedy target's token against the live candidates, or the sampled
        #    one's accepted candidate
        token = verdict[b]
        match = c_alive & (c_tok == token)
        ok, lane = match.any(), match.to(torch.int64).argmax()
        if accepted is not None:
            which = accepted[b]
            sampled = c[GREEDY] == 0
            ok = torch.where(sampled, which >= 0, ok)
            lane = torch.where(sampled, J["order"][which.clamp(min=0)], lane)
        ok = ok & full
        rejected = full & ~ok
        acc_in, acc_gap = ok & in_flight, ok & ~in_flight
        made = st[N] + full
        ended = full & ((token == stop_ids[b]).any() | (made + 1 >= c[MAX_NEW]))
        going = live & ~ended
        # 4. what survives an accepted row: its descendants, up to `keep`
        chosen = lane_ids == lane
        L_alive[b, rj] = torch.where(acc_in, chosen, L_alive[b, rj])
        L_clane[b, rj] = torch.where(acc_in, lane, L_clane[b, rj])
        # the rows at j + 1 .. j + n - 1 whose ancestor at j is the accepted row live on
        later = j + steps
        rl = later % R
        descends = L_anc[b].index_select(0, rl).gather(2, steps_back).view(n - 1, W) == lane
        kept = L_alive[b].index_select(0, rl) & descends & (later <= newest).view(-1, 1)
        L_alive[b].index_copy_(0, rl, torch.where(acc_in, kept, L_alive[b].index_select(0, rl)))
        keep = torch.where(acc_in, torch.where(kept.any(1), later, j).amax(), newest)
        leaf = torch.where(newest == j, chosen, kept.index_select(
            0, (newest - j - 1).clamp(min=0).view(1)).view(W))
        child_ok = ch_alive & torch.where(acc_in, leaf.index_select(0, ch_par), True)
        draft_in = going & (~full | (acc_in & (keep == newest))) & child_ok.any()
        commit_in = going & (rejected | acc_gap)
        enters = draft_in | commit_in
        new_newest = torch.where(draft_in, newest + 1,
                                 torch.where(commit_in, j, torch.where(acc_in, keep, newest)))
        enter = torch.where(commit_in, j, torch.where(draft_in, newest + 1, new_newest + 1))
        e_tok = torch.where(commit_in, torch.where(first, token, 0), ch_tok)
        e_alive = torch.where(commit_in, first, child_ok) & enters
        re = enter % R
        L_tok[b, re], L_alive[b, re] = e_tok, e_alive
        L_look[b, re], L_fill[b, re] = ch_look & ~commit_in, count
        L_par[b, re] = ch_par
        L_score[b, re] = torch.where(commit_in, 0.0, kid_score[b])
        L_clane[b, re] = torch.where(commit_in, 0, -1)
        L_anc[b, re] = torch.where(commit_in, 0, ch_anc)
        # the buffers: the committed token at its position, the entering rows' tokens and
        # embeddings where they live; the accepted row's anchors move to its position
        tokens[b, torch.where(full, j, trash)] = token
        e_rows = torch.where(e_alive, torch.where(commit_in & first, enter,
                                                  tree_slot(capacity, enter, lane_ids, R, W)),
                             trash)
        # (trash to trash where nothing was accepted: a free slot's zero constants name no slot)
        src = torch.where(acc_in, tree_slot(capacity, j, lane, R, W), trash)
        anchors[b, :, torch.where(acc_in, j, trash)] = anchors[b, :, src].clone()
        tokens[b].index_copy_(0, e_rows, e_tok)
        anchors[b, 0].index_copy_(0, e_rows, embed_weight[e_tok])
        # the counts: the judged draft by draft position, the lookup's, N, K, the stage rows
        fill = J["fill"]
        st[len(STATE) + 2 * fill] += full
        st[len(STATE) + 2 * fill + 1] += ok
        looked = torch.where(ok, c_look[lane], (c_look & c_alive).any()) & full
        st[LOOKUP_JUDGED] += looked & (c[LOOKUP_MIN] > 0)
        st[LOOKUP_ACCEPTED] += looked & ok & (c[LOOKUP_MIN] > 0)
        done = ~live | ended
        cycle = st[CYCLE] + 1
        end = torch.where((st[END_CYCLE] == 0) & ended, cycle + margin, st[END_CYCLE])
        rows = (tplan_fields(p, n, W)["rows"] != trash).sum()
        st[:LOOKUP_JUDGED].copy_(torch.stack([
            committed + full, new_newest, done.long(), st[K] + live, made,
            st[STAGE_ROWS] + torch.where(live, rows, 0), full.long(), token, cycle, end]))
        # the next cycle's units: the one entering stage 0, then each stage's moved one on
        # (those past the last surviving position, or all after a rejection, die)
        prefix = torch.where(commit_in, j, committed + full)
        cpos = torch.where(acc_in, j, trash)
        cslot = torch.where(acc_in, src, trash)
        head = tree_unit(enter, end, enters, commit_in, e_tok, e_alive, prefix, cpos, cslot,
                         trash, capacity, n, ch_anc[:, :n])
        bound = torch.where(rejected, -1, torch.where(acc_in, keep, newest))
        moved = u[:-1].clone()
        moved[:, LIVE] = ((moved[:, LIVE] == 1) & (moved[:, POS] <= bound) & ~done).long()
        u.copy_(torch.cat([head.view(1, -1), moved]))


__all__ = ["tree_open", "tree_children", "tree_commit", "tree_unit", "tree_slot", "TPLAN",
           "KID", "LANES", "tplan_size", "tplan_fields", "judge_size", "judge_fields",
           "tree_unit_size"]


dispatch.defer("tree_open", "triton", "spd_kernels.tree_control_triton")
dispatch.defer("tree_children", "triton", "spd_kernels.tree_control_triton")
dispatch.defer("tree_commit", "triton", "spd_kernels.tree_control_triton")
