"""Chain drafting with an EAGLE-3-style head, verified by one target forward per round.

Each round: the head drafts k tokens one after another, the whole target runs once over the last
committed token and the k drafts, and the longest acceptable prefix is committed plus one target
token (the correction at the first rejection, or the bonus after k acceptances). Greedy accepts a
draft iff it equals the target's argmax; sampling uses exact rejection sampling, so the output
follows the target's distribution either way.

Cache invariant between rounds, with x_t the last committed token: the target cache holds rows
0..t-1 (x_t's row is computed by the next verification forward), the head cache rows 0..t-1 built
from target features (row t-1 is the next chain's step 1), and `head_out`/`head_logits` are that
row's output and draft logits.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable

import torch

from spd.baselines.eagle import METHOD, EagleHead, check_compatible, find_shipped_eagle
from spd.errors import SPDError
from spd.model.target import Stage, TargetModel
from spd.runtime.engine import SPDEngine
from spd.runtime.request import check_prompt
from spd.runtime.types import DecodeStats, GenerationResult, PhaseTimer, SamplingParams
from spd.runtime.verdict import pick
from spd_kernels import filtered_probs, rejection_sample, sample_from_probs
from spd_kernels.verify import scatter_draft_probs


class EagleDecoder:
    """Speculative decoding of one sequence with an EAGLE-3-style chain-drafting head.

    head: an EagleHead, a checkpoint folder, "untrained", or None for the head shipped for this
    target (an untrained one if there is none: exact output, few acceptances, and a warning).
    draft_steps: tokens drafted per round (default: the head's config).
    """

    def __init__(self, target: TargetModel, head=None, draft_steps: int | None = None,
                 warn_untrained: bool = True, debug_poison: bool = False):
        self.target = target
        self.head_source = "given"
        if head is None:
            head = find_shipped_eagle(target) or "untrained"
        if isinstance(head, str) and head == "untrained":
            if warn_untrained:
                warnings.warn("no trained EAGLE-3 head for this target: using an untrained one "
                              "(output stays exact, decoding is slower)", stacklevel=2)
            head = EagleHead.untrained(target)
            self.head_source = "untrained"
        elif not isinstance(head, EagleHead):
            self.head_source = str(head)
            head = EagleHead.load(head, target)
        else:
            check_compatible(head.config, target)
        self.head = head
        steps = head.config.draft_steps if draft_steps is None else draft_steps
        if int(steps) != steps or steps < 1:
            raise SPDError(f"draft_steps must be a positive integer, got {steps}")
        self.draft_steps = int(steps)
        self.debug_poison = debug_poison
        # Prompt checks and the target's own pick come from spd.runtime.sequence and the autoregressive
        # reference from the one-stage engine, so both paths share conventions exactly.
        self._ar = SPDEngine(target, n_stages=1, debug_poison=debug_poison)
        self._stage: Stage | None = None
        self._cache = None

    def generate_ar(self, prompt_ids, max_new_tokens: int = 64,
                    sampling: SamplingParams = SamplingParams(),
                    on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Plain decoding of the same target: the reference for speed and exactness."""
        return self._ar.generate_ar(prompt_ids, max_new_tokens, sampling, on_token)

    # --- pieces ---------------------------------------------------------------------------
    def _prepare(self, capacity: int):
        t = self.target
        if self._stage is None or self._stage.cache.capacity < capacity:
            # a round drops at most draft_steps rows (hybrid targets' state rings)
            self._stage = Stage(t, 0, range(0, t.num_layers), capacity, self.debug_poison,
                                max_rollback=self.draft_steps)
            self._cache = self.head.new_cache(capacity, self.debug_poison)
        self._stage.cache.truncate(0)
        self._cache.truncate(0)
        return self._stage, self._cache

    def _choose(self, logits: torch.Tensor, position: int, sampling: SamplingParams, gen):
        """The draft for `position` from the head's logits [draft_vocab]: (target id, q on target
        ids or None when greedy). q is the distribution the token was drawn from."""
        d2t = self.head.draft_to_target
        if sampling.greedy:
            return int(d2t[logits.argmax()]), None
        q = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        idx = sample_from_probs(q, torch.rand((), generator=gen).to(q.device))
        return int(d2t[idx]), scatter_draft_probs(q[None], d2t, self.target.vocab_size)[0]

    def _judge(self, hidden: torch.Tensor, drafts: list[int], qs: list, sampling, gen):
        """Verification of k drafts from the k+1 target rows: (number accepted, the target's
        token after them: the correction at the first rejection or the bonus)."""
        t = self.target
        k = len(drafts)
        dev = hidden.device
        if sampling.greedy:
            # The last row judges nothing: its draft slot is a placeholder.
            cand = torch.tensor(drafts + [0], dtype=torch.int64, device=dev)
            best, ok = t.verify_greedy(hidden, cand)
            ok = ok[:k].tolist()
            a = ok.index(False) if False in ok else k
            return a, int(best[a])
        p = filtered_probs(t.logits(hidden), sampling.temperature, sampling.top_k, sampling.top_p)
        u = torch.rand(k + 1, 2, generator=gen).to(dev)  # independent per row: rows after the
        a = k                                           # first rejection are simply ignored
        token = None
        if k:
            tok, ok = rejection_sample(p[:k], torch.stack(qs).to(dev),
                                       torch.tensor(drafts, dtype=torch.int64, device=dev), u[:k])
            ok = ok.tolist()
            if False in ok:
                a = ok.index(False)
                token = int(tok[a])
        if token is None:  # every draft accepted: the bonus token from the last row
            token = int(sample_from_probs(p[k], u[k, 0]))
        return a, token

    # --- decoding -------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(),
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        ids, max_new = check_prompt(self.target, prompt_ids, max_new_tokens)
        t, head = self.target, self.head
        layers = list(head.config.feature_layers)
        prompt_len = ids.numel()
        capacity = prompt_len + max_new + self.draft_steps + 2
        stage, cache = self._prepare(capacity)
        tokens = torch.zeros(capacity, dtype=torch.int64, device=t.device)
        tokens[:prompt_len] = ids
        feats = torch.zeros(3, capacity, t.hidden_size, device=t.device, dtype=t.dtype)
        stats = DecodeStats(mode=METHOD, n=1)
        timer = PhaseTimer(stats.phase_s)
        gen = torch.Generator().manual_seed(sampling.seed)

        def run_target(start: int, rows: int) -> torch.Tensor:
            """Tokens at positions start.. through every layer, keeping low/mid/high."""
            def record(hidden_index, h):
                for j, b in enumerate(layers):  # a layer may be named twice
                    if b == hidden_index:
                        feats[j, start:start + rows] = h
            h = t.embed_tokens(tokens[start:start + rows])
            record(0, h)
            return stage.forward(h, start, record)

        def head_rows(a: int, b: int):
            """Append head rows a..b-1 built from target features; returns the last row's
            output and logits (the next chain's step 1)."""
            emb = t.embed_tokens(tokens[a + 1:b + 1])
            out, logits = head.step(emb, head.fuse(feats[:, a:b]), a, cache)
            return out[-1:], logits

        t0 = time.perf_counter()
        h = run_target(0, prompt_len)
        first = pick(t.logits(h[-1:])[0], sampling, gen)
        tokens[prompt_len] = first
        last = prompt_len                       # position of the last committed token
        head_out, head_logits = head_rows(0, last)
        stats.prefill_s = time.perf_counter() - t0
        out = [first]
        if on_token:
            on_token(first)
        done = first in t.eos_token_ids or len(out) >= max_new
        t0 = time.perf_counter()
        while not done:
            stats.K += 1
            # Draft k tokens: the most this round can still commit, less the target's own token.
            k = min(self.draft_steps, max_new - len(out) - 1)
            drafts, qs = [], []
            with timer("draft"):
                o, logits = head_out, head_logits
                for j in range(1, k + 1):
                    if j > 1:   # step j: a new row at position last+j-2
                        emb = t.embed_tokens(torch.tensor([drafts[-1]], device=t.device))
                        o, logits = head.step(emb, o, last + j - 2, cache)
                        stats.draft_calls += 1
                    token, q = self._choose(logits, last + j, sampling, gen)
                    drafts.append(token)
                    qs.append(q)
            with timer("stage"):
                tokens[last + 1:last + 1 + k] = torch.tensor(drafts, dtype=torch.int64)
                h = run_target(last, k + 1)
            with timer("verify"):
                accepted, token = self._judge(h, drafts, qs, sampling, gen)
            # Commit the accepted drafts, then the target's token; stop at EOS or the limit.
            committed = drafts[:accepted] + [token]
            n_commit = 0
            for j, tok in enumerate(committed):
                if j < k:
                    stats.count_draft(j + 1, j < accepted)
                out.append(tok)
                n_commit += 1
                if on_token:
                    on_token(tok)
                if tok in t.eos_token_ids or len(out) >= max_new:
                    done = True
                    break
            stats.N += n_commit
            if done:
                break
            # Roll back to the committed length; the head gets rows from the new features.
            new_last = last + n_commit
            with timer("rollback"):
                tokens[last + accepted + 1] = token
                stage.cache.truncate(new_last)
                cache.truncate(last)
            with timer("draft"):
                head_out, head_logits = head_rows(last, new_last)
                stats.draft_calls += 1   # the next chain's step 1
                last = new_last
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return GenerationResult(out, stats, "stop" if out[-1] in t.eos_token_ids else "length")
