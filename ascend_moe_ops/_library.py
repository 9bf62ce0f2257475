"""The one registration point: one :class:`Backend` record per backend, one :class:`OpSpec` per op,
and :func:`define`, from which every namespace's schema, fake kernel and autograd formula derive.

Namespaces, one per :class:`Backend` plus the public one (an op's schema is the same in each):

==========================  =================================================================
``ascend_moe_ops``          the public ops; one kernel per dispatch key, bound once at import
                            (``_backends.bind_public``): CPU and CUDA here, PrivateUse1 by
                            ``_npu.py`` on an Ascend build
``ascend_moe_ops_native``   C++ kernels of ``csrc/cpu`` (``TORCH_LIBRARY_IMPL(..., CPU, m)`` in
                            the extension ``ascend_moe_ops._C``)
``ascend_moe_ops_triton``   Triton kernels of ``triton_ref/`` (CUDA; CPU under TRITON_INTERPRET=1)
``ascend_moe_ops_emu``      the AscendC kernels on the CPU emulation layer
                            (``ascend_moe_ops._ascendc_emu``, tests only)
``ascend_moe_ops_ref``      the pure-PyTorch reference (``ascend_moe_ops/reference``)
==========================  =================================================================

Each op module of ``ascend_moe_ops/ops`` declares its ops with :func:`define` (an :class:`OpSpec`:
name, schema, fake, contract check, autograd formula, public or internal, the backends that
implement it). ``define`` defines the schema in the public namespace and in the namespace of every
backend that implements the op, and registers there the fake (meta) kernel, which runs the metadata
part of the op's contract check first, and the autograd formula, whose backward calls the ops of
the same namespace (so each backend is opcheck-able and differentiable on its own); an op without a
formula (a backward op) gets :func:`no_double_backward`, so its gradient (a second derivative) is
exact on the reference and raises elsewhere instead of being silently zero. Native code
never defines a schema; it only adds implementations. A Python backend's kernel of an op is
``<Backend.python_package>.<op module>.<op name>`` (``reference/moe_permute.py::moe_permute``),
registered by :func:`python_kernel` after the op's full contract check. The listings
(:data:`SCHEMAS` of the public ops, :data:`INTERNAL_SCHEMAS`, :func:`specs`) derive from the specs.

Internal ops (``public=False``: the fused kernels of the framework adapters, e.g. ``swiglu_probs``)
go through the same scheme and are bound in the public namespace like every op (their wrappers
call ``torch.ops.ascend_moe_ops.<op>``); they are left out of the public listings and of the
package's API, and may change without notice.

Autograd of the public namespace is C++ when the extension ``ascend_moe_ops._C`` is built:
``csrc/cpu/autograd.cpp`` registers, at the ``Autograd`` alias key (so for CPU, CUDA and
PrivateUse1 tensors alike), one ``torch::autograd::Function`` per op with a formula, the same
formula as the op module's Python one (same saved tensors, non-differentiable outputs and backward
ops, called through the dispatcher). This module imports the extension before any op is defined,
and :func:`define` leaves the Python formula out of every namespace for which C++ registered one
(:data:`NATIVE_AUTOGRAD` lists the public ops so served): a call of
``torch.ops.ascend_moe_ops.<op>``, and its backward, run no Python between the dispatcher and the
kernel (``tests/test_op_dispatch_path.py``). Without the extension (built with
``ASCEND_MOE_OPS_NO_NATIVE=1``) the Python formula serves the public namespace too.

Conventions: optional ints are ``int?`` (``None``); index outputs are int32 (row maps) or int64
(counts).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch

NAMESPACE = "ascend_moe_ops"


class BackendUnavailableError(RuntimeError):
    """A backend was asked for (explicitly) but cannot run here."""


# ------------------------------------------------------------------------------------ backends
@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend: its name, namespace, the devices it runs on, how to tell whether it is
    available, and how its kernels are bound.

    ``extension``: a C++ extension whose import registers the namespace's kernels (and whose
    ``_bind_cpu(ns)`` registers the same C++ functions for another namespace's CPU key).
    ``python_package``: where the Python kernels live (``<package>.<op module>.<op name>``).
    ``requires``: a module that must be importable. ``interpret_env``: an environment variable
    that, set to ``1``, lets it run on cpu tensors too (checked on every call: ``guard_calls``).
    ``keys``: the dispatch keys its Python kernels are registered at. ``default_on``: the devices
    on which it is a default choice (the order of :data:`BACKENDS` is the preference).
    """

    name: str
    namespace: str
    devices: Tuple[str, ...] = ()  # () = any device
    extension: Optional[str] = None
    python_package: Optional[str] = None
    requires: Optional[str] = None
    interpret_env: Optional[str] = None
    keys: Tuple[str, ...] = ("CPU", "CUDA")
    default_on: Tuple[str, ...] = ()
    needs: str = ""  # what it needs, for the message when it cannot run on a device
    #: its kernels are PyTorch ops that autograd records through when called with grad enabled, so
    #: the gradient of its backward ops (a second derivative) is exact (:func:`no_double_backward`)
    autograd_through_kernels: bool = False

    def usable_on(self, device_type: str) -> Tuple[bool, str]:
        """Whether this backend can run on ``device_type`` at all (independent of what is built)."""
        if not self.devices or device_type in self.devices:
            return True, ""
        if self.interpret_env and device_type == "cpu" and os.environ.get(self.interpret_env) == "1":
            return True, ""
        return False, self.needs or f"the {self.name} backend runs on {', '.join(self.devices)} tensors only, got {device_type}"

    def require_usable(self, args) -> None:
        """Per-call guard of the kernels that may be asked to run where they cannot (the device of
        the first tensor argument)."""
        dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        ok, why = self.usable_on(dev)
        if not ok:
            raise BackendUnavailableError(f"backend {self.name!r} cannot run here: {why}")

    @property
    def guard_calls(self) -> bool:
        return self.interpret_env is not None

    def probe(self) -> Optional[str]:
        """``None`` if the backend's kernels can be registered here, else the reason (the C++
        extension's import registers them)."""
        try:
            if self.extension is not None:
                from . import _native  # the build record first: torch version, CPU (warns once)
                err = _native.problem(self.extension)
                if err is not None:
                    return err
                mod = importlib.import_module(self.extension)
                if not hasattr(mod, "_bind_cpu"):
                    return (f"{self.extension} is an old build without dispatcher kernels; rebuild it "
                            "(python setup.py build_ext --inplace)")
            if self.requires is not None and importlib.util.find_spec(self.requires) is None:
                return f"ModuleNotFoundError: {self.requires} is not installed"
        except Exception as exc:  # ImportError, missing symbol in an old build, toolkit errors
            return f"{type(exc).__name__}: {exc}"
        return None


