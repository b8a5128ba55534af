"""A decode cycle's control as three ops: lay out the cycle, pick the judged candidate, commit.

Between its stage steps and its draft step, a cycle (spd.runtime.cycle) decides on the device
what every stage runs, what the drafter reads, what is judged and what enters next. Written as
torch ops that is about 150 launches of one or two scalars each, one after another: on a GPU
some 200 us a cycle on the critical path. Here it is three ops over a batch of B sequences, one
program a sequence in the Triton kernels (spd_kernels.control_triton); the PyTorch reference of
each is the cycle's own code, and the specification.

Terms (the runtime's: spd.runtime.cycle, spd.runtime.unit, spd.runtime.drafting).
  state   int64 [B, S]: the fields `STATE`, then the judged and accepted drafts by draft
          position [n + 1, 2].
  units   int64 [B, n, H]: the unit each stage runs this cycle; its header fields `UNIT`, then
          the rows' tokens (a chain: one).
  lanes   the rows in flight by position mod R (R = n + 1): tok [B, R] int64, alive [B, R]
          bool, look [B, R] bool (the context lookup proposed it), fill [B, R] int64 (its draft
          position).
  consts  int64 [B, 5]: each sequence's `CONST` (trash row, token budget, lookup's shortest
          match: 0 off, greedy: 1 / sampled: 0, the key of its draws: spd_kernels.philox).
  draws   float32 [B, D]: each sequence's uniforms this cycle, Philox of its key at offsets
          cycle * D + j (spd_kernels.philox), written by the op that lays the cycle out.
  plan    int64 [B, P]: what `cycle_open` lays out (`PLAN`, then rows [n]: where each stage's
          unit rows land, window positions [n + 1] and their feature types [n + 1]).
  cand    int64 [B, 6]: what `cycle_candidate` picks (`CAND`): the child that enters if any,
          whether the lookup proposed it, and the judged position's candidate.

The ops take a chain (one row a position); a token tree's are spd_kernels.tree_control's.
"""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels.checks import SPDInputError, check_tensor
from spd_kernels.opdef import op
from spd_kernels.philox import philox_uniform

# the cycle's state fields (spd.runtime.cycle), then by_position [n + 1, 2]
STATE = ("committed", "newest", "done", "K", "N", "stage_rows", "emitted", "token", "cycle",
         "end", "lookup_judged", "lookup_accepted")
(COMMITTED, NEWEST, DONE, K, N, STAGE_ROWS, EMITTED, TOKEN, CYCLE, END_CYCLE, LOOKUP_JUDGED,
 LOOKUP_ACCEPTED) = range(len(STATE))
# a unit's header (spd.runtime.unit), then tokens [W] (and a tree's slots, keys and mask)
UNIT = ("position", "end", "live", "prefix", "commit_position", "commit_slot")
POS, END, LIVE, PREFIX, CPOS, CSLOT = range(len(UNIT))
# per-sequence constants
CONST = ("trash", "max_new", "lookup_min", "greedy", "key")
TRASH, MAX_NEW, LOOKUP_MIN, GREEDY, KEY = range(len(CONST))
# cycle_open's plan, then rows [n], window positions [n + 1], window types [n + 1]
PLAN = ("committed", "newest", "live", "full", "final", "w0", "last", "child", "found", "length")
(P_COMMITTED, P_NEWEST, P_LIVE, P_FULL, P_FINAL, P_W0, P_LAST, P_CHILD, P_FOUND,
 P_LENGTH) = range(len(PLAN))
# cycle_candidate's picks
CAND = ("child", "child_look", "token", "alive", "look", "fill")
C_CHILD, C_CHILD_LOOK, C_TOK, C_ALIVE, C_LOOK, C_FILL = range(len(CAND))
LOOKUP_MAX = 6  # the longest context match tried (spd.draft.lookup.MAX_LEN)


def state_size(n: int) -> int:
    return len(STATE) + 2 * (n + 1)


def plan_size(n: int) -> int:
    return len(PLAN) + n + 2 * (n + 1)


