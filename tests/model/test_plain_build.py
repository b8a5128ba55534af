"""A stage rank's target built without transformers (spd.model.plain_build) equals the one built
by transformers bit for bit: config fields, rotary tables, stage outputs, KV cache, fingerprint;
configs it cannot build exactly fall back to transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spd.model.loading import load_target
from spd.model.plain_build import PlainCausalLM, read_plain_config
from spd.model.target import Stage

sys.path.insert(0, str(Path(__file__).parent))
from test_partial_loading import _tiny_folder  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROPES = {  # rope_scaling as config.json may give it (the legacy key, folded in by transformers)
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "linear": {"type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=["llama", "llama-tied", "qwen2", "qwen3", "llama-llama3",
                                        "llama-linear", "qwen2-dynamic"])
def folder(request, tmp_path_factory):
    kind, _, variant = request.param.partition("-")
    f = _tiny_folder(tmp_path_factory.mktemp("m"), kind, tied=variant == "tied")
    if variant in ROPES:
        _edit_config(f, rope_parameters=None, rope_scaling=ROPES[variant], rope_theta=5000.0)
    return f


def test_config_fields_are_transformers(folder):
    from transformers import AutoConfig
    hf = AutoConfig.from_pretrained(folder)
    plain = read_plain_config(folder)
    assert plain is not None
    for name in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "hidden_act",
                 "eos_token_id", "bos_token_id", "pad_token_id", "layer_types"):
        assert getattr(plain, name) == getattr(hf, name, None), name
    assert plain.head_dim == (getattr(hf, "head_dim", None)
                              or hf.hidden_size // hf.num_attention_heads)
    assert getattr(plain, "sliding_window") == getattr(hf, "sliding_window", None)
    for k, v in hf.rope_parameters.items():
        assert plain.rope_parameters[k] == v, k


@pytest.mark.parametrize("layers,embed,head", [(range(0, 2), True, False),
                                               (range(1, 3), False, False),
                                               (range(2, 4), False, True)])
def test_a_plain_stage_equals_the_transformers_one_bitwise(folder, layers, embed, head):
    kw = dict(layers=layers, embed=embed, head=head, tokenizer=False)
    plain, hf = load_target(str(folder), plain=True, **kw), load_target(str(folder), **kw)
    assert isinstance(plain.hf, PlainCausalLM) and not isinstance(hf.hf, PlainCausalLM)
    assert plain.fingerprint() == hf.fingerprint()
    assert plain.eos_token_ids == hf.eos_token_ids
    assert (plain.head_dim, plain.rms_eps, plain.max_context, plain.vocab_size) == \
        (hf.head_dim, hf.rms_eps, hf.max_context, hf.vocab_size)
    a, b = dict(plain.hf.named_parameters(remove_duplicate=False)), \
        dict(hf.hf.named_parameters(remove_duplicate=False))
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert p.is_meta == b[name].is_meta and p.dtype == b[name].dtype, name
        if not p.is_meta:
            assert torch.equal(p, b[name]), name
    # tables past the trained length too (dynamic NTK changes its frequencies there)
    for rows in (64, 300):
        for x, y in zip(plain.rope(0, rows), hf.rope(0, rows)):
            assert torch.equal(x, y)
    torch.manual_seed(0)
    hidden = torch.randn(7, plain.hidden_size)
    sp, sh = (Stage(t, 0, layers, 32, cuda_graphs=False) for t in (plain, hf))
    assert torch.equal(sp.forward(hidden, 0), sh.forward(hidden, 0))
    assert torch.equal(sp.forward(hidden[:2], 7), sh.forward(hidden[:2], 7))
    assert torch.equal(sp.cache.k, sh.cache.k) and torch.equal(sp.cache.v, sh.cache.v)
    if head:
        assert torch.equal(plain.logits(hidden), hf.logits(hidden))
        draft = torch.zeros(2, dtype=torch.int64)
        (outs_p, verdict_p), (outs_h, verdict_h) = (s.run(hidden[:2], 9, draft) for s in (sp, sh))
        for x, y in zip([outs_p[-1], *verdict_p], [outs_h[-1], *verdict_h]):
            assert torch.equal(x, y)
    if embed:
        ids = torch.tensor([1, 5, 7])
        assert torch.equal(plain.embed_tokens(ids), hf.embed_tokens(ids))


@pytest.mark.parametrize("change", [
    dict(model_type="mistral"),                          # another model type
    dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),  # a RoPE not computed here
    dict(partial_rotary_factor=0.5),                     # partial rotation
    dict(rope_scaling={"rope_type": "linear"}),          # no factor: transformers says why
    dict(hidden_size="32"),                              # a field of the wrong type
])
def test_what_it_cannot_build_exactly_is_left_to_transformers(tmp_path, change):
    folder = _tiny_folder(tmp_path, "llama")
    _edit_config(folder, **change)
    assert read_plain_config(folder) is None


def test_the_same_configs_are_refused(tmp_path):
    from spd.errors import SPDError
    folder = _tiny_folder(tmp_path, "qwen2")
    _edit_config(folder, use_sliding_window=True, sliding_window=16)
    with pytest.raises(SPDError, match="sliding-window attention is not supported"):
        load_target(str(folder), layers=range(1, 2), tokenizer=False, plain=True)
    _edit_config(folder, use_sliding_window=False, hidden_act="gelu")
    with pytest.raises(SPDError, match="hidden_act='gelu' is not supported"):
        load_target(str(folder), layers=range(1, 2), tokenizer=False, plain=True)
    folder = _tiny_folder(tmp_path / "b", "llama")
    _edit_config(folder, mlp_bias=True)  # the files then lack the biases: refused either way
    with pytest.raises(SPDError):
        load_target(str(folder), layers=range(1, 2), tokenizer=False, plain=True)


_STAGE_RANK = """
import json, sys, torch
from spd.distributed.config import DistConfig
from spd.distributed.rank import _load_own_part
from spd.model.target import Stage
rank, n = int(sys.argv[2]), int(sys.argv[3])
target = _load_own_part(DistConfig(n_stages=n, model=sys.argv[1], device="cpu"), [rank], "cpu")
from spd.model.partition import DepthLayout
layers = DepthLayout.build(target.num_layers, n, None, None).stages[rank - 1]
stage = Stage(target, rank - 1, layers, 32, cuda_graphs=False)
out = stage.forward(torch.randn(3, target.hidden_size), 0)
stage.cache.truncate(1)
target.fingerprint()
print(json.dumps([m for m in ("transformers", "triton", "torch._dynamo", "sympy")
                  if m in sys.modules]))
"""


@pytest.mark.parametrize("kind", ["llama-tied", "qwen3"])
def test_a_stage_rank_imports_neither_transformers_nor_triton(tmp_path, kind):
    model, _, variant = kind.partition("-")
    folder = _tiny_folder(tmp_path, model, tied=variant == "tied")
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'python'}:{REPO}")
    for rank in (1, 2):  # stage 0 (embedding) and the last stage (norm, head)
        out = subprocess.run([sys.executable, "-c", _STAGE_RANK, str(folder), str(rank), "2"],
                             capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert json.loads(out.stdout.splitlines()[-1]) == [], (rank, out.stdout)
