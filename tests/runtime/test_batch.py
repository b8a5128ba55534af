"""Several prompts at once (spd.runtime.batch_ar, spd.runtime.batch_spd; generate_ar and
generate on a list): continuous batching over slot caches, AR and SPD. Each prompt's result
equals its decode alone (SPD: also its N, K and judged drafts; greedy SPD equals AR), greedy and
seeded sampling, with fewer slots than prompts (sequences join as others leave, in a slot another
sequence used), one ending at once, one at a stop id; on_token names the prompt; bad input is
refused with a message naming it."""
from collections import Counter

import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.errors import SPDError
from spd.runtime.batch_ar import BatchedAR
from spd.runtime.batch_spd import BatchedSPD
from spd.runtime.stopping import StopRule

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7, 9], [2, 7, 1], [8, 2, 8, 1, 8, 2]]
MODES = ["ar", "spd"]


@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def engine(request):
    return SPDEngine(make_tiny_target(seed=5, vocab=32, layers=4), n_stages=request.param,
                     warn_untrained=False)


def decode(engine, mode: str):
    return engine.generate_ar if mode == "ar" else engine.generate


def same(batched, alone, mode: str) -> bool:
    ok = batched.token_ids == alone.token_ids and batched.finish_reason == alone.finish_reason
    if mode == "spd":
        a, b = batched.stats, alone.stats
        ok = ok and (a.K, a.N, a.drafts_judged, a.drafts_accepted) == (
            b.K, b.N, b.drafts_judged, b.drafts_accepted)
    return ok


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_batch", [2, 5])
def test_each_prompt_equals_its_decode_alone(engine, mode, max_batch):
    run = decode(engine, mode)
    seen = {i: [] for i in range(len(PROMPTS))}
    results = run(PROMPTS, 12, max_batch=max_batch, on_token=lambda i, tok: seen[i].append(tok))
    assert len(results) == len(PROMPTS)
    for i, (p, r) in enumerate(zip(PROMPTS, results)):
        alone = run(p, 12)
        assert same(r, alone, mode), i
        assert r.token_ids == engine.generate_ar(p, 12).token_ids  # greedy SPD: AR's tokens
        assert seen[i] == r.token_ids and r.stats.mode == mode
        assert r.stats.new_tokens == len(r.token_ids)


@pytest.mark.parametrize("mode", MODES)
def test_seeded_sampling_equals_each_alone(engine, mode):
    run = decode(engine, mode)
    sampling = [SamplingParams(temperature=1.0, top_k=8, seed=s) for s in range(len(PROMPTS))]
    sampling[1] = SamplingParams()  # greedy beside sampled rows
    results = run(PROMPTS, 10, sampling, max_batch=3)
    for p, s, r in zip(PROMPTS, sampling, results):
        assert same(r, run(p, 10, s), mode)


