"""The pipeline without speculation, batched over requests (spd.runtime.batch_pipeline;
`generate_pipeline`): sequences that join at different cycles hold different stages in one
cycle, one token each every n cycles, and each gets AR's tokens (greedy, one ending at its
budget, one at a stop id, one leaving mid-trip, their slots taken by the next ones); seeded sampling
equals the request alone, on this path and on AR's; an error in a callback frees every slot."""
import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.errors import SPDError
from spd.runtime.batch_pipeline import BatchedPipeline

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1], [8, 2, 8, 1, 8, 2]]
NEW = 12


@pytest.fixture(scope="module")
def engine():  # 4 layers in 3 stages: uneven ones
    return SPDEngine(make_tiny_target(seed=5, vocab=32, layers=4), n_stages=3,
                     warn_untrained=False)


@pytest.fixture(scope="module")
def ar(engine):
    """Each prompt's AR tokens alone."""
    return [engine.generate_ar(p, NEW).token_ids for p in PROMPTS]


@pytest.mark.parametrize("chunk", [None, 2], ids=["prefill", "chunked"])
def test_joins_at_different_cycles_keep_stages_busy_and_each_gets_ar_tokens(engine, ar, chunk):
    n = engine.n
    batch = BatchedPipeline(engine, 3, 32, prefill_chunk=chunk)
    # prompt 1 ends at a budget of 3; prompt 3 at a stop id (a token new at its 5th or later)
    j = next(j for j in range(4, NEW) if ar[3][j] not in ar[3][:j])
    budget, stops = {1: 3}, {3: {ar[3][j]}}
    joined, waiting, cycles, mixed = {}, list(range(len(PROMPTS))), 0, 0
    seen = {i: [] for i in range(len(PROMPTS))}

    def join(i):
        ids, max_new, rule = engine.prepare_request(PROMPTS[i], budget.get(i, NEW), None,
                                                    stops.get(i))
        joined[i] = batch.join(ids, max_new, SamplingParams(), rule, seen[i].append)

    while waiting or batch.running:
        if waiting and batch.free and cycles % 2 == 0:  # a join every other cycle at most
            join(waiting.pop(0))
        depths = {e.depth for e in batch.running.values()}
        mixed += len(depths) > 1
        if cycles >= 7 and joined[0].depth > 0 and not joined[0].done:
            batch.leave(joined[0])  # prompt 0 leaves mid-trip (its client left)
        batch.step()
        cycles += 1
    assert mixed > 5  # the stages ran different requests in one cycle
    assert joined[0].out == ar[0][:len(joined[0].out)] and 0 < len(joined[0].out) < NEW
    assert joined[1].out == ar[1][:3]
    assert joined[2].out == ar[2]
    assert joined[3].out == ar[3][:j + 1] and joined[3].rule.finish_reason == "stop"
    assert joined[4].out == ar[4]  # (3 and 4 in the slots the others freed)
    assert {joined[3].slot, joined[4].slot} == {joined[0].slot, joined[1].slot}
    for i, e in joined.items():
        st = e.stats
        assert seen[i] == e.out and st.mode == "pp" and st.n == n == 3
        assert st.new_tokens == len(e.out) and st.N == len(e.out) - 1
        if i:  # ended at a token: n cycles a token
            assert st.K == n * st.N
    assert not batch.running and len(batch.free) == 3


def test_generate_pipeline_equals_ar_and_seeded_sampling_equals_alone(engine, ar):
    results = engine.generate_pipeline(PROMPTS, NEW, max_batch=2)
    assert [r.token_ids for r in results] == ar
    assert all(r.stats.mode == "pp" and r.finish_reason == "length" for r in results)
    sampling = [SamplingParams(temperature=1.0, top_k=8, seed=3), SamplingParams(),
                SamplingParams(temperature=0.8, top_p=0.9, seed=4)]
    got = [r.token_ids for r in engine.generate_pipeline(PROMPTS[:3], 8, sampling)]
    assert got[1] == ar[1][:8]
    for i in (0, 2):
        assert got[i] == engine.generate_pipeline(PROMPTS[i], 8, sampling[i]).token_ids
        assert got[i] == engine.generate_ar(PROMPTS[i], 8, sampling[i]).token_ids  # same draws


def test_one_prompt_and_an_error_in_a_callback(engine, ar):
    seen = []
    r = engine.generate_pipeline(PROMPTS[3], 5, on_token=seen.append)
    assert r.token_ids == seen == ar[3][:5]
    with pytest.raises(SPDError, match="max_batch applies to several prompts"):
        engine.generate_pipeline(PROMPTS[0], 4, max_batch=2)

    def fail(i, tok):
        if i == 1:
            raise RuntimeError("the client's callback failed")
    with pytest.raises(RuntimeError, match="callback failed"):
        engine.generate_pipeline(PROMPTS[:3], 4, on_token=fail)
    batch = engine._batches["pipeline"]
    assert not batch.running and len(batch.free) == batch.slots  # every slot freed
    assert engine.generate_pipeline(PROMPTS[:2], 4)[1].token_ids == ar[1][:4]
    need = len(PROMPTS[2]) + 4 - 1
    with pytest.raises(SPDError, match=rf"need {need} rows of context but a slot holds 8"):
        BatchedPipeline(engine, 1, 8).join(torch.tensor(PROMPTS[2]), 4, SamplingParams(),
                                           engine.prepare_request(PROMPTS[2], 4, None, None)[2])


def test_a_burst_spreads_over_the_stages(engine, ar):
    """Three requests joining in one cycle take the three phases: from their first trips on,
    every cycle runs each stage over one of them, and each still gets AR's tokens."""
    batch = BatchedPipeline(engine, 3, 32)
    joined = []
    for p in PROMPTS[:3]:
        ids, max_new, rule = engine.prepare_request(p, NEW, None, None)
        joined.append(batch.join(ids, max_new, SamplingParams(), rule))
    assert sorted(e.phase for e in joined) == [0, 1, 2]
    full = 0
    while batch.running:
        batch.step()
        full += sorted(e.depth for e in joined if not e.done) == [0, 1, 2]
    assert full >= NEW * engine.n - 2 * engine.n
    assert [e.out for e in joined] == ar[:3]
