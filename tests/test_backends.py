"""Backends as dispatcher namespaces, the public namespace's binding, and ``use_backend``."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _backends, _library
from conftest import backends, namespace, ops_of, required_backends

OPS = sorted(_library.SCHEMAS)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("op", OPS)
def test_required_backends_load(op):
    missing = {b: _backends.unavailable_reason(op, b) for b in required_backends()
               if b not in _backends.available_backends(op, "cpu")}
    assert not missing, f"{op}: required backends unavailable: {missing}"


def test_reference_always_available():
    for op in OPS:
        assert "reference" in _backends.available_backends(op, "cpu")


def test_every_namespace_has_every_schema():
    for ns in _library.NAMESPACES:
        for op in OPS:
            schema = str(getattr(getattr(torch.ops, ns), op).default._schema)
            assert schema == f"{ns}::{_library.SCHEMAS[op]}", schema
    # optional ints are int?, not -1 sentinels
    assert "int? capacity" in _library.SCHEMAS["moe_permute"]
    assert "int? num_out_tokens" in _library.SCHEMAS["moe_permute"]


def _cpu_kernel_line(qualname: str) -> str:
    lines = [ln for ln in torch._C._dispatch_dump(qualname).splitlines() if ln.startswith("CPU:")]
    assert len(lines) == 1, torch._C._dispatch_dump(qualname)
    return lines[0]


def _python_calls(fn, *args) -> int:
    """Number of Python function frames entered while ``fn(*args)`` runs (sys.setprofile); a C
    ``fn`` (an op's C++ entry) adds none itself."""
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(prof)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count


def _permute_args():
    tokens = torch.randn(16, 32)
    routing = torch.randint(0, 4, (16, 2))
    return tokens, routing, torch.rand(16, 2), 4, None, 1, None


@pytest.mark.skipif("native" not in backends("moe_permute"), reason="native backend not built")
def test_public_cpu_kernel_is_the_cxx_function():
    """Native on cpu: the public op's CPU kernel is registered from C++ (not a Python function) and
    a call enters no Python frame between the dispatcher and the kernel. The same measurement on the
    reference namespace (a Python kernel) counts its frames, so the probe can fail."""
    assert amo.active_backend("moe_permute", "cpu") == "native"
    for op in OPS:
        line = _cpu_kernel_line(f"ascend_moe_ops::{op}")
        assert ".py:" not in line and "cpu/module.cpp" in line, line  # bind_cpu, from the op list
    args = _permute_args()
    public = torch.ops.ascend_moe_ops.moe_permute.default._op  # the C++ entry of the op
    reference = torch.ops.ascend_moe_ops_ref.moe_permute.default._op
    public(*args)  # warm up; grad mode on: the public autograd is C++ too (test_op_dispatch_path.py)
    assert _python_calls(public, *args) == 0
    assert _python_calls(reference, *args) > 0


def test_use_backend_redirects_and_restores():
    before = _cpu_kernel_line("ascend_moe_ops::grouped_gemm")
    bound = amo.active_backend("grouped_gemm", "cpu")
    x, w, gs = torch.randn(6, 4), torch.randn(3, 4, 5), torch.tensor([1, 2, 3])
    with amo.use_backend("reference"):
        assert amo.active_backend("grouped_gemm", "cpu") == "reference"
        assert _cpu_kernel_line("ascend_moe_ops::grouped_gemm") != before
        assert _python_calls(torch.ops.ascend_moe_ops.grouped_gemm.default._op, x, w, gs, False) > 0
    assert _cpu_kernel_line("ascend_moe_ops::grouped_gemm") == before
    assert amo.active_backend("grouped_gemm", "cpu") == bound
    with amo.use_backend(bound):  # the bound backend keeps its own kernel (no redirect)
        assert _cpu_kernel_line("ascend_moe_ops::grouped_gemm") == before
        with amo.use_backend("reference", ops=("grouped_gemm",)):  # nested, one op only
            assert amo.active_backend("grouped_gemm", "cpu") == "reference"
            assert amo.active_backend("moe_permute", "cpu") == bound
            assert _cpu_kernel_line("ascend_moe_ops::grouped_gemm") != before
        assert _cpu_kernel_line("ascend_moe_ops::grouped_gemm") == before


def test_forced_backend_that_cannot_run_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with amo.use_backend("triton"):
        with pytest.raises(amo.BackendUnavailableError, match="triton"):
            amo.moe_permute(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.int64), num_experts=1, map_type="index")
    with pytest.raises(ValueError, match="unknown backend"):
        with amo.use_backend("bogus"):
            pass


def _run_python(code: str, **env):
    full = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True,
                          text=True, timeout=300)


