"""ascend_moe_ops.integrations.megatron: the Megatron-Core permute/unpermute drop-in.

Two oracles:
* ``alg_permute`` / ``alg_unpermute`` below: Megatron-Core's documented semantics written as plain
  loops (always run);
* megatron-core itself, when it is installed (``pip install megatron-core``; those tests skip
  cleanly otherwise).
Data movement (permuted tokens, permuted probs, sorted_indices) must match exactly; sums match the
fp64 oracle within the package's 2x-PyTorch rule (``ascend_moe_ops.testing``).
"""

import importlib.metadata
import warnings

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.integrations import megatron as mg
from ascend_moe_ops.testing import assert_close_to_ref
from conftest import backends

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it warns that TransformerEngine/Apex are missing
        from megatron.core.transformer.moe import moe_utils as mcore
    MCORE = importlib.metadata.version("megatron-core")
except Exception as exc:  # not installed, or fails to import here
    mcore, MCORE = None, f"megatron-core unavailable ({type(exc).__name__}: {exc})"

needs_mcore = pytest.mark.skipif(mcore is None, reason=str(MCORE))

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (T, H, E, K): tiny, Pangu-like scaled down (E=256 -> 32, K=8), odd, top-1, every expert
SHAPES = [(37, 16, 8, 3), (64, 96, 32, 8), (13, 7, 5, 1), (9, 33, 7, 7), (1, 5, 4, 2)]
SHAPE_IDS = ["T{}xH{}xE{}xK{}".format(*s) for s in SHAPES]


# ---------------------------------------------------------------- Megatron's semantics, as loops
def _expert_rows(mask, capacity=None):
    """Per expert, the tokens of its rows: routed tokens in token order; with a capacity the first
    ``capacity`` of (routed tokens, then unrouted tokens), both in token order."""
    T, E = mask.shape
    per_expert = []
    for e in range(E):
        routed = [t for t in range(T) if mask[t, e]]
        if capacity is not None:
            routed = (routed + [t for t in range(T) if not mask[t, e]])[:capacity]
        per_expert.append(routed)
    return per_expert


def alg_permute(tokens, mask, probs=None, num_out_tokens=None, drop_and_pad=False):
    E = mask.shape[1]
    cap = num_out_tokens // E if drop_and_pad and num_out_tokens is not None else None
    rows = [(t, e) for e, toks in enumerate(_expert_rows(mask, cap)) for t in toks]
    idx = torch.tensor([t for t, _ in rows], dtype=torch.int64)
    exp = torch.tensor([e for _, e in rows], dtype=torch.int64)
    out = tokens.index_select(0, idx)  # differentiable: its backward sums a token's rows
    pp = probs[idx, exp] if probs is not None else None
    return out, pp, idx


def _row_experts(mask, num_rows, drop_and_pad):
    E = mask.shape[1]
    if drop_and_pad:
        return torch.arange(num_rows) // (num_rows // E)
    return torch.repeat_interleave(torch.arange(E), mask.sum(0))


def alg_unpermute(rows, sorted_indices, restore_shape, probs=None, routing_map=None,
                  drop_and_pad=False, dtype=None):
    """``out[sorted_indices[r]] += rows[r] * probs[token, expert of r]``, in ``dtype``
    (default: fp64) -- ``dtype=rows.dtype`` is PyTorch's own low-precision run of the same math."""
    dtype = dtype or torch.float64
    x = rows.to(dtype)
    if probs is not None:
        exp = _row_experts(routing_map, rows.shape[0], drop_and_pad)
        x = x * probs[sorted_indices, exp].to(dtype).unsqueeze(1)
    out = torch.zeros(restore_shape, dtype=dtype)
    return out.index_add(0, sorted_indices, x)


