"""Greedy verification with the zero-centred final norm of hybrid targets (x * (1 + w),
norm_offset=1.0): the reference equals Hugging Face's Qwen3.5 norm + LM head; the Triton kernel
(interpreter on CPU) and the CUDA kernel (host emulation on CPU) equal the reference, with
poisoned outputs."""
import pytest
import torch
from conftest import needs_simt, needs_triton

from spd_kernels import _cuda, verify_greedy
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs
from spd_kernels.verify import final_logits, verify_greedy_reference

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_inputs(R, D, V, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, D, generator=g) * 2
    norm = torch.randn(D, generator=g) * 0.5  # zero-centred: the effective weight is 1 + w
    head = torch.randn(V, D, generator=g) / D ** 0.5
    cast = lambda t: t.to(device=device, dtype=dtype)
    hidden, norm, head = cast(hidden), cast(norm), cast(head)
    ref = final_logits(hidden, norm, 1e-6, head, 1.0).argmax(-1)
    drafts = torch.randint(0, V, (R,), generator=g).to(device)
    drafts[::2] = ref[::2]
    return hidden, norm, head, drafts


def check(hidden, norm, head, drafts, backend, exact):
    ref_t, ref_ok = verify_greedy_reference(hidden, norm, 1e-6, head, drafts, 1.0)
    for mode in ("a", "b"):
        with poisoned_outputs(mode):
            t, ok = verify_greedy(hidden, norm, 1e-6, head, drafts, 1.0, backend=backend)
        if exact:
            assert torch.equal(t, ref_t) and torch.equal(ok, ref_ok)
        else:  # a disagreement must be a near-tie of the reference logits
            logits = final_logits(hidden, norm, 1e-6, head, 1.0).float()
            best = logits.max(-1).values
            got = logits.gather(1, t[:, None].clamp(0, head.shape[0] - 1))[:, 0]
            ulp = torch.exp2(torch.floor(torch.log2(best.abs().clamp_min(1e-6))) - 7)
            assert (got >= best - ulp).all() and torch.equal(ok, t == drafts.long())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hugging_face_zero_centred_norm(dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm
    hidden, norm, head, drafts = make_inputs(6, 48, 300, dtype, "cpu", seed=1)
    hf = Qwen3_5RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(norm)
        want = torch.nn.functional.linear(hf(hidden), head)
    torch.testing.assert_close(final_logits(hidden, norm, 1e-6, head, 1.0), want, rtol=0, atol=0)
    t, _ = verify_greedy(hidden, norm, 1e-6, head, drafts, 1.0, backend="reference")
    assert torch.equal(t, want.argmax(-1))
    # the plain norm w * x picks other tokens here: the offset matters
    assert not torch.equal(verify_greedy(hidden, norm, 1e-6, head, drafts)[0], t)


@needs_triton
@pytest.mark.parametrize("R,D,V", [(1, 32, 100), (5, 64, 300), (3, 45, 257)])
def test_triton_zero_centred_fp32_exact(R, D, V):
    check(*make_inputs(R, D, V, torch.float32, TRITON_DEVICE, seed=R + D), "triton", True)


@needs_triton
def test_triton_zero_centred_bf16():
    check(*make_inputs(4, 64, 333, torch.bfloat16, TRITON_DEVICE, seed=9), "triton", False)


@needs_simt
@pytest.mark.parametrize("R,D,V", [(1, 32, 100), (3, 45, 257), (9, 24, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_zero_centred_in_host_emulation(R, D, V, dtype):
    args = make_inputs(R, D, V, dtype, "cpu", seed=R * 100 + D)
    with _cuda.simulated():
        check(*args, "cuda", dtype == torch.float32)
