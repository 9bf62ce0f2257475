"""The public ops' dispatch path: no Python between the dispatcher and the kernel, forward and
backward (issue 16's first "Done when").

The autograd of ``torch.ops.ascend_moe_ops.<op>`` is C++ (``csrc/cpu/autograd.cpp``, the
``Autograd`` alias key); the backend namespaces keep the Python formulas of ``ascend_moe_ops/ops``.
Here: the probe (``sys.setprofile``: Python frames entered during one op call, and during its
backward run by the C++ engine), the same formula as Python (gradients bitwise equal to the native
namespace's, whose autograd is the Python formula over the same kernels), the registration for the
other devices' autograd keys, opcheck of the public ops, and the Python fallback without the
extension.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _library
from conftest import backends

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = _library.NAMESPACE
NATIVE = _library.BACKEND_NAMESPACES["native"]
# ops with an autograd formula, and the positions of their differentiable (float) inputs
DIFFERENTIABLE = {"moe_permute": (0, 2), "moe_unpermute": (0, 2), "grouped_gemm": (0, 1),
                  "grouped_gemm_dw": (0, 1), "flash_attention_fwd": (0, 1, 2, 3), "mla_attention_fwd": (0, 1, 2, 3)}

pytestmark = pytest.mark.skipif("native" not in backends("moe_permute"), reason="native extension not built")


def _op(name, ns=PUBLIC):
    return _library.op(name, ns)


def _cases():
    """Small valid fp32 arguments of every public op (k_rope given: every optional tensor present)."""
    T, H, D, Dr = 6, 2, 8, 4
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    q, k, v, kr = torch.randn(T, H, D + Dr), torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, Dr)
    fa = (q, k, v, kr, cu, cu, 4, 4, True, 0.3)
    out, lse = _op("flash_attention_fwd")(*fa)
    Hm, Dn, Dv, Dc = 2, 8, 8, 16
    mq, c, kpe, w = torch.randn(T, Hm, Dn + Dr), torch.randn(T, Dc), torch.randn(T, Dr), torch.randn(Hm * (Dn + Dv), Dc) / 4
    mla = (mq, c, kpe, w, cu, 4, Hm, Dn, Dv, 0.2, True, True)
    mo, ml, kv = _op("mla_attention_fwd")(*mla)
    rmap = torch.tensor([[0, 3], [1, -1], [2, 4]], dtype=torch.int32)
    sizes = torch.tensor([2, 0, 4])
    return {
        "moe_permute": (torch.randn(5, 8), torch.tensor([[0, 2], [1, -1], [2, 2], [0, 1], [1, 0]]),
                        torch.rand(5, 2), 3, None, 2, None),
        "moe_unpermute": (torch.randn(5, 8), rmap, torch.rand(3, 2)),
        "moe_unpermute_backward": (torch.randn(3, 8), torch.randn(5, 8), rmap, torch.rand(3, 2)),
        "grouped_gemm": (torch.randn(7, 8), torch.randn(3, 8, 4), sizes, False),
        "grouped_gemm_dw": (torch.randn(7, 8), torch.randn(7, 4), sizes),
        "flash_attention_fwd": fa,
        "flash_attention_bwd": (torch.randn(T, H, D), q, k, v, kr, out, lse, cu, cu, 4, 4, True, 0.3),
        "mla_attention_fwd": mla,
        "mla_attention_bwd": (torch.randn(T, Hm, Dv), mq, c, kpe, w, mo, ml, kv, cu, 4, Hm, Dn, Dv, 0.2, True),
    }


def _with_grad(name, args, which=None):
    """``args`` with fresh leaves requiring grad at the differentiable positions (``which``: a subset)."""
    args = list(args)
    for i in DIFFERENTIABLE.get(name, ()) if which is None else which:
        args[i] = args[i].detach().clone().requires_grad_()
    return tuple(args)


def _leaves(args):
    return tuple(a for a in args if isinstance(a, torch.Tensor) and a.requires_grad)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class _Probe:
    """Python frames entered while the profiler is on (``sys.setprofile``, this thread). Calls of C
    functions (the op's C++ entry, the dispatcher, the autograd engine) are ``c_call`` events and
    are not counted; torch's own one-line ``OpOverload.__call__`` (the ``torch.ops`` attribute's
    ``__call__``, which calls the C++ entry) is listed apart."""

    def __init__(self):
        self.frames = []

    def _prof(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            self.frames.append(f"{os.path.basename(code.co_filename)}:{code.co_firstlineno} {code.co_qualname}")

    def run(self, fn, *args):
        sys.setprofile(self._prof)
        try:
            return fn(*args)
        finally:
            sys.setprofile(None)

    def python_frames(self):
        return [f for f in self.frames if not f.endswith("OpOverload.__call__")]

    def beyond_guard(self):
        """The Python frames besides the backward ops' double-backward guard
        (``_library.no_double_backward``: a Python ``Autograd`` kernel that, with grad mode off or
        no input requiring grad, only redispatches below autograd)."""
        return [f for f in self.python_frames()
                if "no_double_backward.<locals>" not in f and not f.endswith("OpOverload.redispatch")]


def _backward_in_cxx(probe, outputs, inputs):
    """``torch.autograd.grad(outputs, inputs, ones)`` through the C++ engine entry directly, under
    ``probe`` (the Python wrappers of torch.autograd would count as frames of the probe)."""
    outs = tuple(o for o in outputs if o.requires_grad)
    grads = tuple(torch.ones_like(o) for o in outs)
    return probe.run(torch.autograd.Variable._execution_engine.run_backward, outs, grads, False, False,
                     tuple(inputs), True, False)


# ----------------------------------------------------------------------------- the Done-when probe
@pytest.mark.parametrize("requires_grad", [False, True], ids=["no_grad_inputs", "grad_inputs"])
@pytest.mark.parametrize("name", sorted(_library.SCHEMAS))
def test_no_python_between_dispatcher_and_kernel(name, requires_grad):
    """One call of each public op on cpu (grad mode on, inputs requiring grad or not) enters no
    Python function besides torch's ``OpOverload.__call__``; nor does the backward of the ops with a
    formula. The one exception: the backward ops (no formula of their own: moe_unpermute_backward,
    the *_bwd ops) have a Python double-backward guard at the Autograd key, which raises on a
    gradient of the gradient instead of torch's silent zeros; in a first-order backward it only
    redispatches below autograd."""
    args = _cases()[name]
    if requires_grad:
        if name not in DIFFERENTIABLE:
            args = tuple(a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor)
                         and a.is_floating_point() else a for a in args)  # no formula: torch's C++ fallback
        else:
            args = _with_grad(name, args)
    op = _op(name)
    op(*args)  # warm up (first-call lookups)
    probe = _Probe()
    out = probe.run(op, *args)
    assert probe.frames, "the probe saw no frame at all (OpOverload.__call__ expected): it cannot fail"
    if requires_grad and name not in DIFFERENTIABLE:
        # recording a gradient of a gradient: the guard's Python (it adds the raising node or, on the
        # reference, runs the kernel at the autograd level)
        assert probe.python_frames()[0].endswith("no_double_backward.<locals>.kernel"), probe.python_frames()
        return
    assert probe.beyond_guard() == [], f"{name}: Python ran inside the op call: {probe.python_frames()}"
    if name in DIFFERENTIABLE:
        assert probe.python_frames() == [], f"{name}: Python ran inside the op call: {probe.python_frames()}"
    if requires_grad and name in DIFFERENTIABLE:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
        assert outs, f"{name}: no output requires grad"
        warm = op(*args)  # warm up the backward too (first-call lookups)
        _backward_in_cxx(_Probe(), [o for o in (warm if isinstance(warm, (tuple, list)) else (warm,))
                                    if o.requires_grad], _leaves(args))
        probe = _Probe()
        grads = _backward_in_cxx(probe, outs, _leaves(args))
        assert all(g is not None for g in grads)
        assert probe.beyond_guard() == [] and all(not f.endswith("OpOverload.__call__") for f in probe.frames), \
            f"{name}: Python ran in the backward: {probe.frames}"


def test_probe_sees_the_python_formula():
    """The same probe on the native namespace (same C++ kernels, torch.library's Python autograd
    formula) and on the public op with the Python formula registered over the C++ one (what the
    package did before) counts Python frames: the probe can fail."""
    name = "moe_unpermute"
    args = _with_grad(name, _cases()[name])
    probe = _Probe()
    out = probe.run(_op(name, NATIVE), *args)
    assert probe.python_frames(), "native namespace: Python formula not seen"
    probe = _Probe()
    _backward_in_cxx(probe, [out], _leaves(args))
    assert probe.frames, "native namespace: Python backward not seen"
    from ascend_moe_ops.ops import moe_unpermute as mod
    lib = torch.library.Library(PUBLIC, "FRAGMENT")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
            torch.library.register_autograd(f"{PUBLIC}::{name}", lambda ctx, g: mod._backward(
                _library.ops_of(PUBLIC), ctx, g), setup_context=mod._setup_context, lib=lib)
        probe = _Probe()
        probe.run(_op(name), *args)
        assert probe.python_frames(), "public op with the Python formula: not seen"
    finally:
        lib._destroy()
    probe = _Probe()
    probe.run(_op(name), *args)
    assert probe.python_frames() == [], "the C++ formula is back after the Python one is removed"


# ----------------------------------------------------------------------------- registration
def _dispatch_line(qualname, key, table=False):
    dump = torch._C._dispatch_dump_table(qualname) if table else torch._C._dispatch_dump(qualname)
    lines = [ln for ln in dump.splitlines() if ln.split(":")[0].split("[")[0].strip() == key]
    assert len(lines) == 1, dump
    return lines[0]


def test_public_autograd_is_registered_from_cxx_for_every_backend_key():
    """The public ops with a formula have exactly one Autograd kernel, from C++ (so AutogradCPU,
    AutogradCUDA and AutogradPrivateUse1 all resolve to it: CUDA/triton and the NPU kernels get the
    same autograd); the backend namespaces keep the Python formula; ops without a formula get the
    Python double-backward guard (``_library.no_double_backward``) in every namespace."""
    assert _library.NATIVE_AUTOGRAD == frozenset(DIFFERENTIABLE)
    for name in sorted(_library.SCHEMAS):
        qual = f"{PUBLIC}::{name}"
        if name in DIFFERENTIABLE:
            line = _dispatch_line(qual, "Autograd")
            assert "autograd.cpp" in line and ".py:" not in line, line
            for key in ("AutogradCPU", "AutogradCUDA", "AutogradPrivateUse1"):
                assert "autograd.cpp" in _dispatch_line(qual, key, table=True), (name, key)
            native = _dispatch_line(f"{NATIVE}::{name}", "Autograd")
            assert ".py:" in native, native
        else:
            for ns in (PUBLIC, NATIVE):
                line = _dispatch_line(f"{ns}::{name}", "Autograd")
                assert "_library.py" in line and "autograd.cpp" not in line, line


def test_meta_tensors_get_the_cxx_autograd():
    """A device other than cpu goes through the same C++ autograd (AutogradMeta here; the fake
    kernel computes the outputs): outputs require grad where the Python formula's did, and the
    non-differentiable ones do not."""
    x = torch.empty(7, 8, device="meta", requires_grad=True)
    w = torch.empty(3, 8, 4, device="meta", requires_grad=True)
    y = _op("grouped_gemm")(x, w, torch.tensor([2, 0, 4], device="meta"), False)
    assert y.requires_grad and "GroupedGemm" in type(y.grad_fn).__name__ + str(y.grad_fn.name())
    q = torch.empty(6, 2, 8, device="meta", requires_grad=True)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    out, lse = _op("flash_attention_fwd")(q, q, q, None, cu, cu, 4, 4, True, 0.3)
    assert out.requires_grad and not lse.requires_grad


# ----------------------------------------------------------------------------- the same formula
def _grads(name, ns, args, create_graph=False, seeds_out=None):
    """Outputs, the differentiable ones, and the gradients of the leaves for random output seeds
    (with ``create_graph`` the seeds require grad too and are appended to ``seeds_out``)."""
    out = _op(name, ns)(*args)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    diff = [o for o in outs if o.requires_grad]
    gen = torch.Generator().manual_seed(1)
    seeds = [torch.randn(o.shape, generator=gen, dtype=o.dtype).requires_grad_(create_graph) for o in diff]
    if seeds_out is not None:
        seeds_out.extend(seeds)
    leaves = _leaves(args)
    grads = torch.autograd.grad(diff, leaves, seeds, allow_unused=True, create_graph=create_graph)
    return outs, diff, grads


@pytest.mark.parametrize("subset", ["all", "first", "last"])
@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_cxx_formula_matches_the_python_formula(name, subset):
    """Public op (C++ formula) vs the native namespace (Python formula, same kernels): the same
    outputs, the same outputs requiring grad, bitwise the same gradients (all differentiable inputs
    requiring grad, or only the first or last one)."""
    diff = DIFFERENTIABLE[name]
    which = {"all": diff, "first": diff[:1], "last": diff[-1:]}[subset]
    base = _cases()[name]
    a_pub, a_nat = _with_grad(name, base, which), _with_grad(name, base, which)
    outs_p, diff_p, g_p = _grads(name, PUBLIC, a_pub)
    outs_n, diff_n, g_n = _grads(name, NATIVE, a_nat)
    assert [o.requires_grad for o in outs_p] == [o.requires_grad for o in outs_n]
    for p, n in zip(outs_p, outs_n):
        assert torch.equal(p.detach(), n.detach())
    for i, (p, n) in enumerate(zip(g_p, g_n)):
        assert (p is None) == (n is None), i
        if p is not None:
            assert torch.equal(p, n), f"{name}: gradient {i} differs"


def test_without_probs_or_rope():
    """Absent optional tensors (probs, k_rope): no gradient for them, the rest as the Python formula."""
    c = _cases()
    for name, pos in (("moe_permute", 2), ("moe_unpermute", 2), ("flash_attention_fwd", 3)):
        base = list(c[name])
        base[pos] = None
        if name == "flash_attention_fwd":  # without the rope key, q's head dim is k's
            base[0] = base[0][..., :base[1].shape[-1]].contiguous()
        keep = tuple(i for i in DIFFERENTIABLE[name] if i != pos)
        a_pub, a_nat = _with_grad(name, base, keep), _with_grad(name, base, keep)
        _, _, g_p = _grads(name, PUBLIC, a_pub)
        _, _, g_n = _grads(name, NATIVE, a_nat)
        assert len(g_p) == len(keep)
        for p, n in zip(g_p, g_n):
            assert torch.equal(p, n), name


@pytest.mark.parametrize("name", ["moe_permute", "grouped_gemm", "grouped_gemm_dw"])
def test_double_backward_matches_the_python_formula(name):
    """Double backward where the Python formula supports it (its backward calls differentiable ops):
    the second-order gradients equal the native namespace's."""
    base = _cases()[name]
    res = []
    for ns in (PUBLIC, NATIVE):
        args, seeds = _with_grad(name, base), []
        _, _, grads = _grads(name, ns, args, create_graph=True, seeds_out=seeds)
        grads = [g for g in grads if g is not None and g.requires_grad]
        assert grads, f"{ns}: first-order gradients are not differentiable"
        total = sum((g * torch.linspace(-1, 1, g.numel()).view(g.shape)).sum() for g in grads)
        second = torch.autograd.grad(total, _leaves(args) + tuple(seeds), allow_unused=True)
        assert any(g is not None for g in second)
        res.append(second)
    for p, n in zip(*res):
        assert (p is None) == (n is None)
        if p is not None:
            assert torch.equal(p, n), name


