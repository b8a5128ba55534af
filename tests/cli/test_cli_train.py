"""`python -m spd train` for each method, on a tiny random model folder and cached features."""
import json

import pytest
import torch

from spd.cli import main


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from spd.model.loading import load_target, save_tiny_random_llama
    from spd.train.distill import extract_features
    root = tmp_path_factory.mktemp("cli-train")
    model_dir = save_tiny_random_llama(root / "model")
    t = load_target(str(model_dir))
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 500, (20 + i % 5,), generator=g).tolist() for i in range(20)]
    extract_features(t, seqs, [0, 1, 2, 3, 4], root / "feat", shard_tokens=200)
    return model_dir, root / "feat"


def _train(tiny_setup, out, *extra):
    model_dir, feat = tiny_setup
    return main(["train", "--model", str(model_dir), "--features", str(feat), "--out", str(out),
                 "--steps", "2", "--batch", "1", "--eval-every", "2", "--crop-len", "16",
                 "--draft-vocab-size", "64", *extra])


def test_train_each_method(tiny_setup, tmp_path, capsys):
    assert _train(tiny_setup, tmp_path / "spd", "--stages", "2") == 0
    c = json.loads((tmp_path / "spd" / "config.json").read_text())
    assert (c["n_stages"], c["num_layers"], c["features"], c["extra"]["method"]) == \
        (2, 2, "pre-step", "spd")

    # PPSD: the first stage's output only, drafting after each step, one layer
    assert _train(tiny_setup, tmp_path / "ppsd", "--stages", "2", "--method", "ppsd") == 0
    c = json.loads((tmp_path / "ppsd" / "config.json").read_text())
    assert (c["anchors"], c["features"], c["num_layers"], c["extra"]["method"]) == \
        ([0, 2], "post-step", 1, "ppsd")

    assert _train(tiny_setup, tmp_path / "eagle", "--method", "eagle3", "--draft-steps", "4",
                  "--ttt-steps", "2") == 0
    c = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert (c["method"], c["draft_steps"], c["extra"]["train"]["ttt_steps"]) == ("eagle3", 4, 2)

    # Warm start: a PDM for n=4 from the n=2 one copies the layers both share
    assert _train(tiny_setup, tmp_path / "warm", "--stages", "4",
                  "--init-from", str(tmp_path / "spd")) == 0
    assert "warm start from" in capsys.readouterr().out


def test_train_refuses_bad_combinations(tiny_setup, tmp_path, capsys):
    assert _train(tiny_setup, tmp_path / "e", "--method", "eagle3", "--pdm-layers", "2") == 2
    assert "PDM options" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "w", "--init-from", str(tmp_path / "nothing")) == 2
    assert "no model.safetensors" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "s", "--steps", "0") == 2
    assert _train(tiny_setup, tmp_path / "x", "--extra-features", str(tmp_path / "none")) == 2
    assert "no meta.json" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "k", "--data-skip", "-1") == 2
    assert "--data-skip" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "k", "--code-prompts", "-3") == 2
    assert "--code-prompts must be >= 0, got -3" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "f", "--stages", "2", "--fill-weights", "1,2,3") == 2
    assert "2 non-negative numbers" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "f", "--stages", "2", "--fill-weights", "a,b") == 2
    assert "comma-separated numbers" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "f", "--method", "eagle3", "--fill-weights", "1,1") == 2
    assert "PDM option" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "a", "--argmax-weight", "-0.5") == 2
    assert "--argmax-weight must be >= 0" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "a", "--method", "eagle3", "--argmax-weight", "1") == 2
    assert "PDM option" in capsys.readouterr().err


def test_train_refuses_before_building_data(tiny_setup, tmp_path, capsys):
    """A refused option or a bad value of the method's own is reported before any distillation
    data or feature cache is made (the --features folder stays absent)."""
    fresh = tmp_path / "fresh-features"
    for extra, message in ((("--pdm-layers", "2"), "PDM options"),
                           (("--feature-timing", "post-step"), "PDM options"),
                           (("--init-from", str(tmp_path)), "PDM options"),
                           (("--ttt-steps", "0"), "--ttt-steps must be >= 1, got 0")):
        assert _train(tiny_setup, tmp_path / "e", "--method", "eagle3", "--features",
                      str(fresh), *extra) == 2
        assert message in capsys.readouterr().err
        assert not fresh.exists() and not (tmp_path / "e").exists()


