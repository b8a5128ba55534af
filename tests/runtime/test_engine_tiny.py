"""Engine behaviour on tiny random targets: losslessness, accounting, bad input (the cycle
against the reference decoder, wherever the stages run: test_cycle.py)."""
import pytest
import torch
from conftest import make_tiny_target

from spd import SamplingParams, SPDEngine
from spd.draft.drafters import ReferenceDrafter
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_greedy_lossless_untrained_pdm_and_accounting(n):
    t = make_tiny_target(seed=10 + n, vocab=48, layers=4)
    eng = SPDEngine(t, n_stages=n)
    ar = eng.generate_ar(PROMPT, 30)
    res = eng.generate(PROMPT, 30)
    assert res.token_ids == ar.token_ids
    st = res.stats
    assert st.N == len(res.token_ids) - 1 and st.drafts_judged == st.N
    # Cycles: n-1 fill, then every rejection but possibly the last costs n-1 refill cycles.
    rejects = st.drafts_judged - st.drafts_accepted
    assert st.N + (n - 1) * rejects <= st.K <= st.N + (n - 1) * (rejects + 1)
    oracle = eng.generate(PROMPT, 30, drafter=ReferenceDrafter(PROMPT + ar.token_ids))
    assert oracle.token_ids == ar.token_ids
    assert oracle.stats.K == oracle.stats.N + n - 1 and oracle.stats.acceptance_rate == 1.0


def test_eos_stops_generation():
    t = make_tiny_target(seed=1, vocab=32)
    eng = SPDEngine(t, n_stages=2)
    ar = eng.generate_ar(PROMPT, 30).token_ids
    eos = ar[5]
    t.eos_token_ids = {eos}
    cut = ar[:ar.index(eos) + 1]
    assert eng.generate_ar(PROMPT, 30).token_ids == cut
    assert eng.generate(PROMPT, 30).token_ids == cut
    assert eng.generate(PROMPT, 30, drafter=ReferenceDrafter(PROMPT + ar)).token_ids == cut


def test_sampling_is_reproducible_with_seed():
    t = make_tiny_target(seed=2, vocab=32)
    eng = SPDEngine(t, n_stages=3)
    sp = SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=7)
    a = eng.generate(PROMPT, 20, sp).token_ids
    b = eng.generate(PROMPT, 20, sp).token_ids
    c = eng.generate(PROMPT, 20, SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=8))
    assert a == b and a != c.token_ids


# --- bad input -----------------------------------------------------------------------------
def test_bad_prompts():
    t = make_tiny_target(max_pos=32)
    eng = SPDEngine(t, n_stages=2)
    with pytest.raises(SPDError, match="prompt is empty"):
        eng.generate([], 4)
    with pytest.raises(SPDError, match="context is 32"):
        eng.generate(list(range(16)) * 2, 4)
    with pytest.raises(SPDError, match=r"must lie in \[0, 16\)"):
        eng.generate([1, 2, 99], 4)
    with pytest.raises(SPDError, match="positive integer"):
        eng.generate([1, 2], 0)
    with pytest.warns(UserWarning, match="exceeds the context"):
        out = eng.generate(list(range(16)) + list(range(14)), 10)
    assert len(out.token_ids) == 2


@pytest.mark.parametrize("prompt,msg", [
    ("hello world", "a text prompt needs the target.s tokenizer"),
    (b"hello", "the prompt is text"),
    (torch.tensor([[1, 2, 3], [4, 5, 0]]), r"one sequence: .*got shape \(2, 3\)"),
    (torch.tensor([[[1, 2]]]), r"got shape \(1, 1, 2\)"),
    ([[1, 2, 3], 4], "nested lists"),  # ([[1, 2, 3], [4, 5]]: two prompts, tests/runtime/test_batch.py)
    ([1, 2.5, 3], "non-integers"),
    ([1, True], "non-integers"),
    (torch.tensor([1.0, 2.0]), "integer tensor, got torch.float32"),
    (torch.tensor([True, False]), "integer tensor, got torch.bool"),
    ({1, 2}, "got set"),
])
def test_batched_text_and_non_integer_prompts_are_refused_not_flattened(prompt, msg):
    eng = SPDEngine(make_tiny_target(max_pos=32), n_stages=2)
    for generate in (eng.generate, eng.generate_ar):
        with pytest.raises(SPDError, match=msg):
            generate(prompt, 4)


def test_one_row_prompt_tensor_is_that_sequence():
    eng = SPDEngine(make_tiny_target(max_pos=32), n_stages=2)
    flat = eng.generate(PROMPT, 6).token_ids
    assert eng.generate(torch.tensor([PROMPT]), 6).token_ids == flat
    assert eng.generate(torch.tensor(PROMPT, dtype=torch.int32), 6).token_ids == flat
    assert eng.generate(tuple(PROMPT), 6).token_ids == flat


@pytest.mark.parametrize("kwargs,msg", [
    (dict(n_stages=5), "cannot cut a 4-layer model into 5 stages"),
    (dict(n_stages=2, split=[3, 2]), "sums to 5"),
    (dict(n_stages=2, anchors=[0, 9]), "out of range"),
    (dict(n_stages=2, anchors=[2, 3]), "start with 0"),
])
def test_bad_configuration(kwargs, msg):
    with pytest.raises(SPDError, match=msg):
        SPDEngine(make_tiny_target(), **kwargs)


