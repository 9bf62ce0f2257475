"""flash_attention: every backend x dtype x (causal / not) x (batch / varlen) forward, LSE and
backward against the fp64 reference with the "2 x PyTorch's own error" rule, varlen = per-sequence
batch, opcheck, torch.compile, bad input."""

import inspect
import re

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.testing import ERROR_FACTOR, assert_close_to_ref, max_abs_err, torch_attention, torch_sdpa
from conftest import attention_parity_grid, backends, ops_of, skip_reference_lowp

_DEFAULT_CAUSAL = inspect.signature(amo.flash_attention).parameters["causal"].default
OP = "flash_attention_fwd"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The Triton interpreter is slow: tiny shapes (its bf16 tl.dot is wrong: the wrappers run bf16 as fp32 there).
# Head dims: MLA's 192/128 on the fast paths; 24/16 (a 16 + 8 split, like 128 + 64) in Triton.
DIMS = {"triton": (24, 16)}
REAL_DIMS = (192, 128)
VARLEN = {"triton": [0, 1, 12, 13, 30], "default": [0, 1, 98, 99, 160]}  # lengths 1, 97(odd), 1, 61
BATCH = {"triton": (2, 13, 2), "default": (2, 37, 2)}  # B, S, H


def _fa_backends():
    return backends(OP)


def _fp(backend):
    """The "full precision" dtype of the fp32 tests on a backend: the Ascend Cube path (ascendc-emu)
    has no fp32 (its refusal is tested in tests/test_ascend_flash_attention.py), so fp16 there."""
    return torch.float16 if backend == "ascendc-emu" else torch.float32


def _skip(backend, dtype):
    """Every backend runs every dtype here (the Triton interpreter's bf16 runs as fp32 copies)."""


def _inputs(shape_tok, H, Dq, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_tok, H, Dq, generator=g, dtype=torch.float64)
    k = torch.randn(*shape_tok, H, Dq, generator=g, dtype=torch.float64)
    v = torch.randn(*shape_tok, H, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(*shape_tok, H, Dv, generator=g, dtype=torch.float64)
    return q, k, v, do


def _run(backend, tensors, dtype, **kw):
    q, k, v, do = (t.to(dtype).clone() for t in tensors)
    for t in (q, k, v):
        t.requires_grad_()
    with amo.use_backend(backend):
        out, lse = amo.flash_attention(q, k, v, return_lse=True, **kw)
        out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad


def _run_torch(tensors, dtype, causal=None, softmax_scale=None, cu_seqlens=None):
    """PyTorch's own attention in ``dtype`` (testing.torch_attention, autograd backward): the
    baseline of the 2x rule. Same return layout as :func:`_run`."""
    causal = _DEFAULT_CAUSAL if causal is None else causal
    q, k, v, do = (t.to(dtype).clone() for t in tensors)
    batch = cu_seqlens is None
    H = q.shape[-2]
    if batch:
        B, S = q.shape[:2]
        cu_seqlens = torch.arange(B + 1) * S
    qp, kp, vp, dop = (t.reshape(-1, H, t.shape[-1]).detach().requires_grad_() for t in (q, k, v, do))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = torch_attention(qp, kp, vp, cu_seqlens, causal=causal, softmax_scale=scale)
    out.backward(dop.detach())
    res = [out.detach(), lse.float(), qp.grad, kp.grad, vp.grad]
    if batch:
        res = [r.reshape(q.shape[:2] + r.shape[1:]) for r in res[:1]] + [
            res[1].reshape(H, B, S).transpose(0, 1)] + [
            r.reshape(t.shape) for r, t in zip(res[2:], (q, k, v))]
    return tuple(res)


def _check_against_reference(backend, dtype, tensors, **kw):
    got = _run(backend, tensors, dtype, **kw)
    ref = _run("reference", tensors, torch.float64, **kw)
    low = _run_torch(tensors, dtype, **kw) if dtype != torch.float32 or backend != "reference" else None
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), got, ref, low or (None,) * 5):
        assert_close_to_ref(a, r, dtype=dtype, torch_lowp=lo, name=f"{backend} {name}")
    return got


@attention_parity_grid(OP, DTYPES)
def test_matches_reference(backend, dtype, causal, layout):
    _skip(backend, dtype)
    skip_reference_lowp(backend, dtype)
    if backend == "ascendc-emu" and dtype == torch.float32:
        pytest.skip("no fp32 on the Ascend Cube path (the refusal is tested in test_ascend_flash_attention.py)")
    Dq, Dv = DIMS.get(backend, REAL_DIMS)
    key = backend if backend in VARLEN else "default"
    H = BATCH[key][2]
    if layout == "batch":
        B, S, _ = BATCH[key]
        tensors = _inputs((B, S), H, Dq, Dv)
        kw = dict(causal=causal, softmax_scale=0.1352)
    else:
        cu = torch.tensor(VARLEN[key], dtype=torch.int32)
        tensors = _inputs((int(cu[-1]),), H, Dq, Dv)
        kw = dict(causal=causal, cu_seqlens=cu)  # default scale Dq ** -0.5
    _check_against_reference(backend, dtype, tensors, **kw)


