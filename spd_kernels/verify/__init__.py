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
                           cuda (csrc/kernels/sampling.cu: one launch, one block per row for every pass;
                           the same Philox stream as the Triton kernels)

Two Triton plans for the rejection samplers: one program per row (thresholds by a pivot search
over the row, 16 pivots a pass, no sort: docs/kernels.md), and on a GPU from 16k entries a row
a split-row plan: chunks of the row in parallel programs (stats; top-k / top-p thresholds by
radix select; residual masses), then one program per row for the accept test and the draw
inside the chunk that holds it.

The kernels reproduce the reference's roundings (normed hidden state and logits rounded to the
model dtype, argmax ties to the lowest id), so greedy verification agrees with the reference
except where two logits differ by less than the fp32 accumulation error.
"""
from __future__ import annotations

import weakref

import torch

from spd_kernels import dispatch
from spd_kernels.checks import SPDInputError, check_integer, check_tensor, check_values_enabled
from spd_kernels.opdef import op
from spd_kernels.philox import philox_words, to_uniform
from spd_kernels.sampling import check_sampling_params, filtered_probs, sample_from_probs

# ------------------------------------------------------------------------------------------------
# Reference
# ------------------------------------------------------------------------------------------------

def final_logits(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 lm_head_weight: torch.Tensor, norm_offset: float = 0.0) -> torch.Tensor:
    """RMSNorm (computed in fp32, as Llama/Qwen do) then the LM head: [R, d] -> [R, V].

    norm_offset 0: w * h.to(dtype) (Llama / Qwen2 / Qwen3). Otherwise the zero-centred norm of
    Qwen3.5 / Qwen3-Next: (h * (norm_offset + w)) in fp32, then rounded to the dtype."""
    h = hidden.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if norm_offset:
        h = (h * (norm_offset + norm_weight.float())).to(hidden.dtype)
    else:
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
    if d == 0 or lm_head_weight.shape[0] == 0:
        raise SPDInputError(f"empty shapes: hidden size {d}, vocabulary "
                            f"{lm_head_weight.shape[0]} (lm_head_weight rows); both must be >= 1")
    # both are dimensioned tensors here, so result_type == promote_types (traceable)
    normed = torch.promote_types(norm_weight.dtype, hidden.dtype)
    if normed != lm_head_weight.dtype:
        raise SPDInputError(f"the normed hidden state has dtype {normed} (from hidden "
                            f"{hidden.dtype} and norm_weight {norm_weight.dtype}) but lm_head_weight "
                            f"has dtype {lm_head_weight.dtype}")


@op("verify_greedy")
def verify_greedy(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  lm_head_weight: torch.Tensor, draft_tokens: torch.Tensor,
                  norm_offset: float = 0.0, *,
                  backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [R, d], draft_tokens [R] -> (target argmax [R] int64, accepted [R] bool).
    norm_offset: 1.0 for the zero-centred final norm x * (1 + w) of hybrid targets (see
    final_logits).

    The argmax follows torch.argmax on every backend: NaN ranks above every number and ties go
    to the lowest id, so a row with a NaN logit gives its first NaN id (0 for an all-NaN row);
    the target is always an id in [0, V)."""
    _check_heads(hidden, norm_weight, lm_head_weight)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=hidden.device)
    check_integer("draft_tokens", draft_tokens)
    if draft_tokens.shape[0] != hidden.shape[0]:
        raise SPDInputError(f"{draft_tokens.shape[0]} draft tokens for {hidden.shape[0]} rows")
    if not (eps >= 0.0):
        raise SPDInputError(f"eps must be >= 0, got {eps}")
    if not (abs(norm_offset) < float("inf")):
        raise SPDInputError(f"norm_offset must be finite, got {norm_offset}")
    return dispatch.call("verify_greedy", hidden.device, hidden, norm_weight, float(eps),
                         lm_head_weight, draft_tokens, float(norm_offset), backend=backend)


@verify_greedy.register_fake
def _(hidden, norm_weight, eps, lm_head_weight, draft_tokens, norm_offset=0.0):
    _check_heads(hidden, norm_weight, lm_head_weight)
    return _token_outputs(hidden)


