"""A drafter reading weight-only quantised weights (PipelineDraftModule.quantize_, SPDEngine's
draft_weights, --draft-weights): SPD's output stays exactly the target's, greedy token for token
and sampled in law (chi-square); the quantised copies are cached, remade when a parameter
changes (into the same buffers), and the step runs them as spd_kernels.pdm_step does."""
import pytest
import torch
from conftest import RecordingDrafter, make_tiny_target, needs_gpu, needs_triton_interpreter
from test_sampling_lossless import V, conditional_pvalue

from spd import SamplingParams, SPDEngine
from spd.cli.common import draft_weights_arg
from spd.draft.pdm import DRAFT_WEIGHTS, PipelineDraftModule
from spd.errors import SPDError
from spd_kernels import pdm_step, use_backend
from spd_kernels.quant import quantize_weight

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
QDTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("n", [2, 4])
def test_greedy_output_equals_autoregressive_with_quantised_drafter(kind, n):
    t = make_tiny_target(seed=30 + n, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n, draft_weights=kind)
    assert eng.pdm.draft_weights == kind
    w = eng.pdm.kernel_weights()
    assert w.lm_head.dtype == QDTYPE[kind] and w.layers[0].w_down.dtype == QDTYPE[kind]
    ar = eng.generate_ar(PROMPT, 30)
    res = eng.generate(PROMPT, 30)
    assert res.token_ids == ar.token_ids
    assert res.stats.drafts_judged == res.stats.N


@needs_triton_interpreter
def test_greedy_lossless_with_the_draft_step_on_triton():
    """The draft step's quantised ops on their Triton kernels (interpreter) inside the engine."""
    t = make_tiny_target(seed=41, vocab=32, layers=4, model_type="qwen3")
    eng = SPDEngine(t, n_stages=2, anchors=[0, 2, 3], draft_weights="int8")
    ar = eng.generate_ar(PROMPT, 12)
    with use_backend(anchor_projection="triton", qkv_rope_append="triton",
                     fused_linear="triton", fused_swiglu="triton"):
        res = eng.generate(PROMPT, 12)
    assert res.token_ids == ar.token_ids


def test_quantised_copies_are_cached_refreshed_and_switched_off():
    t = make_tiny_target(seed=3, vocab=40, layers=4, model_type="qwen3")
    pdm = SPDEngine(t, n_stages=2, anchors=[0, 2, 3]).pdm.pack_qkv_()
    assert pdm.draft_weights == "model"
    float_w = pdm.kernel_weights()
    assert float_w.lm_head_scale is None and float_w.layers[0].wq_scale is None
    pdm.quantize_("int8")
    a, b = pdm.kernel_weights(), pdm.kernel_weights()
    assert a.lm_head is b.lm_head and a.layers[-1].w_up is b.layers[-1].w_up  # cached
    lw = a.layers[0]
    # packed q/k/v (pack_qkv_) stay packed, their scales too: one product in the step
    assert lw.wk.data_ptr() == lw.wq.data_ptr() + lw.wq.numel()
    assert lw.wk_scale.data_ptr() == lw.wq_scale.data_ptr() + 4 * lw.wq_scale.numel()
    q, s = quantize_weight(pdm.layers[0].mlp.down_proj.weight, "int8")
    assert torch.equal(lw.w_down, q) and torch.equal(lw.down_scale, s)
    # a parameter written in place: remade, into the same buffer (a captured step reads it)
    addresses = pdm.draft_weight_addresses()
    with torch.no_grad():
        pdm.layers[0].mlp.down_proj.weight.mul_(2.0)
    c = pdm.kernel_weights()
    assert c.layers[0].w_down.data_ptr() == lw.w_down.data_ptr()
    torch.testing.assert_close(c.layers[0].down_scale, 2 * s)
    assert pdm.draft_weight_addresses() == addresses
    # features: the projections' copies for drafting, the float parameters for training
    m = len(pdm.layout.anchors)
    anchors = torch.randn(m, 5, t.hidden_size)
    present = list(pdm.layout.types)
    types = torch.tensor([present[i % len(present)] for i in range(5)])
    quant = pdm.features(anchors, types)
    exact = pdm.features(anchors, types, quantized=False)
    assert not torch.equal(quant, exact)
    torch.testing.assert_close(quant, exact, rtol=0.05, atol=0.02)
    # the step runs pdm_step over the quantised weights
    cache = pdm.new_cache(16)
    got = pdm.step(quant, 0, cache)
    k, v = torch.zeros_like(cache.k), torch.zeros_like(cache.v)
    cos, sin = pdm._rope_for(16, quant)
    assert torch.equal(got, pdm_step(quant, pdm.kernel_weights(), k, v, 0, cos, sin))
    pdm.quantize_("model")
    assert pdm.kernel_weights().lm_head is pdm.lm_head.weight
    assert pdm.draft_weight_addresses() == ()
    assert torch.equal(pdm.features(anchors, types), exact)


