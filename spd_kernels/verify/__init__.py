"""Verification of drafted tokens against the target's final hidden states.

Greedy: a draft is accepted iff it equals argmax of the target logits. Sampling: exact
speculative rejection sampling (accept x ~ q with probability min(1, p(x)/q(x)); on rejection
draw from the normalised residual max(p - q, 0)), which makes the output distributed exactly as
p. The draft distribution q lives on the reduced draft vocabulary and is scattered to target ids
through `draft_to_target`; it is zero elsewhere.

Backends (see spd_kernels.dispatch):
  verify_greedy            reference | triton (fused RMSNorm + LM-head GEMV + argmax + compare,
                           vocabulary split over programs, partial maxima reduced by a second
                           launch; the logits never reach memory) | cuda (same plan in C++)
  rejection_sample         reference | triton (p and q given on target ids) | cuda
  rejection_sample_logits  reference | triton (temperature / top-k / top-p computed in the kernel
                           from the target logits; q on the draft vocabulary, mapped to target ids;
                           uniforms given, or Philox with seed and offset in device tensors) |
                           cuda (csrc/sampling.cu: one launch, one block per row for every pass;
                           the same Philox stream as the Triton kernels)

Two Triton plans for the rejection samplers: one program per row (thresholds by bisection over
the row), and on a GPU from 16k entries a row a split-row plan: chunks of the row in parallel
programs (stats; top-k / top-p thresholds by radix select; residual masses), then one program per
row for the accept test and the draw inside the chunk that holds it.

The kernels reproduce the reference's roundings (normed hidden state and logits rounded to the
model dtype, argmax ties to the lowest id), so greedy verification agrees with the reference
except where two logits differ by less than the fp32 accumulation error.
"""
from __future__ import annotations

import weakref

import torch

from spd_kernels import _alloc, _cuda, dispatch
from spd_kernels._triton import HAS_TRITON, dtype_code, next_pow2, INTERPRET, triton, tl
from spd_kernels.checks import (SPDInputError, check_integer, check_kernel_float, check_tensor,
                                check_values_enabled, last_dim_contiguous)
from spd_kernels.sampling import check_sampling_params, filtered_probs, sample_from_probs

if HAS_TRITON:
    from triton.language.random import uint_to_uniform_float

    from spd_kernels._triton import float_key, round_to


# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------

