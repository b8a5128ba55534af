"""What every rank is told: the run's configuration, the speculation policy, requests, roles."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from spd.draft.lookup import DEFAULT_MIN_LEN as DEFAULT_LOOKUP
from spd.errors import SPDError
from spd.runtime.engine import SamplingParams

DRAFT_RANK = 0


def role_of(rank: int) -> str:
    return "draft rank" if rank == DRAFT_RANK else f"stage {rank - 1}"


# --- configuration ----------------------------------------------------------------------------
@dataclass
class DistConfig:
    """What every rank needs to build its piece. Picklable (sent to spawned ranks)."""
    n_stages: int = 4
    split: list[int] | None = None
    anchors: list[int] | None = None
    pdm: str | None = None
    pdm_layers: int | None = None
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None      # the target's weights (spd.model.loading.resolve_dtype)
    # factory(rank) -> TargetModel; default: load_target(model, device). Tests pass tiny targets.
    target_factory: Callable | None = None
    fault_timeout: float = 10.0   # a silent rank is declared dead after this many seconds
    op_timeout: float = 300.0     # bound of any single wait inside a generation (hangs)
    threads: int | None = None    # torch threads per rank (None: leave torch's default)
    backend: str | None = None    # None: nccl for CUDA devices, gloo otherwise
    # Send data through host copies: None = when gloo carries GPU tensors; True forces it
    # (tests run that path on CPU).
    stage_through_host: bool | None = None
    # Test hook: {"rank": r, "cycle": c, "action": "raise" | "kill"} fails rank r at decode cycle c.
    fault: dict | None = None
    # Announce the next cycle before the current draft is judged: "auto" (while recent drafts
    # are mostly accepted), "on" or "off" (see SpeculationPolicy).
    speculative_control: str = "auto"
    # Context lookup's shortest match (spd.draft.lookup; 0: the PDM alone).
    lookup: int = DEFAULT_LOOKUP
    # Test and benchmark hook (spd.distributed.emulate): every stage forward and draft step
    # becomes a fixed wait of this many seconds; emulate_wait "sleep" (host) or "spin" (CUDA).
    emulate_s: float | None = None
    emulate_wait: str = "sleep"

    @property
    def world_size(self) -> int:
        return self.n_stages + 1

    def validate(self) -> None:
        if int(self.n_stages) != self.n_stages or self.n_stages < 2:
            raise SPDError(f"the distributed runtime needs at least 2 stages (n + 1 >= 3 ranks), "
                           f"got --stages {self.n_stages}; use the single-process engine for n=1")
        if not self.fault_timeout > 0:
            raise SPDError(f"fault timeout must be > 0 seconds, got {self.fault_timeout}")
        if not self.op_timeout > 0:
            raise SPDError(f"communication timeout must be > 0 seconds, got {self.op_timeout}")
        if self.speculative_control not in SPECULATION_MODES:
            raise SPDError(f"speculative control must be one of {', '.join(SPECULATION_MODES)}, "
                           f"got {self.speculative_control!r}")
        if self.emulate_s is not None and not self.emulate_s > 0:
            raise SPDError(f"emulated compute must be > 0 seconds, got {self.emulate_s}")
        if self.emulate_wait not in ("sleep", "spin"):
            raise SPDError(f"emulated wait must be sleep or spin, got {self.emulate_wait!r}")


SPECULATION_MODES = ("auto", "on", "off")


class SpeculationPolicy:
    """Whether rank 0 sends the next unit (this cycle's draft) before it reads this cycle's verdict.

    An accepted guess takes the verdict's read off the critical path (stage 0 is already
    computing the draft); a rejected one makes every stage run a unit that is dropped before the
    correction gets through, one cycle later than without the guess. It pays
    when acceptance is high, so "auto" speculates while a moving average of recent judgments
    (weight `decay` on the past) is at least `threshold`. Tokens never depend on it."""

    def __init__(self, mode: str, threshold: float = 0.5, decay: float = 0.8):
        self.mode, self.threshold, self.decay = mode, threshold, decay
        self.rate = threshold  # start neutral: speculate until rejections say otherwise

    def speculate(self) -> bool:
        return self.mode == "on" or (self.mode == "auto" and self.rate >= self.threshold)

    def record(self, accepted: bool) -> None:
        self.rate = self.decay * self.rate + (1.0 - self.decay) * float(accepted)


def parse_fault(text: str | None) -> dict | None:
    """'rank=2,cycle=5,action=kill' -> {'rank': 2, 'cycle': 5, 'action': 'kill'} (test hook)."""
    if not text:
        return None
    try:
        out = dict(kv.split("=", 1) for kv in text.split(",") if kv.strip())
        fault = {"rank": int(out["rank"]), "cycle": int(out.get("cycle", 1)),
                 "action": out.get("action", "raise")}
    except (KeyError, ValueError) as exc:
        raise SPDError(f"fault spec must look like rank=2,cycle=5,action=kill, got '{text}'") from exc
    if fault["action"] not in ("raise", "kill"):
        raise SPDError(f"fault action must be raise or kill, got '{fault['action']}'")
    return fault


@dataclass
class GenerateRequest:
    """One generation for `run_requests` (tests, benchmarks): reference=... uses the oracle."""
    prompt_ids: list[int]
    max_new_tokens: int = 32
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reference: list[int] | None = None
    reference_accuracy: float = 1.0
    reference_seed: int = 0
