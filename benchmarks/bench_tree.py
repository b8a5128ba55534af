"""Token trees (spd.runtime.drafting, in the one decode cycle: spd.runtime.cycle): the
acceptance a width-W tree buys, what W rows cost a stage.

Acceptance (counted, not timed). The single-process engine (spd.SPDEngine(target, n_stages=n,
tree_width=W), its shipped drafter for n) decodes the held-out prompts (spd.data.datasets
"heldout", first turn in the chat template as `spd eval` builds it; the set is only measured
here, never tuned on; --limit k takes them in turn from each category, so 12 are 3 each of
chat, code, math and multilingual) for every n in --stages, W in --widths and drafter in
--lookup: "gated lookup" is the engine's default (the context lookup competes with the PDM,
spd.draft.lookup), "PDM alone" sets `engine.drafter.lookup = 0`. Per (n, drafter, W), pooled over the prompts:

  alpha       sum N / sum K (N committed tokens, K cycles, refills included; DESIGN.md section 2)
  S_theory    n * alpha, the zero-draft-cost speedup; `x W=1` is it over the chain's at the same
              n and drafter
  accept      judged drafts accepted (sum accepted / sum judged; a tree position is one judgement)
  rows/st/cyc rows the stages computed per stage per cycle, sum stage_rows / (sum K * n): what a
              cycle's stage step costs in rows (a chain: at most 1; a tree: up to W)
  lossless    greedy only: prompts whose SPD tokens differ from plain AR decoding of the same
              target (spd.SPDEngine.generate_ar, decoded once per prompt and shared by every n
              and W); anything but 0 is a bug, and the count is printed, never hidden
Per-category S_theory (chat, code, math, multilingual) and per-prompt counts are in the JSON.
The JSON's decode seconds are wall-clock of this process running every stage one after the
other (eager on a CPU): not the pipeline's cycle time, which the stage step below prices.

Stage step (measured). One step of the largest stage of the uniform split at each n
(spd.model.partition.DepthLayout.build), on the target's own weights, after a prefill of
--context positions: the chain's one-row step (Stage.run at position context) against the tree
step (Stage.tree_run) of W rows at that position. The tree rows attend to the committed prefix
[0, context - (n - 1)) and, under the tree mask, to their own slot and n - 1 uncommitted
ancestors (the tree slots past the positions, as the runtime keeps them: parent of lane r is lane
r // 2 at the position before). --iters timed calls of each (default 20 on a CPU, 50 on a GPU)
in --rounds rounds (5) that time every step in turn, the figure the median of the rounds'
medians (on a shared machine a change of load falls on all steps alike): perf_counter on a CPU,
CUDA events with L2 flushed on a GPU. Rows are labelled
"measured (CPU, eager)" or "measured (GPU, eager)": both sides run eagerly; on a GPU (where a
decode replays its whole cycle, stage steps included, as one CUDA graph: spd.runtime.cycle_graph)
the chain's one-row step captured as its own graph is given beside it as `chain graph us`, and
the tree step captured with its position and prefix on the device as `tree graph us`, with
`graph_ratio` = tree graph / chain graph (or `tree_graph_error`: why it could not be
captured). `ratio` is t(W rows, tree step) /
t(1 row, chain step); `x tree1` is over the tree step's own one row.

    python benchmarks/bench_tree.py                                   # everything, CPU, slow
    python benchmarks/bench_tree.py --stages 4,8 --widths 1,2,4,8 --limit 12 \\
        --max-new-tokens 64 --json-out benchmarks/results/2026-12-04-tree-cpu.json
    TRITON_INTERPRET=0 python benchmarks/bench_tree.py --device cuda --limit 12 \\
        --max-new-tokens 64                                           # a GPU
    python benchmarks/bench_tree.py --quick                           # a check: seconds

--quick: 3 prompts, 16 new tokens, n = 2, widths 1, 2, the engine's drafter only, stage step
at 64 positions, 3 timed calls in one round (each can still be set by its own flag). Prints two tables and
writes JSON (default benchmarks/results/<date>-tree-<device>.json).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # harness, when loaded by path
from harness import (  # noqa: E402
    RESULTS,
    Table,
    Timer,
    add_device_args,
    device_setup,
    device_tag,
    run_meta,
    write_json,
)

from spd.model.loading import describe_device  # noqa: E402
from spd.model.partition import DepthLayout  # noqa: E402
from spd.runtime import metrics  # noqa: E402
from spd.runtime.types import SamplingParams  # noqa: E402

COUNTED = "counted"
# (acceptance, stage step) defaults, and what --quick puts in their place
DEFAULTS = dict(limit=None, max_new_tokens=128, stages="4,8", widths="1,2,4,8",
                lookup="default,0", context=512, rounds=5)
QUICK = dict(limit=3, max_new_tokens=16, stages="2", widths="1,2", lookup="default",
             context=64, iters=3, warmup=1, rounds=1)


def measured_label(device) -> str:
    return f"measured ({'GPU' if torch.device(device).type == 'cuda' else 'CPU'}, eager)"


def lookup_label(lookup: int) -> str:
    return "PDM alone" if lookup == 0 else "gated lookup"


def pick_prompts(records: list[dict], limit: int | None) -> list[dict]:
    """`limit` records taken in turn from each category, in file order (the held-out file is
    sorted by category: its first 12 are all chat), so a short run still covers them all."""
    by_cat: dict[str, list[dict]] = {}
    for r in records:
        by_cat.setdefault(r.get("category", ""), []).append(r)
    queues = list(by_cat.values())
    out = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out[:limit]


# --- acceptance ---------------------------------------------------------------------------------
def prompt_row(record: dict, res, reference: list[int] | None) -> dict:
    """One decoded prompt's counts; `mismatch` against the AR reference (None: not checked)."""
    from spd.evaluation.evaluate import first_difference
    st = res.stats
    diff = None if reference is None else first_difference(reference, list(res.token_ids))
    return dict(id=record.get("id"), category=record.get("category", ""), N=st.N, K=st.K,
                judged=st.drafts_judged, accepted=st.drafts_accepted, stage_rows=st.stage_rows,
                lookup_judged=st.lookup_judged, lookup_accepted=st.lookup_accepted,
                decode_s=st.decode_s, new_tokens=len(res.token_ids),
                mismatch=None if reference is None else diff is not None,
                first_difference=diff)


