"""Shared fixtures: tiny random-init targets (fast) and the real default model (slow, cached)."""
from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

# The Triton interpreter must be chosen before any kernel module is imported: on a CPU machine
# it is how the Triton kernels run at all; on a GPU it would turn them off for CUDA tensors (the
# GPU tests would then have nothing to run), so there Triton compiles for the GPU unless asked.
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"

from spd.draft.drafters import PDMDrafter, ReferenceDrafter  # noqa: E402
from spd_kernels import dispatch  # noqa: E402
from spd_kernels.testing import SIMT_SKIP_REASON, TRITON_DEVICE, TRITON_SKIP_REASON  # noqa: E402

# Every kernel module registered now, as tests walk and patch the registry (a process of the
# runtime imports them only when a kernel may run: tests/kernels/test_dispatch_lazy.py).
dispatch.load_deferred()

# Skip markers shared by the test folders (`from conftest import needs_gpu`); each says why.
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(TRITON_DEVICE is None, reason=TRITON_SKIP_REASON)
needs_triton_interpreter = pytest.mark.skipif(TRITON_DEVICE != "cpu",
                                              reason="needs the Triton interpreter")
needs_simt = pytest.mark.skipif(SIMT_SKIP_REASON is not None, reason=str(SIMT_SKIP_REASON))
GPU_BACKENDS = ("triton", "cuda")  # what the GPU tests of an op run it on, one by one


