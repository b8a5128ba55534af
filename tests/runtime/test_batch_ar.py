"""Autoregressive decoding of several prompts at once (spd.runtime.batch_ar, generate_ar on a
list): continuous batching over slot caches. Each prompt's result equals its decode alone,
greedy and seeded sampling, with fewer slots than prompts (sequences join as others leave, in
a slot another sequence used), one ending at once, one at a stop id; on_token names the prompt;
bad input is refused with a message naming it."""
import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.errors import SPDError
from spd.runtime.batch_ar import BatchedAR
from spd.runtime.stopping import StopRule

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1], [8, 2, 8, 1, 8, 2]]


@pytest.fixture(scope="module")
def engine():
    return SPDEngine(make_tiny_target(seed=5, vocab=32, layers=4), n_stages=2,
                     warn_untrained=False)


@pytest.mark.parametrize("max_batch", [2, 5])
def test_each_prompt_equals_its_decode_alone(engine, max_batch):
    seen = {i: [] for i in range(len(PROMPTS))}
    results = engine.generate_ar(PROMPTS, 12, max_batch=max_batch,
                                 on_token=lambda i, tok: seen[i].append(tok))
    assert len(results) == len(PROMPTS)
    for i, (p, r) in enumerate(zip(PROMPTS, results)):
        alone = engine.generate_ar(p, 12)
        assert r.token_ids == alone.token_ids, i
        assert seen[i] == r.token_ids and r.finish_reason == alone.finish_reason
        assert r.stats.new_tokens == len(r.token_ids) and r.stats.mode == "ar"


def test_seeded_sampling_equals_each_alone(engine):
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    sampling[1] = SamplingParams()  # greedy beside sampled rows
    results = engine.generate_ar(PROMPTS, 10, sampling, max_batch=3)
    for p, s, r in zip(PROMPTS, sampling, results):
        assert r.token_ids == engine.generate_ar(p, 10, s).token_ids


def test_stops_free_their_slots_for_the_next_prompt(engine):
    first = engine.generate_ar(PROMPTS[2], 12).token_ids
    stop_at = first[3]
    results = engine.generate_ar(PROMPTS, 12, max_batch=2, stop_token_ids=[stop_at])
    for p, r in zip(PROMPTS, results):
        alone = engine.generate_ar(p, 12, stop_token_ids=[stop_at])
        assert r.token_ids == alone.token_ids and r.finish_reason == alone.finish_reason
    assert results[2].finish_reason == "stop" and len(results[2].token_ids) <= 4
    ones = engine.generate_ar(PROMPTS, 1, max_batch=2)  # every sequence ends at its join
    assert [r.token_ids for r in ones] == [engine.generate_ar(p, 1).token_ids for p in PROMPTS]


def test_the_default_model_batched_equals_alone(default_target):
    eng = SPDEngine(default_target, n_stages=2, warn_untrained=False)
    chats = [[{"role": "user", "content": q}] for q in
             ("What is a prime number?", "Name a river in Africa.", "Why is the sky dark at night?")]
    results = eng.generate_ar(chats, 10)
    for chat, r in zip(chats, results):
        assert r.token_ids == eng.generate_ar(chat, 10).token_ids


def test_bad_input_is_named(engine):
    with pytest.raises(SPDError, match="max_batch must be a positive integer"):
        engine.generate_ar(PROMPTS, 4, max_batch=0)
    with pytest.raises(SPDError, match="one SamplingParams for all prompts or one each"):
        engine.generate_ar(PROMPTS, 4, [SamplingParams()] * 2)
    with pytest.raises(SPDError, match="max_batch applies to several prompts"):
        engine.generate_ar(PROMPTS[0], 4, max_batch=2)
    with pytest.raises(SPDError, match="SPD decodes one sequence at a time"):
        engine.generate(PROMPTS, 4)
    batch = BatchedAR(engine.target, 2, 8)
    with pytest.raises(SPDError, match=r"the prompt \(8 tokens\) and max_new_tokens \(4\) need "
                                       r"11 rows of context but a slot holds 8"):
        batch.join(torch.tensor(PROMPTS[2]), 4, SamplingParams(), StopRule(set()))
    with pytest.raises(SPDError, match="slots must be a positive integer"):
        BatchedAR(engine.target, 0, 8)