# ---------------------------------------------------------------- inputs
def make_inputs(T, H, E, K, dtype, seed=0, skew=False):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    scores = torch.rand(T, E, generator=g)
    if skew:
        scores = scores + torch.linspace(1, 0, E)  # low expert ids are preferred
    ids = scores.topk(K, dim=1).indices
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    probs = torch.rand(T, E, generator=g) * mask  # dense [T, E], zero where not routed
    return tokens, mask, probs


def _run(backend, fn, *args, **kwargs):
    with amo.use_backend(backend):
        return fn(*args, **kwargs)


def _assert_equal(name, a, b):
    if b is None:
        assert a is None, f"{name}: expected None"
        return
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(a, b), f"{name} differs"


def _assert_permute_equal(got, want):
    for name, a, b in zip(("permuted_tokens", "permuted_probs", "sorted_indices"), got, want):
        _assert_equal(name, a, b)


# ---------------------------------------------------------------- vs the algorithm (always run)
@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("give_n", [True, False], ids=["num_out_tokens", "no_num_out_tokens"])
def test_permute_matches_algorithm(backend, dtype, shape, with_probs, give_n):
    T, H, E, K = shape
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, skew=True)
    probs = probs if with_probs else None
    n = int(mask.sum()) if give_n else None
    got = _run(backend, mg.permute, tokens, mask, probs, num_out_tokens=n)
    _assert_permute_equal(got, alg_permute(tokens, mask, probs, n))


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("capacity", [1, 4, 9])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_drop_and_pad_matches_algorithm(backend, dtype, capacity, with_probs):
    # skewed routing: low experts overfull (tokens dropped), high experts underfull (filled)
    T, H, E, K = 20, 24, 6, 2
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, skew=True)
    probs = probs if with_probs else None
    n = E * capacity + (E - 1)  # Megatron takes capacity = num_out_tokens // E
    got = _run(backend, mg.permute, tokens, mask, probs, num_out_tokens=n, drop_and_pad=True)
    want = alg_permute(tokens, mask, probs, n, drop_and_pad=True)
    _assert_permute_equal(got, want)
    out = _run(backend, mg.unpermute, got[0], got[2], tokens.shape, probs=probs,
               routing_map=mask, drop_and_pad=True)
    ref64 = alg_unpermute(got[0], got[2], tokens.shape, probs, mask, drop_and_pad=True)
    lowp = alg_unpermute(got[0], got[2], tokens.shape, probs, mask, drop_and_pad=True, dtype=dtype)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp)


def test_drop_and_pad_without_num_out_tokens_is_dropless():
    tokens, mask, probs = make_inputs(16, 8, 4, 2, torch.float32)
    _assert_permute_equal(mg.permute(tokens, mask, probs, drop_and_pad=True),
                          alg_permute(tokens, mask, probs))


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("variant", ["probs", "noprobs", "noprobs_no_routing_map"])
def test_unpermute_matches_algorithm(backend, dtype, shape, variant):
    T, H, E, K = shape
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, seed=1)
    _, _, si = alg_permute(tokens, mask)
    rows = (torch.randn(si.numel(), H) * 2).to(dtype)  # expert outputs
    probs = probs if variant == "probs" else None
    rmap = None if variant == "noprobs_no_routing_map" else mask
    out = _run(backend, mg.unpermute, rows, si, tokens.shape, probs=probs, routing_map=rmap)
    assert out.dtype == dtype and out.shape == (T, H)
    ref64 = alg_unpermute(rows, si, tokens.shape, probs, mask)
    lowp = alg_unpermute(rows, si, tokens.shape, probs, mask, dtype=dtype)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp)
    # deterministic (fixed-order fp32 sum)
    assert torch.equal(out, _run(backend, mg.unpermute, rows, si, tokens.shape, probs=probs, routing_map=rmap))


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("drop_and_pad", [False, True], ids=["dropless", "drop_and_pad"])
def test_gradients_match_algorithm(backend, dtype, drop_and_pad):
    T, H, E, K = 24, 40, 6, 3
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, skew=True)
    n = E * 5 if drop_and_pad else int(mask.sum())

    def run(perm, unperm, tok, pr, **kw):
        tok = tok.clone().requires_grad_()
        pr = pr.clone().requires_grad_()
        x, pp, si = perm(tok, mask, pr, num_out_tokens=n, drop_and_pad=drop_and_pad)
        h = x * 1.5 + pp.to(x.dtype).unsqueeze(1)  # a stand-in expert that also uses the probs
        y = unperm(h, si, tok.shape, probs=pr, routing_map=mask, drop_and_pad=drop_and_pad, **kw)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        (y.double() * w).sum().backward()
        return y, tok.grad, pr.grad

    with amo.use_backend(backend):
        y, gt, gp = run(mg.permute, mg.unpermute, tokens, probs)
    y64, gt64, gp64 = run(alg_permute, alg_unpermute, tokens.double(), probs.double())
    yl, gtl, gpl = run(alg_permute, alg_unpermute, tokens, probs, dtype=dtype)
    assert_close_to_ref(y, y64, dtype=dtype, torch_lowp=yl, name="output")
    assert_close_to_ref(gt, gt64, dtype=dtype, torch_lowp=gtl, name="grad tokens")
    assert_close_to_ref(gp, gp64, dtype=torch.float32, torch_lowp=gpl, name="grad probs")