@pytest.mark.parametrize("backend", _fa_backends())
def test_equal_head_dims_and_one_token(backend):
    tensors = _inputs((1, 1), 1, 16, 16)
    _check_against_reference(backend, _fp(backend), tensors, causal=True)
    tensors = _inputs((2, 5), 2, 32, 32)
    _check_against_reference(backend, _fp(backend), tensors, causal=False)


@pytest.mark.parametrize("backend", _fa_backends())
@pytest.mark.parametrize("token_stride", [0, 1, 7, 2**40])
def test_one_token_operands_with_any_token_stride(backend, token_stride):
    """A one-token [1, H, D] operand counts as contiguous whatever its token stride (PyTorch ignores the
    stride of a size-1 dim, and .contiguous() keeps it); the native kernel had passed that stride to BLAS
    as the leading dimension, which refused it and left the product unwritten (wrong out, lse and grads,
    no error). q, k, v, k_rope and the incoming gradient all get such strides here."""
    H, D, Dr, dt = 2, 16, 16, _fp(backend)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, H, D, generator=g, dtype=torch.float64) for _ in range(4))
    kr = torch.randn(1, Dr, generator=g, dtype=torch.float64)
    qr = torch.randn(1, H, Dr, generator=g, dtype=torch.float64)

    def odd(t):  # the same values, the token dim's stride set to token_stride
        return torch.as_strided(t.to(dt).clone(), t.shape, (token_stride,) + t.stride()[1:])

    def run(ns, tensors):
        q_, k_, v_, kr_ = tensors
        fwd = getattr(torch.ops, ns).flash_attention_fwd
        return fwd(q_, k_, v_, kr_, cu, cu, 1, 1, False, 0.3)

    q2 = torch.cat([q, qr], -1)
    want = run("ascend_moe_ops_ref", (q2, k, v, kr))
    with amo.use_backend(backend):
        got = run("ascend_moe_ops", tuple(odd(t) for t in (q2, k, v, kr)))
    for name, a, w in zip(("out", "lse"), got, want):
        assert_close_to_ref(a, w, dtype=dt, name=f"{backend} one-token stride {token_stride} {name}")
    # backward: the incoming gradient reaches the op with the odd stride (out consumed through a view)
    leaves = [t.to(dt).clone().requires_grad_() for t in (q, k, v)]
    with amo.use_backend(backend):
        out = amo.flash_attention(*leaves, cu_seqlens=cu, max_seqlen=1)
    out.backward(odd(do))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.ops.ascend_moe_ops_ref.flash_attention_fwd(*ref, None, cu, cu, 1, 1, False, D ** -0.5)[0].backward(do)
    for name, a, w in zip(("dq", "dk", "dv"), leaves, ref):
        assert_close_to_ref(a.grad, w.grad, dtype=dt, name=f"{backend} one-token stride {token_stride} {name}")


