"""slot_attention: rows of several sequences, each against its own slot of a batched cache. The
reference's CPU path against cache_attention row by row (bit for bit: a sequence beside others
gets the numbers it gets alone) and both of its paths against a float64 loop over each row's
own keys, with every key no row may see poisoned with NaN; the Triton kernel (interpreter) against
the reference, outputs poisoned first; a length-0 row; bad input."""
import pytest
import torch
from conftest import needs_triton

from spd_kernels import SPDInputError, cache_attention, slot_attention
from spd_kernels.attention.slots import _masked
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

H, KVH, HD, B, S = 6, 2, 8, 3, 24


def make_case(R, dtype=torch.float32, seed=0):
    """q [H, R, hd], caches [B, KVH, S, hd], each row's slot and length (one row of length 0);
    every key past the longest length any row reads in its slot is NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, R, HD, generator=g) * 2
    k = torch.randn(B, KVH, S, HD, generator=g)
    v = torch.randn(B, KVH, S, HD, generator=g)
    slots = torch.randint(0, B, (R,), generator=g)
    lengths = torch.randint(1, S + 1, (R,), generator=g)
    lengths[R // 2] = 0
    for b in range(B):
        read = int(lengths[slots == b].max()) if (slots == b).any() else 0
        k[b, :, read:] = float("nan")
        v[b, :, read:] = float("nan")
    return tuple(t.to(dtype) for t in (q, k, v)) + (slots, lengths)


def per_row(q, k, v, slots, lengths):
    """The specification in float64: row r's softmax over keys [0, lengths[r]) of its slot."""
    R = q.shape[1]
    g = H // KVH
    out = torch.zeros(R, H, HD, dtype=torch.float64)
    for r in range(R):
        b, n = int(slots[r]), int(lengths[r])
        for h in range(H):
            if n == 0:
                continue
            keys = k[b, h // g, :n].double()
            w = torch.softmax(keys @ q[h, r].double() * HD ** -0.5, 0)
            out[r, h] = w @ v[b, h // g, :n].double()
    return out.reshape(R, H * HD)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_row_is_what_cache_attention_gives_that_sequence_alone(seed):
    q, k, v, slots, lengths = make_case(7, seed=seed)
    out = slot_attention(q, k, v, slots, lengths)
    assert out.shape == (7, H * HD) and not out.isnan().any()
    for r in range(7):
        n = int(lengths[r])
        if n == 0:
            assert torch.equal(out[r], torch.zeros(H * HD))
            continue
        alone = cache_attention(q[:, r:r + 1], k[int(slots[r])], v[int(slots[r])], n - 1)
        assert torch.equal(out[r], alone[0]), r
    torch.testing.assert_close(out.double(), per_row(q, k, v, slots, lengths), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_path_masks_each_row_to_its_slot(dtype):
    q, k, v, slots, lengths = make_case(9, dtype=dtype, seed=4)
    out = _masked(q, k, v, slots, lengths, None)
    assert out.dtype == dtype and not out.isnan().any()
    assert torch.equal(out[9 // 2], torch.zeros(H * HD, dtype=dtype))  # length 0: zeros
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), per_row(q, k, v, slots, lengths), atol=tol,
                               rtol=tol)


def test_a_scale_and_no_rows():
    q, k, v, slots, lengths = make_case(4, seed=5)
    a = slot_attention(q, k, v, slots, lengths, scale=0.3)
    b = _masked(q, k, v, slots, lengths, 0.3)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a, slot_attention(q, k, v, slots, lengths))
    empty = torch.zeros(0, dtype=torch.int64)
    assert slot_attention(q[:, :0], k, v, empty, empty).shape == (0, H * HD)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(slots=a["slots"] + B), "slots must lie in"),
    (lambda a: a.update(lengths=a["lengths"] + S + 1), "lengths must lie in"),
    (lambda a: a.update(lengths=a["lengths"][:-1]), "one value per row"),
    (lambda a: a.update(slots=a["slots"].int()), "slots"),
    (lambda a: a.update(k_cache=a["k_cache"][0]), "k_cache"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :, :-1]), "one shape"),
    (lambda a: a.update(q=a["q"][:5]), "multiple"),
    (lambda a: a.update(scale=-1.0), "scale"),
])
def test_bad_input_is_named(change, match):
    q, k, v, slots, lengths = make_case(4)
    args = dict(q=q, k_cache=k, v_cache=v, slots=slots, lengths=lengths, scale=None)
    change(args)
    with pytest.raises(SPDInputError, match=match):
        slot_attention(**args)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(dtype):
    """S = 24 keys in blocks of 16 (the running max moves between blocks), G = 3 heads a kv head
    padded to 16, a row of length 0."""
    q, k, v, slots, lengths = (t.to(TRITON_DEVICE) for t in make_case(9, dtype=dtype, seed=6))
    ref = _masked(q, k, v, slots, lengths, None)
    with poisoned_outputs("a"):
        out = slot_attention(q, k, v, slots, lengths, backend="triton")
    assert out.shape == (9, H * HD) and out.dtype == dtype
    t = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **t)
    torch.testing.assert_close(out.double().cpu(), per_row(*(x.cpu() for x in (q, k, v, slots,
                                                                               lengths))), **t)