def test_bad_draft_weights_are_refused():
    t = make_tiny_target(seed=1, vocab=16, layers=2)
    with pytest.raises(SPDError, match="draft weights must be one of model, int8, fp8"):
        SPDEngine(t, n_stages=2, draft_weights="int4")
    with pytest.raises(SPDError, match="draft weights must be one of"):
        PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=2).layout).quantize_("bf16")
    import argparse
    assert [draft_weights_arg(k) for k in DRAFT_WEIGHTS] == list(DRAFT_WEIGHTS)
    with pytest.raises(argparse.ArgumentTypeError, match="must be one of model, int8, fp8"):
        draft_weights_arg("int4")


def test_sampled_tokens_follow_target_with_quantised_drafter():
    """As tests/runtime/test_sampling_lossless.py (its per-position chi-square), with the
    drafter's weights int8: the output's law is the target's."""
    n, sp, prompt = 3, SamplingParams(temperature=1.0), [1, 5, 7, 2]
    t = make_tiny_target(seed=21, vocab=V, layers=3, head_scale=3.0)
    draft_vocab = torch.tensor([0, 2, 3, 5, 6, 8, 9, 11])
    pdm = PipelineDraftModule.untrained(t, SPDEngine(t, n_stages=n, pdm=None).layout,
                                        draft_vocab=draft_vocab, seed=3)
    with torch.no_grad():  # a random but confident drafter: its q overlaps p only in part
        pdm.lm_head.weight.mul_(30.0)
    eng = SPDEngine(t, n_stages=n, pdm=pdm, lookup=0, draft_weights="int8")
    outputs, accepted, judged = [], 0, 0
    seeded = [SamplingParams(sp.temperature, sp.top_k, sp.top_p, seed) for seed in range(400)]
    # (eight at a time: each exactly its decode alone, tests/runtime/test_batch.py)
    for res in eng.generate([prompt] * len(seeded), 8, seeded, max_batch=8):
        outputs.append(res.token_ids)
        accepted += res.stats.drafts_accepted
        judged += res.stats.drafts_judged
    assert 0.05 < accepted / judged < 0.95, "both the accept and the residual paths must occur"
    assert conditional_pvalue(t, sp, prompt, outputs) > 1e-3


@pytest.mark.parametrize("argv", [["generate", "--prompt", "hi"], ["eval"], ["serve"]])
def test_the_flag_is_checked_before_any_model_loads(argv, capsys, monkeypatch):
    import spd.model.loading as loading
    from spd.cli import main

    def load(*a, **k):
        raise AssertionError("the model was loaded before the flag was checked")
    monkeypatch.setattr(loading, "load_target", load)
    assert main(argv + ["--draft-weights", "int4"]) == 2
    assert "argument --draft-weights: must be one of model, int8, fp8, got 'int4'" in \
        capsys.readouterr().err
    if argv == ["eval"]:
        assert main(["eval", "--methods", "spd", "--dataset", "heldout", "--limit", "1",
                     "--draft-weights", "int8"]) == 2
        assert "--draft-weights applies to a single run" in capsys.readouterr().err


def test_generate_builds_the_engine_with_the_flag(monkeypatch):
    import argparse

    import spd.model.loading as loading
    from spd.cli.generate import build_engine
    t = make_tiny_target(seed=2, vocab=16, layers=4)
    monkeypatch.setattr(loading, "load_target", lambda *a, **k: t)
    args = argparse.Namespace(model=None, device="cpu", dtype="float32", mode="spd", stages=2,
                              split=None, anchors=None, pdm=None, pdm_layers=None, lookup=None,
                              draft_weights="fp8")
    _, engine = build_engine(args)
    assert engine.pdm.draft_weights == "fp8"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_gpu_graphed_quantised_draft_step_matches_eager_and_is_lossless(kind):
    """The CUDA-graph draft step captures the quantised copies (Triton kernels: the CUDA ones
    refuse them); replays give the eager step's logits; a weight written in place between
    generations reaches the replays (the copies are remade into the same buffers)."""
    from spd.model.target import TargetModel

    cpu = make_tiny_target(seed=70, vocab=64, layers=4, model_type="qwen3")
    t = TargetModel(cpu.hf.to("cuda").bfloat16(), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=4, anchors=[0, 2, 3], draft_weights=kind)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    for rnd in range(2):
        runs = {}
        for graphs in (False, True):
            d = RecordingDrafter(eng.pdm, PROMPT + ar, 0.6, cuda_graphs=graphs)
            assert eng.generate(PROMPT, 40, drafter=d).token_ids == ar
            runs[graphs] = d
        assert runs[True].graphs is not None and runs[True].graphs.failed is None
        assert runs[True].graphs.replays > 0
        for a, b in zip(runs[False].logits, runs[True].logits):
            torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
        with torch.no_grad():
            eng.pdm.lm_head.weight.mul_(1.5)
