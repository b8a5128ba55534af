"""One sequence's speculative pipeline decode, independent of where the stages run.

`SequenceDecode` holds what the single-process engine (`spd.runtime.engine`) and rank 0 of the
distributed runtime (`spd.distributed.draft_rank`) share for one sequence: the token and anchor buffers,
the `PipelineSchedule`, the draft distributions and fill levels awaiting judgement, the
generator, the stats and the output. The engines own only the transport: how stage forwards run
and how anchor states arrive in `anchors`, and how target caches are truncated after a rollback.

A cycle, as both engines drive it (README, "How a cycle works"):

    draft = dec.draft(0)                      # pre-step features, while the stages run
    ... every (stage, position) in dec.sched.stage_work() runs its next stage ...
    if not dec.sched.full:
        dec.fill(draft)                       # filling: the draft enters at depth 0
    else:
        accepted, token = dec.judge(hidden)   # hidden: the oldest token's final state
        rollback_to = dec.commit(accepted, token, draft)
        ... on rollback, truncate every target cache to rollback_to ...

The generator's draws happen in this order (prefill pick, then per cycle the draft's uniform and,
when full, the verifier's), so seeded sampling gives the same tokens whichever engine runs.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from spd.device import to_device
from spd.draft.drafters import Draft
from spd.draft.lookup import NgramLookup
from spd.errors import SPDError
from spd.runtime.host_mirror import HostMirror
from spd.runtime.schedule import PipelineSchedule
from spd.runtime.stopping import StopRule
from spd.runtime.types import DecodeStats, SamplingParams
from spd_kernels import filtered_probs, rejection_sample_logits, sample_from_probs, verify_greedy

if TYPE_CHECKING:
    from spd.model.partition import DepthLayout
    from spd.model.target import TargetModel


class PhaseTimer:
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


# --- the target's side: prompt checks, its own pick, judging a draft ------------------------------
def _one_sequence(prompt_ids) -> torch.Tensor:
    """Token ids of one sequence as int64 [L]: a list / tuple of ints, a 1-D integer tensor, or a
    [1, L] one (a tokenizer's return_tensors="pt"). A batch is refused, never flattened: SPD
    decodes one sequence at a time."""
    if isinstance(prompt_ids, (str, bytes)):
        raise SPDError("the prompt is text: give its token ids (e.g. "
                       "spd.model.prompt.encode_prompt(target, text) or the tokenizer's ids)")
    if not isinstance(prompt_ids, torch.Tensor):
        if not isinstance(prompt_ids, (list, tuple)) or any(
                isinstance(x, bool) or not isinstance(x, int) for x in prompt_ids):
            kind = type(prompt_ids).__name__
            raise SPDError(f"the prompt must be one sequence of token ids (a list of ints or a "
                           f"1-D integer tensor), got {kind}"
                           + (" holding non-integers or nested lists (a batch?)"
                              if isinstance(prompt_ids, (list, tuple)) else ""))
        return torch.tensor(prompt_ids, dtype=torch.int64).reshape(-1)
    if prompt_ids.dtype == torch.bool or prompt_ids.is_floating_point() or \
            prompt_ids.is_complex():
        raise SPDError(f"prompt token ids must be an integer tensor, got {prompt_ids.dtype}")
    if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1:
        raise SPDError(f"the prompt must be one sequence: a 1-D tensor of token ids (or [1, L]), "
                       f"got shape {tuple(prompt_ids.shape)}; SPD decodes one sequence at a "
                       f"time, so give the rows of a batch one by one")
    return prompt_ids.to(torch.int64)


def check_prompt(target: TargetModel, prompt_ids, max_new_tokens: int) -> tuple[torch.Tensor, int]:
    """(prompt ids on the target's device, max_new_tokens capped to the context left)."""
    t = target
    ids = _one_sequence(prompt_ids)
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
        # stacklevel 3: past this function and the generate() that called it
        warnings.warn(f"max_new_tokens={max_new_tokens} exceeds the context left after the "
                      f"prompt; generating at most {room}", stacklevel=3)
        max_new_tokens = room
    return ids.to(t.device), int(max_new_tokens)


def pick(logits: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """The target's own choice from logits [V] (greedy, or one draw from `gen`)."""
    if sampling.greedy:
        return int(logits.argmax())
    probs = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    return int(sample_from_probs(probs, to_device(torch.rand((), generator=gen), probs.device)))


def read_verdict(token: torch.Tensor, accepted: torch.Tensor) -> tuple[bool, int]:
    """(accepted, token) on the host from a verifier's token [1] int64 and accepted [1] bool:
    one read of both values, not two."""
    tok, ok = torch.cat([token[:1], accepted[:1].to(token.dtype)]).tolist()
    return bool(ok), tok


def verify(target: TargetModel, hidden: torch.Tensor, draft_token: torch.Tensor,
           q: torch.Tensor | None, sampling: SamplingParams, gen: torch.Generator,
           q_ids: torch.Tensor | None = None) -> tuple[bool, int]:
    """(accepted, committed token) for the draft judged by `hidden` [1, d] (the predecessor's
    final state); draft_token [1] int64. Greedy: accept iff the draft is the argmax. Sampling:
    rejection sampling against the draft distribution q [Vq] over the target ids q_ids [Vq]
    (None: q is over every target id)."""
    t = target
    if sampling.greedy:
        best, ok = verify_greedy(hidden, t.norm.weight, t.rms_eps, t.lm_head.weight, draft_token,
                                 t.norm_offset)
        return read_verdict(best, ok)
    logits = t.logits(hidden)
    u = to_device(torch.rand(1, 2, generator=gen), logits.device)
    # Straight from the logits: on a GPU one fused kernel applies temperature / top-k / top-p
    # (no sort, p never stored), maps q's columns to target ids and samples.
    ids = q_ids if q_ids is not None else _vocab_ids(logits.shape[-1], logits.device)
    token, ok = rejection_sample_logits(logits, q[None], ids, draft_token, u,
                                        temperature=sampling.temperature,
                                        top_k=sampling.top_k, top_p=sampling.top_p)
    return read_verdict(token, ok)


_VOCAB_IDS: dict = {}


def _vocab_ids(vocab: int, device: torch.device) -> torch.Tensor:
    """arange(vocab) on device, one tensor per (vocab, device): the kernels cache their checks of
    a vocabulary map per tensor, so the same one is passed every cycle."""
    key = (vocab, str(device))
    ids = _VOCAB_IDS.get(key)
    if ids is None:
        ids = _VOCAB_IDS[key] = torch.arange(vocab, device=device)
    return ids


# --- one sequence's decode state -------------------------------------------------------------------
@dataclass
class PendingDraft:
    """What is kept about a drafted position until it is judged."""
    fill: int                                  # tokens in flight when drafted: its draft position
    q: torch.Tensor | None                     # the draft distribution that proposed it (sampling)
    q_ids: torch.Tensor | None = None          # q's columns as target ids (None: every id)
    from_lookup: bool = False                  # the lookup proposed a token: whether it was
    #                                            used is in SequenceDecode.lookup_used


class SequenceDecode:
    """Everything about one sequence's SPD decode that does not depend on the transport.

    Construct it after `check_prompt`; run the prompt through the stages (filling
    `anchors[:, :prompt_len]`), call `start`, then drive cycles until `done`, and `finish`.
    """

    def __init__(self, target: TargetModel, layout: DepthLayout, drafter, ids: torch.Tensor,
                 max_new: int, sampling: SamplingParams, stats: DecodeStats,
                 on_token: Callable[[int], None] | None = None, stop: StopRule | None = None):
        t, n = target, layout.n
        self.target, self.layout, self.n = target, layout, n
        self.drafter, self.sampling, self.stats, self.on_token = drafter, sampling, stats, on_token
        self.max_new = max_new
        # where the decode ends besides max_new (default: the model's EOS ids)
        self.stop = stop if stop is not None else StopRule(t.eos_token_ids)
        self.prompt_len = ids.numel()
        self.capacity = self.prompt_len + max_new + n + 2
        drafter.begin(self.capacity, t.vocab_size)
        # Per position: the token and its anchor hidden states (slot 0: the embedding).
        self.tokens = torch.zeros(self.capacity, dtype=torch.int64, device=t.device)
        self.tokens[:self.prompt_len] = ids
        self.host_tokens = HostMirror(self.tokens)  # the context lookup reads drafts from here
        self.anchors = torch.zeros(len(layout.anchors), self.capacity, t.hidden_size,
                                   device=t.device, dtype=t.dtype)
        # Drafted positions not judged yet (dropped together on a rejection).
        self.pending: dict[int, PendingDraft] = {}
        # Context lookup (spd.draft.lookup), when the drafter asks for it: committed tokens are
        # indexed as they are emitted.
        min_len = getattr(drafter, "lookup", 0)
        self.lookup = NgramLookup(min_len) if min_len else None
        if self.lookup is not None:
            self.lookup.extend(ids.tolist())
            # per drafted position: whether the gate used the lookup's token (on the device)
            self.lookup_used = HostMirror(torch.zeros(self.capacity, dtype=torch.bool,
                                                      device=t.device))
        self.type_of_depth = torch.tensor([layout.agg_type(k) for k in range(n + 1)],
                                          device=t.device)
        # Aggregation types of the draft rows, per staircase of depths: a few shapes recur, so
        # each is copied to the device once, not every cycle.
        self._row_types: dict[tuple[int, ...], torch.Tensor] = {}
        self.sched = PipelineSchedule(n)
        # Post-step drafting (an ablation) waits for the stages: features one stage deeper.
        self.post_step = getattr(drafter, "post_step", False)
        self.timer = PhaseTimer(stats.phase_s)
        self.gen = torch.Generator().manual_seed(sampling.seed)
        self.draft_s: list[float] = []   # wall time of each draft call (per-cycle breakdowns)
        self.out: list[int] = []
        self.done = False
        self._decode_t0 = 0.0

    # --- set-up ---------------------------------------------------------------------------------
    def start(self, last_hidden: torch.Tensor, prefill_t0: float) -> None:
        """After the prompt's prefill: `last_hidden` [1, d] is the last prompt row's final state.
        The target picks the first token, the drafter caches the prompt's depth-n features, and
        the first token starts the pipeline alone. The decode clock starts here."""
        t, n, P = self.target, self.n, self.prompt_len
        first = pick(t.logits(last_hidden)[0], self.sampling, self.gen)
        self.drafter.prefill(self.anchors[:, :P], self.type_of_depth[n].repeat(P))
        self.stats.prefill_s = time.perf_counter() - prefill_t0
        self._emit(first)
        self.sched.seed(P, drafter_valid=P)
        self.enter(P, first)
        self._decode_t0 = time.perf_counter()

    def finish(self) -> None:
        """Stop the decode clock."""
        self.stats.decode_s = time.perf_counter() - self._decode_t0
        self.stats.new_tokens = len(self.out)

    # --- the cycle ------------------------------------------------------------------------------
    def enter(self, position: int, token) -> None:
        """`token` (an int, or a 0-d device tensor: no host sync) enters stage 0 at depth 0: only
        its embedding (anchor 0) exists."""
        self.tokens[position] = token
        self.host_tokens.wrote(position, position + 1)
        self.anchors[0, position] = self.target.embed_tokens(
            self.tokens[position:position + 1])[0]

    def draft(self, extra_depth: int) -> Draft:
        """The drafter's guess for the successor of the newest in-flight token, from features
        `extra_depth` stages deeper than the schedule's depths (0: pre-step, 1: post-step)."""
        n, sched = self.n, self.sched
        t0 = time.perf_counter()
        with self.timer("draft"):
            rows = sched.draft_rows()
            depths = tuple(min(n, sched.depth(p) + extra_depth) for p in rows)
            types = self._row_types.get(depths)
            if types is None:
                types = self._row_types[depths] = self.type_of_depth[
                    torch.tensor(depths, device=self.target.device)]
            u = torch.rand((), generator=self.gen)
            draft = self.drafter.draft(self.anchors[:, rows.start:rows.stop], types, rows.start,
                                       sched.newest + 1, self.sampling, u)
            from_lookup = False
            if self.lookup is not None:
                draft, from_lookup = self._lookup(sched.newest + 1, draft)
            self.pending[sched.newest + 1] = PendingDraft(sched.count, draft.q, draft.q_ids,
                                                          from_lookup)
            self.stats.draft_calls += 1
            sched.after_draft()
        self.draft_s.append(time.perf_counter() - t0)
        return draft

    def _lookup(self, position: int, draft: Draft) -> tuple[Draft, bool | torch.Tensor]:
        """The context lookup's token for `position` in place of the drafter's, when the text
        so far ends with a match the gate trusts more than the drafter (spd.draft.lookup), and
        whether it was used. Under sampling q is one-hot on the lookup's token, so rejection
        sampling stays exact."""
        # The in-flight tokens past the committed ones, from the host mirror: they were drafted
        # a cycle or more ago, so reading them waits for nothing on the device.
        in_flight = self.host_tokens.read(len(self.lookup), position)
        found = self.lookup.propose(self.lookup.context(in_flight))
        if found is None:
            return draft, False
        token, match_len = found
        q, q_ids = None, None
        if not self.sampling.greedy:
            q, q_ids, draft = self._one_hot(token, draft)
        trust = self.lookup.trust(match_len)
        used = self.lookup_used.buf[position:position + 1]
        if draft.p is None or trust >= 1.0:  # a drafter without a confidence: the match wins
            used.fill_(True)
            self.lookup_used.wrote(position, position + 1)
            return Draft(token, q, q_ids=q_ids), True
        # Gate on the device (the PDM's token and confidence stay there: no host sync); the
        # choice reaches the host through a mirror by the time the draft is judged (stats).
        use = draft.p < trust
        used.copy_(use.view(1))
        self.lookup_used.wrote(position, position + 1)
        return Draft(torch.where(use, torch.full_like(draft.token, token), draft.token),
                     None if q is None else torch.where(use, q, draft.q), q_ids=q_ids), True

    def _one_hot(self, token: int, draft: Draft):
        """(q, q_ids, draft) for the lookup's proposal of `token` under sampling: q one-hot on
        it, over the drafter's columns when the token is one of them (q_ids its map, the
        verifier maps it), else over every target id, the drafter's q scattered there too
        (the rare token outside the draft vocabulary)."""
        column_of = getattr(self.drafter, "draft_column", None)
        column = column_of(token) if column_of is not None and draft.q_ids is not None else None
        if column is not None:
            q = torch.zeros_like(draft.q)
            q[column] = 1.0
            return q, draft.q_ids, draft
        q = torch.zeros(self.target.vocab_size, device=self.target.device)
        q[token] = 1.0
        if draft.q is not None and draft.q_ids is not None:
            full = torch.zeros_like(q).index_copy_(0, draft.q_ids, draft.q)
            draft = Draft(draft.token, full, draft.p)
        return q, None, draft

    def fill(self, draft: Draft) -> None:
        """Filling cycle: nothing left the pipeline, the draft enters at depth 0."""
        self.sched.refill()
        self.enter(self.sched.newest, draft.token)

    def judge(self, hidden: torch.Tensor, verdict=None) -> tuple[bool, int]:
        """The oldest token left the last stage with final state `hidden` [1, d]: judge the
        next in-flight token. Returns (accepted, the token to commit). `verdict`: (target token
        [1], accepted [1]) when the last stage already judged it (greedy, Stage.forward_verify)."""
        with self.timer("verify"):
            if verdict is not None:
                token, ok = verdict
                if isinstance(token, torch.Tensor):  # one read of both values, not two
                    token, ok = torch.cat([token[:1], ok[:1].to(token.dtype)]).tolist()
                    return bool(ok), token
                return bool(ok[0]), int(token[0])
            judged = self.sched.judged
            pending = self.pending[judged]
            return verify(self.target, hidden, self.tokens[judged:judged + 1], pending.q,
                          self.sampling, self.gen, pending.q_ids)

    def commit(self, accepted: bool, token: int, draft: Draft) -> int | None:
        """Commit the judged token. Accept: this cycle's draft enters stage 0 next. Reject: the
        in-flight tokens and the draft are dropped and the correction enters alone; returns the
        committed length every target cache must be truncated to (None when accepted)."""
        judged = self.sched.judged
        pending = self.pending.pop(judged)  # every judged token was drafted
        used = pending.from_lookup and self.lookup_used.read(judged, judged + 1)[0]
        self.stats.count_draft(pending.fill, accepted, used)
        self.stats.N += 1
        self._emit(token)
        if accepted:
            self.sched.accept()
            if not self.done:
                self.enter(self.sched.newest, draft.token)
            return None
        with self.timer("rollback"):
            self.sched.reject()
            self.pending.clear()
            if not self.done:
                self.enter(judged, token)
        return judged

    def _emit(self, token: int) -> None:
        self.out.append(token)
        if self.lookup is not None:
            self.lookup.append(token)
        self.done = self.stop.feed(token) or len(self.out) >= self.max_new
        if self.on_token:
            self.on_token(token)
