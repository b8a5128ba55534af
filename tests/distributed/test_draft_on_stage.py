"""SPD on n devices (--draft-on-stage S): the draft rank runs in stage S's process, so n processes
carry the n + 1 roles. The tokens, N and K must be those of the n + 1 layout (which
test_distributed.py holds equal to the single-process engine's; here both are compared)."""
from __future__ import annotations

from functools import partial

import pytest
from conftest import make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest, Placement, role_of, use_placement
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.distributed.transport import Mailbox
from spd.draft.drafters import ReferenceDrafter
from spd.errors import InternalError, SPDError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def tiny_factory(seed: int, rank: int):
    return make_tiny_target(seed=seed, vocab=48, layers=4)


def test_placement_maps_roles_to_processes():
    p = Placement(4, draft_on_stage=2)
    assert p.processes == 4 and p.roles == 5
    # process 0: the draft rank and stage 2; the other stages in order
    assert [p.process_of(r) for r in range(5)] == [0, 1, 2, 0, 3]
    assert p.roles_of(0) == [0, 3] and p.roles_of(3) == [4]
    assert sorted(r for q in range(4) for r in p.roles_of(q)) == list(range(5))
    assert p.describe(0) == "draft rank + stage 2"
    plain = Placement(4)
    assert [plain.process_of(r) for r in range(5)] == list(range(5)) and plain.processes == 5
    use_placement(DistConfig(n_stages=3, draft_on_stage=0))
    try:
        assert role_of(0) == "draft rank + stage 0" and role_of(1) == "stage 1"
    finally:
        use_placement(DistConfig(n_stages=3))
    for bad in (-1, 3, 1.5, True):
        with pytest.raises(SPDError, match="--draft-on-stage"):
            DistConfig(n_stages=3, draft_on_stage=bad).validate()
    assert DistConfig(n_stages=3, draft_on_stage=1).world_size == 3


def test_mailbox_matches_sends_to_receives_in_posting_order():
    import torch
    box = Mailbox()
    key = (0, 1, 30)
    first = box.post_recv(key, torch.full((2,), -7.0))   # posted before its send: copied in
    box.send(key, torch.tensor([1.0, 2.0]))
    box.send(key, torch.tensor([3.0, 4.0]))              # sent before its receive: kept aside
    second = box.post_recv(key, torch.full((2,), -7.0))
    second.wait(1.0, "second")                           # waited out of order
    first.wait(1.0, "first")
    assert first.tensor.tolist() == [1.0, 2.0] and second.tensor.tolist() == [3.0, 4.0]
    late = box.post_recv(key, torch.empty(2))
    with pytest.raises(InternalError, match="within"):
        late.wait(0.05, "third")
    box.fail("stage 0 failed")
    with pytest.raises(InternalError, match="stage 0 failed"):
        late.wait(1.0, "third")


@pytest.mark.parametrize("n,stage", [(2, 0), (3, 1), (4, 3)])
def test_same_tokens_n_and_k_as_n_plus_one_layout(n, stage):
    t = make_tiny_target(seed=30 + n, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n)
    ref = PROMPT + eng.generate_ar(PROMPT, 40).token_ids
    sp = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=5)
    cases = [
        (GenerateRequest(PROMPT, 20), {}),
        (GenerateRequest(PROMPT, 40, reference=ref, reference_accuracy=0.7, reference_seed=n),
         {"drafter": ReferenceDrafter(ref, 0.7, n)}),                        # mixed accept/reject
        (GenerateRequest(PROMPT, 20, sp, reference=ref, reference_accuracy=0.6, reference_seed=1),
         {"sampling": sp, "drafter": ReferenceDrafter(ref, 0.6, 1)}),        # seeded sampling
        (GenerateRequest(PROMPT * 3, 20), {}),                               # context lookup
    ]
    expected = [eng.generate(r.prompt_ids, r.max_new_tokens, **kw) for r, kw in cases]
    base = dict(n_stages=n, target_factory=partial(tiny_factory, 30 + n), fault_timeout=5.0,
                op_timeout=60.0)
    layouts = {"n + 1": DistConfig(**base), "n": DistConfig(**base, draft_on_stage=stage)}
    got = {k: launch_local(c, partial(run_requests, [r for r, _ in cases]), timeout=150)
           for k, c in layouts.items()}
    for i, e in enumerate(expected):
        for g in (got["n + 1"][i], got["n"][i]):
            assert g.token_ids == e.token_ids
            assert (g.stats.N, g.stats.K, g.stats.drafts_judged, g.stats.drafts_accepted) == \
                (e.stats.N, e.stats.K, e.stats.drafts_judged, e.stats.drafts_accepted)
            assert g.stats.by_position == e.stats.by_position
        d = got["n"][i].stats.distributed
        assert d["processes"] == n and d["draft_on_stage"] == stage
        assert d["world_size"] == n + 1 and d["cycles"] == got["n"][i].stats.K
        assert [r["rank"] for r in d["ranks"]] == list(range(n + 1))
        assert all(d["ranks"][r]["units_worked"] == d["units"] for r in range(1, n + 1))
    assert 0 < got["n"][1].stats.drafts_accepted < got["n"][1].stats.drafts_judged


