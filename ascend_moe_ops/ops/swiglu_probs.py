"""``swiglu_probs``: SwiGLU with the router probability of each row applied in the same pass.

An internal fused kernel of the framework adapters (Megatron-Core's ``GroupedMLP`` computes
``silu(x1) * x2 * probs`` between its grouped GEMMs), not one of the package's public ops: its
schemas live in ``_library.INTERNAL_SCHEMAS`` and exist for two namespaces only, the native C++
kernel (``csrc/cpu/swiglu_probs.cpp``, cpu) and the pure-PyTorch reference
(``reference/swiglu_probs.py``), which :func:`swiglu_probs` runs on every other device and when the
native extension is not loaded. Spec: :mod:`ascend_moe_ops.reference.swiglu_probs`.
"""

from __future__ import annotations

import torch

from .. import _library
from . import _checks

Tensor = torch.Tensor
OP, BWD = "swiglu_probs", "swiglu_probs_backward"
NATIVE, REFERENCE = _library.INTERNAL_NAMESPACES


def _check(name: str, x: Tensor, probs: Tensor) -> None:
    _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"{name}: x must have an even number of columns [N, 2F], got shape {tuple(x.shape)}")
    _checks.check_tensor("probs", probs, ndim=1, dtypes=_checks.FLOAT_DTYPES, device=x.device)
    if probs.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: probs must have shape ({x.shape[0]},) (one per row of x), "
                         f"got {tuple(probs.shape)}")


def _fake(x, probs):
    _check(OP, x, probs)
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _fake_bwd(grad_out, x, probs):
    _check(BWD, x, probs)
    return x.new_empty(x.shape), probs.new_empty(probs.shape)


def _ref_fwd(x, probs):
    from ..reference.swiglu_probs import swiglu_probs as f
    _check(OP, x, probs)
    return f(x, probs)


def _ref_bwd(grad_out, x, probs):
    from ..reference.swiglu_probs import swiglu_probs_backward as f
    _check(BWD, x, probs)
    if tuple(grad_out.shape) != (x.shape[0], x.shape[1] // 2):
        raise ValueError(f"{BWD}: grad_out must have shape ({x.shape[0]}, {x.shape[1] // 2}) (x is [N, 2F]), "
                         f"got {tuple(grad_out.shape)}")
    return f(grad_out, x, probs)


def _setup_context(ctx, inputs, output):
    x, probs = inputs
    ctx.save_for_backward(x, probs)


def _make_backward(ns):
    def backward(ctx, grad):
        x, probs = ctx.saved_tensors
        gx, gp = getattr(torch.ops, ns).swiglu_probs_backward.default(grad.contiguous(), x, probs)
        return gx, gp
    return backward


for _ns in _library.INTERNAL_NAMESPACES:
    torch.library.register_fake(f"{_ns}::{OP}", _fake, lib=_library.LIBS[_ns])
    torch.library.register_fake(f"{_ns}::{BWD}", _fake_bwd, lib=_library.LIBS[_ns])
    # the native namespace's formula is C++ (csrc/cpu/autograd.cpp) when the extension is loaded
    # (_library imported it); the Python one otherwise, and always for the reference namespace
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{_ns}::{OP}", "Autograd"):
        torch.library.register_autograd(f"{_ns}::{OP}", _make_backward(_ns), setup_context=_setup_context,
                                        lib=_library.LIBS[_ns])
for _key in ("CPU", "CUDA"):
    _library.LIBS[REFERENCE].impl(OP, _ref_fwd, _key)
    _library.LIBS[REFERENCE].impl(BWD, _ref_bwd, _key)


#: the namespace :func:`swiglu_probs` runs for a tensor: native on cpu when loaded, else reference
namespace_for = _library.internal_namespace_for


def swiglu_probs(x: Tensor, probs: Tensor) -> Tensor:
    """``silu(x[:, :F]) * x[:, F:] * probs[:, None]`` in one pass, differentiable w.r.t. both.

    Args:
        x: ``[N, 2F]`` fp32/fp16/bf16/fp64 (the gate half first, as Megatron's ``torch.chunk``).
        probs: ``[N]`` float router probabilities of the rows.

    Returns:
        ``[N, F]`` in ``x``'s dtype, computed in fp32 and rounded once. Backward saves only ``x``
        and ``probs``.
    """
    # the arguments are checked once, by the kernel that runs (native: C++; reference and fake:
    # _check), not here as well
    return getattr(torch.ops, namespace_for(x)).swiglu_probs.default(x.contiguous(), probs.contiguous())
