"""Backend registry: which implementation of an op runs on which device.

Every public op is one ``torch.ops.ascend_moe_ops.<op>`` (schema in ``_library.py``). Its kernel for
the CPU and CUDA dispatch keys is a small router that asks this module which implementation to run:

=============  ====================================================  =========================
backend        what it is                                            devices
=============  ====================================================  =========================
native         C++ kernels in ``csrc/cpu`` (extension ``_C``)        cpu
triton         Triton kernels in ``triton_ref/``                     cuda; cpu under
                                                                     ``TRITON_INTERPRET=1``
ascendc-emu    the AscendC kernel sources compiled against the       cpu (tests only)
               CPU emulation layer in ``csrc/ascend/emu``
reference      pure PyTorch in ``ascend_moe_ops/reference``          any
=============  ====================================================  =========================

On Ascend NPUs (``PrivateUse1``) the AscendC host glue registers its kernels with the dispatcher
directly; there is only one implementation there.

Selection, per call: an explicit :func:`use_backend` context, else the environment variable
``ASCEND_MOE_OPS_BACKEND``, else the default order for the device (cpu: native, reference;
cuda: triton, reference).  A *forced* backend that cannot run raises; a *default* choice that
falls back to the reference is reported once with a warning naming the reason, and
:func:`active_backend` always tells what really runs.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from typing import Callable, Dict, Optional, Tuple

ENV_VAR = "ASCEND_MOE_OPS_BACKEND"
BACKENDS = ("native", "triton", "ascendc-emu", "reference")
_DEFAULT_ORDER = {
    "cpu": ("native", "reference"),
    "cuda": ("triton", "reference"),
}

# (op, backend) -> (module path, attribute); resolved lazily so that a missing toolkit only
# disables the backends that need it.
_IMPLS: Dict[Tuple[str, str], Tuple[str, str]] = {}
_LOADED: Dict[Tuple[str, str], Callable] = {}
_LOAD_ERRORS: Dict[Tuple[str, str], str] = {}
_WARNED: set = set()
_local = threading.local()


class BackendUnavailableError(RuntimeError):
    """A backend was asked for (explicitly) but cannot run here."""


def register_impl(op: str, backend: str, module: str, attr: str) -> None:
    """Declare that ``module.attr`` implements ``op`` for ``backend`` (imported on first use)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _IMPLS[(op, backend)] = (module, attr)


def _device_type(device) -> str:
    if device is None:
        return "cpu"
    if isinstance(device, str):
        return device.split(":")[0]
    return device.type


def _load(op: str, backend: str) -> Optional[Callable]:
    key = (op, backend)
    if key in _LOADED:
        return _LOADED[key]
    if key in _LOAD_ERRORS:
        return None
    if key not in _IMPLS:
        _LOAD_ERRORS[key] = f"no {backend} implementation of {op} exists"
        return None
    module, attr = _IMPLS[key]
    try:
        fn = getattr(importlib.import_module(module), attr)
    except Exception as exc:  # ImportError, missing symbol in an old build, toolkit errors
        _LOAD_ERRORS[key] = f"{type(exc).__name__}: {exc}"
        return None
    _LOADED[key] = fn
    return fn


def _usable_on(backend: str, device_type: str) -> Tuple[bool, str]:
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


def requested_backend() -> Optional[str]:
    """The backend forced by :func:`use_backend` or the environment variable, if any."""
    forced = getattr(_local, "forced", None)
    if forced is None:
        forced = os.environ.get(ENV_VAR) or None
    if forced is not None and forced not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={forced!r} is not a backend; expected one of {BACKENDS}")
    return forced


def resolve(op: str, device) -> Tuple[str, Callable]:
    """Return ``(backend_name, implementation)`` for ``op`` on ``device``."""
    dev = _device_type(device)
    forced = requested_backend()
    if forced is not None:
        ok, why = _usable_on(forced, dev)
        fn = _load(op, forced) if ok else None
        if fn is None:
            why = why or _LOAD_ERRORS.get((op, forced), "")
            raise BackendUnavailableError(
                f"backend {forced!r} was requested for ascend_moe_ops.{op} on {dev} but cannot run: {why}")
        return forced, fn
    order = _DEFAULT_ORDER.get(dev, ("reference",))
    reasons = []
    for backend in order:
        ok, why = _usable_on(backend, dev)
        fn = _load(op, backend) if ok else None
        if fn is not None:
            if reasons and (op, dev) not in _WARNED:
                _WARNED.add((op, dev))
                warnings.warn(f"ascend_moe_ops.{op} on {dev} runs the {backend} backend: "
                              + "; ".join(reasons), RuntimeWarning, stacklevel=3)
            return backend, fn
        reasons.append(f"{backend} unavailable ({why or _LOAD_ERRORS.get((op, backend), '')})")
    raise BackendUnavailableError(f"no backend for ascend_moe_ops.{op} on {dev}: " + "; ".join(reasons))


def active_backend(op: str, device="cpu") -> str:
    """Name of the backend that ``ascend_moe_ops.<op>`` runs on ``device`` right now."""
    if _device_type(device) == "npu" or _device_type(device) == "privateuseone":
        return "ascendc"
    return resolve(op, device)[0]


def available_backends(op: str, device="cpu") -> list:
    """Every backend that can run ``op`` on ``device`` in this process (for tests and benchmarks)."""
    dev = _device_type(device)
    out = []
    for backend in BACKENDS:
        ok, _ = _usable_on(backend, dev)
        if ok and _load(op, backend) is not None:
            out.append(backend)
    return out


def unavailable_reason(op: str, backend: str, device="cpu") -> str:
    ok, why = _usable_on(backend, _device_type(device))
    if not ok:
        return why
    if _load(op, backend) is None:
        return _LOAD_ERRORS.get((op, backend), "not loadable")
    return ""


@contextlib.contextmanager
def use_backend(name: Optional[str]):
    """Force ``name`` for every op called in this thread inside the ``with`` block."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    prev = getattr(_local, "forced", None)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = prev