def test_index_converters_round_trip():
    tokens, mask, probs = make_inputs(30, 4, 8, 3, torch.float32, skew=True)
    res = amo.moe_permute(tokens, mask, num_out_tokens=int(mask.sum()))
    si = mg.sorted_indices_from_row_id_map(res.row_id_map, res.tokens.shape[0])
    _assert_equal("sorted_indices", si, alg_permute(tokens, mask)[2])
    exp = torch.repeat_interleave(torch.arange(8), mask.sum(0))
    back = mg.row_id_map_from_sorted_indices(si, exp, 30, 8)
    _assert_equal("row_id_map", back, res.row_id_map)


def test_empty_input():
    tokens, mask, probs = make_inputs(0, 8, 4, 2, torch.float32)
    x, pp, si = mg.permute(tokens, mask, probs)
    assert x.shape == (0, 8) and pp.shape == (0,) and si.shape == (0,)
    assert mg.unpermute(x, si, (0, 8), probs=probs, routing_map=mask).shape == (0, 8)
    assert mg.unpermute(x, si, (0, 8)).shape == (0, 8)


def test_bad_inputs():
    tokens, mask, probs = make_inputs(10, 8, 4, 2, torch.float32)
    x, pp, si = mg.permute(tokens, mask, probs)
    with pytest.raises(ValueError, match="num_out_tokens=21 must equal the 20 routed"):
        mg.permute(tokens, mask, probs, num_out_tokens=21)
    with pytest.raises(ValueError, match="num_out_tokens"):
        mg.permute(tokens, mask, probs, num_out_tokens=19)
    with pytest.raises(ValueError, match="routing_map must have one row per token"):
        mg.permute(tokens[:5], mask, probs)
    with pytest.raises(ValueError, match="probs must have shape"):
        mg.permute(tokens, mask, probs[:, :3])
    with pytest.raises(TypeError, match="routing_map must have dtype"):
        mg.permute(tokens, mask.float(), probs)
    with pytest.raises(ValueError, match="capacity num_out_tokens // num_experts = 11 exceeds"):
        mg.permute(tokens, mask, probs, num_out_tokens=44, drop_and_pad=True)
    with pytest.raises(ValueError, match="routing_map is required when probs is given"):
        mg.unpermute(x, si, tokens.shape, probs=probs)
    with pytest.raises(ValueError, match="restore_shape must be"):
        mg.unpermute(x, si, (10, 7))
    with pytest.raises(ValueError, match="sorted_indices must have one entry per row"):
        mg.unpermute(x, si[:-1], tokens.shape)
    with pytest.raises(ValueError, match="sorted_indices has value 10"):
        mg.unpermute(x, torch.full_like(si, 10), tokens.shape)
    with pytest.raises(ValueError, match="not a multiple of the 4 experts"):
        mg.unpermute(x[:19], si[:19], tokens.shape, routing_map=mask, drop_and_pad=True)


