"""The one decode cycle (spd.runtime.cycle) against the plain reference decoder, wherever the
stages run (conftest.PLACES: one process, n + 1 ranks, the draft on a stage).

Every decode must give the reference decoder's tokens, N, K, judged and accepted drafts by
draft position, stage rows and lookup counts (tests/reference_decoder.py: README's steps with
host branches), greedy equal to AR; chains and token trees, pre- and post-step drafting, the
context lookup, a prompt shorter than n, budgets and stop ids, dense and hybrid targets.
Drafters: the untrained PDM (rejections), and drafters that propose the target's own token at
random (conftest.NoisyPDMDrafter, NoisyTreeDrafter: accepts, rejections and, in a tree,
branches that end early), the tree's depending on every feature it reads. The ranks run under
SPD_REPLAY_CHECK: every steady cycle of every rank is the work one CUDA graph replays.
"""
from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from conftest import (
    PLACES,
    NoisyPDMDrafter,
    decode_in,
    engine_for,
    make_tiny_hybrid,
    noisy_tree_drafter,
    request_drafter,
    tiny_factory,
)
from reference_decoder import ReferenceDecoder

from spd import SamplingParams
from spd.distributed.config import GenerateRequest
from spd.draft.drafters import PDMDrafter

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.9, top_k=20, seed=3)


def noisy_chain(reference, accuracy, seed, engine):
    return NoisyPDMDrafter(engine.pdm, reference, accuracy, seed)


def post_step(engine):
    """The engine's PDM, drafting after the stages (features one stage deeper)."""
    drafter = PDMDrafter(engine.pdm, lookup=engine.drafter.lookup)
    drafter.post_step = True
    return drafter


def counts(tokens, s) -> tuple:
    return (tokens, s.N, s.K, s.drafts_judged, s.drafts_accepted, s.stage_rows,
            dict(s.by_position), s.lookup_judged, s.lookup_accepted)


def check_against_reference(results, requests, oracle_engine) -> None:
    """Each result equals the reference decoder's decode of its request (module docstring)."""
    ref = ReferenceDecoder(oracle_engine)
    for got, req in zip(results, requests):
        want = ref.generate(req.prompt_ids, req.max_new_tokens, req.sampling,
                            drafter=request_drafter(req, oracle_engine),
                            stop_token_ids=req.stop_token_ids)
        assert counts(got.token_ids, got.stats) == counts(*want), req


def requests_for(engine, width: int, seed: int) -> list[GenerateRequest]:
    """Greedy and seeded sampling; a noisy drafter, the untrained PDM with the context lookup
    on a prompt that repeats, post-step drafting, a prompt of one token, a budget of one token
    and a stop id."""
    ar = engine.generate_ar(PROMPT * 2, 30).token_ids
    ref = PROMPT * 2 + ar
    noisy = (partial(noisy_tree_drafter, ref, 0.6, seed, mix=1.0) if width > 1
             else partial(noisy_chain, ref, 0.6, seed))
    short_ref = PROMPT[:1] + engine.generate_ar(PROMPT[:1], 30).token_ids
    short = (partial(noisy_tree_drafter, short_ref, 0.7, seed) if width > 1
             else partial(noisy_chain, short_ref, 0.7, seed))
    return [GenerateRequest(PROMPT * 2, 24, GREEDY, drafter=noisy),
            GenerateRequest(PROMPT * 2, 24, SAMPLED, drafter=noisy),
            GenerateRequest(PROMPT * 3, 24, GREEDY),
            GenerateRequest(PROMPT * 3, 24, SAMPLED),
            GenerateRequest(PROMPT * 2, 16, GREEDY, drafter=post_step),
            GenerateRequest(PROMPT * 2, 16, SAMPLED, drafter=post_step),
            GenerateRequest(PROMPT[:1], 20, GREEDY, drafter=short),
            GenerateRequest(PROMPT[:1], 20, SAMPLED),
            GenerateRequest(PROMPT * 2, 1, GREEDY),
            GenerateRequest(PROMPT * 2, 24, GREEDY, drafter=noisy, stop_token_ids=[ar[6]])]


CONFIGS = [(2, 1), (4, 1), (3, 3)]


