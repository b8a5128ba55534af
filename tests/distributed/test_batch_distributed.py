"""Several sequences through the distributed pipeline at once (spd.distributed.batch_stage,
batch_draft): local ranks on gloo, tiny targets, n = 2 and 4, chains and a token tree.

Each sequence's result equals its decode alone (tokens, N, K, judged and accepted drafts;
greedy equal to AR and to the one-process batch, seeded sampling equal to alone), with fewer
slots than prompts (sequences join at later cycles, in a slot another sequence used), one
ending at a stop id, every one at its first token, a client leaving mid-decode, and a
single-sequence request on the same ranks after the sessions. With n = 4 every rank runs under
SPD_REPLAY_CHECK: each steady cycle is the work one CUDA graph would replay.
"""
from __future__ import annotations

from functools import partial

import pytest
import torch
from conftest import tiny_factory

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig
from spd.distributed.draft_rank import session_kind
from spd.distributed.launch import launch_local

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1], [8, 2, 8, 1, 8, 2]]
SAMPLED = [SamplingParams(temperature=1.0, top_k=8, seed=s) for s in range(len(PROMPTS))]
SAMPLED[1] = SamplingParams()  # a greedy sequence beside sampled ones


@pytest.fixture(autouse=True)
def one_thread():
    """The one-process references on one thread, as the ranks run (threads=1): on a loaded
    machine of few cores torch's threads wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def figures(r) -> tuple:
    s = r.stats
    return (r.token_ids, r.finish_reason, s.K, s.N, s.drafts_judged, s.drafts_accepted)


def _config(factory, n: int, **kw) -> DistConfig:
    return DistConfig(n_stages=n, target_factory=factory, lookup=2, fault_timeout=10.0,
                      op_timeout=60.0, threads=1, **kw)


def _engine(factory, n: int, width: int = 1) -> SPDEngine:
    return SPDEngine(factory(0), n_stages=n, tree_width=width, lookup=2, warn_untrained=False)


def _interface(engine, max_new: int, mode: str = "spd") -> dict:
    """join / step / leave on 2 slots: A joins at once, B some cycles later, C waits for a
    slot and takes B's when B's client leaves mid-decode."""
    eng = engine.engine
    reqs = [eng.prepare_request(p, max_new, None, None) for p in PROMPTS[:3]]
    context = max(session_kind(mode).rows_for(eng, ids.numel(), m) for ids, m, _ in reqs)
    batch = engine.batch(2, context, mode=mode)
    join = lambda i: batch.join(reqs[i][0], reqs[i][1], SamplingParams(), reqs[i][2])  # noqa
    a = join(0)
    for _ in range(3):
        batch.step()
    b = join(1)
    while b.slot is None:
        batch.step()
    c = join(2)
    for _ in range(3):
        batch.step()
    assert c.slot is None  # (no free slot yet)
    b_slot, b_out = b.slot, len(b.out)
    batch.leave(b)
    while batch.running or batch.waiting:
        batch.step()
    batch.close()
    return {"out": [e.out for e in (a, b, c)], "K": [e.stats.K for e in (a, c)],
            "joined": [e.joined_at for e in (a, b, c)], "slots": [a.slot, b_slot, c.slot],
            "b_at_leave": b_out, "session": batch.describe(), "snaps": sorted(batch.snaps)}


def _job(engine, plan: list[tuple[str, dict]]) -> dict:
    """Rank 0: each (name, generate_batch's arguments) in turn, or "interface" / "single"."""
    out = {}
    for name, kw in plan:
        if name.startswith("interface"):
            out[name] = _interface(engine, **kw)
        elif name == "single":
            out[name] = engine.generate(**kw)
        else:
            seen: dict[int, list[int]] = {}
            d: dict = {}
            res = engine.generate_batch(**kw, describe=d,
                                        on_token=lambda i, t: seen.setdefault(i, []).append(t))
            out[name] = (res, seen, d)
    return out


def test_two_stages_each_sequence_equals_its_decode_alone():
    n, factory = 2, partial(tiny_factory, 5, vocab=32)
    eng = _engine(factory, n)
    stop = eng.generate_ar(PROMPTS[2], 12).token_ids[3]
    greedy = dict(prompts=PROMPTS, max_new_tokens=12, max_batch=3, stop_token_ids=[stop])
    sampled = dict(prompts=PROMPTS, max_new_tokens=10, sampling=SAMPLED, max_batch=2)
    ones = dict(prompts=PROMPTS, max_new_tokens=1, max_batch=2)
    got = launch_local(_config(factory, n), partial(_job, plan=[
        ("greedy", greedy), ("sampled", sampled), ("ones", ones),
        ("interface", {"max_new": 16}), ("single", {"prompt_ids": PROMPTS[0],
                                                    "max_new_tokens": 12})]), timeout=150)

    res, seen, d = got["greedy"]
    batched = eng.generate(PROMPTS, 12, max_batch=3, stop_token_ids=[stop])  # one process
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        alone = eng.generate(p, 12, stop_token_ids=[stop])
        assert figures(r) == figures(alone) == figures(batched[i]), i
        assert r.token_ids == eng.generate_ar(p, 12, stop_token_ids=[stop]).token_ids
        assert seen[i] == r.token_ids
    assert res[2].finish_reason == "stop" and len(res[2].token_ids) <= 4
    assert sum(r.stats.drafts_accepted for r in res) > 0  # accepts (the lookup) and rejections
    assert sum(r.stats.drafts_judged - r.stats.drafts_accepted for r in res) > 0
    assert d["pauses"] >= 2 and all(r["cycles"] == d["cycles"] for r in d["ranks"])

    res, _, _ = got["sampled"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert figures(r) == figures(eng.generate(p, 10, s))
    assert res[0].token_ids != eng.generate_ar(PROMPTS[0], 10).token_ids  # sampling sampled

    res, _, d = got["ones"]
    assert [r.token_ids for r in res] == [eng.generate(p, 1).token_ids for p in PROMPTS]
    assert d["cycles"] == 0  # every sequence ended at its join: no cycle ran

    f = got["interface"]
    a, b, c = (eng.generate(p, 16) for p in PROMPTS[:3])
    assert f["out"][0] == a.token_ids and f["out"][2] == c.token_ids
    assert f["K"] == [a.stats.K, c.stats.K]
    assert f["out"][1] == b.token_ids[:len(f["out"][1])] and len(f["out"][1]) < 16
    assert f["out"][1][:f["b_at_leave"]] == b.token_ids[:f["b_at_leave"]]
    j = f["joined"]
    assert j[0] == 0 < j[1] < j[2]  # joins at different cycles
    assert f["slots"][2] == f["slots"][1] != f["slots"][0]  # C in the slot B left

    single = got["single"]
    assert figures(single) == figures(eng.generate(PROMPTS[0], 12))  # the ranks still in step


def test_four_stages_under_the_replay_check(monkeypatch):
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")  # (the ranks take it too)
    n, factory = 4, partial(tiny_factory, 7, vocab=32)
    eng = _engine(factory, n)
    greedy = dict(prompts=PROMPTS[:4], max_new_tokens=8, max_batch=3)
    sampled = dict(prompts=PROMPTS[:4], max_new_tokens=8, sampling=SAMPLED[:4], max_batch=3)
    got = launch_local(_config(factory, n, ahead=1), partial(_job, plan=[
        ("greedy", greedy), ("sampled", sampled)]), timeout=150)
    res, _, d = got["greedy"]
    for p, r in zip(PROMPTS, res):
        assert figures(r) == figures(eng.generate(p, 8))
        assert r.token_ids == eng.generate_ar(p, 8).token_ids
    assert d["graph"]["checked"] > 0 and all(r["graph"]["checked"] > 0 for r in d["ranks"])
    assert len(d["ranks"]) == n
    # rank 0: one graph a bucket (1, 2, 3 slots; bubbles only: 1), whichever sequences
    # joined and left
    assert d["graph"]["made"] <= 4, d["graph"]
    res, _, d = got["sampled"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert figures(r) == figures(eng.generate(p, 8, s))
    assert all(r["graph"]["checked"] > 0 for r in d["ranks"])


@pytest.mark.parametrize("n,width", [(3, 2)])
def test_token_trees_each_equal_alone(n, width):
    factory = partial(tiny_factory, 9, vocab=32)
    eng = _engine(factory, n, width)
    kw = dict(prompts=PROMPTS, max_new_tokens=10, sampling=SAMPLED, max_batch=2)
    got = launch_local(_config(factory, n, tree_width=width), partial(_job, plan=[
        ("tree", kw)]), timeout=150)
    res, _, _ = got["tree"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert figures(r) == figures(eng.generate(p, 10, s))
    assert res[1].token_ids == eng.generate_ar(PROMPTS[1], 10).token_ids


@pytest.mark.parametrize("n,S,width", [(3, 1, 1), (3, 2, 1), (2, 0, 2)],
                         ids=["middle-chain", "last-chain", "first-tree"])
def test_draft_on_a_stage_each_sequence_equals_alone(n, S, width, monkeypatch):
    """--draft-on-stage S with several sequences (n processes): rank 0 runs stage S in its
    batch cycle (LocalStage: its units from rank 0's message or stage S - 1, on to stage S + 1,
    a greedy chain's verdicts at the last stage), the others as before. Greedy and seeded
    sampled sequences each equal their decode alone (and the one-process batch), greedy AR's;
    the session's figures name every stage, the one in rank 0's process included. In the
    middle, under SPD_REPLAY_CHECK: every rank's steady cycles are the work a graph replays."""
    if S == 1:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    factory = partial(tiny_factory, 5, vocab=32)
    eng = _engine(factory, n, width)
    greedy = dict(prompts=PROMPTS, max_new_tokens=10, max_batch=3)
    sampled = dict(prompts=PROMPTS[:4], max_new_tokens=8, sampling=SAMPLED[:4], max_batch=2)
    got = launch_local(_config(factory, n, draft_on_stage=S, tree_width=width),
                       partial(_job, plan=[("greedy", greedy), ("sampled", sampled)]),
                       timeout=150)
    res, seen, d = got["greedy"]
    batched = eng.generate(PROMPTS, 10, max_batch=3)
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        assert figures(r) == figures(eng.generate(p, 10)) == figures(batched[i]), i
        assert r.token_ids == eng.generate_ar(p, 10).token_ids and seen[i] == r.token_ids
    assert sum(r.stats.drafts_accepted for r in res) > 0
    assert [r["rank"] for r in d["ranks"]] == list(range(1, n + 1))
    assert all(r["cycles"] == d["cycles"] for r in d["ranks"]) and d["pauses"] >= 2
    assert d["ranks"][S]["role"] == f"stage {S}" and d["ranks"][S]["forward_s"] > 0
    if S == 1:
        assert all(r["graph"]["checked"] > 0 for r in d["ranks"])
    res, _, _ = got["sampled"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert figures(r) == figures(eng.generate(p, 8, s))


def test_prompts_prefilled_in_chunks_across_ranks_each_equal_alone(monkeypatch):
    """prefill_chunk = 3 on n = 3 ranks: each joining prompt goes through the ranks three rows
    a pause while the others decode between pauses (a prompt of 8 rows: three pauses), also
    with the draft on a stage (its chunks through rank 0's stage). Each sequence's result is
    its decode alone (greedy and seeded sampled), and more pauses run than without chunks.
    Under SPD_REPLAY_CHECK every unit runs: a prefilling slot's bubbles, parked again each
    cycle, stay at its trash row (a prompt of 13 rows: 5 chunks)."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    n, factory = 3, partial(tiny_factory, 5, vocab=32)
    eng = _engine(factory, n)
    long = [PROMPTS[2] + PROMPTS[0], *PROMPTS[:4]]  # (13, 5, 2, 8 and 5 rows)
    sampling = [SAMPLED[0], SamplingParams(), SAMPLED[2], SamplingParams(), SAMPLED[4]]
    plan = [(f"chunk{c}", dict(prompts=long, max_new_tokens=10, sampling=sampling,
                               max_batch=2, prefill_chunk=c)) for c in (None, 3)]
    for S in (None, 1):
        got = launch_local(_config(factory, n, draft_on_stage=S), partial(_job, plan=plan),
                           timeout=150)
        for c in (None, 3):
            res, seen, d = got[f"chunk{c}"]
            for i, (p, s, r) in enumerate(zip(long, sampling, res)):
                assert figures(r) == figures(eng.generate(p, 10, s)), (S, c, i)
                assert seen[i] == r.token_ids
        assert got["chunk3"][2]["pauses"] > got["chunkNone"][2]["pauses"] + 2, S


def test_a_hybrid_target_batches_across_ranks():
    """A hybrid target (Qwen3.5) through a batch session on n = 2 ranks: each stage rank keeps
    every slot's DeltaNet state rings (SlotStage), reset when a slot's next prompt comes.
    Five prompts through two slots, greedy and seeded sampled, each its decode alone in one
    process; greedy AR's."""
    from conftest import tiny_hybrid_factory
    n, factory = 2, partial(tiny_hybrid_factory, 3)
    eng = SPDEngine(factory(0), n_stages=n, lookup=2, warn_untrained=False)
    kw = dict(prompts=PROMPTS, max_new_tokens=10, sampling=SAMPLED, max_batch=2)
    got = launch_local(_config(factory, n), partial(_job, plan=[("hybrid", kw)]), timeout=150)
    res, _, _ = got["hybrid"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert figures(r) == figures(eng.generate(p, 10, s))
    assert res[1].token_ids == eng.generate_ar(PROMPTS[1], 10).token_ids


@pytest.mark.parametrize("n", [2, 3])
def test_the_pipeline_without_speculation_across_ranks(n, monkeypatch):
    """The baseline on the same ranks (spd.distributed.batch_pipeline, a batch session of mode
    "pipeline"): five prompts through fewer slots, greedy ones each AR's tokens and the
    one-process pipeline's figures (one ending at a stop id), seeded sampled ones each the
    one-process pipeline's alone, prompts prefilled in chunks; a client that leaves mid-decode
    frees its slot for the one waiting; only the last stage sends rank 0 anything (no anchor
    rows); an SPD decode on the same ranks after. n = 3 under SPD_REPLAY_CHECK (every unit
    runs, bubbles at the trash row included)."""
    if n == 3:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    factory = partial(tiny_factory, 5, vocab=32)
    eng = _engine(factory, n)
    stop = eng.generate_ar(PROMPTS[2], 12).token_ids[3]
    greedy = dict(prompts=PROMPTS, max_new_tokens=12, max_batch=3, stop_token_ids=[stop],
                  mode="pipeline")
    sampled = dict(prompts=PROMPTS, max_new_tokens=10, sampling=SAMPLED, max_batch=2,
                   prefill_chunk=3, mode="pipeline")
    got = launch_local(_config(factory, n), partial(_job, plan=[
        ("greedy", greedy), ("sampled", sampled),
        ("interface", {"max_new": 16, "mode": "pipeline"}),
        ("single", {"prompt_ids": PROMPTS[0], "max_new_tokens": 12})]), timeout=150)

    res, seen, d = got["greedy"]
    for i, (p, r) in enumerate(zip(PROMPTS, res)):
        alone = eng.generate_pipeline(p, 12, stop_token_ids=[stop])
        assert figures(r)[:4] == figures(alone)[:4], i
        assert r.token_ids == eng.generate_ar(p, 12, stop_token_ids=[stop]).token_ids
        assert seen[i] == r.token_ids and r.stats.mode == "pp"
    assert res[2].finish_reason == "stop" and len(res[2].token_ids) <= 4
    assert d["pauses"] >= 2 and all(r["cycles"] == d["cycles"] for r in d["ranks"])
    if n == 3:
        assert all(r["graph"]["checked"] > 0 for r in d["ranks"])
    res, _, _ = got["sampled"]
    for p, s, r in zip(PROMPTS, SAMPLED, res):
        assert r.token_ids == eng.generate_pipeline(p, 10, s).token_ids

    f = got["interface"]
    a, b, c = f["out"]
    assert a == eng.generate_ar(PROMPTS[0], 16).token_ids
    assert c == eng.generate_ar(PROMPTS[2], 16).token_ids
    assert 0 < f["b_at_leave"] < 16 and b == eng.generate_ar(PROMPTS[1], 16).token_ids[:len(b)]
    assert f["slots"][2] == f["slots"][1]  # (C took the slot B's client left)
    assert f["snaps"] == [n - 1]
    assert figures(got["single"]) == figures(eng.generate(PROMPTS[0], 12))
