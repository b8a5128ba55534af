"""--model org/name: found in the local Hugging Face cache (offline), or a clear error naming the
cache searched. The cache here is a fake one built in tmp_path (HF_HUB_CACHE)."""
import shutil

import pytest

from spd.errors import SPDError
from spd.model.hub import looks_like_repo_id
from spd.model.loading import load_target, resolve_model_path, save_tiny_random_llama

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_random_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_folder):
    """A cache holding acme/tiny-llama at COMMIT, laid out as huggingface_hub writes it."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_folder, repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_repo_id_loads_from_the_cache(hf_cache, tiny_folder):
    folder = resolve_model_path("acme/tiny-llama")
    assert folder == hf_cache / "models--acme--tiny-llama" / "snapshots" / COMMIT
    t = load_target("acme/tiny-llama")
    ref = load_target(str(tiny_folder))
    assert t.fingerprint() == ref.fingerprint()


def test_an_absent_repo_id_names_the_cache_searched(hf_cache):
    with pytest.raises(SPDError, match="acme/other: not a local folder, and not in the Hugging "
                       "Face cache") as err:
        load_target("acme/other")
    assert str(hf_cache) in str(err.value) and "huggingface-cli download" in str(err.value)


def test_a_local_folder_named_like_a_repo_id_wins(hf_cache, tmp_path, monkeypatch, tiny_folder):
    shutil.copytree(tiny_folder, tmp_path / "acme" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("acme/tiny-llama").resolve() == tmp_path / "acme" / "tiny-llama"


@pytest.mark.parametrize("text,expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("Qwen/Qwen3-0.6B", True),
    ("/abs/path", False), ("./rel/x", False), ("a/b/c", False), ("name", False),
    ("../up", False), ("~/models/x", False), ("org/", False),
])
def test_what_looks_like_a_repo_id(text, expected):
    assert looks_like_repo_id(text) is expected
