"""tree_rejection_sample: lossless verification, under sampling, of several deterministic candidate
tokens for one position (the children of one node of a draft tree).

Terms:
  V            the target vocabulary size; target_logits [V].
  p            the target distribution: filtered_probs(target_logits, temperature, top_k, top_p)
               (spd_kernels.sampling's rules; temperature > 0: greedy is not this op's job).
  candidates   c_0 .. c_{k-1} [k]: target ids proposed deterministically (e.g. the drafter's
               top-k children of one node), checked in this order. -1 is padding (no
               candidate): skipped, its uniform unused. The real candidates must be distinct
               (a repeated id would be tested twice against a residual that no longer holds
               it; the result is then unspecified). Ids outside [-1, V) and repeats are refused
               on the host for CPU tensors; device tensors are never read on the host (no
               synchronisation), and both backends treat an id outside [0, V) as padding.
  uniforms     u_0 .. u_k [k + 1] in [0, 1): u_i decides candidate i, u_k drives the draw from
               the final residual (float64 is rounded to float32, kept below 1).
  r_i          the residual before candidate i: r_0 = p; after rejecting c_i,
               r_{i+1} = norm(max(r_i - onehot(c_i), 0)) (r_i with c_i's entry set to 0,
               renormalised). A draft that is a point mass on c_i is accepted with probability
               min(1, r_i(c_i) / 1) = r_i(c_i).
  R_i          the unnormalised mass of r_i: with the p-mass of the tokens that are not real
               candidates, N = sum p(x) over x not in {c_j}, and the candidates still unchecked,
               R_i = N + (p(c_i) + (p(c_{i+1}) + ... )), summed in fp32 from the last candidate
               back (padding adds 0), so r_i(c_i) = p(c_i) / R_i without the subtraction
               1 - sum of rejected masses (no cancellation).

Procedure: for i = 0 .. k-1, skipping padding, accept c_i iff u_i * R_i < p(c_i) (u_i < r_i(c_i)
without the division), or c_i holds all the mass left (p(c_i) >= R_i > 0: for a normal R_i that
already follows from u_i < 1; the rule covers a subnormal one); stop at the first acceptance.
If every candidate is rejected, the token is sample_from_probs(p with every candidate's entry set
to 0, u_k): the inverse-CDF draw (the first index whose running mass exceeds u_k * total,
clamped to the last index with mass, so ties follow sample_from_probs). The output is then
distributed exactly as p (proof at the reference). Edge cases: a candidate outside p's support
(cut by top-k / top-p, or p = 0) is always rejected and leaves the residual unchanged; when all of
p's mass sits on candidates, the last one with mass is accepted with probability 1 (R_i is then
exactly p(c_i): N = 0 and the later candidates add zeros), so the final draw never meets an empty
residual and nothing is divided by zero.

Returns (token [1] int64, accepted [1] int64): accepted is the index i of the accepted candidate,
or -1 when every candidate was rejected and the token was drawn from the residual.

Batched form (a batch of token trees, one judged position a row, one launch): target_logits
[B, V], candidates [B, k], uniforms [B, k + 1] -> (token [B], accepted [B]) int64, row b exactly
what the 1-D call on row b gives; the sampling parameters are shared by the rows. The host checks
(ids in [-1, V), distinct real candidates) apply to each row.

Backends: reference (plain torch, fp32; the batched form loops over the rows) | triton
(spd_kernels.verify.triton_tree: one program a row, rows read through their strides;
p's statistics and the top-k / top-p thresholds as in rejection_sample_logits' one-program
kernel, then the candidate masses, N, the accept tests and the residual walk). The Triton kernel
computes p as exp(x - max) / z and sums in its own order, so it agrees with the reference except
where a uniform lies within rounding of a decision boundary.
"""
from __future__ import annotations

import torch

