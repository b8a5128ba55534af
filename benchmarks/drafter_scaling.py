"""The drafter's scaling curve: held-out acceptance and S_theory against training tokens.

Reads training runs (their history.json and config.json) and `spd eval --json-out` files on the
held-out prompts, prints one table and writes one JSON. Each point is a drafter; its tokens are
the ones it trained on in all (a warm start counts its source's tokens too, given with
--base-tokens). Columns: the run's own held-out estimate (`S_est`, from top-1 agreement by fill
level on held-out sequences of its data: spd.train.estimate) and the decoded figures on the
held-out prompts (S_theory and acceptance, PDM alone and with the context lookup).

The fit: the logit of the acceptance (PDM alone, decoded; and the run's estimate) as a line in
log2(tokens), so that a projection stays inside (0, 1); the projected acceptance gives S_theory
through the pipeline's refill arithmetic at uniform acceptance (spd.train.estimate). Projection
rows extrapolate the line and are labelled so: an extrapolation, not a measurement.

    python benchmarks/drafter_scaling.py --point v7=1740272:EVAL_ALONE:EVAL_LOOKUP \\
        --point runs/s1=+:EVAL_ALONE --base-tokens 1740272 --json-out FILE
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Table, run_meta, write_json  # noqa: E402


def _eval(path: str | None) -> dict:
    if not path:
        return {}
    o = json.loads(Path(path).read_text())["overall"]
    return {"S_theory": o["theoretical_speedup"], "acceptance": o["acceptance_rate"],
            "prompts": o["prompts"]}


def point(spec: str, base_tokens: int) -> dict:
    """NAME=TOKENS:ALONE[:LOOKUP] (a drafter given by its token count), or RUN=+:ALONE[:LOOKUP]
    (a training run folder: its own tokens plus --base-tokens)."""
    name, rest = spec.split("=", 1)
    tokens, alone, lookup = (rest.split(":") + [None, None])[:3]
    row = {"drafter": name}
    if tokens == "+":
        cfg = json.loads((Path(name) / "config.json").read_text())
        hist = json.loads((Path(name) / "history.json").read_text())
        row["new_tokens"] = cfg["extra"]["train_tokens"]
        row["tokens"] = base_tokens + row["new_tokens"]
        row["trained_tokens"] = sum(h["tokens"] for h in hist)  # windows actually seen
        last = next((h for h in reversed(hist) if "S_est" in h), {})
        row["S_est"] = last.get("S_est")
        row["est_accept"] = last.get("accept")
        row["drafter"] = Path(name).name
    else:
        row["tokens"] = int(tokens)
    a, lk = _eval(alone), _eval(lookup)
    row.update(S_alone=a.get("S_theory"), accept_alone=a.get("acceptance"),
               S_lookup=lk.get("S_theory"), accept_lookup=lk.get("acceptance"),
               prompts=a.get("prompts"))
    return row


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def fit(rows: list[dict], key: str) -> tuple[float, float] | None:
    """(a, b) of logit(row[key]) = a + b * log2(tokens), least squares."""
    pts = [(math.log2(r["tokens"]), _logit(r[key])) for r in rows
           if r.get(key) is not None and 0 < r[key] < 1]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / var if var else 0.0
    return my - b * mx, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", required=True)
    ap.add_argument("--base-tokens", type=int, default=0)
    ap.add_argument("--project", default="1e7,1e8,6e8",
                    help="token counts to extrapolate the fit to (labelled as such)")
    ap.add_argument("--json-out", required=True)
    args = ap.parse_args()
    rows = sorted((point(s, args.base_tokens) for s in args.point), key=lambda r: r["tokens"])
    table = Table([("drafter", "<24"), ("tokens", ">10.0f"), ("S_est", ">7.2f"),
                   ("S_alone", ">9.2f", "S alone"), ("accept_alone", ">11.2f", "acc alone"),
                   ("S_lookup", ">10.2f", "S lookup"), ("accept_lookup", ">12.2f", "acc lookup")])
    table.print_header()
    for r in rows:
        table.print(r)
    from spd.train.estimate import projected_alpha
    fits = {k: fit(rows, k) for k in ("accept_alone", "est_accept")}
    projections = []
    for k, ab in fits.items():
        if ab is None:
            continue
        a, b = ab
        print(f"fit logit({k}) = {a:.3f} + {b:.3f} * log2(tokens)")
        for t in (float(x) for x in args.project.split(",")):
            acc = 1 / (1 + math.exp(-(a + b * math.log2(t))))
            s_proj = {n: projected_alpha([acc] * n) * n for n in (4, 8)}
            projections.append({"metric": k, "tokens": t, "acceptance": acc,
                                "S_theory_n4": s_proj[4], "S_theory_n8": s_proj[8],
                                "label": "extrapolation of the fit, not a measurement"})
            print(f"  extrapolation, not a measurement: {k} at {t:.0e} tokens = {acc:.2f} "
                  f"(S_theory {s_proj[4]:.2f} at n = 4, {s_proj[8]:.2f} at n = 8, PDM alone)")
    write_json(args.json_out, run_meta("cpu", command=" ".join(sys.argv)), rows=rows,
               fits={k: v for k, v in fits.items() if v}, projections=projections)
    return 0


if __name__ == "__main__":
    sys.exit(main())
