"""What a decode takes and gives back: sampling parameters, counts with their derived metrics,
and the result. Both engines, the baselines and the evaluation share these."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from spd.errors import SPDError
from spd.runtime import metrics
from spd_kernels.sampling import check_sampling_params

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes an unsigned 64-bit seed


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_sampling_params(self.temperature, self.top_k, self.top_p)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed <= MAX_SEED:
            raise SPDError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")

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
    lookup_judged: int = 0     # of those, drafts the context lookup proposed (spd.draft.lookup)
    lookup_accepted: int = 0
    draft_calls: int = 0       # drafter invocations (their time is phase_s["draft"])
    stage_rows: int = 0        # rows the stages computed in decode cycles (a chain: one per
    #                            in-flight token; a tree: up to its width per stage)
    tree_width: int = 1        # candidates per position (spd.runtime.drafting; 1: the chain)
    new_tokens: int = 0        # all new tokens returned, the prefill's first token included
    prefill_s: float = 0.0
    decode_s: float = 0.0
    phase_s: dict = field(default_factory=dict)  # seconds per phase (draft, stage_i, verify, ...)
    # Judged and accepted drafts by draft position: SPD counts the tokens in flight when the
    # draft was made (how far it looks past the newest fully computed token); chain drafters
    # (EAGLE-3) count the step in the chain. {position: [judged, accepted]}
    by_position: dict = field(default_factory=dict)

    def count_draft(self, position: int, accepted: bool, lookup: bool = False) -> None:
        """One judged draft at draft position `position` (1-based); `lookup`: the context
        lookup proposed it."""
        self.drafts_judged += 1
        self.drafts_accepted += int(accepted)
        self.lookup_judged += int(lookup)
        self.lookup_accepted += int(lookup and accepted)
        cell = self.by_position.setdefault(int(position), [0, 0])
        cell[0] += 1
        cell[1] += int(accepted)

    @property
    def alpha(self) -> float:
        return metrics.alpha(self.N, self.K)

    @property
    def theoretical_speedup(self) -> float:
        return metrics.theoretical_speedup(self.N, self.K, self.n)

    @property
    def acceptance_rate(self) -> float:
        return metrics.rate(self.drafts_accepted, self.drafts_judged)

    @property
    def decode_tok_s(self) -> float:
        return metrics.tokens_per_s(self.N, self.decode_s)

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
                f"decode={self.decode_tok_s:.1f} tok/s"
                + (f" lookup={self.lookup_accepted}/{self.lookup_judged}"
                   if self.lookup_judged else ""))


@dataclass
class GenerationResult:
    token_ids: list[int]   # new tokens only
    stats: DecodeStats
    finish_reason: str = "length"  # "stop": EOS, a stop token or a stop string; "length": budget
    text: str | None = None        # the new text, cut before a stop string (when decodable)


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
