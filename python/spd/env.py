"""Every SPD_* environment variable, read and documented in one place (docs/environment.md).

The runtime reads its variables through the functions here; the kernels read theirs through
`spd_kernels.env` (that package imports without this one); build-time variables are read by
setup.py and the scripts, before anything is installed, and are listed here only.
"""
from __future__ import annotations

from pathlib import Path

from spd_kernels.env import VARIABLES as KERNEL_VARIABLES
from spd_kernels.env import Var

CACHE = Var("SPD_CACHE", "~/.cache/spd", "where the default model, "
            "downloaded wheels and feature caches live", "spd.data.assets")
CUDA_GRAPHS = Var("SPD_CUDA_GRAPHS", "1", "0: run the decode cycle (every rank's) and the "
                  "autoregressive step eagerly on a GPU instead of replaying them as CUDA graphs: "
                  "the same cycle, slower", "spd.cuda_graphs")
REPLAY_CHECK = Var("SPD_REPLAY_CHECK", "0", "1: run every rank's decode cycles eagerly and check "
                   "that each steady cycle is the same work, op for op and tensor for tensor, "
                   "as the first (what a CUDA graph's replay assumes; on a CPU the cycle's look "
                   "at its units is off then); the tests set it", "spd.runtime.cycle_graph")
FAULT_INJECT = Var("SPD_FAULT_INJECT", "", "tests only: make a distributed rank fail on purpose "
                   "(rank=2,cycle=5,action=kill)", "spd.cli.generate")
TRAIN_FAULT = Var("SPD_TRAIN_FAULT", "", "tests only: make a training rank kill itself in the "
                  "middle of a step (rank=1,step=5)", "spd.train.ranks")
RUN_SECRET = Var("SPD_RUN_SECRET", "", "the distributed run's secret, which signs the store "
                 "records that can stop it: the self-launcher makes one; with torchrun on several "
                 "nodes set the same random value on every node (docs/distributed.md)",
                 "spd.distributed.launch")

BUILD_VARIABLES = (
    Var("SPD_CUDA_ARCHS", "90", "CUDA architectures the extension is compiled for, e.g. 80;90",
        "setup.py"),
    Var("SPD_SIMT_SANITIZE", "0", "1: build the host emulation alone with AddressSanitizer and "
        "the alignment check", "setup.py, tests/sanitize_emulation.sh"),
    Var("SPD_CI_VENV", ".venv", "the virtual environment .ci/run creates", ".ci/run"),
    Var("SPD_DATE", "$(date +%F)", "date in the names of the device session's result files",
        "benchmarks/device_session.sh"),
    Var("SPD_DEVICE_BUDGET", "560", "seconds the device session may spend",
        "benchmarks/device_session.sh"),
    Var("SPD_DEVICE_SMOKE", "", "set: a tiny CPU run that checks the device script itself",
        "benchmarks/device_session.sh"),
    Var("SPD_TEST_WORKERS", "8", "pytest-xdist workers of the device session's GPU tests",
        "benchmarks/device_session.sh"),
    Var("SPD_TRAIN_SECONDS", "300", "how long the device training script trains the default "
        "model's drafter (20 in its smoke mode)", "benchmarks/device_train.sh"),
    Var("SPD_TRAIN_DATA", "sharegpt", "the --data of the device training script's run "
        "(space-separated)", "benchmarks/device_train.sh"),
    Var("SPD_TRAIN_MODEL", "", "a local Hugging Face folder for the device training script "
        "(default: the default model in SPD_CACHE)", "benchmarks/device_train.sh"),
)

RUNTIME_VARIABLES = (CACHE, CUDA_GRAPHS, REPLAY_CHECK, FAULT_INJECT, TRAIN_FAULT, RUN_SECRET)
VARIABLES = RUNTIME_VARIABLES + KERNEL_VARIABLES + BUILD_VARIABLES


def cache_dir() -> Path:
    return Path(CACHE.get()).expanduser()


def cuda_graphs_enabled() -> bool:
    return CUDA_GRAPHS.get() != "0"


def fault_injection() -> str | None:
    return FAULT_INJECT.get() or None


def train_fault() -> str | None:
    return TRAIN_FAULT.get() or None


def run_secret() -> str | None:
    return RUN_SECRET.get() or None


def table() -> str:
    """The variables as a markdown table (docs/environment.md is checked against it)."""
    rows = ["| variable | default | read by | what it does |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | `{v.default or '(unset)'}` | {v.read_by} | {v.doc} |"
             for v in VARIABLES]
    return "\n".join(rows)


def replay_check_enabled() -> bool:
    return REPLAY_CHECK.get() == "1"
