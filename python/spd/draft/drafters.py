"""Drafters: what proposes the token that enters stage 1 each cycle.

`PDMDrafter` is the real one. `ReferenceDrafter` knows the target's own continuation in advance
and proposes it (right with a set probability): it exists to check the engine's accounting and
losslessness independently of draft quality (benchmarks and tests), never for real decoding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spd.device import to_device
from spd.draft.graphs import PDMStepGraphs, graphs_enabled
from spd.draft.lookup import MAX_LEN
from spd.errors import SPDError
from spd_kernels import filtered_probs, sample_from_probs


@dataclass
class Draft:
    """A proposed token: an int, or a 0-d int64 tensor on the model's device (the PDM's drafts
    stay there, so entering the draft into the pipeline needs no host synchronisation; `int()`
    it where the host needs the id)."""
    token: int | torch.Tensor
    # the draft distribution (sampling only) [Vq] fp32, over the columns `q_ids` names: the
    # PDM's own draft vocabulary (never scattered to the target's; the verifier maps it)
    q: torch.Tensor | None = None
    # the drafter's top probability (0-d, on its device), where the context lookup's gate needs it
    p: torch.Tensor | None = None
    # [Vq] int64: the target id of each column of q; None when q is over every target id
    q_ids: torch.Tensor | None = None


def target_id(d2t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """d2t [Vd] at a 0-d draft id -> the 0-d target id, on the device. Not `d2t[idx]`: torch
    indexes with a 0-d tensor through item(), a host synchronisation every cycle."""
    return d2t.index_select(0, idx.reshape(1)).reshape(())


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """A drafter's confidence: the top probability of softmax(logits) at temperature 1, on the
    logits' device (1 / sum(exp(logits - max)): no host sync); logits [..., V] -> [...] (a
    row: 0-d)."""
    lf = logits.float()
    return torch.exp(lf - lf.amax(-1, keepdim=True)).sum(-1).reciprocal()


class PDMDrafter:
    """The PDM's guess each cycle. `lookup` (>= 1: the shortest match) lets the decode loop put
    the context lookup's token in its place when the text repeats itself (spd.draft.lookup); 0: off."""
    name = "pdm"

    def __init__(self, pdm, cuda_graphs: bool = True, lookup: int = 0, cache=None):
        """cache: the KVCache to draft in (a batch's slot: PDM.slot_caches), where it has room
        (else one of its own is made at `begin`)."""
        if not 0 <= lookup <= MAX_LEN:
            raise SPDError(f"lookup is a match length in [0, {MAX_LEN}] (0: off), got {lookup}")
        self.pdm = pdm
        self.lookup = lookup
        self.cache = cache
        self.post_step = pdm.config.features == "post-step"
        self.cuda_graphs = cuda_graphs
        self.graphs = None  # spd.draft.graphs.PDMStepGraphs on a GPU: the draft step as replays
        self._columns: tuple[object, dict[int, int]] = (None, {})  # (map's identity, columns)

    def begin(self, capacity: int, vocab_size: int) -> None:
        if self.cache is None or self.cache.capacity < capacity:
            self.cache = self.pdm.new_cache(capacity)
            self.graphs = None
            if self.cuda_graphs and graphs_enabled(self.cache.k.device):
                self.graphs = PDMStepGraphs(self.pdm, self.cache)
        if self.graphs is not None:
            self.graphs.check_weights()
        self.cache.truncate(0)
        self.vocab_size = vocab_size
        d2t = self.pdm.draft_to_target
        key = (d2t.data_ptr(), d2t._version)
        if self._columns[0] != key:  # read once per map, before any decode cycle
            self._columns = (key, {t: c for c, t in enumerate(d2t.tolist())})

    def draft_column(self, token: int) -> int | None:
        """The column of target id `token` in the draft vocabulary (None: outside it): where a
        one-hot proposal of the context lookup goes in q."""
        return self._columns[1].get(token)

    def prefill(self, anchors, types) -> None:
        # eager: the prompt's length differs every time
        self.pdm.step(self.pdm.features(anchors, types), 0, self.cache)

    def draft_logits(self, anchors, types, start, last=None) -> torch.Tensor:
        """Draft logits [Vd] of row `last` ([1] int64; None: the last) of the rows at positions
        start.. ([1] int64 on the device: never read on the host; graph replay on a GPU). Rows
        from `start` on are recomputed: the step writes them."""
        if self.graphs is not None:
            return self.graphs.run(anchors, types, start, last)
        return self.pdm.step(self.pdm.features(anchors, types), start, self.cache, last)

    def tree_logits(self, anchors, types, positions, slots, prefix_len, tree_mask,
                    leaves) -> torch.Tensor:
        """Draft logits [len(leaves), Vd] of a token tree's rows (spd.runtime.drafting):
        anchors [m, R, d] and types [R] of the rows at positions [R] (int64), written to this
        drafter's cache slots `slots` [R]; each row attends to the cache's rows
        [0, prefix_len) (prefix_len [1] int64) and to its ancestors and itself among the rows
        (tree_mask [R, R] bool). All on the device. Eager (no graphs yet)."""
        return self.pdm.tree_step(self.pdm.features(anchors, types), positions, slots,
                                  prefix_len, tree_mask, leaves, self.cache)

    def tree_top_k(self, k: int) -> int:
        """The children a leaf `tree_top` gives for k asked: k, or the draft vocabulary where
        smaller."""
        return min(k, self.pdm.draft_to_target.shape[0])

    def tree_top(self, anchors, types, positions, slots, prefix_len, tree_mask, leaves,
                 sampling, out) -> None:
        """A token tree's draft step (`tree_logits`' arguments): each leaf's k most probable
        children into out = (log-probabilities [W, k] float32, descending; their draft
        columns and target ids [W, k] int64; each leaf's top probability [W] float32), k =
        tree_top_k(...) (a control slot's rows: spd.runtime.control.TreeControl). The
        probabilities are the sampling's (filtered_probs; greedy: the softmax)."""
        top, cols, ids, pmax = out
        logits = self.tree_logits(anchors, types, positions, slots, prefix_len, tree_mask,
                                  leaves)
        if sampling.greedy:
            logp = torch.log_softmax(logits.float(), dim=-1)
        else:
            logp = filtered_probs(logits, sampling.temperature, sampling.top_k,
                                  sampling.top_p).log()
        torch.topk(logp, top.shape[1], dim=-1, out=(top, cols))
        torch.index_select(self.pdm.draft_to_target, 0, cols.view(-1), out=ids.view(-1))
        torch.exp(top[:, 0], out=pmax)

    def draft(self, anchors, types, start, position, sampling, uniform, last=None) -> Draft:
        """The guess for `position` (0-d int64) from rows anchors [m, R, d] with types [R] at
        positions start.. ([1] int64), read at row `last` ([1] int64; None: the last row);
        uniform: a 0-d tensor (sampling's draw). Nothing is read on the host."""
        return self.pick(self.draft_logits(anchors, types, start, last), sampling, uniform)

    def pick(self, logits: torch.Tensor, sampling, uniform) -> Draft:
        """The guess from the draft logits [Vd]: greedy, their argmax; sampled, a draw from the
        filtered distribution with `uniform` (0-d) by inverse CDF. Its target id, and the PDM's
        confidence where the lookup's gate needs it."""
        d2t = self.pdm.draft_to_target
        # the PDM's confidence for the context lookup's gate (at temperature 1 whatever the
        # sampling: the gate's hit rates were measured that way)
        p = top_probability(logits) if self.lookup else None
        if sampling.greedy:
            return Draft(target_id(d2t, logits.argmax()), p=p)
        q = filtered_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        idx = sample_from_probs(q, to_device(uniform, q.device))
        return Draft(target_id(d2t, idx), q.float(), p, q_ids=d2t)


