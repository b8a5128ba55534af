"""The backend dispatcher: automatic choice and fallback, SPD_BACKEND / use_backend / backend=
forcing with clear errors, and the SPD engine staying lossless with every op forced to Triton."""
import pytest
import torch
from conftest import make_tiny_target, needs_gpu, needs_simt

from spd import SamplingParams, SPDEngine
from spd_kernels import SPDBackendError, _cuda, dispatch, truncate_kv_, use_backend
from spd_kernels.testing import TRITON_DEVICE

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_triton_cpu = pytest.mark.skipif(TRITON_DEVICE != "cpu",
                                      reason="needs the Triton interpreter (TRITON_INTERPRET=1)")
CPU = torch.device("cpu")
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("SPD_BACKEND", raising=False)


def test_auto_on_cpu_is_reference_for_every_op():
    for op in dispatch.ops():
        assert dispatch.select(op, CPU)[0] == "reference"
        assert "reference" in dispatch.available(op, CPU)
    info = dispatch.describe()
    assert set(info["ops"]) == set(dispatch.ops())
    assert all("reference" in v["implemented"] and "triton" in v["implemented"]
               for v in info["ops"].values())


def test_on_request_only_kernels_are_passed_over_by_the_automatic_choice(monkeypatch):
    """A backend registered with automatic=False (the CUDA sampler, not yet timed on a GPU) runs
    when named but never by default: here with the cuda-first order of a GPU and a fake op."""
    calls = []
    impls = {"cuda": dispatch._Impl(lambda: calls.append("cuda"), automatic=False),
             "reference": dispatch._Impl(lambda: calls.append("reference"))}
    monkeypatch.setitem(dispatch._REGISTRY, "verify_greedy", impls)
    monkeypatch.setattr(dispatch, "_auto_order", lambda device: ("cuda", "triton", "reference"))
    monkeypatch.setattr(dispatch, "backend_unavailable", lambda backend, device: None)
    assert dispatch.select("verify_greedy", CPU)[0] == "reference"
    assert dispatch.select("verify_greedy", CPU, backend="cuda")[0] == "cuda"
    monkeypatch.setenv("SPD_BACKEND", "verify_greedy=cuda")
    dispatch.call("verify_greedy", CPU)
    assert calls == ["cuda"]
    assert dispatch.describe()["ops"]["verify_greedy"]["on_request_only"] == ["cuda"]


def test_the_cuda_sampler_is_on_request_only():
    info = dispatch.describe()["ops"]
    assert "cuda" in info["rejection_sample_logits"]["on_request_only"]
    assert "cuda" not in info["verify_greedy"]["on_request_only"]


@needs_triton_cpu
def test_env_forces_backend_globally_and_per_op(monkeypatch):
    monkeypatch.setenv("SPD_BACKEND", "triton")
    assert dispatch.select("verify_greedy", CPU)[0] == "triton"
    monkeypatch.setenv("SPD_BACKEND", "triton,truncate_kv=reference")
    assert dispatch.select("verify_greedy", CPU)[0] == "triton"
    assert dispatch.select("truncate_kv", CPU)[0] == "reference"
    monkeypatch.setenv("SPD_BACKEND", "anchor_projection=triton")
    assert dispatch.select("anchor_projection", CPU)[0] == "triton"
    assert dispatch.select("verify_greedy", CPU)[0] == "reference"
    monkeypatch.setenv("SPD_BACKEND", "auto")
    assert dispatch.select("verify_greedy", CPU)[0] == "reference"


def test_env_errors(monkeypatch):
    monkeypatch.setenv("SPD_BACKEND", "warp_drive")
    with pytest.raises(SPDBackendError, match="unknown backend 'warp_drive'"):
        dispatch.select("verify_greedy", CPU)
    monkeypatch.setenv("SPD_BACKEND", "not_an_op=triton")
    with pytest.raises(SPDBackendError, match="unknown op 'not_an_op'"):
        dispatch.select("verify_greedy", CPU)


