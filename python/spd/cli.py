"""Command line: `python -m spd generate --prompt TEXT ...` (see `python -m spd generate -h`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from spd.errors import SPDError


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="decode one prompt with SPD (or autoregressively)",
                       description="Decode one prompt with speculative pipeline decoding. The "
                       "output is exactly the target's own (greedy or sampled).")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--model", default=None,
                   help="local Hugging Face folder (Llama/Qwen2/Qwen3); default: "
                        "SmolLM2-135M-Instruct, fetched and converted once into $SPD_CACHE")
    p.add_argument("--pdm", default=None, help="PDM checkpoint folder (default: untrained PDM)")
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
    import torch

    from spd.engine import SamplingParams, SPDEngine
    from spd.loading import load_target

    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_new_tokens < 1:
        raise SPDError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SPDError("--device cuda was requested but no CUDA device is available")
    target = load_target(args.model, device=args.device)
    n = 1 if args.mode == "ar" else args.stages
    engine = SPDEngine(target, n_stages=n, split=_parse_ints(args.split, "--split"),
                       anchors=_parse_ints(args.anchors, "--anchors"), pdm=args.pdm,
                       pdm_layers=args.pdm_layers, warn_untrained=False)
    if args.pdm is None and n >= 2:
        print("[spd] warning: no trained PDM given (--pdm); using an untrained one. Output is "
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spd",
                                     description="Speculative Pipeline Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    return parser


def main(argv=None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SPDError as exc:
        print(f"spd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspd: interrupted", file=sys.stderr)
        return 130