def slot_drafters(pdm, slots: int, capacity: int, lookup: int = 0):
    """A batch's drafters, one a slot, each drafting in its rows of one pair of slot caches
    (PipelineDraftModule.slot_caches: what a batched draft step, `batch_step`, writes) ->
    (the drafters, (k, v)). No graphs of their own: the batch's cycle is the graph."""
    k, v, caches = pdm.slot_caches(slots, capacity)
    return ([PDMDrafter(pdm, cuda_graphs=False, lookup=lookup, cache=c) for c in caches],
            (k, v))


class ReferenceDrafter:
    """Proposes reference[position] with probability `accuracy`, else a different token."""
    name = "reference"

    def __init__(self, reference: list[int], accuracy: float = 1.0, seed: int = 0):
        self.reference = list(reference)
        self.accuracy = accuracy
        self.rng = torch.Generator().manual_seed(seed)

    def begin(self, capacity: int, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._table = None  # the reference as a device table (made once, before any cycle)
        self._capacity = capacity

    def prefill(self, anchors, types) -> None:
        self._tables(anchors.device)  # before the first cycle (a cycle copies nothing)

    def _tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the reference [capacity] int64, 0 past its end; arange(vocab)) on `device`."""
        if self._table is None or self._table[0].device != device:
            ref = self.reference[:self._capacity]
            ref = ref + [0] * (self._capacity - len(ref))
            self._table = (torch.tensor(ref, dtype=torch.int64, device=device),
                           torch.arange(self.vocab_size, device=device))
        return self._table

    def draft(self, anchors, types, start, position, sampling, uniform, last=None) -> Draft:
        """reference[position] (0-d int64 on the device: no host read), or with probability
        1 - accuracy the next id; under sampling q is one-hot on it."""
        table, ids = self._tables(anchors.device)
        right = table.index_select(0, position.reshape(1)).reshape(())
        token = right
        if self.accuracy < 1.0:
            hit = torch.rand((), generator=self.rng).to(anchors.device) < self.accuracy
            token = torch.where(hit, right, (right + 1) % self.vocab_size)
        q = None if sampling.greedy else (ids == token).to(torch.float32)
        return Draft(token, q)