def plan_rows(plan: torch.Tensor, n: int) -> torch.Tensor:
    """[..., n]: where each stage's unit rows land this cycle (a dead unit's: the trash row)."""
    return plan[..., len(PLAN):len(PLAN) + n]


def plan_window(plan: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([..., n + 1] positions, [..., n + 1] feature types) of the drafter's window."""
    at = len(PLAN) + n
    return plan[..., at:at + n + 1], plan[..., at + n + 1:at + 2 * (n + 1)]


# ------------------------------------------------------------------------------------------------
# the context lookup, as fixed-shape device work
# ------------------------------------------------------------------------------------------------

def lookup_proposal(tokens, committed, newest, min_len: int, max_len: int = LOOKUP_MAX):
    """The token that followed the latest earlier occurrence of the context's last k tokens
    (spd.draft.lookup): tokens [C] int64, positions < `committed` (0-d int64) committed, then
    those in flight up to `newest` (0-d int64) -> (token, match length), 0-d int64 each; length
    0: no match. An occurrence ends at j with a committed successor (j + 1 < committed); the
    latest one wins, and the longest k in [min_len, max_len] that the context holds (the last
    max_len committed tokens and those in flight)."""
    C, dev = tokens.shape[0], tokens.device
    j = torch.arange(C, device=dev).view(C, 1)  # where an earlier occurrence ends
    i = torch.arange(max_len, device=dev)       # how far back from the end
    at = (j - i).clamp(min=0)
    back = (newest - i).clamp(min=0)
    # run[j, k - 1]: the k tokens ending at j equal the k ending at newest
    run = (tokens[at] == tokens[back]).cumprod(1).bool()
    k = i + 1
    ok = run & (j + 1 < committed) & (j >= k - 1)
    last = torch.where(ok, j, -1).amax(0)  # [max_len]: the latest end for each k
    held = torch.clamp(committed, max=max_len) + newest + 1 - committed  # the context's length
    usable = (last >= 0) & (k >= min_len) & (k <= held)
    length = torch.where(usable, k, 0).amax()
    end = last.index_select(0, (length - 1).clamp(min=0).view(1))
    token = tokens.index_select(0, (end + 1).clamp(max=C - 1)).view(())
    return token, length


# ------------------------------------------------------------------------------------------------
# argument checks (shapes, dtypes, devices: never a value, which would read the device)
# ------------------------------------------------------------------------------------------------

def _check_batch(state, units, consts):
    check_tensor("state", state, dim=2, dtype=torch.int64)
    dev, B = state.device, state.shape[0]
    check_tensor("units", units, dim=3, dtype=torch.int64, device=dev)
    n = units.shape[1]
    if n < 1 or units.shape[0] != B:
        raise SPDInputError(f"units must be [B={B}, n, H] with n >= 1, got {tuple(units.shape)}")
    if units.shape[2] != len(UNIT) + 1:
        raise SPDInputError(f"units must hold a chain's header [{len(UNIT) + 1}] (one token a "
                            f"unit; a token tree's units are not taken), got "
                            f"{units.shape[2]} fields")
    _check_state(state, consts, B, n, dev)
    return B, n, dev


def _check_state(state, consts, B, n, dev):
    if state.shape[1] != state_size(n):
        raise SPDInputError(f"state must be [B, {state_size(n)}] for n = {n}, got "
                            f"{tuple(state.shape)}")
    check_tensor("consts", consts, dim=2, dtype=torch.int64, device=dev)
    if tuple(consts.shape) != (B, len(CONST)):
        raise SPDInputError(f"consts must be [{B}, {len(CONST)}], got {tuple(consts.shape)}")


def check_draws(draws, B, dev):
    """draws [B, D] float32 (D >= 1), or None."""
    if draws is not None:
        _check_rows("draws", draws, B, dev, torch.float32)
        if draws.shape[1] < 1:
            raise SPDInputError(f"draws must be [{B}, D] with D >= 1, got {tuple(draws.shape)}")


def draw_reference(state, consts, draws) -> None:
    """Each sequence's uniforms this cycle into draws [B, D] (module docstring): Philox of its
    key at cycle * D + j."""
    D = draws.shape[1]
    offset = state[:, CYCLE:CYCLE + 1] * D + torch.arange(D, device=state.device)
    draws.copy_(philox_uniform(consts[:, KEY], offset))


def _check_rows(name, x, B, dev, dtype=None, dim=2, floating=False):
    check_tensor(name, x, dim=dim, dtype=dtype, device=dev, floating=floating)
    if x.shape[0] != B:
        raise SPDInputError(f"{name} must have the batch's {B} sequences first, got "
                            f"{tuple(x.shape)}")


def _check_plan(plan, B, n, dev):
    _check_rows("plan", plan, B, dev, torch.int64)
    if plan.shape[1] != plan_size(n):
        raise SPDInputError(f"plan must be [{B}, {plan_size(n)}] for n = {n}, got "
                            f"{tuple(plan.shape)}")


def _check_lanes(lanes, B, n, dev):
    dtypes = (torch.int64, torch.bool, torch.bool, torch.int64)
    if len(lanes) != 4:
        raise SPDInputError(f"lanes must be (tok, alive, look, fill), got {len(lanes)} tensors")
    for name, x, dtype in zip(("tok", "alive", "look", "fill"), lanes, dtypes):
        _check_rows(f"lanes.{name}", x, B, dev, dtype)
        if x.shape[1] != n + 1:
            raise SPDInputError(f"lanes.{name} must be [{B}, {n + 1}], got {tuple(x.shape)}")


# ------------------------------------------------------------------------------------------------
# cycle_open: the cycle's layout before its stage and draft steps
# ------------------------------------------------------------------------------------------------

@op("cycle_open", mutates=("plan", "window", "draws"))
def cycle_open(state: torch.Tensor, units: torch.Tensor, consts: torch.Tensor,
               tokens: torch.Tensor, anchors: torch.Tensor, type_of_depth: torch.Tensor,
               plan: torch.Tensor, window: torch.Tensor, extra: int = 0,
               draws: torch.Tensor | None = None, *, backend: str | None = None) -> None:
    """Lay out a cycle of B chains (module docstring). state [B, S], units [B, n, H],
    consts [B, 5], tokens [B, C] int64, anchors [B, m, C, d]: each sequence's buffers;
    type_of_depth [n + 1] int64: the feature type of a row at each depth. Writes plan [B, P]
    and window [B, m, n + 1, d] (the anchors of the drafter's window; nothing where `extra`:
    post-step features, read after the stage steps), and given draws [B, D] float32, every
    sequence's uniforms this cycle. extra: 1 when the drafter reads features one stage deeper
    (post-step drafting)."""
    B, n, dev = _check_batch(state, units, consts)
    _check_rows("tokens", tokens, B, dev, torch.int64)
    _check_rows("anchors", anchors, B, dev, dim=4, floating=True)
    if anchors.shape[2] != tokens.shape[1]:
        raise SPDInputError(f"anchors [B, m, C, d] must have tokens' C = {tokens.shape[1]} rows, "
                            f"got {tuple(anchors.shape)}")
    check_tensor("type_of_depth", type_of_depth, dim=1, dtype=torch.int64, device=dev)
    if type_of_depth.shape[0] != n + 1:
        raise SPDInputError(f"type_of_depth must be [{n + 1}], got {tuple(type_of_depth.shape)}")
    _check_plan(plan, B, n, dev)
    _check_rows("window", window, B, dev, dim=4, floating=True)
    want = (B, anchors.shape[1], n + 1, anchors.shape[3])
    if tuple(window.shape) != want or window.dtype != anchors.dtype:
        raise SPDInputError(f"window must be {list(want)} {anchors.dtype} like the anchors, got "
                            f"{list(window.shape)} {window.dtype}")
    if extra not in (0, 1):
        raise SPDInputError(f"extra must be 0 or 1, got {extra!r}")
    check_draws(draws, B, dev)
    dispatch.call("cycle_open", dev, state, units, consts, tokens, anchors, type_of_depth, plan,
                  window, extra, draws, backend=backend)


@cycle_open.register_fake
def _(state, units, consts, tokens, anchors, type_of_depth, plan, window, extra=0, draws=None):
    return None


@dispatch.register("cycle_open", "reference")
def cycle_open_reference(state, units, consts, tokens, anchors, type_of_depth, plan, window,
                         extra, draws):
    if draws is not None:
        draw_reference(state, consts, draws)
    n = units.shape[1]
    offsets = torch.arange(n + 1, device=state.device)
    stage_ids = torch.arange(n, device=state.device)
    for b in range(state.shape[0]):
        st, u, c = state[b], units[b], consts[b]
        live = st[DONE] == 0
        committed, newest = st[COMMITTED], st[NEWEST]
        start = committed - 1
        final = start - st[EMITTED]  # the last cycle's start (the drafter's window)
        ulive = (u[:, LIVE] == 1) & live
        occ = torch.where(ulive, u[:, POS], -1)  # the position at each depth
        rows = torch.where(ulive, u[:, POS], c[TRASH])
        # the window: n + 1 positions from w0; a row's depth is n below the ones in flight,
        # else the stage whose unit holds it
        w0 = torch.maximum(newest - n, final).clamp(min=0)  # (0: a free slot's zeroed rows)
        pos = w0 + offsets
        at = (occ.view(1, n) == pos.view(-1, 1)).to(torch.int64)
        depth = torch.where(pos < start, n, (at * stage_ids).sum(1))
        types = type_of_depth[(depth + extra).clamp(max=n)]
        found = length = torch.zeros((), dtype=torch.int64, device=state.device)
        if int(c[LOOKUP_MIN]):  # (the reference reads the host; the kernel does not)
            found, length = lookup_proposal(tokens[b], committed, newest, int(c[LOOKUP_MIN]))
        head = torch.stack([committed, newest, live.long(), (occ[n - 1] >= 0).long(), final, w0,
                            newest - w0, newest + 1, found, length])
        plan[b].copy_(torch.cat([head, rows, pos, types]))
        if not extra:
            window[b].copy_(anchors[b].index_select(1, pos))


# ------------------------------------------------------------------------------------------------
# cycle_candidate: after the steps, the child that enters and the judged position's candidate
# ------------------------------------------------------------------------------------------------

@op("cycle_candidate", mutates=("cand", "q_ring", "q_judged", "judged_hidden"))
def cycle_candidate(plan: torch.Tensor, lanes: list[torch.Tensor], draft: torch.Tensor,
                    cand: torch.Tensor, draft_p: torch.Tensor | None = None,
                    trust: torch.Tensor | None = None, q: torch.Tensor | None = None,
                    q_ids: torch.Tensor | None = None, q_ring: torch.Tensor | None = None,
                    q_judged: torch.Tensor | None = None, final: torch.Tensor | None = None,
                    judged_hidden: torch.Tensor | None = None, *,
                    backend: str | None = None) -> None:
    """The child of each chain's newest position and its judged candidate (module docstring):
    plan [B, P] (cycle_open's), lanes (tok, alive, look, fill [B, R]), draft [B] int64 (the
    drafter's token, a target id) -> cand [B, 6]. The context lookup's token (plan's `found`)
    replaces the draft where it matched (`length` > 0) and, given draft_p [B] float32 (the
    drafter's top probability), where that is below trust [L + 1] float32 at the match's length.

    Sampling: q [B, Vq] float32 is the draft's distribution; it is kept at the new position's
    row of q_ring [B, R, Vr], as it is (q_ids None: Vr = Vq) or over every target id (q_ids
    [Vq] int64: each column's target id, Vr = V), one-hot on the lookup's token where that was
    used; the judged position's row is copied to q_judged [B, Vr].

    final [B, C, d] (each sequence's last-stage rows): the row before the judged position, whose
    logits judge it, is copied to judged_hidden [B, d]."""
    check_tensor("plan", plan, dim=2, dtype=torch.int64)
    B, dev = plan.shape[0], plan.device
    n = (plan.shape[1] - len(PLAN) - 2) // 3
    _check_plan(plan, B, n, dev)
    _check_lanes(list(lanes), B, n, dev)
    _check_rows("draft", draft, B, dev, torch.int64, dim=1)
    _check_rows("cand", cand, B, dev, torch.int64)
    if cand.shape[1] != len(CAND):
        raise SPDInputError(f"cand must be [{B}, {len(CAND)}], got {tuple(cand.shape)}")
    if draft_p is not None:
        _check_rows("draft_p", draft_p, B, dev, torch.float32, dim=1)
        if trust is None:
            raise SPDInputError("draft_p needs the trust table (trust [L + 1] float32)")
    if trust is not None:
        check_tensor("trust", trust, dim=1, dtype=torch.float32, device=dev)
        if trust.shape[0] != LOOKUP_MAX + 1:
            raise SPDInputError(f"trust must be [{LOOKUP_MAX + 1}], got {tuple(trust.shape)}")
    if (q is None) != (q_ring is None) or (q is None) != (q_judged is None):
        raise SPDInputError("q, q_ring and q_judged go together (a sampled chain)")
    if q is not None:
        _check_rows("q", q, B, dev, torch.float32)
        _check_rows("q_ring", q_ring, B, dev, torch.float32, dim=3)
        _check_rows("q_judged", q_judged, B, dev, torch.float32)
        Vq, Vr = q.shape[1], q_ring.shape[2]
        if q_ring.shape[1] != n + 1 or tuple(q_judged.shape) != (B, Vr):
            raise SPDInputError(f"q_ring must be [{B}, {n + 1}, Vr] and q_judged [{B}, Vr], got "
                                f"{tuple(q_ring.shape)} and {tuple(q_judged.shape)}")
        if (q_ids is None and Vr != Vq) or Vr < Vq:
            raise SPDInputError(f"q_ring's {Vr} columns must be q's {Vq}, or every target id "
                                f"with q_ids naming q's")
        if q_ids is not None:
            check_tensor("q_ids", q_ids, dim=1, dtype=torch.int64, device=dev)
            if q_ids.shape[0] != Vq:
                raise SPDInputError(f"q_ids must be [{Vq}], got {tuple(q_ids.shape)}")
    if (final is None) != (judged_hidden is None):
        raise SPDInputError("final and judged_hidden go together")
    if final is not None:
        _check_rows("final", final, B, dev, dim=3, floating=True)
        _check_rows("judged_hidden", judged_hidden, B, dev, final.dtype)
        if judged_hidden.shape[1] != final.shape[2]:
            raise SPDInputError(f"judged_hidden must be [{B}, {final.shape[2]}] like final's "
                                f"rows, got {tuple(judged_hidden.shape)}")
    dispatch.call("cycle_candidate", dev, plan, list(lanes), draft, cand, draft_p, trust, q,
                  q_ids, q_ring, q_judged, final, judged_hidden, backend=backend)


@cycle_candidate.register_fake
def _(plan, lanes, draft, cand, draft_p=None, trust=None, q=None, q_ids=None, q_ring=None,
      q_judged=None, final=None, judged_hidden=None):
    return None


@dispatch.register("cycle_candidate", "reference")
def cycle_candidate_reference(plan, lanes, draft, cand, draft_p, trust, q, q_ids, q_ring,
                              q_judged, final, judged_hidden):
    tok, alive, look, fill = lanes
    R = tok.shape[1]
    for b in range(plan.shape[0]):
        p = plan[b]
        committed, newest = p[P_COMMITTED], p[P_NEWEST]
        used = p[P_LENGTH] > 0
        if draft_p is not None:  # the gate: the lookup's token where the drafter is less sure
            used = used & (draft_p[b] < trust.index_select(0, p[P_LENGTH:P_LENGTH + 1])[0])
        child = torch.where(used, p[P_FOUND], draft[b])
        # the judged position's candidate: its row in flight, or after a gap this cycle's child
        rj = committed % R
        in_flight = committed <= newest
        picked = torch.stack([
            child, used.long(), torch.where(in_flight, tok[b, rj], child),
            torch.where(in_flight, alive[b, rj], True).long(),
            torch.where(in_flight, look[b, rj], used).long(),
            torch.where(in_flight, fill[b, rj], newest - committed + 2)])
        cand[b].copy_(picked)
        if q is not None:  # the draft's q waits for its judgement at its position's row
            row = q[b]
            if q_ids is not None:  # over every target id
                row = torch.zeros(q_ring.shape[2], device=q.device).index_copy_(0, q_ids, row)
            ids = torch.arange(q_ring.shape[2], device=q.device)
            row = torch.where(used, (ids == p[P_FOUND]).float(), row)  # (never without lookup)
            q_ring[b, (newest + 1) % R] = row
            q_judged[b].copy_(q_ring[b, rj])
        if final is not None:
            judged_hidden[b].copy_(final[b, (committed - 1).clamp(min=0)])


# ------------------------------------------------------------------------------------------------
# cycle_commit: judge, commit and lay out the next cycle's units
# ------------------------------------------------------------------------------------------------

@op("cycle_commit", mutates=("state", "units", "lanes", "tokens", "embedded"))
def cycle_commit(state: torch.Tensor, units: torch.Tensor, consts: torch.Tensor,
                 plan: torch.Tensor, cand: torch.Tensor, lanes: list[torch.Tensor],
                 tokens: torch.Tensor, embedded: torch.Tensor, embed_weight: torch.Tensor,
                 stop_ids: torch.Tensor, verdict: torch.Tensor,
                 accepted: torch.Tensor | None = None, margin: int = 0, *,
                 backend: str | None = None) -> None:
    """Judge and commit a cycle of B chains, and lay out the next (module docstring; the
    runtime's README, "How a cycle works", steps 3 and 4). verdict [B] int64: the target's
    token for the judged position: a greedy sequence's argmax, compared here with the
    candidate; a sampled one's from rejection sampling, with accepted [B] bool its verdict on
    the candidate (None: every sequence is greedy; else consts' `greedy` says which are).
    Writes state, units, lanes (tok, alive, look, fill [B, R]), tokens [B, C] and embedded
    [B, C, d] (slot 0 of the anchors: the entering token's embedding, a row of embed_weight
    [V, d]); stop_ids [B, T] int64 (-1: none) end a decode, as its budget does;
    margin: the cycles from the end's to the last one launched (spd.runtime.cycle.Cycle)."""
    B, n, dev = _check_batch(state, units, consts)
    _check_plan(plan, B, n, dev)
    _check_rows("cand", cand, B, dev, torch.int64)
    if cand.shape[1] != len(CAND):
        raise SPDInputError(f"cand must be [{B}, {len(CAND)}], got {tuple(cand.shape)}")
    _check_lanes(list(lanes), B, n, dev)
    _check_rows("tokens", tokens, B, dev, torch.int64)
    _check_rows("embedded", embedded, B, dev, dim=3, floating=True)
    check_tensor("embed_weight", embed_weight, dim=2, dtype=embedded.dtype, device=dev)
    if embedded.shape[1] != tokens.shape[1] or embedded.shape[2] != embed_weight.shape[1]:
        raise SPDInputError(f"embedded must be [{B}, {tokens.shape[1]}, "
                            f"{embed_weight.shape[1]}], got {tuple(embedded.shape)}")
    _check_rows("stop_ids", stop_ids, B, dev, torch.int64)
    _check_rows("verdict", verdict, B, dev, torch.int64, dim=1)
    if accepted is not None:
        _check_rows("accepted", accepted, B, dev, torch.bool, dim=1)
    if margin < 1:
        raise SPDInputError(f"margin must be at least 1 cycle, got {margin!r}")
    dispatch.call("cycle_commit", dev, state, units, consts, plan, cand, list(lanes), tokens,
                  embedded, embed_weight, stop_ids, verdict, accepted, margin, backend=backend)


@cycle_commit.register_fake
def _(state, units, consts, plan, cand, lanes, tokens, embedded, embed_weight, stop_ids,
      verdict, accepted=None, margin=0):
    return None


@dispatch.register("cycle_commit", "reference")
def cycle_commit_reference(state, units, consts, plan, cand, lanes, tokens, embedded,
                           embed_weight, stop_ids, verdict, accepted, margin):
    n = units.shape[1]
    R = n + 1
    L_tok, L_alive, L_look, L_fill = lanes
    for b in range(state.shape[0]):
        st, u, c, p, ch = state[b], units[b], consts[b], plan[b], cand[b]
        trash = c[TRASH]
        committed, newest = p[P_COMMITTED], p[P_NEWEST]
        live, full = p[P_LIVE] == 1, (p[P_FULL] == 1) & (p[P_LIVE] == 1)
        j, count = committed, newest - committed + 2  # the judged position; tokens in flight
        in_flight = j <= newest
        c_tok, c_alive, c_look = ch[C_TOK], ch[C_ALIVE] == 1, ch[C_LOOK] == 1
        token = verdict[b]
        ok = c_alive & (c_tok == token)
        if accepted is not None:
            ok = torch.where(c[GREEDY] == 1, ok, accepted[b])
        ok = ok & full
        rejected = full & ~ok
        acc_in, acc_gap = ok & in_flight, ok & ~in_flight
        made = st[N] + full
        ended = full & ((token == stop_ids[b]).any() | (made + 1 >= c[MAX_NEW]))
        going = live & ~ended
        # what enters stage 0 next: the child (filling, or its parent accepted in flight), or
        # the correction (a rejection, or an accepted gap's token), or nothing
        draft_in = going & (~full | acc_in)
        commit_in = going & (rejected | acc_gap)
        enters = draft_in | commit_in
        new_newest = torch.where(draft_in, newest + 1, torch.where(commit_in, j, newest))
        enter = torch.where(commit_in, j, torch.where(draft_in, newest + 1, new_newest + 1))
        e_tok = torch.where(commit_in, token, ch[C_CHILD])
        r = enter % R
        L_tok[b, r], L_alive[b, r] = e_tok, enters
        L_look[b, r], L_fill[b, r] = (ch[C_CHILD_LOOK] == 1) & ~commit_in, count
        # the buffers: the committed token at its position, the entering one's token and
        # embedding at its own
        tokens[b, torch.where(full, j, trash)] = token
        e_row = torch.where(enters, enter, trash)
        tokens[b, e_row] = e_tok
        embedded[b, e_row] = embed_weight[e_tok]
        # the counts: the judged draft by its draft position, the lookup's, N, K, stage rows
        fill = ch[C_FILL]
        st[len(STATE) + 2 * fill] += full
        st[len(STATE) + 2 * fill + 1] += ok
        looked = torch.where(ok, c_look, c_look & c_alive) & full
        st[LOOKUP_JUDGED] += looked & (c[LOOKUP_MIN] > 0)
        st[LOOKUP_ACCEPTED] += looked & ok & (c[LOOKUP_MIN] > 0)
        done = ~live | ended
        cycle = st[CYCLE] + 1
        end = torch.where((st[END_CYCLE] == 0) & ended, cycle + margin, st[END_CYCLE])
        rows = (plan_rows(p, n) != trash).sum()
        st[:LOOKUP_JUDGED].copy_(torch.stack([
            committed + full, new_newest, done.long(), st[K] + live, made,
            st[STAGE_ROWS] + torch.where(live, rows, 0), full.long(), token, cycle, end]))
        # the next cycle's units: the one entering stage 0, then each stage's moved on (those
        # past the newest surviving position, or all after a rejection, die)
        prefix = torch.where(commit_in, j, committed + full)
        head = torch.stack([enter, end, enters.long(), prefix, trash, trash, e_tok])
        bound = torch.where(rejected, -1, newest)
        moved = u[:-1].clone()
        moved[:, LIVE] = ((moved[:, LIVE] == 1) & (moved[:, POS] <= bound) & ~done).long()
        u.copy_(torch.cat([head.view(1, -1), moved]))


dispatch.defer("cycle_open", "triton", "spd_kernels.control_triton")
dispatch.defer("cycle_candidate", "triton", "spd_kernels.control_triton")
dispatch.defer("cycle_commit", "triton", "spd_kernels.control_triton")
