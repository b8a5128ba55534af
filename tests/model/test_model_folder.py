"""A --model folder that is damaged or whose config.json lies is refused, naming the file."""
import json

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from spd.errors import SPDError
from spd.model.loading import load_target


@pytest.fixture
def model_dir(tmp_path):
    """A 4-layer random Llama (no tokenizer: every check here comes before it is read)."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def _edit_config(folder, **changes):
    c = json.loads((folder / "config.json").read_text())
    c.update(changes)
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("layers,msg", [
    (3, "unexpected 9 (model.layers.3."),  # a 30-layer model said to have 20
    (5, "missing 9 (model.layers.4."),     # ... or 34
])
def test_a_config_that_lies_about_the_layer_count_is_refused(model_dir, layers, msg):
    _edit_config(model_dir, num_hidden_layers=layers)
    with pytest.raises(SPDError, match="the weights do not match config.json") as err:
        load_target(str(model_dir))
    assert msg in str(err.value)


def test_weights_of_other_shapes_are_refused(model_dir):
    _edit_config(model_dir, intermediate_size=48)
    with pytest.raises(SPDError, match="the weights do not match config.json"):
        load_target(str(model_dir))


@pytest.mark.parametrize("text,msg", [
    ("{oops", "model config .*config.json is not valid JSON"),
    ("[]", "config.json holds a JSON list, not an object"),
])
def test_a_config_that_is_not_a_json_object_is_refused(model_dir, text, msg):
    (model_dir / "config.json").write_text(text)
    with pytest.raises(SPDError, match=msg):
        load_target(str(model_dir))


def test_a_folder_without_weights_is_refused(model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(SPDError, match="has no weights"):
        load_target(str(model_dir))


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b"", "empty"),
    (lambda b: b[:len(b) - 100], "truncated"),
    (lambda b: b"\xff" * 8 + b[8:], "truncated or corrupt"),
])
def test_damaged_weights_are_refused(model_dir, damage, msg):
    w = model_dir / "model.safetensors"
    w.write_bytes(damage(w.read_bytes()))
    with pytest.raises(SPDError, match=f"model.safetensors is not a readable safetensors file "
                                       f"\\(.*{msg}"):
        load_target(str(model_dir))


def test_the_cli_reports_a_damaged_model_in_one_line(model_dir, capsys):
    from spd.cli import main
    (model_dir / "model.safetensors").write_bytes(b"")
    assert main(["generate", "--prompt", "hi", "--model", str(model_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("spd: error: ") and "\n" not in err and "model.safetensors" in err


@pytest.mark.parametrize("device", ["banana", "meta", "cuda:x", "cpu:0"])
def test_a_bad_device_is_refused_by_the_api(model_dir, device):
    with pytest.raises(SPDError, match=f"--device must be cpu, cuda or cuda:N, got '{device}'"):
        load_target(str(model_dir), device=device)