def test_bad_sampling_params():
    with pytest.raises(SPDError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=2.0)
    with pytest.raises(SPDError, match="temperature"):
        SamplingParams(temperature=-0.5)


def test_pdm_checkpoint_mismatches(tmp_path):
    t = make_tiny_target(seed=0)
    eng = SPDEngine(t, n_stages=2, anchors=[0, 2, 3])
    eng.pdm.save(tmp_path / "pdm")
    # Round trip into the same target and layout.
    again = SPDEngine(t, n_stages=2, anchors=[0, 2, 3], pdm=tmp_path / "pdm")
    for (k, a), (_, b) in zip(eng.pdm.state_dict().items(), again.pdm.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(SPDError, match="n=2 stages but n=4"):
        SPDEngine(t, n_stages=4, anchors=[0, 2, 3], pdm=tmp_path / "pdm")
    with pytest.raises(SPDError, match="anchors"):
        SPDEngine(t, n_stages=2, anchors=[0, 1, 3], pdm=tmp_path / "pdm")
    with pytest.raises(SPDError, match="split"):
        SPDEngine(t, n_stages=2, split=[1, 3], anchors=[0, 2, 3], pdm=tmp_path / "pdm")
    with pytest.raises(SPDError, match="trained on another target"):
        SPDEngine(make_tiny_target(seed=1), n_stages=2, anchors=[0, 2, 3], pdm=tmp_path / "pdm")
    with pytest.raises(SPDError, match="vocab 16; this target .* vocab 32"):
        SPDEngine(make_tiny_target(seed=0, vocab=32), n_stages=2, anchors=[0, 2, 3],
                  pdm=tmp_path / "pdm")
    with pytest.raises(SPDError, match="not found"):
        SPDEngine(t, n_stages=2, pdm=tmp_path / "missing")
    with pytest.raises(SPDError, match="n=2 stages but n=4"):
        PipelineDraftModule.load(tmp_path / "pdm", t, SPDEngine(t, n_stages=4).layout)


@pytest.mark.parametrize("n", [2, 3])
def test_bfloat16_target_greedy_spd_equals_its_own_ar_and_hf_generate(n):
    """--dtype bfloat16: SPD decodes exactly the bf16 target (its AR decode token for token, and
    Hugging Face's greedy generate of the same bf16 weights)."""
    from spd.model.target import TargetModel
    t = TargetModel(make_tiny_target(seed=5, vocab=64, layers=4).hf.to(torch.bfloat16), None,
                    name="tiny-bf16")
    assert t.dtype == torch.bfloat16 and t.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    eng = SPDEngine(t, n_stages=n)
    ar = eng.generate_ar(PROMPT, 40).token_ids
    hf = t.hf.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False)
    assert ar == hf[0, len(PROMPT):].tolist()
    for accuracy in (1.0, 0.5):
        drafter = ReferenceDrafter(PROMPT + ar, accuracy, seed=3)
        assert eng.generate(PROMPT, 40, drafter=drafter).token_ids == ar


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_gpu_ar_graph_and_spd_equal_hf_greedy(model_type):
    """On a GPU: the AR decode as one graph per token equals HF's greedy generate, and SPD over
    graphed stages with the fused last stage equals it too, across rejections."""
    from spd.model.target import TargetModel
    cpu = make_tiny_target(seed=6, vocab=64, layers=4, model_type=model_type)
    t = TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=2)
    ar = eng.generate_ar(PROMPT, 48).token_ids
    assert eng._ar.graphs is not None and eng._ar.graphs.failed is None
    hf = t.hf.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=48, do_sample=False)
    assert ar == hf[0, len(PROMPT):].tolist()
    for accuracy in (1.0, 0.5):
        res = eng.generate(PROMPT, 48, drafter=ReferenceDrafter(PROMPT + ar, accuracy, seed=2))
        assert res.token_ids == ar
    last = eng._stages[-1]
    assert last.verify_graphs.failed is None and last.verify_graphs.replays > 0


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stop_token_ids_end_the_decode_like_eos(n):
    """stop_token_ids: the decode ends at the first such token, which is kept; SPD (across
    rejections) and AR agree, and the finish reason says why the decode ended."""
    eng = SPDEngine(make_tiny_target(seed=2, vocab=32), n_stages=n)
    full = eng.generate_ar(PROMPT, 30)
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop_at = full.token_ids[7]
    cut = full.token_ids[:full.token_ids.index(stop_at) + 1]
    drafter = ReferenceDrafter(PROMPT + full.token_ids, 0.5, seed=4) if n > 1 else None
    for res in (eng.generate_ar(PROMPT, 30, stop_token_ids=[stop_at]),
                eng.generate(PROMPT, 30, drafter=drafter, stop_token_ids=[stop_at])):
        assert res.token_ids == cut and res.finish_reason == "stop"
    for bad, msg in (([40], r"must lie in \[0, 32\)"), ([1.5], "list of integer"),
                     (7, "list of integer")):
        with pytest.raises(SPDError, match=msg):
            eng.generate(PROMPT, 4, stop_token_ids=bad)
    with pytest.raises(SPDError, match="stop strings need the target's tokenizer"):
        eng.generate(PROMPT, 4, stop="x")