def test_train_draft_vocab_by_coverage(tiny_setup, tmp_path, capsys):
    from spd.model.loading import load_target
    from spd.train.distill import FeatureSet
    from spd.train.trainer import coverage_size
    model_dir, feat = tiny_setup
    t = load_target(str(model_dir))
    counts = FeatureSet(feat, t).argmax_counts(t.vocab_size)
    assert _train(tiny_setup, tmp_path / "c", "--stages", "2",
                  "--draft-vocab-coverage", "0.5") == 0  # capped by _train's size 64
    c = json.loads((tmp_path / "c" / "config.json").read_text())
    assert c["draft_vocab_size"] == min(64, coverage_size(counts, 0.5))
    assert _train(tiny_setup, tmp_path / "c", "--draft-vocab-coverage", "1.5") == 2
    assert "--draft-vocab-coverage must lie in (0, 1]" in capsys.readouterr().err
    assert _train(tiny_setup, tmp_path / "e", "--method", "eagle3",
                  "--draft-vocab-coverage", "0.9") == 2
    assert "PDM option" in capsys.readouterr().err


def test_train_with_fill_and_argmax_weights(tiny_setup, tmp_path):
    assert _train(tiny_setup, tmp_path / "fw", "--stages", "2", "--fill-weights", "3,1",
                  "--argmax-weight", "0.5") == 0
    c = json.loads((tmp_path / "fw" / "config.json").read_text())
    assert c["extra"]["train"]["fill_weights"] == [3.0, 1.0]
    assert c["extra"]["train"]["argmax_weight"] == 0.5
    assert c["extra"]["train"]["precision"] in ("fp32", "bf16")  # 'auto' resolved and recorded
    assert _train(tiny_setup, tmp_path / "bf", "--stages", "2", "--precision", "bf16") == 0
    c = json.loads((tmp_path / "bf" / "config.json").read_text())
    assert c["extra"]["train"]["precision"] == "bf16"


def test_fill_level_sampling_follows_the_weights():
    import random

    from spd.errors import SPDError
    from spd.train.trainer import TrainConfig, sample_fill
    rng = random.Random(0)
    cfg = TrainConfig(fill_weights=[4, 2, 1, 1])
    counts = [0] * 5
    for _ in range(8000):
        counts[sample_fill(rng, 4, cfg)] += 1
    assert counts[0] == 0
    for k, share in zip(range(1, 5), (0.5, 0.25, 0.125, 0.125)):
        assert abs(counts[k] / 8000 - share) < 0.02, counts
    default = TrainConfig()  # the paper's rule: full half the time, else uniform below n
    counts = [0] * 5
    for _ in range(8000):
        counts[sample_fill(rng, 4, default)] += 1
    assert abs(counts[4] / 8000 - 0.5) < 0.02 and all(abs(c / 8000 - 1 / 6) < 0.02
                                                      for c in counts[1:4])
    assert sample_fill(rng, 1, default) == 1
    with pytest.raises(SPDError, match="not all zero"):
        sample_fill(rng, 2, TrainConfig(fill_weights=[0, 0]))


def test_train_on_extra_feature_folders(tiny_setup, tmp_path):
    from spd.model.loading import load_target
    from spd.train.distill import extract_features
    model_dir, _ = tiny_setup
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 500, (24,), generator=g).tolist() for _ in range(6)]
    extract_features(load_target(str(model_dir)), seqs, [0, 1, 2, 3, 4], tmp_path / "more",
                     shard_tokens=200)
    assert _train(tiny_setup, tmp_path / "o", "--stages", "2", "--extra-features",
                  str(tmp_path / "more")) == 0
    c = json.loads((tmp_path / "o" / "config.json").read_text())
    held_out = c["extra"]["train"]["eval_sequences"]  # the last ones of --features, cropped
    total = sum(20 + i % 5 for i in range(20)) + 6 * 24  # both folders' tokens
    assert c["extra"]["train_tokens"] == total - held_out * 16