def test_num_out_tokens_as_tensor():
    # Megatron's AllGather dispatcher passes tokens_per_expert.sum() (a tensor)
    tokens, mask, probs = make_inputs(12, 8, 4, 2, torch.float32)
    _assert_permute_equal(mg.permute(tokens, mask, probs, num_out_tokens=mask.sum()),
                          alg_permute(tokens, mask, probs))


# ---------------------------------------------------------------- vs megatron-core itself
@needs_mcore
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("give_n", [True, False], ids=["num_out_tokens", "no_num_out_tokens"])
def test_matches_megatron_core(dtype, shape, with_probs, give_n):
    T, H, E, K = shape
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, seed=2, skew=True)
    probs = probs if with_probs else None
    n = int(mask.sum()) if give_n else None
    theirs = mcore.permute(tokens, mask, probs=probs, num_out_tokens=n)
    ours = mg.permute(tokens, mask, probs=probs, num_out_tokens=n)
    _assert_permute_equal(ours, theirs)

    rows = (torch.randn(theirs[0].shape) * 2).to(dtype)
    kw = dict(probs=probs, routing_map=mask)
    out = mg.unpermute(rows, ours[2], tokens.shape, **kw)
    ref = mcore.unpermute(rows, theirs[2], tokens.shape, **kw)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    ref64 = alg_unpermute(rows, theirs[2], tokens.shape, probs, mask)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=ref, name="unpermute vs megatron-core")


@needs_mcore
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("capacity", [2, 4, 7])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_drop_and_pad_matches_megatron_core(dtype, capacity, with_probs):
    T, H, E, K = 20, 24, 6, 2
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, skew=True)
    probs = probs if with_probs else None
    n = E * capacity
    theirs = mcore.permute(tokens, mask, probs=probs, num_out_tokens=n, drop_and_pad=True)
    ours = mg.permute(tokens, mask, probs=probs, num_out_tokens=n, drop_and_pad=True)
    _assert_permute_equal(ours, theirs)
    rows = (torch.randn(theirs[0].shape) * 2).to(dtype)
    kw = dict(probs=probs, routing_map=mask, drop_and_pad=True)
    out = mg.unpermute(rows, ours[2], tokens.shape, **kw)
    ref = mcore.unpermute(rows, theirs[2], tokens.shape, **kw)
    ref64 = alg_unpermute(rows, theirs[2], tokens.shape, probs, mask, drop_and_pad=True)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=ref, name="unpermute vs megatron-core")


@needs_mcore
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("drop_and_pad", [False, True], ids=["dropless", "drop_and_pad"])
def test_gradients_match_megatron_core(dtype, drop_and_pad):
    T, H, E, K = 32, 48, 8, 4
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, seed=5, skew=True)
    n = E * 6 if drop_and_pad else int(mask.sum())

    def run(mod, tok, pr):
        tok = tok.clone().requires_grad_()
        pr = pr.clone().requires_grad_()
        x, pp, si = mod.permute(tok, mask, probs=pr, num_out_tokens=n, drop_and_pad=drop_and_pad)
        h = x * 1.5 + pp.to(x.dtype).unsqueeze(1)
        y = mod.unpermute(h, si, tok.shape, probs=pr, routing_map=mask, drop_and_pad=drop_and_pad)
        w = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        (y.double() * w).sum().backward()
        return y, tok.grad, pr.grad

    y, gt, gp = run(mg, tokens, probs)
    ym, gtm, gpm = run(mcore, tokens, probs)
    y64, gt64, gp64 = run(mcore, tokens.double(), probs.double())  # Megatron's path in fp64 = oracle
    assert_close_to_ref(y, y64, dtype=dtype, torch_lowp=ym, name="output")
    assert_close_to_ref(gt, gt64, dtype=dtype, torch_lowp=gtm, name="grad tokens")
    assert_close_to_ref(gp, gp64, dtype=torch.float32, torch_lowp=gpm, name="grad probs")


