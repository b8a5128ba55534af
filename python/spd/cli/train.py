"""`spd train`: distillation data, the feature cache, and a PDM (or the baselines' drafters)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spd.baselines import training
from spd.cli.common import MAX_SEED, add_model_layout_args, int_in, parse_ints
from spd.errors import SPDError
from spd.train.methods import ARGMAX_MESSAGE, TrainJob


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a PDM by distillation from the target",
                       description="Build distillation data (ShareGPT conversations and the "
                       "target's own responses, evaluation prompts excluded), extract and cache "
                       "the target's features, and train a PDM. Rerun the same command to resume.")
    add_model_layout_args(p)
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
    p.add_argument("--method", choices=training.NAMES, default=training.DEFAULT,
                   help="; ".join(f"{m.name}{' (default)' if m.name == training.DEFAULT else ''}"
                                  f": {m.summary}" for m in training.TRAIN_METHODS.values()))
    p.add_argument("--init-from", default=None,
                   help="warm start from a PDM checkpoint: copies every weight whose name and "
                        "shape match (e.g. a trained n=4 PDM to start an n=6 one)")
    p.add_argument("--pdm-layers", type=int_in(1), default=None,
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
    p.add_argument("--eval-sequences", type=int, default=16,
                   help="sequences held out from the end of the data for evaluation")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="in [0, 2**63 - 1]")
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
    from spd.model.loading import load_target
    from spd.model.partition import DepthLayout, default_anchors
    from spd.train.distill import FeatureSet, build_sequences, cached_sequences, extract_features
    from spd.train.loop import resolve_precision
    from spd.train.trainer import check_fill_weights

    method = training.get(args.method)
    if args.steps < 1 or args.batch < 1:
        raise SPDError("--steps and --batch must be >= 1")
    for flag in ("data_skip", "code_prompts", "self_distill", "conversations"):
        if getattr(args, flag) < 0:
            raise SPDError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    target = load_target(args.model, device=args.device, dtype=args.dtype)
    precision = resolve_precision(args.precision, target.device)
    anchors = parse_ints(args.anchors, "--anchors")
    split = parse_ints(args.split, "--split")
    if anchors is None and method.anchors is not None:  # e.g. PPSD: the first stage's output
        anchors = method.anchors(target.num_layers, args.stages, split)
    layout = DepthLayout.build(target.num_layers, args.stages, split, anchors)
    method.check_options(args)  # refused options, before any data is built
    fill_weights = None
    if args.fill_weights is not None:
        try:
            fill_weights = [float(x) for x in args.fill_weights.split(",")]
        except ValueError:
            raise SPDError(f"--fill-weights takes comma-separated numbers, got "
                           f"{args.fill_weights!r}") from None
        check_fill_weights(fill_weights, layout.n)
    if args.argmax_weight < 0:
        raise SPDError(ARGMAX_MESSAGE.format(argmax_weight=args.argmax_weight,
                                             method=method.name))
    if args.eval_sequences < 1:
        raise SPDError(f"--eval-sequences must be >= 1, got {args.eval_sequences}")
    # The default features folder is keyed by the target and by every option that shapes the
    # data, so other data options build their own features instead of reusing these.
    data_options = {k: getattr(args, k) for k in DATA_OPTIONS}
    data_key = hashlib.sha256(json.dumps(data_options, sort_keys=True, default=str)
                              .encode()).hexdigest()[:12]
    feat_dir = args.features or str(cache_dir() / "features"
                                    / f"{target.fingerprint()}-{data_key}-v2")
    feat_anchors = sorted(set(default_anchors(target.num_layers)) | set(layout.anchors)
                          | set(method.feature_layers(target.num_layers)))
    meta = Path(feat_dir) / "meta.json"
    if not meta.exists() or _unfinished(meta):
        seqs = cached_sequences(Path(feat_dir) / "sequences.json", lambda: build_sequences(
            target, conversations=args.conversations, self_distill_prompts=args.self_distill,
            max_len=args.max_len, response_tokens=args.response_tokens, seed=args.seed,
            skip=args.data_skip, code_prompts=args.code_prompts, code_roots=args.code_roots,
            distill_dtype=getattr(torch, args.distill_dtype) if args.distill_dtype else None))
        extract_features(target, seqs, feat_anchors, feat_dir)
    features = FeatureSet(list(args.extra_features) + [feat_dir], target)
    final = method.run(TrainJob(target=target, features=features, layout=layout,
                                precision=precision, fill_weights=fill_weights, options=args))
    print(json.dumps({"out": args.out, "final": final}))
    return 0


# the flags that decide which sequences the features are extracted from
DATA_OPTIONS = ("conversations", "self_distill", "max_len", "response_tokens", "seed",
                "data_skip", "code_prompts", "code_roots", "distill_dtype")


def _unfinished(meta_path) -> bool:
    meta = json.loads(meta_path.read_text())
    return not meta.get("shards") or not meta.get("complete")

