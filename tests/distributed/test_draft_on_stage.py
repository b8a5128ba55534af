"""SPD on n devices (--draft-on-stage S): the draft rank runs in stage S's process (stage S runs
inside rank 0's cycle), so n processes carry the n + 1 roles. Its decodes against the reference
decoder: tests/runtime/test_cycle.py (the "stage" placement); here the roles, a failure, a GPU
and the command line."""
from __future__ import annotations

from functools import partial

import pytest
from conftest import make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd.distributed.config import DistConfig, GenerateRequest, Placement, role_of, use_placement
from spd.distributed.launch import launch_local
from spd.distributed.rank import run_requests
from spd.draft.drafters import ReferenceDrafter
from spd.errors import SPDError

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


def test_a_failing_process_of_the_draft_and_a_stage_stops_the_run():
    """The process of the draft and stage 1 raises mid-decode: the run stops naming that
    process (both its roles), no hang (the other stage waits on it)."""
    from spd.distributed.faults import RankFailedError
    config = DistConfig(n_stages=2, target_factory=partial(tiny_factory, 3), fault_timeout=3.0,
                        op_timeout=30.0, draft_on_stage=1,
                        fault={"rank": 0, "cycle": 3, "action": "raise"})
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
    process, each on a stream of its own: exactly the single-process engine's output, greedy
    and sampled."""
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
