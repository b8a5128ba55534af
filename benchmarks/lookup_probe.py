"""Which context-lookup rule to use: replay SPD with the PDM alone and score alternatives.

Decodes prompts with the PDM alone (`lookup=0`) and, for every draft that gets judged, records
the PDM's token and top probability, the context lookup's proposal at each match length, and the
token the target committed there. A rule "use the lookup's token when its match is >= K tokens"
is then scored by the fraction of judged drafts it gets right, and that acceptance a by the
steady-state estimate S = n / (1 + (1 - a)(n - 1)) (each rejection costs n - 1 refill cycles).
The estimate ignores that a better drafter changes which drafts get judged; `spd eval --lookup K`
measures the real figure. Choose K on prompts you do not report (e.g. --offset 5 --limit 5).
It also prints, per match length, how often the lookup was right where it disagreed with the
PDM: the table `spd.draft.lookup.TRUST` gates on (re-measure it for another target or n).

The cycle decides on the device (spd.runtime.drafting); this probe reads on the host what it
needs: each draft as it is made (Drafting.draft, wrapped: the PDM's token, the tokens before
the drafted position, the committed count), the lookup's proposal there from a host index
(spd.draft.lookup.NgramLookup) and, after each decode, the committed tokens. The judged draft of
a position is the last one made for it (a position is drafted again only after its earlier
draft died, and never once it is committed).

    python benchmarks/lookup_probe.py --stages 4 --offset 5 --limit 5 --json-out probe.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from spd.draft.drafters import top_probability
from spd.draft.lookup import DEFAULT_MIN_LEN, MAX_LEN, NgramLookup
from spd.evaluation.evaluate import collect_sets, encode_question
from spd.model.loading import describe_device, load_target
from spd.runtime.drafting import Drafting
from spd.runtime.engine import SPDEngine
from spd.runtime.types import SamplingParams


class _Recorder:
    """Wraps Drafting.draft to log each draft with what the host sees then (restored by
    close()); `decode` keeps the judged ones."""

    def __init__(self):
        self.judged: list[dict] = []
        self.last_p = 0.0  # the PDM's top probability of the latest draft step
        self._drafts: dict[int, dict] = {}  # position -> its latest draft, this decode
        self._index = NgramLookup(1, MAX_LEN)
        self._draft = Drafting.draft
        rec = self

        def draft(drafting, newest, start, occ, extra, uniform, committed):
            children = rec._draft(drafting, newest, start, occ, extra, uniform, committed)
            tokens, position, c = drafting.seq.tokens, int(newest) + 1, int(committed)
            index = rec._index  # the committed tokens
            index.extend(tokens[len(index):c].tolist())
            found = index.propose(index.context(tokens[c:position].tolist()))
            rec._drafts[position] = {"pdm": int(children.tok[0]), "p": rec.last_p,
                                     "lookup": found[0] if found else None,
                                     "match": found[1] if found else 0,
                                     "fill": int(newest - start + 1),
                                     "context": tokens[max(0, position - 8):position].tolist()}
            return children

        Drafting.draft = draft

    def decode(self, engine: SPDEngine, ids: list[int], max_new_tokens: int) -> None:
        """One greedy decode; its judged drafts onto `judged`."""
        self._drafts, self._index = {}, NgramLookup(1, MAX_LEN)
        res = engine.generate(ids, max_new_tokens, SamplingParams())
        tokens = list(ids) + list(res.token_ids)
        for position in range(len(ids) + 1, len(tokens)):  # every one judged (the first: not)
            d = self._drafts.get(position)
            if d is not None:
                true = tokens[position]
                self.judged.append(dict(d, true=true, accepted=d["pdm"] == true))

    def close(self):
        Drafting.draft = self._draft


def score(judged: list[dict], n: int, rules: dict) -> dict:
    out = {}
    for name, use in rules.items():
        right = sum((j["lookup"] if j["lookup"] is not None and use(j) else j["pdm"]) == j["true"]
                    for j in judged)
        a = right / len(judged) if judged else 0.0
        out[name] = {"acceptance": a, "S_estimate": n / (1 + (1 - a) * (n - 1))}
    return out


def calibrate(judged: list[dict]) -> dict:
    """Per match length: how often the lookup's token was right where it differed from the
    PDM's (what spd.draft.lookup.TRUST holds for the default model)."""
    out = {}
    for k in range(1, MAX_LEN + 1):
        d = [j for j in judged if j["match"] == k and j["lookup"] != j["pdm"]]
        if d:
            out[str(k)] = {"drafts": len(d),
                           "hit_rate": sum(j["lookup"] == j["true"] for j in d) / len(d)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--pdm", default=None, help="PDM folder (default: the shipped one)")
    ap.add_argument("--datasets", default="mt_bench,humaneval")
    ap.add_argument("--offset", type=int, default=0, help="skip this many prompts of each set")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--dump-judged", default=None,
                    help="also write every judged draft (with its last 8 context tokens) here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t = load_target(None)
    engine = SPDEngine(t, n_stages=args.stages, pdm=args.pdm, lookup=0)
    sets = collect_sets(args.datasets.split(","), None, args.offset + args.limit)
    sets = {k: v[args.offset:] for k, v in sets.items()}
    rec = _Recorder()
    # the PDM's top probability for each draft, taken where the drafter computes its logits
    real_logits = engine.drafter.draft_logits

    def logits_and_p(*a, **k):
        logits = real_logits(*a, **k)
        rec.last_p = float(top_probability(logits))
        return logits
    engine.drafter.draft_logits = logits_and_p
    per_set, t0 = {}, time.time()
    try:
        for name, questions in sets.items():
            start = len(rec.judged)
            for q in questions:
                rec.decode(engine, encode_question(t.tokenizer, q), args.max_new_tokens)
            per_set[name] = rec.judged[start:]
    finally:
        rec.close()
    rules = {"PDM alone": lambda j: False}
    rules.update({f"lookup, match >= {k}": (lambda k: lambda j: j["match"] >= k)(k)
                  for k in range(1, 5)})
    # what the drafter does: a match of >= DEFAULT_MIN_LEN tokens, gated by the PDM's
    # confidence against spd.draft.lookup.TRUST
    rules["gated (shipped)"] = lambda j: (j["match"] >= DEFAULT_MIN_LEN
                                          and j["p"] < NgramLookup.trust(j["match"]))
    report = {"stages": args.stages, "pdm": engine.pdm_source, "offset": args.offset,
              "limit": args.limit, "max_new_tokens": args.max_new_tokens,
              "device": describe_device(t.device),
              "seconds": time.time() - t0,
              "rules": {name: score(j, args.stages, rules) for name, j in
                        list(per_set.items()) + [("overall", sum(per_set.values(), []))]},
              "judged": {name: len(j) for name, j in per_set.items()},
              "trust": calibrate(sum(per_set.values(), []))}
    print(f"{'rule':<22}" + "".join(f"{name:>22}" for name in report["rules"]))
    for rule in rules:
        print(f"{rule:<22}" + "".join(
            f"{r[rule]['acceptance']:>12.3f} S~{r[rule]['S_estimate']:>5.2f}   "
            for r in report["rules"].values()))
    print("lookup hit rate where it disagreed with the PDM (spd.draft.lookup.TRUST), by match length:")
    for k, c in report["trust"].items():
        print(f"  {k}: {c['hit_rate']:.2f} of {c['drafts']}  "
              f"(TRUST {NgramLookup.trust(int(k)):.2f})")
    if args.dump_judged:
        with open(args.dump_judged, "w") as f:
            json.dump(per_set, f)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
