"""The SPD engine (single process): prefill, fill, steady state, verify, rollback, refill.

Stages run one after another here (one process), so this engine proves the algorithm and its
accounting rather than the wall-clock gain; the distributed runtime runs the same schedule with
one rank per stage. An autoregressive path (`generate_ar`) uses the same stages and caches.
"""
from __future__ import annotations

import time
import warnings
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from spd.drafters import Draft, PDMDrafter
from spd.errors import SPDError
from spd.partition import DepthLayout
from spd.pdm import PipelineDraftModule, check_compatible, find_shipped_pdm, read_pdm_config
from spd.schedule import PipelineSchedule
from spd.target import Stage, TargetModel
from spd_kernels import filtered_probs, rejection_sample, sample_from_probs, verify_greedy
from spd_kernels.sampling import check_sampling_params


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_sampling_params(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DecodeStats:
    mode: str
    n: int
    N: int = 0                 # tokens committed by decode cycles (the prefill's token excluded)
    K: int = 0                 # decode cycles (target forwards for the AR path), refills included
    drafts_judged: int = 0
    drafts_accepted: int = 0
    draft_calls: int = 0       # drafter invocations (their time is phase_s["draft"])
    new_tokens: int = 0        # all new tokens returned, the prefill's first token included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    phase_s: dict = field(default_factory=dict)  # seconds per phase (draft, stage_i, verify, ...)
    # Judged and accepted drafts by draft position: SPD counts the tokens in flight when the
    # draft was made (how far it looks past the newest fully computed token); chain drafters
    # (EAGLE-3) count the step in the chain. {position: [judged, accepted]}
    by_position: dict = field(default_factory=dict)

    def count_draft(self, position: int, accepted: bool) -> None:
        """One judged draft at draft position `position` (1-based)."""
        self.drafts_judged += 1
        self.drafts_accepted += int(accepted)
        cell = self.by_position.setdefault(int(position), [0, 0])
        cell[0] += 1
        cell[1] += int(accepted)

    @property
    def alpha(self) -> float:
        return self.N / self.K if self.K else 0.0

    @property
    def theoretical_speedup(self) -> float:
        return self.alpha * self.n

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_judged if self.drafts_judged else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.N / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["phase_s"] = dict(self.phase_s)
        d["by_position"] = {str(k): list(v) for k, v in sorted(self.by_position.items())}
        d["phase_s"]["control"] = max(0.0, self.decode_s - sum(self.phase_s.values()))
        d.update(alpha=self.alpha, theoretical_speedup=self.theoretical_speedup,
                 acceptance_rate=self.acceptance_rate, decode_tok_s=self.decode_tok_s)
        return d

    def summary(self) -> str:
        return (f"mode={self.mode} n={self.n} N={self.N} K={self.K} alpha={self.alpha:.3f} "
                f"S_theory={self.theoretical_speedup:.2f} accept={self.acceptance_rate:.2f} "
                f"decode={self.decode_tok_s:.1f} tok/s")


@dataclass
class GenerationResult:
    token_ids: list[int]   # new tokens only
    stats: DecodeStats


class _Timer:
    """Accumulates wall time per phase: `with timer("verify"): ...`."""

    def __init__(self, sink: dict):
        self.sink = sink

    def __call__(self, phase: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.sink[phase] = timer.sink.get(phase, 0.0) + time.perf_counter() - self.t0
        return _Ctx()


class SPDEngine:
    """Speculative pipeline decoding of one sequence on a target cut into n stages.

    pdm: a PipelineDraftModule, a checkpoint folder, "untrained", or None for the checkpoint
    shipped for this target and layout (an untrained PDM if there is none: exact output, many
    rejections, and a warning says so).
    """

    def __init__(self, target: TargetModel, n_stages: int = 4, split=None, anchors=None,
                 pdm=None, pdm_layers: int | None = None, debug_poison: bool = False,
                 warn_untrained: bool = True):
        self.target = target
        if isinstance(pdm, (str, Path)) and str(pdm) != "untrained" and anchors is None:
            # A checkpoint fixes its own anchors (a PPSD drafter's differ from the default)
            anchors = read_pdm_config(pdm).anchors
        self.layout = DepthLayout.build(target.num_layers, n_stages, split, anchors)
        self.n = self.layout.n
        self.debug_poison = debug_poison
        self._stages: list[Stage] = []
        self.pdm = None
        # Called as hook(stages, drafter, tokens, committed_length) after every rollback: lets
        # tests check that the truncated caches equal a fresh prefill of the committed tokens.
        self.rollback_hooks: list[Callable] = []
        self.pdm_source = "none"
        if self.n >= 2:
            if pdm is None:  # the checkpoint shipped for this target and layout, if any
                pdm = find_shipped_pdm(target, self.layout) or "untrained"
            if isinstance(pdm, str) and pdm == "untrained":
                if warn_untrained:
                    warnings.warn("no trained PDM for this target and n: using an untrained one "
                                  "(output stays exact, decoding is slower)", stacklevel=2)
                pdm = PipelineDraftModule.untrained(target, self.layout, pdm_layers)
                self.pdm_source = "untrained"
            elif not isinstance(pdm, PipelineDraftModule):
                self.pdm_source = str(pdm)
                pdm = PipelineDraftModule.load(pdm, target, self.layout)
            else:
                check_compatible(pdm.config, target, self.layout)
                self.pdm_source = "given"
            self.pdm = pdm
            self.drafter = PDMDrafter(pdm)

    # --- set-up -------------------------------------------------------------------------------
    def _check_prompt(self, prompt_ids, max_new_tokens: int) -> tuple[torch.Tensor, int]:
        t = self.target
        ids = torch.as_tensor(prompt_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise SPDError("the prompt is empty: give at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= t.vocab_size:
            raise SPDError(f"prompt token ids must lie in [0, {t.vocab_size}) for this target")
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
            raise SPDError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
        if ids.numel() >= t.max_context:
            raise SPDError(f"the prompt has {ids.numel()} tokens but the model's context is "
                           f"{t.max_context}: shorten the prompt")
        room = t.max_context - ids.numel()
        if max_new_tokens > room:
            warnings.warn(f"max_new_tokens={max_new_tokens} exceeds the context left after the "
                          f"prompt; generating at most {room}", stacklevel=3)
            max_new_tokens = room
        return ids.to(t.device), int(max_new_tokens)

    def _prepare_stages(self, capacity: int, n: int) -> list[Stage]:
        layout = self.layout if n == self.n else DepthLayout.build(
            self.target.num_layers, n, None, self.layout.anchors)
        reuse = (len(self._stages) == n and self._stages[0].cache.capacity >= capacity
                 and [s.layer_ids for s in self._stages] == list(layout.stages))
        if not reuse:
            self._stages = [Stage(self.target, i, r, capacity, self.debug_poison)
                            for i, r in enumerate(layout.stages)]
        for s in self._stages:
            s.cache.truncate(0)
        return self._stages

    def _pick(self, logits: torch.Tensor, sampling: SamplingParams, gen) -> int:
        """The target's own choice from logits [V] (greedy or sampled)."""
        if sampling.greedy:
            return int(logits.argmax())
        probs = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        return int(sample_from_probs(probs, torch.rand((), generator=gen).to(probs.device)))

    def _prefill(self, stages, ids, record=None) -> torch.Tensor:
        h = self.target.embed_tokens(ids)
        if record is not None:
            record(0, h)
        for st in stages:
            h = st.forward(h, 0, record)
        return h

    # --- autoregressive path ------------------------------------------------------------------
    @torch.no_grad()
    def generate_ar(self, prompt_ids, max_new_tokens: int = 64,
                    sampling: SamplingParams = SamplingParams(),
                    on_token: Callable[[int], None] | None = None) -> GenerationResult:
        """Plain decoding through the same stages: one full forward per token."""
        ids, max_new = self._check_prompt(prompt_ids, max_new_tokens)
        t = self.target
        stages = self._prepare_stages(ids.numel() + max_new + 1, self.n)
        stats = DecodeStats(mode="ar", n=1)
        timer = _Timer(stats.phase_s)
        gen = torch.Generator().manual_seed(sampling.seed)
        t0 = time.perf_counter()
        h = self._prefill(stages, ids)
        token = self._pick(t.logits(h[-1:])[0], sampling, gen)
        stats.prefill_s = time.perf_counter() - t0
        out = [token]
        if on_token:
            on_token(token)
        t0 = time.perf_counter()
        pos = ids.numel()
        while len(out) < max_new and token not in t.eos_token_ids:
            with timer("stage"):
                h = t.embed_tokens(torch.tensor([token], device=t.device))
                for st in stages:
                    h = st.forward(h, pos, None)
            with timer("verify"):
                token = self._pick(t.logits(h)[0], sampling, gen)
            pos += 1
            out.append(token)
            stats.K += 1
            stats.N += 1
            if on_token:
                on_token(token)
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return GenerationResult(out, stats)

    # --- speculative pipeline decoding --------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams = SamplingParams(), drafter=None,
                 on_token: Callable[[int], None] | None = None) -> GenerationResult:
        if self.n < 2:
            return self.generate_ar(prompt_ids, max_new_tokens, sampling, on_token)
        ids, max_new = self._check_prompt(prompt_ids, max_new_tokens)
        t, n, layout = self.target, self.n, self.layout
        drafter = drafter or self.drafter
        prompt_len = ids.numel()
        capacity = prompt_len + max_new + n + 2
        stages = self._prepare_stages(capacity, n)
        drafter.begin(capacity, t.vocab_size)

        # Per-position state: token, anchor hidden states, the hidden an in-flight token carries
        # between stages, and (sampling) the draft distribution that proposed it.
        tokens = torch.zeros(capacity, dtype=torch.int64, device=t.device)
        tokens[:prompt_len] = ids
        anchors = torch.zeros(len(layout.anchors), capacity, t.hidden_size, device=t.device,
                              dtype=t.dtype)
        carry = torch.zeros(capacity, t.hidden_size, device=t.device, dtype=t.dtype)
        draft_q: dict[int, torch.Tensor] = {}
        draft_fill: dict[int, int] = {}   # position -> tokens in flight when it was drafted
        slot = {b: j for j, b in enumerate(layout.anchors)}
        type_of_depth = torch.tensor([layout.agg_type(k) for k in range(n + 1)],
                                     device=t.device)

        stats = DecodeStats(mode="spd", n=n)
        timer = _Timer(stats.phase_s)
        gen = torch.Generator().manual_seed(sampling.seed)

        def record_at(position):
            def record(hidden_index, h):
                j = slot.get(hidden_index)
                if j is not None:
                    anchors[j, position:position + h.shape[0]] = h
            return record

        def enter(position: int, token: int, q: torch.Tensor | None = None) -> None:
            """Token enters the pipeline at depth 0: only its embedding exists. q is the draft
            distribution that proposed it (sampling), kept until the token is judged."""
            tokens[position] = token
            e = t.embed_tokens(tokens[position:position + 1])
            anchors[0, position] = e[0]
            carry[position] = e[0]
            if q is not None:
                draft_q[position] = q

        post_step = getattr(drafter, "post_step", False)

        def draft_newest(extra_depth: int) -> Draft:
            with timer("draft"):
                rows = sched.draft_rows()
                depths = torch.tensor([min(n, sched.depth(p) + extra_depth) for p in rows],
                                      device=t.device)
                u = torch.rand((), generator=gen)
                draft = drafter.draft(anchors[:, rows.start:rows.stop], type_of_depth[depths],
                                      rows.start, sched.newest + 1, sampling, u)
                draft_fill[sched.newest + 1] = sched.count
                stats.draft_calls += 1
                sched.after_draft()
            return draft

        # Prefill: the prompt through every stage as one chunk; the PDM caches depth-n features.
        t0 = time.perf_counter()
        h = self._prefill(stages, ids, record_at(0))
        first = self._pick(t.logits(h[-1:])[0], sampling, gen)
        drafter.prefill(anchors[:, :prompt_len],
                        type_of_depth[n].repeat(prompt_len))
        stats.prefill_s = time.perf_counter() - t0
        out = [first]
        if on_token:
            on_token(first)

        sched = PipelineSchedule(n)
        sched.seed(prompt_len, drafter_valid=prompt_len)
        enter(prompt_len, first)
        done = first in t.eos_token_ids or len(out) >= max_new
        t0 = time.perf_counter()
        while not done:
            stats.K += 1
            # 1. Draft the successor of the newest token from pre-step features, concurrently
            #    with 2. every in-flight token running its next stage. (Post-step drafting, an
            #    ablation, waits for the stages and sees every in-flight token one stage deeper.)
            if not post_step:
                draft = draft_newest(0)
            for s, p in sched.stage_work():
                with timer(f"stage_{s}"):
                    carry[p] = stages[s].forward(carry[p:p + 1], p, record_at(p))[0]
            if post_step:
                draft = draft_newest(1)
            if not sched.full:  # filling: nothing leaves the pipeline this cycle
                sched.refill()
                enter(sched.newest, draft.token, draft.q)
                continue
            # 3. The oldest token leaves the last stage; its logits judge the next one.
            with timer("verify"):
                judged = sched.judged
                accepted, token = self._verify(carry[sched.start:sched.start + 1],
                                               tokens[judged:judged + 1],
                                               draft_q.pop(judged, None), sampling, gen)
            stats.count_draft(draft_fill.pop(judged, n), accepted)
            stats.N += 1
            out.append(token)
            if on_token:
                on_token(token)
            done = token in t.eos_token_ids or len(out) >= max_new
            if accepted:
                sched.accept()
                if not done:
                    enter(sched.newest, draft.token, draft.q)
            else:
                with timer("rollback"):
                    sched.reject()
                    for st in stages:
                        st.cache.truncate(judged)
                    draft_q.clear()
                    draft_fill.clear()
                    if not done:
                        enter(judged, token)
                for hook in self.rollback_hooks:
                    hook(stages, drafter, tokens, judged)
        stats.decode_s = time.perf_counter() - t0
        stats.new_tokens = len(out)
        return GenerationResult(out, stats)

    def _verify(self, hidden, draft_token, q, sampling: SamplingParams, gen):
        """(accepted, committed token) for the draft judged by `hidden` (the predecessor's state)."""
        t = self.target
        if sampling.greedy:
            target, ok = verify_greedy(hidden, t.norm.weight, t.rms_eps, t.lm_head.weight,
                                       draft_token)
            return bool(ok[0]), int(target[0])
        p = filtered_probs(t.logits(hidden), sampling.temperature, sampling.top_k, sampling.top_p)
        u = torch.rand(1, 2, generator=gen).to(p.device)
        token, ok = rejection_sample(p, q[None].to(p.device), draft_token, u)
        return bool(ok[0]), int(token[0])
