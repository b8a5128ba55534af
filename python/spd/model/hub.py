"""Models named by Hugging Face repo id ("org/name"), found in the local Hugging Face cache.

Offline only: spd never downloads a model on its own (the default model aside); a repo id that
is not in the cache is an error naming the cache folder searched and the command that fills it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from spd.errors import SPDError

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]$")


def looks_like_repo_id(text: str) -> bool:
    """"org/name", as the Hub spells repo ids (a relative path of two parts looks the same:
    the caller tries the folder first)."""
    return bool(_REPO_ID.match(text)) and ".." not in text


def hub_cache_dir() -> Path:
    """The Hugging Face cache, as huggingface_hub finds it (read at each call, so a changed
    HF_HUB_CACHE / HF_HOME takes effect)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return Path(home).expanduser() / "hub"


def resolve_repo_id(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of `repo_id` (its main revision unless `revision`)."""
    cache = hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise SPDError(f"--model {repo_id}: not a local folder, and finding a Hugging Face repo "
                       "id needs the huggingface_hub package (pip install huggingface_hub)") \
            from None
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                   local_files_only=True)
    except Exception as exc:  # LocalEntryNotFoundError, a malformed repo id or cache entry
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SPDError(f"--model {repo_id}: not a local folder, and not in the Hugging Face "
                       f"cache {cache} ({why}); download it first (huggingface-cli download "
                       f"{repo_id}) or pass a local folder") from None
    return Path(folder)