from spd_kernels import dispatch
from spd_kernels.checks import SPDInputError, check_integer, check_tensor
from spd_kernels.opdef import op
from spd_kernels.sampling import check_sampling_params, filtered_probs, sample_from_probs
from spd_kernels.verify import _BELOW_ONE, _check_uniforms


def _check_tree(target_logits, candidates, uniforms, temperature, top_k, top_p):
    check_tensor("target_logits", target_logits, floating=True)
    dims = target_logits.dim()
    if dims not in (1, 2):
        raise SPDInputError(f"target_logits must have 1 dimension [V] or 2 [B, V], got shape "
                            f"{tuple(target_logits.shape)}")
    dev = target_logits.device
    check_tensor("candidates", candidates, dim=dims, device=dev)
    check_integer("candidates", candidates)
    check_tensor("uniforms", uniforms, dim=dims, floating=True, device=dev)
    check_sampling_params(temperature, top_k, top_p)
    if temperature == 0.0:
        raise SPDInputError("temperature must be > 0 for tree_rejection_sample (greedy "
                            "verification is verify_greedy's job)")
    vocab, k = target_logits.shape[-1], candidates.shape[-1]
    if vocab == 0:
        raise SPDInputError("target_logits is empty: the vocabulary must hold at least 1 token")
    if dims == 2:
        rows = target_logits.shape[0]
        for name, t in (("candidates", candidates), ("uniforms", uniforms)):
            if t.shape[0] != rows:
                raise SPDInputError(f"{name} must have B = {rows} rows (target_logits' batch), "
                                    f"got shape {tuple(t.shape)}")
    if uniforms.shape[-1] != k + 1:
        raise SPDInputError(f"uniforms must hold k + 1 = {k + 1} values (one per candidate and "
                            f"one for the residual draw), got {uniforms.shape[-1]}")
    # Values are read on the host only for CPU tensors (never a device synchronisation); each
    # row on its own (a repeat across rows is fine).
    if candidates.device.type == "cpu" and candidates.numel():
        cand = candidates.reshape(-1, k).long()
        bad = (cand < -1) | (cand >= vocab)
        if bool(bad.any()):
            row = f" (row {int(bad.any(1).nonzero()[0])})" if dims == 2 else ""
            raise SPDInputError(f"candidates must be target ids in [0, {vocab}) or -1 "
                                f"(padding){row}")
        srt = cand.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] != -1)
        if bool(dup.any()):
            row = f" (row {int(dup.any(1).nonzero()[0])})" if dims == 2 else ""
            raise SPDInputError(f"candidates must be distinct (apart from -1 padding){row}")
    if uniforms.device.type == "cpu":
        _check_uniforms(uniforms)


def _float32_uniforms(uniforms: torch.Tensor) -> torch.Tensor:
    """The uniforms as the float32 every backend reads: float64 rounded and kept below 1, half
    precision widened (exact)."""
    if uniforms.dtype == torch.float32:
        return uniforms
    u = uniforms.float()
    return u.clamp_(max=_BELOW_ONE) if uniforms.dtype == torch.float64 else u


