"""The frozen target as the teacher of online distillation.

Each training step runs the target on its batch (no gradient) and keeps, per token, what the
feature cache would have held: the anchor hidden states, the final normed hidden state (the
target's logits on the draft vocabulary are recomputed from it in the loss) and the target's
argmax over its whole vocabulary. Nothing is written to disk, so memory is bounded by the batch.

Sequences of a batch are right-padded to the longest: attention is causal and the hybrid
targets' recurrent layers run forwards, so padding after a sequence never changes its own
positions, and no attention mask is needed. The states are taken by forward hooks on the
embedding, the anchor layers and the final norm of the Hugging Face model (the full logits are
never formed: the argmax is computed in row chunks).
"""
from __future__ import annotations

from typing import Callable

import torch

from spd.errors import SPDError

ARGMAX_CHUNK = 4096  # rows per LM-head product when taking the argmax (bounds [rows, vocab])


def _output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class Teacher:
    """teacher(sequences) -> one item per sequence, as a FeatureSet item: tokens [T] int32,
    anchors [m, T, d], final [T, d], argmax [T] int32 (the target's dtype and device), and
    mask [T] bool where `mask_of(ids)` names the rows that count (spd.train.corpus.AnswerMask)."""

    def __init__(self, target, anchors: list[int],
                 mask_of: Callable[[list[int]], list[bool]] | None = None):
        if target.hf is None or any(p.is_meta for p in target.hf.parameters()):
            raise SPDError("online distillation needs the whole target in this process (a stage "
                           "rank's partial load cannot teach)")
        if not anchors or anchors[0] != 0 or max(anchors) > target.num_layers - 1:
            raise SPDError(f"teacher anchors must start at 0 and end before the final norm "
                           f"(layer outputs 0..{target.num_layers - 1}), got {anchors}")
        self.target = target
        self.anchors = list(anchors)
        self.mask_of = mask_of
        self._states: dict[int, torch.Tensor] = {}

    def _hooks(self):
        t = self.target
        hooks = []

        def keep(key):
            def hook(module, args, out):
                self._states[key] = _output(out)
            return hook
        hooks.append(t.embed.register_forward_hook(keep(0)))
        for b in self.anchors[1:]:
            hooks.append(t.layers[b - 1].register_forward_hook(keep(b)))
        hooks.append(t.norm.register_forward_hook(keep("final")))
        return hooks

    @torch.no_grad()
    def __call__(self, sequences: list[list[int]]) -> list[dict]:
        if not sequences or any(len(s) == 0 for s in sequences):
            raise SPDError("the teacher needs at least one non-empty sequence")
        t = self.target
        width = max(len(s) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for r, s in enumerate(sequences):
            ids[r, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        hooks = self._hooks()
        try:
            self._states.clear()
            # the inner model: hidden states only, the LM head runs below in chunks
            t.hf.model(input_ids=ids.to(t.device), use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        states = torch.stack([self._states[b] for b in self.anchors])  # [m, B, W, d]
        final = self._states["final"]                                  # [B, W, d]
        self._states.clear()
        items = []
        for r, s in enumerate(sequences):
            n = len(s)
            f = final[r, :n]
            argmax = torch.cat([t.lm_head(f[a:a + ARGMAX_CHUNK]).argmax(-1)
                                for a in range(0, n, ARGMAX_CHUNK)])
            items.append({"tokens": torch.as_tensor(s, dtype=torch.int32),
                          "anchors": states[:, r, :n], "final": f,
                          "argmax": argmax.to(torch.int32)})
            if self.mask_of is not None:
                items[-1]["mask"] = torch.tensor(self.mask_of(s), dtype=torch.bool)
        return items


__all__ = ["Teacher"]
