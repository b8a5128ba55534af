"""The counter-based draws (spd_kernels.philox): Philox4x32-10 against its published known
answers, the PyTorch reference against Triton's tl.rand bit for bit (edge keys and offsets
past 2**32), and the uniforms' distribution."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import needs_triton

from spd_kernels.philox import philox4x32, philox_uniform, seed_key
from spd_kernels.testing import TRITON_DEVICE

# Random123's known-answer vectors for philox4x32_10: (counter, key) -> output
KNOWN = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, want", KNOWN)
def test_philox_gives_the_known_answers(counter, key, want):
    words = [torch.tensor(v, dtype=torch.int64) for v in (*counter, *key)]
    assert [int(w) for w in philox4x32(*words)] == list(want)


def test_seed_key_keeps_the_seeds_bits():
    assert [seed_key(s) for s in (0, 7, 2**63 - 1, 2**63, 2**64 - 1)] == \
        [0, 7, 2**63 - 1, -2**63, -1]


if TRITON_DEVICE is not None:
    from spd_kernels._triton import tl, triton

    @triton.jit
    def _rand_kernel(keys, offsets, out, D, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        at = tl.load(offsets + b * D + j, mask=j < D, other=0)
        tl.store(out + b * D + j, tl.rand(tl.load(keys + b), at), mask=j < D)


@needs_triton
def test_reference_equals_triton_rand():
    g = torch.Generator().manual_seed(0)
    B, D = 40, 16
    keys = torch.randint(-2**63, 2**63 - 1, (B,), generator=g)
    keys[:4] = torch.tensor([0, -1, 2**63 - 1, -2**63])
    offsets = torch.randint(0, 2**62, (B, D), generator=g)
    offsets[0] = torch.arange(D)
    offsets[1] = 2**32 - 8 + torch.arange(D)  # (the counter's low word wraps into the high)
    keys, offsets = keys.to(TRITON_DEVICE), offsets.to(TRITON_DEVICE)
    out = torch.full((B, D), float("nan"), device=TRITON_DEVICE)
    _rand_kernel[(B,)](keys, offsets, out, D, BLOCK=D)
    assert torch.equal(out, philox_uniform(keys, offsets))


def test_uniforms_are_uniform_and_independent():
    """Over 8 keys x 32768 offsets: the bins of [0, 1) (chi-square), the mean and variance,
    and no correlation between neighbouring offsets or keys."""
    keys = torch.tensor([seed_key(s) for s in (0, 1, 2, 3, 41, 2**40, 2**63, 2**64 - 1)])
    offsets = torch.arange(32768).repeat(len(keys), 1) + 3 * 2**32
    u = philox_uniform(keys, offsets).double()
    assert ((u >= 0) & (u < 1)).all()
    bins = 64
    counts = torch.bincount((u * bins).long().view(-1), minlength=bins).double()
    expected = u.numel() / bins
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # (bins - 1 degrees of freedom: mean 63, sd about 11.2; 120 is past p = 1e-6)
    assert chi2 < 120, chi2
    sd = 1 / math.sqrt(12 * u.numel())  # the mean's standard error
    assert abs(float(u.mean()) - 0.5) < 6 * sd
    assert abs(float(u.var()) - 1 / 12) < 0.002
    c = u - 0.5
    for a, b in ((c[:, 1:], c[:, :-1]), (c[1:], c[:-1])):
        r = float((a * b).mean() / (a.std() * b.std()))
        assert abs(r) < 6 / math.sqrt(a.numel()), r
