"""Plain autoregressive decoding of the target, the baseline every speedup is measured against.

One full forward per token: embedding, every stage's step, final norm + LM head, the choice. On a
GPU the forward of one token is one CUDA graph (positions from the caches' device lengths, the
greedy choice by the fused verify kernel, the token fed back on the device), so a decode step is
one launch, as in the best single-GPU decoders. The host reads each token one step late from a
pinned buffer (streaming, EOS), while the GPU already runs the next step; only sampling takes a
host draw per token. On the CPU the same forward runs eagerly.
"""
from __future__ import annotations

from typing import Callable

import torch

from spd.cuda_graphs import GraphSet, graphs_enabled
from spd.device import to_device
from spd.model.target import Stage, TargetModel
from spd.runtime.stopping import StopRule
from spd.runtime.types import SamplingParams
from spd.runtime.verdict import pick


class ARDecoder:
    """Decodes after a prefill through `stages`, whose caches hold the prompt."""

    def __init__(self, target: TargetModel, stages: list[Stage]):
        self.t, self.stages = target, stages
        self.sampling, self.gen = SamplingParams(), None
        dev = target.device
        self._no_draft = torch.full((1,), -1, dtype=torch.int64, device=dev)
        self.graphs = None
        if graphs_enabled(dev):
            self.graphs = GraphSet(dev, "autoregressive step", self._device_step,
                                   undo=self._undo)

    def _choose(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, d] -> greedy: the target's token [1] int64; sampling: logits [V] fp32."""
        t = self.t
        if self.sampling.greedy:
            return t.verify_greedy(hidden, self._no_draft)[0]
        return t.logits(hidden)[0]

    def _device_step(self, token: torch.Tensor) -> torch.Tensor:
        # token [1] int64 on the device; each stage writes at its cache's device length.
        h = self.t.embed_tokens(token)
        for st in self.stages:
            h = st.step(h, st.cache.position)[-1]
            st.cache.lengths.add_(1)
        return self._choose(h)

    def _undo(self, token: torch.Tensor) -> None:
        for st in self.stages:
            st.cache.lengths.sub_(1)

    def _step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """The forward of `token` [1] at position `pos`: greedy token [1] or logits [V]."""
        if self.graphs is not None and self.graphs.failed is None:
            for st in self.stages:
                st.cache.check_room(pos, 1)
            out = self.graphs.run(self.sampling.greedy, token)
            if out is not None:
                return out
            for st in self.stages:  # capture failed (warned): the eager step writes at pos
                st.cache.set_length(pos)
        h = self.t.embed_tokens(token)
        for st in self.stages:
            h = st.forward(h, pos)
        return self._choose(h)

    def decode(self, first: int, pos: int, max_new: int, sampling: SamplingParams,
               gen: torch.Generator, stop: StopRule, on_token: Callable[[int], None] | None,
               timer) -> list[int]:
        """Tokens after `first` (the prefill's, at position `pos`, already fed to `stop`) up to
        max_new in all, or until `stop` ends the decode. The graphs (one greedy, one returning
        logits) are kept across calls: reuse a decoder for the same stages."""
        self.sampling, self.gen = sampling, gen
        out = [first]
        if max_new <= 1 or stop.ended:
            return out
        dev = self.t.device
        token = torch.tensor([first], dtype=torch.int64, device=dev)
        if self.sampling.greedy and dev.type == "cuda":
            return self._decode_streamed(out, token, pos, max_new, stop, on_token, timer)
        while len(out) < max_new and not stop.ended:
            with timer("step"):
                chosen = self._step(token, pos)
                nxt = int(chosen[0]) if self.sampling.greedy else pick(chosen, self.sampling,
                                                                       self.gen)
            token = to_device(torch.tensor([nxt], dtype=torch.int64), dev)
            pos += 1
            out.append(nxt)
            stop.feed(nxt)
            if on_token:
                on_token(nxt)
        return out

    def _decode_streamed(self, out, token, pos, max_new, stop, on_token, timer) -> list[int]:
        """Greedy on a GPU: token k is read on the host while step k + 1 runs; the step after the
        end (or past max_new) is computed and dropped, never returned."""
        pinned = torch.empty(2, dtype=torch.int64, pin_memory=True)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        issued = 0
        with timer("step"):
            while True:
                if len(out) + issued < max_new:
                    token = self._step(token, pos)  # feeds back on the device
                    pos += 1
                    slot = (len(out) + issued) % 2
                    pinned[slot:slot + 1].copy_(token, non_blocking=True)
                    events[slot].record()
                    issued += 1
                if issued == 0:
                    break
                # read the oldest issued token (one step behind the newest)
                if issued == 2 or len(out) + issued >= max_new:
                    slot = len(out) % 2
                    events[slot].synchronize()
                    nxt = int(pinned[slot])
                    issued -= 1
                    out.append(nxt)
                    ended = stop.feed(nxt)
                    if on_token:
                        on_token(nxt)
                    if ended:
                        break
        return out