NATIVE = Backend("native", "ascend_moe_ops_native", devices=("cpu",), extension="ascend_moe_ops._C",
                 keys=("CPU",), default_on=("cpu",))
TRITON = Backend("triton", "ascend_moe_ops_triton", devices=("cuda",), python_package="ascend_moe_ops.triton_ref",
                 requires="triton", interpret_env="TRITON_INTERPRET", default_on=("cuda",),
                 needs=("the triton backend needs a CUDA device, or TRITON_INTERPRET=1 (set before "
                        "triton is imported) to run on cpu tensors"))
ASCENDC_EMU = Backend("ascendc-emu", "ascend_moe_ops_emu", devices=("cpu",), extension="ascend_moe_ops._ascendc_emu",
                      keys=("CPU",))
REFERENCE = Backend("reference", "ascend_moe_ops_ref", python_package="ascend_moe_ops.reference",
                    default_on=("cpu", "cuda"), autograd_through_kernels=True)

#: every backend, by name, in order of preference
BACKENDS: Dict[str, Backend] = {b.name: b for b in (NATIVE, TRITON, ASCENDC_EMU, REFERENCE)}
#: the backend that implements every op and runs anywhere: what an op falls back to where the
#: bound backend has no kernel of it
FALLBACK = REFERENCE
BACKEND_NAMESPACES: Dict[str, str] = {b.name: b.namespace for b in BACKENDS.values()}
NAMESPACES = (NAMESPACE,) + tuple(BACKEND_NAMESPACES.values())
LIBS: Dict[str, torch.library.Library] = {ns: torch.library.Library(ns, "DEF") for ns in NAMESPACES}
_lib = LIBS[NAMESPACE]  # the public namespace's library (PrivateUse1 registrations in _npu.py)


def backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {tuple(BACKENDS)}")
    return BACKENDS[name]


# ------------------------------------------------------------------------------------ op specs
@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op, declared once in its op module (``ascend_moe_ops/ops/<module>.py``).

    ``schema``: the signature without the name, ``"(Tensor x, int n) -> Tensor"``.
    ``fake(*args)``: the outputs' metadata (after ``check_meta``). ``check(*args)``: the full
    contract check (metadata and values) the Python kernels run; ``check_meta``: its metadata part
    (default: ``check``). ``backward(ops, ctx, *grads)`` with ``setup_context``: the autograd
    formula; ``ops(name)`` gives the op of the namespace being differentiated; an op without one
    (the backward ops: ``backward_of`` names the op whose backward it is) gets
    :func:`no_double_backward` instead, so a second derivative is exact or raises, never silently
    zero. ``empty(*args)``: the
    outputs of a valid empty call, or ``None`` (the C++ kernels do the same after their check).
    ``public``: listed and exported (else an internal op of the adapters). ``backends``: the
    backends that implement it (``None``: every one). ``composite``: backend name -> ``factory(ns)``
    giving a Python kernel composed of that namespace's ops (MLA on the Ascend kernels); it is the
    whole kernel (also served on PrivateUse1 by ``_npu``), so it runs ``check`` and ``empty`` itself.
    ``module``: the op module's name (set by :func:`define`).
    """

    name: str
    schema: str
    fake: Callable
    check: Callable
    check_meta: Optional[Callable] = None
    backward: Optional[Callable] = None
    setup_context: Optional[Callable] = None
    empty: Optional[Callable] = None
    public: bool = True
    backends: Optional[Tuple[str, ...]] = None
    composite: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
    backward_of: Optional[str] = None
    module: str = ""

    def implemented_by(self, backend_name: str) -> bool:
        return self.backends is None or backend_name in self.backends

    def namespaces(self) -> Tuple[str, ...]:
        return (NAMESPACE,) + tuple(b.namespace for b in BACKENDS.values() if self.implemented_by(b.name))


_SPECS: Dict[str, OpSpec] = {}
#: public op -> schema (derived from the specs; the internal ops are in :data:`INTERNAL_SCHEMAS`)
SCHEMAS: Dict[str, str] = {}
INTERNAL_SCHEMAS: Dict[str, str] = {}
#: ops whose autograd formula of the public namespace is the C++ one (``csrc/cpu/autograd.cpp``)
NATIVE_AUTOGRAD: set = set()


def _import_native() -> None:
    """Import the C++ extension before any op is defined: its ``TORCH_LIBRARY_IMPL(..., Autograd,
    m)`` blocks then tell :func:`define` which formulas are C++. The build record is checked first
    (``_native``: torch version, CPU; a mismatch warns once with the rebuild command and the
    extension is not imported); when it is not built or does not load, ``_backends.load("native")``
    reports why."""
    from . import _native
    _native.extension(NATIVE.extension)


_import_native()


def specs(public: Optional[bool] = None) -> List[OpSpec]:
    """Every defined op's spec (``public``: only the public / internal ones), in definition order."""
    return [s for s in _SPECS.values() if public is None or s.public == public]


def op_modules(public: Optional[bool] = None) -> List[str]:
    """The op modules (``ascend_moe_ops/ops/<module>.py``) that defined ops, in definition order;
    ``public``: only those that define a public op / only internal ones."""
    out: List[str] = []
    for s in specs():
        if s.module not in out and (public is None or any(t.public == public for t in specs() if t.module == s.module)):
            out.append(s.module)
    return out


