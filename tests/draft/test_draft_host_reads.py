"""The PDM's draft token stays on the device: choosing it (greedy or sampled) and mapping it to a
target id reads nothing back to the host, so entering it into the pipeline never waits on the
device. (Indexing with a 0-d tensor, `d2t[logits.argmax()]`, is an `item()` inside torch.)"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import bench_module

from spd.draft.drafters import PDMDrafter
from spd.runtime.types import SamplingParams

probe = bench_module("probe_host_reads")
VOCAB_DRAFT, VOCAB = 50, 80


def _drafter(seed: int) -> tuple[PDMDrafter, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d2t = torch.randperm(VOCAB, generator=g)[:VOCAB_DRAFT]  # draft id -> target id
    pdm = SimpleNamespace(config=SimpleNamespace(features="pre-step"), draft_to_target=d2t)
    drafter = PDMDrafter(pdm, cuda_graphs=False, lookup=2)  # lookup: also its confidence
    drafter.vocab_size = VOCAB
    logits = torch.randn(VOCAB_DRAFT, generator=g)
    drafter.draft_logits = lambda anchors, types, start, last: logits  # (the step: not tested)
    return drafter, d2t, logits


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, top_k=20,
                                                                       top_p=0.9)])
def test_a_draft_reads_nothing_back_to_the_host(sampling):
    drafter, d2t, logits = _drafter(seed=7)
    log: list = []
    with probe.ReadLog(log, where=True):
        draft = drafter.draft(None, None, torch.tensor([0]), torch.tensor(5), sampling,
                              torch.tensor(0.3))
    # reads inside spd_kernels are its CPU-only value checks (spd_kernels.checks): not on a GPU
    ours = [e for e in log if e[0] == "read" and "spd_kernels" not in e[2]]
    assert ours == [], ours
    assert isinstance(draft.token, torch.Tensor) and draft.token.dim() == 0
    if sampling.greedy:
        assert int(draft.token) == int(d2t[int(logits.argmax())])
    else:  # q stays on the draft vocabulary, its columns named by the map
        assert draft.q.shape == (VOCAB_DRAFT,) and draft.q_ids is d2t
        column = d2t.tolist().index(int(draft.token))
        assert draft.q[column] > 0
