"""tree_attention: token-tree rows (GQA) against a KV cache, each row seeing the committed prefix
and the tree slots its mask picks. Reference (int and device-tensor prefix_len) and the Triton
kernel (interpreter) against a per-row float64 loop over each row's own keys, with every cache
slot no row attends to poisoned with NaN; M = 0 against cache_attention; K/V mutations; errors."""
import pytest
import torch
from conftest import needs_triton

import spd_kernels
from spd_kernels import SPDBackendError, SPDInputError, cache_attention, dispatch, tree_attention
from spd_kernels.testing import TRITON_DEVICE, poisoned_outputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(H, KVH, hd, R, M, P, S, dtype=torch.float32, device="cpu", seed=0):
    """q [H, R, hd], caches [KVH, S, hd], tree_slots [M] (distinct slots in [P, S), shuffled) and
    tree_mask [R, M]: a random tree over the M slots (parent before child in slot-list order),
    row r seeing the path from the root to a node of its own (ancestors and itself). Every
    cache slot no row attends to is NaN."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(H, R, hd, generator=g) * 2
    k = torch.randn(KVH, S, hd, generator=g)
    v = torch.randn(KVH, S, hd, generator=g)
    slots = (P + torch.randperm(S - P, generator=g))[:M]
    parent = [-1] + [int(torch.randint(-1, m, (), generator=g)) for m in range(1, M)]
    mask = torch.zeros(R, M, dtype=torch.bool)
    for r in range(R if M else 0):
        node = r % M if R <= M else int(torch.randint(0, M, (), generator=g))
        while node >= 0:
            mask[r, node] = True
            node = parent[node]
    attended = torch.zeros(S, dtype=torch.bool)
    attended[:P] = True
    attended[slots[mask.any(0)]] = True
    k[:, ~attended] = float("nan")
    v[:, ~attended] = float("nan")
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, slots.to(device), mask.to(device)


def poison_unattended(k, v, P, slots, mask):
    attended = torch.zeros(k.shape[1], dtype=torch.bool, device=k.device)
    attended[:P] = True
    attended[slots[mask.any(0)]] = True
    k[:, ~attended] = float("nan")
    v[:, ~attended] = float("nan")


def per_row(q, k, v, P, slots, mask, scale=None):
    """The specification, one row and head at a time in float64: gather the row's keys (the
    prefix, then its masked-in tree slots), softmax, weighted sum; no key: zeros."""
    H, R, hd = q.shape
    g = H // k.shape[0]
    out = torch.zeros(R, H, hd, dtype=torch.float64)
    q, k, v, slots, mask = (t.cpu() for t in (q, k, v, slots, mask))
    for r in range(R):
        idx = torch.cat([torch.arange(P), slots[mask[r]]])
        if idx.numel() == 0:
            continue
        for h in range(H):
            w = torch.softmax(k[h // g, idx].double() @ q[h, r].double() * (scale or hd ** -0.5), 0)
            out[r, h] = w @ v[h // g, idx].double()
    return out.reshape(R, H * hd)


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


# (H, KVH, hd, R, M, P, S): GQA; an odd group; M = 0; prefix 0 with MQA; head_dim 12 and more
# rows than tree slots; one row per tree node past a longer prefix.
CASES = [(4, 2, 8, 3, 4, 5, 12), (6, 3, 16, 5, 7, 10, 20), (2, 2, 8, 1, 0, 6, 9),
         (8, 1, 32, 4, 6, 0, 10), (3, 3, 12, 6, 5, 30, 40), (4, 1, 16, 9, 9, 70, 90)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_per_row_gather(case, dtype):
    H, KVH, hd, R, M, P, S = case
    q, k, v, slots, mask = make_case(*case, dtype=dtype, seed=sum(case))
    want = per_row(q, k, v, P, slots, mask)
    for prefix in (P, torch.tensor(P), torch.tensor([P])):
        out = tree_attention(q, k, v, prefix, slots, mask)
        assert out.shape == (R, H * hd) and out.dtype == dtype
        assert not out.isnan().any()
        torch.testing.assert_close(out.double(), want, **tol(dtype))
    scaled = tree_attention(q, k, v, torch.tensor(P), slots, mask, scale=0.3)
    torch.testing.assert_close(scaled.double(), per_row(q, k, v, P, slots, mask, 0.3),
                               **tol(dtype))


@pytest.mark.parametrize("P,H,KVH", [(1, 2, 1), (6, 4, 2), (13, 3, 3)])
def test_no_tree_slots_is_cache_attention_of_one_row(P, H, KVH):
    q, k, v, slots, mask = make_case(H, KVH, 8, 1, 0, P, 16, seed=P)
    assert slots.shape == (0,) and mask.shape == (1, 0)
    want = cache_attention(q, k, v, P - 1)
    torch.testing.assert_close(tree_attention(q, k, v, P, slots, mask), want)
    torch.testing.assert_close(tree_attention(q, k, v, torch.tensor(P), slots, mask), want)


def test_a_row_with_no_key_is_zeros():
    q, k, v, slots, mask = make_case(4, 2, 8, 3, 4, 0, 10, seed=3)
    mask[1] = False
    poison_unattended(k, v, 0, slots, mask)
    want = per_row(q, k, v, 0, slots, mask)
    for prefix in (0, torch.tensor(0)):
        out = tree_attention(q, k, v, prefix, slots, mask)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out.double(), want)


def _mutation_check(run):
    """Row 0 of a tree must not move when a slot outside its mask (but seen by another row)
    changes, and must move when one of its own tree slots or a prefix slot changes."""
    P = 5
    q, k, v, slots, mask = make_case(4, 2, 16, 4, 6, P, 16, device=TRITON_DEVICE or "cpu",
                                     seed=11)
    mask[0] = False
    mask[0, 0] = True  # row 0: the root only; the other rows see other slots too
    others = [m for m in range(6) if not mask[0, m] and mask[1:, m].any()]
    assert others
    base = run(q, k, v, P, slots, mask)
    for m in others:
        k2, v2 = k.clone(), v.clone()
        k2[:, slots[m]] += 1.0
        v2[:, slots[m]] -= 3.0
        out = run(q, k2, v2, P, slots, mask)
        assert torch.equal(out[0], base[0]), m
        seen_by = mask[:, m].nonzero().flatten()
        assert not torch.allclose(out[seen_by], base[seen_by])
    for slot in (int(slots[0]), P - 1):  # row 0's own tree slot, a prefix slot
        k2, v2 = k.clone(), v.clone()
        v2[:, slot] += 1.0
        assert not torch.allclose(run(q, k2, v2, P, slots, mask)[0], base[0])


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_masked_out_slots_do_not_reach_a_row_reference(kind):
    def run(q, k, v, P, slots, mask):
        prefix = P if kind == "int" else torch.tensor(P, device=q.device)
        return tree_attention(q, k, v, prefix, slots, mask, backend="reference")
    _mutation_check(run)


def _args(**over):
    q, k, v, slots, mask = make_case(4, 2, 8, 3, 4, 5, 12, seed=1)
    a = dict(q=q, k_cache=k, v_cache=v, prefix_len=5, tree_slots=slots, tree_mask=mask)
    a.update(over)
    return a


BAD = [
    (dict(q=torch.randn(4, 8)), "q must have 3 dimensions"),
    (dict(k_cache=torch.randn(2, 12)), "k_cache must have 3 dimensions"),
    (dict(v_cache=torch.randn(2, 11, 8)), "k_cache and v_cache must have one shape"),
    (dict(q=torch.randn(3, 3, 8)), r"q's heads \(3\) must be a positive multiple"),
    (dict(q=torch.randn(4, 3, 16)), "q has head_dim 16"),
    (dict(tree_slots=torch.tensor([6, 7, 8, 9], dtype=torch.int32)),
     "tree_slots must have dtype torch.int64"),
    (dict(tree_slots=torch.tensor([[6, 7, 8, 9]])), "tree_slots must have 1 dimensions"),
    (dict(tree_slots=torch.tensor([6, 7, 8, 12])), r"tree_slots must lie in \[0, 12\)"),
    (dict(tree_slots=torch.tensor([6, -1, 8, 9])), r"tree_slots must lie in \[0, 12\)"),
    (dict(tree_mask=torch.ones(3, 5, dtype=torch.bool)), r"tree_mask must be \[R, M\] = \[3, 4\]"),
    (dict(tree_mask=torch.ones(4, 4, dtype=torch.bool)), r"tree_mask must be \[R, M\] = \[3, 4\]"),
    (dict(tree_mask=torch.ones(3, 4, dtype=torch.uint8)), "tree_mask must have dtype torch.bool"),
    (dict(tree_mask=torch.ones(3, 4, dtype=torch.bool, device="meta")), "tree_mask is on meta"),
    (dict(tree_slots=torch.arange(4, device="meta")), "tree_slots is on meta"),
    (dict(prefix_len=torch.tensor(5, device="meta")), "prefix_len is on meta"),
    (dict(prefix_len=5.0), "prefix_len must be an int"),
    (dict(prefix_len=13), r"prefix_len must lie in \[0, 12\]"),
    (dict(prefix_len=torch.tensor(-1)), r"prefix_len must lie in \[0, 12\]"),
    (dict(prefix_len=torch.tensor([5, 6])), "prefix_len must hold one position"),
    (dict(prefix_len=torch.tensor(5, dtype=torch.int32)), "prefix_len must have dtype torch.int64"),
    (dict(prefix_len=0, tree_slots=torch.zeros(0, dtype=torch.int64),
          tree_mask=torch.zeros(3, 0, dtype=torch.bool)), "prefix_len is 0 and tree_slots is empty"),
    (dict(scale=float("nan")), "scale must be a positive finite float"),
]


@pytest.mark.parametrize("over,match", BAD)
def test_bad_inputs_name_the_argument(over, match):
    with pytest.raises(SPDInputError, match=match):
        tree_attention(**_args(**over))


def test_custom_op_and_compile():
    a = _args(prefix_len=torch.tensor(5))
    want = tree_attention(**a)
    assert "tree_attention" in dispatch.ops() and "tree_attention" in spd_kernels.__all__
    assert torch.equal(torch.ops.spd.tree_attention(*a.values()), want)
    assert torch.equal(torch.ops.spd.tree_attention(*a.values(), scale=None), want)
    torch._dynamo.reset()
    fn = torch.compile(lambda *t: tree_attention(*t), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(*a.values()), want)
    torch._dynamo.reset()


def test_backends_cpu_reference_and_triton_on_request():
    assert dispatch.select("tree_attention", torch.device("cpu"))[0] == "reference"
    assert dispatch.has("tree_attention", "triton")
    assert dispatch.on_request("tree_attention", "triton")  # not yet timed on a GPU


# --- Triton (interpreter on CPU) ---------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[5]])
def test_triton_matches_reference(case, dtype):
    H, KVH, hd, R, M, P, S = case
    q, k, v, slots, mask = make_case(*case, dtype=dtype, device=TRITON_DEVICE, seed=sum(case))
    ref = tree_attention(q, k, v, torch.tensor(P, device=TRITON_DEVICE), slots, mask,
                         backend="reference")
    with poisoned_outputs("a"):
        out = tree_attention(q, k, v, torch.tensor([P], device=TRITON_DEVICE), slots, mask,
                             backend="triton")
    assert out.shape == (R, H * hd) and out.dtype == dtype
    t = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref.float(), **t)
    torch.testing.assert_close(out.double(), per_row(q, k, v, P, slots, mask), **tol(dtype))
    with poisoned_outputs("b"):
        again = tree_attention(q, k, v, P, slots, mask, backend="triton")  # host prefix_len
    assert torch.equal(again, out)


@needs_triton
def test_triton_many_key_blocks_and_pair_blocks(monkeypatch):
    """16-key and 16-slot blocks (the running max moves between blocks), 72 (row, head) pairs
    over two programs, a row with no key (zeros), prefix 0 in a second call."""
    from spd_kernels.attention import tree_triton
    monkeypatch.setattr(tree_triton, "_tree_blocks", lambda hd, S, M: (16, 16))
    case = (8, 1, 16, 9, 40, 37, 90)
    q, k, v, slots, mask = make_case(*case, device=TRITON_DEVICE, seed=5)
    q[:, 2] *= 8  # a peaky row
    mask[4] = False
    poison_unattended(k, v, 37, slots, mask)
    with poisoned_outputs("a"):
        out = tree_attention(q, k, v, torch.tensor(37, device=TRITON_DEVICE), slots, mask,
                             backend="triton")
    torch.testing.assert_close(out.double(), per_row(q, k, v, 37, slots, mask), **tol(q.dtype))
    k0, v0 = k.clone(), v.clone()
    poison_unattended(k0, v0, 0, slots, mask)
    with poisoned_outputs("b"):
        out = tree_attention(q, k0, v0, 0, slots, mask, backend="triton")
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    torch.testing.assert_close(out.double(), per_row(q, k0, v0, 0, slots, mask), **tol(q.dtype))


@needs_triton
def test_triton_masked_out_slots_do_not_reach_a_row():
    _mutation_check(lambda q, k, v, P, slots, mask: tree_attention(
        q, k, v, torch.tensor(P, device=q.device), slots, mask, backend="triton"))


@needs_triton
def test_triton_refuses_what_it_cannot_take():
    q, k, v, slots, mask = make_case(3, 3, 12, 2, 3, 4, 10, device=TRITON_DEVICE)
    with pytest.raises(SPDBackendError, match="power-of-two head_dim"):
        tree_attention(q, k, v, 4, slots, mask, backend="triton")
    q, k, v, slots, mask = make_case(4, 2, 8, 2, 3, 4, 10, device=TRITON_DEVICE)
    with pytest.raises(SPDBackendError, match="q in the caches' dtype"):
        tree_attention(q.double(), k, v, 4, slots, mask, backend="triton")
