"""Command line: `python -m spd generate --prompt TEXT ...` (see `python -m spd generate -h`)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spd.errors import SPDError
from spd_kernels import SPDBackendError, _cuda


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with SPD (or autoregressively)",
                       description="Decode one prompt with speculative pipeline decoding. The "
                       "output is exactly the target's own (greedy or sampled).")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", default=None,
                   help="local Hugging Face folder (Llama/Qwen2/Qwen3); default: "
                        "SmolLM2-135M-Instruct, fetched and converted once into $SPD_CACHE")
    p.add_argument("--pdm", default=None,
                   help="PDM checkpoint folder, or \"untrained\" (default: the checkpoint shipped "
                        "for this target and n, else an untrained PDM)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages n (1 = autoregressive)")
    p.add_argument("--split", default=None, help="layers per stage, e.g. 8,8,7,7 (default uniform)")
    p.add_argument("--anchors", default=None,
                   help="anchor hidden-state indices, e.g. 0,8,15,23,29 (default: 0, L/4, L/2, "
                        "3L/4, L-1)")
    p.add_argument("--pdm-layers", type=int, default=None,
                   help="layers of an untrained PDM (default: L/n - 1 within [1, 4])")
    p.add_argument("--mode", choices=("spd", "ar"), default="spd",
                   help="spd (default) or ar: plain autoregressive decoding on the same stages")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default: on)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, stats) instead of streaming")
    from spd.distributed.launch import add_distributed_args
    add_distributed_args(p)
    _add_lookup_arg(p)
    p.set_defaults(func=cmd_generate)


def _parse_ints(text, what):
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise SPDError(f"{what} must be comma-separated integers, got '{text}'") from exc


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not text:
        raise SPDError("the prompt is empty: pass --prompt TEXT")
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return tokenizer(text)["input_ids"]


class _Streamer:
    """Prints text as tokens arrive (decoding the whole suffix keeps multi-token characters right)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, token_id: int) -> None:
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[len(self.shown):])
        sys.stdout.flush()
        self.shown = text


def cmd_generate(args) -> int:
    from spd.distributed.launch import cmd_generate_distributed, wants_distributed
    if wants_distributed(args):
        return cmd_generate_distributed(args)
    import torch

    from spd.runtime.engine import SamplingParams, SPDEngine
    from spd.model.loading import load_target

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise SPDError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SPDError("--device cuda was requested but no CUDA device is available")
    target = load_target(args.model, device=args.device)
    n = 1 if args.mode == "ar" else args.stages
    engine = SPDEngine(target, n_stages=n, split=_parse_ints(args.split, "--split"),
                       anchors=_parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                       pdm_layers=args.pdm_layers, warn_untrained=False,
                       lookup=_check_lookup(args.lookup))
    if engine.pdm_source == "untrained":
        print("[spd] warning: no trained PDM for this target and layout; using an untrained one. Output is "
              "still exactly the target's, but most drafts are rejected, so decoding is slow.",
              file=sys.stderr)
    prompt_ids = encode_prompt(target.tokenizer, args.prompt, args.chat)
    streamer = None if args.json else _Streamer(target.tokenizer)
    result = engine.generate(prompt_ids, args.max_new_tokens, sampling, on_token=streamer)
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    st = result.stats
    if args.json:
        stats = st.as_dict()
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": stats}))
    else:
        print()
        print(f"[spd] {st.summary()} prefill={st.prefill_s * 1000:.0f} ms", file=sys.stdout)
    return 0


def _add_lookup_arg(p) -> None:
    from spd.draft.lookup import DEFAULT_MIN_LEN
    p.add_argument("--lookup", type=int, default=None, metavar="K",
                   help="when the last K or more tokens occurred earlier in the text, draft the "
                        "token that followed them there instead of the PDM's guess, unless the "
                        "PDM is surer than such a match tends to be right (output is "
                        f"unchanged; 0: the PDM alone; default {DEFAULT_MIN_LEN}, and 0 in the "
                        "--methods grid, which compares the drafters themselves)")


