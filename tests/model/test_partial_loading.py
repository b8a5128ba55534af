"""Loading a part of the target (a distributed rank's): only its tensors are read, they equal a
whole load's, the fingerprint is the whole model's; a whole load holds one copy of each weight."""
from __future__ import annotations

import shutil

import pytest
import torch

from spd.errors import SPDError
from spd.model.loading import _load_whole, load_target, resolve_model_path
from spd.model.target import TargetModel
from spd.model.weight_files import WeightFiles

PARTS = {  # what each kind of rank holds (n = 2 of a 4-layer model; stage 1 of 3 of 30 layers)
    "draft rank": dict(layers=range(0), embed=True, head=True),
    "stage 0": dict(layers=range(0, 2), embed=True, head=False),
    "middle stage": dict(layers=range(1, 3), embed=False, head=False),
    "last stage": dict(layers=range(2, 4), embed=False, head=False),
}


def _tiny_folder(root, model_type: str, tied: bool = False, bin_format: bool = False,
                 sharded: bool = False):
    """A random 4-layer model of that type with the default model's tokenizer files."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    cfg = cls(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              tie_word_embeddings=tied, head_dim=8)
    torch.manual_seed(1)
    folder = root / f"{model_type}{'-tied' if tied else ''}{'-bin' if bin_format else ''}"
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if sharded else {}))
    if bin_format:  # a pickle checkpoint, as older folders have (save_pretrained writes none)
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    src = resolve_model_path(None)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    return folder


@pytest.fixture(scope="module", params=["llama", "llama-tied", "llama-sharded", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    kind, _, variant = request.param.partition("-")
    return _tiny_folder(tmp_path_factory.mktemp("m"), kind, tied=variant == "tied",
                        sharded=variant == "sharded")


def _whole(folder, dtype=torch.float32) -> TargetModel:
    """The target as Hugging Face's from_pretrained loads it (the reference)."""
    return TargetModel(_load_whole(folder, "cpu", dtype).eval(), None, name=str(folder))


def _check_part(part: TargetModel, whole: TargetModel, layers, embed, head) -> None:
    held = dict(part.hf.named_parameters(remove_duplicate=False))
    for name, ref in whole.hf.named_parameters(remove_duplicate=False):
        p = held[name]
        if name.startswith("model.layers."):
            want = int(name.split(".")[2]) in layers
        elif name == "model.embed_tokens.weight":
            want = embed or (head and part.hf.lm_head.weight is part.embed.weight)
        else:  # final norm, LM head (a tied one is the embedding)
            want = head or (embed and p is part.embed.weight)
        assert p.is_meta != want, (name, want)
        if want:
            assert p.dtype == ref.dtype and torch.equal(p, ref), name
    for a, b in zip(part.hf.buffers(), whole.hf.buffers()):  # the rotary tables
        assert torch.equal(a, b)


@pytest.mark.parametrize("part", PARTS)
def test_a_part_holds_exactly_its_tensors_and_has_the_whole_models_fingerprint(
        tiny_folder, part, weight_reads):
    kw = PARTS[part]
    whole = _whole(tiny_folder)
    read, sampled = weight_reads
    t = load_target(str(tiny_folder), tokenizer=False, **kw)
    _check_part(t, whole, **kw)
    assert sorted(read) == sorted({n for n, p in t.hf.named_parameters() if not p.is_meta})
    assert t.fingerprint() == whole.fingerprint()
    # the fingerprint read only samples of the weights this part does not hold
    assert all(t.hf.get_parameter(k).is_meta for k in sampled)
    assert t.device == torch.device("cpu") and t.vocab_size == 96


def test_bf16_parts_match_bf16_whole_loads_and_keep_the_fingerprint(tiny_folder):
    whole = _whole(tiny_folder, torch.bfloat16)
    for kw in PARTS.values():
        t = load_target(str(tiny_folder), dtype="bf16", tokenizer=False, **kw)
        _check_part(t, whole, **kw)
        assert t.fingerprint() == whole.fingerprint() == _whole(tiny_folder).fingerprint()