def _token_outputs(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [R] int64, accepted [R] bool) shaped for `like`'s rows: the ops' fake outputs."""
    rows = like.shape[0]
    return like.new_empty(rows, dtype=torch.int64), like.new_empty(rows, dtype=torch.bool)


@dispatch.register("verify_greedy", "reference")
def verify_greedy_reference(hidden, norm_weight, eps, lm_head_weight, draft_tokens,
                            norm_offset=0.0):
    target = final_logits(hidden, norm_weight, eps, lm_head_weight, norm_offset).argmax(-1)
    return target, target == draft_tokens.long()


def scatter_draft_probs(draft_probs: torch.Tensor, draft_to_target: torch.Tensor,
                        vocab_size: int) -> torch.Tensor:
    """q on the draft vocabulary [R, Vd] -> q on target ids [R, V] (zero outside the mapping).
    The ids' range is checked where values are (CPU tensors; device ones with
    SPD_CHECK_VALUES=1): on a GPU that check would be a host read per call."""
    check_tensor("draft_to_target", draft_to_target, dim=1, device=draft_probs.device)
    if draft_to_target.shape[0] != draft_probs.shape[-1]:
        raise SPDInputError(f"draft_to_target maps {draft_to_target.shape[0]} ids but draft_probs "
                            f"has {draft_probs.shape[-1]} columns")
    if draft_to_target.numel() and check_values_enabled(draft_to_target) and (
            int(draft_to_target.min()) < 0 or int(draft_to_target.max()) >= vocab_size):
        raise SPDInputError(f"draft_to_target holds ids outside the target vocabulary [0, {vocab_size})")
    return _scatter(draft_probs, draft_to_target, vocab_size)


def _scatter(draft_probs, draft_to_target, vocab_size):
    """scatter_draft_probs without its checks (the caller checked the map)."""
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
    if rows and check_values_enabled(target_probs):
        _check_distribution("target_probs", target_probs)
        _check_distribution("draft_probs", draft_probs)
        _check_uniforms(uniforms)


# Value rules (CPU tensors always; device tensors with SPD_CHECK_VALUES=1): probabilities are
# finite, >= 0 and each row sums to 1 within this tolerance; uniforms lie in [0, 1).
PROB_SUM_TOLERANCE = 1e-3


def _check_distribution(name: str, p: torch.Tensor) -> None:
    pf = p.float()
    if not bool(torch.isfinite(pf).all()) or bool((pf < 0).any()):
        raise SPDInputError(f"{name} must hold finite probabilities >= 0 (found NaN, inf or a "
                            f"negative entry)")
    sums = pf.sum(-1)
    worst = float((sums - 1).abs().max())
    if worst > PROB_SUM_TOLERANCE:
        raise SPDInputError(f"every row of {name} must sum to 1 (within {PROB_SUM_TOLERANCE}); "
                            f"a row sums to {float(sums[(sums - 1).abs().argmax()]):.6g}")


def _check_uniforms(uniforms: torch.Tensor | None) -> None:
    if uniforms is not None and uniforms.numel() and not bool(
            ((uniforms >= 0) & (uniforms < 1)).all()):
        raise SPDInputError("uniforms must lie in [0, 1) (found a value outside, or NaN)")


@op("rejection_sample")
def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_tokens: torch.Tensor, uniforms: torch.Tensor, *,
                     backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling, row by row.

    target_probs [R, V] = p, draft_probs [R, V] = q (both on target ids), draft_tokens [R] drawn
    from q, uniforms [R, 2] in [0, 1) (any float dtype; float64 is rounded to float32, kept
    below 1, for every backend): column 0 decides acceptance, column 1 drives the residual
    draw. Returns (token [R] int64, accepted [R] bool): token is the draft where accepted, else
    the residual sample.
    """
    _check_rejection(target_probs, draft_probs, draft_tokens, uniforms)
    return dispatch.call("rejection_sample", target_probs.device, target_probs, draft_probs,
                         draft_tokens, _as_float32_uniforms(uniforms), backend=backend)


@rejection_sample.register_fake
def _(target_probs, draft_probs, draft_tokens, uniforms):
    return _token_outputs(target_probs)


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
        _check_distribution("draft_probs", draft_probs)
        _check_uniforms(uniforms)
    if check_values_enabled(draft_to_target):
        target_to_draft_map(draft_to_target, vocab)  # range and duplicates (cached per mapping)