def gpu_backend(op: str, backend: str) -> str:
    """`backend` for a GPU test of `op`, or a skip that says why it cannot run here (no GPU, no
    built extension, Triton in its CPU interpreter). The test then forces it (`backend=`),
    which raises rather than fall back, so a test that passes ran it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if not dispatch.has(op, backend):
        pytest.skip(f"{op} has no {backend} kernel")
    why = dispatch.backend_unavailable(backend, torch.device("cuda"))
    if why is not None:
        pytest.skip(f"{op} on {backend}: {why}")
    return backend


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


class NoisyPDMDrafter(PDMDrafter):
    """Runs the real PDM (so its cache is cropped and recomputed as usual) but proposes the
    reference token with probability `accuracy`: random accept/reject sequences."""

    def __init__(self, pdm, reference, accuracy, seed):
        super().__init__(pdm)
        self.ref = ReferenceDrafter(reference, accuracy, seed)

    def begin(self, capacity, vocab_size):
        super().begin(capacity, vocab_size)
        self.ref.begin(capacity, vocab_size)

    def prefill(self, anchors, types):
        super().prefill(anchors, types)
        self.ref.prefill(anchors, types)

    def draft(self, anchors, types, start, position, sampling, uniform):
        super().draft(anchors, types, start, position, sampling, uniform)
        return self.ref.draft(anchors, types, start, position, sampling, uniform)


class NoisyTreeDrafter(PDMDrafter):
    """Runs the real PDM over the tree, then reorders each leaf's logits so the reference token
    (the target's own continuation at the drafted position) is the top child with probability
    `accuracy`, else at a random lower rank (accepted through a non-top row) or absent."""

    def __init__(self, pdm, reference, accuracy, seed, lookup=0):
        super().__init__(pdm, lookup=lookup)
        self.reference, self.accuracy = reference, accuracy
        self.gen = torch.Generator().manual_seed(seed)

    def tree_logits(self, anchors, types, positions, slots, prefix_len, tree_mask, leaves):
        logits = super().tree_logits(anchors, types, positions, slots, prefix_len, tree_mask,
                                     leaves)
        position = max(positions) + 1
        token = self.reference[position] if position < len(self.reference) else 0
        col = int((self.pdm.draft_to_target == token).nonzero()[0])
        out = logits.clone()
        for i in range(out.shape[0]):
            r = float(torch.rand((), generator=self.gen))
            ranked = out[i].sort(descending=True).values
            if r < self.accuracy:
                out[i, col] = ranked[0] + 1.0
            elif r < (1 + self.accuracy) / 2:
                rank = int(torch.randint(1, 4, (), generator=self.gen))
                out[i, col] = ranked[min(rank, len(ranked) - 1)] - 1e-3
            else:
                out[i, col] = ranked[-1] - 10.0
        return out


class FeatureTreeDrafter(PDMDrafter):
    """The real PDM over the tree, its logits sharpened, and at each leaf the reference token
    (the target's own continuation at the drafted position) raised by a random amount with
    probability `accuracy`. Unlike NoisyTreeDrafter, every other child and the order of the
    rows follow the PDM's logits, so they depend on every anchor row the drafter reads (a
    missing or misplaced feature changes the tree, and so N, K or the judged drafts), and the
    children of one position come from several leaves (an accepted row keeps some of them, not
    all: the surviving lanes are not a prefix of the draft's)."""

    def __init__(self, pdm, reference, accuracy, seed, sharpen=6.0):
        super().__init__(pdm)
        self.reference, self.accuracy, self.sharpen = reference, accuracy, sharpen
        self.gen = torch.Generator().manual_seed(seed)
        self.trace: list[tuple[tuple[int, ...], list[float]]] = []  # per call: rows, features

    def tree_logits(self, anchors, types, positions, slots, prefix_len, tree_mask, leaves):
        logits = super().tree_logits(anchors, types, positions, slots, prefix_len, tree_mask,
                                     leaves)
        # every row's features (the anchors its depth reads) reach every leaf's logits: the
        # untrained PDM's attention alone mixes them too weakly to change the tree
        feats = self.pdm.features(anchors, types).float()
        self.trace.append((tuple(positions), feats.sum(-1).tolist()))
        mix = torch.Generator().manual_seed(7)
        proj = torch.randn(feats.shape[-1], logits.shape[-1], generator=mix)
        shared = feats.mean(0) @ proj
        out = logits.float() * self.sharpen + shared / shared.std()
        out = out - out.mean(-1, keepdim=True)
        position = max(positions) + 1
        token = self.reference[position] if position < len(self.reference) else 0
        hit = (self.pdm.draft_to_target == token).nonzero()
        for i in range(out.shape[0]):  # per leaf: the target's token raised, or not
            boost = float(torch.rand((), generator=self.gen)) * 2 * out[i].std()
            if len(hit) and float(torch.rand((), generator=self.gen)) < self.accuracy:
                out[i, int(hit[0])] += boost
        return out


def feature_tree_drafter(reference, accuracy, seed, engine):
    """A FeatureTreeDrafter over `engine`'s PDM (a picklable factory for distributed requests)."""
    return FeatureTreeDrafter(engine.pdm, reference, accuracy, seed)


def run_traced(requests, engine):
    """A rank-0 job (spd.distributed.rank.run_requests) that also returns each request's
    drafter trace: [(result, trace)]."""
    out = []
    for req in requests:
        drafter = req.drafter(engine.engine)
        result = engine.generate(req.prompt_ids, req.max_new_tokens, req.sampling,
                                 drafter=drafter)
        out.append((result, drafter.trace))
    return out


def noisy_tree_drafter(reference, accuracy, seed, engine):
    """A NoisyTreeDrafter over `engine`'s PDM (a picklable factory for distributed requests)."""
    return NoisyTreeDrafter(engine.pdm, reference, accuracy, seed)


class RecordingDrafter(PDMDrafter):
    """Runs the real PDM step (graph or eager) and records its logits, but proposes the
    reference token with probability `accuracy`, so two runs see the same accept/reject path."""

    def __init__(self, pdm, reference, accuracy, cuda_graphs):
        super().__init__(pdm, cuda_graphs=cuda_graphs)
        self.ref = ReferenceDrafter(reference, accuracy, seed=1)
        self.logits = []

    def begin(self, capacity, vocab_size):
        super().begin(capacity, vocab_size)
        self.ref.begin(capacity, vocab_size)

    def draft(self, anchors, types, start, position, sampling, uniform):
        self.logits.append(self.draft_logits(anchors, types, start).clone())
        return self.ref.draft(anchors, types, start, position, sampling, uniform)


def check_stages_match_hf(t, stages, vocab: int = 40) -> None:
    """A 9-row prompt chunk, then 4 tokens one at a time (the decode pattern), through `stages`
    (fresh, covering every layer of `t`): each layer's output and the logits equal HF's."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab, (13,), generator=g)
    with torch.no_grad():
        ref = t.hf(ids[None], output_hidden_states=True)
    seen = {}

    def record(idx, h):
        seen.setdefault(idx, []).append(h.clone())

    h = t.embed_tokens(ids[:9])
    for st in stages:
        h = st.forward(h, 0, record)
    outs = [h]
    for p in range(9, 13):
        h = t.embed_tokens(ids[p:p + 1])
        for st in stages:
            h = st.forward(h, p, record)
        outs.append(h)
    final = torch.cat(outs)
    # (hybrid targets: HF runs a chunk through the chunked delta rule, ~1e-6 from the recurrent
    # form; the tolerances cover it)
    for layer_out in range(1, t.num_layers):  # HF's last hidden state is after the final norm
        got = torch.cat(seen[layer_out])
        torch.testing.assert_close(got, ref.hidden_states[layer_out][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(t.logits(final), ref.logits[0].float(), rtol=1e-4, atol=1e-4)
    assert all(st.cache.length == 13 for st in stages)


def bench_module(name: str):
    """benchmarks/<name>.py as a module (tests share a probe's measurement code with it)."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def weight_reads(monkeypatch):
    """(read, sampled): the tensor names WeightFiles reads whole and samples (the fingerprint's
    reads), in order, while the test runs."""
    from spd.model.weight_files import WeightFiles
    read, sampled = [], []
    real_read, real_sample = WeightFiles.read_into, WeightFiles.sample
    monkeypatch.setattr(WeightFiles, "read_into",
                        lambda self, k, dst: (read.append(k), real_read(self, k, dst))[1])
    monkeypatch.setattr(WeightFiles, "sample",
                        lambda self, k, c: (sampled.append(k), real_sample(self, k, c))[1])
    return read, sampled