def _check_lookup(k: int | None, default: int | None = None) -> int:
    if k is None:
        from spd.draft.lookup import DEFAULT_MIN_LEN
        return DEFAULT_MIN_LEN if default is None else default
    if k < 0:
        raise SPDError(f"--lookup is a match length (0: off), got {k}")
    return k


def _add_model_layout_args(p) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2)")
    p.add_argument("--stages", type=int, default=4, help="pipeline stages n")
    p.add_argument("--split", default=None, help="layers per stage, e.g. 8,8,7,7")
    p.add_argument("--anchors", default=None, help="anchor hidden-state indices, e.g. 0,8,15,23,29")
    p.add_argument("--device", default="cpu")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a PDM by distillation from the target",
                       description="Build distillation data (ShareGPT conversations and the "
                       "target's own responses, evaluation prompts excluded), extract and cache "
                       "the target's features, and train a PDM. Rerun the same command to resume.")
    _add_model_layout_args(p)
    p.add_argument("--out", required=True, help="output folder (the checkpoint; resumes if present)")
    p.add_argument("--features", default=None,
                   help="feature cache folder (default: $SPD_CACHE/features/<target>); extracted "
                        "when missing, reused and resumed otherwise")
    p.add_argument("--extra-features", nargs="+", default=[], metavar="FOLDER",
                   help="more features folders (already extracted, same anchors) to train on "
                        "besides --features; held-out sequences still come from the end of "
                        "--features")
    p.add_argument("--data-skip", type=int, default=0,
                   help="pass over this many shuffled ShareGPT conversations before taking "
                        "--self-distill and --conversations (builds a data set disjoint from "
                        "one built with the same seed)")
    p.add_argument("--method", choices=("spd", "ppsd", "eagle3"), default="spd",
                   help="spd (default): a PDM on multi-depth features; ppsd: the PPSD baseline "
                        "(a drafter on the first stage's output only, run after each pipeline "
                        "step); eagle3: the EAGLE-3-style chain-drafting head (one layer)")
    p.add_argument("--init-from", default=None,
                   help="warm start from a PDM checkpoint: copies every weight whose name and "
                        "shape match (e.g. a trained n=4 PDM to start an n=6 one)")
    p.add_argument("--pdm-layers", type=int, default=None,
                   help="PDM decoder layers L_s (default 2; 1 for ppsd)")
    p.add_argument("--intermediate-size", type=int, default=None,
                   help="drafter MLP width (default 768 for a PDM; the target's for eagle3)")
    p.add_argument("--ttt-steps", type=int, default=3,
                   help="eagle3: chain steps unrolled in training (training-time test)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="eagle3: tokens drafted per round at inference (default 5), stored in "
                        "the checkpoint")
    p.add_argument("--draft-vocab-size", type=int, default=8192)
    p.add_argument("--conversations", type=int, default=600, help="ShareGPT conversations")
    p.add_argument("--self-distill", type=int, default=128,
                   help="prompts answered by the target itself (self-distillation)")
    p.add_argument("--code-prompts", type=int, default=0,
                   help="also self-distill this many code-completion prompts made from the "
                        "documented functions of Python's standard library (signature and "
                        "docstring; HumanEval's function names excluded); --data-skip passes "
                        "over the same number of them")
    p.add_argument("--code-roots", nargs="+", default=[], metavar="DIR",
                   help="more code prompts from the documented functions of these package "
                        "folders (e.g. site-packages/numpy), after the standard library's")
    p.add_argument("--response-tokens", type=int, default=192,
                   help="max tokens of each self-distilled response")
    p.add_argument("--distill-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="generate the self-distilled responses with a copy of the target in "
                        "this dtype (default: the target's own); bfloat16 is ~1.8x faster on "
                        "a CPU with avx512_bf16. Features are still extracted at the target's "
                        "dtype")
    p.add_argument("--max-len", type=int, default=512, help="tokens per training sequence")
    p.add_argument("--crop-len", type=int, default=256,
                   help="train on random windows of this many tokens (attention cost grows "
                        "with its square)")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--batch", type=int, default=2, help="sequences per optimiser step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fill-weights", default=None, metavar="W1,...,Wn",
                   help="relative weights of the training fill levels 1..n (default: full with "
                        "probability 1/2, else uniform); e.g. 4,2,1,1 at n=4 follows inference, "
                        "where a rejection restarts drafting at fill 1")
    p.add_argument("--argmax-weight", type=float, default=0.0,
                   help="add this weight times the cross-entropy of the target's argmax token "
                        "to the KL loss (greedy decoding accepts only that token; default 0)")
    p.add_argument("--feature-timing", choices=("pre-step", "post-step"), default=None,
                   help="pre-step (default): draft from features that exist when the cycle "
                        "starts, hidden behind the stages; post-step: after the stage step "
                        "(more accurate, not hidden; the paper's ablation; the default for ppsd)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="arithmetic of the training loss: bf16 autocast (weights, optimiser and "
                        "held-out evaluation stay fp32; ~1.8x faster on a CPU with bf16 units) "
                        "or fp32; auto (default): bf16 where the device has native bf16")
    p.add_argument("--storage", choices=("int8", "fp16", "fp32"), default="int8",
                   help="weight storage of the saved checkpoint (int8: ~4x smaller than fp32)")
    p.set_defaults(func=cmd_train)


def cmd_train(args) -> int:
    import torch

    from spd.data.assets import cache_dir
    from spd.train.distill import FeatureSet, build_sequences, cached_sequences, extract_features
    from spd.model.loading import load_target
    from spd.model.partition import DepthLayout, default_anchors
    from spd.train.loop import resolve_precision
    from spd.train.trainer import TrainConfig, check_fill_weights, train

    if args.steps < 1 or args.batch < 1:
        raise SPDError("--steps and --batch must be >= 1")
    for flag in ("data_skip", "code_prompts", "self_distill", "conversations"):
        if getattr(args, flag) < 0:
            raise SPDError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    target = load_target(args.model, device=args.device)
    precision = resolve_precision(args.precision, target.device)
    anchors = _parse_ints(args.anchors, "--anchors")
    split = _parse_ints(args.split, "--split")
    if args.method == "ppsd" and anchors is None:  # PPSD sees the first stage's output only
        anchors = [0, DepthLayout.build(target.num_layers, args.stages, split).split[0]]
    layout = DepthLayout.build(target.num_layers, args.stages, split, anchors)
    fill_weights = None  # checked before any data is built
    if args.fill_weights is not None:
        if args.method == "eagle3":
            raise SPDError("--fill-weights is a PDM option; the eagle3 head has no fill levels")
        try:
            fill_weights = [float(x) for x in args.fill_weights.split(",")]
        except ValueError:
            raise SPDError(f"--fill-weights takes comma-separated numbers, got "
                           f"{args.fill_weights!r}") from None
        check_fill_weights(fill_weights, layout.n)
    if args.argmax_weight < 0 or (args.argmax_weight and args.method == "eagle3"):
        raise SPDError(f"--argmax-weight must be >= 0 and is a PDM option, got "
                       f"{args.argmax_weight} with --method {args.method}")
    feat_dir = args.features or str(cache_dir() / "features" / f"{target.fingerprint()}-v1")
    feat_anchors = sorted(set(default_anchors(target.num_layers)) | set(layout.anchors))
    if args.method == "eagle3":
        from spd.baselines.eagle import default_feature_layers
        feat_anchors = sorted(set(feat_anchors) | set(default_feature_layers(target.num_layers)))
    meta = Path(feat_dir) / "meta.json"
    if not meta.exists() or _unfinished(meta):
        seqs = cached_sequences(Path(feat_dir) / "sequences.json", lambda: build_sequences(
            target, conversations=args.conversations, self_distill_prompts=args.self_distill,
            max_len=args.max_len, response_tokens=args.response_tokens, seed=args.seed,
            skip=args.data_skip, code_prompts=args.code_prompts, code_roots=args.code_roots,
            distill_dtype=getattr(torch, args.distill_dtype) if args.distill_dtype else None))
        extract_features(target, seqs, feat_anchors, feat_dir)
    features = FeatureSet(list(args.extra_features) + [feat_dir], target)
    if args.method == "eagle3":
        return _train_eagle(args, target, features, precision)
    if args.feature_timing is None:
        args.feature_timing = "post-step" if args.method == "ppsd" else "pre-step"
    cfg = TrainConfig(n_stages=layout.n, split=layout.split, anchors=list(layout.anchors),
                      pdm_layers=args.pdm_layers or (1 if args.method == "ppsd" else 2),
                      method=args.method, init_from=args.init_from,
                      intermediate_size=args.intermediate_size or 768,
                      draft_vocab_size=args.draft_vocab_size, steps=args.steps,
                      batch_sequences=args.batch, lr=args.lr, eval_every=args.eval_every,
                      save_every=args.eval_every, max_len=args.max_len, seed=args.seed,
                      features=args.feature_timing, crop_len=args.crop_len,
                      fill_weights=fill_weights, argmax_weight=args.argmax_weight,
                      precision=precision)
    final = train(target, features, cfg, args.out, storage=args.storage)
    print(json.dumps({"out": args.out, "final": final}))
    return 0


def _train_eagle(args, target, features, precision: str) -> int:
    """`spd train --method eagle3`: the EAGLE-3-style head on the same data and vocabulary."""
    from spd.baselines.eagle import DEFAULT_DRAFT_STEPS
    from spd.baselines.eagle_train import EagleTrainConfig, train_eagle
    if args.init_from or args.pdm_layers or args.feature_timing:
        raise SPDError("--init-from, --pdm-layers and --feature-timing are PDM options; the "
                       "eagle3 head has one layer and drafts in a chain")
    if args.ttt_steps < 1:
        raise SPDError(f"--ttt-steps must be >= 1, got {args.ttt_steps}")
    cfg = EagleTrainConfig(steps=args.steps, batch_sequences=args.batch, lr=args.lr,
                           crop_len=args.crop_len, eval_every=args.eval_every,
                           save_every=args.eval_every, seed=args.seed,
                           draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps,
                           intermediate_size=args.intermediate_size,
                           draft_steps=args.draft_steps or DEFAULT_DRAFT_STEPS,
                           precision=precision)
    final = train_eagle(target, features, cfg, args.out, storage=args.storage)
    print(json.dumps({"out": args.out, "final": final}))
    return 0


def _unfinished(meta_path) -> bool:
    meta = json.loads(meta_path.read_text())
    return not meta.get("shards") or not meta.get("complete")


def _add_eval(sub) -> None:
    p = sub.add_parser(
        "eval", help="decode prompt sets with SPD (or a grid of methods) and report speedups",
        description="Decode prompt sets and report N, K, alpha, theoretical speedup and "
        "acceptance. With --methods, run the comparison grid (ar, pp, eagle3, ppsd, spd over "
        "--stages, --pdm-layers, --datasets and --temperature lists), check every greedy output "
        "against autoregressive decoding, and write grid.json, report.md and plots to --out-dir "
        "(rerun the same command to resume).")
    p.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2)")
    p.add_argument("--stages", default="4",
                   help="pipeline stages n (a comma list with --methods, e.g. 2,4,6)")
    p.add_argument("--split", default=None, help="layers per stage, e.g. 8,8,7,7 (single run)")
    p.add_argument("--anchors", default=None, help="anchor hidden-state indices (single run)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dataset", "--datasets", dest="dataset", action="append", default=None,
                   help="mt_bench or humaneval (repeat or comma-separate; default: both unless "
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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="compare every output with autoregressive decoding (default: on at T=0)")
    p.add_argument("--json-out", default=None, help="write the report as JSON (single run)")
    _add_lookup_arg(p)
    g = p.add_argument_group("comparison grid")
    g.add_argument("--methods", default=None,
                   help="comma list of ar, pp, eagle3, ppsd, spd: run the grid")
    g.add_argument("--pdm-layers", default="2", help="SPD drafter depths L_s, e.g. 1,2,3")
    g.add_argument("--out-dir", default="spd-eval-grid",
                   help="where grid.json, report.md and the plots go (default: ./spd-eval-grid)")
    g.add_argument("--checkpoint-dir", action="append", default=[],
                   help="extra folder of drafter checkpoints (subfolders with config.json) to "
                        "search besides the shipped ones; repeatable")
    g.add_argument("--cost-reps", type=int, default=10,
                   help="timing repetitions per piece of the cost model")
    g.add_argument("--recost", action="store_true",
                   help="measure the cost model again when resuming (every speedup in the "
                        "report is recomputed from it)")
    p.set_defaults(func=cmd_eval)


