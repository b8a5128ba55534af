"""The Gated DeltaNet step and the conv ring update (spd_kernels.deltanet): the reference equals
transformers' recurrent delta rule and causal conv; the Triton kernels (interpreter on CPU) equal
the reference, outputs poisoned, rings written only where the reference writes them, the slot
read from a device position."""
import pytest
import torch
from conftest import needs_triton

from spd_kernels.deltanet import conv_ring_step, gated_delta_step
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def delta_inputs(T, hk, hv, dk, dv, R, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, dk, generator=g).to(dtype)
    k = torch.randn(T, hk, dk, generator=g).to(dtype)
    v = torch.randn(T, hv, dv, generator=g).to(dtype)
    gate = -torch.rand(T, hv, generator=g) * 2  # log decay <= 0, fp32
    beta = torch.rand(T, hv, generator=g).to(dtype)
    ring = torch.randn(R, hv, dk, dv, generator=g)
    return q, k, v, gate, beta, ring


def test_reference_equals_transformers_recurrent_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
    q, k, v, gate, beta, ring = delta_inputs(5, 2, 4, 8, 6, 3, torch.float32, seed=1)
    start = 7
    init = ring[start % 3].clone()
    out = gated_delta_step(q, k, v, gate, beta, ring, start, backend="reference")
    want, final = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=gate[None], beta=beta[None], initial_state=init[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, want[0], rtol=0, atol=0)
    torch.testing.assert_close(ring[(start + 5) % 3], final[0], rtol=0, atol=0)


def test_conv_reference_equals_transformers_conv():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 10, generator=g), torch.randn(10, 4, generator=g)
    ring = torch.zeros(3, 3, 10)
    out = conv_ring_step(x, ring, w, 0, backend="reference")
    want = causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ring[7 % 3], x[-3:])  # the history before length 7


@needs_triton
@pytest.mark.parametrize("T,R", [(1, 3), (3, 4), (4, 3), (9, 2), (5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_triton_delta_step_equals_reference(T, R, dtype, on_device):
    q, k, v, gate, beta, ring = delta_inputs(T, 2, 4, 12, 20, R, dtype, seed=T * 10 + R)
    dev = TRITON_DEVICE
    q, k, v, gate, beta, ring = (x.to(dev) for x in (q, k, v, gate, beta, ring))
    start = 11 if not on_device else torch.tensor([11], device=dev)
    ref_ring = ring.clone()
    want = gated_delta_step(q, k, v, gate, beta, ref_ring, start, backend="reference")
    for mode in ("a", "b"):
        got_ring = ring.clone()
        with poisoned_outputs(mode):
            got = gated_delta_step(q, k, v, gate, beta, got_ring, start, backend="triton")
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2,
                                                                           atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(got_ring, ref_ring, rtol=1e-5, atol=1e-5)
        written = {(11 + t + 1) % R for t in range(max(0, T - R), T)}
        for s in range(R):  # slots the step does not write are untouched
            if s not in written:
                assert torch.equal(got_ring[s], ring[s])


@needs_triton
@pytest.mark.parametrize("T,R", [(1, 3), (3, 4), (4, 2), (9, 3), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_conv_ring_equals_reference(T, R, dtype):
    g = torch.Generator().manual_seed(T + R)
    C = 40
    x = torch.randn(T, C, generator=g).to(dtype).to(TRITON_DEVICE)
    w = torch.randn(C, 4, generator=g).to(dtype).to(TRITON_DEVICE)
    ring = torch.randn(R, 3, C, generator=g).to(dtype).to(TRITON_DEVICE)
    start = torch.tensor([5], device=TRITON_DEVICE)
    ref_ring = ring.clone()
    want = conv_ring_step(x, ref_ring, w, start, backend="reference")
    for mode in ("a", "b"):
        got_ring = ring.clone()
        with poisoned_outputs(mode):
            got = conv_ring_step(x, got_ring, w, start, backend="triton")
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2,
                                                                           atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        torch.testing.assert_close(got_ring, ref_ring, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("live", [0, 1, True, False])
@pytest.mark.parametrize("T,R", [(1, 3), (4, 3)])
def test_a_dead_row_writes_no_ring_entry(backend, live, T, R):
    """live of 0 (a batch's dead row, read on the device): the same outputs, every ring entry
    as it was; live of 1: the same as no `live` at all."""
    dev = TRITON_DEVICE if backend == "triton" else "cpu"
    q, k, v, gate, beta, ring = (x.to(dev) for x in delta_inputs(T, 2, 4, 8, 12, R,
                                                                    torch.float32, seed=T))
    g = torch.Generator().manual_seed(R)
    x, w = torch.randn(T, 40, generator=g).to(dev), torch.randn(40, 4, generator=g).to(dev)
    conv = torch.randn(R, 3, 40, generator=g).to(dev)
    flag = torch.tensor([live], device=dev)
    start = torch.tensor([7], device=dev)
    want_ring, want_conv = ring.clone(), conv.clone()
    want = gated_delta_step(q, k, v, gate, beta, want_ring, start, backend="reference")
    want_x = conv_ring_step(x, want_conv, w, start, backend="reference")
    got_ring, got_conv = ring.clone(), conv.clone()
    got = gated_delta_step(q, k, v, gate, beta, got_ring, start, live=flag, backend=backend)
    got_x = conv_ring_step(x, got_conv, w, start, live=flag, backend=backend)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    if live:
        torch.testing.assert_close(got_ring, want_ring, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_conv, want_conv, rtol=0, atol=0)
        assert not torch.equal(got_ring, ring)
    else:
        assert torch.equal(got_ring, ring) and torch.equal(got_conv, conv)


def test_live_is_checked():
    from spd_kernels.checks import SPDInputError
    q, k, v, gate, beta, ring = delta_inputs(1, 2, 4, 8, 12, 3, torch.float32, seed=0)
    with pytest.raises(SPDInputError, match="live"):
        gated_delta_step(q, k, v, gate, beta, ring, 0, live=torch.ones(2, dtype=torch.int64))
    with pytest.raises(SPDInputError, match="live"):
        conv_ring_step(torch.zeros(1, 4), torch.zeros(3, 3, 4), torch.zeros(4, 4), 0,
                       live=torch.ones(1))
