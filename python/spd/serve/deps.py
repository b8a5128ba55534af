"""The server's optional dependencies, checked once with a message that says how to get them."""
from __future__ import annotations

from spd.errors import SPDError


def require_serve_deps() -> None:
    """SPDError naming the install command when fastapi or uvicorn is missing."""
    missing = []
    for name in ("fastapi", "uvicorn"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise SPDError(f"`spd serve` needs {' and '.join(missing)}: pip install 'spd[serve]'")
