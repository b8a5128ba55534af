"""Tree drafting in the distributed runtime (--tree-width W): the same tokens, N, K and judged
drafts as the single-process engine, greedy (random accept paths that take lower rows and leave
gaps) and sampled, in the n + 1 layout and with the draft on a stage; the CLI end to end."""
from __future__ import annotations

from functools import partial

import pytest
from conftest import make_tiny_target, noisy_tree_drafter

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest
from spd.distributed.launch import launch_local
from spd.distributed.protocol import TreeUnitFormat
from spd.distributed.rank import run_requests
from spd.errors import InternalError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def tiny_factory(seed: int, rank: int):
    return make_tiny_target(seed=seed, vocab=48, layers=4)


@pytest.mark.slow
@pytest.mark.parametrize("n,width,on_stage", [(2, 2, None), (3, 4, None), (4, 4, 1)])
def test_tree_same_as_one_process(n, width, on_stage):
    seed = 40 + n
    t = tiny_factory(seed, 0)
    eng = SPDEngine(t, n_stages=n, tree_width=width)
    ref = PROMPT + eng.generate_ar(PROMPT, 40).token_ids
    sp = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=5)
    noisy = partial(noisy_tree_drafter, ref, 0.5, n)
    cases = [
        (GenerateRequest(PROMPT, 40, drafter=noisy), {}),                        # greedy, gaps
        (GenerateRequest(PROMPT, 24, sp, drafter=noisy), {"sampling": sp}),       # sampled
        (GenerateRequest(PROMPT * 3, 24), {}),                                   # the PDM + lookup
    ]
    expected = [eng.generate(r.prompt_ids, r.max_new_tokens,
                             drafter=r.drafter(eng) if r.drafter else None, **kw)
                for r, kw in cases]
    config = DistConfig(n_stages=n, target_factory=partial(tiny_factory, seed),
                        fault_timeout=5.0, op_timeout=60.0, tree_width=width,
                        draft_on_stage=on_stage)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=150)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert (g.stats.N, g.stats.K, g.stats.drafts_judged, g.stats.drafts_accepted) == \
            (e.stats.N, e.stats.K, e.stats.drafts_judged, e.stats.drafts_accepted)
        assert g.stats.by_position == e.stats.by_position
        assert g.stats.tree_width == width and g.stats.distributed["verify_on"] == "rank 0"
    assert got[0].token_ids == ref[len(PROMPT):]
    for g in got[:2]:
        assert 0 < g.stats.drafts_accepted < g.stats.drafts_judged


@pytest.mark.slow
@pytest.mark.parametrize("n,width,on_stage", [(2, 4, None), (4, 3, 0)])
def test_default_model_tree_equals_one_process_and_ar(default_target, n, width, on_stage):
    """The default model and its shipped drafters, distributed against one process and AR
    (benchmarks/tree_grid.py's cell; the grid over n in {2, 3, 4, 8} and W in {2, 3, 4, 8} is
    that script's). Its PDM's trees keep lanes in any subset and read every stage's anchors, as
    the tiny drafters' did not: distributed trees once lost the target's tokens here."""
    from conftest import bench_module

    from spd.model.prompt import encode_prompt
    grid = bench_module("tree_grid")
    tok = default_target.tokenizer
    prompts = [encode_prompt(tok, "Write a Python function that checks whether a number is "
                             "prime.", True),
               encode_prompt(tok, "List three uses of a hash map.", True)]
    ar_engine = SPDEngine(default_target, n_stages=1)
    ar = [ar_engine.generate_ar(p, 32).token_ids for p in prompts]
    cell = grid.run_cell(default_target, n, width, prompts, ar, 32, on_stage)
    for row in cell["rows"]:
        assert row["dist_vs_one_first_difference"] is None, row
        assert row["stats_equal"], row
        assert row["dist_vs_ar_first_difference"] is None, row
        assert row["one_vs_ar_first_difference"] is None, row
    assert cell["ok"]


def test_tree_unit_format_packs_and_pads():
    import torch
    fmt = TreeUnitFormat.of(3, 2)
    assert (fmt.width, fmt.keys, fmt.commits) == (2, 6, 5)
    meta = fmt.pack(10, 8, [7], [40], [33, 40], [[True, True]], [(9, 35)], trash=99)
    assert len(meta) == fmt.ints
    f = fmt.fields(torch.tensor(meta))
    assert f["position"].tolist() == [10] and f["prefix_len"].tolist() == [8]
    assert f["tokens"].tolist() == [7, 0] and f["slots"].tolist() == [40, 99]
    assert f["keys"].tolist() == [33, 40, 99, 99, 99, 99]
    assert f["mask"].tolist() == [[True, True] + [False] * 4, [False] * 6]
    assert f["commit_pos"].tolist() == [9, 99, 99, 99, 99]
    assert f["commit_slot"].tolist() == [35, 99, 99, 99, 99]
    with pytest.raises(InternalError, match="over its format"):
        fmt.pack(10, 8, [1, 2, 3], [1, 2, 3], [], [[], [], []], [], trash=99)


def test_a_stage_reads_nothing_of_a_tree_unit_on_the_host(monkeypatch):
    """A stage rank's tree unit (commits, then the rows under the tree mask at a device
    position and prefix) reads no tensor on the host, the kernels' reference paths included
    (benchmarks/probe_host_reads.py's ReadLog). The kernels' value checks, which read CPU
    tensors only (on a GPU they would synchronise), are off as for device tensors."""
    import torch

    import spd_kernels.attention.tree as tree_op
    import spd_kernels.cache_positions as positions
    for module in (tree_op, positions):
        monkeypatch.setattr(module, "check_values_enabled", lambda *t: False)
    from conftest import bench_module

    from spd.distributed.protocol import UnitMessage
    from spd.distributed.stage_rank import StageWorker
    from spd.model.target import Stage
    read_log = bench_module("probe_host_reads").ReadLog
    t = tiny_factory(3, 0)
    fmt, cap = TreeUnitFormat.of(2, 3), 64
    stage = Stage(t, 1, range(2, 4), cap)
    stage.run(torch.randn(20, t.hidden_size), 0)             # a prefix of 20 positions
    msg = UnitMessage(fmt.row_bytes(t.hidden_size, t.dtype), "cpu", True)
    meta = fmt.pack(21, 20, [5, 6], [40, 41], [30, 40, 41], [[1, 1, 0], [1, 0, 1]],
                    [(20, 30)], trash=63)
    msg.write_tree(torch.tensor(meta), torch.randn(fmt.width, t.hidden_size))
    worker = StageWorker.__new__(StageWorker)
    worker.stage = stage
    log: list = []
    with read_log(log, where=True):
        got_meta, rows = msg.tree(fmt, t.hidden_size, t.dtype)
        outs = worker._forward_tree_unit(fmt, rows, got_meta)
    assert log == []
    assert len(outs) == 2 and outs[-1].shape == (fmt.width, t.hidden_size)
    assert torch.isfinite(outs[-1][:2]).all()
    assert torch.equal(stage.cache.k[:, :, 20], stage.cache.k[:, :, 30])  # the commit copy