def pooled(rows: list[dict], n: int) -> dict:
    """Sums over prompt_rows and the figures of the module docstring."""
    tot = {k: sum(r[k] for r in rows) for k in ("N", "K", "judged", "accepted", "stage_rows",
                                                  "lookup_judged", "lookup_accepted",
                                                  "decode_s", "new_tokens")}
    checked = [r for r in rows if r["mismatch"] is not None]
    return dict(tot, prompts=len(rows), alpha=metrics.alpha(tot["N"], tot["K"]),
                theoretical_speedup=metrics.theoretical_speedup(tot["N"], tot["K"], n),
                acceptance_rate=metrics.rate(tot["accepted"], tot["judged"]),
                rows_per_stage_cycle=tot["stage_rows"] / (tot["K"] * n) if tot["K"] else 0.0,
                lookup_share=metrics.rate(tot["lookup_judged"], tot["judged"]),
                decode_tok_s_serial=metrics.tokens_per_s(tot["N"], tot["decode_s"]),
                checked=len(checked),
                mismatches=sum(r["mismatch"] for r in checked) if checked else None)


def acceptance_rows(target, prompts: list[tuple[dict, list[int]]], stages: list[int],
                    widths: list[int], lookups: list[int | None], max_new_tokens: int,
                    sampling: SamplingParams, on_row=None, pdm=None) -> list[dict]:
    """Every (n, drafter, W) over `prompts` ((record, prompt ids) pairs) -> pooled rows (with
    by_category and per_prompt). lookups: None is the engine's default. Greedy: each output is
    compared with AR decoding, decoded once per prompt. on_row(row) is called as each is done.
    pdm: given to every engine (None: the one shipped for the target and n)."""
    from spd.runtime.engine import SPDEngine

    references: dict[int, list[int]] = {}
    rows = []
    for n in stages:
        base = SPDEngine(target, n_stages=n, pdm=pdm)
        source = base.pdm_source
        engines = {w: SPDEngine(target, n_stages=n, pdm=base.pdm, tree_width=w) for w in widths}
        default_lookup = base.drafter.lookup
        for lk in lookups:
            lookup = default_lookup if lk is None else lk
            chain = None
            for w in widths:
                engine = engines[w]
                engine.drafter.lookup = lookup
                per_prompt = []
                t0 = time.perf_counter()
                for i, (record, ids) in enumerate(prompts):
                    res = engine.generate(ids, max_new_tokens, sampling)
                    ref = None
                    if sampling.greedy:
                        if i not in references:
                            references[i] = list(engine.generate_ar(ids, max_new_tokens,
                                                                    sampling).token_ids)
                        ref = references[i]
                    per_prompt.append(prompt_row(record, res, ref))
                s = pooled(per_prompt, n)
                cats = sorted({r["category"] for r in per_prompt if r["category"]})
                by_cat = {c: {k: v for k, v in pooled([r for r in per_prompt
                                                       if r["category"] == c], n).items()
                              if k in ("prompts", "N", "K", "alpha", "theoretical_speedup",
                                       "acceptance_rate", "mismatches")} for c in cats}
                if w == 1:
                    chain = s["theoretical_speedup"]
                row = dict(what="acceptance", kind=COUNTED, n=n, width=w, lookup=lookup,
                           drafter=lookup_label(lookup), pdm=source, split=list(base.layout.split),
                           max_new_tokens=max_new_tokens, temperature=sampling.temperature,
                           **s, s_over_chain=(s["theoretical_speedup"] / chain
                                              if chain else None),
                           run_s=time.perf_counter() - t0, by_category=by_cat,
                           per_prompt=per_prompt)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


