"""Verification of drafted tokens against the target's final hidden states.

Greedy: a draft is accepted iff it equals argmax of the target logits. Sampling: exact
speculative rejection sampling (accept x ~ q with probability min(1, p(x)/q(x)); on rejection
draw from the normalised residual max(p - q, 0)), which makes the output distributed exactly as
p. The draft distribution q lives on the reduced draft vocabulary and is scattered to target ids
through `draft_to_target`; it is zero elsewhere.
"""
from __future__ import annotations

import torch

from spd_kernels.checks import SPDInputError, check_tensor
from spd_kernels.sampling import filtered_probs, sample_from_probs


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


def verify_greedy(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  lm_head_weight: torch.Tensor, draft_tokens: torch.Tensor):
    """hidden [R, d], draft_tokens [R] -> (target argmax [R] int64, accepted [R] bool)."""
    _check_heads(hidden, norm_weight, lm_head_weight)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=hidden.device)
    if draft_tokens.shape[0] != hidden.shape[0]:
        raise SPDInputError(f"{draft_tokens.shape[0]} draft tokens for {hidden.shape[0]} rows")
    target = final_logits(hidden, norm_weight, eps, lm_head_weight).argmax(-1)
    return target, target == draft_tokens.long()


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


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_tokens: torch.Tensor, uniforms: torch.Tensor):
    """Exact speculative sampling, row by row.

    target_probs [R, V] = p, draft_probs [R, V] = q (both on target ids), draft_tokens [R] drawn
    from q, uniforms [R, 2] in [0, 1): column 0 decides acceptance, column 1 drives the residual
    draw. Returns (token [R] int64, accepted [R] bool): token is the draft where accepted, else
    the residual sample.
    """
    check_tensor("target_probs", target_probs, dim=2, floating=True)
    check_tensor("draft_probs", draft_probs, dim=2, floating=True, device=target_probs.device)
    check_tensor("draft_tokens", draft_tokens, dim=1, device=target_probs.device)
    check_tensor("uniforms", uniforms, dim=2, floating=True, device=target_probs.device)
    rows, vocab = target_probs.shape
    if draft_probs.shape != target_probs.shape:
        raise SPDInputError(f"draft_probs shape {tuple(draft_probs.shape)} != target_probs shape "
                            f"{tuple(target_probs.shape)}")
    if draft_tokens.shape[0] != rows or uniforms.shape != (rows, 2):
        raise SPDInputError(f"expected {rows} draft tokens and uniforms of shape ({rows}, 2)")
    tok = draft_tokens.long()
    if rows and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        raise SPDInputError(f"draft token ids must lie in [0, {vocab})")
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
    resampled = sample_from_probs(residual, uniforms[:, 1])
    return torch.where(accepted, tok, resampled), accepted


__all__ = ["filtered_probs", "final_logits", "rejection_sample", "scatter_draft_probs",
           "verify_greedy"]
