"""Backends: each one registered with the dispatcher under its own namespace, and the one bound to
the public namespace per dispatch key, chosen once at import.

=============  ==========================  ===============================================  ==================
backend        namespace                   what it is                                       devices
=============  ==========================  ===============================================  ==================
native         ``ascend_moe_ops_native``   C++ kernels in ``csrc/cpu`` (extension ``_C``)   cpu
triton         ``ascend_moe_ops_triton``   Triton kernels in ``triton_ref/``                cuda; cpu under
                                                                                            TRITON_INTERPRET=1
ascendc-emu    ``ascend_moe_ops_emu``      the AscendC kernels on the CPU emulation layer   cpu (tests only)
reference      ``ascend_moe_ops_ref``      pure PyTorch in ``ascend_moe_ops/reference``     any
=============  ==========================  ===============================================  ==================

``torch.ops.<namespace>.<op>`` runs that backend directly (tests and the parity report parametrize
over the namespaces). The public ``torch.ops.ascend_moe_ops.<op>`` has ONE kernel per dispatch key,
bound at import by :func:`bind_public`: the environment variable ``ASCEND_MOE_OPS_BACKEND`` if set
(a forced backend that cannot run raises ``BackendUnavailableError`` at the first call on that
device; an unknown name raises ``ValueError`` at import), else the default order (cpu: native, then
reference; cuda: triton, then reference), with one ``RuntimeWarning`` naming the reason when the
default falls back. The traits of each backend (namespace, devices, availability, how it binds)
are its record, ``_library.Backend``; the order is that of ``_library.BACKENDS``. For native on cpu
the public kernel is the C++ function itself: nothing in Python runs between the dispatcher and the
kernel. An op the bound backend does not implement (an internal op on triton) is bound to the
reference backend, once, at the same time; :func:`active_backend` says so. On Ascend NPUs (``PrivateUse1``) the AscendC
host glue registers its kernels itself (``_npu.py``). :func:`active_backend` tells what is bound.

:func:`use_backend` is a convenience for tests and benchmarks: inside the ``with`` block the public
ops' CPU (and, for triton/reference, CUDA) kernels are replaced by a redirect to the backend's
namespace, process-wide (not per thread), and restored on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from . import _library
from ._library import BackendUnavailableError  # noqa: F401  (raised here and by the kernels)

ENV_VAR = "ASCEND_MOE_OPS_BACKEND"
BACKENDS = tuple(_library.BACKENDS)  # the names, in order of preference
_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_LOAD_ERRORS: Dict[str, Optional[str]] = {}       # backend -> None (loaded) or the reason
_OP_ERRORS: Dict[Tuple[str, str], Optional[str]] = {}  # (backend, op) -> None or the reason
_BOUND: Dict[str, str] = {}                        # device type -> backend bound to the public ns
_BOUND_OPS: Dict[Tuple[str, str], str] = {}        # (device type, op) -> backend, where it differs
_FORCED: List[Tuple[str, frozenset]] = []         # use_backend stack: (backend, ops)
_python_registered: set = set()


def namespace(backend: str) -> str:
    return _library.backend(backend).namespace


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, str):
        return device.split(":")[0]
    return device.type


def usable_on(backend: str, device_type: str) -> Tuple[bool, str]:
    """Whether ``backend`` can run on ``device_type`` at all (independent of what is built)."""
    if backend not in _library.BACKENDS:
        return False, f"unknown backend {backend!r}"
    return _library.BACKENDS[backend].usable_on(device_type)


def _register_python(backend: str) -> None:
    """Register the Python kernels of ``backend`` for its own namespace."""
    if backend in _python_registered:
        return
    _python_registered.add(backend)
    rec = _library.BACKENDS[backend]
    for name in _library.python_ops(backend):
        kernel = _library.python_kernel(backend, name, rec.namespace)
        for key in rec.keys:
            _library.LIBS[rec.namespace].impl(name, kernel, key)


def load(backend: str) -> Optional[str]:
    """Make ``backend``'s namespace populated; ``None`` if it is, else the reason it is not."""
    if backend in _LOAD_ERRORS:
        return _LOAD_ERRORS[backend]
    err = _library.backend(backend).probe()
    if err is None:
        _register_python(backend)
    _LOAD_ERRORS[backend] = err
    return err


