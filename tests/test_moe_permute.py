"""moe_permute: every backend present vs the reference (exact: it only moves data), the reference
vs a naive loop written from the contract, autograd, opcheck, compile, edge cases and bad input."""

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.reference import moe_permute as ref_mod
from ascend_moe_ops.testing import assert_close_to_ref
from conftest import backends, ops_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (T, H, E, K): Pangu Ultra MoE scaled down (H 7680 -> 768, E=256, K=8), DeepSeek-V3-like, odd sizes
SHAPES = [(48, 768, 256, 8), (33, 97, 7, 3), (1, 97, 7, 1), (20, 64, 4, 4)]
# num_out_tokens as a string: relative to the routed slot count of the inputs (see resolve_mode)
MODES = [dict(), dict(capacity=3), dict(align=4), dict(capacity=4, align=2), dict(num_out_tokens="routed"),
         dict(num_out_tokens="routed-1", align=4)]
MODE_ID = lambda m: "-".join(f"{k}{v}" for k, v in m.items()) or "dropless"  # noqa: E731


def routed_slots(routing) -> int:
    return int((routing != 0).sum() if routing.dtype == torch.bool else (routing >= 0).sum())


def resolve_mode(mode, routing):
    """``num_out_tokens`` given as "routed", "routed-1", "routed+3", "half" or "zero" -> an int."""
    mode = dict(mode)
    n = mode.get("num_out_tokens")
    if isinstance(n, str):
        r = routed_slots(routing)
        mode["num_out_tokens"] = {"routed": r, "routed-1": max(r - 1, 0), "routed+3": r + 3, "half": r // 2,
                                  "zero": 0}[n]
    return mode


def make_routing(T, E, K, kind, *, dtype=torch.int64, empty_frac=0.15, dup=True, gen=None):
    """Index routing with -1 slots and duplicate ids, or a bool mask with ~K experts per token."""
    if kind == "mask":
        scores = torch.rand(T, E, generator=gen)
        k = min(K, E)
        idx = scores.topk(k, dim=1).indices
        mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
        mask &= torch.rand(T, E, generator=gen) > empty_frac
        return mask
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] if K <= E else torch.randint(0, E, (K,), generator=gen)
                       for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.int64)
    if dup and T and K > 1:
        ids[::5, 1] = ids[::5, 0]  # duplicate ids in some rows
    ids[torch.rand(T, K, generator=gen) < empty_frac] = -1
    return ids.to(dtype)