@pytest.mark.parametrize("backend", _fa_backends())
def test_varlen_equals_per_sequence_batch(backend, monkeypatch):
    # ascendc-emu: 16 x 16 blocks for every call, so packed and per-sequence runs do the same block sums
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    Dq, Dv = DIMS.get(backend, (48, 32))
    cu = [0, 7, 8, 25]
    q, k, v, do = _inputs((cu[-1],), 2, Dq, Dv, seed=3)
    packed = _run(backend, (q, k, v, do), _fp(backend), cu_seqlens=torch.tensor(cu))
    for s, e in zip(cu[:-1], cu[1:]):
        one = _run(backend, tuple(t[None, s:e] for t in (q, k, v, do)), _fp(backend))
        for name, a, b in zip(("out", "dq", "dk", "dv"), (packed[0],) + packed[2:], (one[0],) + one[2:]):
            torch.testing.assert_close(a[s:e], b[0], atol=2e-6, rtol=1e-5, msg=f"{name} of sequence {s}:{e}")
        torch.testing.assert_close(packed[1][:, s:e], one[1][0], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", _fa_backends())
def test_empty_sequence_and_lse_layout(backend):
    q, k, v, do = _inputs((9,), 2, 16, 16)
    cu = torch.tensor([0, 4, 4, 9])
    # values too, not only shapes: an empty sequence in the middle must not disturb its neighbours
    out, lse, dq, dk, dv = _check_against_reference(backend, _fp(backend), (q, k, v, do), cu_seqlens=cu)
    assert lse.shape == (2, 9) and lse.dtype == torch.float32
    assert all(torch.isfinite(t).all() for t in (out, lse, dq, dk, dv))
    with amo.use_backend(backend):
        out_b, lse_b = amo.flash_attention(*(t.to(_fp(backend))[None] for t in (q, k, v)), return_lse=True)
    assert out_b.shape == (1, 9, 2, 16) and lse_b.shape == (1, 2, 9)


@pytest.mark.parametrize("backend", _fa_backends())
@pytest.mark.parametrize("kernels", ["fused", "phases"])
def test_lse_of_a_nan_or_inf_row_is_not_the_no_key_marker(backend, kernels, monkeypatch):
    """lse = -inf marks a row that sees no key, and only that: a row with a NaN score gives NaN (as the
    reference), one with a +inf score +inf (the reference's logsumexp; the kernels take the row max,
    their online softmax's exp(inf - inf) being NaN); the other rows are untouched. Native, Triton and
    AscendC gave -inf for both before 2026-12-07."""
    if kernels == "phases" and backend != "ascendc-emu":
        pytest.skip("one kernel set")
    monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", kernels)
    dt = _fp(backend)
    q, k, v, _ = (t.to(dt) for t in _inputs((7,), 2, 8, 8, seed=3))
    q[1, 0, 0] = float("nan")
    q[4, 1, :] = float("inf")  # with k[:, 1, :].sum(-1) > 0 somewhere: a +inf score
    k[:, 1, :] = k[:, 1, :].abs()
    cu_q, cu_k = torch.tensor([0, 7]), torch.tensor([0, 5])  # causal, Lq > Lk: rows 0, 1 see no key
    for causal, nokey in ((False, ()), (True, (0, 1))):
        with amo.use_backend(backend):
            out, lse = amo.flash_attention(q, k[:5], v[:5], causal=causal, softmax_scale=0.3, cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=5, return_lse=True)
        with amo.use_backend("reference"):
            _, want = amo.flash_attention(q.double(), k[:5].double(), v[:5].double(), causal=causal,
                                          softmax_scale=0.3, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7,
                                          max_seqlen_k=5, return_lse=True)
        nan_row = () if 1 in nokey else ((0, 1),)
        for h, t in nan_row:
            assert torch.isnan(want[h, t]) and torch.isnan(lse[h, t]), (causal, lse[h, t])
        assert want[1, 4] == float("inf") and lse[1, 4] == float("inf"), lse[1, 4]
        for t in nokey:  # the no-key rows keep their marker, in both heads
            assert torch.isneginf(lse[:, t]).all() and torch.isneginf(want[:, t]).all()
            assert (out[t] == 0).all()
        rest = torch.ones_like(want, dtype=torch.bool)
        rest[0, 1] = rest[1, 4] = False
        for t in nokey:
            rest[:, t] = False
        torch.testing.assert_close(lse[rest].double(), want[rest], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kernels", ["fused", "phases"])
@pytest.mark.parametrize("backend", _fa_backends())
def test_nan_or_inf_in_a_key_a_row_must_not_see_stays_out(backend, kernels, monkeypatch):
    """Causal: a NaN or an infinite value in a future key changes nothing for the rows that do not see
    it -- their out and lse stay finite and equal the reference's. (The fused AscendC kernels used to
    add a -inf triangle to the scores, and NaN + -inf is NaN: the earlier rows came out NaN. In a value
    row or in the backward a NaN reaches earlier rows through 0 * NaN in the products on every backend,
    the reference included.)"""
    if kernels == "phases" and backend != "ascendc-emu":
        pytest.skip("one kernel set")
    monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", kernels)
    dt = _fp(backend)
    q, k, v, _ = (t.to(dt) for t in _inputs((6,), 2, 8, 8, seed=5))
    k[4, 0, 0], k[5, 1, :] = float("nan"), float("inf")
    cu = torch.tensor([0, 6])
    res = {}
    for b in (backend, "reference"):
        with amo.use_backend(b):
            res[b] = amo.flash_attention(*((t.double() if b == "reference" else t) for t in (q, k, v)), causal=True,
                                         softmax_scale=0.3, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=6,
                                         max_seqlen_k=6, return_lse=True)
    (out, lse), (want_out, want_lse) = res[backend], res["reference"]
    lo_out, lo_lse = torch_attention(q, k, v, cu, causal=True, softmax_scale=0.3)  # PyTorch in the same dtype
    for name, g, w, lo in (("out", out[:4], want_out[:4], lo_out[:4]),  # rows 0..3
                           ("lse", lse[:, :4], want_lse[:, :4], lo_lse[:, :4].float())):
        assert torch.isfinite(w).all() and torch.isfinite(g).all(), (name, g)
        assert_close_to_ref(g, w, dtype=dt, torch_lowp=lo, name=f"{backend} {name}")
    assert torch.isnan(out[4, 0]).all() and torch.isnan(lse[0, 4:]).all()  # the rows that see key 4


@pytest.mark.parametrize("backend", _fa_backends())
def test_a_huge_finite_scale_gives_the_reference_answer(backend):
    """softmax_scale 1e24: every score times it is still finite in float32 (about 1e25), the softmax a
    one-hot row, and every backend agrees with the fp64 reference (the native kernel's exp of a score
    minus the row max came out above 0 by the product's rounding -- ~1e15 -- and gave NaN)."""
    dt = _fp(backend)
    q, k, v, _ = (t.to(dt) for t in _inputs((7,), 2, 8, 8, seed=7))
    cu = torch.tensor([0, 3, 7])
    res = {}
    for b in (backend, "reference"):
        with amo.use_backend(b):
            res[b] = amo.flash_attention(*((t.double() if b == "reference" else t) for t in (q, k, v)), causal=True,
                                         softmax_scale=1e24, cu_seqlens=cu, max_seqlen=4, return_lse=True)
    (out, lse), (want_out, want_lse) = res[backend], res["reference"]
    assert torch.isfinite(out).all() and torch.isfinite(lse).all(), backend
    # one-hot rows: out is the value row of the largest score, in the input dtype
    torch.testing.assert_close(out.double(), want_out.to(dt).double(), rtol=0, atol=0)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=0)


def test_flags_must_be_bools():
    """return_lse="no" (a truthy string) returned (out, lse): flags are bools, named in the error."""
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        amo.flash_attention(q, q, q, cu_seqlens=cu, max_seqlen=4, return_lse="no")
    with pytest.raises(TypeError, match="causal must be a bool"):
        amo.flash_attention(q, q, q, cu_seqlens=cu, max_seqlen=4, causal=1)


def test_softmax_scale_past_float32_is_taken_in_float64():
    """The finiteness rule follows the accumulation type: 1e39 is refused for float32 inputs (it is inf
    there: test_op_contracts) and taken for float64 ones, where it is finite."""
    q, k, v, _ = (t.double() for t in _inputs((3,), 1, 4, 4, seed=1))
    cu = torch.tensor([0, 3])
    for b in ("reference", "native"):
        if b not in amo.available_backends("flash_attention_fwd"):
            continue
        with amo.use_backend(b):
            out = amo.flash_attention(q, k, v, causal=True, softmax_scale=1e39, cu_seqlens=cu, max_seqlen=3)
        assert torch.isfinite(out).all(), b


@pytest.mark.parametrize("backend", _fa_backends())
def test_nan_in_a_masked_value_row_is_the_documented_result(backend):
    """A NaN in a value row a causal row must not see reaches it through 0 * NaN in P . V, on every backend
    as in PyTorch's scaled_dot_product_attention (docs/ops/flash_attention.md); another sequence of the
    packed batch is never affected."""
    dt = _fp(backend)
    q, k, v, _ = (t.to(dt) for t in _inputs((6,), 1, 16, 16, seed=2))
    v[2, 0, 0] = float("nan")  # the last key of sequence 0
    cu = torch.tensor([0, 3, 6])
    with amo.use_backend(backend):
        out = amo.flash_attention(q, k, v, causal=True, cu_seqlens=cu, max_seqlen=3)
    assert torch.isnan(out[:3, 0, 0]).all()  # rows 0, 1 never see key 2: NaN all the same
    with amo.use_backend("reference"):
        want = amo.flash_attention(q.double(), k.double(), v.double(), causal=True, cu_seqlens=cu, max_seqlen=3)
    assert torch.isfinite(out[3:]).all()
    assert_close_to_ref(out[3:], want[3:], dtype=dt, name=f"{backend} other sequence")


@pytest.mark.parametrize("backend", _fa_backends())
def test_opcheck(backend):
    Dq, Dv = DIMS.get(backend, (24, 16))
    q, k, v, do = (t.to(_fp(backend)) for t in _inputs((11,), 2, Dq, Dv))
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    ops = ops_of(backend)  # the backend's own namespace
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(ops("flash_attention_fwd"), (q, k, v, None, cu, cu, 6, 6, True, 0.2))
    out, lse = ops("flash_attention_fwd")(q.detach(), k.detach(), v.detach(), None, cu, cu, 6, 6, True, 0.2)
    torch.library.opcheck(ops("flash_attention_bwd"),
                          (do, q.detach(), k.detach(), v.detach(), None, out, lse, cu, cu, 6, 6, True, 0.2))


def test_compile_fullgraph():
    q, k, v, do = (t.float() for t in _inputs((2, 9), 2, 24, 16))

    def f(q, k, v):
        return amo.flash_attention(q, k, v, softmax_scale=0.3) * 2.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (compiled, f):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        y = fn(qq, kk, vv)
        y.backward(do)
        grads.append((y, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("bad, match", [
    (dict(q=torch.randn(2, 4, 2, 8, dtype=torch.float64).int()), "q must have dtype"),
    (dict(k=torch.randn(2, 4, 2, 8).half()), "k must have dtype"),
    (dict(k=torch.randn(2, 4, 3, 8), v=torch.randn(2, 4, 3, 8)), "k must have a number of heads Hkv"),
    (dict(k=torch.randn(2, 4, 2, 6)), "k head dim must equal q head dim"),
    (dict(v=torch.randn(2, 4, 8)), "v must be 4-D"),
    (dict(q=torch.randn(8, 8), k=torch.randn(8, 8), v=torch.randn(8, 8)), "q must be"),
    (dict(v=torch.randn(2, 4, 2, 8, device="meta")), "v is on meta"),
    (dict(cu_seqlens=torch.tensor([0, 8])), "packed"),
])
def test_bad_inputs(bad, match):
    args = dict(q=torch.randn(2, 4, 2, 8), k=torch.randn(2, 4, 2, 8), v=torch.randn(2, 4, 2, 8))
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        amo.flash_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("cu, match", [
    ([0, 5, 3, 8], "cu_seqlens_q must be non-decreasing"),
    ([1, 4, 8], "cu_seqlens_q must start at 0"),
    ([0, 4, 7], "cu_seqlens_q must end at the number of tokens of q T=8"),
    ([0], "cu_seqlens_q must have B\\+1 >= 2 entries"),
])
def test_bad_cu_seqlens(cu, match):
    q = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match=match):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor(cu), max_seqlen=8)


def test_bad_cu_seqlens_dtype_and_max_seqlen():
    q = torch.randn(8, 2, 8)
    with pytest.raises(TypeError, match=re.escape("cu_seqlens must have dtype in (int32, int64), got float32")):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor([0.0, 8.0]))
    # checked before max_seqlen is computed from it (that would fail inside torch, unnamed)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens must be 1-D, got shape (1, 3)")):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor([[0, 4, 8]]))
    with pytest.raises(ValueError, match="cu_seqlens is on meta but the other inputs are on cpu"):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor([0, 4, 8], device="meta"))
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k must be 1-D")):
        amo.flash_attention(q, q, q, cu_seqlens_q=torch.tensor([0, 8]), cu_seqlens_k=torch.tensor([[0, 8]]))
    with pytest.raises(ValueError, match="max_seqlen_q=3 is smaller than the longest sequence"):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor([0, 8]), max_seqlen=3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reference_meets_2x_rule(dtype):
    """The oracle itself in fp16/bf16 (the CPU fallback and every parity test's yardstick): its
    max error against fp64 is at most 2 x PyTorch's own in the same precision, forward and
    backward, at MLA's 192/128 head dims, varlen, causal. Both baselines: the naive composition
    (testing.torch_attention) and the fused scaled_dot_product_attention (fp32 inside, the
    stricter one). The inputs are representable in ``dtype``, so only the computation's error
    is measured. The LSE (fp32 from fp32 scores) must be fp32-accurate."""
    cu = torch.tensor([0, 1, 98, 99, 160])
    kw = dict(causal=True, cu_seqlens=cu, softmax_scale=0.1352)
    tensors = [t.to(dtype).double() for t in _inputs((160,), 2, 192, 128, seed=11)]
    exact = _run("reference", tensors, torch.float64, **kw)
    ours = _run("reference", tensors, dtype, **kw)
    naive = _run_torch(tensors, dtype, **kw)
    leaves = [t.to(dtype).requires_grad_() for t in tensors[:3]]
    out = torch_sdpa(*leaves, cu, causal=True, softmax_scale=0.1352)
    out.backward(tensors[3].to(dtype))
    fused = [out.detach(), None] + [t.grad for t in leaves]
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    for name, a, r, lo, fu in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, naive, fused):
        err = max_abs_err(a, r)
        assert err <= ERROR_FACTOR * max_abs_err(lo, r), f"{name}: {err:.3e} vs naive {max_abs_err(lo, r):.3e}"
        if fu is not None:
            assert err <= ERROR_FACTOR * max_abs_err(fu, r), f"{name}: {err:.3e} vs sdpa {max_abs_err(fu, r):.3e}"
    assert max_abs_err(ours[1], exact[1]) <= 1e-5 * exact[1].abs().max().item()


