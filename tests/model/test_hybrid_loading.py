"""Hybrid target folders (Qwen3.5 text, its vision-language form, Qwen3-Next) load as
TargetModels whose stages reproduce the Hugging Face model; fingerprints tell them apart."""
import pytest
import torch

from spd.model.loading import load_target, save_tiny_random_hybrid
from spd.model.partition import DepthLayout
from spd.model.target import Stage


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    return {name: save_tiny_random_hybrid(root / name, mt, vision=vision)
            for name, mt, vision in (("qwen3_5", "qwen3_5", False),
                                     ("qwen3_5_vl", "qwen3_5", True),
                                     ("qwen3_next", "qwen3_next", False))}


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_vl", "qwen3_next"])
def test_hybrid_folder_loads_and_stages_match(folders, name):
    t = load_target(str(folders[name]))
    assert t.hybrid and t.norm_offset == 1.0
    layout = DepthLayout.build(t.num_layers, 3)
    assert layout.anchors[0] == 0 and layout.anchors[-1] <= t.num_layers
    stages = [Stage(t, i, r, capacity=24, poison=True, max_rollback=3)
              for i, r in enumerate(layout.stages)]
    ids = torch.randint(0, t.vocab_size, (10,), generator=torch.Generator().manual_seed(2))
    h = t.embed_tokens(ids[:7])
    for st in stages:
        h = st.forward(h, 0)
    outs = [h]
    for p in range(7, 10):
        h = t.embed_tokens(ids[p:p + 1])
        for st in stages:
            h = st.forward(h, p)
        outs.append(h)
    with torch.no_grad():
        ref = t.hf(ids[None]).logits[0].float()
    torch.testing.assert_close(t.logits(torch.cat(outs)), ref, rtol=1e-4, atol=1e-4)


def test_vision_language_form_is_its_text_model(folders):
    text, vl = load_target(str(folders["qwen3_5"])), load_target(str(folders["qwen3_5_vl"]))
    assert type(vl.hf).__name__ == "Qwen3_5ForCausalLM"
    assert len({text.fingerprint(), vl.fingerprint(),
                load_target(str(folders["qwen3_next"])).fingerprint()}) == 3


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_next"])
def test_cli_generates_from_a_hybrid_folder(folders, name, capsys):
    import json

    from spd.cli import main
    args = ["generate", "--model", str(folders[name]), "--stages", "2", "--prompt", "Hello",
            "--max-new-tokens", "8", "--json", "--no-chat"]
    assert main(args) == 0
    spd = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(args + ["--mode", "ar"]) == 0
    ar = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(spd["token_ids"]) == 8 and spd["token_ids"] == ar["token_ids"]


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_next"])
def test_a_part_of_a_hybrid_folder_is_its_stage(folders, name):
    """A rank's part (layers 2..3, no embedding), read in part: the same fingerprint and stage
    outputs as the whole model's."""
    whole = load_target(str(folders[name]))
    part = load_target(str(folders[name]), layers=range(2, 4), embed=False, tokenizer=False)
    assert part.fingerprint() == whole.fingerprint()
    assert part.hf.model.layers[0].input_layernorm.weight.is_meta
    h = torch.randn(5, whole.hidden_size, generator=torch.Generator().manual_seed(1))
    outs = [Stage(t, 1, range(2, 4), capacity=8).forward(h, 0) for t in (whole, part)]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
