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
default falls back. For native on cpu the public kernel is the C++ function itself: nothing in
Python runs between the dispatcher and the kernel. On Ascend NPUs (``PrivateUse1``) the AscendC
host glue registers its kernels itself (``_npu.py``). :func:`active_backend` tells what is bound.

:func:`use_backend` is a convenience for tests and benchmarks: inside the ``with`` block the public
ops' CPU (and, for triton/reference, CUDA) kernels are replaced by a redirect to the backend's
namespace, process-wide (not per thread), and restored on exit.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from typing import Dict, List, Optional, Tuple

import torch

from . import _library, _native

ENV_VAR = "ASCEND_MOE_OPS_BACKEND"
BACKENDS = ("native", "triton", "ascendc-emu", "reference")
_DEFAULT_ORDER = {"cpu": ("native", "reference"), "cuda": ("triton", "reference")}
_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_EXTENSIONS = {"native": "ascend_moe_ops._C", "ascendc-emu": "ascend_moe_ops._ascendc_emu"}

_LOAD_ERRORS: Dict[str, Optional[str]] = {}       # backend -> None (loaded) or the reason
_OP_ERRORS: Dict[Tuple[str, str], Optional[str]] = {}  # (backend, op) -> None or the reason
_BOUND: Dict[str, str] = {}                        # device type -> backend bound to the public ns
_FORCED: List[Tuple[str, frozenset]] = []         # use_backend stack: (backend, ops)
_python_registered: set = set()


class BackendUnavailableError(RuntimeError):
    """A backend was asked for (explicitly) but cannot run here."""


def namespace(backend: str) -> str:
    if backend not in _library.BACKEND_NAMESPACES:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return _library.BACKEND_NAMESPACES[backend]


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, str):
        return device.split(":")[0]
    return device.type


def _triton_error() -> Optional[str]:
    if importlib.util.find_spec("triton") is None:
        return "ModuleNotFoundError: triton is not installed"
    return None


def usable_on(backend: str, device_type: str) -> Tuple[bool, str]:
    """Whether ``backend`` can run on ``device_type`` at all (independent of what is built)."""
    if backend == "reference":
        return True, ""
    if backend in ("native", "ascendc-emu"):
        if device_type != "cpu":
            return False, f"the {backend} backend runs on cpu tensors only, got {device_type}"
        return True, ""
    if backend == "triton":
        if device_type == "cuda":
            return True, ""
        if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            return True, ""
        return False, ("the triton backend needs a CUDA device, or TRITON_INTERPRET=1 (set before "
                       "triton is imported) to run on cpu tensors")
    return False, f"unknown backend {backend!r}"


def require_usable(backend: str, args) -> None:
    """Per-call guard of the Python backends' kernels (the device of the first tensor argument)."""
    dev = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    ok, why = usable_on(backend, dev)
    if not ok:
        raise BackendUnavailableError(f"backend {backend!r} cannot run here: {why}")


def _register_python(backend: str) -> None:
    """Register the Python kernels of ``backend`` for its own namespace (CPU and CUDA keys)."""
    if backend in _python_registered:
        return
    _python_registered.add(backend)
    ns = namespace(backend)
    names = (list(_library.PYTHON_IMPLS.get(backend, {}))
             + list(_library.COMPOSITE_KERNELS.get(backend, {})))
    for name in names:
        kernel = _library.python_kernel(backend, name, ns)
        keys = ("CPU",) if backend == "ascendc-emu" else ("CPU", "CUDA")
        for key in keys:
            _library.LIBS[ns].impl(name, kernel, key)


def load(backend: str) -> Optional[str]:
    """Make ``backend``'s namespace populated; ``None`` if it is, else the reason it is not."""
    if backend in _LOAD_ERRORS:
        return _LOAD_ERRORS[backend]
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    err = None
    try:
        if backend in _EXTENSIONS:
            # the build record is checked first (_native.py: torch version, CPU); a mismatch or a
            # broken build warns once with the rebuild command, and the reference kernels serve
            err = _native.problem(_EXTENSIONS[backend])
            mod = None if err else importlib.import_module(_EXTENSIONS[backend])  # registers its kernels
            if mod is not None and not hasattr(mod, "_bind_cpu"):
                err = (f"{_EXTENSIONS[backend]} is an old build without dispatcher kernels; rebuild it "
                       "(python setup.py build_ext --inplace)")
        elif backend == "triton":
            err = _triton_error()
    except Exception as exc:  # ImportError, missing symbol in an old build, toolkit errors
        err = f"{type(exc).__name__}: {exc}"
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
    if err is None and op in _library.PYTHON_IMPLS.get(backend, {}):
        module, attr = _library.PYTHON_IMPLS[backend][op]
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
def _bind(backend: str, key: str) -> None:
    """Register ``backend``'s kernels of every op for the public namespace, dispatch key ``key``."""
    public = _library.NAMESPACE
    cxx_ops = set()
    if backend in _EXTENSIONS:
        importlib.import_module(_EXTENSIONS[backend])._bind_cpu(public)
        cxx_ops = {op for op in _library.SCHEMAS
                   if torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace(backend)}::{op}", "CPU")
                   and op not in _library.COMPOSITE_KERNELS.get(backend, {})}
    for name in _library.SCHEMAS:
        if name not in cxx_ops:
            _library.LIBS[public].impl(name, _library.python_kernel(backend, name, public), key)


