"""Loading a part of a hybrid target (Qwen3.5, its vision-language form, Qwen3-Next): only its
tensors are read (never the visual tower's), they equal Hugging Face's whole load, the
fingerprint is the whole model's; every weight is held once, the stage layout included (the
permuted q/k, the output gate, Qwen3-Next's reordered projections are the parameters' own rows,
not copies beside them)."""
from __future__ import annotations

import pytest
import torch

from spd.model.hybrid_layout import hf_rows
from spd.model.loading import _load_whole, load_target, save_tiny_random_hybrid
from spd.model.target import Stage, TargetModel
from spd.model.weight_files import WeightFiles

PARTS = {  # what each kind of rank holds (n = 2 of a 4-layer model)
    "draft rank": dict(layers=range(0), embed=True, head=True),
    "stage 0": dict(layers=range(0, 2), embed=True, head=False),
    "middle stage": dict(layers=range(1, 3), embed=False, head=False),
    "last stage": dict(layers=range(2, 4), embed=False, head=True),
}
FULL_FIRST = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
FOLDERS = {  # name -> (model type, vision form, layer types (None: the helper's linear-first))
    "qwen3_5": ("qwen3_5", False, None),
    "qwen3_5-full-first": ("qwen3_5", False, FULL_FIRST),
    "qwen3_5-vl": ("qwen3_5", True, FULL_FIRST),
    "qwen3_next": ("qwen3_next", False, FULL_FIRST),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-parts")
    return {name: save_tiny_random_hybrid(root / name, mt, vision=vision, layer_types=types)
            for name, (mt, vision, types) in FOLDERS.items()}


def _whole(folder, dtype=torch.float32) -> TargetModel:
    """The target as Hugging Face's from_pretrained loads it (the reference)."""
    return TargetModel(_load_whole(folder, "cpu", dtype).eval(), None, name=str(folder))


def _hf_layout(model, name: str, p: torch.Tensor) -> torch.Tensor:
    rows = hf_rows(model.get_submodule(name.rpartition(".")[0]))
    return p if rows is None or p.is_meta else p[rows]


def _wanted(name: str, layers, embed: bool, head: bool) -> bool:
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    return embed if name == "model.embed_tokens.weight" else head


def _check_part(part: TargetModel, whole: TargetModel, layers, embed, head) -> None:
    held = dict(part.hf.named_parameters(remove_duplicate=False))
    for name, ref in whole.hf.named_parameters(remove_duplicate=False):
        p, want = held[name], _wanted(name, layers, embed, head)
        assert p.is_meta != want, (name, want)
        if want:
            got, expected = _hf_layout(part.hf, name, p), _hf_layout(whole.hf, name, ref)
            assert p.dtype == ref.dtype and torch.equal(got, expected), name
    ref = dict(whole.hf.named_buffers())  # rotary tables; row orders of the layers held
    for name, b in part.hf.named_buffers():
        assert torch.equal(b, ref[name]), name


def _stored_names(part: TargetModel) -> set[str]:
    """The stored tensors of what the part holds (Qwen3-Next's experts: one per expert)."""
    names = set()
    for n, p in part.hf.named_parameters():
        if p.is_meta:
            continue
        key = part.weight_files.key(n)
        if key is None:  # a fused expert parameter
            prefix, _, attr = n.rpartition(".")
            projs = ("down_proj",) if attr == "down_proj" else ("gate_proj", "up_proj")
            names.update(part.weight_files.key(f"{prefix}.{e}.{x}.weight")
                         for e in range(p.shape[0]) for x in projs)
        else:
            names.add(key)
    return names


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_hybrid_part_holds_exactly_its_tensors_and_has_the_whole_models_fingerprint(
        folders, name, part, weight_reads):
    kw = PARTS[part]
    whole = _whole(folders[name])
    read, sampled = weight_reads
    t = load_target(str(folders[name]), tokenizer=False, **kw)
    _check_part(t, whole, **kw)
    assert len(read) == len(set(read)) and set(read) == _stored_names(t)
    assert not any(k.startswith("model.visual.") for k in read)
    assert t.fingerprint() == whole.fingerprint()
    # the fingerprint read only samples of weights this part does not hold
    by_key = {t.weight_files.key(n): p for n, p in t.hf.named_parameters()}
    assert sampled and all(by_key[k].is_meta for k in sampled)


@pytest.mark.parametrize("name", FOLDERS)
def test_bf16_hybrid_parts_match_bf16_whole_loads_and_keep_the_fingerprint(folders, name):
    whole = _whole(folders[name], torch.bfloat16)
    assert whole.fingerprint() == _whole(folders[name]).fingerprint()
    for kw in PARTS.values():
        t = load_target(str(folders[name]), dtype="bf16", tokenizer=False, **kw)
        _check_part(t, whole, **kw)
        assert t.fingerprint() == whole.fingerprint()


def _storages(tensors) -> dict[int, int]:
    """Distinct storages (by address) -> their bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _check_one_copy(t: TargetModel, stored_bytes: int | None = None) -> None:
    """The parameters' storages hold exactly their bytes (and the files' text model), and the
    stage weights are views of them: no permuted or reordered copy beside them. (Only the
    zero-centred norms' 1 + w vectors are the stage's own.)"""
    params = list(t.hf.parameters())
    target = _storages(params)
    assert sum(target.values()) == sum(p.nbytes for p in params)
    if stored_bytes is not None:
        assert sum(p.nbytes for p in params) == stored_bytes
    st = Stage(t, 0, range(t.num_layers), capacity=8, max_rollback=2)
    matrices = [w for lw in st.weights.layers
                for w in (*vars(lw).values(), *vars(lw.mlp).values())
                if isinstance(w, torch.Tensor) and w.dim() >= 2]
    assert set(_storages(matrices)) <= set(target)
    own = [w for lw in st.weights.layers for w in (*vars(lw).values(), *vars(lw.mlp).values())
           if isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() not in target]
    assert all(w.dim() == 1 for w in own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FOLDERS)
def test_a_whole_hybrid_load_holds_one_copy_of_each_weight(folders, name, dtype):
    t = load_target(str(folders[name]), dtype=dtype, tokenizer=False)
    files = WeightFiles(sorted(folders[name].glob("model*.safetensors")))
    text = [e for k, e in files.entries.items() if not k.startswith("model.visual.")]
    assert all(p.dtype == dtype for p in t.hf.parameters())
    _check_one_copy(t, sum(e.numel for e in text) * dtype.itemsize)
    assert any(hf_rows(m) is not None for m in t.hf.modules())  # rearranged in place, once


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_a_built_hybrid_model_is_rearranged_in_place(model_type, monkeypatch):
    """A target made from a model in memory (tests, factories): its layers put in the stage
    layout in place; Hugging Face's forward still gives its own outputs."""
    from conftest import make_tiny_hybrid

    import spd.model.target
    t = make_tiny_hybrid(seed=4, vocab=40, model_type=model_type, layer_types=FULL_FIRST)
    _check_one_copy(t)
    # the same model as Hugging Face built it (no TargetModel: not rearranged)
    monkeypatch.setattr(spd.model.target, "TargetModel", lambda model, **kw: model)
    fresh = make_tiny_hybrid(seed=4, vocab=40, model_type=model_type, layer_types=FULL_FIRST)
    assert not any(hf_rows(m) is not None for m in fresh.modules())
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(t.hf(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-6)
    # moved apart (as .to(device) does): a new target packs them again, not reordered twice
    for p in t.hf.parameters():
        p.data = p.data.clone()
    again = TargetModel(t.hf, None)
    _check_one_copy(again)
    assert again.fingerprint() == t.fingerprint()
    with torch.no_grad():
        torch.testing.assert_close(t.hf(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", FOLDERS)
def test_the_stages_of_hybrid_parts_equal_the_whole_loads(folders, name):
    whole = load_target(str(folders[name]), tokenizer=False)
    parts = [load_target(str(folders[name]), tokenizer=False, **PARTS[p])
             for p in ("stage 0", "last stage")]
    ids = torch.randint(0, whole.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    outs = {}
    for key, targets in (("whole", [whole, whole]), ("parts", parts)):
        stages = [Stage(t, i, r, capacity=16, max_rollback=2)
                  for i, (t, r) in enumerate(zip(targets, (range(0, 2), range(2, 4))))]
        got = []
        for pos, rows in ((0, 6), (6, 1), (7, 2)):
            h = targets[0].embed_tokens(ids[pos:pos + rows])
            for st in stages:
                h = st.forward(h, pos)
            got.append(targets[1].logits(h))
        outs[key] = torch.cat(got)
    torch.testing.assert_close(outs["parts"], outs["whole"], rtol=0, atol=0)


def test_a_pickle_hybrid_checkpoint_loads_whole_then_drops_the_rest(folders, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file
    src = folders["qwen3_5-full-first"]
    folder = shutil.copytree(src, tmp_path / "bin")
    (folder / "model.safetensors").unlink()
    torch.save(load_file(src / "model.safetensors"), folder / "pytorch_model.bin")
    whole = _whole(src)
    kw = PARTS["middle stage"]
    t = load_target(str(folder), tokenizer=False, **kw)
    assert "cannot be read in part" in capsys.readouterr().err
    _check_part(t, whole, **kw)
    assert t.fingerprint() == whole.fingerprint()
