"""swiglu_probs (the adapters' fused SwiGLU x router-prob kernel): native and reference vs fp64
with the 2x-PyTorch error rule, gradients, edge cases, opcheck and bad input."""

import pytest
import torch
import torch.nn.functional as F

import ascend_moe_ops  # noqa: F401  (registers the ops)
from ascend_moe_ops import _backends, _library
from ascend_moe_ops.ops import swiglu_probs as sp
from ascend_moe_ops.testing import assert_close_to_ref

NAMESPACES = [pytest.param(sp.REFERENCE, id="reference")]
if _backends.load("native") is None and torch._C._dispatch_has_kernel_for_dispatch_key(f"{sp.NATIVE}::{sp.OP}", "CPU"):
    NAMESPACES.insert(0, pytest.param(sp.NATIVE, id="native"))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _op(ns, name=sp.OP):
    return getattr(getattr(torch.ops, ns), name).default


def _torch(x, p):
    """What Megatron-Core's GroupedMLP computes (eager): silu(x1) * x2 in x's dtype, times probs."""
    a, b = torch.chunk(x, 2, dim=-1)
    return (F.silu(a) * b * p.unsqueeze(1)).to(x.dtype)


def _inputs(N, F2, dtype, pdtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, F2, generator=g) * 3).to(dtype)
    p = torch.rand(N, generator=g).to(pdtype)
    go = torch.randn(N, F2 // 2, generator=g).to(dtype)
    return x, p, go


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# N x F >= 2^16 (the last) runs the native kernel's rows on several threads
@pytest.mark.parametrize("shape", [(1, 2), (37, 2 * 19), (130, 512), (600, 512)], ids=lambda s: f"N{s[0]}xF{s[1] // 2}")
def test_forward_and_backward_match_fp64(ns, dtype, shape):
    x, p, go = _inputs(*shape, dtype)
    out = _op(ns)(x, p)
    x64, p64 = x.double().requires_grad_(), p.double().requires_grad_()
    ref = _torch(x64, p64)
    ref.backward(go.double())
    xl, pl = x.clone().requires_grad_(), p.clone().requires_grad_()
    low = _torch(xl, pl)
    low.backward(go)
    assert out.dtype == dtype and out.shape == (shape[0], shape[1] // 2)
    assert_close_to_ref(out, ref.detach(), torch_lowp=low.detach(), name="out")
    gx, gp = _op(ns, sp.BWD)(go, x, p)
    assert gx.dtype == dtype and gp.dtype == p.dtype
    assert_close_to_ref(gx, x64.grad, torch_lowp=xl.grad, name="grad x")
    assert_close_to_ref(gp, p64.grad, dtype=dtype, torch_lowp=pl.grad, name="grad probs")


@pytest.mark.parametrize("ns", NAMESPACES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
def test_very_negative_and_infinite_gates_match_the_reference(ns, dtype):
    """silu(a) for a far below the exp clamp: -0 as torch's silu, NaN for a = -inf (the native fp32
    sigmoid was floored at 6e-39 before 2026-12-07: silu(-3e38) = -1.8, silu(-inf) = -inf, the
    backward -1.8 / -inf too); forward and backward match the reference: the same zeros, infinities
    and NaNs, the finite gate's values to rounding."""
    big = torch.finfo(dtype).max
    gate = torch.tensor([-big, -1e30 if dtype in (torch.float32, torch.float64, torch.bfloat16) else -6e4,
                         float("-inf"), -200.0, -110.0, float("inf"), float("nan"), 3.0], dtype=torch.float64)
    x = torch.cat([gate, torch.linspace(0.5, 2.0, gate.numel(), dtype=torch.float64)]).view(1, -1).to(dtype)
    p = torch.tensor([0.75])
    go = torch.ones(1, gate.numel(), dtype=dtype)
    got, want = _op(ns)(x, p), _op(sp.REFERENCE)(x, p)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0, equal_nan=True)
    torch.testing.assert_close(got[0, :2], torch.zeros(2, dtype=dtype), rtol=0, atol=0)
    assert torch.isnan(got[0, 2]) and torch.isnan(got[0, 6]) and got[0, 5] == float("inf")
    (gx, gp), (wx, wp) = _op(ns, sp.BWD)(go, x, p), _op(sp.REFERENCE, sp.BWD)(go, x, p)
    torch.testing.assert_close(gx, wx, rtol=1e-2, atol=0, equal_nan=True)
    torch.testing.assert_close(gp, wp, rtol=1e-2, atol=0, equal_nan=True)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_autograd_and_fp64_gradcheck(ns):
    x = torch.randn(6, 10, dtype=torch.float64, requires_grad=True)
    p = torch.rand(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_op(ns), (x, p))


@pytest.mark.parametrize("ns", NAMESPACES)
def test_opcheck(ns):
    x, p, _ = _inputs(9, 16, torch.float32)
    torch.library.opcheck(_op(ns), (x, p))
    torch.library.opcheck(_op(ns, sp.BWD), (torch.randn(9, 8), x, p))


@pytest.mark.parametrize("ns", NAMESPACES)
def test_bf16_probs_noncontiguous_and_empty(ns):
    x, p, _ = _inputs(20, 64, torch.bfloat16, pdtype=torch.bfloat16)
    wide = torch.zeros(20, 96, dtype=torch.bfloat16)
    wide[:, 16:80] = x
    xs = wide[:, 16:80]  # non-contiguous view
    assert not xs.is_contiguous()
    out = sp.swiglu_probs(xs, p) if ns == sp.namespace_for(xs) else _op(ns)(xs.contiguous(), p)
    assert torch.equal(out, _op(ns)(x, p))
    assert_close_to_ref(out, _torch(x.double(), p.double()), torch_lowp=_torch(x, p.float()))
    for shape in [(0, 8), (5, 0)]:
        e = torch.zeros(shape, dtype=torch.bfloat16)
        out = _op(ns)(e, torch.ones(shape[0]))
        assert out.shape == (shape[0], shape[1] // 2)
        gx, gp = _op(ns, sp.BWD)(torch.zeros(shape[0], shape[1] // 2, dtype=torch.bfloat16), e, torch.ones(shape[0]))
        assert gx.shape == shape and gp.shape == (shape[0],) and not gp.any()


def test_deterministic_and_native_close_to_reference():
    x, p, go = _inputs(300, 2 * 300, torch.bfloat16)
    ns = sp.namespace_for(x)
    a, b = _op(ns)(x, p), _op(ns)(x, p)
    assert torch.equal(a, b)
    assert torch.equal(_op(ns, sp.BWD)(go, x, p)[1], _op(ns, sp.BWD)(go, x, p)[1])
    ref = _op(sp.REFERENCE)(x, p)
    # both round one fp32 result once; they may differ by one bf16 ulp where exp differs in the last bit
    assert ((a.float() - ref.float()).abs() <= 2 ** -7 * ref.float().abs() + 1e-30).all()


def test_wrapper_differentiable_and_saves_only_inputs():
    x, p, go = _inputs(16, 32, torch.bfloat16)
    xg, pg = x.clone().requires_grad_(), p.clone().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = sp.swiglu_probs(xg, pg)
    assert {t.data_ptr() for t in saved} <= {xg.data_ptr(), pg.data_ptr()}
    out.backward(go)
    gx, gp = _op(sp.namespace_for(x), sp.BWD)(go, x, p)
    assert torch.equal(xg.grad, gx) and torch.equal(pg.grad, gp)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_bad_input_names_the_argument(ns):
    x, p, _ = _inputs(4, 8, torch.float32)
    with pytest.raises(ValueError, match="even number of columns"):
        sp.swiglu_probs(x[:, :7], p)
    with pytest.raises(ValueError, match="probs"):
        sp.swiglu_probs(x, p[:3])
    with pytest.raises(TypeError, match="x"):
        sp.swiglu_probs(x.to(torch.int32), p)
    with pytest.raises((ValueError, RuntimeError), match="probs"):
        _op(ns)(x, p[:3])
    with pytest.raises((ValueError, RuntimeError), match="grad_out"):
        _op(ns, sp.BWD)(torch.zeros(4, 3), x, p)


def test_internal_ops_are_not_public():
    """Internal: not in the public listing nor the package's API; like every op it is bound once in
    the public namespace (the wrapper calls that op, no per-call choice of namespace)."""
    assert sp.OP in _library.INTERNAL_SCHEMAS and sp.OP not in _library.SCHEMAS
    assert not _library.spec(sp.OP).public and sp.OP not in ascend_moe_ops.__all__
    assert not hasattr(ascend_moe_ops, sp.OP)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"{_library.NAMESPACE}::{sp.OP}", "CPU")
    want = "native" if len(NAMESPACES) == 2 else "reference"
    assert ascend_moe_ops.active_backend(sp.OP, "cpu") == want
    assert sp.namespace_for(torch.zeros(1)) == _library.BACKEND_NAMESPACES[want]


@pytest.mark.skipif(len(NAMESPACES) == 1, reason="native extension not built")
def test_native_formula_is_the_cpp_one():
    """With the extension loaded, the native namespace's autograd is csrc/cpu/autograd.cpp's (no
    Python autograd.Function per call): the graph node is a C++ node, not the Python formula's."""
    x, p, go = _inputs(6, 16, torch.float32)
    out = _op(sp.NATIVE)(x.requires_grad_(), p.requires_grad_())
    assert "CppNode" in out.grad_fn.name() and "SwigluProbs" in out.grad_fn.name()
    out.backward(go)
    gx, gp = _op(sp.NATIVE, sp.BWD)(go, x.detach(), p.detach())
    assert torch.equal(x.grad, gx) and torch.equal(p.grad, gp)
