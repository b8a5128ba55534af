"""Corrupt or lying PDM checkpoint folders are refused with an SPDError naming the file."""
import json

import pytest
import torch
from conftest import make_tiny_target

from spd import SPDEngine
from spd.draft.pdm import PipelineDraftModule
from spd.errors import SPDError


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(vocab=16, max_pos=64)


@pytest.fixture
def pdm_dir(target, tmp_path):
    eng = SPDEngine(target, n_stages=2, pdm="untrained", warn_untrained=False)
    eng.pdm.save(tmp_path / "pdm")
    return tmp_path / "pdm"


def _load(folder, target):
    return SPDEngine(target, n_stages=2, pdm=str(folder))


def _edit_config(folder, **changes):
    path = folder / "config.json"
    c = json.loads(path.read_text())
    c.update(changes)
    path.write_text(json.dumps(c))


def test_a_good_checkpoint_loads(pdm_dir, target):
    assert _load(pdm_dir, target).pdm_source == str(pdm_dir)


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b"", "empty"),
    (lambda b: b[:len(b) // 2], "truncated"),
    (lambda b: b[:5], "only 5 bytes"),
    (lambda b: (10**9).to_bytes(8, "little") + b[8:], "truncated or corrupt"),
    (lambda b: b[:8] + b"#" * 16 + b[24:], "header is not JSON"),
])
def test_damaged_weights_are_refused(pdm_dir, target, damage, msg):
    w = pdm_dir / "model.safetensors"
    w.write_bytes(damage(w.read_bytes()))
    with pytest.raises(SPDError, match=f"model.safetensors is not a readable safetensors file "
                                       f"\\(.*{msg}"):
        _load(pdm_dir, target)


@pytest.mark.parametrize("text,msg", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    (b"\xff\xfe{}", "is not valid JSON"),
])
def test_a_config_that_is_not_a_json_object_is_refused(pdm_dir, target, text, msg):
    path = pdm_dir / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SPDError, match=msg) as err:
        _load(pdm_dir, target)
    assert "config.json" in str(err.value)


@pytest.mark.parametrize("changes,msg", [
    ({"num_heads": 8, "num_kv_heads": 2}, "weights of other shapes than config.json implies"),
    ({"head_dim": 4}, "weights of other shapes"),
    ({"draft_vocab_size": 12}, "weights of other shapes"),
    ({"num_layers": "2"}, "num_layers must be an integer >= 1, got '2'"),
    ({"num_layers": 2.5}, "num_layers must be an integer >= 1, got 2.5"),
    ({"num_layers": 0}, "num_layers must be an integer >= 1, got 0"),
    ({"num_heads": 3}, "must be a multiple of num_kv_heads"),
    ({"draft_vocab_size": 17}, "exceeds the target's vocabulary"),
])
def test_a_config_that_lies_is_refused(pdm_dir, target, changes, msg):
    _edit_config(pdm_dir, **changes)
    with pytest.raises(SPDError, match=msg):
        _load(pdm_dir, target)


def _rewrite_map(folder, ids):
    from safetensors.torch import load_file, save_file
    w = load_file(str(folder / "model.safetensors"))
    w["draft_to_target"] = torch.tensor(ids, dtype=torch.int64)
    save_file(w, str(folder / "model.safetensors"))


@pytest.mark.parametrize("fix,msg", [
    (lambda ids: ids[:-1] + [16], r"outside the target vocabulary \[0, 16\)"),
    (lambda ids: ids[:-1] + [-1], "outside the target vocabulary"),
    (lambda ids: ids[:-1] + [ids[0]], "1 duplicate target id"),
])
def test_a_bad_draft_to_target_map_is_refused(pdm_dir, target, fix, msg):
    """A repeated id gives one target token two draft rows: sampling would lose mass."""
    _rewrite_map(pdm_dir, fix(list(range(16))))
    with pytest.raises(SPDError, match=msg):
        _load(pdm_dir, target)
    with pytest.raises(SPDError, match=msg):  # also without a target
        PipelineDraftModule.load(pdm_dir)


def test_zero_pdm_layers_is_refused(target):
    with pytest.raises(SPDError, match="num_layers must be an integer >= 1, got 0"):
        SPDEngine(target, n_stages=2, pdm="untrained", pdm_layers=0, warn_untrained=False)


def test_the_cli_refuses_a_damaged_pdm_before_loading_the_model(pdm_dir, monkeypatch, capsys):
    import spd.model.loading as loading
    from spd.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the PDM was checked")
    monkeypatch.setattr(loading, "load_target", no_load)
    (pdm_dir / "model.safetensors").write_bytes(b"")
    assert main(["generate", "--prompt", "hi", "--pdm", str(pdm_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.safetensors is not a readable safetensors" in err
    (pdm_dir / "config.json").write_text("[]")
    prompts = pdm_dir.parent / "q.jsonl"
    prompts.write_text('{"turns": ["hi"]}\n')
    assert main(["eval", "--prompts", str(prompts), "--pdm", str(pdm_dir)]) == 2
    assert "config.json holds a JSON list, not an object" in capsys.readouterr().err


def test_an_untrained_pdm_does_not_depend_on_the_global_generator(target):
    """Every process builds the same untrained PDM (a distributed rank 0 and the one-process
    engine draft alike under seeded sampling), whatever torch's global generator holds."""
    from spd.model.partition import DepthLayout
    layout = DepthLayout.build(target.num_layers, 2)
    torch.manual_seed(1)
    a = PipelineDraftModule.untrained(target, layout)
    torch.manual_seed(2)
    b = PipelineDraftModule.untrained(target, layout)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