def test_environment_override_is_read_once_at_import():
    """ASCEND_MOE_OPS_BACKEND binds the public namespace at import: reference -> a Python kernel,
    reported by active_backend; an unknown name fails the import, naming the variable."""
    r = _run_python("""
        import torch, ascend_moe_ops as amo
        line = [l for l in torch._C._dispatch_dump('ascend_moe_ops::moe_unpermute').splitlines()
                if l.startswith('CPU:')][0]
        print(amo.active_backend('moe_unpermute', 'cpu'), '.py:' in line)
    """, ASCEND_MOE_OPS_BACKEND="reference")
    assert r.returncode == 0 and r.stdout.split() == ["reference", "True"], r.stderr
    r = _run_python("import ascend_moe_ops", ASCEND_MOE_OPS_BACKEND="bogus")
    assert r.returncode != 0 and "ValueError" in r.stderr and "ASCEND_MOE_OPS_BACKEND" in r.stderr


def test_every_backend_namespace_runs_after_a_plain_import():
    """torch.ops.<namespace>.<op> of every backend available here runs right after ``import
    ascend_moe_ops`` (no use_backend or available_backends call first): the emulated AscendC
    namespace used to have only its schemas and fake kernels until something loaded it."""
    names = [b for b in amo.available_backends("grouped_gemm") if b != "triton" or os.environ.get("TRITON_INTERPRET")]
    r = _run_python(f"""
        import torch, ascend_moe_ops as amo
        from ascend_moe_ops import _library
        x, w, gs = torch.randn(4, 8).half(), torch.randn(2, 8, 3).half(), torch.tensor([1, 3])
        for b in {names!r}:
            ns = _library.BACKENDS[b].namespace
            out = getattr(torch.ops, ns).grouped_gemm(x, w, gs, False)
            print(b, tuple(out.shape))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:-1] == [f"{b} (4, 3)" for b in names]


# ------------------------------------------------------------------------------ opcheck per namespace
def _f(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def _cases(backend):
    """Small valid arguments of every op for ``backend`` (fp16: the emulated kernels' dtype)."""
    ops = ops_of(backend)
    dt = torch.float16
    T, H, D = 6, 2, 16
    q, k, v = _f(T, H, D), _f(T, H, D), _f(T, H, D)
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    out, lse = ops("flash_attention_fwd")(q, k, v, None, cu, cu, 4, 4, True, D ** -0.5)
    Hm, Dn, Dr, Dv, Dc = 2, 16, 16, 16, 32
    mq, c, kpe, w = _f(T, Hm, Dn + Dr), _f(T, Dc), _f(T, Dr), _f(Hm * (Dn + Dv), Dc) / Dc ** 0.5
    mo, ml, kv = ops("mla_attention_fwd")(mq, c, kpe, w, cu, 4, Hm, Dn, Dv, 0.2, True, False)
    rmap = torch.tensor([[0, 3], [1, -1], [2, 4]], dtype=torch.int32)
    return {
        "moe_permute": (_f(5, 16, dtype=dt), torch.tensor([[0, 2], [1, -1], [2, 2], [0, 1], [1, 0]]),
                        torch.rand(5, 2), 3, None, 1, None),
        "moe_unpermute": (_f(5, 16), rmap, torch.rand(3, 2)),
        "moe_unpermute_backward": (_f(3, 16), _f(5, 16), rmap, torch.rand(3, 2)),
        "grouped_gemm": (_f(7, 16), _f(3, 16, 16), torch.tensor([2, 0, 4]), False),
        "grouped_gemm_dw": (_f(7, 16), _f(7, 16), torch.tensor([2, 0, 4])),
        "flash_attention_fwd": (q, k, v, None, cu, cu, 4, 4, True, D ** -0.5),
        "flash_attention_bwd": (_f(T, H, D), q, k, v, None, out, lse, cu, cu, 4, 4, True, D ** -0.5),
        "mla_attention_fwd": (mq, c, kpe, w, cu, 4, Hm, Dn, Dv, 0.2, True, False),
        "mla_attention_bwd": (_f(T, Hm, Dv), mq, c, kpe, w, mo, ml, kv, cu, 4, Hm, Dn, Dv, 0.2, True),
    }


_DIFFERENTIABLE = {"moe_permute": (0,), "moe_unpermute": (0, 2), "grouped_gemm": (0, 1), "grouped_gemm_dw": (0, 1),
                   "flash_attention_fwd": (0, 1, 2), "mla_attention_fwd": (0, 1, 2, 3)}


@pytest.mark.parametrize("backend", [b for b in _backends.BACKENDS if b in backends("grouped_gemm")])
def test_opcheck_every_op_of_every_namespace(backend):
    """Each namespace has its own kernels, fake kernels and autograd: opcheck passes on its own."""
    cases = _cases(backend)
    for op, args in cases.items():
        args = list(args)
        for i in _DIFFERENTIABLE.get(op, ()):
            if args[i].dtype.is_floating_point:
                args[i] = args[i].clone().requires_grad_()
        torch.library.opcheck(ops_of(backend)(op), tuple(args),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