@op("tree_rejection_sample")
def tree_rejection_sample(target_logits: torch.Tensor, candidates: torch.Tensor,
                          uniforms: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                          top_p: float = 1.0, *,
                          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """target_logits [V], candidates [k] (int64 or int32; -1 = padding), uniforms [k + 1] in
    [0, 1) -> (token [1] int64, accepted [1] int64: the accepted candidate's index or -1).
    Batched: target_logits [B, V], candidates [B, k], uniforms [B, k + 1] -> (token [B],
    accepted [B]), row b what the 1-D call on row b gives (one launch; shared parameters).

    Checks the candidates in order against p = filtered_probs(target_logits, temperature, top_k,
    top_p) and its residuals, each as a point-mass draft (see the module docstring); the token is
    distributed exactly as p."""
    _check_tree(target_logits, candidates, uniforms, temperature, top_k, top_p)
    return dispatch.call("tree_rejection_sample", target_logits.device, target_logits,
                         candidates, _float32_uniforms(uniforms), float(temperature), int(top_k),
                         float(top_p), backend=backend)


@tree_rejection_sample.register_fake
def _(target_logits, candidates, uniforms, temperature=1.0, top_k=0, top_p=1.0):
    rows = target_logits.shape[0] if target_logits.dim() == 2 else 1
    one = target_logits.new_empty(rows, dtype=torch.int64)
    return one, torch.empty_like(one)


@dispatch.register("tree_rejection_sample", "reference")
def tree_rejection_sample_reference(target_logits, candidates, uniforms, temperature=1.0,
                                    top_k=0, top_p=1.0):
    if target_logits.dim() == 2:  # the batched form: each row as the 1-D call on it
        if target_logits.shape[0] == 0:
            none = torch.empty(0, dtype=torch.int64, device=target_logits.device)
            return none, none.clone()
        outs = [_reference_row(x, c, u, temperature, top_k, top_p)
                for x, c, u in zip(target_logits, candidates, uniforms)]
        return torch.cat([t for t, _ in outs]), torch.cat([a for _, a in outs])
    return _reference_row(target_logits, candidates, uniforms, temperature, top_k, top_p)


def _reference_row(target_logits, candidates, uniforms, temperature, top_k, top_p):
    """One row: target_logits [V], candidates [k], uniforms [k + 1] -> ([1], [1])."""
    # Exactness, by induction from the last step back: the procedure started at candidate i
    # with residual r_i outputs x with probability r_i(x). At i = k it draws from r_k. At i:
    # P(x) = [x = c_i] r_i(c_i) + (1 - r_i(c_i)) r_{i+1}(x), and for x != c_i
    # r_{i+1}(x) = r_i(x) / (1 - r_i(c_i)), so P(x) = r_i(x) for every x (r_i(c_i) = 1: c_i is
    # always accepted). Padding leaves r unchanged. At i = 0: P(out = x) = r_0(x) = p(x).
    # Since r_k is 0 on every candidate, P(accepted != -1) = P(out in {c_j}) = sum_j p(c_j).
    vocab, k = target_logits.shape[0], candidates.shape[0]
    dev = target_logits.device
    p = filtered_probs(target_logits[None], temperature, top_k, top_p)[0]  # fp32 [V]
    cand = candidates.long()
    real = (cand >= 0) & (cand < vocab)  # anything else is padding (checked on the host for CPU)
    p_c = torch.where(real, p[torch.where(real, cand, 0)], 0.0)
    is_cand = torch.zeros(vocab + 1, dtype=torch.bool, device=dev)
    is_cand[torch.where(real, cand, vocab)] = True  # padding lands on the extra slot
    rest = p.masked_fill(is_cand[:vocab], 0.0)  # r_k unnormalised: p without the candidates
    n = rest.sum()
    # R_i = N + (p(c_i) + (p(c_{i+1}) + ...)): fp32, from the last candidate back (fixed order)
    tail = torch.zeros((), dtype=torch.float32, device=dev)
    totals = []
    for i in reversed(range(k)):
        tail = tail + p_c[i]
        totals.append(n + tail)
    mass = torch.stack(totals[::-1]) if k else p_c
    u = uniforms.float()
    accept = real & ((u[:k] * mass < p_c) | ((p_c > 0) & (p_c >= mass)))
    pos = torch.arange(k, device=dev)
    first = torch.cat([torch.where(accept, pos, k), pos.new_full((1,), k)]).min()
    drawn = sample_from_probs(rest, u[k])
    token = torch.cat([cand, drawn[None]]).gather(0, first.reshape(1))  # c_first, or the draw
    accepted = torch.where(first < k, first, -1)
    return token, accepted.reshape(1)


dispatch.defer("tree_rejection_sample", "triton", "spd_kernels.verify.triton_tree")

__all__ = ["tree_rejection_sample", "tree_rejection_sample_reference"]