def test_a_failing_stage_beside_the_draft_stops_the_run():
    """The stage thread of the draft's process raises: the run stops naming that process, no
    hang (the main thread may be waiting on the mailbox or on a peer)."""
    from spd.distributed.faults import RankFailedError
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 3), fault_timeout=3.0,
                        op_timeout=30.0, draft_on_stage=1,
                        fault={"rank": 0, "role": 2, "cycle": 3, "action": "raise"})
    with pytest.raises(RankFailedError, match=r"rank 0 \(draft rank \+ stage 1\)"):
        launch_local(config, partial(run_requests, [GenerateRequest(PROMPT, 30)]), timeout=60)


def cuda_tiny_factory(seed: int, rank: int):
    from spd.model.target import TargetModel
    t = make_tiny_target(seed=seed, vocab=48, layers=4)
    return TargetModel(t.hf.to("cuda"), None, name=t.name)


@pytest.mark.gpu
@needs_gpu
def test_gpu_draft_beside_a_stage_matches_single_process():
    """Every process on one GPU (gloo through host memory), the draft and stage 1 in one
    process on two threads and streams: the mailbox's CUDA events order the copies, so the
    output is exactly the single-process engine's, greedy and sampled."""
    n = 3
    t = cuda_tiny_factory(21, 0)
    eng = SPDEngine(t, n_stages=n)
    ref = PROMPT + eng.generate_ar(PROMPT, 24).token_ids
    sp = SamplingParams(temperature=1.0, top_k=10, seed=3)
    cases = [(GenerateRequest(PROMPT, 24, reference=ref, reference_accuracy=0.6, reference_seed=2),
              {"drafter": ReferenceDrafter(ref, 0.6, 2)}),
             (GenerateRequest(PROMPT, 24, sp), {"sampling": sp})]
    expected = [eng.generate(PROMPT, 24, **kw) for _, kw in cases]
    config = DistConfig(n_stages=n, target_factory=partial(cuda_tiny_factory, 21), device="cuda",
                        backend="gloo", fault_timeout=10.0, op_timeout=60.0, draft_on_stage=1)
    got = launch_local(config, partial(run_requests, [r for r, _ in cases]), timeout=180)
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert (g.stats.N, g.stats.K) == (e.stats.N, e.stats.K)
        assert g.stats.distributed["processes"] == n


def test_cli_draft_on_stage_equals_one_process(tmp_path):
    """`spd generate --distributed --draft-on-stage S` end to end (n processes, a model folder):
    the single-process engine's tokens; and the flag without --distributed is a clear error."""
    import json
    import subprocess
    import sys

    from spd.model.loading import save_tiny_random_llama
    folder = save_tiny_random_llama(tmp_path / "tiny")
    base = [sys.executable, "-m", "spd", "generate", "--model", str(folder), "--stages", "3",
            "--prompt", "The sky is", "--max-new-tokens", "12", "--json", "--threads", "1"]

    def run(*extra):
        out = subprocess.run(base + list(extra), capture_output=True, text=True, timeout=240)
        return out.returncode, out.stdout, out.stderr
    rc, out, err = run()
    assert rc == 0, err
    one = json.loads(out)
    rc, out, err = run("--distributed", "--draft-on-stage", "2", "--split", "2,1,1")
    assert rc == 0, err
    dist = json.loads(out)
    assert dist["token_ids"] == one["token_ids"]
    assert dist["stats"]["distributed"]["processes"] == 3
    assert dist["stats"]["distributed"]["ranks"][3]["layers"] == [3, 4]  # stage 2: one layer
    rc, _, err = run("--draft-on-stage", "0")
    assert rc == 2 and "add --distributed" in err