def spec(name: str) -> OpSpec:
    if name not in _SPECS:
        raise ValueError(f"unknown op {name!r}; expected one of {sorted(_SPECS)}")
    return _SPECS[name]


def define(op_spec: OpSpec, module: Optional[str] = None) -> OpSpec:
    """Declare an op: define its schema in the public namespace and in every namespace of a backend
    that implements it, and register there its fake kernel (``check_meta`` first) and, when given,
    its autograd formula (left out where C++ registered one). ``module`` (the caller's
    ``__name__``) names the op module, which names the Python kernels."""
    name = op_spec.name
    if name in _SPECS:
        raise ValueError(f"op {name!r} is defined twice ({_SPECS[name].module} and {module})")
    if module is not None:
        op_spec = dataclasses.replace(op_spec, module=module.rsplit(".", 1)[-1])
    if op_spec.backends is not None and FALLBACK.name not in op_spec.backends:
        raise ValueError(f"op {name!r}: the {FALLBACK.name} backend must implement every op")
    _SPECS[name] = op_spec
    (SCHEMAS if op_spec.public else INTERNAL_SCHEMAS)[name] = name + op_spec.schema
    check_meta = op_spec.check_meta or op_spec.check
    fake = op_spec.fake

    def fake_kernel(*args):
        check_meta(*args)
        return fake(*args)

    for ns in op_spec.namespaces():
        LIBS[ns].define(name + op_spec.schema)
        torch.library.register_fake(f"{ns}::{name}", fake_kernel, lib=LIBS[ns])
        if op_spec.backward is None:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "Autograd"):
                LIBS[ns].impl(name, no_double_backward(op_spec, ns), "Autograd", with_keyset=True)
            continue
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "Autograd"):
            if ns == NAMESPACE:
                NATIVE_AUTOGRAD.add(name)
            continue  # the C++ formula
        bwd = functools.partial(op_spec.backward, ops_of(ns))
        torch.library.register_autograd(f"{ns}::{name}", bwd, setup_context=op_spec.setup_context, lib=LIBS[ns])
    return op_spec


def double_backward_message(op_spec: OpSpec, backend_name: str) -> str:
    """The error of a second derivative through ``op_spec`` (an op without an autograd formula) on a
    backend whose kernel autograd cannot record through."""
    what = f"{op_spec.name} (the backward of {op_spec.backward_of})" if op_spec.backward_of else op_spec.name
    works = [b.name for b in BACKENDS.values() if b.autograd_through_kernels and op_spec.implemented_by(b.name)]
    ops = "" if op_spec.public else f", ops={[o for o in (op_spec.backward_of, op_spec.name) if o]!r}"
    hint = (f"The {' and '.join(works)} backend computes it (ascend_moe_ops.use_backend({works[0]!r}{ops}), "
            f"or torch.ops.{BACKENDS[works[0]].namespace}.{op_spec.name})") if works else ""
    return (f"{what}: double backward (a gradient of the gradient) is not supported on the "
            f"{backend_name} backend; first-order gradients (create_graph=True included) are not "
            f"affected. {hint}".rstrip() + ".")


def _kernel_backend(ns: str, name: str, args) -> str:
    """The backend whose kernel a call of ``<ns>::<name>`` with ``args`` runs: the namespace's own,
    or for the public namespace the one bound to the device of the first tensor argument (looked up
    at call time, when ``_backends`` is imported: ``use_backend`` changes it)."""
    for b in BACKENDS.values():
        if b.namespace == ns:
            return b.name
    dev = next((a.device for a in args if isinstance(a, torch.Tensor)), "cpu")
    return importlib.import_module(__package__ + "._backends").active_backend(name, dev)