def naive_permute(tokens, routing, probs, E, capacity=None, align=1, num_out_tokens=None):
    """The contract, as a plain loop (slow, obviously right)."""
    T, H = tokens.shape
    S = routing.shape[1]
    slots = []  # (expert, t, s, prob)
    for t in range(T):
        for s in range(S):
            e = (s if bool(routing[t, s]) else -1) if routing.dtype == torch.bool else int(routing[t, s])
            if e >= 0:
                slots.append((e, t, s, float(probs[t, s]) if probs is not None else 0.0))
    kept = {}
    for e in range(E):
        mine = [x for x in slots if x[0] == e]
        if capacity is not None:
            # keep highest prob; among equal probs the earlier position
            order = sorted(range(len(mine)), key=lambda i: (-mine[i][3] if probs is not None else 0, i))
            mine = [mine[i] for i in sorted(order[:capacity])]
        kept[e] = mine
    if num_out_tokens is not None:  # the first num_out_tokens slots in (expert, position) order
        budget = num_out_tokens
        for e in range(E):
            kept[e] = kept[e][:budget]
            budget -= len(kept[e])
    counts = [len(kept[e]) for e in range(E)]
    sizes = [capacity if capacity is not None else -(-c // align) * align for c in counts]
    if capacity is not None:
        N = E * capacity
    else:
        N = (num_out_tokens if num_out_tokens is not None else T * S) + E * (align - 1)
    out = torch.zeros(N, H, dtype=tokens.dtype)
    out_p = torch.zeros(N, dtype=probs.dtype) if probs is not None else None
    row_map = torch.full((T, S), -1, dtype=torch.int32)
    start = 0
    for e in range(E):
        for r, (_, t, s, _) in enumerate(kept[e]):
            out[start + r] = tokens[t]
            row_map[t, s] = start + r
            if probs is not None:
                out_p[start + r] = probs[t, s]
        start += sizes[e]
    return out, out_p, row_map, torch.tensor(counts, dtype=torch.int64), torch.tensor(sizes, dtype=torch.int64)


def _inputs(T, H, E, K, kind, dtype, idx_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    routing = make_routing(T, E, K, kind, dtype=idx_dtype, gen=g)
    probs = torch.rand(routing.shape, generator=g)
    probs[:, :1] = probs[:, 1:2] if routing.shape[1] > 1 else probs[:, :1]  # some exact ties
    return tokens, routing, probs


def _run(backend, *args, **kwargs):
    if args[1].dtype != torch.bool:
        kwargs.setdefault("map_type", "index")  # ids, also where top-K = E (ambiguous without it)
    with amo.use_backend(backend):
        return amo.moe_permute(*args, **kwargs)


def _grads_fn(tokens, routing, probs, E, mode):
    """``grads(backend, tokens, probs) -> (grad tokens, grad probs, row_id_map)`` of a fixed scalar
    loss of permute's outputs: random weights on the permuted tokens, distinct weights 1..N on the
    permuted probs (so a probs gradient that lands in the wrong slot shows)."""
    g_tok = torch.randn(_run("reference", tokens, routing, probs, num_experts=E, **mode).tokens.shape)

    def grads(bk, tok, pr):
        tok = tok.clone().requires_grad_()
        pr = pr.clone().requires_grad_()
        r = _run(bk, tok, routing, pr, num_experts=E, **mode)
        with amo.use_backend(bk):
            ((r.tokens.double() * g_tok.double()).sum() + (r.probs.double() * torch.arange(
                1, r.probs.numel() + 1, dtype=torch.float64)).sum()).backward()
        return tok.grad, pr.grad, r.row_id_map
    return grads


def _assert_same(res, ref):
    names = ["tokens", "probs", "row_id_map", "tokens_per_expert", "group_sizes"]
    for name, a, b in zip(names, res, ref):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"{name} differs from the reference"


@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_ID)
@pytest.mark.parametrize("with_probs", [True, False])
def test_reference_matches_contract(kind, mode, with_probs):
    T, H, E, K = 23, 5, 6, 3
    tokens, routing, probs = _inputs(T, H, E, K, kind, torch.float32)
    probs = probs if with_probs else None
    mode = resolve_mode(mode, routing)
    res = _run("reference", tokens, routing, probs, num_experts=E, **mode)
    _assert_same(res, naive_permute(tokens, routing, probs, E, **mode))


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xH{}xE{}xK{}".format(*s))
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_ID)
def test_permute_matches_reference(backend, dtype, shape, kind, mode):
    T, H, E, K = shape
    if kind == "mask" and E > 64:
        pytest.skip("mask routing is tested on the smaller expert counts (same code path)")
    tokens, routing, probs = _inputs(T, H, E, K, kind, dtype)
    mode = resolve_mode(mode, routing)
    ref = _run("reference", tokens, routing, probs, num_experts=E, **mode)
    res = _run(backend, tokens, routing, probs, num_experts=E, **mode)
    _assert_same(res, ref)
    # padding rows and rows past the used ones are exactly zero
    used = torch.zeros(res.tokens.shape[0], dtype=torch.bool)
    rows = res.row_id_map[res.row_id_map >= 0].long()
    used[rows] = True
    assert (res.tokens[~used] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_permute"))
def test_int32_and_int64_ids_agree(backend):
    tokens, routing, probs = _inputs(40, 32, 8, 2, "index", torch.float32)
    a = _run(backend, tokens, routing.to(torch.int32), probs, num_experts=8, capacity=7)
    b = _run(backend, tokens, routing.to(torch.int64), probs, num_experts=8, capacity=7)
    _assert_same(a, b)


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("case", ["empty_input", "expert_without_tokens", "all_to_one", "top1",
                                  "all_slots_empty", "dropped_tokens"])
def test_edge_cases(backend, case):
    E = 5
    tokens, routing, probs = _inputs(12, 16, E, 2, "index", torch.float32)
    kwargs = dict(num_experts=E)
    if case == "empty_input":
        tokens, routing, probs = tokens[:0], routing[:0], probs[:0]
    elif case == "expert_without_tokens":
        routing[routing == 3] = 4
    elif case == "all_to_one":
        routing[:] = 2
    elif case == "top1":
        routing, probs = routing[:, :1].clone(), probs[:, :1].clone()
        routing[routing < 0] = 0
    elif case == "all_slots_empty":
        routing[:] = -1
    elif case == "dropped_tokens":
        routing[:] = 1
        kwargs["capacity"] = 3
    ref = _run("reference", tokens, routing, probs, **kwargs)
    res = _run(backend, tokens, routing, probs, **kwargs)
    _assert_same(res, ref)
    _assert_same(ref, naive_permute(tokens, routing, probs, E, kwargs.get("capacity")))
    if case == "expert_without_tokens":
        assert res.tokens_per_expert[3] == 0
    if case == "dropped_tokens":
        assert int((res.row_id_map >= 0).sum()) == 3 and int(res.tokens_per_expert[1]) == 3


@pytest.mark.parametrize("backend", backends("moe_permute"))
def test_non_contiguous_inputs(backend):
    tokens, routing, probs = _inputs(30, 64, 8, 4, "index", torch.float32)
    t_nc = torch.randn(64, 30).t()  # transposed view
    t_nc.copy_(tokens)
    r_nc = torch.stack([routing, routing], 2).reshape(30, 8)[:, ::2]
    p_nc = torch.stack([probs, probs], 2).reshape(30, 8)[:, ::2]
    assert not (t_nc.is_contiguous() or r_nc.is_contiguous() or p_nc.is_contiguous())
    _assert_same(_run(backend, t_nc, r_nc, p_nc, num_experts=8, align=2),
                 _run("reference", tokens, routing, probs, num_experts=8, align=2))


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("probs, kept", [
    ([0.5 + 1e-12, 0.5 + 3e-12], 0),   # higher second, equal in fp32: a tie, the first kept
    ([0.5, 0.5 + 2 ** -20], 1),         # apart in fp32: the higher kept
    ([1e300, 1e301], 0),                # both +inf in fp32: a tie
    ([1e-300, 1e-200], 0),              # both 0 in fp32: a tie
    ([0.0, -0.0], 0), ([-0.0, 0.0], 0),  # signed zeros tie
    ([float("nan"), -1.0], 1),          # NaN below every number
])
def test_capacity_ranks_fp64_probs_as_fp32(backend, probs, kept):
    """The documented capacity ranking (docs/ops/moe_permute.md, Modes): probs compared as float32
    values on every backend, fp64 ones rounded to nearest first, ties kept by position."""
    dt = torch.float16 if backend == "ascendc-emu" else torch.float32
    routing = torch.tensor([[0], [0], [1]])
    p = torch.tensor([[probs[0]], [probs[1]], [0.3]], dtype=torch.float64)
    with amo.use_backend(backend):
        res = amo.moe_permute(torch.randn(3, 4, dtype=dt), routing, p, num_experts=2, capacity=1)
    want = [0, -1, 1] if kept == 0 else [-1, 0, 1]
    assert res.row_id_map.flatten().tolist() == want


@pytest.mark.parametrize("backend", backends("moe_permute"))
def test_unused_tokens_do_not_leak_nan(backend):
    tokens, routing, probs = _inputs(16, 8, 4, 2, "index", torch.float32)
    routing[3] = -1
    tokens[3] = float("nan")  # token 3 is routed nowhere
    res = _run(backend, tokens, routing, probs, num_experts=4, align=4)
    assert torch.isfinite(res.tokens).all() and torch.isfinite(res.probs).all()


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [dict(), dict(capacity=3), dict(align=4)], ids=["dropless", "capacity", "align"])
def test_backward_matches_fp64_reference(backend, dtype, mode):
    T, H, E, K = 24, 40, 6, 3
    tokens, routing, probs = _inputs(T, H, E, K, "index", dtype)
    grads = _grads_fn(tokens, routing, probs, E, mode)
    gt, gp, _ = grads(backend, tokens, probs)
    rt, rp, _ = grads("reference", tokens.double(), probs.double())
    lt, _, _ = grads("reference", tokens, probs)  # the same math in PyTorch, same precision
    assert_close_to_ref(gt, rt, dtype=dtype, torch_lowp=lt, name="grad tokens")
    assert torch.equal(gp.double(), rp), "grad of probs is a pure gather: exact"


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("mode", [dict(), dict(capacity=4), dict(align=8)], ids=["dropless", "capacity", "align"])
def test_opcheck(backend, mode):
    tokens, routing, probs = _inputs(10, 16, 4, 2, "index", torch.float32)
    tokens.requires_grad_()
    probs.requires_grad_()
    cap = mode.get("capacity")
    op = ops_of(backend)("moe_permute")  # the backend's own namespace
    torch.library.opcheck(op, (tokens, routing, probs, 4, cap, mode.get("align", 1), None))
    torch.library.opcheck(op, (tokens, routing, None, 4, cap, mode.get("align", 1), None))


def test_compile_fullgraph_round_trip():
    tokens, routing, probs = _inputs(16, 32, 4, 2, "index", torch.float32)

    def f(x, r, p):
        out = amo.moe_permute(x, r, p, num_experts=4, align=2, map_type="index")
        return amo.moe_unpermute(out.tokens * 3.0, out.row_id_map, p)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = tokens.clone().requires_grad_()
    y = compiled(x, routing, probs)
    y.sum().backward()
    x2 = tokens.clone().requires_grad_()
    y2 = f(x2, routing, probs)
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)


