"""moe_unpermute (and its backward op): every backend present vs the fp64 reference with the
2x-PyTorch error rule, determinism, NaN isolation, round trips, autograd, opcheck and bad input."""

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.testing import assert_close_to_ref
from conftest import backends, ops_of
from test_moe_permute import SHAPES, _inputs, resolve_mode

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MODES = [dict(), dict(capacity=3), dict(align=4)]
MODE_IDS = ["dropless", "capacity", "align"]


def _permuted(T, H, E, K, kind, dtype, mode, seed=0):
    tokens, routing, probs = _inputs(T, H, E, K, kind, dtype, seed=seed)
    with amo.use_backend("reference"):
        res = amo.moe_permute(tokens, routing, probs, num_experts=E, **resolve_mode(mode, routing),
                              map_type="mask" if routing.dtype == torch.bool else "index")
    # expert outputs: something other than the permuted tokens, with NaN in every unused row
    rows = res.tokens.float() * 1.5 + 0.25
    used = torch.zeros(rows.shape[0], dtype=torch.bool)
    used[res.row_id_map[res.row_id_map >= 0].long()] = True
    rows[~used] = float("nan")
    return tokens, probs, res, rows.to(dtype)


def _unpermute(backend, *args):
    with amo.use_backend(backend):
        return amo.moe_unpermute(*args)


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xH{}xE{}xK{}".format(*s))
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_forward_matches_fp64_reference(backend, dtype, shape, kind, mode, with_probs):
    T, H, E, K = shape
    if kind == "mask" and E > 64:
        pytest.skip("mask routing is tested on the smaller expert counts (same code path)")
    _, probs, res, rows = _permuted(T, H, E, K, kind, dtype, mode)
    probs = probs if with_probs else None
    out = _unpermute(backend, rows, res.row_id_map, probs)
    assert out.dtype == dtype and out.shape == (T, H)
    ref64 = _unpermute("reference", rows.double(), res.row_id_map, None if probs is None else probs.double())
    lowp = _unpermute("reference", rows, res.row_id_map, probs)
    assert torch.isfinite(out).all(), "NaN from a row no kept slot points to leaked into the output"
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp)
    # bitwise deterministic
    assert torch.equal(out, _unpermute(backend, rows, res.row_id_map, probs))


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_int32_and_int64_maps_agree(backend):
    _, probs, res, rows = _permuted(40, 32, 8, 2, "index", torch.float32, dict(align=2))
    a = _unpermute(backend, rows, res.row_id_map.to(torch.int32), probs)
    b = _unpermute(backend, rows, res.row_id_map.to(torch.int64), probs)
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_round_trip(backend, dtype, mode):
    """unpermute(permute(x)) == x * (number of kept slots of each token)."""
    tokens, routing, probs = _inputs(37, 96, 8, 4, "index", dtype)
    with amo.use_backend(backend):
        res = amo.moe_permute(tokens, routing, probs, num_experts=8, **mode, map_type="index")
        back = amo.moe_unpermute(res.tokens, res.row_id_map)
    kept = (res.row_id_map >= 0).sum(1, keepdim=True)
    expected = tokens.double() * kept.double()
    assert_close_to_ref(back, expected, dtype=dtype, torch_lowp=(tokens.float() * kept).to(dtype))


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "noprobs"])
def test_backward_matches_fp64_reference(backend, dtype, mode, with_probs):
    T, H, E, K = 29, 48, 6, 3
    _, probs, res, rows = _permuted(T, H, E, K, "index", dtype, mode)
    rows = torch.nan_to_num(rows, nan=0.0)
    probs = probs if with_probs else None
    g = torch.randn(T, H).to(dtype)

    def grads(bk, x, p, gout):
        x = x.clone().requires_grad_()
        p = None if p is None else p.clone().requires_grad_()
        with amo.use_backend(bk):
            out = amo.moe_unpermute(x, res.row_id_map, p)
            out.backward(gout)
        return x.grad, (None if p is None else p.grad)

    gx, gp = grads(backend, rows, probs, g)
    rx, rp = grads("reference", rows.double(), None if probs is None else probs.double(), g.double())
    lx, lp = grads("reference", rows, probs, g)
    assert_close_to_ref(gx, rx, dtype=dtype, torch_lowp=lx, name="grad permuted")
    used = torch.zeros(rows.shape[0], dtype=torch.bool)
    used[res.row_id_map[res.row_id_map >= 0].long()] = True
    assert (gx[~used] == 0).all(), "rows no slot points to must get exactly zero gradient"
    if with_probs:
        assert_close_to_ref(gp, rp, dtype=probs.dtype, torch_lowp=lp, name="grad probs")
        assert (gp[res.row_id_map < 0] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
@pytest.mark.parametrize("kind", ["index", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_num_out_tokens_dropped_slots_contribute_zero(backend, kind, dtype):
    """After a permute that keeps only the first num_out_tokens rows, the dropped slots (row map -1)
    are zero contributions, forward and backward, on every backend: the combine of a token equals
    the plain fp64 sum over its kept slots, a token with no kept slot is exactly zero, and dropped
    slots get exactly zero prob gradient."""
    T, H, E, K = 25, 40, 6, 3
    _, probs, res, rows = _permuted(T, H, E, K, kind, dtype, dict(num_out_tokens="half", align=2), seed=1)
    rmap = res.row_id_map
    assert (rmap < 0).all(1).any() and (rmap >= 0).any()  # some tokens lost every slot, some kept some
    want = torch.zeros(T, H, dtype=torch.float64)
    for t, s_ in torch.nonzero(rmap >= 0).tolist():
        want[t] += probs[t, s_].double() * rows[rmap[t, s_]].double()
    out = _unpermute(backend, rows, rmap, probs)
    assert torch.isfinite(out).all() and (out[(rmap < 0).all(1)] == 0).all()
    assert_close_to_ref(out, want, dtype=dtype, torch_lowp=_unpermute("reference", rows, rmap, probs))
    x = torch.nan_to_num(rows, nan=0.0).requires_grad_()
    p = probs.clone().requires_grad_()
    with amo.use_backend(backend):
        amo.moe_unpermute(x, rmap, p).sum().backward()
    assert (p.grad[rmap < 0] == 0).all() and (p.grad[rmap >= 0] != 0).any()
    used = torch.zeros(x.shape[0], dtype=torch.bool)
    used[rmap[rmap >= 0].long()] = True
    assert (x.grad[~used] == 0).all() and (x.grad[used] != 0).any()


@pytest.mark.parametrize("backend", backends("moe_unpermute_backward"))
def test_backward_op_without_probs_uses_stand_in(backend):
    """Without probs only N and the dtype of `permuted` matter (autograd passes an [N, 0] tensor)."""
    _, _, res, rows = _permuted(16, 24, 4, 2, "index", torch.float32, dict(align=4))
    g = torch.randn(16, 24)
    op = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
    with amo.use_backend(backend):
        full, _ = op(g, torch.nan_to_num(rows), res.row_id_map, None)
        stand_in, gp = op(g, rows.new_empty((rows.shape[0], 0)), res.row_id_map, None)
    assert torch.equal(full, stand_in) and gp.numel() == 0


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_edge_cases(backend):
    # empty input
    out = _unpermute(backend, torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.int32), torch.rand(0, 2))
    assert out.shape == (0, 8)
    # all slots dropped -> zeros even if every row is NaN
    rows = torch.full((6, 8), float("nan"))
    out = _unpermute(backend, rows, torch.full((3, 2), -1, dtype=torch.int32), torch.rand(3, 2))
    assert torch.equal(out, torch.zeros(3, 8))
    # top-1, no probs: a pure gather
    perm = torch.randn(5, 7)
    rmap = torch.tensor([[4], [0], [-1], [2]], dtype=torch.int32)
    out = _unpermute(backend, perm, rmap, None)
    assert torch.equal(out[0], perm[4]) and torch.equal(out[1], perm[0]) and (out[2] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_non_contiguous_inputs(backend):
    _, probs, res, rows = _permuted(30, 64, 8, 4, "index", torch.float32, dict())
    rows = torch.nan_to_num(rows)
    rows_nc = torch.empty(64, rows.shape[0]).t()
    rows_nc.copy_(rows)
    p_nc = torch.stack([probs, probs], 2).reshape(30, 8)[:, ::2]
    m_nc = torch.stack([res.row_id_map, res.row_id_map], 2).reshape(30, 8)[:, ::2]
    assert not (rows_nc.is_contiguous() or p_nc.is_contiguous() or m_nc.is_contiguous())
    assert torch.equal(_unpermute(backend, rows_nc, m_nc, p_nc), _unpermute(backend, rows, res.row_id_map, probs))


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_opcheck(backend):
    _, probs, res, rows = _permuted(10, 16, 4, 2, "index", torch.float32, dict(align=4))
    rows = torch.nan_to_num(rows).requires_grad_()
    probs = probs.requires_grad_()
    ops = ops_of(backend)  # the backend's own namespace
    for p in (probs, None):
        torch.library.opcheck(ops("moe_unpermute"), (rows, res.row_id_map, p))
        torch.library.opcheck(ops("moe_unpermute_backward"),
                              (torch.randn(10, 16), rows.detach(), res.row_id_map, None if p is None else p.detach()))


@pytest.mark.parametrize("bad, match", [
    (dict(permuted=torch.randn(8)), "permuted must be 2-D"),
    (dict(permuted=torch.ones(8, 4, dtype=torch.int32)), "permuted must have dtype"),
    (dict(row_id_map=torch.zeros(3, 2)), "row_id_map must have dtype"),
    (dict(row_id_map=torch.tensor([[0, 1], [2, 8], [3, -1]])), "row_id_map .* outside the valid range"),
    (dict(row_id_map=torch.tensor([[0, 1], [2, -5], [3, -1]])), "row_id_map .* outside the valid range"),
    (dict(probs=torch.rand(3, 3)), "probs must have shape"),
    (dict(probs=torch.rand(3, 2, device="meta")), "probs is on meta"),
])
def test_bad_inputs(bad, match):
    args = dict(permuted=torch.randn(8, 4), row_id_map=torch.tensor([[0, 1], [2, 7], [3, -1]]),
                probs=torch.rand(3, 2))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        amo.moe_unpermute(**args)


# ---- native (C++) backend specifics: thread counts, streaming stores, unchecked maps ----

NATIVE = "native" in backends("moe_unpermute")


@pytest.mark.skipif(not NATIVE, reason="the native backend is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_bitwise_independent_of_thread_count(dtype):
    """Each output element is summed by one thread in slot order: 1 and 2 threads agree bitwise."""
    _, probs, res, rows = _permuted(256, 1000, 16, 8, "index", dtype, dict(align=4))
    g = torch.randn(256, 1000).to(dtype)
    op_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
    prev = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with amo.use_backend("native"):
                outs.append((amo.moe_unpermute(rows, res.row_id_map, probs),
                             *op_bwd(g, rows, res.row_id_map, probs)))
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not NATIVE, reason="the native backend is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_streamed_output_matches_reference(dtype):
    """Outputs >= 16 MiB take the streaming-store path (forward [T, H] and backward [N, H])."""
    T, H, E, K = 2048, 4096, 32, 2
    _, probs, res, rows = _permuted(T, H, E, K, "index", dtype, dict())
    g = torch.randn(T, H).to(dtype)
    op_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
    out = {}
    for b in ("native", "reference"):
        with amo.use_backend(b):
            out[b] = (amo.moe_unpermute(rows, res.row_id_map, None), *op_bwd(g, rows, res.row_id_map, probs))
    assert torch.equal(out["native"][0], out["reference"][0])  # no probs: exact sums in slot order
    assert torch.equal(out["native"][1], out["reference"][1])  # w * g rounded once: exact
    assert torch.allclose(out["native"][2], out["reference"][2], rtol=1e-3, atol=1e-3)