def final_logits(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 lm_head_weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm (computed in fp32, as Llama/Qwen do) then the LM head: [R, d] -> [R, V]."""
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = norm_weight * h.to(hidden.dtype)
    return torch.nn.functional.linear(h, lm_head_weight)


def _check_heads(hidden, norm_weight, lm_head_weight):
    check_tensor("hidden", hidden, dim=2, floating=True)
    check_tensor("norm_weight", norm_weight, dim=1, floating=True, device=hidden.device)
    check_tensor("lm_head_weight", lm_head_weight, dim=2, floating=True, device=hidden.device)
    d = hidden.shape[1]
    if norm_weight.shape[0] != d or lm_head_weight.shape[1] != d:
        raise SPDInputError(f"hidden size mismatch: hidden {d}, norm {norm_weight.shape[0]}, "
                            f"lm_head {lm_head_weight.shape[1]}")
    # both are dimensioned tensors here, so result_type == promote_types (traceable)
    normed = torch.promote_types(norm_weight.dtype, hidden.dtype)
    if normed != lm_head_weight.dtype:
        raise SPDInputError(f"the normed hidden state has dtype {normed} (from hidden "
                            f"{hidden.dtype} and norm_weight {norm_weight.dtype}) but lm_head_weight "
                            f"has dtype {lm_head_weight.dtype}")


@dispatch.register("verify_greedy", "reference")
def verify_greedy_reference(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    target = final_logits(hidden, norm_weight, eps, lm_head_weight).argmax(-1)
    return target, target == draft_tokens.long()


def verify_greedy(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  lm_head_weight: torch.Tensor, draft_tokens: torch.Tensor, *,
                  backend: str | None = None):
    """hidden [R, d], draft_tokens [R] -> (target argmax [R] int64, accepted [R] bool)."""
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        return torch.ops.spd.verify_greedy(hidden, norm_weight, float(eps), lm_head_weight,
                                           draft_tokens)
    _check_heads(hidden, norm_weight, lm_head_weight)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=hidden.device)
    check_integer("draft_tokens", draft_tokens)
    if draft_tokens.shape[0] != hidden.shape[0]:
        raise SPDInputError(f"{draft_tokens.shape[0]} draft tokens for {hidden.shape[0]} rows")
    if not (eps >= 0.0):
        raise SPDInputError(f"eps must be >= 0, got {eps}")
    return dispatch.call("verify_greedy", hidden.device, hidden, norm_weight, float(eps),
                         lm_head_weight, draft_tokens, backend=backend)


def scatter_draft_probs(draft_probs: torch.Tensor, draft_to_target: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """q on the draft vocabulary [R, Vd] -> q on target ids [R, V] (zero outside the mapping)."""
    check_tensor("draft_to_target", draft_to_target, dim=1, device=draft_probs.device)
    if draft_to_target.shape[0] != draft_probs.shape[-1]:
        raise SPDInputError(f"draft_to_target maps {draft_to_target.shape[0]} ids but draft_probs "
                            f"has {draft_probs.shape[-1]} columns")
    if draft_to_target.numel() and (int(draft_to_target.min()) < 0
                                    or int(draft_to_target.max()) >= vocab_size):
        raise SPDInputError(f"draft_to_target holds ids outside the target vocabulary [0, {vocab_size})")
    q = draft_probs.new_zeros(*draft_probs.shape[:-1], vocab_size, dtype=torch.float32)
    return q.index_copy_(-1, draft_to_target.long(), draft_probs.float())


def _check_rejection(target_probs, draft_probs, draft_tokens, uniforms):
    check_tensor("target_probs", target_probs, dim=2, floating=True)
    check_tensor("draft_probs", draft_probs, dim=2, floating=True, device=target_probs.device)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=target_probs.device)
    check_integer("draft_tokens", draft_tokens)
    check_tensor("uniforms", uniforms, dim=2, floating=True, device=target_probs.device)
    rows, vocab = target_probs.shape
    if draft_probs.shape != target_probs.shape:
        raise SPDInputError(f"draft_probs shape {tuple(draft_probs.shape)} != target_probs shape "
                            f"{tuple(target_probs.shape)}")
    if draft_tokens.shape[0] != rows or uniforms.shape != (rows, 2):
        raise SPDInputError(f"expected {rows} draft tokens and uniforms of shape ({rows}, 2)")
    if rows and check_values_enabled(draft_tokens):
        tok = draft_tokens
        if int(tok.min()) < 0 or int(tok.max()) >= vocab:
            raise SPDInputError(f"draft token ids must lie in [0, {vocab})")


@dispatch.register("rejection_sample", "reference")
def rejection_sample_reference(target_probs, draft_probs, draft_tokens, uniforms):
    tok = draft_tokens.long()
    p = target_probs.float()
    q = draft_probs.float()
    p_x = p.gather(1, tok[:, None]).squeeze(1)
    q_x = q.gather(1, tok[:, None]).squeeze(1)
    # u < p/q written without the division (q_x > 0 for a token actually drawn from q).
    accepted = uniforms[:, 0].float() * q_x < p_x
    residual = (p - q).clamp_min(0.0)
    # If p == q the residual is empty; acceptance is then certain, but keep the draw well defined.
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty[:, None], p, residual)
    resampled = sample_from_probs(residual, uniforms[:, 1].float())
    return torch.where(accepted, tok, resampled), accepted


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_tokens: torch.Tensor, uniforms: torch.Tensor, *,
                     backend: str | None = None):
    """Exact speculative sampling, row by row.

    target_probs [R, V] = p, draft_probs [R, V] = q (both on target ids), draft_tokens [R] drawn
    from q, uniforms [R, 2] in [0, 1): column 0 decides acceptance, column 1 drives the residual
    draw. Returns (token [R] int64, accepted [R] bool): token is the draft where accepted, else
    the residual sample.
    """
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        return torch.ops.spd.rejection_sample(target_probs, draft_probs, draft_tokens, uniforms)
    _check_rejection(target_probs, draft_probs, draft_tokens, uniforms)
    return dispatch.call("rejection_sample", target_probs.device, target_probs, draft_probs,
                         draft_tokens, uniforms, backend=backend)


# --- fused: target logits + draft distribution on the draft vocabulary -------------------------

_VOCAB_MAPS: dict = {}


def target_to_draft_map(draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Inverse of draft_to_target: int32 [V] holding each target id's draft column, or -1.

    Checks the mapping once (range, no duplicates) and caches the result per mapping tensor (the
    object itself, held weakly, and its version counter), so steady-state calls pay no host
    synchronisation.
    """
    key = id(draft_to_target)
    hit = _VOCAB_MAPS.get(key)
    if hit is not None:
        ref, version, vocab, inv = hit
        if ref() is draft_to_target and version == draft_to_target._version and vocab == vocab_size:
            return inv
    check_tensor("draft_to_target", draft_to_target, dim=1)
    check_integer("draft_to_target", draft_to_target)
    vd = draft_to_target.shape[0]
    if vd and (int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= vocab_size):
        raise SPDInputError(f"draft_to_target holds ids outside the target vocabulary "
                            f"[0, {vocab_size})")
    if vd and int(torch.unique(draft_to_target).numel()) != vd:
        raise SPDInputError("draft_to_target maps two draft columns to the same target id")
    inv = torch.full((vocab_size,), -1, dtype=torch.int32, device=draft_to_target.device)
    inv[draft_to_target.long()] = torch.arange(vd, dtype=torch.int32, device=inv.device)
    if len(_VOCAB_MAPS) > 16:
        _VOCAB_MAPS.clear()
    _VOCAB_MAPS[key] = (weakref.ref(draft_to_target), draft_to_target._version, vocab_size, inv)
    return inv


def _check_rejection_logits(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms,
                            temperature, top_k, top_p, philox_seed, philox_offset):
    check_tensor("target_logits", target_logits, dim=2, floating=True)
    dev = target_logits.device
    rows, vocab = target_logits.shape
    check_tensor("draft_probs", draft_probs, dim=2, floating=True, device=dev)
    check_tensor("draft_to_target", draft_to_target, dim=1, device=dev)
    check_integer("draft_to_target", draft_to_target)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=dev)
    check_integer("draft_tokens", draft_tokens)
    check_sampling_params(temperature, top_k, top_p)
    if draft_probs.shape[0] != rows or draft_tokens.shape[0] != rows:
        raise SPDInputError(f"target_logits has {rows} rows but draft_probs has "
                            f"{draft_probs.shape[0]} and draft_tokens {draft_tokens.shape[0]}")
    if draft_to_target.shape[0] != draft_probs.shape[1]:
        raise SPDInputError(f"draft_to_target maps {draft_to_target.shape[0]} ids but draft_probs "
                            f"has {draft_probs.shape[1]} columns")
    if draft_probs.shape[1] > vocab:
        raise SPDInputError(f"the draft vocabulary ({draft_probs.shape[1]}) is larger than the "
                            f"target's ({vocab})")
    if uniforms is not None:
        check_tensor("uniforms", uniforms, dim=2, floating=True, device=dev)
        if uniforms.shape != (rows, 2):
            raise SPDInputError(f"uniforms must have shape ({rows}, 2), got {tuple(uniforms.shape)}")
        if philox_seed is not None or philox_offset is not None:
            raise SPDInputError("give either uniforms or philox_seed/philox_offset, not both")
    else:
        if philox_seed is None or philox_offset is None:
            raise SPDInputError("rejection sampling needs randomness: pass uniforms [R, 2] or "
                                "philox_seed and philox_offset (int64 tensors of one element)")
        for name, t in (("philox_seed", philox_seed), ("philox_offset", philox_offset)):
            check_tensor(name, t, dtype=torch.int64, device=dev)
            if t.numel() != 1:
                raise SPDInputError(f"{name} must hold exactly one element, got shape "
                                    f"{tuple(t.shape)}")
    if rows and check_values_enabled(draft_tokens):
        if int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= vocab:
            raise SPDInputError(f"draft token ids must lie in [0, {vocab})")
    if check_values_enabled(draft_to_target):
        target_to_draft_map(draft_to_target, vocab)  # range and duplicates (cached per mapping)