@pytest.mark.parametrize("bad, match", [
    (dict(tokens=torch.randn(4)), "tokens must be 2-D"),
    (dict(tokens=torch.randint(0, 3, (4, 8))), "tokens must have dtype"),
    (dict(routing=torch.zeros(5, 2, dtype=torch.int64)), "routing must have one row per token"),
    (dict(routing=torch.zeros(4, 2)), "routing must have dtype"),
    (dict(routing=torch.tensor([[0, 1], [2, 9], [0, 0], [1, 1]])), "routing .* outside the valid range"),
    (dict(routing=torch.tensor([[0, 1], [2, -2], [0, 0], [1, 1]])), "routing .* outside the valid range"),
    (dict(probs=torch.rand(4, 3)), "probs must have shape"),
    (dict(probs=torch.ones(4, 2, dtype=torch.int64)), "probs must have dtype"),
    (dict(num_experts=None), "num_experts is required"),
    (dict(capacity=0), "capacity must be >= 1"),
    (dict(align=0), "align must be >= 1"),
    (dict(capacity=3, align=2), "align=2 must divide capacity=3"),
    (dict(num_out_tokens=-1), "num_out_tokens must be >= 0, got -1"),
    (dict(capacity=2, num_out_tokens=3), "num_out_tokens cannot be combined with capacity"),
    (dict(routing=torch.ones(4, 5, dtype=torch.bool)), "num_experts=4 does not match"),
    (dict(probs=torch.rand(4, 2, device="meta")), "probs is on meta"),
])
def test_bad_inputs(bad, match):
    args = dict(tokens=torch.randn(4, 8), routing=torch.tensor([[0, 1], [2, 3], [0, 0], [1, 1]]),
                probs=torch.rand(4, 2), num_experts=4)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        amo.moe_permute(args.pop("tokens"), args.pop("routing"), args.pop("probs"), **args)