def _philox_uniforms_reference(rows, device, philox_seed, philox_offset):
    """Uniforms [rows, 2] for the reference when only a seed/offset pair is given: the kernels'
    stream bit for bit (row r: the first two words of Philox(seed, offset + r), as Triton's
    tl.randint4x gives them: spd_kernels.philox), so a row of a batch is what a one-row call at
    offset + r draws. Advances the offset by `rows`."""
    at = philox_offset.reshape(1).to(device) + torch.arange(rows, device=device)
    c0, c1, _, _ = philox_words(philox_seed.reshape(1).to(device), at)
    philox_offset.add_(rows)
    return torch.stack([to_uniform(c0), to_uniform(c1)], 1)


# Largest float32 below 1: float64 uniforms round to float32, and one just below 1 would round to
# 1.0, outside [0, 1).
_BELOW_ONE = 1.0 - 2.0 ** -24


def _as_float32_uniforms(uniforms: torch.Tensor | None) -> torch.Tensor | None:
    """Uniforms of any float dtype as the float32 every backend reads (float64 is rounded, and
    kept below 1), so the automatic choice never falls back to another backend over the dtype."""
    if uniforms is None or uniforms.dtype != torch.float64:
        return uniforms
    return uniforms.float().clamp_(max=_BELOW_ONE)


@op("rejection_sample_logits", mutates=("philox_offset",))
def rejection_sample_logits(target_logits: torch.Tensor, draft_probs: torch.Tensor,
                            draft_to_target: torch.Tensor, draft_tokens: torch.Tensor,
                            uniforms: torch.Tensor | None = None, *,
                            philox_seed: torch.Tensor | None = None,
                            philox_offset: torch.Tensor | None = None, temperature: float = 1.0,
                            top_k: int = 0, top_p: float = 1.0,
                            backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact speculative sampling straight from the target logits.

    target_logits [R, V]; p = filtered_probs(target_logits, temperature, top_k, top_p) (the same
    rules as `sampling.filtered_probs`; temperature 0 is greedy). draft_probs [R, Vd]: q on the
    draft vocabulary, column c standing for target id draft_to_target[c] ([Vd] int, distinct ids in
    [0, V)). draft_tokens [R]: the drafted target ids. Randomness: uniforms [R, 2] (as in
    `rejection_sample`, so backends agree bit for bit) or philox_seed/philox_offset (int64 device
    tensors of one element; the offset advances by R per call, so a captured CUDA graph draws new
    numbers on every replay). Returns (token [R] int64, accepted [R] bool).
    """
    _check_rejection_logits(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms,
                            temperature, top_k, top_p, philox_seed, philox_offset)
    return dispatch.call("rejection_sample_logits", target_logits.device, target_logits,
                         draft_probs, draft_to_target, draft_tokens,
                         _as_float32_uniforms(uniforms), float(temperature), int(top_k),
                         float(top_p), philox_seed, philox_offset, backend=backend)


@rejection_sample_logits.register_fake
def _(target_logits, draft_probs, draft_to_target, draft_tokens, uniforms=None, philox_seed=None,
      philox_offset=None, temperature=1.0, top_k=0, top_p=1.0):
    return _token_outputs(target_logits)


@dispatch.register("rejection_sample_logits", "reference")
def rejection_sample_logits_reference(target_logits, draft_probs, draft_to_target, draft_tokens,
                                      uniforms=None, temperature=1.0, top_k=0, top_p=1.0,
                                      philox_seed=None, philox_offset=None):
    rows, vocab = target_logits.shape
    if uniforms is None:
        uniforms = _philox_uniforms_reference(rows, target_logits.device, philox_seed,
                                              philox_offset)
    p = filtered_probs(target_logits, temperature, top_k, top_p)
    q = _scatter(draft_probs, draft_to_target, vocab)  # the op checked the map (cached)
    return rejection_sample_reference(p, q, draft_tokens, uniforms)


# Registered with the dispatcher when first needed (importing it imports Triton).
dispatch.defer("verify_greedy", "triton", "spd_kernels.verify.triton_greedy")
dispatch.defer("verify_greedy", "cuda", "spd_kernels.verify.cuda")  # its checks are Triton's
dispatch.defer("rejection_sample", "triton", "spd_kernels.verify.triton_rejection")
dispatch.defer("rejection_sample_logits", "triton", "spd_kernels.verify.triton_rejection")

__all__ = ["filtered_probs", "final_logits", "rejection_sample", "rejection_sample_logits",
           "scatter_draft_probs", "target_to_draft_map", "verify_greedy"]
