"""`spd eval`: decode prompt sets with SPD and report N, K, alpha, speedup, acceptance.

Each prompt's first turn is wrapped in the chat template and decoded. With `check=True` (the
default at T=0) every SPD output is compared token for token with the autoregressive path, and a
mismatch is an error. Results are aggregated per dataset (sums of N and K, so alpha = sum N /
sum K) and overall.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tqdm import tqdm

from spd.data.datasets import load_dataset, load_question_file
from spd.errors import InternalError, SPDError
from spd.model.loading import describe_device
from spd.runtime import metrics
from spd.runtime.types import SamplingParams


def encode_question(tokenizer, question: dict) -> list[int]:
    """A question's first turn in the chat template: what every evaluation decodes."""
    from spd.model.prompt import encode_prompt
    return encode_prompt(tokenizer, question["turns"][0], chat=True)


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first index where two token lists differ (their common length when one is a prefix
    of the other), None when equal: what a losslessness failure reports."""
    if expected == got:
        return None
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                min(len(expected), len(got)))


def result_row(question: dict, res) -> dict:
    """One decoded prompt's counts, as every evaluation records them."""
    st = res.stats
    return {"id": question["id"], "category": question.get("category", ""), "N": st.N,
            "K": st.K, "judged": st.drafts_judged,
            "accepted": st.drafts_accepted, "lookup_judged": st.lookup_judged,
            "lookup_accepted": st.lookup_accepted, "decode_s": st.decode_s,
            "draft_s": st.phase_s.get("draft", 0.0), "draft_calls": st.draft_calls,
            "new_tokens": len(res.token_ids),
            "by_position": {str(k): list(v) for k, v in st.by_position.items()}}


_SUMMED = ("N", "K", "judged", "accepted", "decode_s", "draft_s", "draft_calls", "new_tokens")
_SUMMED_IF_THERE = ("lookup_judged", "lookup_accepted")  # absent from older grid.json rows


def add_totals(rows: list[dict]) -> dict:
    """Sums over `result_row`s, or over totals of several sets (their prompt counts added),
    with the judged/accepted counts by draft position merged."""
    tot = {k: sum(r[k] for r in rows) for k in _SUMMED}
    tot.update({k: sum(r.get(k, 0) for r in rows) for k in _SUMMED_IF_THERE})
    tot["prompts"] = sum(r.get("prompts", 1) for r in rows)
    by_pos: dict = {}
    for r in rows:
        for p, (j, a) in r["by_position"].items():
            cell = by_pos.setdefault(str(p), [0, 0])
            cell[0] += j
            cell[1] += a
    tot["by_position"] = dict(sorted(by_pos.items(), key=lambda kv: int(kv[0])))
    return tot


def summarise(rows: list[dict], n: int) -> dict:
    t = add_totals(rows)
    in_vocab = sum(r["in_vocab"] for r in rows)
    return {"prompts": t["prompts"], "n": n, "N": t["N"], "K": t["K"],
            "alpha": metrics.alpha(t["N"], t["K"]),
            "theoretical_speedup": metrics.theoretical_speedup(t["N"], t["K"], n),
            "acceptance_rate": metrics.rate(t["accepted"], t["judged"]),
            "decode_tok_s": metrics.tokens_per_s(t["N"], t["decode_s"]),
            "draft_vocab_coverage": metrics.rate(in_vocab, t["new_tokens"]),
            # judged drafts that came from the context lookup (spd.draft.lookup), and their acceptance
            "lookup_share": metrics.rate(t["lookup_judged"], t["judged"]),
            "lookup_acceptance": metrics.rate(t["lookup_accepted"], t["lookup_judged"])}


class ReferenceStore:
    """Autoregressive reference outputs kept on disk between evaluations (`spd eval --ar-cache`):
    one greedy AR decode per prompt serves every drafter compared on it. An entry is keyed by the
    target's fingerprint, dtype and device type, the kernel backend setting, the prompt's ids,
    the token budget and the sampling parameters, so it is only reused for the same decode."""

    def __init__(self, folder):
        self.folder = Path(folder)

    def _path(self, engine, ids: list[int], max_new_tokens: int, sampling) -> Path:
        from spd_kernels.env import BACKEND
        t = engine.target
        key = json.dumps([t.fingerprint(), str(t.dtype), t.device.type, BACKEND.get(),
                          list(ids), max_new_tokens, sampling.temperature, sampling.top_k,
                          sampling.top_p, sampling.seed])
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def reference(self, engine, ids: list[int], max_new_tokens: int, sampling) -> list[int]:
        from spd.data.files import write_text_atomic
        path = self._path(engine, ids, max_new_tokens, sampling)
        if path.exists():
            try:
                return json.loads(path.read_text())["token_ids"]
            except (ValueError, KeyError, OSError):
                pass  # unreadable: decode again and rewrite it
        ref = engine.generate_ar(ids, max_new_tokens, sampling).token_ids
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({"token_ids": ref}))
        return ref


