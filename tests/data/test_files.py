"""Atomic writes with the umask's permissions, and training checkpoints that load no code."""
import os
import stat

import pytest
import torch

from spd.data.files import atomic_write, save_safetensors, write_text_atomic
from spd.errors import SPDError
from spd.train.loop import load_state


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_get_the_umask_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        save_safetensors({"w": torch.randn(3)}, tmp_path / "m.safetensors")
        write_text_atomic(tmp_path / "c.json", "{}")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "m.safetensors") == 0o644  # safetensors' save_file gives 0600
    assert _mode(tmp_path / "c.json") == 0o644
    from safetensors.torch import load_file
    assert load_file(tmp_path / "m.safetensors")["w"].shape == (3,)


def test_an_interrupted_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "state.pt"
    target.write_bytes(b"previous")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target) as f:
            f.write(b"half of the new")
            raise KeyboardInterrupt  # a kill mid-write
    assert target.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["state.pt"]  # no temporary file left behind


class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # what a malicious pickle does: run code on load
        return (open, (self.path, "w"))


def test_a_checkpoint_with_code_in_it_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "evil": _Marker(str(marker))}, tmp_path / "train_state.pt")
    with pytest.raises(SPDError, match="other than tensors and plain values; it was not loaded"):
        load_state(tmp_path / "train_state.pt")
    assert not marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x00garbage"])
def test_an_empty_or_corrupt_checkpoint_is_a_clear_error(tmp_path, content):
    (tmp_path / "train_state.pt").write_bytes(content)
    with pytest.raises(SPDError, match="not a readable training checkpoint"):
        load_state(tmp_path / "train_state.pt")


def test_a_real_checkpoint_round_trips(tmp_path):
    import random
    state = {"step": 3, "model": {"w": torch.randn(2)}, "rng": random.Random(1).getstate(),
             "torch_rng": torch.get_rng_state(), "order": [1, 2], "history": [{"loss": 1.0}],
             "config": {"lr": 1e-3, "split": None, "features": "pre-step"}}
    with atomic_write(tmp_path / "train_state.pt") as f:
        torch.save(state, f)
    back = load_state(tmp_path / "train_state.pt")
    assert back["step"] == 3 and back["rng"] == state["rng"] and back["config"] == state["config"]


def test_a_saved_drafter_is_readable_by_others(tmp_path):
    """PDM checkpoints were written 0600 (safetensors' save_file): others on a shared machine
    could not load them."""
    from conftest import make_tiny_target

    from spd import SPDEngine
    eng = SPDEngine(make_tiny_target(vocab=16, max_pos=32), n_stages=2)
    old = os.umask(0o022)
    try:
        eng.pdm.save(tmp_path / "pdm")
    finally:
        os.umask(old)
    files = list((tmp_path / "pdm").iterdir())
    assert files and {_mode(p) for p in files} == {0o644}
