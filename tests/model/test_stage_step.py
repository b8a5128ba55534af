"""The stage step on spd_kernels (spd_kernels.stage_step via spd.model.target.Stage) against Hugging
Face's own forward: every family, chunks and single rows, across truncations with poisoned tails;
the cache's device length as the position; packing; refusals; and, on a GPU, graph replays."""
import pytest
import torch
from conftest import make_tiny_target, needs_gpu, needs_triton_interpreter

from spd.errors import InternalError, SPDError
from spd.model.layers import pack_layer_
from spd.model.partition import partition_layers
from spd.model.target import Stage
from spd_kernels import use_backend
from spd_kernels.qkv_rope import back_to_back

VOCAB = 48


def _randomised(model_type, seed):
    """A tiny target whose biases and norm weights are random too (HF initialises them to 0/1)."""
    t = make_tiny_target(seed=seed, vocab=VOCAB, layers=4, model_type=model_type)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in t.hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    return t


def _randomised_on_gpu(model_type, seed):
    from spd.model.target import TargetModel
    cpu = _randomised(model_type, seed)
    return TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)


def _graphed_and_eager(t, capacity):
    """Two one-stage pipelines over every layer: graphed (on a GPU) and eager."""
    return (Stage(t, 0, range(t.num_layers), capacity=capacity, poison=True),
            Stage(t, 0, range(t.num_layers), capacity=capacity, poison=True, cuda_graphs=False))


def _hf_states(t, ids):
    with torch.no_grad():
        return t.hf(ids[None], output_hidden_states=True)


def _walk(t, stages, ids, g):
    """Prefill a random chunk, then random chunks / single rows with random truncations; after
    each step compare the rows just computed with Hugging Face's forward over the sequence."""
    length = int(torch.randint(3, 9, (), generator=g))
    pos = 0
    checked = 0
    while length <= ids.numel():
        rows = length - pos
        h = t.embed_tokens(ids[pos:length])
        seen = {}
        for st in stages:
            h = st.forward(h, pos, lambda i, x: seen.__setitem__(i, x.clone()))
        ref = _hf_states(t, ids[:length])
        for layer_out in range(1, t.num_layers):  # HF's last hidden state is after the norm
            torch.testing.assert_close(seen[layer_out], ref.hidden_states[layer_out][0, pos:],
                                       rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(t.logits(h), ref.logits[0, pos:].float(), rtol=1e-4,
                                   atol=1e-4)
        checked += rows
        if float(torch.rand((), generator=g)) < 0.4 and length > 2:  # a rollback
            back = int(torch.randint(1, min(4, length - 1) + 1, (), generator=g))
            length -= back
            for st in stages:
                st.cache.truncate(length)
        pos = length
        step = 1 if float(torch.rand((), generator=g)) < 0.7 else int(
            torch.randint(2, 5, (), generator=g))
        length = pos + step
    return checked


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_stage_step_equals_hugging_face_across_truncations(model_type):
    t = _randomised(model_type, seed=7)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (40,), generator=g)
    stages = [Stage(t, i, r, capacity=48, poison=True)
              for i, r in enumerate(partition_layers(t.num_layers, 2, [1, 3]))]
    assert _walk(t, stages, ids, g) >= 40
    if model_type == "qwen2":
        assert stages[0].weights.layers[0].qkv_bias is not None


@needs_triton_interpreter
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_triton_stage_step_equals_hugging_face(model_type):
    """Every op of the step on its Triton kernel (the interpreter): same rows as HF."""
    t = _randomised(model_type, seed=8)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, VOCAB, (14,), generator=g)
    stages = [Stage(t, 0, range(t.num_layers), capacity=16, poison=True)]
    with use_backend("triton"):
        _walk(t, stages, ids, g)


def test_the_device_length_is_the_position_a_graphed_step_reads():
    """The graphed step's body (run eagerly here) sets the cache's device length to its device
    position, writes there and advances it; a lower position is a truncation."""
    t = _randomised("qwen3", seed=9)
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    ref = _hf_states(t, ids)
    st = Stage(t, 0, range(t.num_layers), capacity=16, poison=True)
    st.forward(t.embed_tokens(ids[:8]), 0)
    st.cache.truncate(5)
    outs = []
    for p in range(5, 12):
        pos = torch.tensor([p])
        outs.append(st._device_step(t.embed_tokens(ids[p:p + 1]), pos)[-1].clone())
    assert st.cache.lengths.tolist() == [12] * t.num_layers
    torch.testing.assert_close(t.logits(torch.cat(outs)), ref.logits[0, 5:].float(), rtol=1e-4,
                               atol=1e-4)


