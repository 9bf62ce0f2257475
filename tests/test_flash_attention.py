"""flash_attention: every backend x dtype x (causal / not) x (batch / varlen) forward, LSE and
backward against the fp64 reference with the "2 x PyTorch's own error" rule, varlen = per-sequence
batch, opcheck, torch.compile, bad input."""

import inspect

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.testing import ERROR_FACTOR, assert_close_to_ref, max_abs_err, torch_attention, torch_sdpa
from conftest import backends, ops_of

_DEFAULT_CAUSAL = inspect.signature(amo.flash_attention).parameters["causal"].default
OP = "flash_attention_fwd"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The Triton interpreter is slow and its bf16 tl.dot is wrong: tiny shapes, fp32/fp16 only.
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
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("tl.dot on bf16 is wrong in the Triton interpreter; bf16 Triton runs on GPU only")


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


@pytest.mark.parametrize("backend", _fa_backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("layout", ["batch", "varlen"])
def test_matches_reference(backend, dtype, causal, layout):
    _skip(backend, dtype)
    if backend == "reference" and dtype != torch.float32:
        pytest.skip("the reference in low precision is the comparison itself")
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
def test_opcheck(backend):
    Dq, Dv = DIMS.get(backend, (24, 16))
    q, k, v, do = (t.to(_fp(backend)) for t in _inputs((11,), 2, Dq, Dv))
    cu = torch.tensor([0, 5, 11], dtype=torch.int32)
    ops = ops_of(backend)  # the backend's own namespace
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(ops("flash_attention_fwd"), (q, k, v, None, cu, 6, True, 0.2))
    out, lse = ops("flash_attention_fwd")(q.detach(), k.detach(), v.detach(), None, cu, 6, True, 0.2)
    torch.library.opcheck(ops("flash_attention_bwd"),
                          (do, q.detach(), k.detach(), v.detach(), None, out, lse, cu, 6, True, 0.2))


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
    (dict(k=torch.randn(2, 4, 3, 8)), "k must have shape"),
    (dict(k=torch.randn(2, 4, 2, 6)), "k head dim must equal q head dim"),
    (dict(v=torch.randn(2, 4, 2, 12)), r"d_v=12 > d_qk=8 is not supported"),
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
    ([0, 5, 3, 8], "cu_seqlens must be non-decreasing"),
    ([1, 4, 8], "cu_seqlens must start at 0"),
    ([0, 4, 7], "cu_seqlens must end at the number of tokens T=8"),
    ([0], "cu_seqlens must have B\\+1 >= 2 entries"),
])
def test_bad_cu_seqlens(cu, match):
    q = torch.randn(8, 2, 8)
    with pytest.raises(ValueError, match=match):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor(cu), max_seqlen=8)


def test_bad_cu_seqlens_dtype_and_max_seqlen():
    q = torch.randn(8, 2, 8)
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        amo.flash_attention(q, q, q, cu_seqlens=torch.tensor([0.0, 8.0]))
    with pytest.raises(ValueError, match="max_seqlen=3 is smaller than the longest sequence"):
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


# The AscendC kernels (csrc/ascend/kernels/flash_attention.cpp, run on the emulator) compute dS of
# a one-key row from dP and delta as they come (~6e-8 in fp16 here): not exactly zero yet.
_EMU_ONE_KEY = pytest.mark.xfail(strict=True, reason="AscendC flash attention backward: one-key rows "
                                 "give dq/dk of ~1 ulp instead of exactly 0 (kernel not changed yet)")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=_EMU_ONE_KEY) if b == "ascendc-emu" else b
                                     for b in _fa_backends()])
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
        out, lse = ops.flash_attention_fwd(q, k, v, kr, cu_t, 7, causal, 0.3)
        dq, dk, dv, dkr = ops.flash_attention_bwd(do, q, k, v, kr, out, lse, cu_t, 7, causal, 0.3)
    single = [0, 1, 9, 17]
    one_key_queries = single + ([2, 10] if causal else [])
    assert (dq[one_key_queries] == 0).all(), f"dq of one-key rows: {dq[one_key_queries].abs().max():.3e}"
    assert (dk[single] == 0).all(), f"dk of one-token sequences: {dk[single].abs().max():.3e}"
    if rope:
        assert (dkr[single] == 0).all(), f"dk_rope of one-token sequences: {dkr[single].abs().max():.3e}"
    # the other rows do get gradients (the test is not vacuous)
    assert dq[3:9].abs().min() > 0 and dk[3:9].abs().max() > 0
    torch.testing.assert_close(dv[single].float(), do[single].float(), atol=1e-3, rtol=1e-3)
