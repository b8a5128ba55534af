"""Writing files so that a reader never sees half of one.

`atomic_write` writes to a temporary file in the same folder, flushes it to disk and renames it
over the target: a kill mid-write leaves the previous file (or none), never a truncated one.
Files get the permissions of the umask, like any other file the user writes (safetensors'
`save_file` creates them 0600, unreadable by others on a shared machine, so weights go through
`save_safetensors` here instead).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator:
    """`with atomic_write(p) as f: f.write(...)`: p appears complete, or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_write(path, "w") as f:
        f.write(text)


def save_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """safetensors.torch.save_file, written atomically with the umask's permissions."""
    from safetensors.torch import save
    data = save(tensors, metadata=metadata)
    with atomic_write(path) as f:
        f.write(data)