def no_double_backward(op_spec: OpSpec, ns: str) -> Callable:
    """The ``Autograd`` kernel of an op without a formula (a backward op: ``moe_unpermute_backward``,
    ``flash_attention_bwd``, ...) in namespace ``ns``, called with its dispatch key set.

    Grad mode off or no tensor argument requiring grad (every first-order backward without
    ``create_graph``): the kernel below autograd, nothing recorded. Otherwise, where the kernel that
    runs is made of PyTorch ops autograd records through (:attr:`Backend.autograd_through_kernels`:
    the reference), it runs at this level and the second derivative is exact; on any other backend
    the outputs get a node whose backward raises ``NotImplementedError``
    (:func:`double_backward_message`) instead of torch's fallback, which warned once and gave zeros.
    """
    overload = op(op_spec.name, ns)
    after_autograd = torch._C._after_autograd_keyset

    def below_autograd(keyset, args):
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & after_autograd, *args)

    class NoDoubleBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, keyset, backend_name, *args):
            ctx.backend_name = backend_name
            return below_autograd(keyset, args)

        @staticmethod
        def backward(ctx, *grads):
            raise NotImplementedError(double_backward_message(op_spec, ctx.backend_name))

    NoDoubleBackward.__name__ = f"{op_spec.name}_no_double_backward"

    def kernel(keyset, *args):
        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
            return below_autograd(keyset, args)
        backend_name = _kernel_backend(ns, op_spec.name, args)
        rec = BACKENDS.get(backend_name)
        if rec is not None and rec.autograd_through_kernels:
            return overload.redispatch(keyset & after_autograd, *args)  # recorded op by op
        return NoDoubleBackward.apply(keyset, backend_name, *args)

    kernel.__name__ = f"{op_spec.name}_autograd"
    return kernel


def op(name: str, ns: str = NAMESPACE):
    """``torch.ops.<ns>.<name>`` (default overload); ``ns`` defaults to the public namespace."""
    return getattr(getattr(torch.ops, ns), name).default


def ops_of(ns: str):
    """``name -> op`` for one namespace (what backward formulas and compositions call)."""
    return functools.partial(op, ns=ns)


def python_impl(backend_name: str, name: str) -> Tuple[str, str]:
    """``(module, attribute)`` of a Python backend's kernel of ``name``."""
    s = spec(name)
    return f"{BACKENDS[backend_name].python_package}.{s.module}", name


def python_ops(backend_name: str) -> List[str]:
    """The ops whose kernels in ``backend_name``'s namespace are Python (its own kernels, or
    compositions of its C++ ones)."""
    b = BACKENDS[backend_name]
    return [s.name for s in specs() if s.implemented_by(b.name) and (b.python_package or b.name in s.composite)]


def python_kernel(backend_name: str, name: str, ns: str) -> Callable:
    """The kernel of ``name`` for a Python backend (or a Python composition of a C++ backend's
    ops), registered for namespace ``ns``: the op's contract check, then the implementation
    (imported on first call, so a missing toolkit only disables its backend)."""
    s = spec(name)
    if backend_name in s.composite:
        return s.composite[backend_name](ns)
    b = BACKENDS[backend_name]
    module, attr = python_impl(backend_name, name)
    check, empty = s.check, s.empty
    state = {}

    def kernel(*args):
        check(*args)
        if b.guard_calls:
            b.require_usable(args)
        if empty is not None:
            out = empty(*args)
            if out is not None:
                return out
        fn = state.get("fn")
        if fn is None:
            fn = state["fn"] = getattr(importlib.import_module(module), attr)
        return fn(*args)

    kernel.__name__ = f"{name}_{backend_name.replace('-', '_')}"
    return kernel


def redirect_kernel(backend_name: str, name: str) -> Callable:
    """A kernel that calls ``backend_name``'s own op (its C++ kernel checks the arguments): how an
    op of a C++ backend whose extension does not bind it to another namespace is served there."""
    target = op(name, BACKENDS[backend_name].namespace)

    def kernel(*args):
        return target(*args)

    kernel.__name__ = f"{name}_{backend_name.replace('-', '_')}_redirect"
    return kernel