def _philox_uniforms_reference(rows, device, philox_seed, philox_offset):
    """Uniforms for the reference when only a seed/offset pair is given (host sync; the stream
    differs from the Triton kernel's Philox: bit-for-bit comparisons go through `uniforms`)."""
    seed, off = int(philox_seed.reshape(-1)[0]), int(philox_offset.reshape(-1)[0])
    gen = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + off) % (1 << 63))
    philox_offset.add_(rows)
    return torch.rand(rows, 2, generator=gen).to(device)


@dispatch.register("rejection_sample_logits", "reference")
def rejection_sample_logits_reference(target_logits, draft_probs, draft_to_target, draft_tokens,
                                      uniforms=None, temperature=1.0, top_k=0, top_p=1.0,
                                      philox_seed=None, philox_offset=None):
    rows, vocab = target_logits.shape
    if uniforms is None:
        uniforms = _philox_uniforms_reference(rows, target_logits.device, philox_seed,
                                              philox_offset)
    p = filtered_probs(target_logits, temperature, top_k, top_p)
    q = scatter_draft_probs(draft_probs, draft_to_target, vocab)
    return rejection_sample_reference(p, q, draft_tokens, uniforms)


def rejection_sample_logits(target_logits: torch.Tensor, draft_probs: torch.Tensor,
                            draft_to_target: torch.Tensor, draft_tokens: torch.Tensor,
                            uniforms: torch.Tensor | None = None, *, temperature: float = 1.0,
                            top_k: int = 0, top_p: float = 1.0,
                            philox_seed: torch.Tensor | None = None,
                            philox_offset: torch.Tensor | None = None,
                            backend: str | None = None):
    """Exact speculative sampling straight from the target logits.

    target_logits [R, V]; p = filtered_probs(target_logits, temperature, top_k, top_p) (the same
    rules as `sampling.filtered_probs`; temperature 0 is greedy). draft_probs [R, Vd]: q on the
    draft vocabulary, column c standing for target id draft_to_target[c] ([Vd] int, distinct ids in
    [0, V)). draft_tokens [R]: the drafted target ids. Randomness: uniforms [R, 2] (as in
    `rejection_sample`, so backends agree bit for bit) or philox_seed/philox_offset (int64 device
    tensors of one element; the offset advances by R per call, so a captured CUDA graph draws new
    numbers on every replay). Returns (token [R] int64, accepted [R] bool).
    """
    if torch.compiler.is_compiling():  # the custom op keeps host checks out of the graph
        return torch.ops.spd.rejection_sample_logits(
            target_logits, draft_probs, draft_to_target, draft_tokens, uniforms, philox_seed,
            philox_offset, float(temperature), int(top_k), float(top_p))
    _check_rejection_logits(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms,
                            temperature, top_k, top_p, philox_seed, philox_offset)
    return dispatch.call("rejection_sample_logits", target_logits.device, target_logits,
                         draft_probs, draft_to_target, draft_tokens, uniforms, float(temperature),
                         int(top_k), float(top_p), philox_seed, philox_offset, backend=backend)