def test_layers_are_packed_once_without_changing_the_model():
    t = make_tiny_target(seed=4, model_type="qwen2")
    a, m = t.layers[0].self_attn, t.layers[0].mlp
    assert back_to_back(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight) is not None
    assert back_to_back(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias) is not None
    assert back_to_back(m.gate_proj.weight, m.up_proj.weight) is not None
    before = [p.data_ptr() for p in t.hf.parameters()]
    pack_layer_(t.layers[0])  # packed already: nothing moves
    assert [p.data_ptr() for p in t.hf.parameters()] == before
    fresh = make_tiny_target(seed=4, model_type="qwen2")
    for (name, p), q in zip(t.hf.named_parameters(), fresh.hf.parameters()):
        assert torch.equal(p, q), name


def test_layers_the_stage_step_does_not_compute_are_refused():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from spd.model.target import TargetModel
    base = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    for extra, match in ((dict(hidden_act="gelu"), "hidden_act='gelu'"),
                         (dict(attention_bias=True), "bias on o_proj"),
                         (dict(mlp_bias=True), "bias on gate_proj")):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**base, **extra))
        with pytest.raises(SPDError, match=match):
            TargetModel(hf, None, name="odd")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_gpu_stage_graph_replays_equal_the_eager_step(model_type):
    """Graph replays at every position across rollbacks equal the eager kernel step, bit for bit,
    and a replay makes no host synchronisation."""
    t = _randomised_on_gpu(model_type, seed=10)
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).cuda()
    graphed, eager = _graphed_and_eager(t, capacity=48)
    for st in (graphed, eager):
        st.forward(t.embed_tokens(ids[:6]), 0)
    pos = 6
    for p in range(6, 40):
        if p % 7 == 0:  # a rollback of 2
            pos -= 2
            for st in (graphed, eager):
                st.cache.truncate(pos)
        x = t.embed_tokens(ids[pos:pos + 1])
        want = eager.forward(x, pos)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = graphed.forward(x, pos).clone()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), p
        pos += 1
    assert graphed.graphs.failed is None and graphed.graphs.replays > 20



def _verify_walk(t, last, plain, ids, *, sync_check=False):
    """Single rows through the last stage's fused step + verify and through the same layers'
    plain step, with rollbacks: equal outputs, and the verdict on a draft that is the plain
    output's argmax every other row (another token otherwise). Returns the accepted count."""
    for st in (last, plain):
        st.forward(t.embed_tokens(ids[:6]), 0)
    pos, accepted = 6, 0
    for p in range(6, ids.numel()):
        if p % 5 == 0:  # a rollback of 2
            pos -= 2
            for st in (last, plain):
                st.cache.truncate(pos)
        x = t.embed_tokens(ids[pos:pos + 1])
        want = plain.forward(x, pos).clone()
        best = t.logits(want).argmax(-1)
        draft = best if p % 2 else (best + 1) % VOCAB
        if sync_check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            outs, (token, ok) = last.run(x, pos, draft)
            out, token, ok = outs[-1].clone(), token.clone(), ok.clone()
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(out, want), p
        assert token.dtype == torch.int64 and token.tolist() == best.tolist(), p
        assert ok.tolist() == [bool(p % 2)], p
        accepted += int(ok[0])
        pos += 1
    return accepted


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_last_stage_judges_with_the_stage_output(model_type):
    """Stage.run with a draft: the stage's output and, from it, final norm + LM head + argmax and
    the verdict on the draft, across rollbacks; only the last stage may judge."""
    t = _randomised(model_type, seed=13)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(14))
    first, last = (Stage(t, i, r, capacity=32, poison=True)
                   for i, r in enumerate(partition_layers(t.num_layers, 2, [1, 3])))
    plain = Stage(t, 1, last.layer_ids, capacity=32, poison=True)
    with pytest.raises(InternalError, match="only the last stage can verify"):
        first.run(t.embed_tokens(ids[:1]), 0, ids[:1])
    # the last stage alone: embeddings stand in for stage 0's output
    assert _verify_walk(t, last, plain, ids) == 9


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_gpu_fused_last_stage_graph_replays_without_host_sync(model_type):
    """On a GPU the fused step + verify replays as one graph with no host synchronisation, and
    equals the eager plain step across rollbacks."""
    t = _randomised_on_gpu(model_type, seed=15)
    ids = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(6)).cuda()
    last, plain = _graphed_and_eager(t, capacity=40)
    assert _verify_walk(t, last, plain, ids, sync_check=True) == 12
    assert last.verify_graphs.failed is None and last.verify_graphs.replays > 15