@pytest.mark.parametrize("place", PLACES + ("checked",))
@pytest.mark.parametrize("n,width", CONFIGS, ids=[f"n{n}-W{w}" for n, w in CONFIGS])
def test_cycle_equals_the_reference_decoder(place, n, width, monkeypatch):
    """"checked": one process under SPD_REPLAY_CHECK (no step skipped: the GPU's work);
    "process": one process as a CPU runs it (dead units' stage steps skipped)."""
    if place != "process":
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")  # (the ranks take it too)
    seed = 20 + n + width
    factory = partial(tiny_factory, seed, layers=max(4, n))
    eng = engine_for(factory, n, width, lookup=2)
    requests = requests_for(eng, width, seed)
    got = decode_in("process" if place == "checked" else place, factory, n, requests,
                    width=width, lookup=2)
    check_against_reference(got, requests, eng)
    ar = eng.generate_ar(PROMPT * 2, 30).token_ids
    assert got[0].token_ids == ar[:24] and got[9].token_ids == ar[:7]
    assert got[9].finish_reason == "stop" and len(got[8].token_ids) == 1
    for g, r in zip(got, requests):
        if r.sampling.greedy:
            assert g.token_ids == eng.generate_ar(r.prompt_ids, r.max_new_tokens).token_ids[
                :len(g.token_ids)]
    noisy = got[0].stats
    assert 0 < noisy.drafts_accepted < noisy.drafts_judged  # accepts and rejections
    assert got[2].stats.lookup_judged > 0
    assert got[1].token_ids != got[0].token_ids  # sampling sampled
    if place in ("ranks", "stage"):  # every rank ran rank 0's cycles, each steady one checked
        d = got[0].stats.distributed
        eager = "its messages cannot be captured"  # (gloo)
        assert d["graph"]["checked"] > 0 and d["graph"]["eager"] == eager
        assert all(r["graph"]["checked"] > 0 for r in d["ranks"][1:])
        assert d["processes"] == (n if place == "stage" else n + 1)


@pytest.mark.parametrize("place", ["process", "ranks"])
def test_one_token_prompt_with_eight_stages(place, monkeypatch):
    """n = 8 from a one-token prompt: the drafter's window starts at position 0 until the
    newest position passes 8 (its later rows are never read)."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    factory = partial(tiny_factory, 80, layers=8)
    eng = engine_for(factory, 8, lookup=2)
    ref = PROMPT[:1] + eng.generate_ar(PROMPT[:1], 30).token_ids
    requests = [GenerateRequest(PROMPT[:1], 24, GREEDY,
                                drafter=partial(noisy_chain, ref, 0.8, 1)),
                GenerateRequest(PROMPT[:1], 24, SAMPLED)]
    got = decode_in(place, factory, 8, requests, lookup=2)
    check_against_reference(got, requests, eng)
    assert got[0].token_ids == ref[1:25] and got[0].stats.drafts_accepted > 5


def hybrid_factory(model_type: str, rank: int):
    return make_tiny_hybrid(seed=3, model_type=model_type)


@pytest.mark.parametrize("place,model_type", [("process", "qwen3_5"), ("ranks", "qwen3_5"),
                                              ("stage", "qwen3_next"), ("ranks", "qwen3_next")])
def test_hybrid_targets(place, model_type, monkeypatch):
    """Qwen3.5 / Qwen3-Next (linear-attention layers: a ring of recurrent states per stage,
    rolled back by the position alone): greedy equals AR, and the reference decoder's counts,
    greedy and sampled."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    factory, n = partial(hybrid_factory, model_type), 3
    eng = engine_for(factory, n, lookup=2)
    ref = PROMPT * 2 + eng.generate_ar(PROMPT * 2, 30).token_ids
    requests = [GenerateRequest(PROMPT * 2, 24, GREEDY, drafter=partial(noisy_chain, ref, 0.6, 2)),
                GenerateRequest(PROMPT * 2, 24, SAMPLED, drafter=partial(noisy_chain, ref, 0.6, 2)),
                GenerateRequest(PROMPT * 3, 20, GREEDY)]
    got = decode_in(place, factory, n, requests, lookup=2)
    check_against_reference(got, requests, eng)
    assert got[0].token_ids == ref[16:40]
    assert 0 < got[0].stats.drafts_accepted < got[0].stats.drafts_judged


def _random_requests(eng, width: int, rng: random.Random, count: int) -> list[GenerateRequest]:
    out = []
    vocab = eng.target.vocab_size
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.choice([1, 2, 5, 9, 14]))]
        if rng.random() < 0.3:
            prompt = prompt * 3  # the text repeats: the lookup proposes
        ref = prompt + eng.generate_ar(prompt, 40).token_ids
        sampling = (GREEDY if rng.random() < 0.5 else
                    SamplingParams(temperature=rng.choice([0.7, 1.0]),
                                   top_k=rng.choice([0, 10]), top_p=rng.choice([1.0, 0.9]),
                                   seed=rng.randrange(1 << 30)))
        accuracy = rng.choice([0.3, 0.6, 0.9])
        drafter = (partial(noisy_tree_drafter, ref, accuracy, i, mix=rng.choice([0.0, 1.0]))
                   if width > 1 else
                   rng.choice([partial(noisy_chain, ref, accuracy, i), None, post_step]))
        out.append(GenerateRequest(prompt, rng.randrange(1, 30), sampling, drafter=drafter))
    return out


@pytest.mark.parametrize("place,n,width", [("process", 4, 4), ("ranks", 3, 2),
                                           ("stage", 4, 1)])