def test_explicit_unavailable_backend_raises_clearly(monkeypatch):
    with pytest.raises(SPDBackendError, match="cuda backend was requested.*CUDA tensors"):
        dispatch.select("verify_greedy", CPU, backend="cuda")
    # every op has a CUDA kernel today: take one away to see the message for a missing one
    monkeypatch.delitem(dispatch._REGISTRY["qkv_rope_append"], "cuda")
    with pytest.raises(SPDBackendError, match="qkv_rope_append has no cuda implementation"):
        dispatch.select("qkv_rope_append", CPU, backend="cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    with pytest.raises(SPDBackendError, match="TRITON_INTERPRET=1"):
        dispatch.select("verify_greedy", CPU, backend="triton")
    assert dispatch.select("verify_greedy", CPU)[0] == "reference"  # auto never raises for it
    monkeypatch.setattr(dispatch, "triton_installed", lambda: False)
    with pytest.raises(SPDBackendError, match="Triton is not installed"):
        dispatch.select("verify_greedy", CPU, backend="triton")


@needs_triton_cpu
def test_precedence_and_context(monkeypatch):
    monkeypatch.setenv("SPD_BACKEND", "reference")
    with use_backend("triton"):
        assert dispatch.select("verify_greedy", CPU)[0] == "triton"
        assert dispatch.select("verify_greedy", CPU, backend="reference")[0] == "reference"
        with use_backend(verify_greedy="reference"):
            assert dispatch.select("verify_greedy", CPU)[0] == "reference"
            assert dispatch.select("truncate_kv", CPU)[0] == "reference"  # env applies again
        assert dispatch.select("truncate_kv", CPU)[0] == "triton"
    assert dispatch.select("verify_greedy", CPU)[0] == "reference"
    with pytest.raises(SPDBackendError, match="unknown op"):
        with use_backend(no_such_op="triton"):
            pass


@needs_triton_cpu
def test_auto_skips_a_backend_that_does_not_support_the_arguments(monkeypatch):
    monkeypatch.setattr(dispatch, "_auto_order", lambda device: ("triton", "reference"))
    length = torch.tensor([4, 4])
    mixed = [torch.randn(2, 1, 6, 2), torch.randn(2, 1, 6, 2).half()]
    args = (length, torch.tensor(2), mixed, -2, True)
    assert dispatch.select("truncate_kv", CPU, args)[0] == "reference"
    same = [torch.randn(2, 1, 6, 2), torch.randn(2, 1, 6, 2)]
    assert dispatch.select("truncate_kv", CPU, (length, torch.tensor(2), same, -2, True))[0] == "triton"
    with pytest.raises(SPDBackendError, match="one shape and dtype"):
        truncate_kv_(length, torch.tensor(2), mixed, poison=True, backend="triton")


@needs_simt
@pytest.mark.parametrize("n", [2, 3])
def test_engine_lossless_with_the_cuda_kernels_in_host_emulation(n):
    """The CUDA C++ kernels, run on the CPU by the host emulation: greedy SPD with verify, KV
    truncation (with NaN poison) and the anchor projection on the cuda backend reproduces
    autoregressive decoding; sampled SPD with the CUDA rejection sampler reproduces the
    reference backends' run (same uniforms)."""
    cuda_ops = dict(verify_greedy="cuda", truncate_kv="cuda", anchor_projection="cuda")
    t = make_tiny_target(seed=60 + n, vocab=40, layers=4)
    eng = SPDEngine(t, n_stages=n, anchors=[0, 2, 3], debug_poison=True)
    ar = eng.generate_ar(PROMPT, 16).token_ids
    with _cuda.simulated(), use_backend(**cuda_ops):
        res = eng.generate(PROMPT, 16)
    assert res.token_ids == ar
    assert res.stats.drafts_judged > res.stats.drafts_accepted  # rollbacks happened
    sp = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=5)
    ref = eng.generate(PROMPT, 10, sp).token_ids
    with _cuda.simulated(), use_backend(rejection_sample_logits="cuda", **cuda_ops):
        assert eng.generate(PROMPT, 10, sp).token_ids == ref


@pytest.fixture
def one_thread():
    """The interpreter's numpy work and torch's OpenMP pool fight over 2 cores: one torch thread
    keeps this test from crawling on a busy machine (the results do not depend on it)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@needs_triton_cpu
@pytest.mark.parametrize("n", [3])
def test_engine_lossless_with_every_op_on_triton(n, one_thread):
    """Greedy SPD with verify, KV truncation (with NaN poison) and the anchor projection all run
    by the Triton kernels must reproduce autoregressive decoding token for token; sampled SPD must
    reproduce the reference backends' run (same uniforms, bit-exact rejection sampling)."""
    t = make_tiny_target(seed=40 + n, vocab=40, layers=4)
    eng = SPDEngine(t, n_stages=n, anchors=[0, 2, 3], debug_poison=True)
    ar = eng.generate_ar(PROMPT, 16).token_ids
    with use_backend("triton"):
        res = eng.generate(PROMPT, 16)
    assert res.token_ids == ar
    assert res.stats.drafts_judged > res.stats.drafts_accepted  # rollbacks happened
    sp = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, seed=5)
    ref = eng.generate(PROMPT, 10, sp).token_ids
    with use_backend("triton"):
        assert eng.generate(PROMPT, 10, sp).token_ids == ref


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("backend,programmatic", [("triton", False), ("cuda", False),
                                                  ("triton", True), ("cuda", True)])