def run_eval(engine, sets: dict[str, list[dict]], max_new_tokens: int, sampling: SamplingParams,
             check: bool, progress: bool = True, references: ReferenceStore | None = None
             ) -> dict:
    target = engine.target
    tok = target.tokenizer
    vocab = set(engine.pdm.draft_to_target.tolist()) if engine.pdm is not None else set()
    report = {"config": {"n": engine.n, "split": engine.layout.split,
                         "anchors": list(engine.layout.anchors),
                         "pdm": getattr(engine, "pdm_source", "untrained"),
                         "pdm_layers": engine.pdm.config.num_layers if engine.pdm else 0,
                         "draft_weights": getattr(engine.pdm, "draft_weights", None),
                         "tree_width": getattr(engine, "tree_width", 1),
                         "max_new_tokens": max_new_tokens, "temperature": sampling.temperature,
                         "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
                         "checked_against_ar": check,
                         "ar_reference": "decoded" if references is None else "cache",
                         "lookup": getattr(getattr(engine, "drafter", None), "lookup", 0),
                         "device": describe_device(target.device)},
              "datasets": {}}
    all_rows = []
    total = sum(len(v) for v in sets.values())
    bar = tqdm(total=total, desc="eval", unit="prompt", disable=not progress)
    for name, questions in sets.items():
        rows = []
        for q in questions:
            ids = encode_question(tok, q)
            res = engine.generate(ids, max_new_tokens, sampling)
            if check:
                ref = (references.reference(engine, ids, max_new_tokens, sampling) if references
                       else engine.generate_ar(ids, max_new_tokens, sampling).token_ids)
                if ref != res.token_ids:
                    raise InternalError("SPD output differs from the autoregressive output",
                                        dataset=name, prompt=q["id"],
                                        first_difference=first_difference(ref, res.token_ids))
            in_vocab = sum(t in vocab for t in res.token_ids)
            rows.append(result_row(q, res) | {"in_vocab": in_vocab})
            bar.update(1)
            bar.set_postfix(alpha=f"{summarise(rows, engine.n)['alpha']:.3f}")
        report["datasets"][name] = summarise(rows, engine.n) | {"per_prompt": rows}
        all_rows += rows
    bar.close()
    report["overall"] = summarise(all_rows, engine.n)
    categories = sorted({r["category"] for r in all_rows if r["category"]})
    if len(categories) > 1:  # e.g. heldout's chat, code, math, multilingual
        report["by_category"] = {c: summarise([r for r in all_rows if r["category"] == c],
                                              engine.n) for c in categories}
    return report


def format_table(report: dict) -> str:
    hdr = (f"{'dataset':<12}{'prompts':>8}{'N':>7}{'K':>7}{'alpha':>8}{'S_theory':>10}"
           f"{'accept':>8}{'tok/s':>8}{'vocab cov':>10}{'lookup':>8}{'lk acc':>8}")
    lines = [hdr, "-" * len(hdr)]
    rows = list(report["datasets"].items())
    rows += [(f"  {c}", s) for c, s in report.get("by_category", {}).items()]
    for name, s in rows + [("overall", report["overall"])]:
        lines.append(f"{name:<12}{s['prompts']:>8}{s['N']:>7}{s['K']:>7}{s['alpha']:>8.3f}"
                     f"{s['theoretical_speedup']:>10.2f}{s['acceptance_rate']:>8.2f}"
                     f"{s['decode_tok_s']:>8.1f}{s['draft_vocab_coverage']:>10.2f}"
                     f"{s['lookup_share']:>8.2f}{s['lookup_acceptance']:>8.2f}")
    return "\n".join(lines)


def collect_sets(datasets: list[str], prompts_file: str | None, limit: int | None) -> dict:
    sets = {}
    if prompts_file:
        sets[Path(prompts_file).stem] = load_question_file(prompts_file)
    for name in datasets:
        sets[name] = load_dataset(name)
    if limit is not None:
        if limit < 1:
            raise SPDError(f"--limit must be >= 1, got {limit}")
        sets = {k: v[:limit] for k, v in sets.items()}
    if not sets:
        raise SPDError("nothing to evaluate: give --dataset and/or --prompts")
    return sets


def write_json(report: dict, path) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1))
    except OSError as exc:
        raise SPDError(f"cannot write --json-out {path}: {exc.strerror or exc}") from exc


__all__ = ["ReferenceStore", "add_totals", "collect_sets", "encode_question", "format_table", "result_row",
           "run_eval", "summarise", "write_json"]
