"""Python-type checks of the public wrappers (and of the non-op modules: balance, distributed,
integrations; a public module, so the framework adapters use no private helper). Every message names the argument and says what was expected and what was given. The
op contracts themselves (shapes, dtypes, devices, values) are checked at the op boundary:
the specs' checks (``_contracts.py``) and ``csrc/common/<family>_checks.h``."""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence

import torch

from . import _contracts

FLOAT_DTYPES = _contracts.FLOAT_DTYPES
INDEX_DTYPES = _contracts.INDEX_DTYPES


def check_tensor(name: str, t, *, ndim: Optional[int] = None, dtypes: Optional[Iterable] = None,
                 device: Optional[torch.device] = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(expected)}{extra}, got {tuple(t.shape)}")


def _type_name(value) -> str:
    """The type of value as a message names it: numpy's scalars by module (``numpy.bool`` is not
    ``bool``)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _is_bool(value) -> bool:
    """A Python bool or a numpy bool scalar (not an int: ``overlap=1`` is refused)."""
    t = type(value)
    return isinstance(value, bool) or (t.__module__ == "numpy" and t.__name__ in ("bool_", "bool"))


def check_int(name: str, value, *, minimum: Optional[int] = None) -> int:
    """A Python or numpy integer (not a bool), returned as int, or a symbolic size under
    ``torch.compile``, ``>= minimum``."""
    # the ABC is asked last (and only of what is not a Python int): torch.compile traces the rest
    if _is_bool(value) or not (isinstance(value, (int, torch.SymInt)) or isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be an int, got {_type_name(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value if isinstance(value, torch.SymInt) else int(value)


def check_bool(name: str, value) -> bool:
    """A Python or numpy bool, returned as bool (a truthy string or int is not one:
    ``return_lse="no"`` returned the lse)."""
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {_type_name(value)}")
    return bool(value)


def check_float(name: str, value, *, finite: bool = False, minimum: Optional[float] = None,
                why: str = ""):
    """A Python or numpy real number (not a bool), returned as float; with ``finite`` not NaN nor
    infinite, with ``minimum`` ``>= minimum`` (comparisons only, so a symbolic float under
    ``torch.compile`` passes through unchanged). ``why`` ends the ValueError's message."""
    if _is_bool(value) or not (isinstance(value, (int, float, torch.SymInt, torch.SymFloat))
                               or isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a float, got {_type_name(value)}")
    if finite and not -math.inf < value < math.inf:
        raise ValueError(f"{name} must be a finite number{'' if minimum is None else f' >= {minimum}'}, "
                         f"got {value!r}{why}")
    if minimum is not None and not value >= minimum:
        raise ValueError(f"{name} must be {'a finite number ' if finite else ''}>= {minimum}, got {value!r}{why}")
    return value if isinstance(value, torch.SymFloat) else float(value)


def is_fake(t: torch.Tensor) -> bool:
    return _contracts.is_fake(t)


def check_values(name: str, t: torch.Tensor, bad, rule: str, short: str) -> None:
    """``bad(t)`` nowhere true: a ValueError on the CPU, a device-side assert elsewhere (the one
    value check, ``_contracts.values_ok``, without an op prefix); under ``torch.compile`` an assert
    traced into the graph (the fake-tensor test cannot be traced)."""
    if torch.compiler.is_compiling():
        if t.numel():
            torch._assert_async(~bad(t).any(), f"{name} {short}")
        return
    _contracts.values_ok(None, name, t, bad, rule, short)


def check_index_range(name: str, idx: torch.Tensor, low: int, high: int) -> None:
    """All values of ``idx`` in ``[low, high)``. On the CPU a ValueError; on accelerators a
    device-side assert (no host synchronization), so the kernels never see a wild index. The one
    range check (``_contracts.index_range``), without an op prefix."""
    _contracts.index_range(None, name, idx, low, high)
