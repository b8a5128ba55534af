"""Writing files so that a reader never sees half of one, and refusing files that are half.

`atomic_write` writes to a temporary file in the same folder, flushes it to disk and renames it
over the target: a kill mid-write leaves the previous file (or none), never a truncated one.
`build_folder_once` does the same for a folder built on first use, under a file lock, so two
processes starting at once build it once. Files get the permissions of the umask, like any
other file the user writes (safetensors' `save_file` creates them 0600, unreadable by others on
a shared machine, so weights go through `save_safetensors` here instead).

`check_safetensors` and `read_json_object` turn a truncated, empty or corrupt file into an
SPDError naming it, before anything is built from it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

from spd.errors import SPDError


def _temp_name(path: Path, suffix: str) -> Path:
    """A hidden name next to `path`, unique per process and call."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "wb") -> Iterator:
    """`with atomic_write(p) as f: f.write(...)`: p appears complete, or not at all."""
    path = Path(path)
    tmp = _temp_name(path, "tmp")
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


@contextlib.contextmanager
def file_lock(path: str | Path, what: str = "") -> Iterator[None]:
    """An exclusive flock on `path` (created if missing) for the `with` block; says so on stderr
    when another process holds it. The lock goes with the process, however it ends."""
    path = Path(path)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[spd] waiting for another process {what or 'holding ' + str(path)}",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_folder_once(final: str | Path, build: Callable[[Path], None],
                      complete: Callable[[Path], bool], what: str = "") -> Path:
    """`final`, made by `build(tmp)` in a temporary folder next to it and renamed into place,
    unless `complete(final)` already holds. Under a lock file beside it, so concurrent first
    uses build it once; the others wait and reuse it. An incomplete `final` (left by an older
    version, or damaged) is rebuilt; temporary folders of builds that were killed are removed."""
    final = Path(final)
    if complete(final):
        return final
    with file_lock(final.with_name(f".{final.name}.lock"), f"building {what or final}"):
        if complete(final):  # built by the process we waited for
            return final
        for old in [*final.parent.glob(f".{final.name}.*.partial"),
                    final.with_name(final.name + ".partial")]:  # (the latter: older versions)
            shutil.rmtree(old, ignore_errors=True)
        tmp = _temp_name(final, "partial")
        tmp.mkdir()
        try:
            build(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def read_json_object(path: str | Path, what: str = "") -> dict:
    """A JSON file holding an object, as a dict; SPDError naming the file otherwise."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SPDError(f"{label} is not valid JSON ({exc})") from exc
    except OSError as exc:
        raise SPDError(f"cannot read {label}: {exc.strerror or exc}") from exc
    if not isinstance(value, dict):
        raise SPDError(f"{label} holds a JSON {type(value).__name__}, not an object")
    return value


def check_safetensors(path: str | Path) -> None:
    """Refuse a file that is not a complete safetensors file: empty, a bad header, or shorter
    than the tensors its header lists (a truncated copy or download). Reads the header only."""
    read_safetensors_header(path)


def read_safetensors_header(path: str | Path) -> tuple[int, dict]:
    """(header length n, header) of a complete safetensors file (check_safetensors' checks):
    the tensors' data starts at byte 8 + n, each at its `data_offsets` from there."""
    path = Path(path)

    def bad(why: str):
        return SPDError(f"{path} is not a readable safetensors file ({why}): replace it with a "
                        "complete copy")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("empty" if size == 0 else f"only {size} bytes")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise bad(f"truncated or corrupt: its header claims {n} bytes, the file has "
                          f"{size}")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as exc:
        raise SPDError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad("its header is not JSON") from exc
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    try:
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"],
                  default=0)
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        raise bad(f"a tensor entry of its header is malformed ({exc})") from exc
    if 8 + n + end > size:
        raise bad(f"truncated: its tensors need {8 + n + end} bytes, the file has {size}")
    return n, header


def check_output_file(path: str | Path, flag: str) -> None:
    """Refuse, before any work is done, an output path that cannot be written: a folder, or one
    below an existing file."""
    path = Path(path)
    if path.is_dir():
        raise SPDError(f"{flag} {path} is a folder; give a file name")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise SPDError(f"{flag} {path} cannot be written: {parent} is a file, not a "
                               "folder")
            break