def test_double_backward_without_a_formula_behaves_as_before():
    """moe_unpermute's backward op has no formula: differentiating the gradient again raises the
    double-backward guard's error on the public and native namespaces alike (same outcome; it was
    torch's autograd fallback: a warning and zeros)."""
    name = "moe_unpermute"
    outcomes = []
    for ns in (PUBLIC, NATIVE):
        args = _with_grad(name, _cases()[name])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _, _, grads = _grads(name, ns, args, create_graph=True)
                torch.autograd.grad(sum(g.sum() for g in grads), _leaves(args), allow_unused=True)
                outcomes.append(("ok", sorted({str(w.message).replace(ns + "::", "<ns>::")[:80] for w in caught})))
            except RuntimeError as exc:
                outcomes.append(("error", str(exc).replace(ns, "<ns>")[:80]))
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][0] == "error" and "double backward" in outcomes[0][1], outcomes


def test_no_grad_and_inference_mode_skip_the_autograd_node():
    args = _with_grad("grouped_gemm", _cases()["grouped_gemm"])
    with torch.no_grad():
        assert not _op("grouped_gemm")(*args).requires_grad
    with torch.inference_mode():
        assert not _op("grouped_gemm")(*args).requires_grad
    y = _op("grouped_gemm")(*args)
    assert y.requires_grad and "GroupedGemm" in y.grad_fn.name()


