"""mask_permute / sort_chunks (the Megatron-Core adapter's internal kernels): native and reference
vs Megatron-Core's semantics (written out here as torch ops, exact), gradients, edge cases (top-1, a
token with no expert, an expert with no token, empty), opcheck and bad input."""

import pytest
import torch

import ascend_moe_ops  # noqa: F401  (registers the ops)
from ascend_moe_ops import _library
from ascend_moe_ops.ops import megatron_paths as mp
from ascend_moe_ops.testing import assert_close_to_ref

NAMESPACES = [pytest.param(mp.REFERENCE, id="reference")]
if mp.native_loaded():
    NAMESPACES.insert(0, pytest.param(mp.NATIVE, id="native"))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _op(ns, name):
    return getattr(getattr(torch.ops, ns), name).default


def _megatron_permute(tokens, mask, probs):
    """Megatron-Core 0.16.1's unfused dropless permute."""
    T, E = mask.shape
    mt = mask.t().contiguous()
    si = torch.arange(T).unsqueeze(0).expand(E, T).masked_select(mt)
    pp = probs.t().contiguous().masked_select(mt) if probs is not None else None
    return tokens.index_select(0, si), pp, si


def _inputs(T, H, E, K, dtype, pdtype=torch.float32, seed=0, holes=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    scores = torch.rand(T, E, generator=g) + torch.linspace(1, 0, E)  # skewed: high experts get few tokens
    mask = torch.zeros(T, E, dtype=torch.bool)
    if K:
        mask.scatter_(1, scores.topk(K, dim=1).indices, True)
    if holes and T > 2:
        mask[1] = False                    # a token with no expert
        mask[2, : max(1, E // 2)] = False  # a token with fewer experts
        mask[:, -1] = False                # an expert with no token
    probs = (torch.rand(T, E, generator=g) * mask).to(pdtype)
    return tokens, mask, probs


def _check_maps(mask, si, row_id_map, ids):
    T, E = mask.shape
    counts = mask.sum(1)
    S = int(counts.max()) if T and E else 0
    assert row_id_map.shape == (T, S) and row_id_map.dtype == torch.int32
    assert ids.shape == (T, S) and ids.dtype == torch.int64
    for t in range(T):
        want = mask[t].nonzero().flatten().tolist()
        c = len(want)
        assert ids[t, :c].tolist() == want and (ids[t, c:] == -1).all()
        assert (row_id_map[t, c:] == -1).all()
        assert (si[row_id_map[t, :c].long()] == t).all()
    ends = torch.cumsum(mask.sum(0), 0)
    rows = row_id_map[ids >= 0].long()
    assert torch.equal(torch.searchsorted(ends, rows, right=True), ids[ids >= 0])  # expert of each row


SHAPES = [(37, 16, 8, 3), (64, 96, 70, 8), (13, 7, 5, 1), (9, 33, 7, 7), (1, 5, 4, 2), (20, 8, 130, 4)]


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xH{}xE{}xK{}".format(*s))
@pytest.mark.parametrize("holes", [False, True], ids=["topk", "holes"])
def test_mask_permute_is_megatron(ns, dtype, shape, holes):
    T, H, E, K = shape
    tokens, mask, probs = _inputs(T, H, E, K, dtype, holes=holes)
    for p in (probs, None):
        out, pp, si, rmap, ids = _op(ns, mp.PERMUTE)(tokens, mask, p, int(mask.sum()))
        w_out, w_pp, w_si = _megatron_permute(tokens, mask, p)
        assert torch.equal(out, w_out) and out.dtype == dtype
        assert torch.equal(si, w_si) and si.dtype == torch.int64
        if p is None:
            assert pp.shape == (0,)
        else:
            assert torch.equal(pp, w_pp) and pp.dtype == p.dtype
        _check_maps(mask, si, rmap, ids)
    # without num_out_tokens: the same
    assert torch.equal(_op(ns, mp.PERMUTE)(tokens, mask, probs, None)[0], w_out)


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pdtype", [torch.float32, torch.bfloat16], ids=str)
def test_mask_permute_gradients_are_megatron(ns, dtype, pdtype):
    tokens, mask, probs = _inputs(24, 40, 6, 3, dtype, pdtype=pdtype, holes=True)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(int(mask.sum()), 40, generator=g).to(dtype)
    wp = torch.randn(int(mask.sum()), generator=g).to(pdtype)

    def run(fn):
        t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out, pp = fn(t, p)
        ((out.float() * w.float()).sum() + (pp.float() * wp.float()).sum()).backward()
        return t.grad, p.grad

    ours = run(lambda t, p: _op(ns, mp.PERMUTE)(t, mask, p, None)[:2])
    theirs = run(lambda t, p: _megatron_permute(t, mask, p)[:2])
    # probs: one value per entry, exact; tokens: a token's rows summed in fp32 and rounded once
    # (Megatron's index_select backward adds in the token dtype): exact in fp32, else within the
    # package's rule vs the fp64 sum
    assert ours[1].dtype == pdtype and torch.equal(ours[1], theirs[1])
    assert ours[0].dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(ours[0], theirs[0])
    else:
        rows = torch.arange(int(mask.sum()))
        si = _megatron_permute(tokens, mask, None)[2]
        ref64 = torch.zeros(tokens.shape, dtype=torch.float64).index_add_(0, si, w.double()[rows])
        assert_close_to_ref(ours[0], ref64, dtype=dtype, torch_lowp=theirs[0], name="grad tokens")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_mask_permute_fp64_gradcheck_and_opcheck(ns):
    tokens, mask, probs = _inputs(7, 5, 4, 2, torch.float64, pdtype=torch.float64, holes=True)
    t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _op(ns, mp.PERMUTE)(a, mask, b, None)[:2], (t, p))
    tokens, mask, probs = _inputs(9, 8, 5, 2, torch.float32, holes=True)
    # the row count and S depend on the mask's values: the fake kernel gives dynamic sizes, which
    # the aot-dispatch check cannot compare with a real run; the schema, fake and autograd
    # registration checks run
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(_op(ns, mp.PERMUTE), (tokens, mask, probs, int(mask.sum())), test_utils=utils)
    torch.library.opcheck(_op(ns, mp.PERMUTE), (tokens, mask, None, None), test_utils=utils)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_mask_permute_non_contiguous_routing_map(ns):
    """A transposed (non-contiguous) routing_map: the reference returned transposed row maps and
    its backward failed ("view size is not compatible"); the outputs are contiguous and the
    gradients those of the contiguous map, and the probs gradient takes non-contiguous maps."""
    tokens, mask, probs = _inputs(6, 8, 5, 2, torch.float32, holes=True)
    nc = mask.t().contiguous().t()
    assert not nc.is_contiguous() and torch.equal(nc, mask)
    g = torch.Generator().manual_seed(4)
    w = torch.randn(int(mask.sum()), 8, generator=g)
    wp = torch.randn(int(mask.sum()), generator=g)
    res = []
    for m in (mask, nc):
        t, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        outs = _op(ns, mp.PERMUTE)(t, m, p, None)
        assert all(o.is_contiguous() for o in outs)
        ((outs[0] * w).sum() + (outs[1] * wp).sum()).backward()
        res.append([o.detach() for o in outs] + [t.grad, p.grad])
    for a, b in zip(*res):
        assert torch.equal(a, b)
    out = _op(ns, mp.PERMUTE)(tokens, mask, probs, None)
    rmap, ids = out[3].t().contiguous().t(), out[4].t().contiguous().t()   # non-contiguous maps
    assert torch.equal(mp.probs_grad(wp, rmap, ids, probs.shape, probs.dtype, probs.device), res[0][-1])


@pytest.mark.parametrize("ns", NAMESPACES)
def test_mask_permute_empty(ns):
    for T, H, E in [(0, 8, 4), (5, 0, 4), (5, 8, 0)]:
        tokens, mask, probs = _inputs(T, H, E, 0, torch.bfloat16)
        out, pp, si, rmap, ids = _op(ns, mp.PERMUTE)(tokens, mask, probs, 0)
        assert out.shape == (0, H) and pp.shape == (0,) and si.shape == (0,)
        assert rmap.shape == (T, 0) and ids.shape == (T, 0)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_mask_permute_compiles_with_gradients(dynamic):
    """torch.compile(fullgraph=True) of mask_permute, forward and backward: with dynamic shapes the
    fake kernel gave new_dynamic_size a symbolic max ("expected min and max to be statically known
    ints"); with static shapes the probs gradient branched on the data-dependent S
    (GuardOnDataDependentSymNode "Eq(u1, 0)"). Values and gradients equal eager ones."""
    def f(x, p):
        out, pp, _, _, _ = mp.mask_permute(x, p > 0.5, p, None)
        return (out * pp.unsqueeze(1).to(out.dtype)).sum(0)

    for T, E in ((6, 4), (7, 5)):  # a second shape: dynamic=True reuses its graph
        g = torch.Generator().manual_seed(T)
        x0, p0 = torch.randn(T, 5, generator=g), torch.rand(T, E, generator=g)
        p0[1] = 0.0  # a token with no expert
        gy = torch.randn(5, generator=g)
        res = []
        for fn in (f, torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=dynamic)):
            x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
            y = fn(x, p)
            (y * gy).sum().backward()
            res.append((y.detach(), x.grad, p.grad))
        for a, b in zip(*res):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("ns", NAMESPACES)
def test_mask_permute_bad_input_names_the_argument(ns):
    tokens, mask, probs = _inputs(10, 8, 4, 2, torch.float32)
    op = _op(ns, mp.PERMUTE)
    with pytest.raises(ValueError, match="num_out_tokens=21 must equal the 20 routed"):
        op(tokens, mask, probs, 21)
    with pytest.raises(ValueError, match="num_out_tokens must be >= 0"):
        op(tokens, mask, probs, -1)
    with pytest.raises(ValueError, match="routing_map must have one row per token"):
        op(tokens[:5], mask, probs, None)
    with pytest.raises(ValueError, match="probs must have shape"):
        op(tokens, mask, probs[:, :3], None)
    with pytest.raises(TypeError, match="routing_map must have dtype"):
        op(tokens, mask.int(), probs, None)
    with pytest.raises(TypeError, match="tokens must have dtype"):
        op(tokens.int(), mask, probs, None)


def _megatron_sort(x, sizes, order, probs):
    parts = torch.split(x, sizes.tolist(), dim=0)
    out = torch.cat([parts[i] for i in order.tolist()], dim=0)
    pp = None
    if probs is not None:
        ps = torch.split(probs, sizes.tolist(), dim=0)
        pp = torch.cat([ps[i] for i in order.tolist()], dim=0)
    return out, pp


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes,order", [([3, 0, 5, 2, 4, 1], [2, 0, 5, 3, 1, 4]), ([4], [0]), ([0, 0], [1, 0]),
                                         ([2, 7, 1], [0, 1, 2])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_sort_chunks_is_megatron(ns, dtype, sizes, order, index_dtype):
    N = sum(sizes)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, 2, generator=g).to(dtype)  # rows of any shape
    p = torch.rand(N, generator=g)
    st, ot = torch.tensor(sizes, dtype=index_dtype), torch.tensor(order, dtype=index_dtype)
    w = torch.randn(x.shape, generator=g)

    def run(fn):
        xi, pi = x.clone().requires_grad_(), p.clone().requires_grad_()
        out, pp = fn(xi, pi)
        ((out.float() * w).sum() + (pp * torch.arange(N)).sum()).backward()
        return out, pp, xi.grad, pi.grad

    ours = run(lambda a, b: _op(ns, mp.SORT)(a, st, ot, b, False))
    theirs = run(lambda a, b: _megatron_sort(a, st, ot, b))
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    out, none = _op(ns, mp.SORT)(x, st, ot, None, False)
    assert none.shape == (0,) and torch.equal(out, theirs[0])
    back, _ = _op(ns, mp.SORT)(out, st, ot, None, True)
    assert torch.equal(back, x)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_sort_chunks_opcheck_and_bad_input(ns):
    x = torch.randn(6, 2)
    st, ot = torch.tensor([2, 4]), torch.tensor([1, 0])
    torch.library.opcheck(_op(ns, mp.SORT), (x, st, ot, torch.rand(6), False))
    torch.library.opcheck(_op(ns, mp.SORT), (x, st, ot, None, True))
    op = _op(ns, mp.SORT)
    with pytest.raises(ValueError, match="split_sizes must add up to the 6 rows"):
        op(x, torch.tensor([2, 3]), ot, None, False)
    with pytest.raises(ValueError, match="sorted_idxs must have one entry per chunk"):
        op(x, st, torch.tensor([1, 0, 2]), None, False)
    with pytest.raises(ValueError, match="sorted_idxs must be a permutation"):
        op(x, st, torch.tensor([1, 1]), None, False)
    with pytest.raises(TypeError, match="split_sizes must have dtype"):
        op(x, torch.tensor([2.0, 4.0]), ot, None, False)
    with pytest.raises(ValueError, match="probs must have one entry per row"):
        op(x, st, ot, torch.rand(5), False)


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("sizes, order", [
    ([2**63 - 1, 2**63 - 1, 8], [2, 1, 0]),          # the int64 sum wraps to the 6 rows (a crash before)
    ([2**62, 2**62, 2**62, 2**62 + 6], [3, 2, 1, 0]),  # ... silently (the input came back unsorted)
    ([1, 2, 2], [2, 0, 1]),
    ([2, -1, 5], [0, 1, 2]),
    ([1, 2, 3], [0, 0, 1]),
], ids=["sum_overflows", "sum_wraps", "sum_short", "negative", "not_permutation"])
def test_sort_chunks_bad_values_same_error_as_the_reference(ns, sizes, order):
    """Each split size is bounded by the rows before it is summed (no int64 overflow); every backend
    raises the reference's ValueError, message included, with or without probs and inverse."""
    x = torch.arange(6.0).view(6, 1)
    with pytest.raises(ValueError) as want:
        _op(mp.REFERENCE, mp.SORT)(x, torch.tensor(sizes), torch.tensor(order), None, False)
    for probs, inverse in ((None, False), (torch.rand(6), True)):
        with pytest.raises(ValueError) as got:
            _op(ns, mp.SORT)(x, torch.tensor(sizes), torch.tensor(order), probs, inverse)
        assert str(got.value).splitlines()[0] == str(want.value), (str(got.value), str(want.value))


def test_internal_not_public():
    for name in (mp.PERMUTE, mp.SORT):
        assert name in _library.INTERNAL_SCHEMAS and name not in _library.SCHEMAS
