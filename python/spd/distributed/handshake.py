"""The handshake: every rank describes its run and all must agree with rank 0 before any message."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spd.distributed.config import DistConfig, role_of
from spd.distributed.transport import Runtime
from spd.errors import SPDError
from spd.model.partition import DepthLayout


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as f:
        if size <= 256 << 20:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:  # large files: head, tail and size
            h.update(f.read(8 << 20))
            f.seek(size - (8 << 20))
            h.update(f.read())
    return h.hexdigest()[:16]


def pdm_digest(pdm) -> str | None:
    if pdm is None or pdm == "untrained":  # rank 0 resolves these the same way everywhere
        return None
    folder = Path(pdm).expanduser()
    files = [folder / "config.json", folder / "model.safetensors"]
    if not all(f.exists() for f in files):
        return f"missing: {folder}"
    return "+".join(file_digest(f) for f in files)


def rank_info(rank: int, world: int, config: DistConfig, target, layout: DepthLayout) -> dict:
    from spd.version import __version__
    return {"rank": rank, "world_size": world, "spd_version": __version__,
            "n_stages": layout.n, "draft_on_stage": config.draft_on_stage,
            "stage_split": layout.split, "anchors": list(layout.anchors),
            "target_fingerprint": target.fingerprint(), "target_name": target.name,
            "dtype": str(target.dtype), "pdm": pdm_digest(config.pdm),
            "pdm_path": str(config.pdm) if config.pdm else None}


_CHECKED = (("world_size", "world size"), ("spd_version", "spd version"),
            ("n_stages", "number of stages"), ("draft_on_stage", "draft's stage"),
            ("stage_split", "stage split"),
            ("anchors", "anchor layers"), ("target_fingerprint", "target model"),
            ("dtype", "model dtype"), ("pdm", "PDM checkpoint"))


def check_handshake(infos: list[dict]) -> None:
    """Every rank must describe the same run as rank 0; raise SPDError naming the first that does not."""
    ref = infos[0]
    for info in infos[1:]:
        for key, what in _CHECKED:
            if info[key] != ref[key]:
                r = info["rank"]
                extra = ""
                if key == "target_fingerprint":
                    extra = f" (rank {r} loaded {info['target_name']}, rank 0 {ref['target_name']})"
                elif key == "pdm":
                    extra = f" (rank {r}: {info['pdm_path']}, rank 0: {ref['pdm_path']})"
                raise SPDError(f"rank {r} ({role_of(r)}) disagrees with rank 0 on the {what}: "
                               f"{info[key]!r} vs {ref[key]!r}{extra}. Every rank must be started "
                               "with the same model files, PDM checkpoint and stage options")


def exchange_info(rt: Runtime, info: dict) -> list[dict]:
    rt.store.set(f"hello/{rt.rank}", json.dumps(info))
    return [json.loads(rt.store.get(f"hello/{r}")) for r in range(rt.world)]