def _op_error(backend: str, op: str) -> Optional[str]:
    """``None`` if ``op`` of ``backend`` can be called (module importable, kernel registered)."""
    key = (backend, op)
    if key in _OP_ERRORS:
        return _OP_ERRORS[key]
    err = load(backend)
    spec = _library.spec(op)
    if err is None and not spec.implemented_by(backend):
        err = f"no {backend} implementation of {op} exists"
    if err is None and _library.BACKENDS[backend].python_package and backend not in spec.composite:
        module, attr = _library.python_impl(backend, op)
        try:
            getattr(importlib.import_module(module), attr)
        except Exception as exc:
            err = f"{type(exc).__name__}: {exc}"
    if err is None and not torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace(backend)}::{op}", "CPU"):
        err = f"no {backend} implementation of {op} exists"
    _OP_ERRORS[key] = err
    return err


def available_backends(op: str, device="cpu") -> list:
    """Every backend that can run ``op`` on ``device`` in this process (for tests and benchmarks)."""
    dev = _device_type(device)
    return [b for b in BACKENDS if usable_on(b, dev)[0] and _op_error(b, op) is None]


def unavailable_reason(op: str, backend: str, device="cpu") -> str:
    ok, why = usable_on(backend, _device_type(device))
    if not ok:
        return why
    return _op_error(backend, op) or ""


# ------------------------------------------------------------------------------ the public namespace
def _bind(backend: str, key: str, dev: str) -> None:
    """Register ``backend``'s kernels of every op for the public namespace, dispatch key ``key``:
    its C++ functions themselves where its extension binds them, else its Python kernels, else a
    redirect to its own namespace; an op it does not implement gets the fallback backend's."""
    public = _library.NAMESPACE
    rec = _library.BACKENDS[backend]
    cxx_ops = set()
    if rec.extension is not None:
        importlib.import_module(rec.extension)._bind_cpu(public)
        cxx_ops = {s.name for s in _library.specs()
                   if s.implemented_by(backend) and backend not in s.composite
                   and torch._C._dispatch_has_kernel_for_dispatch_key(f"{rec.namespace}::{s.name}", "CPU")
                   and torch._C._dispatch_has_kernel_for_dispatch_key(f"{public}::{s.name}", key)}
    for s in _library.specs():
        if s.name in cxx_ops:
            continue
        if not s.implemented_by(backend):
            load(_library.FALLBACK.name)
            kernel = _library.python_kernel(_library.FALLBACK.name, s.name, public)
            _BOUND_OPS[(dev, s.name)] = _library.FALLBACK.name
        elif rec.python_package is not None or backend in s.composite:
            kernel = _library.python_kernel(backend, s.name, public)
        else:
            kernel = _library.redirect_kernel(backend, s.name)
        _library.LIBS[public].impl(s.name, kernel, key)


def _triton_ops_error(backend: str, dev: str) -> Optional[str]:
    """On a machine with a GPU, a Python backend that guards its calls (triton) has its kernels
    imported at bind time (so a broken install falls back or raises at import, not at the first
    call)."""
    rec = _library.BACKENDS[backend]
    if not rec.guard_calls or (dev == "cuda" and not torch.cuda.is_available()):
        return None
    errs = [e for e in (_op_error(backend, op) for op in _library.python_ops(backend)) if e]
    return errs[0] if errs else None


def _raising(backend: str, why: str):
    def kernel(*args):
        raise BackendUnavailableError(f"{ENV_VAR}={backend!r} was requested but cannot run here: {why}")
    return kernel


def _default_order(dev: str) -> Tuple[str, ...]:
    return tuple(b.name for b in _library.BACKENDS.values() if dev in b.default_on)


