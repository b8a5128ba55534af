"""Data-parallel training ranks: the process group torchrun sets up, and what crosses it.

`torchrun --nproc-per-node N -m spd train ...` starts N processes with RANK, WORLD_SIZE,
LOCAL_RANK and a rendezvous in their environment; `RankGroup.from_env` joins them (gloo on the
CPU, NCCL on GPUs, each rank on cuda:LOCAL_RANK). Every rank holds the whole PDM and, for online
distillation, its own frozen target; the data is split by sequence (spd.train.corpus).

Gradients are summed over ranks once per optimiser step, as one flat buffer (the PDM is small:
one all-reduce a step is all DDP would do too, without its hooks), then divided by the number of
loss tokens of the whole global batch, so N ranks compute what one process computes on the same
global batch, up to the order of floating-point sums.

A rank that dies breaks its peers' next all-reduce (gloo reports the closed connection at once;
under NCCL, torchrun stops the other ranks, and `timeout` bounds any wait): the survivors end with
one line that says so and where to resume from, never a hang.
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
from dataclasses import dataclass

import torch

from spd.errors import SPDError

DEFAULT_TIMEOUT_S = 600.0


class RankLostError(RuntimeError):
    """Another rank stopped answering (it died or froze): the run cannot go on."""


@dataclass
class RankGroup:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """Rank 0 writes checkpoints, history and progress."""
        return self.rank == 0

    @classmethod
    def from_env(cls, device: str | torch.device = "cpu",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> "RankGroup":
        """One process (no torchrun), or this rank of torchrun's group, joined here."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        device = torch.device(device)
        if world <= 1:
            return cls(0, 1, device)
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise SPDError(f"rank {rank} needs cuda:{local}, but this machine shows "
                               f"{torch.cuda.device_count()} GPU(s): start at most that many "
                               "ranks per node (--nproc-per-node)")
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            kw = {"device_id": device} if device.type == "cuda" else {}
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
        _stop_quietly_on_sigterm(rank)
        return cls(rank, world, device)

    # --- what crosses ranks --------------------------------------------------------------------
    def sum_(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """All-reduce (sum) in place; a lost peer raises RankLostError naming `what`."""
        if self.world == 1:
            return tensor
        import torch.distributed as dist
        try:
            dist.all_reduce(tensor)
        except (RuntimeError, dist.DistBackendError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            raise RankLostError(f"rank {self.rank} lost the other ranks while summing {what} "
                                f"({first})") from exc
        return tensor

    def sum_gradients_(self, params: list[torch.nn.Parameter], scale: float | torch.Tensor
                       ) -> None:
        """grad <- scale * (sum over ranks of grad) for every parameter (missing grads count as
        zero: a projection no row of this rank used)."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            self.sum_(flat, "gradients")
            offset = 0
            for p in params:
                k = p.numel()
                p.grad.copy_(flat[offset:offset + k].view_as(p))
                offset += k
        for p in params:
            p.grad.mul_(scale)

    def sum_floats(self, values: list[float], what: str) -> list[float]:
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.sum_(t, what).tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values`, rank by rank (each rank gets them all)."""
        if self.world == 1:
            return [list(values)]
        import torch.distributed as dist
        out = [None] * self.world
        dist.all_gather_object(out, list(values))
        return out

    def all_equal(self, value: str, what: str) -> None:
        """Refuse to go on when ranks disagree on `value` (e.g. the configuration)."""
        if self.world == 1:
            return
        import torch.distributed as dist
        values = [None] * self.world
        dist.all_gather_object(values, value)
        if len(set(values)) != 1:
            raise SPDError(f"the ranks disagree on {what}: start every rank with the same "
                           "command")

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


def peak_memory_mb(device: torch.device) -> dict:
    """This process's peak resident memory, and on a GPU the peak allocated there (MB)."""
    import resource
    out = {"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return out


def fault_now(rank: int, step: int) -> None:
    """Test hook (SPD_TRAIN_FAULT=rank=R,step=S): rank R kills itself in the middle of step S."""
    from spd import env
    spec = env.train_fault()
    if not spec:
        return
    try:
        want = dict(part.split("=") for part in spec.split(","))
        hit = int(want["rank"]) == rank and int(want["step"]) == step
    except (ValueError, KeyError):
        raise SPDError(f"SPD_TRAIN_FAULT must look like rank=1,step=5, got {spec!r}") from None
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)


def _stop_quietly_on_sigterm(rank: int) -> None:
    """torchrun stops the other ranks with SIGTERM when one fails: one line, not a traceback."""
    def stop(signum, frame):
        print(f"[spd train] rank {rank} stopped: another rank failed (its error is above); "
              "rerun the same command to resume from the last checkpoint", file=sys.stderr,
              flush=True)
        os._exit(128 + signum)
    signal.signal(signal.SIGTERM, stop)


__all__ = ["DEFAULT_TIMEOUT_S", "RankGroup", "RankLostError", "fault_now", "peak_memory_mb"]