def test_gpu_engine_lossless_under_each_backend(backend, programmatic):
    """On a GPU, greedy SPD with verify / truncation (poisoned) / anchor projection on `backend`
    (also as programmatic dependent launches, SPD_PDL=1) reproduces
    autoregressive decoding (reference backends) token for token."""
    from spd.model.target import TargetModel
    ops = ("verify_greedy", "truncate_kv", "anchor_projection")
    if any(backend not in dispatch.available(op, "cuda") for op in ops):
        pytest.skip(f"{backend} backend not available for CUDA tensors here")
    for n in (2, 4):
        cpu = make_tiny_target(seed=50 + n, vocab=64, layers=4)
        t = TargetModel(cpu.hf.to("cuda"), None, name=cpu.name)
        eng = SPDEngine(t, n_stages=n, anchors=[0, 2, 3], debug_poison=True)
        with use_backend("reference"):
            ar = eng.generate_ar(PROMPT, 24).token_ids
        with use_backend(**{op: backend for op in ops}), _cuda.programmatic_launch(programmatic):
            res = eng.generate(PROMPT, 24)
        assert res.token_ids == ar


def test_python_m_spd_kernels_reports_the_picks():
    """`python -m spd_kernels` lists every op with the backend it would run on each device, and
    says why when SPD_BACKEND forces one that cannot run here."""
    import json
    import os
    import subprocess
    import sys
    env = dict(os.environ, SPD_BACKEND="fused_linear=cuda", TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-m", "spd_kernels", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert set(info["ops"]) == set(dispatch.ops()) and info["spd_backend_env"] == "fused_linear=cuda"
    assert info["ops"]["verify_greedy"]["picked"]["cpu"] == "reference"
    assert "cuda" in info["ops"]["cache_attention"]["on_request_only"]
    assert "need CUDA tensors" in info["ops"]["fused_linear"]["picked"]["cpu"]
    table = subprocess.run([sys.executable, "-m", "spd_kernels"], env=env, capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0 and "cache_attention" in table.stdout
    assert "SPD_BACKEND: fused_linear=cuda" in table.stdout


@needs_simt
def test_engine_drafts_through_the_cuda_pdm_step_in_host_emulation():
    """A bf16 target whose PDM has head_dim 64: every op of the draft step (QKV products, norm /
    RoPE / append, attention, dense layers, draft head) on the CUDA kernels in the host emulation,
    with the runtime's own caches, views and positions (40 tokens: the cache outgrows one 32-key
    tile, so the attention's key splits and their merge run too). The output stays the target's
    greedy decode (the verifier is the reference), and every draft's logits match the reference
    step's at the same call, so the kernels compute the step the runtime expects."""
    from spd.model.target import TargetModel
    cpu = make_tiny_target(seed=71, vocab=48, layers=4, hidden=128, heads=2, kv_heads=1)
    t = TargetModel(cpu.hf.to(torch.bfloat16), None, name=cpu.name)
    eng = SPDEngine(t, n_stages=3, anchors=[0, 2, 3], lookup=0, warn_untrained=False)
    assert eng.pdm.config.head_dim == 64 and next(eng.pdm.parameters()).dtype == torch.bfloat16
    logits = {"reference": [], "cuda": []}
    step = eng.pdm.step

    def recording(*args):
        out = step(*args)
        logits[run].append(out.float().clone())
        return out
    eng.pdm.step = recording  # the drafter calls pdm.step: record each draft's logits
    run = "reference"
    ar = eng.generate_ar(PROMPT, 40).token_ids
    ref = eng.generate(PROMPT, 40)
    pdm_ops = dict(qkv_rope_append="cuda", cache_attention="cuda", fused_linear="cuda",
                   fused_swiglu="cuda")
    run = "cuda"
    with _cuda.simulated(), use_backend(**pdm_ops):
        res = eng.generate(PROMPT, 40)
    assert res.token_ids == ar == ref.token_ids
    assert len(logits["cuda"]) == len(logits["reference"]) > 10
    for got, want in zip(logits["cuda"], logits["reference"]):
        torch.testing.assert_close(got, want, rtol=0.03, atol=0.05)


def test_automatic_fallback_over_the_arguments_is_reported_once(monkeypatch):
    """A kernel that runs on the device but not these arguments: the automatic choice takes the
    next backend and says why, once per (op, kernel)."""
    import warnings

    from spd_kernels import dispatch as d
    monkeypatch.setattr(d, "_auto_order", lambda device: ("triton", "reference"))
    monkeypatch.setattr(d, "backend_unavailable", lambda b, device: None)
    monkeypatch.setattr(d, "_REPORTED", set())
    x, w = torch.randn(100, 8), torch.randn(4, 8)  # 100 rows: past the Triton kernel's 64
    with pytest.warns(UserWarning, match="fused_linear runs on reference, not its triton kernel: "
                                         "the kernel is for at most 64 rows"):
        assert d.select("fused_linear", x.device, (x, w, None, 1e-6, None), {})[0] == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d.select("fused_linear", x.device, (torch.randn(80, 8), w, None, 1e-6, None), {})