def _triton_ops_error(backend: str, dev: str) -> Optional[str]:
    """On a machine with a GPU, triton's kernels are imported at bind time (so a broken install
    falls back or raises at import, not at the first call)."""
    if backend != "triton" or (dev == "cuda" and not torch.cuda.is_available()):
        return None
    errs = [e for e in (_op_error(backend, op) for op in _library.PYTHON_IMPLS["triton"]) if e]
    return errs[0] if errs else None


def _raising(backend: str, why: str):
    def kernel(*args):
        raise BackendUnavailableError(f"{ENV_VAR}={backend!r} was requested but cannot run here: {why}")
    return kernel


def bind_public() -> None:
    """Choose, once, the backend of every public op per dispatch key (CPU, CUDA) and bind it."""
    forced = os.environ.get(ENV_VAR) or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={forced!r} is not a backend; expected one of {BACKENDS}")
    for dev, key in _KEYS.items():
        if forced is not None:
            ok, why = usable_on(forced, dev)
            err = (load(forced) or _triton_ops_error(forced, dev)) if ok else why
            if err is None:
                _bind(forced, key)
                _BOUND[dev] = forced
            else:
                for name in _library.SCHEMAS:
                    _library.LIBS[_library.NAMESPACE].impl(name, _raising(forced, err), key)
                _BOUND[dev] = f"unavailable ({forced}: {err})"
            continue
        reasons = []
        for backend in _DEFAULT_ORDER[dev]:
            ok, why = usable_on(backend, dev)
            err = (load(backend) or _triton_ops_error(backend, dev)) if ok else why
            if err is None:
                if reasons and (dev == "cpu" or torch.cuda.is_available()):
                    warnings.warn(f"ascend_moe_ops on {dev} runs the {backend} backend: " + "; ".join(reasons),
                                  RuntimeWarning, stacklevel=2)
                _bind(backend, key)
                _BOUND[dev] = backend
                break
            reasons.append(f"{backend} unavailable ({err})")


def active_backend(op: str, device="cpu") -> str:
    """Name of the backend that ``torch.ops.ascend_moe_ops.<op>`` runs on ``device`` right now."""
    dev = _device_type(device)
    if dev in ("npu", "privateuseone"):
        return "ascendc"
    if op not in _library.SCHEMAS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(_library.SCHEMAS)}")
    for name, ops in reversed(_FORCED):
        if op in ops and usable_on(name, dev)[0]:
            return name
    bound = _BOUND.get(dev)
    if bound is None:
        raise BackendUnavailableError(f"no backend is bound for ascend_moe_ops.{op} on {dev}")
    if bound.startswith("unavailable"):
        raise BackendUnavailableError(f"ascend_moe_ops.{op} on {dev}: {bound}")
    return bound


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
    unknown = selected - set(_library.SCHEMAS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; expected names from {sorted(_library.SCHEMAS)}")
    lib = torch._C._dispatch_library("IMPL", _library.NAMESPACE, "", __file__, 0)
    keys = ("CPU",) if name in _EXTENSIONS else ("CPU", "CUDA")
    if not _FORCED:  # the backend already bound keeps its kernel (no redirect cost, e.g. in benchmarks)
        keys = tuple(k for k in keys if _BOUND.get(k.lower()) != name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": intended
        for op in sorted(selected):
            target = _library.op(op, ns)

            def redirect(*args, _target=target):
                return _target(*args)

            for key in keys:
                lib.impl(op, key, redirect, False)
    _FORCED.append((name, selected))
    try:
        yield
    finally:
        _FORCED.pop()
        lib.reset()