# --- stage step ---------------------------------------------------------------------------------
def tree_inputs(context: int, n: int, width: int) -> dict:
    """The arguments of Stage.tree_run for `width` rows at position `context` with n - 1
    uncommitted ancestors each (parent of lane r: lane r // 2 at the position before), their
    slots laid out as the runtime's (position mod (n + 1)) * W + lane past the positions."""
    base, p, depth = context + 1, context, n - 1

    def slot(position: int, lane: int) -> int:
        return base + (position % (n + 1)) * width + lane

    branches = []
    for r in range(width):
        lane, br = r, [slot(p, r)]
        for j in range(1, depth + 1):
            lane //= 2
            br.append(slot(p - j, lane))
        branches.append(br)
    keys: list[int] = []
    for br in branches:
        keys.extend(k for k in br if k not in keys)
    return dict(position=p, slots=[slot(p, r) for r in range(width)], prefix_len=p - depth,
                tree_slots=keys, tree_mask=[[k in br for k in keys] for br in branches])


def interleaved(timer: Timer, calls: dict, rounds: int) -> dict:
    """{name: median microseconds} of `calls` ({name: fn}), timed in `rounds` rounds that each
    time every call in turn (about timer.iters / rounds calls apiece, the first round after
    timer.warmup untimed ones): on a shared machine a change of load falls on all of them alike.
    The figure is the median of the rounds' medians."""
    sub = copy.copy(timer)
    sub.iters = max(1, -(-timer.iters // rounds))
    times: dict = {k: [] for k in calls}
    for r in range(rounds):
        sub.warmup = timer.warmup if r == 0 else 0
        for k, fn in calls.items():
            times[k].append(sub(fn)[0])
    return {k: statistics.median(v) for k, v in times.items()}


def stage_step_rows(target, stages: list[int], widths: list[int], context: int,
                    timer: Timer, rounds: int = 5) -> list[dict]:
    """Per n: the largest stage's one-row chain step against its W-row tree step."""
    from spd.cuda_graphs import graphs_enabled
    from spd.model.target import Stage

    dev, dt, d = target.device, target.dtype, target.hidden_size
    gpu = dev.type == "cuda"
    label = measured_label(dev)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in stages:
        layout = DepthLayout.build(target.num_layers, n)
        index = max(range(n), key=lambda i: len(layout.stages[i]))
        layer_ids = layout.stages[index]
        capacity = context + 1 + (n + 1) * max(widths) + 8
        prefill = torch.randn(context, d, generator=g).to(dev, dt)
        one = torch.randn(1, d, generator=g).to(dev, dt)

        def make(graphs: bool):
            st = Stage(target, index, layer_ids, capacity, cuda_graphs=graphs)
            st.run(prefill, 0)  # the context's K/V: real values (no denormal garbage)
            return st

        def tree_call(w: int):
            a = tree_inputs(context, n, w)
            x = torch.randn(w, d, generator=g).to(dev, dt)
            slots = torch.tensor(a["slots"], dtype=torch.int64, device=dev)
            keys = torch.tensor(a["tree_slots"], dtype=torch.int64, device=dev)
            mask = torch.tensor(a["tree_mask"], dtype=torch.bool, device=dev)
            return len(keys), lambda: stage.tree_run(x, a["position"], slots, a["prefix_len"],
                                                     keys, mask)

        def tree_graph(w: int):
            """The tree step as a CUDA-graph replay, its position and prefix on the device as
            a unit gives them (spd.runtime.unit): (replay or None, why not)."""
            from spd.cuda_graphs import GraphSet
            a = tree_inputs(context, n, w)
            args = (torch.randn(w, d, generator=g).to(dev, dt),
                    torch.tensor([a["position"]], device=dev),
                    torch.tensor(a["slots"], dtype=torch.int64, device=dev),
                    torch.tensor([a["prefix_len"]], device=dev),
                    torch.tensor(a["tree_slots"], dtype=torch.int64, device=dev),
                    torch.tensor(a["tree_mask"], dtype=torch.bool, device=dev))
            graphs = GraphSet(dev, f"tree step of {w} rows", gstage.tree_run)
            try:
                if graphs.run(w, *args) is None:
                    return None, graphs.failed
            except Exception as exc:  # a capture this bench cannot make: reported, not fatal
                return None, f"{type(exc).__name__}: {exc}"
            return (lambda: graphs.run(w, *args)), None

        stage = make(False)
        calls = {"chain": lambda: stage.run(one, context)}
        graph_error = gstage = None
        if gpu and graphs_enabled(dev):
            gstage = make(True)
            gstage.run(one, context)  # captures the one-row graph
            if gstage.graphs.failed is not None:
                graph_error = str(gstage.graphs.failed)
            else:
                calls["graph"] = lambda: gstage.run(one, context)
        tree_keys, tree_graph_error = {}, {}
        for w in widths:
            tree_keys[w], calls[w] = tree_call(w)
            if gstage is not None:
                replay, tree_graph_error[w] = tree_graph(w)
                if replay is not None:
                    calls[f"tree graph {w}"] = replay
        us = interleaved(timer, calls, rounds)
        tree1 = us.get(1)
        for w in widths:
            rows.append(dict(what="stage step", kind=label, n=n, stage=index,
                             stage_layers=len(layer_ids), context=context, width=w,
                             tree_keys=tree_keys[w], chain_us=us["chain"],
                             chain_graph_us=us.get("graph"), graph_error=graph_error,
                             tree_us=us[w], ratio=us[w] / us["chain"],
                             tree_graph_us=us.get(f"tree graph {w}"),
                             tree_graph_error=tree_graph_error.get(w),
                             graph_ratio=(us[f"tree graph {w}"] / us["graph"]
                                          if f"tree graph {w}" in us and "graph" in us
                                          else None),
                             over_tree1=us[w] / tree1 if tree1 else None,
                             calls=rounds * -(-timer.iters // rounds), rounds=rounds,
                             dtype=str(dt).removeprefix("torch.")))
        stage = gstage = None  # its graphs and cache go before the next stage's
        if gpu:
            torch.cuda.empty_cache()
    return rows


def save_quietly(path, meta: dict, rows: list[dict]) -> None:
    """harness.write_json's file without its line: the rows so far, while the run goes on."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


# --- the run ------------------------------------------------------------------------------------
def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"{flag} takes comma-separated integers, got {text!r}")


def _lookups(text: str) -> list[int | None]:
    out = []
    for x in (x.strip() for x in text.split(",")):
        if x == "default":
            out.append(None)
        elif x.isdigit():
            out.append(int(x))
        elif x:
            sys.exit(f"--lookup takes 'default' or integers >= 0, comma-separated; got {text!r}")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target folder (default: the embedded one)")
    ap.add_argument("--stages", default=None, help=f"comma-separated n ({DEFAULTS['stages']})")
    ap.add_argument("--widths", default=None,
                    help=f"comma-separated tree widths W, 1 = the chain ({DEFAULTS['widths']})")
    ap.add_argument("--lookup", default=None,
                    help="drafters, comma-separated: 'default' (the engine's gated lookup) or a "
                         "shortest match length, 0 = the PDM alone (default,0)")
    ap.add_argument("--limit", type=int, default=None, help="held-out prompts (all 36)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(128)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy, checked against AR; > 0: sampled (seed 0), not checked")
    ap.add_argument("--context", type=int, default=None,
                    help="cached positions of the stage step (512)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="stage step: rounds that time every call in turn (--iters split "
                         "among them; 5)")
    ap.add_argument("--parts", default="stage,acceptance",
                    help="what to run, comma-separated: stage, acceptance")
    ap.add_argument("--quick", action="store_true", help="a check in seconds (module docstring)")
    add_device_args(ap)
    ap.add_argument("--out", dest="json_out", default=None, help="same as --json-out")
    args = ap.parse_args(argv)
    fill = {**DEFAULTS, **QUICK} if args.quick else dict(DEFAULTS)
    if not args.quick and not args.device.startswith("cuda"):
        fill.update(iters=20, warmup=2)  # a CPU step is a few ms: more calls than harness's 5
    for key, value in fill.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.stage_list = _ints(args.stages, "--stages")
    args.width_list = _ints(args.widths, "--widths")
    args.lookup_list = _lookups(args.lookup)
    args.part_list = [p for p in args.parts.split(",") if p]
    if not args.stage_list or min(args.stage_list) < 2 or not args.width_list \
            or not all(1 <= w <= 16 for w in args.width_list) or not args.lookup_list:
        sys.exit("--stages: n >= 2; --widths: W in 1..16; --lookup: at least one drafter")
    if set(args.part_list) - {"stage", "acceptance"} or not args.part_list:
        sys.exit("--parts takes stage and/or acceptance")
    if (args.limit is not None and args.limit < 1) or args.max_new_tokens < 1 or args.rounds < 1 \
            or args.context <= max(args.stage_list) or args.temperature < 0:
        sys.exit("--limit, --max-new-tokens and --rounds >= 1, --context > n, --temperature >= 0")
    args.width_list = sorted(set(args.width_list))  # W = 1 first: the others are set against it
    return args


ACC_COLUMNS = [("n", ">3"), ("drafter", ">13"), ("width", ">3", "W"), ("prompts", ">8"),
               ("N", ">6"), ("K", ">6"), ("alpha", ">7.3f"), ("theoretical_speedup", ">9.2f",
                                                             "S_theory"),
               ("s_over_chain", ">8.3f", "x W=1"), ("acceptance_rate", ">8.3f", "accept"),
               ("rows_per_stage_cycle", ">12.2f", "rows/st/cyc"),
               ("lossless", ">10"), ("run_s", ">7.0f", "s")]
STEP_COLUMNS = [("n", ">3"), ("stage_layers", ">7", "layers"), ("context", ">8"),
                ("width", ">3", "W"), ("kind", ">23"), ("chain_us", ">11.1f", "chain1 us"),
                ("chain_graph_us", ">15.1f", "chain graph us"), ("tree_us", ">10.1f", "tree us"),
                ("tree_graph_us", ">14.1f", "tree graph us"), ("ratio", ">8.2f"),
                ("over_tree1", ">8.2f", "x tree1"), ("graph_ratio", ">8.2f", "x graph")]


def main(argv=None, target=None) -> int:
    """argv: the command line (None: sys.argv); target: a TargetModel to use instead of loading
    --model (tests pass the session's default model)."""
    args = parse_args(argv)
    device, dtype, timer = device_setup(args, flush=True)
    if target is None:
        from spd.model.loading import load_target
        target = load_target(args.model, device=str(device), dtype=dtype)
    device = target.device
    sampling = SamplingParams(temperature=args.temperature)
    out = args.json_out or RESULTS / f"{args.date}-tree-{device_tag(device)}.json"
    meta = run_meta(device, date=args.date, model=getattr(target, "name", None),
                    stages=args.stage_list, widths=args.width_list,
                    lookups=["default" if x is None else x for x in args.lookup_list],
                    limit=args.limit, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, context=args.context, iters=timer.iters,
                    quick=args.quick, dataset="heldout",
                    note="acceptance rows are counts (alpha, S_theory = n * alpha: no draft "
                         "cost); stage-step rows time the step alone, eagerly (graph columns: "
                         "the step captured on its own); decode_tok_s_serial runs every stage "
                         "in one process")
    print(f"{describe_device(device)}; target {meta['model']}; {target.num_layers} layers")
    rows: list[dict] = []
    if "stage" in args.part_list:
        print(f"\nstage step: the largest stage at each n, {args.context} cached positions, "
              f"{timer.iters} calls each in {args.rounds} interleaved rounds (median of the "
              "rounds' medians)")
        table = Table(STEP_COLUMNS)
        table.print_header()
        with torch.no_grad():
            for r in stage_step_rows(target, args.stage_list, args.width_list, args.context,
                                     timer, args.rounds):
                table.print(r)
                rows.append(r)
        save_quietly(out, meta, rows)
    if "acceptance" in args.part_list:
        from spd.data.datasets import load_dataset
        from spd.evaluation.evaluate import encode_question
        records = pick_prompts(load_dataset("heldout"), args.limit)
        prompts = [(q, encode_question(target.tokenizer, q)) for q in records]
        check = "AR-checked" if sampling.greedy else "sampled, not checked"
        print(f"\nacceptance: {len(prompts)} held-out prompts, {args.max_new_tokens} new tokens, "
              f"T = {args.temperature} ({check}); lossless: prompts differing from AR / checked")
        table = Table(ACC_COLUMNS)
        table.print_header()

        def on_row(r):
            r_show = dict(r, lossless=(f"{r['mismatches']}/{r['checked']}"
                                       if r["mismatches"] is not None else "-"))
            table.print(r_show)
            rows.append(r)
            save_quietly(out, meta, rows)  # after each row: a cut run keeps its rows

        acceptance_rows(target, prompts, args.stage_list, args.width_list, args.lookup_list,
                        args.max_new_tokens, sampling, on_row)
        checked = [r for r in rows if r["what"] == "acceptance" and r["mismatches"] is not None]
        meta["ar_mismatches"] = sum(r["mismatches"] for r in checked) if checked else None
        meta["ar_checked"] = sum(r["checked"] for r in checked)
        if meta["ar_mismatches"]:
            print(f"LOSSLESS CHECK FAILED: {meta['ar_mismatches']} of {meta['ar_checked']} "
                  "decodes differ from AR")
        elif checked:
            print(f"lossless: all {meta['ar_checked']} decodes equal AR token for token")
    write_json(out, meta, rows=rows)
    return 1 if meta.get("ar_mismatches") else 0


if __name__ == "__main__":
    sys.exit(main())
