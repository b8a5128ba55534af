"""The PDM draft step as CUDA-graph replays (spd.draft.graphs): same logits as the eager step."""
import pytest
import torch
from conftest import RecordingDrafter, make_tiny_target, needs_gpu

from spd import SamplingParams, SPDEngine
from spd.draft.drafters import PDMDrafter
from spd.draft.graphs import graphs_enabled

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_graphs_only_on_cuda(tiny_target, monkeypatch):
    assert not graphs_enabled(torch.device("cpu"))
    eng = SPDEngine(tiny_target, n_stages=2, anchors=[0, 2, 3])
    drafter = PDMDrafter(eng.pdm)
    drafter.begin(64, tiny_target.vocab_size)
    assert drafter.graphs is None  # CPU: eager
    if torch.cuda.is_available():
        monkeypatch.setenv("SPD_CUDA_GRAPHS", "0")
        assert not graphs_enabled(torch.device("cuda"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n", [2, 4])
def test_gpu_graph_replays_match_eager_step(n):
    """Every draft call of a decode with rollbacks (rows 1..n+1, moving positions): the replayed
    graph's logits equal the eager step's, and the decode stays lossless."""
    from spd.model.target import TargetModel
    cpu = make_tiny_target(seed=60 + n, vocab=64, layers=4)
    t = TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=n, anchors=[0, 2, 3], debug_poison=True)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    runs = {}
    for graphs in (False, True):
        d = RecordingDrafter(eng.pdm, PROMPT + ar, 0.6, cuda_graphs=graphs)
        res = eng.generate(PROMPT, 40, drafter=d)
        assert res.token_ids == ar
        runs[graphs] = (d, res.stats)
    eager, graphed = runs[False][0], runs[True][0]
    assert graphed.graphs is not None and graphed.graphs.failed is None
    assert graphed.graphs.replays == len(graphed.logits) > 0
    assert len(graphed.graphs.graphs) > 1  # several row counts were captured
    assert runs[False][1].K == runs[True][1].K
    for a, b in zip(eager.logits, graphed.logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@needs_gpu
def test_gpu_graphed_sampling_is_lossless_and_reproducible():
    from spd.model.target import TargetModel
    cpu = make_tiny_target(seed=71, vocab=64, layers=4)
    t = TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=3, anchors=[0, 2, 3])
    sp = SamplingParams(temperature=0.9, top_k=20, seed=4)
    eager = eng.generate(PROMPT, 30, sp, drafter=PDMDrafter(eng.pdm, cuda_graphs=False))
    graphed_drafter = PDMDrafter(eng.pdm)
    graphed = eng.generate(PROMPT, 30, sp, drafter=graphed_drafter)
    assert graphed_drafter.graphs is not None and graphed_drafter.graphs.replays > 0
    assert graphed.token_ids == eager.token_ids


def test_pack_qkv_keeps_the_weights_and_packs_them_once(tiny_target):
    """PDMStepGraphs packs each layer's q/k/v weights back to back (one product on the Triton
    path): the values stay, the parameters become views of one buffer, a second pack is a no-op."""
    from spd_kernels.qkv_rope import packed_qkv

    pdm = SPDEngine(tiny_target, n_stages=2, anchors=[0, 2, 3]).pdm
    before = {k: v.clone() for k, v in pdm.state_dict().items()}
    attn = [layer.self_attn for layer in pdm.layers]
    assert all(packed_qkv(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) is None for a in attn)
    pdm.pack_qkv_()
    assert all(packed_qkv(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) is not None
               for a in attn)
    after = pdm.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    ptrs = [a.q_proj.weight.data_ptr() for a in attn]
    pdm.pack_qkv_()
    assert [a.q_proj.weight.data_ptr() for a in attn] == ptrs