def bind_public() -> None:
    """Choose, once, the backend of every public op per dispatch key (CPU, CUDA) and bind it."""
    forced = os.environ.get(ENV_VAR) or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={forced!r} is not a backend; expected one of {BACKENDS}")
    load(_library.FALLBACK.name)  # its namespace serves every op, always
    for dev, key in _KEYS.items():
        if forced is not None:
            ok, why = usable_on(forced, dev)
            err = (load(forced) or _triton_ops_error(forced, dev)) if ok else why
            if err is None:
                _bind(forced, key, dev)
                _BOUND[dev] = forced
            else:
                for s in _library.specs():
                    _library.LIBS[_library.NAMESPACE].impl(s.name, _raising(forced, err), key)
                _BOUND[dev] = f"unavailable ({forced}: {err})"
            continue
        reasons = []
        for backend in _default_order(dev):
            ok, why = usable_on(backend, dev)
            err = (load(backend) or _triton_ops_error(backend, dev)) if ok else why
            if err is None:
                if reasons and (dev == "cpu" or torch.cuda.is_available()):
                    warnings.warn(f"ascend_moe_ops on {dev} runs the {backend} backend: " + "; ".join(reasons),
                                  RuntimeWarning, stacklevel=2)
                _bind(backend, key, dev)
                _BOUND[dev] = backend
                break
            reasons.append(f"{backend} unavailable ({err})")
    # A C++ backend bound to no device (ascendc-emu) is registered too when its extension is built in
    # this package, so that torch.ops.<its namespace>.<op> runs after a plain import (when it is
    # not built, nothing is imported and nothing warned: its namespace then says it has no kernel).
    from . import _native
    for rec in _library.BACKENDS.values():
        if rec.name not in _LOAD_ERRORS and rec.extension is not None and _native.built(rec.extension):
            load(rec.name)


def active_backend(op: str, device="cpu") -> str:
    """Name of the backend that ``torch.ops.ascend_moe_ops.<op>`` runs on ``device`` right now."""
    dev = _device_type(device)
    if dev in ("npu", "privateuseone"):
        return "ascendc"
    if op not in _library.SCHEMAS and op not in _library.INTERNAL_SCHEMAS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(_library.SCHEMAS)}")
    for name, ops in reversed(_FORCED):
        if op in ops and usable_on(name, dev)[0]:
            return name
    bound = _BOUND.get(dev)
    if bound is None:
        raise BackendUnavailableError(f"no backend is bound for ascend_moe_ops.{op} on {dev}")
    if bound.startswith("unavailable"):
        raise BackendUnavailableError(f"ascend_moe_ops.{op} on {dev}: {bound}")
    return _BOUND_OPS.get((dev, op), bound)


def forced_backend() -> Optional[str]:
    """The backend the innermost active :func:`use_backend` forces (``None`` outside one)."""
    return _FORCED[-1][0] if _FORCED else None


@contextlib.contextmanager
def use_backend(name: Optional[str], ops=None):
    """Run every public op (or only those named in ``ops``) on backend ``name`` inside the
    ``with`` block (``None``: no change).

    A convenience for tests and benchmarks, process-wide (not per thread): the public namespace's
    CPU kernels (and CUDA ones for triton/reference) are overridden by a redirect to
    ``torch.ops.<namespace of name>.<op>`` and restored on exit. Production code should call the
    namespace directly or set ``ASCEND_MOE_OPS_BACKEND`` before import.
    """
    if name is None:
        yield
        return
    ns = namespace(name)
    err = load(name)
    if err is not None:
        raise BackendUnavailableError(f"backend {name!r} was requested but cannot run here: {err}")
    selected = frozenset(_library.SCHEMAS if ops is None else ops)
    known = set(_library.SCHEMAS) | set(_library.INTERNAL_SCHEMAS)
    unknown = selected - known
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; expected names from {sorted(_library.SCHEMAS)}")
    missing = sorted(op for op in selected if not _library.spec(op).implemented_by(name))
    if missing:
        raise ValueError(f"backend {name!r} has no kernel of {missing}")
    lib = torch._C._dispatch_library("IMPL", _library.NAMESPACE, "", __file__, 0)
    keys = _library.BACKENDS[name].keys
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
        for op in sorted(selected):
            target = _library.op(op, ns)

            def redirect(*args, _target=target):
                return _target(*args)

            for key in keys:
                dev = key.lower()
                if not _FORCED and _BOUND_OPS.get((dev, op), _BOUND.get(dev)) == name:
                    continue  # the backend already bound keeps its kernel (no redirect cost, e.g. in benchmarks)
                lib.impl(op, key, redirect, False)
    _FORCED.append((name, selected))
    try:
        yield
    finally:
        _FORCED.pop()
        lib.reset()