@pytest.mark.parametrize("backend", _fa_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
def test_one_key_rows_give_exactly_zero_dq_dk(backend, dtype, causal, rope):
    """A query that sees a single key (a one-token sequence; with causal, the first query of
    every sequence) has softmax weight 1, so its score gradient is 0: its dq row is exactly 0,
    and a one-token sequence's dk (and shared rope-key gradient) is exactly 0, not ~1e-6."""
    if backend == "ascendc-emu" and dtype == torch.float32:
        pytest.skip("no fp32 on the Ascend Cube path")
    cu = [0, 1, 2, 9, 10, 17, 18]  # one-token sequences at rows 0, 1, 9 and 17
    T, H, Dk, Dr, Dv = cu[-1], 2, 16, (8 if rope else 0), 16
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(T, H, d, generator=g).to(dtype) for d in (Dk + Dr, Dk, Dv, Dv))
    kr = torch.randn(T, Dr, generator=g).to(dtype) if rope else None
    cu_t = torch.tensor(cu, dtype=torch.int32)
    ops = torch.ops.ascend_moe_ops
    with amo.use_backend(backend):
        out, lse = ops.flash_attention_fwd(q, k, v, kr, cu_t, cu_t, 7, 7, causal, 0.3)
        dq, dk, dv, dkr = ops.flash_attention_bwd(do, q, k, v, kr, out, lse, cu_t, cu_t, 7, 7, causal, 0.3)
    single = [0, 1, 9, 17]
    one_key_queries = single + ([2, 10] if causal else [])
    assert (dq[one_key_queries] == 0).all(), f"dq of one-key rows: {dq[one_key_queries].abs().max():.3e}"
    assert (dk[single] == 0).all(), f"dk of one-token sequences: {dk[single].abs().max():.3e}"
    if rope:
        assert (dkr[single] == 0).all(), f"dk_rope of one-token sequences: {dkr[single].abs().max():.3e}"
    # the other rows do get gradients (the test is not vacuous)
    assert dq[3:9].abs().min() > 0 and dk[3:9].abs().max() > 0
    torch.testing.assert_close(dv[single].float(), do[single].float(), atol=1e-3, rtol=1e-3)


