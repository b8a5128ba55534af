"""Pieces every subcommand shares: list parsing, the lookup flag, the model/layout flags, the
streamed and JSON output of a generation."""
from __future__ import annotations

import argparse
import json
import sys

from spd.errors import SPDError

# torch.Generator.manual_seed takes an unsigned 64-bit seed; the flag stops at 2**63 - 1 so
# that the grid's per-prompt seeds (seed + i) stay in range too
MAX_SEED = 2**63 - 1
SEED_HELP = "in [0, 2**63 - 1]"


def int_in(lo: int, hi: int | None = None):
    """argparse type: an integer in [lo, hi] (no upper bound when hi is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text}")
        return value
    parse.__name__ = "integer"
    return parse


def device_arg(text: str) -> str:
    """argparse type of --device: cpu, cuda or cuda:N (checked without importing torch)."""
    from spd.model.loading import check_device
    try:
        return check_device(text)
    except SPDError:
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got '{text}'") from None


def check_prompt(text: str, flag: str = "--prompt") -> str:
    """Refused before any model loads: an empty prompt, or one that is not UTF-8 (undecodable
    bytes in argv arrive as lone surrogates)."""
    if not text:
        raise SPDError(f"the prompt is empty: pass {flag} TEXT")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SPDError(f"{flag} is not valid UTF-8 text: pass it in the UTF-8 encoding") from None
    return text


def precheck_pdm(pdm) -> None:
    """A --pdm checkpoint folder's config and weights file, read before the target loads."""
    if pdm is not None and str(pdm) != "untrained":
        from spd.draft.pdm import check_pdm_folder
        check_pdm_folder(pdm)


def parse_ints(text, what):
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise SPDError(f"{what} must be comma-separated integers, got '{text}'") from exc


def parse_floats(text, what):
    try:
        return [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError as exc:
        raise SPDError(f"{what} must be comma-separated numbers, got '{text}'") from exc


def add_lookup_arg(p) -> None:
    from spd.draft.lookup import DEFAULT_MIN_LEN, MAX_LEN
    p.add_argument("--lookup", type=int_in(0, MAX_LEN), default=None, metavar="K",
                   help="when the last K or more tokens occurred earlier in the text, draft the "
                        "token that followed them there instead of the PDM's guess, unless the "
                        "PDM is surer than such a match tends to be right (output is "
                        f"unchanged; 0: the PDM alone; default {DEFAULT_MIN_LEN}, and 0 in the "
                        "--methods grid, which compares the drafters themselves)")


def check_lookup(k: int | None, default: int | None = None) -> int:
    if k is None:
        from spd.draft.lookup import DEFAULT_MIN_LEN
        return DEFAULT_MIN_LEN if default is None else default
    from spd.draft.lookup import MAX_LEN
    if k < 0 or k > MAX_LEN:
        raise SPDError(f"--lookup is a match length in [0, {MAX_LEN}] (0: off), got {k}")
    return k


def draft_weights_arg(text: str) -> str:
    """argparse type of --draft-weights: model, int8 or fp8 (spd.draft.pdm.DRAFT_WEIGHTS)."""
    from spd.draft.pdm import DRAFT_WEIGHTS
    if text not in DRAFT_WEIGHTS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DRAFT_WEIGHTS)}, got "
                                         f"'{text}'")
    return text


def add_draft_weights_arg(p) -> None:
    p.add_argument("--draft-weights", type=draft_weights_arg, default="model", metavar="KIND",
                   help="what the PDM's draft step reads: model (default: the PDM's own "
                        "dtype), int8 or fp8 (e4m3): weight-only quantised copies, one scale "
                        "per output row, half the weight bytes of bf16 per draft step. The "
                        "output is unchanged (verification is exact); only the acceptance rate "
                        "may move")


def tree_width_arg(text: str) -> int:
    """argparse type of --tree-width: an integer in [1, 16]."""
    try:
        width = int(text)
    except ValueError:
        width = None
    if width is None or not 1 <= width <= 16:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 16] (1: a chain), got "
                                         f"'{text}'")
    return width