# ---------------------------------------------------------------- the benchmark's peer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bench_peer_reimplementation_is_megatron(dtype):
    """The benchmark's fallback peer ("megatron-algorithm (reimplemented)") computes what the
    oracle (and megatron-core, when installed) computes, so its timings are of the right work."""
    from ascend_moe_ops.benchmark.suite import bench_moe_permute as bench
    tokens, mask, probs = make_inputs(40, 24, 8, 3, dtype, skew=True)
    got = bench._alg_permute(tokens, mask, probs)
    _assert_permute_equal(got, alg_permute(tokens, mask, probs))
    rows = torch.randn(got[0].shape).to(dtype)
    out = bench._alg_unpermute(rows, got[2], tokens.shape, probs=probs, routing_map=mask)
    ref64 = alg_unpermute(rows, got[2], tokens.shape, probs, mask)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=alg_unpermute(
        rows, got[2], tokens.shape, probs, mask, dtype=dtype))
    if mcore is not None:
        _assert_permute_equal(got, mcore.permute(tokens, mask, probs=probs))
        ref = mcore.unpermute(rows, got[2], tokens.shape, probs=probs, routing_map=mask)
        assert torch.equal(out, ref)


@needs_mcore
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
@pytest.mark.parametrize("K", [1, 3])
def test_cpu_fast_path_holes_match_megatron_core(dtype, with_probs, K):
    """The CPU path (native mask_permute / sort_chunks) with a token routed to no expert, a token
    with fewer experts and an expert with no token: values bitwise, gradients of probs bitwise,
    of tokens bitwise in fp32 (within the rule in bf16: a token's rows are summed in fp32)."""
    T, H, E = 19, 24, 6
    tokens, mask, probs = make_inputs(T, H, E, K, dtype, seed=7, skew=True)
    mask[3] = False
    mask[5, :4] = False
    mask[:, 2] = False
    probs = probs * mask
    n = int(mask.sum())
    w = torch.randn(n, H, generator=torch.Generator().manual_seed(1)).to(dtype)

    def run(mod):
        tok, pr = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        x, pp, si = mod.permute(tok, mask, probs=pr if with_probs else None, num_out_tokens=n)
        sizes = mask.sum(0)
        order = torch.tensor([3, 0, 5, 1, 4, 2])
        y, yp = mod.sort_chunks_by_idxs(x, sizes, order, probs=pp)
        loss = (y.float() * w.float()).sum()
        if with_probs:
            loss = loss + (yp * torch.arange(n)).sum()
        loss.backward()
        return x, pp, si, y, yp, tok.grad, pr.grad

    ours, theirs = run(mg), run(mcore)
    for name, a, b in zip(("rows", "probs", "sorted_indices", "sorted rows", "sorted probs"), ours[:5], theirs[:5]):
        _assert_equal(name, a, b)
    if with_probs:
        _assert_equal("grad probs", ours[6], theirs[6])
    if dtype == torch.float32:
        _assert_equal("grad tokens", ours[5], theirs[5])
    else:
        inv = torch.empty(n, dtype=torch.int64)
        # the gradient of the rows before sort_chunks, in fp64
        sizes = mask.sum(0).tolist()
        order = [3, 0, 5, 1, 4, 2]
        starts = [sum(sizes[:j]) for j in range(E)]
        pos = 0
        for j in order:
            inv[starts[j]:starts[j] + sizes[j]] = torch.arange(pos, pos + sizes[j])
            pos += sizes[j]
        ref64 = torch.zeros(T, H, dtype=torch.float64).index_add_(0, theirs[2], w.double()[inv])
        assert_close_to_ref(ours[5], ref64, dtype=dtype, torch_lowp=theirs[5], name="grad tokens")