def _parse_floats(text, what):
    try:
        return [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError as exc:
        raise SPDError(f"{what} must be comma-separated numbers, got '{text}'") from exc


def cmd_eval(args) -> int:
    from spd.evaluation.evaluate import collect_sets
    from spd.model.loading import load_target

    stages = _parse_ints(args.stages, "--stages")
    temps = _parse_floats(args.temperature, "--temperature")
    if not args.methods and (len(stages) != 1 or len(temps) != 1):
        raise SPDError("lists of --stages or --temperature need --methods (the grid)")
    names = [x for d in (args.dataset or []) for x in d.split(",") if x]
    if not names and not args.prompts:
        names = ["mt_bench", "humaneval"]
    sets = collect_sets(names, args.prompts, args.limit)
    if args.methods:
        return _eval_grid(args, sets, stages, temps)
    from spd.runtime.engine import SamplingParams, SPDEngine
    from spd.evaluation.evaluate import format_table, run_eval, write_json
    sampling = SamplingParams(temps[0], args.top_k, args.top_p, args.seed)
    check = sampling.greedy if args.check is None else args.check
    if check and not sampling.greedy:
        raise SPDError("--check compares with autoregressive decoding token for token, which "
                       "only holds at --temperature 0")
    target = load_target(args.model, device=args.device)
    engine = SPDEngine(target, n_stages=stages[0], split=_parse_ints(args.split, "--split"),
                       anchors=_parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                       warn_untrained=False, lookup=_check_lookup(args.lookup))
    if engine.pdm_source == "untrained":
        print("[spd] warning: no trained PDM for this target and layout; using an untrained one",
              file=sys.stderr)
    report = run_eval(engine, sets, args.max_new_tokens, sampling, check)
    print(format_table(report))
    if args.json_out:
        write_json(report, args.json_out)
        print(f"wrote {args.json_out}")
    return 0


def _eval_grid(args, sets, stages, temps) -> int:
    from spd.evaluation.grid import GridSpec, run_grid
    from spd.model.loading import load_target
    from spd.evaluation.report import markdown, write_report

    if args.pdm or args.split or args.anchors or args.json_out:
        raise SPDError("--pdm, --split, --anchors and --json-out belong to a single run; the "
                       "grid finds its drafters itself (add folders with --checkpoint-dir) and "
                       "writes to --out-dir")
    if args.top_k or args.top_p != 1.0:
        raise SPDError("the grid samples with plain temperature; drop --top-k/--top-p")
    if args.check is False:
        raise SPDError("the grid always checks greedy outputs against autoregressive decoding")
    spec = GridSpec(methods=[m for m in args.methods.split(",") if m], stages=stages,
                    pdm_layers=_parse_ints(args.pdm_layers, "--pdm-layers"), datasets=sets,
                    temperatures=temps, max_new_tokens=args.max_new_tokens, seed=args.seed,
                    checkpoint_dirs=args.checkpoint_dir, cost_reps=args.cost_reps,
                    lookup=_check_lookup(args.lookup, default=0))
    for d in args.checkpoint_dir:
        if not Path(d).is_dir():
            raise SPDError(f"--checkpoint-dir {d} is not a folder")
    target = load_target(args.model, device=args.device)
    # The command that reproduces the grid (resume-only flags left out)
    command = ("python -m spd " + " ".join(a for a in sys.argv[1:] if a != "--recost")
               if sys.argv[1:2] == ["eval"] else "")
    state = run_grid(target, spec, args.out_dir, command=command, recost=args.recost)
    written = write_report(state, args.out_dir)
    print(markdown(state))
    print("wrote " + ", ".join(str(x) for x in [Path(args.out_dir) / "grid.json", *written]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spd",
                                     description="Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_train(sub)
    _add_eval(sub)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        _cuda.programmatic_launch_enabled()  # a bad SPD_PDL is refused up front, on any device
        return args.func(args)
    except (SPDError, SPDBackendError) as exc:  # bad input, or a backend forced where it can't run
        print(f"spd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspd: interrupted", file=sys.stderr)
        return 130