def add_tree_width_arg(p) -> None:
    p.add_argument("--tree-width", type=tree_width_arg, default=1, metavar="W",
                   help="candidate tokens in flight per position (default 1: a chain of "
                        "drafts). W > 1 drafts a token tree: up to W rows per stage per cycle, "
                        "the W most probable branches by the PDM's cumulative probability; "
                        "more drafts are accepted (a higher S_theory) at W times the rows per "
                        "stage step, which a GPU reads with the same weights but a CPU computes "
                        "W times over. One process only for now; not on hybrid targets")


def dtype_arg(text: str) -> str:
    """argparse type of --dtype: a name of spd.model.loading.DTYPE_NAMES or a short form."""
    from spd.model.loading import DTYPE_ALIASES, DTYPE_NAMES
    name = DTYPE_ALIASES.get(text.lower(), text.lower())
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPE_NAMES)} (or "
                                         f"{', '.join(DTYPE_ALIASES)}), got '{text}'")
    return name


def add_dtype_arg(p) -> None:
    p.add_argument("--dtype", default="auto", type=dtype_arg, metavar="DTYPE",
                   help="the target's weights: auto (default: float32 on the CPU, bfloat16 on "
                        "a GPU), float32, bfloat16 or float16 (or fp32, bf16, fp16); the output "
                        "is exactly that dtype's target. bfloat16 suits CPUs with native bf16 "
                        "(AVX512-BF16 / AMX)")


def add_model_layout_args(p, stages_help: str = "pipeline stages n") -> None:
    """The target and how it is cut into stages: the flags every command that loads one shares."""
    p.add_argument("--model", default=None,
                   help="local Hugging Face folder (Llama/Qwen2/Qwen3/Qwen3.5/Qwen3-Next), or a "
                        "repo id (org/name) found in the local Hugging Face cache; default: "
                        "SmolLM2-135M-Instruct, fetched and converted once into $SPD_CACHE")
    p.add_argument("--stages", type=int, default=4, help=stages_help)
    p.add_argument("--split", default=None,
                   help="layers per stage, e.g. 8,8,7,7, or auto: equal stage times by bytes read "
                        "per step (weights, KV at 1024 tokens; the last stage also the LM head it "
                        "verifies with); default uniform")
    p.add_argument("--anchors", default=None,
                   help="anchor hidden-state indices, e.g. 0,8,15,23,29 (default: 0, L/4, L/2, "
                        "3L/4, L-1)")
    p.add_argument("--device", type=device_arg, default="cpu",
                   help="cpu (default), cuda or cuda:N")
    add_dtype_arg(p)


class Streamer:
    """Prints text as tokens arrive, decoded incrementally (spd.runtime.text: a character split
    over tokens is printed once complete)."""

    def __init__(self, tokenizer):
        from spd.runtime.text import IncrementalText
        self.text = IncrementalText(tokenizer)

    def __call__(self, token_id: int) -> None:
        piece = self.text.add(token_id)
        if piece:
            sys.stdout.write(piece)
            sys.stdout.flush()


def print_generation(tokenizer, result, as_json: bool, quiet: bool = False) -> None:
    """The end of `generate`: one JSON object, or a newline after the streamed text and (unless
    quiet) the summary line."""
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    st = result.stats
    if as_json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "stats": st.as_dict()}))
    else:
        print()
        if not quiet:
            print(f"[spd] {st.summary()} prefill={st.prefill_s * 1000:.0f} ms")
    sys.stdout.flush()


def warn_untrained_pdm(detail: bool = True) -> None:
    """Printed when no trained PDM matches the target and layout (output stays exact)."""
    msg = "[spd] warning: no trained PDM for this target and layout; using an untrained one"
    if detail:
        msg += (". Output is still exactly the target's, but most drafts are rejected, so "
                "decoding is slow.")
    print(msg, file=sys.stderr)