@pytest.mark.parametrize("mode", MODES)
def test_stops_free_their_slots_for_the_next_prompt(engine, mode):
    run = decode(engine, mode)
    stop_at = engine.generate_ar(PROMPTS[2], 12).token_ids[3]
    results = run(PROMPTS, 12, max_batch=2, stop_token_ids=[stop_at])
    for p, r in zip(PROMPTS, results):
        assert same(r, run(p, 12, stop_token_ids=[stop_at]), mode)
    assert results[2].finish_reason == "stop" and len(results[2].token_ids) <= 4
    ones = run(PROMPTS, 1, max_batch=2)  # every sequence ends at its join
    assert [r.token_ids for r in ones] == [run(p, 1).token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode", MODES)
def test_the_default_model_batched_equals_alone(default_target, mode):
    eng = SPDEngine(default_target, n_stages=4)
    chats = [[{"role": "user", "content": q}] for q in
             ("What is a prime number?", "Why is the sky dark at night?")]
    run = decode(eng, mode)
    for chat, r in zip(chats, run(chats, 8)):
        assert r.token_ids == eng.generate_ar(chat, 8).token_ids


def test_bad_input_is_named(engine):
    with pytest.raises(SPDError, match="max_batch must be a positive integer"):
        engine.generate_ar(PROMPTS, 4, max_batch=0)
    with pytest.raises(SPDError, match="one SamplingParams for all prompts or one each"):
        engine.generate(PROMPTS, 4, [SamplingParams()] * 2)
    with pytest.raises(SPDError, match="max_batch applies to several prompts"):
        engine.generate(PROMPTS[0], 4, max_batch=2)
    with pytest.raises(SPDError, match="give no drafter"):
        engine.generate(PROMPTS, 4, drafter=engine.drafter)
    need = len(PROMPTS[2]) + 4 - 1
    with pytest.raises(SPDError, match=rf"the prompt \(8 tokens\) and max_new_tokens \(4\) need "
                                       rf"{need} rows of context but a slot holds 8"):
        BatchedAR(engine.target, 2, 8).join(torch.tensor(PROMPTS[2]), 4, SamplingParams(),
                                            StopRule(set()))
    with pytest.raises(SPDError, match="a slot holds 12"):
        BatchedSPD(engine, 2, 12).join(torch.tensor(PROMPTS[2]), 4, SamplingParams(),
                                       StopRule(set()))
    with pytest.raises(SPDError, match="slots must be a positive integer"):
        BatchedAR(engine.target, 0, 8)


@pytest.mark.parametrize("replay", [False, True], ids=["cpu", "checked"])
def test_a_steady_batched_cycle_reads_nothing_and_copies_no_python_value(engine, replay,
                                                                         monkeypatch):
    """Outside spd_kernels' CPU reference paths, a cycle of the batch reads no device value and
    makes no tensor of a Python value: the host reads each sequence's published state (host
    memory) and nothing else; under SPD_REPLAY_CHECK (every row every cycle, as on a GPU) only
    a change in the set of running sequences makes its index. On a CPU a stage runs its live
    rows alone (their units looked at: host memory), whose sets are indexed as they come."""
    from conftest import bench_module
    probe = bench_module("probe_host_reads")
    if replay:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    log: list = []
    sampling = [SamplingParams(), SamplingParams(temperature=1.0, seed=2), SamplingParams()]
    with probe.CallLog(log, (BatchedSPD, "step")):
        with probe.ReadLog(log, where=True, copies=True):
            results = engine.generate(PROMPTS[:3], 12, sampling)
    steps, events = [], []
    for event in log:
        if event[0] == "step":
            steps.append([])
        elif steps and event[0] in ("read", "copy") and "/spd_kernels/" not in event[2]:
            steps[-1].append(event)
            events.append(event)
    assert len(steps) >= max(r.stats.K for r in results) > 5
    if replay:  # the set of slots made: in the first step, and in a step after one left
        assert sum(1 for s in steps if s) <= 3
    assert all("batch_spd.py" in e[2] for e in events), events


def test_a_sequence_rejected_every_cycle_leaves_the_others_as_they_are_alone(engine):
    """Three sequences in one batch: one drafter always wrong (every draft rejected: that
    pipeline refills every time), one always right, one the engine's own. Each gets the tokens,
    N, K and judged / accepted drafts it gets alone with the same drafter."""
    from conftest import NoisyPDMDrafter
    prompts = PROMPTS[:3]
    refs = [p + engine.generate_ar(p, 16).token_ids for p in prompts]
    made = {0: lambda: NoisyPDMDrafter(engine.pdm, refs[0], 0.0, seed=1),
            1: lambda: NoisyPDMDrafter(engine.pdm, refs[1], 1.0, seed=1)}
    batch = BatchedSPD(engine, 3, 64)
    for slot, drafter in made.items():  # (slots fill from 0)
        batch.drafters[slot] = drafter()
    joined = []
    for p in prompts:
        ids, max_new, rule = engine.prepare_request(p, 16, None, None)
        joined.append(batch.join(ids, max_new, SamplingParams(), rule))
    assert [e.slot for e in joined] == [0, 1, 2]
    while batch.running:
        batch.step()
    for i, (p, e) in enumerate(zip(prompts, joined)):
        alone = engine.generate(p, 16, drafter=made[i]() if i in made else None)
        assert e.out == alone.token_ids == refs[i][len(p):]
        a, b = e.stats, alone.stats
        assert (a.K, a.N, a.drafts_judged, a.drafts_accepted) == (
            b.K, b.N, b.drafts_judged, b.drafts_accepted), i
    assert joined[0].stats.drafts_accepted == 0 < joined[0].stats.drafts_judged
    assert joined[1].stats.drafts_accepted == joined[1].stats.drafts_judged > 0


def poisoned(batch):
    """`batch` with every KV row (a hybrid target's: and every DeltaNet ring entry) NaN until
    written: a row read before it is written (a prefill chunk at the wrong place, a tree row
    not committed) spoils the tokens."""
    caches = batch.stages.k + batch.stages.v if hasattr(batch, "stages") else [batch.k, batch.v]
    if batch.target.hybrid:
        caches = [t for p in batch.stages.parts for b in range(p.slots)
                  for t in (lambda c: (c.k, c.v, c.conv, c.state))(p.view(b).cache)]
    for c in caches:
        c.fill_(float("nan"))
    return batch


def run_batch(engine, batch, prompts, max_new: int, sampling=None):
    """The prompts joined one a step (as slots free) and decoded -> each one's entry, what
    every step emitted ([(prompt index, token)] a step) and after each step every prompt's
    progress (SPD: cycles launched; AR: tokens)."""
    sampling = sampling or [SamplingParams()] * len(prompts)
    waiting, joined, steps, progress = list(range(len(prompts))), {}, [], []
    while waiting or batch.running:
        steps.append([])
        if waiting and batch.free:
            i = waiting.pop(0)
            ids, n_new, rule = engine.prepare_request(prompts[i], max_new, None, None)
            joined[i] = batch.join(ids, n_new, sampling[i], rule,
                                   lambda tok, i=i: steps[-1].append((i, tok)))
        batch.step()
        progress.append({i: getattr(e, "launched", len(e.out)) for i, e in joined.items()})
    return [joined[i] for i in range(len(prompts))], steps, progress


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ahead", [0, 3])
def test_chunked_prefill_and_reading_behind_change_no_token(engine, mode, ahead):
    """Prompts prefilled two rows a step while the others decode, the host reading each
    sequence `ahead` cycles behind (SPD): every result is its decode alone, and a long prompt's
    prefill steps still carry the running sequences' tokens."""
    sampling = [SamplingParams(temperature=1.0, top_k=8, seed=s) for s in range(len(PROMPTS))]
    sampling[0] = SamplingParams()
    batch = poisoned(BatchedAR(engine.target, 3, 32, prefill_chunk=2) if mode == "ar" else
                     BatchedSPD(engine, 3, 32, ahead=ahead, prefill_chunk=2))
    entries, steps, progress = run_batch(engine, batch, PROMPTS, 10, sampling)
    run = decode(engine, mode)
    for i, (p, s, e) in enumerate(zip(PROMPTS, sampling, entries)):
        alone = run(p, 10, s)
        assert e.out == alone.token_ids, i
        if mode == "spd":
            assert (e.stats.K, e.stats.drafts_judged) == (alone.stats.K,
                                                          alone.stats.drafts_judged), i
    # PROMPTS[2] (8 rows) joins in step 2: its first chunk there, its others in the next
    # three steps (the last one choosing its first token), while the others decode
    firsts = [k for k, got in enumerate(steps) if any(i == 2 for i, _ in got)]
    assert firsts[0] == 2 + 2
    for k in (2, 3, 4):
        assert all(progress[k][i] > progress[k - 1][i] for i in (0, 1)), k


def test_a_batched_cycle_is_the_work_one_graph_replays(engine, monkeypatch):
    """Under SPD_REPLAY_CHECK every steady cycle of the batch (its sequences' controls, draft
    steps and the shared stage steps) is the same work, op for op on the same memory, as the
    first steady cycle of its members: what one CUDA graph replays until a sequence joins or
    leaves. Greedy and sampled sequences together, joining at different steps."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    sampling = [SamplingParams(), SamplingParams(temperature=1.0, top_p=0.9, seed=4),
                SamplingParams(), SamplingParams(temperature=0.7, seed=1)]
    batch = BatchedSPD(engine, 3, 40)
    entries, _, _ = run_batch(engine, batch, PROMPTS[:4], 14, sampling)
    for p, s, e in zip(PROMPTS, sampling, entries):
        assert e.out == engine.generate(p, 14, s).token_ids
    got = batch.describe()
    assert got["checked"] >= 10 and got["made"] >= 4 and got.get("captured", 0) == 0, got
    # a sequence's buffers are its slot's, allocated once with the batch
    for e in entries:
        slot = (batch.tokens[e.slot], batch.anchors[e.slot], batch.final[e.slot])
        for mine, slots in zip((e.seq.tokens, e.seq.anchors, e.seq.final), slot):
            assert mine.data_ptr() == slots.data_ptr()


@pytest.mark.parametrize("width", [1, 3], ids=["chains", "trees"])
def test_one_graph_a_bucket_serves_every_join_and_leave(engine, tree_engine, width,
                                                        monkeypatch):
    """A bucket's cycle runs every slot below it, a free or prefilling slot a bubble parked at
    its trash row: under SPD_REPLAY_CHECK (every row every cycle, as on a GPU) one graph a key
    (bucket, greedy or not, the sampling groups) carries the cycles of every set of members
    that fits it, prompts joining (prefilled two rows a step into a slot the others' cycles
    run over) and leaving, and each sequence still gets its decode alone (tokens, N, K,
    judged drafts) in caches poisoned with NaN."""
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    eng = engine if width == 1 else tree_engine
    sampling = [SamplingParams(temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    sampling[0] = sampling[3] = SamplingParams()
    one_graph_a_bucket(eng, BatchedSPD(eng, 4, 48, prefill_chunk=2), PROMPTS, sampling,
                       monkeypatch)


def one_graph_a_bucket(eng, batch, prompts, sampling, monkeypatch) -> None:
    """`prompts` through `batch` (its caches poisoned), 10 tokens each: each its decode alone
    (tokens, N, K, judged drafts), every cycle a bucket's, one graph a key, some key serving
    three sets of members or more."""
    from spd.runtime.cycle_graph import BatchGraphs
    launched: list = []
    real = BatchGraphs.launch
    monkeypatch.setattr(BatchGraphs, "launch", lambda self, key, members, cycle: launched.append(
        (key, tuple(e.slot for e in members))) or real(self, key, members, cycle))
    entries, _, _ = run_batch(eng, poisoned(batch), prompts, 10, sampling)
    for i, (p, s, e) in enumerate(zip(prompts, sampling, entries)):
        alone = eng.generate(p, 10, s)
        a, b = e.stats, alone.stats
        assert e.out == alone.token_ids and (a.K, a.N, a.drafts_judged) == (
            b.K, b.N, b.drafts_judged), i
    keys = Counter(key for key, _ in launched)
    assert all(key[0] == "bucket" for key in keys), keys
    got = batch.describe()  # (a key's first two cycles: the warm-up and the trace to match)
    assert got["made"] == len(keys) and got["checked"] == sum(max(c - 2, 0) for c in
                                                              keys.values()), got
    members = {}  # each key's sets of members
    for key, slots in launched:
        members.setdefault(key, set()).add(slots)
    assert max(map(len, members.values())) >= 3, members


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_a_prompt_prefilled_in_a_bucket_is_as_alone(hybrid, monkeypatch):
    """Bucketed (a hybrid target's batch too), a prefilling slot below the bucket runs a bubble
    every cycle between its prompt's chunks. The last prompt (7 rows, 2 a chunk) prefills in
    slot 1 while slots 0, 2 and 3 decode (bucket 4): each bubble stays at its trash row 21 (a
    cycle's commit would move it to row 1, over the prompt's rows), and on the hybrid it writes
    no DeltaNet ring entry (with n = 2 it would write entry 22 mod 3 = 1, the one its chunk at
    row 4 reads). Each sequence gets its decode alone, one graph a bucket."""
    from conftest import make_tiny_hybrid
    monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    t = make_tiny_hybrid(seed=3, vocab=32, layer_types=(
        "full_attention", "linear_attention", "linear_attention", "linear_attention")
                         ) if hybrid else make_tiny_target(seed=5, vocab=32, layers=4)
    eng = SPDEngine(t, n_stages=2, warn_untrained=False)
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0], PROMPTS[4], PROMPTS[2][:7]]
    sampling = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams(),
                SamplingParams(temperature=1.0, seed=4), SamplingParams()]
    one_graph_a_bucket(eng, BatchedSPD(eng, 4, 48, prefill_chunk=2), prompts, sampling,
                       monkeypatch)


@pytest.fixture(scope="module")
def tree_engine():
    return SPDEngine(make_tiny_target(seed=5, vocab=32, layers=4), n_stages=3,
                     warn_untrained=False, tree_width=3)


@pytest.mark.parametrize("replay,mixed", [(False, True), (True, True), (False, False)],
                         ids=["cpu", "checked", "all-sampled"])
def test_token_trees_in_one_batch_each_equal_its_decode_alone(tree_engine, replay, mixed,
                                                              monkeypatch):
    """Token trees (W = 3 rows a unit, n = 3), three sequences at once with drafters that
    accept through top and lower rows and reject: each gets its decode alone (tokens, N, K,
    judged and accepted drafts), greedy ones AR's tokens, a seeded sampled one its own (all
    sampled alike: the batch judges them in one op); under SPD_REPLAY_CHECK every steady cycle
    of the batch is the work one graph replays."""
    from conftest import NoisyTreeDrafter
    if replay:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    eng, prompts = tree_engine, PROMPTS[:3]
    refs = [p + eng.generate_ar(p, 14).token_ids for p in prompts]
    made = [lambda i=i, a=a: NoisyTreeDrafter(eng.pdm, refs[i], a, seed=i, mix=0.5)
            for i, a in enumerate((0.8, 0.5, 0.8))]
    sampling = ([SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3)]
                if mixed else [SamplingParams(temperature=0.9, top_k=12, seed=s) for s in (1, 2, 3)])
    batch = poisoned(BatchedSPD(eng, 3, 64))
    for slot in range(3):
        batch.drafters[slot] = made[slot]()
    entries, _, _ = run_batch(eng, batch, prompts, 14, sampling)
    for i, (p, e) in enumerate(zip(prompts, entries)):
        alone = eng.generate(p, 14, sampling[i], drafter=made[i]())
        assert e.out == alone.token_ids, i
        a, b = e.stats, alone.stats
        assert (a.K, a.N, a.drafts_judged, a.drafts_accepted) == (
            b.K, b.N, b.drafts_judged, b.drafts_accepted), i
        if sampling[i].greedy:
            assert e.out == refs[i][len(p):]
    assert entries[0].stats.drafts_accepted > 0 or not mixed
    if replay:
        assert batch.describe()["checked"] >= 5


@pytest.mark.parametrize("mixed,replay", [(False, False), (True, True)],
                         ids=["greedy", "mixed-checked"])
def test_token_trees_draft_in_one_step_each_as_alone(tree_engine, mixed, replay, monkeypatch):
    """The plain PDM drafters of a batch of token trees draft in one step over every tree
    (TreeBatch._draft: PipelineDraftModule.batch_tree_step in the slot caches): four prompts
    through three slots (one joins a slot another left), greedy, or greedy beside two sampling
    groups, each get their decode alone (tokens, N, K, judged and accepted drafts), greedy
    ones AR's tokens; checked, every steady cycle is the work one graph replays."""
    from spd.runtime.tree_batch import TreeBatch
    if replay:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    eng, prompts = tree_engine, PROMPTS[:4]
    sampling = [SamplingParams()] * 4
    if mixed:
        sampling = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
                    SamplingParams(temperature=0.8, top_k=10, seed=4),
                    SamplingParams(temperature=1.0, seed=5)]
    batched = []
    real = TreeBatch._draft
    monkeypatch.setattr(TreeBatch, "_draft", lambda self, ctl, cycles, groups: batched.append(
        groups is not None and self.in_slot_caches(cycles, tuple(sorted(cycles)), "tree_top",
                                         "tree_logits")) or real(self, ctl, cycles, groups))
    batch = poisoned(BatchedSPD(eng, 3, 64))
    entries, _, _ = run_batch(eng, batch, prompts, 12, sampling)
    assert batched and all(batched)  # (every cycle drafted in one step)
    for i, (p, e) in enumerate(zip(prompts, entries)):
        alone = eng.generate(p, 12, sampling[i])
        a, b = e.stats, alone.stats
        assert e.out == alone.token_ids and (a.K, a.N, a.drafts_judged, a.drafts_accepted) == (
            b.K, b.N, b.drafts_judged, b.drafts_accepted), i
        if sampling[i].greedy:
            assert e.out == eng.generate_ar(p, 12).token_ids, i
    assert sum(e.stats.drafts_accepted for e in entries) > 0
    if replay:
        assert batch.describe()["checked"] >= 5