def test_output_size_is_static():
    """Shapes depend only on argument shapes (no host sync needed to allocate); one definition."""
    from ascend_moe_ops.ops._contracts import output_rows
    assert ref_mod.output_rows is output_rows  # the reference uses the contract's function
    assert output_rows(4096, 8, 256, None, 1, None) == 4096 * 8
    assert output_rows(4096, 8, 256, None, 16, None) == 4096 * 8 + 256 * 15
    assert output_rows(4096, 8, 256, 40, 1, None) == 256 * 40
    assert output_rows(4096, 8, 256, None, 1, 100) == 100
    assert output_rows(4096, 8, 256, None, 4, 100) == 100 + 256 * 3


# ---- num_out_tokens: the first rows in expert order are kept (TransformerEngine's rule) ----

def te_kept_rows(routing, num_out_tokens):
    """TransformerEngine's rule, written from its PyTorch reference of the index-map permute: a
    stable argsort of the flat expert ids; the first ``num_out_tokens`` entries of that order become
    rows ``0..n-1``, the others are dropped. Empty slots are left out first (TE itself would sort
    ``-1`` ids ahead of expert 0). A mask is read as one slot per (token, expert), which gives TE's
    mask-map row order (expert-major, token order). Returns the ``[T, S]`` row map (align = 1)."""
    T, S = routing.shape
    if routing.dtype == torch.bool:
        flat = torch.where(routing, torch.arange(S).expand(T, S), -1).reshape(-1)
    else:
        flat = routing.reshape(-1).long()
    pos = torch.nonzero(flat >= 0).flatten()
    order = pos[torch.argsort(flat[pos], stable=True)]
    kept = order[:num_out_tokens]
    rows = torch.full((T * S,), -1, dtype=torch.int32)
    rows[kept] = torch.arange(kept.numel(), dtype=torch.int32)
    return rows.reshape(T, S)


