"""`spd eval`: prompt sets decoded and scored, or the comparison grid with --methods."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spd.cli.common import (
    MAX_SEED,
    add_draft_weights_arg,
    add_dtype_arg,
    add_lookup_arg,
    add_tree_width_arg,
    check_lookup,
    device_arg,
    int_in,
    parse_floats,
    parse_ints,
    precheck_pdm,
    warn_untrained_pdm,
)
from spd.data.files import check_output_file
from spd.errors import SPDError


def add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="decode prompt sets with SPD (or a grid of methods) and report speedups",
        description="Decode prompt sets and report N, K, alpha, theoretical speedup and "
        "acceptance. With --methods, run the comparison grid (ar, pp, eagle3, ppsd, spd, spd-nd, "
        "spd-tree over "
        "--stages, --pdm-layers, --datasets and --temperature lists), check every greedy output "
        "against autoregressive decoding, and write grid.json, report.md and plots to --out-dir "
        "(rerun the same command to resume).")
    p.add_argument("--model", default=None,
                   help="local Hugging Face folder, or org/name from the local HF cache "
                        "(default: SmolLM2)")
    p.add_argument("--stages", default="4",
                   help="pipeline stages n (a comma list with --methods, e.g. 2,4,6)")
    p.add_argument("--split", default=None,
                   help="layers per stage, e.g. 8,8,7,7, or auto (equal stage times by bytes "
                        "read per step, the last stage's LM head included); single run")
    p.add_argument("--anchors", default=None, help="anchor hidden-state indices (single run)")
    p.add_argument("--device", type=device_arg, default="cpu")
    add_dtype_arg(p)
    p.add_argument("--dataset", "--datasets", dest="dataset", action="append", default=None,
                   help="mt_bench, humaneval or heldout (the project's own prompts that no "
                        "drafter trained or was tuned on: chat, code, math, multilingual); "
                        "repeat or comma-separate (default: mt_bench and humaneval unless "
                        "--prompts is given)")
    p.add_argument("--prompts", default=None,
                   help="FastChat question .jsonl (one object a line with a 'turns' list)")
    p.add_argument("--limit", type=int, default=None, help="first K prompts of each set")
    p.add_argument("--pdm", default=None, help="PDM checkpoint (single run; default: shipped)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", default="0",
                   help="sampling temperature (a comma list with --methods, e.g. 0,1)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="in [0, 2**63 - 1]")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare every output with autoregressive decoding (default: on at T=0)")
    p.add_argument("--json-out", default=None, help="write the report as JSON (single run)")
    p.add_argument("--ar-cache", action="store_true",
                   help="keep the autoregressive reference outputs of --check in "
                        "$SPD_CACHE/ar-reference and reuse them: one AR decode per prompt "
                        "serves every drafter compared on the same target, dtype, device and "
                        "budget (single run)")
    add_lookup_arg(p)
    add_draft_weights_arg(p)
    add_tree_width_arg(p)
    g = p.add_argument_group("comparison grid")
    g.add_argument("--methods", default=None,
                   help="comma list of ar, pp, eagle3, ppsd, spd, spd-nd (SPD on n devices: "
                        "the PDM on stage 0's), spd-tree (SPD drafting a tree of width 4): "
                        "run the grid")
    g.add_argument("--pdm-layers", default="2", help="SPD drafter depths L_s, e.g. 1,2,3")
    g.add_argument("--out-dir", default="spd-eval-grid",
                   help="where grid.json, report.md and the plots go (default: ./spd-eval-grid)")
    g.add_argument("--checkpoint-dir", action="append", default=[],
                   help="extra folder of drafter checkpoints (subfolders with config.json) to "
                        "search besides the shipped ones; repeatable")
    g.add_argument("--cost-reps", type=int, default=10,
                   help="timing repetitions per piece of the cost model")
    g.add_argument("--runtime-from", default=None, metavar="JSON",
                   help="a benchmarks/bench_protocol.py JSON of this device type: its measured "
                        "cost per cycle of the distributed runtime (cycle - F, always-right, "
                        "the device loop where measured) is added to every pipelined cycle "
                        "(default: none charged)")
    g.add_argument("--batch-sizes", default="1,2,4,8,16",
                   help="B for the report's batched rows (ar, pp and spd with B sequences at "
                        "once, projected from costs measured at B rows; docs/batching.md)")
    g.add_argument("--recost", action="store_true",
                   help="measure the cost model again when resuming (every speedup in the "
                        "report is recomputed from it)")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from spd.evaluation.evaluate import collect_sets
    from spd.model.loading import load_target

    stages = parse_ints(args.stages, "--stages")
    temps = parse_floats(args.temperature, "--temperature")
    if not args.methods and (len(stages) != 1 or len(temps) != 1):
        raise SPDError("lists of --stages or --temperature need --methods (the grid)")
    names = [x for d in (args.dataset or []) for x in d.split(",") if x]
    if not names and not args.prompts:
        names = ["mt_bench", "humaneval"]
    sets = collect_sets(names, args.prompts, args.limit)
    if args.methods:
        if args.draft_weights != "model":
            raise SPDError("--draft-weights applies to a single run, not the --methods grid")
        if args.tree_width != 1:
            raise SPDError("--tree-width applies to a single run; the grid's tree row is the "
                           "method spd-tree")
        return _eval_grid(args, sets, stages, temps)
    if args.json_out:
        check_output_file(args.json_out, "--json-out")  # before hours of decoding, not after
    from spd.evaluation.evaluate import format_table, run_eval, write_json
    from spd.model.stage_costs import resolve_split, target_costs
    from spd.runtime.engine import SPDEngine
    from spd.runtime.types import SamplingParams
    sampling = SamplingParams(temps[0], args.top_k, args.top_p, args.seed)
    check = sampling.greedy if args.check is None else args.check
    if check and not sampling.greedy:
        raise SPDError("--check compares with autoregressive decoding token for token, which "
                       "only holds at --temperature 0")
    precheck_pdm(args.pdm)
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    split = resolve_split(args.split, lambda: target_costs(target), stages[0])
    engine = SPDEngine(target, n_stages=stages[0], split=split,
                       anchors=parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                       warn_untrained=False, lookup=check_lookup(args.lookup),
                       draft_weights=args.draft_weights, tree_width=args.tree_width)
    if engine.pdm_source == "untrained":
        warn_untrained_pdm(detail=False)
    references = None
    if args.ar_cache:
        from spd.data.assets import cache_dir
        from spd.evaluation.evaluate import ReferenceStore
        references = ReferenceStore(cache_dir() / "ar-reference")
    report = run_eval(engine, sets, args.max_new_tokens, sampling, check, references=references)
    print(format_table(report))
    if args.json_out:
        write_json(report, args.json_out)
        print(f"wrote {args.json_out}")
    return 0


def _eval_grid(args, sets, stages, temps) -> int:
    from spd.evaluation.grid import GridSpec, run_grid
    from spd.evaluation.report import markdown, write_report
    from spd.model.loading import load_target

    if args.pdm or args.split or args.anchors or args.json_out:
        raise SPDError("--pdm, --split, --anchors and --json-out belong to a single run; the "
                       "grid finds its drafters itself (add folders with --checkpoint-dir) and "
                       "writes to --out-dir")
    if args.runtime_from:  # a bad file is refused before any decoding
        from spd.evaluation.cost_model import runtime_overhead
        runtime_overhead(args.runtime_from, "cuda" if args.device.startswith("cuda") else "cpu")
    if args.top_k or args.top_p != 1.0:
        raise SPDError("the grid samples with plain temperature; drop --top-k/--top-p")
    if args.check is False:
        raise SPDError("the grid always checks greedy outputs against autoregressive decoding")
    pdm_layers = parse_ints(args.pdm_layers, "--pdm-layers")
    if not pdm_layers or min(pdm_layers) < 1:
        raise SPDError(f"--pdm-layers takes PDM depths >= 1, got '{args.pdm_layers}'")
    spec = GridSpec(methods=[m for m in args.methods.split(",") if m], stages=stages,
                    pdm_layers=pdm_layers, datasets=sets,
                    temperatures=temps, max_new_tokens=args.max_new_tokens, seed=args.seed,
                    checkpoint_dirs=args.checkpoint_dir, cost_reps=args.cost_reps,
                    lookup=check_lookup(args.lookup, default=0),
                    batch_sizes=parse_ints(args.batch_sizes, "--batch-sizes"))
    for d in args.checkpoint_dir:
        if not Path(d).is_dir():
            raise SPDError(f"--checkpoint-dir {d} is not a folder")
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    # The command that reproduces the grid (resume-only flags left out)
    command = ("python -m spd " + " ".join(a for a in sys.argv[1:] if a != "--recost")
               if sys.argv[1:2] == ["eval"] else "")
    state = run_grid(target, spec, args.out_dir, command=command, recost=args.recost,
                     runtime_from=args.runtime_from)
    written = write_report(state, args.out_dir)
    print(markdown(state))
    print("wrote " + ", ".join(str(x) for x in [Path(args.out_dir) / "grid.json", *written]))
    return 0

