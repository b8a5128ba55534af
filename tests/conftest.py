"""Shared fixtures: tiny random-init targets (fast) and the real default model (slow, cached)."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

# The Triton interpreter must be chosen before any kernel module is imported (CPU machines).
os.environ.setdefault("TRITON_INTERPRET", "1")

from spd_kernels.testing import SIMT_SKIP_REASON, TRITON_DEVICE, TRITON_SKIP_REASON  # noqa: E402

# Skip markers shared by the test folders (`from conftest import needs_gpu`); each says why.
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason=TRITON_SKIP_REASON)
needs_triton_interpreter = pytest.mark.skipif(TRITON_DEVICE != "cpu",
                                              reason="needs the Triton interpreter")
needs_simt = pytest.mark.skipif(SIMT_SKIP_REASON is not None, reason=str(SIMT_SKIP_REASON))


def make_tiny_target(seed: int = 0, vocab: int = 16, layers: int = 4, hidden: int = 32,
                     heads: int = 4, kv_heads: int = 2, model_type: str = "llama",
                     head_scale: float = 4.0, max_pos: int = 256):
    """A random Llama/Qwen3 target with peaky next-token distributions (head weights scaled)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    from spd.model.target import TargetModel

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              max_position_embeddings=max_pos, tie_word_embeddings=False,
              eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if model_type == "qwen3":
        cfg.head_dim = hidden // heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.generation_config.eos_token_id = None
    return TargetModel(model, tokenizer=None, name=f"tiny-{model_type}-{seed}")


def pytest_configure(config):
    # on a GPU: a test that faults a kernel fails itself, not every later test (cuda_guard.py)
    from cuda_guard import CudaContextGuard
    config.pluginmanager.register(CudaContextGuard(), "spd-cuda-context-guard")


@pytest.fixture
def tiny_target():
    return make_tiny_target()


@pytest.fixture(scope="session")
def default_target():
    from spd.model.loading import load_target
    return load_target(None)


@pytest.fixture(autouse=True)
def _quiet_untrained_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no trained PDM")
        yield


def make_tiny_hybrid(seed: int = 0, vocab: int = 16, model_type: str = "qwen3_5",
                     layer_types=("linear_attention", "full_attention", "linear_attention",
                                  "linear_attention"),
                     hidden: int = 32, head_scale: float = 4.0, max_pos: int = 256,
                     randomise_norms: bool = True):
    """A random hybrid (Qwen3.5 text / Qwen3-Next) target with peaky next-token distributions.
    Norm weights, A_log and dt_bias are random too (HF initialises the norms to 0 / 1)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig

    from spd.model.target import TargetModel
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  max_position_embeddings=max_pos, tie_word_embeddings=False,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    if model_type == "qwen3_next":  # mixture-of-experts MLP on every second layer
        cfg = Qwen3NextConfig(**common, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=16,
                              decoder_sparse_step=2)
    else:
        cfg = Qwen3_5TextConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
        for name, p in model.named_parameters():
            if randomise_norms and ("norm" in name or "dt_bias" in name or "A_log" in name):
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None
    return TargetModel(model, tokenizer=None, name=f"tiny-{model_type}-{seed}")