NUM_OUT = ["zero", "half", "routed-1", "routed", "routed+3"]


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("n", NUM_OUT)
def test_num_out_tokens_keeps_te_rows(backend, kind, n):
    """Below the routed count the first rows in expert order are kept, exactly TE's rows; at or above
    it every slot is kept and the extra rows are zero. tokens_per_expert counts the kept slots."""
    T, H, E, K = 19, 24, 5, 3
    tokens, routing, probs = _inputs(T, H, E, K, kind, torch.float32, seed=2)
    mode = resolve_mode(dict(num_out_tokens=n), routing)
    res = _run(backend, tokens, routing, probs, num_experts=E, **mode)
    _assert_same(res, _run("reference", tokens, routing, probs, num_experts=E, **mode))
    _assert_same(res, naive_permute(tokens, routing, probs, E, **mode))
    n_out = mode["num_out_tokens"]
    want = te_kept_rows(routing, n_out)
    assert torch.equal(res.row_id_map, want)
    kept = min(n_out, routed_slots(routing))
    assert res.tokens.shape == (n_out, H) and int(res.tokens_per_expert.sum()) == kept
    assert torch.equal(res.group_sizes, res.tokens_per_expert)
    src = torch.nonzero(want >= 0)
    assert torch.equal(res.tokens[want[want >= 0].long()], tokens[src[:, 0]])
    assert (res.tokens[kept:] == 0).all() and (res.probs[kept:] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("case", ["top1", "expert_without_tokens", "bf16_int32_align", "all_slots_empty",
                                  "empty_input", "mask_align"])
def test_num_out_tokens_edge_cases(backend, case):
    E, K, kind, dtype, idx, align = 5, 2, "index", torch.float32, torch.int64, 1
    if case == "bf16_int32_align":
        dtype, idx, align = torch.bfloat16, torch.int32, 4
    if case == "mask_align":
        kind, align = "mask", 3
    tokens, routing, probs = _inputs(14, 16, E, K, kind, dtype, idx_dtype=idx, seed=5)
    n = "routed-1"
    if case == "top1":
        routing, probs = routing[:, :1].clone(), probs[:, :1].clone()
        routing[routing < 0] = 1
    elif case == "expert_without_tokens":
        routing[routing == 1] = 0  # expert 1 (inside the budget) and expert 4 have no tokens
        routing[routing == 4] = 3
    elif case == "all_slots_empty":
        routing[:] = -1
        n = "routed+3"
    elif case == "empty_input":
        tokens, routing, probs = tokens[:0], routing[:0], probs[:0]
        n = "routed+3"
    mode = dict(resolve_mode(dict(num_out_tokens=n), routing), align=align)
    res = _run(backend, tokens, routing, probs, num_experts=E, **mode)
    _assert_same(res, _run("reference", tokens, routing, probs, num_experts=E, **mode))
    _assert_same(res, naive_permute(tokens, routing, probs, E, **mode))
    assert int(res.tokens_per_expert.sum()) == min(mode["num_out_tokens"], routed_slots(routing))
    if align == 1:
        assert torch.equal(res.row_id_map, te_kept_rows(routing, mode["num_out_tokens"]))
    if case == "expert_without_tokens":
        assert res.tokens_per_expert[1] == 0 and res.tokens_per_expert[4] == 0


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_num_out_tokens_backward(backend, kind, dtype):
    """Gradients through permute with the tail dropped: dropped slots give exactly zero, to tokens
    (a token whose slots are all dropped gets a zero gradient) and to probs."""
    T, H, E, K = 21, 40, 6, 3
    tokens, routing, probs = _inputs(T, H, E, K, kind, dtype, seed=3)
    mode = resolve_mode(dict(num_out_tokens="half", align=2), routing)
    grads = _grads_fn(tokens, routing, probs, E, mode)
    gt, gp, row_map = grads(backend, tokens, probs)
    rt, rp, _ = grads("reference", tokens.double(), probs.double())
    lt, _, _ = grads("reference", tokens, probs)
    assert_close_to_ref(gt, rt, dtype=dtype, torch_lowp=lt, name="grad tokens")
    assert torch.equal(gp.double(), rp), "grad of probs is a pure gather: exact"
    dropped = (row_map < 0) & (routing != 0 if kind == "mask" else routing >= 0)
    assert dropped.any() and (gp[dropped] == 0).all()
    none_kept = (row_map < 0).all(1)
    assert none_kept.any() and (gt[none_kept] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("kind", ["index", "mask"])
def test_num_out_tokens_zero_backward(backend, kind):
    """num_out_tokens=0 with routed slots: no output row, and the gradients of tokens and probs
    are exact zeros of the inputs' shapes (the probs gather has nothing to read from)."""
    T, H, E, K = 9, 16, 4, 2
    tokens, routing, probs = _inputs(T, H, E, K, kind, torch.float32, seed=5)
    tok = tokens.clone().requires_grad_()
    pr = probs.clone().requires_grad_()
    r = _run(backend, tok, routing, pr, num_experts=E, num_out_tokens=0)
    assert r.tokens.shape == (0, H) and r.probs.shape == (0,)
    with amo.use_backend(backend):
        (r.tokens.sum() + r.probs.sum()).backward()
    assert tok.grad.shape == tokens.shape and (tok.grad == 0).all()
    assert pr.grad.shape == probs.shape and (pr.grad == 0).all()


# ---- native (C++) backend specifics: the parallel map path, streaming copies, thread counts ----

NATIVE = "native" in backends("moe_permute")


@pytest.mark.skipif(not NATIVE, reason="the native backend is not built")
@pytest.mark.parametrize("case", ["mask_parallel_map", "capacity_parallel_map", "streamed_rows"])
def test_native_large_paths_match_reference(case):
    """Inputs big enough for the C++ code paths the small shapes never take: the map computed by
    several threads (>= 2^20 routing slots) and streaming stores (output >= 16 MiB, rows of 2080
    bytes so the aligned body has an unaligned head and tail)."""
    if case == "streamed_rows":
        tokens, routing, probs = _inputs(1024, 520, 64, 8, "index", torch.float32)
        mode = dict(num_experts=64, align=8)
    else:
        tokens, routing, probs = _inputs(4096, 12, 256, 8, "mask", torch.bfloat16)
        mode = dict(num_experts=256, capacity=96) if case == "capacity_parallel_map" else dict(num_experts=256)
    _assert_same(_run("native", tokens, routing, probs, **mode), _run("reference", tokens, routing, probs, **mode))


@pytest.mark.skipif(not NATIVE, reason="the native backend is not built")
def test_native_independent_of_thread_count():
    tokens, routing, probs = _inputs(512, 300, 16, 4, "index", torch.bfloat16)
    prev = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(_run("native", tokens, routing, probs, num_experts=16, capacity=100))
    finally:
        torch.set_num_threads(prev)
    _assert_same(outs[0], outs[1])


@pytest.mark.skipif("triton" not in backends("moe_permute"), reason="triton backend not available")
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16], ids=str)
def test_triton_capacity_row_map_is_its_own(monkeypatch, kind, probs_dtype):
    """The Triton backend computes its capacity-mode row map itself: with the reference's row-map
    function disabled it still matches the contract (naive loop) and the reference exactly,
    including prob ties (bf16 probs quantize to many ties), empty slots and a capacity that
    drops tokens of some experts and leaves others short."""
    E, C = 5, 4
    tokens, routing, probs = _inputs(37, 24, E, 3, kind, torch.float32, seed=4)
    probs = None if probs_dtype is None else probs.to(probs_dtype)
    ref = _run("reference", tokens, routing, probs, num_experts=E, capacity=C)

    def disabled(*a, **k):
        raise AssertionError("the triton backend called the reference's compute_row_id_map")

    monkeypatch.setattr(ref_mod, "compute_row_id_map", disabled)
    res = _run("triton", tokens, routing, probs, num_experts=E, capacity=C)
    monkeypatch.undo()
    _assert_same(res, ref)
    _assert_same(res, naive_permute(tokens, routing, probs, E, capacity=C))
    assert (res.tokens_per_expert <= C).all() and (res.group_sizes == C).all()