# ------------------------------------------------------------------------------------------------
# Triton
# ------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _greedy_partial_kernel(h_ptr, g_ptr, w_ptr, pval_ptr, pidx_ptr,
                               R, D, V, NB, stride_h, stride_w, eps,
                               R_H: tl.constexpr, R_G: tl.constexpr, R_L: tl.constexpr,
                               BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        """Program (v, r): rows r*BLOCK_R.. against vocabulary rows v*BLOCK_V..; writes the block's
        max logit and its lowest id per row to pval/pidx[row, v]."""
        pid_v = tl.program_id(0)
        pid_r = tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < R
        h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
        # RMS of each row (the hidden rows are tiny and stay in cache across programs).
        ss = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(h_rows + cols[None, :], mask=rmask[:, None] & (cols < D)[None, :],
                        other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / D + eps)
        vrows = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = vrows < V
        w_rows = w_ptr + vrows.to(tl.int64)[:, None] * stride_w
        acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            x = tl.load(h_rows + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            g = tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            hn = round_to(x * rstd[:, None], R_H)          # h.to(hidden.dtype)
            hn = round_to(g[None, :] * hn, R_G)             # norm_weight * h
            w = tl.load(w_rows + cols[None, :], mask=vmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(hn[:, None, :] * w[None, :, :], axis=2)
        logits = round_to(acc, R_L)                          # logits in the model dtype
        logits = tl.where(vmask[None, :], logits, float("-inf"))
        best = tl.max(logits, axis=1)
        idx = tl.min(tl.where(logits == best[:, None], vrows[None, :], 2147483647), axis=1)
        out = rows.to(tl.int64) * NB + pid_v
        tl.store(pval_ptr + out, best, mask=rmask)
        tl.store(pidx_ptr + out, idx, mask=rmask)

    @triton.jit
    def _greedy_reduce_kernel(pval_ptr, pidx_ptr, draft_ptr, target_ptr, accepted_ptr, NB,
                              BLOCK_NB: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        best = tl.full([], float("-inf"), tl.float32)
        bidx = tl.full([], 2147483647, tl.int32)
        for b0 in range(0, NB, BLOCK_NB):
            offs = b0 + tl.arange(0, BLOCK_NB)
            m = offs < NB
            vals = tl.load(pval_ptr + r * NB + offs, mask=m, other=float("-inf"))
            idxs = tl.load(pidx_ptr + r * NB + offs, mask=m, other=2147483647)
            cm = tl.max(vals, axis=0)
            ci = tl.min(tl.where(vals == cm, idxs, 2147483647), axis=0)
            take = (cm > best) | ((cm == best) & (ci < bidx))
            bidx = tl.where(take, ci, bidx)
            best = tl.maximum(best, cm)
        target = bidx.to(tl.int64)
        tl.store(target_ptr + r, target)
        draft = tl.load(draft_ptr + r).to(tl.int64)
        tl.store(accepted_ptr + r, (draft == target).to(tl.int8))


def _greedy_blocks(R, D, V):
    block_r = min(next_pow2(R), 4)
    if INTERPRET:  # big tiles: fewer interpreted iterations
        return block_r, min(next_pow2(V), 64), min(next_pow2(D), 256), 1
    budget = 8192 // block_r  # fp32 elements of the [BLOCK_V, BLOCK_D] tile per row
    block_d = min(next_pow2(D), 256)
    block_v = max(16, min(64, budget // block_d))
    return block_r, block_v, block_d, 4


def _triton_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    for name, t in (("hidden", hidden), ("norm_weight", norm_weight),
                    ("lm_head_weight", lm_head_weight)):
        why = check_kernel_float(name, t) or last_dim_contiguous(name, t)
        if why:
            return why
    return None


@dispatch.register("verify_greedy", "triton", supports=_triton_greedy_supports)
def verify_greedy_triton(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    R, D = hidden.shape
    V = lm_head_weight.shape[0]
    target = _alloc.empty(R, dtype=torch.int64, device=hidden.device)
    accepted = _alloc.empty(R, dtype=torch.bool, device=hidden.device)
    if R == 0:
        return target, accepted
    draft_tokens = draft_tokens.contiguous()  # the kernels index it by row
    block_r, block_v, block_d, warps = _greedy_blocks(R, D, V)
    nb = triton.cdiv(V, block_v)
    pval = _alloc.empty(R, nb, dtype=torch.float32, device=hidden.device)
    pidx = _alloc.empty(R, nb, dtype=torch.int32, device=hidden.device)
    _greedy_partial_kernel[(nb, triton.cdiv(R, block_r))](
        hidden, norm_weight, lm_head_weight, pval, pidx, R, D, V, nb,
        hidden.stride(0), lm_head_weight.stride(0), eps,
        R_H=dtype_code(hidden.dtype),
        R_G=dtype_code(torch.result_type(norm_weight, hidden)),
        R_L=dtype_code(lm_head_weight.dtype),
        BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_D=block_d, num_warps=warps)
    _greedy_reduce_kernel[(R,)](pval, pidx, draft_tokens, target, accepted.view(torch.int8), nb,
                                BLOCK_NB=min(next_pow2(nb), 1024))
    return target, accepted


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


if HAS_TRITON:
    # Split-row plan (no top-k / top-p): the row is cut into NB chunks, one program each, so a
    # 152k-entry row is read by ~75 SMs at once instead of walked by one.

    @triton.jit
    def _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, FROM_LOGITS: tl.constexpr,
                   GREEDY: tl.constexpr, NB_PAD: tl.constexpr):
        """Merge the chunks' (max, sum exp(x - max), first argmax) into the row's (mx, amax, z)
        (placeholders when p is given as probabilities)."""
        mx = tl.zeros([], dtype=tl.float32)
        amax = tl.zeros([], dtype=tl.int32)
        z = tl.zeros([], dtype=tl.float32) + 1.0
        if FROM_LOGITS:
            b = tl.arange(0, NB_PAD)
            bm = b < NB
            cmax = tl.load(pmax_ptr + r * NB + b, mask=bm, other=float("-inf"))
            mx = tl.max(cmax, axis=0)
            carg = tl.load(parg_ptr + r * NB + b, mask=bm, other=2147483647)
            amax = tl.min(tl.where(bm & (cmax == mx), carg, 2147483647), axis=0)
            if not GREEDY:
                csum = tl.load(psum_ptr + r * NB + b, mask=bm, other=0.0)
                z = tl.sum(tl.where(bm, csum * tl.exp(cmax - mx), 0.0), axis=0)
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
        z = tl.zeros([], dtype=tl.float32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = _x_chunk(x_row, offs, offs < hi, temperature, GREEDY)
            mx, amax, z = _online_max(x, offs, mx, amax, z, GREEDY)
        tl.store(pmax_ptr + r * NB + b, mx)
        tl.store(psum_ptr + r * NB + b, z)
        tl.store(parg_ptr + r * NB + b, amax)

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
        tk, tp, z = _selected(thr_ptr, zsel_ptr, r, z, TOP_K, TOP_P)
        lo = b * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        s_res = tl.zeros([], dtype=tl.float32)
        s_p = tl.zeros([], dtype=tl.float32)
        for v0 in range(lo, hi, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mask = offs < hi
            p = _p_chunk(x_row, offs, mask, temperature, mx, amax, tk, tp, z, FROM_LOGITS,
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
        tk, tp, z = _selected(thr_ptr, zsel_ptr, r, z, TOP_K, TOP_P)
        tok, accepted, u1 = _judge(x_row, q_row, t2d_ptr, tok_ptr, r, V, temperature, mx, amax,
                                   tk, tp, z, u_ptr, stride_u, seed_ptr, offset_ptr, FROM_LOGITS,
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
                                carry, use_p, temperature, mx, amax, tk, tp, z, FROM_LOGITS,
                                GREEDY, TOP_K, TOP_P, Q_MAPPED, BLOCK)
            out = tl.minimum(found, last)
        tl.store(out_tok_ptr + r, out)
        tl.store(out_acc_ptr + r, accepted.to(tl.int8))

    @triton.jit
    def _selected(thr_ptr, zsel_ptr, r, z, TOP_K: tl.constexpr, TOP_P: tl.constexpr):
        """The row's top-k / top-p key thresholds and the kept mass the radix select stored
        (z unchanged without top-k / top-p)."""
        tk = tl.zeros([], dtype=tl.int32)
        tp = tl.zeros([], dtype=tl.int32)
        if TOP_K or TOP_P:
            z = tl.load(zsel_ptr + r)
            if TOP_K:
                tk = tl.load(thr_ptr + 2 * r)
            if TOP_P:
                tp = tl.load(thr_ptr + 2 * r + 1)
        return tk, tp, z

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
        if PHASE_P and TOP_K:
            tk = tl.load(thr_ptr + 2 * r)
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
                match = match & (key >= tk)
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
                             above_ptr, above_mass_ptr, thr_ptr, zsel_ptr, NB, top_k, top_p,
                             SHIFT: tl.constexpr, PHASE_P: tl.constexpr, TOP_K: tl.constexpr,
                             NEED_MASS: tl.constexpr, NB_PAD: tl.constexpr):
        """Program r: the next digit of the threshold from the chunks' histograms. After the
        last round it stores the threshold key (thr [R, 2]: top-k, top-p) and the mass of the
        kept set (zsel [R]); before, the prefix and the count / mass above it."""
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
        if PHASE_P:
            if TOP_K:  # z of the top-k set: everything this phase's first round counts
                if SHIFT == 24:
                    zk = tl.sum(m, axis=0)
                    tl.store(zsel_ptr + r, zk)
                else:
                    zk = tl.load(zsel_ptr + r)
            else:
                mx, amax, zk = _row_stats(pmax_ptr, psum_ptr, parg_ptr, r, NB, True, False,
                                          NB_PAD)
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
            if PHASE_P:
                tl.store(thr_ptr + 2 * r + 1, (prefix - 2147483648).to(tl.int32))
            else:
                tl.store(thr_ptr + 2 * r, (prefix - 2147483648).to(tl.int32))
            tl.store(zsel_ptr + r, above_m + tl.sum(tl.where(i == sel, m, 0.0), axis=0))


SPLIT_MIN_VOCAB = 16384   # below this one program per row is quick enough on a GPU


def _split_chunk(V: int, device) -> int:
    """Chunk length of the split-row plan on this device, 0 for the one-program plan."""
    if device.type != "cuda" or V < SPLIT_MIN_VOCAB:
        return 0
    return max(2048, next_pow2(triton.cdiv(V, 1024)))  # at most 1024 chunks a row


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


def _split_row_stats(x, temperature, from_logits, greedy, chunk, top_k=0, top_p=1.0,
                     use_top_k=False, use_top_p=False):
    """The split-row plan's first launches: per-chunk (max, sum exp, argmax) of x / T (from
    logits), and the radix select of the top-k / top-p thresholds. Returns the chunking, the
    partials and thr [R, 2] (top-k, top-p key), zsel [R] (mass exp(x - max) of the kept set)."""
    R, V = x.shape
    if use_top_k or use_top_p:  # each select program sums NB x 256 histogram entries
        chunk = max(chunk, next_pow2(triton.cdiv(V, RADIX_MAX_CHUNKS)))
    nb = triton.cdiv(V, chunk)
    nb_pad = next_pow2(nb)
    dev = x.device
    pmax = torch.empty(R, nb, dtype=torch.float32, device=dev)
    psum = torch.empty(R, nb, dtype=torch.float32, device=dev)
    parg = torch.empty(R, nb, dtype=torch.int32, device=dev)
    thr = torch.empty(R, 2, dtype=torch.int32, device=dev)
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
                                       thr, zsel, nb, int(top_k), float(top_p), SHIFT=shift,
                                       PHASE_P=phase_p, TOP_K=use_top_k, NEED_MASS=need_mass,
                                       NB_PAD=nb_pad, num_warps=SPLIT_WARPS)


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


# ------------------------------------------------------------------------------------------------
# CUDA C++ (csrc/verify.cu)
# ------------------------------------------------------------------------------------------------

def _cuda_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    if not (hidden.dtype == norm_weight.dtype == lm_head_weight.dtype):
        return (f"the CUDA kernel needs one dtype for hidden, norm_weight and lm_head_weight, got "
                f"{hidden.dtype}, {norm_weight.dtype}, {lm_head_weight.dtype}")
    return _triton_greedy_supports(hidden, norm_weight, eps, lm_head_weight, draft_tokens)


@dispatch.register("verify_greedy", "cuda", supports=_cuda_greedy_supports)
def verify_greedy_cuda(hidden, norm_weight, eps, lm_head_weight, draft_tokens):
    ext = _cuda.ext()
    R, D = hidden.shape
    V = lm_head_weight.shape[0]
    target = _alloc.empty(R, dtype=torch.int64, device=hidden.device)
    accepted = _alloc.empty(R, dtype=torch.bool, device=hidden.device)
    if R == 0:
        return target, accepted
    draft_tokens = draft_tokens.contiguous()
    nb = ext.verify_greedy_num_blocks(V)
    pval = _alloc.empty(R, nb, dtype=torch.float32, device=hidden.device)
    pidx = _alloc.empty(R, nb, dtype=torch.int32, device=hidden.device)
    ext.verify_greedy(hidden.data_ptr(), hidden.stride(0), norm_weight.data_ptr(),
                      lm_head_weight.data_ptr(), lm_head_weight.stride(0),
                      draft_tokens.data_ptr(), draft_tokens.dtype == torch.int64,
                      pval.data_ptr(), pidx.data_ptr(), target.data_ptr(), accepted.data_ptr(),
                      R, D, V, float(eps), dtype_code(hidden.dtype), _cuda.stream_of(hidden))
    return target, accepted


def _launch_rejection_cuda(x, q, t2d, tok, uniforms, philox_seed, philox_offset, temperature,
                           top_k, top_p, from_logits):
    """One block per row does every pass (csrc/sampling.cu); same arguments as the Triton plan."""
    ext = _cuda.ext()
    R, V = x.shape
    out, acc, tok = _rejection_outputs(x, tok)
    if R == 0:
        return out, acc
    philox = uniforms is None
    if not philox:
        uniforms = uniforms.float()
        if uniforms.stride(1) != 1:
            uniforms = uniforms.contiguous()
    ext.rejection_sample(x.data_ptr(), x.stride(0), dtype_code(x.dtype), q.data_ptr(), q.stride(0),
                         dtype_code(q.dtype), 0 if t2d is None else t2d.data_ptr(),
                         tok.data_ptr(), tok.dtype == torch.int64,
                         0 if philox else uniforms.data_ptr(), 0 if philox else uniforms.stride(0),
                         philox_seed.data_ptr() if philox else 0,
                         philox_offset.data_ptr() if philox else 0, out.data_ptr(),
                         acc.data_ptr(), R, V, float(temperature), int(top_k), float(top_p),
                         from_logits, _cuda.stream_of(x))
    if philox:
        philox_offset.add_(R)  # after the launch: every block read the old value
    return out, acc


# The CUDA sampler is checked in the host emulation but not yet timed on a GPU against the
# Triton plans: until it is, it runs only when asked for (backend="cuda", SPD_BACKEND).
@dispatch.register("rejection_sample", "cuda", supports=_rs_supports, automatic=False)
def rejection_sample_cuda(target_probs, draft_probs, draft_tokens, uniforms):
    return _launch_rejection_cuda(target_probs, draft_probs, None, draft_tokens, uniforms, None,
                                  None, 1.0, 0, 1.0, from_logits=False)


@dispatch.register("rejection_sample_logits", "cuda", supports=_rsl_supports, automatic=False)
def rejection_sample_logits_cuda(target_logits, draft_probs, draft_to_target, draft_tokens,
                                 uniforms=None, temperature=1.0, top_k=0, top_p=1.0,
                                 philox_seed=None, philox_offset=None):
    t2d = target_to_draft_map(draft_to_target, target_logits.shape[1])
    return _launch_rejection_cuda(target_logits, draft_probs, t2d, draft_tokens, uniforms,
                                  philox_seed, philox_offset, temperature, top_k, top_p,
                                  from_logits=True)


__all__ = ["filtered_probs", "final_logits", "rejection_sample", "rejection_sample_logits",
           "scatter_draft_probs", "target_to_draft_map", "verify_greedy"]