def test_random_decodes_equal_the_reference_decoder(place, n, width):
    """Random prompts (repeating ones too), budgets, samplings and drafters, on random tiny
    targets: every decode equals the reference decoder's (a differential test)."""
    rng = random.Random(n * 10 + width)
    seed = rng.randrange(1000)
    factory = partial(tiny_factory, seed, vocab=rng.choice([16, 48]), layers=max(4, n))
    eng = engine_for(factory, n, width, lookup=2)
    requests = _random_requests(eng, width, rng, 12)
    got = decode_in(place, factory, n, requests, width=width, lookup=2)
    check_against_reference(got, requests, eng)
    assert sum(g.stats.drafts_accepted for g in got) > 0


@pytest.mark.parametrize("ahead", [0, 1, 8])
def test_cycles_launched_ahead_change_nothing(ahead):
    """However far the host runs ahead of the cycles it reads, the same tokens and counts:
    cycles past the end change nothing."""
    factory = partial(tiny_factory, 7)
    eng = engine_for(factory, 3, ahead=ahead)
    ref = PROMPT + eng.generate_ar(PROMPT, 30).token_ids
    requests = [GenerateRequest(PROMPT, m, GREEDY, drafter=partial(noisy_chain, ref, 0.6, 2))
                for m in (1, 2, 5, 30)]
    check_against_reference(decode_in("process", factory, 3, requests, ahead=ahead), requests,
                            eng)


def test_a_stop_only_the_host_sees_emits_nothing_past_it(monkeypatch):
    """A stop string is the host's alone (the device ends at EOS, stop ids and the budget):
    the device runs cycles past it, none of whose tokens reach on_token or the result."""
    from spd.runtime.stopping import StopRule
    eng = engine_for(partial(tiny_factory, 9), 4)
    real_feed = StopRule.feed

    def feed(rule, token):  # a stop "string" that ends at the 7th new token
        real_feed(rule, token)
        rule.ended = rule.ended or len(rule.ids) >= 7
        return rule.ended
    monkeypatch.setattr(StopRule, "feed", feed)
    seen: list[int] = []
    res = eng.generate(PROMPT, 30, on_token=seen.append)
    assert seen == res.token_ids == eng.generate_ar(PROMPT, 7).token_ids
    assert res.finish_reason == "stop"


def _cancelled_then_whole(engine, after: int):
    """A decode cancelled from the host once `after` tokens are out (the server's disconnect:
    the host ends it, the ranks run on to the end cycle), then a whole one: still in step."""
    import threading
    cancel = threading.Event()

    def seen(_tok, count=[0]):  # noqa: B006 - a counter across calls
        count[0] += 1
        if count[0] == after:
            cancel.set()
    first = engine.generate(PROMPT, 30, on_token=seen, cancel=cancel)
    return first, engine.generate(PROMPT, 30)


def test_a_cancel_keeps_the_ranks_in_step():
    """The host ends a decode across ranks (a cancel, as a stop string would): nothing past the
    token after the cancel, and the next request on the same ranks is whole and exact."""
    from spd.distributed.config import DistConfig
    from spd.distributed.launch import launch_local
    factory = partial(tiny_factory, 33)
    config = DistConfig(n_stages=3, target_factory=factory, lookup=0, ahead=3,
                        fault_timeout=5.0, op_timeout=60.0)
    cancelled, whole = launch_local(config, partial(_cancelled_then_whole, after=5),
                                    timeout=150)
    e = engine_for(factory, 3).generate(PROMPT, 30)
    assert cancelled.token_ids == e.token_ids[:6]
    assert cancelled.stats.distributed["cycles_run"] < e.stats.K
    assert counts(whole.token_ids, whole.stats) == counts(e.token_ids, e.stats)


def test_trees_on_hybrid_targets_are_refused():
    from spd import SPDEngine
    from spd.errors import SPDError
    with pytest.raises(SPDError, match="not supported on hybrid targets"):
        SPDEngine(make_tiny_hybrid(), n_stages=2, tree_width=2)


def test_stage_caches_hold_the_committed_tokens():
    """After a decode with rejections, every stage's KV rows of the committed positions are a
    fresh prefill's of the same tokens (rollbacks are only lower positions: nothing a dropped
    row wrote is left where a committed one is read)."""
    from spd.model.target import Stage
    factory = partial(tiny_factory, 5)
    eng = engine_for(factory, 3)
    ref = PROMPT + eng.generate_ar(PROMPT, 30).token_ids
    res = eng.generate(PROMPT, 24, drafter=NoisyPDMDrafter(eng.pdm, ref, 0.5, 3))
    assert 0 < res.stats.drafts_accepted < res.stats.drafts_judged
    ids = torch.tensor(PROMPT + res.token_ids)
    done = len(ids) - 1  # the last token's row may still be in flight
    h = eng.target.embed_tokens(ids[:done])
    for st in eng._stages:
        fresh = Stage(eng.target, st.index, st.layer_ids, done + 1)
        outs, _ = fresh.run(h, 0)
        h = outs[-1]
        for mine, want in ((st.cache.k, fresh.cache.k), (st.cache.v, fresh.cache.v)):
            torch.testing.assert_close(mine[:, :, :done], want[:, :, :done], rtol=1e-4,
                                       atol=1e-5)