def _many_experts_case(E, T=40, K=2, seed=7):
    """Ids over ``E`` experts with crowded experts in the first and in the last expert tile."""
    g = torch.Generator().manual_seed(seed)
    routing = torch.randint(-1, E, (T, K), generator=g)
    routing[: T // 2, 0] = E - 1
    routing[T // 2:, 1] = 3
    return torch.randn(T, 8, generator=g), routing, torch.rand(T, K, generator=g)


@pytest.mark.skipif("triton" not in backends("moe_permute"), reason="triton backend not available")
@pytest.mark.parametrize("E", [4097, 16385])
@pytest.mark.parametrize("mode", [dict(), dict(capacity=3), dict(align=4), dict(num_out_tokens=30, align=2)],
                         ids=["dropless", "capacity", "align", "num_out_tokens"])
def test_triton_more_experts_than_one_block(E, mode):
    """num_experts above 16384 (documented max 2**20) failed in the Triton kernels ("numel
    (2097152) exceeds triton maximum tensor numel"): the count and scan kernels now take the
    experts tile by tile (4095 per histogram program, 4096 per scan step in the interpreter);
    bitwise equal to the reference across tiles, the num_out_tokens budget and group starts
    carried from tile to tile."""
    tokens, routing, probs = _many_experts_case(E)
    _assert_same(_run("triton", tokens, routing, probs, num_experts=E, **mode),
                 _run("reference", tokens, routing, probs, num_experts=E, **mode))


@pytest.mark.slow
@pytest.mark.skipif("triton" not in backends("moe_permute"), reason="triton backend not available")
def test_triton_documented_max_experts():
    """E = 2**20, the documented maximum (dropless: the capacity and align outputs have E * C
    rows, which the interpreter zero-fills slowly)."""
    E = 2 ** 20
    tokens, routing, probs = _many_experts_case(E, T=16)
    _assert_same(_run("triton", tokens, routing, probs, num_experts=E),
                 _run("reference", tokens, routing, probs, num_experts=E))


@pytest.mark.parametrize("backend", [b for b in backends("moe_permute") if b == "ascendc-emu"])
@pytest.mark.parametrize("mode", [dict(), dict(capacity=3), dict(align=4)], ids=["dropless", "capacity", "align"])
def test_permute_more_slots_than_the_token_major_loop(backend, mode):
    """top-K > 64: the AscendC kernel's row-major loop (the token-major one reads at most 64
    destinations per token); bitwise equal to the reference, padding rows zero."""
    T, H, E, K = 5, 48, 80, 66
    tokens, routing, probs = _inputs(T, H, E, K, "index", torch.bfloat16)
    ref = _run("reference", tokens, routing, probs, num_experts=E, **mode)
    res = _run(backend, tokens, routing, probs, num_experts=E, **mode)
    _assert_same(res, ref)