def test_other_cpu_backend_under_the_cxx_autograd():
    """The C++ autograd redispatches to whatever kernel the public namespace has: with the reference
    backend bound to cpu, gradients equal the reference namespace's (its Python formula)."""
    name = "grouped_gemm"
    base = _cases()[name]
    with amo.use_backend("reference"):
        _, _, g_p = _grads(name, PUBLIC, _with_grad(name, base))
    _, _, g_r = _grads(name, _library.BACKEND_NAMESPACES["reference"], _with_grad(name, base))
    for p, r in zip(g_p, g_r):
        assert torch.equal(p, r)


# ----------------------------------------------------------------------------- opcheck of the public ops
@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_opcheck_public_op(name):
    """opcheck of the public op (schema, autograd registration, fake tensor, AOT dispatch static and
    dynamic): the C++ autograd traces under AOTAutograd."""
    args = _with_grad(name, _cases()[name])
    torch.library.opcheck(_op(name), args)


# ----------------------------------------------------------------------------- fallback
def test_python_formula_serves_the_public_ops_without_the_extension():
    """Without the C++ extension the public ops keep the Python formula (and stay differentiable)."""
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["ascend_moe_ops._C"] = None  # the extension is absent: import fails
        warnings.simplefilter("ignore")
        import torch, ascend_moe_ops as amo
        from ascend_moe_ops import _library
        line = [l for l in torch._C._dispatch_dump("ascend_moe_ops::grouped_gemm").splitlines()
                if l.startswith("Autograd[alias]")][0]
        x = torch.randn(6, 4, requires_grad=True)
        w = torch.randn(2, 4, 3, requires_grad=True)
        y = amo.grouped_gemm(x, w, torch.tensor([2, 4]))
        y.sum().backward()
        print(sorted(_library.NATIVE_AUTOGRAD), ".py:" in line, amo.active_backend("grouped_gemm"),
              x.grad is not None and w.grad is not None)
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "True", "reference", "True"], r.stdout