@pytest.mark.parametrize("replay", [False, True], ids=["cpu", "checked"])
def test_a_hybrid_target_batches_each_as_alone(replay, monkeypatch):
    """A hybrid target (Qwen3.5: DeltaNet and gated attention layers): each slot keeps its own
    state rings (SlotStage), one stage step over every sequence's row
    (batch_hybrid_stage_step). Three sequences with drafters that accept and reject (the
    rings roll back), greedy and seeded sampled, each get their decode alone (tokens, N, K,
    judged and accepted drafts), greedy ones AR's; then five prompts through two slots (a
    slot's rings reused by the next sequence) with the plain drafters. Checked: every steady
    cycle is the work one graph replays."""
    from conftest import NoisyPDMDrafter, make_tiny_hybrid
    if replay:
        monkeypatch.setenv("SPD_REPLAY_CHECK", "1")
    t = make_tiny_hybrid(seed=3, vocab=32, layer_types=(
        "full_attention", "linear_attention", "linear_attention", "full_attention"))
    eng = SPDEngine(t, n_stages=3, anchors=[0, 2, 3], warn_untrained=False)
    prompts = PROMPTS[:3]
    refs = [p + eng.generate_ar(p, 12).token_ids for p in prompts]
    made = [lambda i=i: NoisyPDMDrafter(eng.pdm, refs[i], 0.6, seed=i) for i in range(3)]
    sampling = [SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    batch = BatchedSPD(eng, 3, 64)
    for slot in range(3):
        batch.drafters[slot] = made[slot]()
    entries, _, _ = run_batch(eng, batch, prompts, 12, sampling)
    for i, (p, e) in enumerate(zip(prompts, entries)):
        alone = eng.generate(p, 12, sampling[i], drafter=made[i]())
        a, b = e.stats, alone.stats
        assert e.out == alone.token_ids and (a.K, a.N, a.drafts_judged, a.drafts_accepted) == (
            b.K, b.N, b.drafts_judged, b.drafts_accepted), i
        if sampling[i].greedy:
            assert e.out == refs[i][len(p):]
    assert sum(e.stats.drafts_accepted for e in entries) > 0
    assert sum(e.stats.drafts_judged - e.stats.drafts_accepted for e in entries) > 0
    if replay:
        assert batch.describe()["checked"] >= 5
        return
    many = [SamplingParams(temperature=0.8, top_k=10, seed=s) for s in range(len(PROMPTS))]
    many[1] = SamplingParams()
    for p, s, r in zip(PROMPTS, many, eng.generate(PROMPTS, 10, many, max_batch=2)):
        assert r.token_ids == eng.generate(p, 10, s).token_ids
    # the baselines batch a hybrid target the same way (their slots' own rings): AR, and the
    # pipeline (greedy: AR's tokens)
    for p, s, r in zip(PROMPTS, many, eng.generate_ar(PROMPTS, 10, many, max_batch=2)):
        assert r.token_ids == eng.generate_ar(p, 10, s).token_ids
    for p, r in zip(PROMPTS, eng.generate_pipeline(PROMPTS, 10, max_batch=2)):
        assert r.token_ids == eng.generate_ar(p, 10).token_ids


@pytest.mark.parametrize("n", [2, 3])
def test_a_hybrid_slots_dead_row_writes_no_ring_entry(n):
    """A parked slot's bubble (a dead unit at the trash row context - 1, as a GPU runs it)
    through a hybrid stage step beside a live row: the parked slot's state rings and conv
    histories stay bit for bit as they were (its next prefill chunk reads them: with n = 2 the
    bubble's entry context mod 3 is the one a 5-row prefill's next chunk reads), and the live
    row writes only its own entry."""
    from conftest import make_tiny_hybrid

    from spd.runtime.slot_stage import SlotStage
    from spd.runtime.unit import FIXED, LIVE, POS, UnitFormat, dead_unit
    t = make_tiny_hybrid(seed=3, vocab=32, layer_types=(
        "linear_attention", "full_attention", "linear_attention", "linear_attention"))
    layout = SPDEngine(t, n_stages=n, warn_untrained=False).layout
    context, R, fmt = 32, n + 1, UnitFormat(n, 1)
    g = torch.Generator().manual_seed(0)
    for s in range(n):
        part = SlotStage(t, layout, s, 2, context)
        x = [torch.randn(L, t.hidden_size, generator=g) for L in (5, 3)]
        if s == 0:
            x = [t.embed_tokens(torch.randint(0, 32, (L,), generator=g)) for L in (5, 3)]
        part.prefill(0, x[0], 0)
        part.prefill(1, x[1], 0)
        caches = [part.view(b).cache for b in range(2)]
        before = [(c.conv.clone(), c.state.clone()) for c in caches]
        heads = torch.stack([dead_unit(fmt, context - 1, context - 1)] * 2)  # [2, H]
        heads[1, POS], heads[1, LIVE], heads[1, FIXED] = 3, 1, 7  # slot 1's next row, live
        rows = None if s == 0 else torch.randn(2, 1, t.hidden_size, generator=g)
        part.run(fmt, (0, 1), torch.tensor([0, 1]), heads, rows)
        assert caches[0].conv.numel() and caches[0].state.numel()
        for (conv, state), c, written in zip(before, caches, (None, (3 + 1) % R)):
            for e in range(R):
                if e != written:
                    assert torch.equal(c.conv[:, e], conv[:, e]), (s, e)
                    assert torch.equal(c.state[:, e], state[:, e]), (s, e)
        assert not torch.equal(caches[1].state[:, (3 + 1) % R], before[1][1][:, (3 + 1) % R])
