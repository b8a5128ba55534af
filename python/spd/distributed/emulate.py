"""Emulated compute: what the runtime alone costs (a test and benchmark hook).

With `DistConfig.emulate_s = F` every stage forward and every draft step become a fixed wait of
F seconds, so a cycle's time beyond F is the runtime's own: communication, control, bookkeeping,
verification. The wait is `time.sleep` on a CPU (the cores stay free for the other ranks) and a
spin kernel (`torch.cuda._sleep`, calibrated once) on a GPU when asked for (`emulate_wait =
"spin"`; ranks that share one GPU time-slice kernels of different processes, so there the
default stays a host sleep).

An emulated stage forward is the identity, so the target's verdict on the token after position
p depends on the token at p alone: f(tok) = argmax LM head(final norm(embed(tok))).
`reference_tokens` iterates f: the emulated target's own continuation, which a ReferenceDrafter
proposes (always right, or right with a probability). Everything else (the transport, the
schedule, the verdict, rollbacks) is the real runtime's. This module is read in two places only:
`make_stage` (stage ranks) and `wrap_drafter` (rank 0).
"""
from __future__ import annotations

import time

import torch

from spd.model.target import Stage


class ComputeWait:
    """A wait of `seconds`: host sleep, or (spin=True, CUDA) one spin kernel on the current
    stream, so the host runs ahead of it as it does of a real forward."""

    _CYCLES_PER_S: dict[str, float] = {}

    def __init__(self, seconds: float, device, spin: bool = False):
        self.seconds = float(seconds)
        self.device = torch.device(device)
        self.spin = spin and self.device.type == "cuda"
        if self.spin:
            self.cycles = max(1, int(self.seconds * self._cycles_per_s(self.device)))

    @classmethod
    def _cycles_per_s(cls, device: torch.device) -> float:
        key = str(device)
        if key not in cls._CYCLES_PER_S:
            probe = 2_000_000
            torch.cuda._sleep(probe)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(probe)
            end.record()
            end.synchronize()
            cls._CYCLES_PER_S[key] = probe / (start.elapsed_time(end) * 1e-3)
        return cls._CYCLES_PER_S[key]

    def __call__(self) -> None:
        if self.spin:
            torch.cuda._sleep(self.cycles)
        else:
            time.sleep(self.seconds)


def _wait_of(config) -> ComputeWait | None:
    if not getattr(config, "emulate_s", None):
        return None
    return ComputeWait(config.emulate_s, config.device, getattr(config, "emulate_wait", "sleep")
                       == "spin")


class EmulatedStage(Stage):
    """A stage whose step is the identity after a fixed wait (the cache's length and the last
    stage's verdict are the real stage's)."""

    def __init__(self, *args, wait: ComputeWait, **kwargs):
        super().__init__(*args, cuda_graphs=False, **kwargs)
        self.wait = wait

    def step(self, hidden, start):
        self.wait()
        return [hidden] * len(self.layer_ids)


def make_stage(target, index: int, layer_ids: range, capacity: int, config) -> Stage:
    """The stage a stage rank runs: the real one, or the emulated one under `emulate_s`."""
    wait = _wait_of(config)
    if wait is None:
        return Stage(target, index, layer_ids, capacity)
    return EmulatedStage(target, index, layer_ids, capacity, wait=wait)


class EmulatedDrafter:
    """`inner` (a cheap drafter, e.g. ReferenceDrafter) behind a fixed wait per draft step."""

    def __init__(self, inner, wait: ComputeWait):
        self.inner, self.wait = inner, wait

    def __getattr__(self, name):  # begin, prefill, name, lookup, post_step, ...
        return getattr(self.inner, name)

    def draft(self, *args, **kwargs):
        self.wait()
        return self.inner.draft(*args, **kwargs)


def wrap_drafter(drafter, config):
    """Rank 0's drafter: as it is, or behind the emulated draft step under `emulate_s`."""
    wait = _wait_of(config)
    return drafter if wait is None else EmulatedDrafter(drafter, wait)


@torch.no_grad()
def reference_tokens(target, prompt: list[int], count: int) -> list[int]:
    """prompt + the emulated target's `count` greedy tokens (identity stages: f(last token))."""
    out = list(prompt)
    for _ in range(count):
        h = target.embed_tokens(torch.tensor(out[-1:], device=target.device))
        out.append(int(target.logits(h)[0].argmax()))
    return out


def tiny_target(seed: int, layers: int, rank: int = 0, device: str = "cpu"):
    """A small random Llama built in memory (identical on every rank from the seed): the
    emulated runs need its shapes, embedding and LM head, not its layers' cost."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spd.model.target import TargetModel

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaky: no near-ties between the verdict's paths
    model.generation_config.eos_token_id = None
    return TargetModel(model, tokenizer=None, name=f"emulated-llama-{layers}L-{seed}")