# =================================================================================================
# API parity with the peers: seqlen_q != seqlen_k (causal aligned bottom-right, flash-attention
# >= 2.1), GQA/MQA, d_v > d_qk and the LSE layout, on every backend, forward and backward, against an
# fp64 dense-math oracle written here (independent of the reference).

# Features a backend's kernels do not do yet: its cases are xfail(strict=True,
# raises=NotImplementedError). THE one place: delete an entry when the kernels learn the feature.
NOT_YET: dict = {}


def _parity_backends(*features):
    out = []
    for b in _fa_backends():
        missing = sorted(NOT_YET.get(b, set()) & set(features))
        marks = [pytest.mark.xfail(strict=True, raises=NotImplementedError,
                                   reason=f"{b} backend: {', '.join(missing)} not implemented yet")] if missing else []
        out.append(pytest.param(b, marks=marks, id=b))
    return out


def oracle(q, k, v, cu_q, cu_k, causal, scale):
    """Dense attention in plain torch on packed ``[T, H, D]`` tensors (fp64 for the oracle; any dtype
    for PyTorch's own low-precision error), differentiable by autograd. Query ``i`` of a sequence
    with ``Lq`` queries and ``Lk`` keys sees keys ``j <= i + Lk - Lq`` when causal; q head ``h``
    uses kv head ``h // (Hq // Hkv)``; a row that sees no key gives 0 and lse -inf."""
    Hq, Hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    bq, bk = [int(x) for x in cu_q], [int(x) for x in cu_k]
    for sq, eq, sk, ek in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        Lq, Lk = eq - sq, ek - sk
        ks, vs = (t[sk:ek].repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
        s = torch.einsum("ihd,jhd->hij", q[sq:eq], ks) * scale
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
        allowed = (j <= i + (Lk - Lq)) if causal else torch.ones(Lq, Lk, dtype=torch.bool)
        seen = allowed.any(-1)
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(~seen[:, None], 0.0)
        p = torch.softmax(s, dim=-1) * seen[:, None]
        outs.append(torch.einsum("hij,jhd->ihd", p, vs))
        none = torch.full((Hq, Lq), float("-inf"), dtype=s.dtype)
        lses.append(torch.where(seen, torch.logsumexp(s, dim=-1), none))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def oracle_grads(q, k, v, do, cu_q, cu_k, causal, scale):
    """(out, lse, dq, dk, dv) of :func:`oracle` in the inputs' dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = oracle(*leaves, cu_q, cu_k, causal, scale)
    out.backward(do)
    return (out.detach(), lse.detach()) + tuple(t.grad for t in leaves)


def _cu(lens):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32)


def _parity(backend, dtype, lens_q, lens_k, Hq, Hkv, Dqk, Dv, causal, *, batch=False, seed=0,
            lse_layout="hs"):
    """Run the public function on ``backend`` (batch form when all lengths are equal and ``batch``,
    else the packed form with cu_seqlens_q / cu_seqlens_k) and check out, lse, dq, dk, dv against
    the fp64 oracle with the 2x rule."""
    _skip(backend, dtype)
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, Hq, Dqk, generator=g, dtype=torch.float64)
    k = torch.randn(Tk, Hkv, Dqk, generator=g, dtype=torch.float64)
    v = torch.randn(Tk, Hkv, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(Tq, Hq, Dv, generator=g, dtype=torch.float64)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    scale = 0.37
    want = oracle_grads(q, k, v, do, cu_q, cu_k, causal, scale)
    low = oracle_grads(*(t.to(dtype) for t in (q, k, v, do)), cu_q, cu_k, causal, scale)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    B = len(lens_q)
    with amo.use_backend(backend):
        if batch:
            Sq, Sk = lens_q[0], lens_k[0]
            qb, kb, vb = (t.view(B, -1, *t.shape[1:]) for t in leaves)
            out, lse = amo.flash_attention(qb, kb, vb, causal=causal, softmax_scale=scale, return_lse=True,
                                           lse_layout=lse_layout)
            assert out.shape == (B, Sq, Hq, Dv)
            out = out.reshape(Tq, Hq, Dv)
            lse = (lse.permute(1, 0, 2) if lse_layout == "hs" else lse.permute(2, 0, 1)).reshape(Hq, Tq)
        else:
            out, lse = amo.flash_attention(*leaves, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q,
                                           cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q, default=0),
                                           max_seqlen_k=max(lens_k, default=0), return_lse=True,
                                           lse_layout=lse_layout)
            if lse_layout == "sh":
                assert lse.shape == (Tq, Hq)
                lse = lse.t()
        out.backward(do.to(dtype))
    got = (out.detach(), lse) + tuple(t.grad for t in leaves)
    assert got[1].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert all(t.dtype == dtype for t in got[:1] + got[2:])
    for name, a, r, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        assert_close_to_ref(a, r, dtype=dtype, torch_lowp=None if dtype == torch.float64 else lo,
                            name=f"{backend} {name}")
    return got, want


def _lowp(backend):
    """The low-precision dtype of a backend's parity cases (bf16; fp16 where bf16 cannot run here)."""
    return torch.float16 if backend == "triton" and not torch.cuda.is_available() else torch.bfloat16


def _dims(backend, dqk, dv):
    return (16, 24) if backend == "triton" and dv > dqk else ((16, 16) if backend == "triton" else (dqk, dv))


def test_oracle_matches_sdpa_with_gqa():
    """The oracle itself: equal lengths with GQA against torch SDPA (enable_gqa; top-left causal =
    bottom-right when Sq = Sk), and Sq != Sk against SDPA with the explicit bottom-right mask."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 7, 16, generator=g, dtype=torch.float64)  # [B, H, S, D] for SDPA
    k, v = (torch.randn(2, 2, 7, 16, generator=g, dtype=torch.float64) for _ in range(2))
    pk = lambda t: t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[-1])  # noqa: E731
    for causal in (True, False):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3,
                                                                 enable_gqa=True)
        got, _ = oracle(pk(q), pk(k), pk(v), _cu([7, 7]), _cu([7, 7]), causal, 0.3)
        torch.testing.assert_close(got, pk(want))
    k2, v2 = (torch.randn(1, 8, 11, 16, generator=g, dtype=torch.float64) for _ in range(2))
    q2 = q[:1, :, :4]
    mask = torch.ones(4, 11, dtype=torch.bool).tril(11 - 4)
    want = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=0.3)
    got, _ = oracle(pk(q2), pk(k2), pk(v2), _cu([4]), _cu([11]), True, 0.3)
    torch.testing.assert_close(got, pk(want))


@pytest.mark.parametrize("backend", _parity_backends("seqlen_qk"))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lens", [(5, 11), (11, 5)], ids=["sq_lt_sk", "sq_gt_sk"])
@pytest.mark.parametrize("lowp", [False, True], ids=["fp", "lowp"])
def test_seqlen_q_ne_seqlen_k_batch(backend, causal, lens, lowp):
    dtype = _lowp(backend) if lowp else _fp(backend)
    Sq, Sk = lens
    _parity(backend, dtype, [Sq, Sq], [Sk, Sk], 2, 2, 32, 32, causal, batch=True)


@pytest.mark.parametrize("backend", _parity_backends("seqlen_qk"))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lse_layout", ["hs", "sh"])
def test_varlen_different_q_and_k_lengths(backend, causal, lse_layout):
    # per sequence (Lq, Lk): more keys, no keys, no queries, fewer keys, one query, one key
    lens_q, lens_k = [3, 4, 0, 9, 1, 5], [7, 0, 2, 4, 6, 1]
    (out, lse, dq, dk, dv), _ = _parity(backend, _fp(backend), lens_q, lens_k, 2, 2, 16, 16, causal,
                                        lse_layout=lse_layout)
    # the sequence without keys: out 0, lse -inf, dq 0 (exactly)
    assert (out[3:7] == 0).all() and torch.isneginf(lse[:, 3:7]).all() and (dq[3:7] == 0).all()
    # the keys of the sequence without queries get no gradient
    assert (dk[7:9] == 0).all() and (dv[7:9] == 0).all()


@pytest.mark.parametrize("backend", _parity_backends("seqlen_qk"))
def test_causal_rows_that_see_no_key(backend):
    """Sq > Sk, causal: the first Sq - Sk queries see no key (bottom-right alignment): out = 0,
    lse = -inf and zero dq, exactly; the next one sees exactly one key, so its dq is exactly 0."""
    (out, lse, dq, dk, dv), _ = _parity(backend, _fp(backend), [9], [4], 2, 2, 16, 16, True)
    assert (out[:5] == 0).all() and torch.isneginf(lse[:, :5]).all() and (dq[:5] == 0).all()
    assert torch.isfinite(lse[:, 5:]).all() and (dq[5] == 0).all() and dq[6:].abs().max() > 0


@pytest.mark.parametrize("backend", _parity_backends("gqa"))
@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa_8_2", "mqa_8_1"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lowp", [False, True], ids=["fp", "lowp"])
def test_gqa_and_mqa(backend, hkv, causal, lowp):
    dtype = _lowp(backend) if lowp else _fp(backend)
    _parity(backend, dtype, [6, 6], [6, 6], 8, hkv, 16, 16, causal, batch=True)


@pytest.mark.parametrize("backend", _parity_backends("gqa", "seqlen_qk"))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gqa_with_varlen_q_and_k(backend, causal):
    _parity(backend, _fp(backend), [2, 7, 0, 5], [6, 3, 4, 5], 4, 2, 16, 16, causal, seed=3)


@pytest.mark.parametrize("backend", _parity_backends())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("lowp", [False, True], ids=["fp", "lowp"])
def test_dv_larger_than_dqk(backend, causal, lowp):
    """d_v > d_qk through the public function (64 / 128; 16 / 24 in the Triton interpreter)."""
    dtype = _lowp(backend) if lowp else _fp(backend)
    Dqk, Dv = _dims(backend, 64, 128)
    _parity(backend, dtype, [5, 9], [5, 9], 2, 2, Dqk, Dv, causal, seed=1)


@pytest.mark.parametrize("backend", _parity_backends())
def test_lse_layouts(backend):
    """lse_layout="sh" is the transpose of the default "hs": [B, S, H] / [T, H]."""
    dt = _fp(backend)
    q, k, v = (torch.randn(2, 5, 2, 16).to(dt) for _ in range(3))
    cu = _cu([3, 7])
    with amo.use_backend(backend):
        o_hs, l_hs = amo.flash_attention(q, k, v, return_lse=True)
        o_sh, l_sh = amo.flash_attention(q, k, v, return_lse=True, lse_layout="sh")
        p_hs = amo.flash_attention(q.view(10, 2, 16), k.view(10, 2, 16), v.view(10, 2, 16), cu_seqlens=cu,
                                   return_lse=True)[1]
        p_sh = amo.flash_attention(q.view(10, 2, 16), k.view(10, 2, 16), v.view(10, 2, 16), cu_seqlens=cu,
                                   return_lse=True, lse_layout="sh")[1]
    assert l_hs.shape == (2, 2, 5) and l_sh.shape == (2, 5, 2) and torch.equal(o_hs, o_sh)
    assert torch.equal(l_sh, l_hs.transpose(1, 2))
    assert p_hs.shape == (2, 10) and p_sh.shape == (10, 2) and torch.equal(p_sh, p_hs.t())


@pytest.mark.parametrize("backend", [p for p in _parity_backends("gqa", "seqlen_qk")
                                     if p.values[0] in ("reference", "native")])  # the fp64 backends
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gradcheck_fp64(backend, causal):
    """gradcheck of the public function in fp64 on small shapes with every feature at once: GQA,
    varlen q/k with different lengths (an empty one too), d_v > d_qk."""
    g = torch.Generator().manual_seed(7)
    cu_q, cu_k = _cu([2, 3, 0]), _cu([3, 1, 2])
    q = torch.randn(5, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(6, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return amo.flash_attention(q, k, v, causal=causal, softmax_scale=0.6, cu_seqlens_q=cu_q,
                                   cu_seqlens_k=cu_k, max_seqlen_q=3, max_seqlen_k=3)

    with amo.use_backend(backend):
        assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(lse_layout="th"), ValueError, "lse_layout must be one of"),
    (dict(cu_seqlens=_cu([4]), cu_seqlens_q=_cu([4])), ValueError, "either cu_seqlens"),
    (dict(cu_seqlens_q=_cu([4])), ValueError, "cu_seqlens_k is missing"),
    (dict(cu_seqlens_k=_cu([4])), ValueError, "cu_seqlens_q is missing"),
    (dict(cu_seqlens_q=_cu([4]), cu_seqlens_k=_cu([4]), max_seqlen=4), ValueError, "max_seqlen goes with"),
    (dict(cu_seqlens=_cu([4]), max_seqlen_q=4), ValueError, "max_seqlen_q / max_seqlen_k go with"),
    (dict(cu_seqlens_q=_cu([4]), cu_seqlens_k=_cu([3])), ValueError, "cu_seqlens_k must end"),
    (dict(cu_seqlens_q=_cu([2, 2]), cu_seqlens_k=_cu([4])), ValueError, "cu_seqlens_k must have the B\\+1 = 3"),
])
def test_bad_varlen_arguments(kw, exc, match):
    q = torch.randn(4, 2, 8)
    with pytest.raises(exc, match=match):
        amo.flash_attention(q, q, q, **kw)


def test_bad_batch_arguments():
    q = torch.randn(2, 4, 4, 8)
    with pytest.raises(ValueError, match="k must have the batch size 2"):
        amo.flash_attention(q, torch.randn(3, 4, 4, 8), torch.randn(3, 4, 4, 8))
    with pytest.raises(ValueError, match="v must have shape"):
        amo.flash_attention(q, torch.randn(2, 6, 2, 8), torch.randn(2, 5, 2, 8))
    with pytest.raises(ValueError, match="k must have a number of heads"):
        amo.flash_attention(q, torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))
    with pytest.raises(ValueError, match="max_seqlen goes with the packed form"):
        amo.flash_attention(q, q, q, max_seqlen=4)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_triton_fp64_every_feature(causal):
    """Triton accumulates in fp64 for fp64 inputs; its fp64 gradcheck is too slow in the interpreter,
    so every feature at once (GQA, varlen q/k with different lengths and an empty one, d_v > d_qk)
    is checked against the fp64 oracle with the fp64 tolerance instead."""
    if "triton" not in _fa_backends():
        pytest.skip("no triton backend here")
    _parity("triton", torch.float64, [2, 3, 0, 4], [3, 1, 2, 6], 4, 2, 16, 24, causal)
