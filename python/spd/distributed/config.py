"""What every rank is told: the run's configuration, requests, roles."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from spd.draft.lookup import DEFAULT_MIN_LEN as DEFAULT_LOOKUP
from spd.errors import SPDError
from spd.runtime.cycle import DEFAULT_AHEAD
from spd.runtime.engine import SamplingParams

DRAFT_RANK = 0  # the draft rank's role, and the process that hosts it


def role_name(role: int) -> str:
    """A role: 0 the draft rank, s + 1 stage s."""
    return "draft rank" if role == DRAFT_RANK else f"stage {role - 1}"


@dataclass(frozen=True)
class Placement:
    """Which process runs which role. Messages address n + 1 roles (role 0 the draft rank, role
    s + 1 stage s); by default each role is a process of its own (rank = role). With the draft
    on stage S (--draft-on-stage) process 0 runs the draft rank and stage S (the PDM on that
    stage's device; stage S runs inside rank 0's cycle, on a CUDA stream of its own), and
    processes 1.. the other stages in order: n processes, n devices."""
    n: int
    draft_on_stage: int | None = None

    @property
    def roles(self) -> int:
        return self.n + 1

    @property
    def processes(self) -> int:
        return self.roles if self.draft_on_stage is None else self.n

    def process_of(self, role: int) -> int:
        S = self.draft_on_stage
        if S is None or role == DRAFT_RANK:
            return role
        s = role - 1
        return 0 if s == S else s + 1 if s < S else s

    def roles_of(self, process: int) -> list[int]:
        """The roles process `process` runs, the draft rank first."""
        return [r for r in range(self.roles) if self.process_of(r) == process]

    def describe(self, process: int) -> str:
        return " + ".join(role_name(r) for r in self.roles_of(process)) or f"rank {process}"


# How this process names ranks in its messages (set once by the launcher and by each rank, so
# a failure names the roles a process runs).
_PLACEMENT: Placement | None = None


def use_placement(config: "DistConfig") -> None:
    global _PLACEMENT
    _PLACEMENT = config.placement


def role_of(rank: int) -> str:
    """What process `rank` runs ("draft rank", "stage 2", "draft rank + stage 0")."""
    return role_name(rank) if _PLACEMENT is None else _PLACEMENT.describe(rank)


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
    # Context lookup's shortest match (spd.draft.lookup; 0: the PDM alone).
    lookup: int = DEFAULT_LOOKUP
    # What the draft step reads (spd.draft.pdm.DRAFT_WEIGHTS): "model", "int8" or "fp8".
    draft_weights: str = "model"
    # Candidate rows per position (spd.runtime.drafting; 1: a chain of drafts).
    tree_width: int = 1
    # Test and benchmark hook (spd.distributed.emulate): every stage forward and draft step
    # becomes a fixed wait of this many seconds; emulate_wait "sleep" (host) or "spin" (CUDA).
    emulate_s: float | None = None
    emulate_wait: str = "sleep"
    # n-device mode: the PDM runs in stage S's process, on that device (Placement); None: the
    # draft rank is a process and a device of its own (n + 1).
    draft_on_stage: int | None = None
    # Cycles each rank launches past the last one its host has read (spd.runtime.cycle).
    ahead: int = DEFAULT_AHEAD

    @property
    def placement(self) -> Placement:
        return Placement(int(self.n_stages), self.draft_on_stage)

    @property
    def world_size(self) -> int:
        """Processes (torch.distributed ranks): n + 1, or n with the draft on a stage."""
        return self.placement.processes

    def describe_world(self) -> str:
        if self.draft_on_stage is None:
            return f"{self.world_size} ({self.n_stages} stage ranks + 1 draft rank)"
        return (f"{self.world_size} (one per stage; the draft rank runs in stage "
                f"{self.draft_on_stage}'s)")

    def validate(self) -> None:
        if int(self.n_stages) != self.n_stages or self.n_stages < 2:
            raise SPDError(f"the distributed runtime needs at least 2 stages (n + 1 >= 3 ranks), "
                           f"got --stages {self.n_stages}; use the single-process engine for n=1")
        if not self.fault_timeout > 0:
            raise SPDError(f"fault timeout must be > 0 seconds, got {self.fault_timeout}")
        if not self.op_timeout > 0:
            raise SPDError(f"communication timeout must be > 0 seconds, got {self.op_timeout}")
        from spd.runtime.sequence import check_tree_width
        check_tree_width(self.tree_width)
        if self.emulate_s is not None and not self.emulate_s > 0:
            raise SPDError(f"emulated compute must be > 0 seconds, got {self.emulate_s}")
        S = self.draft_on_stage
        if S is not None and (isinstance(S, bool) or int(S) != S or not 0 <= S < self.n_stages):
            raise SPDError(f"--draft-on-stage takes a stage index in 0..{self.n_stages - 1} "
                           f"(there are {self.n_stages} stages), got {S!r}")
        if isinstance(self.ahead, bool) or int(self.ahead) != self.ahead or self.ahead < 0:
            raise SPDError(f"--ahead takes a number of cycles >= 0, got {self.ahead!r}")
        if self.emulate_wait not in ("sleep", "spin"):
            raise SPDError(f"emulated wait must be sleep or spin, got {self.emulate_wait!r}")


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
    # a test's own drafter: drafter(engine: SPDEngine) -> drafter, made on rank 0 (picklable)
    drafter: Callable | None = None
    stop_token_ids: list[int] | None = None
