"""Loading of the AscendC NPU backend (dispatch key ``PrivateUse1``).

The package never imports torch_npu by itself unless it is installed: ``importlib.util.find_spec``
probes for it first (an installed torch_npu needs CANN at import time). When torch_npu is present
and the CMake build (csrc/ascend/CMakeLists.txt, see docs/ascend.md) has produced
``ascend_moe_ops/lib/libascend_moe_ops_npu.so``, that library is loaded with
``torch.ops.load_library``; its ``TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, ...)`` blocks then
serve every op on NPU tensors. :func:`status` says what happened.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Optional

import torch

LIB_NAME = "libascend_moe_ops_npu.so"
_STATUS: Optional[str] = None


def library_path() -> Optional[str]:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib")
    found = glob.glob(os.path.join(here, LIB_NAME))
    return found[0] if found else None


def load() -> str:
    """Load the NPU backend if possible; returns a one-line status (also kept for :func:`status`)."""
    global _STATUS
    if _STATUS is not None:
        return _STATUS
    if importlib.util.find_spec("torch_npu") is None:
        _STATUS = "not loaded: torch_npu is not installed"
        return _STATUS
    path = library_path()
    if path is None:
        _STATUS = f"not loaded: {LIB_NAME} is not built (run csrc/ascend/build_npu.sh on a CANN machine)"
        return _STATUS
    try:
        import torch_npu  # noqa: F401  (registers the PrivateUse1 backend)
        torch.ops.load_library(path)
    except Exception as exc:  # toolkit/driver problems: report, keep the CPU backends working
        _STATUS = f"not loaded: {type(exc).__name__}: {exc}"
        return _STATUS
    _register_composites()
    _STATUS = f"loaded {path}"
    return _STATUS


def _register_composites() -> None:
    """Ops whose Ascend path is a composition of the AscendC kernels in Python (mla_attention: the
    grouped GEMM Cube kernels for the up-projection and its gradients, the flash attention kernels
    for the attention) are served on PrivateUse1 by those Python functions (UNVERIFIED on an NPU)."""
    from . import _library
    from .ops import mla_attention as mla

    fwd, bwd = mla.ascend_kernels(_library.NAMESPACE)
    _library.LIBS[_library.NAMESPACE].impl("mla_attention_fwd", fwd, "PrivateUse1")
    _library.LIBS[_library.NAMESPACE].impl("mla_attention_bwd", bwd, "PrivateUse1")


def status() -> str:
    return load()
