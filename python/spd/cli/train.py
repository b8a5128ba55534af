"""`spd train`: distillation data, the feature cache, and a PDM (or the baselines' drafters)."""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from spd.baselines import training
from spd.cli.common import MAX_SEED, add_model_layout_args, int_in, parse_ints
from spd.errors import SPDError
from spd.train.methods import ARGMAX_MESSAGE, TrainJob


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train a PDM by distillation from the target",
                       description="Distil a drafter from the target. Online (the default for "
                       "targets over 1B parameters, or with --data): the frozen target computes "
                       "each batch's features as training goes, on your data (--data) or the "
                       "built-in ShareGPT. Cached: the built-in data's features are extracted "
                       "into a cache first (small CPU runs). Several ranks: torchrun "
                       "--nproc-per-node N -m spd train .... Rerun the same command to resume.")
    add_model_layout_args(p)
    p.add_argument("--out", required=True, help="output folder (the checkpoint; resumes if present)")
    p.add_argument("--mode", choices=("auto", "online", "cached"), default="auto",
                   help="online: the target computes each batch's features during training "
                        "(memory bounded by the batch); cached: extract the built-in data's "
                        "features to disk first. auto (default): online for a target over 1B "
                        "parameters or when --data is given, else cached")
    p.add_argument("--data", nargs="+", default=None, metavar="PATH",
                   help="training conversations: JSONL (ShareGPT 'conversations' or OpenAI "
                        "'messages'), a JSON array, parquet, a datasets.save_to_disk folder, a "
                        "folder of these, or 'sharegpt' (the built-in set); streamed "
                        "(docs/training.md). Default: sharegpt")
    p.add_argument("--holdout", type=float, default=0.02,
                   help="share of conversations held out by a hash of their first user turn: "
                        "never trained on; the run evaluates on the first --eval-sequences of "
                        "them (online). A set with none in that share holds out one "
                        "conversation (from 8 usable ones on), else trains on all with a "
                        "warning")
    p.add_argument("--too-long", choices=("drop", "cut"), default="drop",
                   help="conversations over --max-len tokens are dropped (the paper's filter) "
                        "or cut to --max-len (online)")
    p.add_argument("--loss-on", choices=("answers", "all"), default=None,
                   help="online: train (and estimate held-out acceptance) on the rows that "
                        "predict the target's own answer tokens, as drafting meets them, or on "
                        "every row, chat template and user text included (default: answers "
                        "online; the cached path trains on every row)")
    p.add_argument("--epochs", type=float, default=None,
                   help="passes over the data; sets --steps (online default when --steps is "
                        "not given: 1, the paper's)")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="sequences per forward on one rank; --batch / (ranks x micro-batch) "
                        "micro-batches are accumulated per step (default 0: no accumulation)")
    p.add_argument("--pack-tokens", type=int, default=0,
                   help="pack a micro-batch's sequences into PDM forwards of up to this many "
                        "tokens (default 0: one sequence a forward)")
    p.add_argument("--regenerate", action="store_true",
                   help="online: first replace each conversation's first answer by the "
                        "target's own greedy answer (self-distillation; --response-tokens, "
                        "--distill-dtype), written under OUT/regenerated/ and resumed there")
    p.add_argument("--regenerate-batch", type=int, default=16,
                   help="prompts answered together when regenerating")
    p.add_argument("--rank-timeout", type=float, default=600.0,
                   help="seconds a rank waits for the others before the run stops (torchrun)")
    p.add_argument("--json", action="store_true",
                   help="print the run's summary as JSON at the end")
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
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocabulary: the most frequent target tokens (default 8192; with "
                        "--draft-vocab-coverage, the cap on its size)")
    p.add_argument("--draft-vocab-coverage", type=float, default=None, metavar="F",
                   help="PDM: the smallest draft vocabulary whose tokens make up a share F in "
                        "(0, 1] of the tokens counted (the target's argmax tokens of a feature "
                        "cache; online, the data's tokens), e.g. 0.99 (capped by "
                        "--draft-vocab-size if given)")
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
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per training sequence (default: 2048 online, the paper's; 512 "
                        "cached)")
    p.add_argument("--crop-len", type=int, default=None,
                   help="train on random windows of this many tokens, 0 for whole sequences "
                        "(attention cost grows with its square; default: 256 on a CPU, whole "
                        "sequences on a GPU)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: one epoch online, 1600 cached)")
    p.add_argument("--batch", type=int, default=2,
                   help="sequences per optimiser step, every rank together")
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate, warm-up then linear decay (default: 1e-4 online, "
                        "the paper's; 1e-3 cached)")
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