@pytest.mark.slow
def test_default_model_parts_have_the_whole_models_fingerprint(default_target):
    whole = default_target.fingerprint()
    for kw in (dict(layers=range(0)), dict(layers=range(8, 16), embed=False, head=False),
               dict(layers=range(23, 30), embed=False, head=False)):
        t = load_target(None, tokenizer=False, **kw)
        assert t.fingerprint() == whole, kw
        held = sum(p.numel() for p in t.hf.parameters() if not p.is_meta)
        assert 0 < held < 0.3 * sum(p.numel() for p in default_target.hf.parameters())


def test_a_pickle_checkpoint_loads_whole_then_drops_the_rest_with_a_warning(tmp_path, capsys):
    folder = _tiny_folder(tmp_path, "llama", bin_format=True)
    whole = _whole(folder)
    kw = PARTS["middle stage"]
    t = load_target(str(folder), tokenizer=False, **kw)
    assert "cannot be read in part" in capsys.readouterr().err
    _check_part(t, whole, **kw)
    assert t.fingerprint() == whole.fingerprint()
    load_target(str(folder), tokenizer=False)  # a whole load needs no warning
    assert "cannot be read in part" not in capsys.readouterr().err


@pytest.mark.parametrize("layers", [range(2, 5), range(-1, 2), range(0, 4, 2), [0, 1]])
def test_layers_outside_the_model_are_refused(tiny_folder, layers):
    with pytest.raises(SPDError, match="not a block of the model's 4 layers"):
        load_target(str(tiny_folder), layers=layers, tokenizer=False)


def _storages(tensors) -> dict[int, int]:
    """Distinct storages (by address) -> their bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_whole_load_holds_one_copy_of_each_weight(tiny_folder, dtype):
    t = load_target(str(tiny_folder), dtype=dtype, tokenizer=False)
    files = WeightFiles(sorted(tiny_folder.glob("model*.safetensors")))
    stored = sum(e.numel for e in files.entries.values()) * dtype.itemsize
    params = list(t.hf.parameters())  # a tied head is listed once
    assert all(p.dtype == dtype for p in params)
    # no storage beyond the parameters' bytes (no file map, no unpacked originals, no copy)
    assert sum(_storages(params).values()) == sum(p.nbytes for p in params) == stored
    if t.config.tie_word_embeddings:
        assert t.lm_head.weight is t.embed.weight


@pytest.mark.slow
def test_the_engine_uses_the_targets_weights_without_copies(default_target):
    from spd import SPDEngine
    t = default_target
    params = list(t.hf.parameters())
    target_storages = _storages(params)
    assert sum(target_storages.values()) == sum(p.nbytes for p in params)
    engine = SPDEngine(t, n_stages=4, pdm="untrained", warn_untrained=False)
    engine.generate([1, 2, 3, 4], 4)
    stage_tensors = [w for st in engine._stages for lw in st.weights.layers
                     for w in vars(lw).values() if isinstance(w, torch.Tensor)]
    assert set(_storages(stage_tensors)) <= set(target_storages)  # views of the target's
    pdm = list(engine.pdm.parameters())
    assert not set(_storages(pdm)) & set(target_storages)
    # the PDM's head holds its draft rows only, no copy of the embedding or of the whole head
    vocab_rows = t.vocab_size * t.hidden_size
    assert all(p.numel() < vocab_rows for p in pdm)



def test_a_sharded_folder_reads_the_shards_its_index_names(tmp_path):
    folder = _tiny_folder(tmp_path, "qwen2", sharded=True)
    whole = _whole(folder)
    shutil.copy(sorted(folder.glob("model-*.safetensors"))[0], folder / "consolidated.safetensors")
    kw = PARTS["last stage"]
    t = load_target(str(folder), tokenizer=False, **kw)
    _check_part(t, whole, **kw)
    assert t.fingerprint() == whole.fingerprint()
    gone = sorted(folder.glob("model-*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(SPDError, match=f"names shards that are not there: {gone.name}"):
        load_target(str(folder), tokenizer=False, **kw)
