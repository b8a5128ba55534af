"""The plain-decoding speed a one-process SPD run is read against.

In one process the stages run one after another, so SPD's tok/s there is not what n devices give,
and a newcomer would read it against nothing. `--mode ar` runs record their speed per (model,
device, dtype) in $SPD_CACHE/plain-decoding.json; the SPD summary names the last one, and what
S_theory means.
"""
from __future__ import annotations

import json
from datetime import date

from spd.data.assets import cache_dir
from spd.data.files import write_text_atomic
from spd.errors import SPDError

FILE = "plain-decoding.json"


def _key(target, device: str) -> str:
    return f"{target.name}|{device}|{str(target.dtype).replace('torch.', '')}"


def _read() -> dict:
    try:
        data = json.loads((cache_dir() / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record(target, device: str, tok_s: float) -> None:
    """Keep an AR run's decode speed; a cache that cannot be written is no error here."""
    data = _read()
    data[_key(target, device)] = {"tok_s": round(tok_s, 2), "date": str(date.today())}
    try:
        write_text_atomic(cache_dir() / FILE, json.dumps(data, indent=1))
    except (OSError, SPDError):
        pass


def _plain(target, device: str) -> tuple[str, float | None]:
    """(what the last `--mode ar` run here measured, in words; its tok/s or None)."""
    last = _read().get(_key(target, device))
    if isinstance(last, dict) and "tok_s" in last and "date" in last:
        return (f"plain decoding (--mode ar) ran at {last['tok_s']:.1f} tok/s here on "
                f"{last['date']}", float(last["tok_s"]))
    return "plain decoding was not measured here yet (run with --mode ar)", None


def explain(target, device: str, n: int) -> str:
    """The line printed under a one-process SPD summary."""
    plain, _ = _plain(target, device)
    return (f"[spd] one process: the {n} stages ran one after another, so decode tok/s is not "
            f"what pipelining gives; {plain}; S_theory is the speedup {n + 1} devices ({n} stages "
            f"+ 1 draft) would give")


def explain_distributed(target, device: str, stats) -> str:
    """The line printed under a distributed SPD summary: the measured cycle and tok/s beside
    the last plain decoding measured on this device (one process, the whole model)."""
    d = stats.distributed
    plain, ar = _plain(target, device)
    ratio = f" ({stats.decode_tok_s / ar:.2f}x)" if ar else ""
    return (f"[spd] distributed: measured cycle "
            f"{d['cycle_ms']['median']:.2f} ms (median of {d['cycles']}), "
            f"{stats.decode_tok_s:.1f} tok/s{ratio}; {plain}")