ONLINE_ABOVE_PARAMS = 1e9  # --mode auto trains online above this many target parameters
# the flags that build the cached path's built-in data; online runs take --data instead
BUILTIN_DATA = ("conversations", "self_distill", "code_prompts", "code_roots", "data_skip")


def cmd_train(args) -> int:
    from spd.model.loading import load_target
    from spd.train.ranks import RankGroup, RankLostError

    method = training.get(args.method)
    _check_numbers(args)
    group = RankGroup.from_env(args.device, args.rank_timeout)
    try:
        target = load_target(args.model, device=str(group.device), dtype=args.dtype)
        mode = _resolve_mode(args, target)
        job = _job(args, method, target, mode)
        if mode == "online":
            summary = _train_online(args, job, group)
        else:
            summary = _train_cached(args, method, job, group)
    except RankLostError as exc:
        print(f"spd: error: {exc}. The run stopped; its last checkpoint is in {args.out}: rerun "
              f"the same command to resume from it", file=sys.stderr)
        return 1
    finally:
        group.close()
    if group.main:
        if args.json:
            print(json.dumps(summary))
        else:
            final = summary.get("final", {})
            shown = {k: round(v, 4) for k, v in final.items() if isinstance(v, float)}
            print(f"[spd train] done: {args.out} ({mode}) {json.dumps(shown)}")
    return 0


