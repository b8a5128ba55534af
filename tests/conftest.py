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

    def draft(self, anchors, types, start, position, sampling, uniform, last=None):
        super().draft(anchors, types, start, position, sampling, uniform, last)
        return self.ref.draft(anchors, types, start, position, sampling, uniform, last)


class NoisyTreeDrafter(PDMDrafter):
    """The real PDM over the tree (its cache recomputed as usual), then at each leaf the
    reference token (the target's own continuation at the drafted position) is made the top
    child with probability `accuracy`, else put at a random lower rank (accepted through a
    non-top row) or last (absent: a rejection, or a gap when no leaf has it). `mix` adds the
    features of each leaf's branch to its logits, so the tree depends on every anchor row the
    drafter reads (a misplaced feature changes it). All on the device: a cycle reads nothing
    on the host (the random choices come from a CPU generator, as ReferenceDrafter's)."""

    def __init__(self, pdm, reference, accuracy, seed, lookup=0, mix=0.0):
        super().__init__(pdm, lookup=lookup)
        self.reference, self.accuracy, self.mix = reference, accuracy, mix
        self.gen = torch.Generator().manual_seed(seed)

    def begin(self, capacity, vocab_size):
        super().begin(capacity, vocab_size)
        dev = self.pdm.lm_head.weight.device
        ref = (self.reference + [0] * capacity)[:capacity]
        self.table = torch.tensor(ref, device=dev)
        d2t = self.pdm.draft_to_target
        self.column = torch.full((vocab_size,), d2t.numel() - 1, dtype=torch.int64, device=dev)
        self.column[d2t] = torch.arange(d2t.numel(), device=dev)
        if self.mix:
            g = torch.Generator().manual_seed(7)
            self.proj = torch.randn(self.pdm.config.hidden_size, d2t.numel(), generator=g).to(dev)

    def tree_logits(self, anchors, types, positions, slots, prefix_len, tree_mask, leaves):
        logits = super().tree_logits(anchors, types, positions, slots, prefix_len, tree_mask,
                                     leaves).float()
        W, V = logits.shape
        if self.mix:  # the features of the rows each leaf sees (its branch) reach its logits
            sees = tree_mask.index_select(0, leaves).float()                 # [W, R]
            feats = self.pdm.features(anchors, types).float()
            shared = (sees @ feats / sees.sum(1, keepdim=True)) @ self.proj  # [W, V]
            logits = logits * 6.0 + shared / shared.std(-1, keepdim=True).clamp(min=1e-6)
        position = positions.index_select(0, leaves[:1]) + 1
        col = self.column.index_select(0, self.table.index_select(0, position)).expand(W)
        dev = logits.device
        r = torch.rand(W, generator=self.gen).to(dev)
        rank = torch.randint(1, 4, (W,), generator=self.gen).clamp(max=V - 1).to(dev)
        ranked = logits.sort(dim=-1, descending=True).values
        value = torch.where(r < self.accuracy, ranked[:, 0] + 1.0,
                            torch.where(r < (1 + self.accuracy) / 2,
                                        ranked.gather(1, rank.view(W, 1)).view(W) - 1e-3,
                                        ranked[:, -1] - 10.0))
        return logits.scatter(1, col.view(W, 1), value.view(W, 1))


def noisy_tree_drafter(reference, accuracy, seed, engine, mix=0.0):
    """A NoisyTreeDrafter over `engine`'s PDM (a picklable factory for distributed requests)."""
    return NoisyTreeDrafter(engine.pdm, reference, accuracy, seed, mix=mix)


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

    def draft(self, anchors, types, start, position, sampling, uniform, last=None):
        self.logits.append(self.draft_logits(anchors, types, start, last).clone())
        return self.ref.draft(anchors, types, start, position, sampling, uniform, last)


# --- where the stages run: one test set for every runtime ----------------------------------------
# "process": every stage in this process (spd.runtime.engine.LocalStages); "ranks": n stage ranks
# and rank 0 (gloo, self-launched); "stage": n ranks, the draft on stage n // 2 (--draft-on-stage)
PLACES = ("process", "ranks", "stage")


def engine_for(factory, n: int, width: int = 1, lookup: int = 0, ahead: int = 2):
    """The one-process engine on factory(0) (a tiny target factory(rank) -> TargetModel)."""
    from spd import SPDEngine
    return SPDEngine(factory(0), n_stages=n, tree_width=width, lookup=lookup, ahead=ahead,
                     warn_untrained=False)


def request_drafter(req, engine):
    """A GenerateRequest's drafter on `engine` (spd.distributed.rank.run_requests' rule)."""
    if req.drafter is not None:
        return req.drafter(engine)
    if req.reference is not None:
        return ReferenceDrafter(req.reference, req.reference_accuracy, req.reference_seed)
    return None


def decode_in(place: str, factory, n: int, requests, *, width: int = 1, lookup: int = 0,
              ahead: int = 2, timeout: float = 300.0):
    """The GenerationResults of `requests` (spd.distributed.config.GenerateRequest) with the
    stages `place`d (PLACES). `factory(rank)` makes the target in every process: picklable."""
    from functools import partial

    from spd.distributed.config import DistConfig
    from spd.distributed.launch import launch_local
    from spd.distributed.rank import run_requests
    if place == "process":
        eng = engine_for(factory, n, width, lookup, ahead)
        return [eng.generate(r.prompt_ids, r.max_new_tokens, r.sampling,
                             drafter=request_drafter(r, eng), stop_token_ids=r.stop_token_ids)
                for r in requests]
    config = DistConfig(n_stages=n, target_factory=factory, tree_width=width, lookup=lookup,
                        ahead=ahead, fault_timeout=10.0, op_timeout=120.0, threads=1,
                        draft_on_stage=n // 2 if place == "stage" else None)
    return launch_local(config, partial(run_requests, list(requests)), timeout=timeout)


def tiny_factory(seed: int, rank: int, vocab: int = 48, layers: int = 4):
    """make_tiny_target for every rank (partial(tiny_factory, seed) is picklable)."""
    return make_tiny_target(seed=seed, vocab=vocab, layers=layers)


def tiny_hybrid_factory(seed: int, rank: int, vocab: int = 32):
    """make_tiny_hybrid for every rank (Qwen3.5, attention first and last)."""
    return make_tiny_hybrid(seed=seed, vocab=vocab, layer_types=(
        "full_attention", "linear_attention", "linear_attention", "full_attention"))


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