def _check_numbers(args) -> None:
    """Bad values, refused before any model loads."""
    if (args.steps is not None and args.steps < 1) or args.batch < 1:
        raise SPDError("--steps and --batch must be >= 1")
    cover = args.draft_vocab_coverage
    if cover is not None and not 0.0 < cover <= 1.0:
        raise SPDError(f"--draft-vocab-coverage must lie in (0, 1], got {cover}")
    if args.draft_vocab_size is not None and args.draft_vocab_size < 1:
        raise SPDError(f"--draft-vocab-size must be >= 1, got {args.draft_vocab_size}")
    if args.draft_vocab_size is None:  # 0: no cap on a vocabulary chosen by coverage
        args.draft_vocab_size = 0 if cover is not None else 8192
    for flag in ("data_skip", "code_prompts", "self_distill", "conversations", "micro_batch",
                 "pack_tokens"):
        if getattr(args, flag) < 0:
            raise SPDError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.crop_len is not None and args.crop_len < 0:
        raise SPDError(f"--crop-len must be >= 0, got {args.crop_len}")
    if args.max_len is not None and args.max_len < 16:
        raise SPDError(f"--max-len must be >= 16, got {args.max_len}")
    if args.eval_sequences < 1:
        raise SPDError(f"--eval-sequences must be >= 1, got {args.eval_sequences}")
    if args.regenerate_batch < 1:
        raise SPDError(f"--regenerate-batch must be >= 1, got {args.regenerate_batch}")
    if not args.rank_timeout > 0:
        raise SPDError(f"--rank-timeout must be > 0 seconds, got {args.rank_timeout}")
    if not 0 <= args.holdout < 1:
        raise SPDError(f"--holdout must lie in [0, 1), got {args.holdout}")
    if args.epochs is not None and not args.epochs > 0:
        raise SPDError(f"--epochs must be > 0, got {args.epochs}")
    if args.mode == "online" and args.method == "eagle3":
        raise SPDError("online training is for PDMs (--method spd or ppsd) for now; train the "
                       "EAGLE-3 head with --mode cached")
    from spd.train.batches import BatchPlan
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    BatchPlan(args.batch, args.micro_batch or max(1, args.batch // world), world)
    if args.data is not None:
        from spd.data.conversations import check_sources
        check_sources(args.data)


def _resolve_mode(args, target) -> str:
    if args.mode != "auto":
        mode = args.mode
    else:
        params = sum(p.numel() for p in target.hf.parameters())
        mode = "online" if args.data is not None or params > ONLINE_ABOVE_PARAMS else "cached"
    if mode == "online":
        given = [f"--{k.replace('_', '-')}" for k in BUILTIN_DATA
                 if getattr(args, k) not in (0, [], None) and
                 getattr(args, k) != _DEFAULTS.get(k)]
        if given:
            raise SPDError(f"{', '.join(given)} build the cached path's built-in data; online "
                           "training reads --data (and --regenerate answers it with the target)")
        if args.features or args.extra_features:
            raise SPDError("--features and --extra-features are feature caches: give "
                           "--mode cached to train on them")
    elif args.regenerate:
        raise SPDError("--regenerate is for online training (--mode online); the cached path "
                       "self-distils with --self-distill")
    return mode


_DEFAULTS = {"conversations": 600, "self_distill": 128}


def _job(args, method, target, mode: str) -> TrainJob:
    """The layout, precision and fill weights, checked before any data is built."""
    from spd.model.partition import DepthLayout
    from spd.model.stage_costs import resolve_split, target_costs
    from spd.train.loop import resolve_precision
    from spd.train.trainer import check_fill_weights

    anchors = parse_ints(args.anchors, "--anchors")
    split = resolve_split(args.split, lambda: target_costs(target), args.stages)
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
    gpu = target.device.type == "cuda"
    online = mode == "online"
    args.max_len = args.max_len or (2048 if online else 512)
    args.crop_len = args.crop_len if args.crop_len is not None else (0 if gpu else 256)
    args.lr = args.lr or (1e-4 if online else 1e-3)
    if args.loss_on == "answers" and not online:
        raise SPDError("--loss-on answers is for online training (the feature cache keeps no "
                       "turn boundaries)")
    args.loss_on = args.loss_on or ("answers" if online else "all")
    if not online:
        args.steps = args.steps or 1600
    return TrainJob(target=target, features=None, layout=layout,
                    precision=resolve_precision(args.precision, target.device),
                    fill_weights=fill_weights, options=args)


def _train_online(args, job: TrainJob, group) -> dict:
    import torch

    from spd.train.corpus import CorpusConfig
    from spd.train.methods import pdm_train_config
    from spd.train.online import train_online
    if job.options.method == "eagle3":
        raise SPDError("online training is for PDMs (--method spd or ppsd) for now; train "
                       "the EAGLE-3 head with --mode cached")
    corpus = CorpusConfig(sources=list(args.data or ["sharegpt"]), max_len=args.max_len,
                          too_long=args.too_long, holdout=args.holdout, seed=args.seed)
    cfg = pdm_train_config(training.get(args.method), job)
    epochs = args.epochs if args.epochs is not None else (None if args.steps else 1.0)
    return train_online(job.target, corpus, cfg, args.out, group=group, epochs=epochs,
                        regenerate_tokens=args.response_tokens if args.regenerate else 0,
                        regenerate_batch=args.regenerate_batch,
                        regenerate_dtype=getattr(torch, args.distill_dtype)
                        if args.distill_dtype else None, storage=args.storage)


def _train_cached(args, method, job: TrainJob, group) -> dict:
    import torch

    from spd.data.assets import cache_dir
    from spd.model.partition import default_anchors
    from spd.train.distill import FeatureSet, build_sequences, cached_sequences, extract_features
    target, layout = job.target, job.layout
    if group.world > 1 and method.name == "eagle3":
        raise SPDError("the EAGLE-3 head trains in one process; start it without torchrun")
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
    if group.main and (not meta.exists() or _unfinished(meta)):
        seqs = cached_sequences(Path(feat_dir) / "sequences.json", lambda: build_sequences(
            target, conversations=args.conversations, self_distill_prompts=args.self_distill,
            max_len=args.max_len, response_tokens=args.response_tokens, seed=args.seed,
            skip=args.data_skip, code_prompts=args.code_prompts, code_roots=args.code_roots,
            distill_dtype=getattr(torch, args.distill_dtype) if args.distill_dtype else None))
        extract_features(target, seqs, feat_anchors, feat_dir)
    group.sum_floats([0.0], "the end of feature extraction")  # rank 0 built the cache
    features = FeatureSet(list(args.extra_features) + [feat_dir], target)
    final = method.run(TrainJob(target=target, features=features, layout=layout,
                                precision=job.precision, fill_weights=job.fill_weights,
                                options=args, group=group))
    return {"out": args.out, "mode": "cached", "ranks": group.world, "final": final}


# the flags that decide which sequences the features are extracted from
DATA_OPTIONS = ("conversations", "self_distill", "max_len", "response_tokens", "seed",
                "data_skip", "code_prompts", "code_roots", "distill_dtype")


def _unfinished(meta_path) -> bool:
    meta = json.loads(meta_path.read_text())
    return not meta.get("shards") or not meta.get("complete")
