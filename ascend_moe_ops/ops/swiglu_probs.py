"""``swiglu_probs``: SwiGLU with the router probability of each row applied in the same pass.

An internal fused kernel of the framework adapters (Megatron-Core's ``GroupedMLP`` computes
``silu(x1) * x2 * probs`` between its grouped GEMMs), not one of the package's public ops: its spec
is ``public=False`` and only two backends implement it, the native C++ kernel
(``csrc/cpu/swiglu_probs.cpp``, cpu) and the pure-PyTorch reference (``reference/swiglu_probs.py``,
the spec). :func:`swiglu_probs` calls ``torch.ops.ascend_moe_ops.swiglu_probs``, bound once at
import like every op (native on cpu when the extension is built, the reference everywhere else).
"""

from __future__ import annotations

import torch

from .. import _backends, _library
from . import checks

Tensor = torch.Tensor
OP, BWD = "swiglu_probs", "swiglu_probs_backward"
BACKENDS = (_library.NATIVE.name, _library.REFERENCE.name)
NATIVE, REFERENCE = (_library.BACKENDS[b].namespace for b in BACKENDS)


def _check(name: str, x: Tensor, probs: Tensor) -> None:
    checks.check_tensor("x", x, ndim=2, dtypes=checks.FLOAT_DTYPES)
    if x.shape[1] % 2:
        raise ValueError(f"{name}: x must have an even number of columns [N, 2F], got shape {tuple(x.shape)}")
    checks.check_tensor("probs", probs, ndim=1, dtypes=checks.FLOAT_DTYPES, device=x.device)
    if probs.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: probs must have shape ({x.shape[0]},) (one per row of x), "
                         f"got {tuple(probs.shape)}")


def _check_fwd(x, probs):
    _check(OP, x, probs)


def _check_bwd(grad_out, x, probs):
    """As the native kernel: grad_out on x's device, in x's dtype, of shape [N, F]."""
    _check(BWD, x, probs)
    checks.check_tensor("grad_out", grad_out, device=x.device)
    if grad_out.dtype != x.dtype:
        raise TypeError(f"{BWD}: grad_out must have x's dtype {str(x.dtype).replace('torch.', '')}, got "
                        f"{str(grad_out.dtype).replace('torch.', '')}")
    if tuple(grad_out.shape) != (x.shape[0], x.shape[1] // 2):
        raise ValueError(f"{BWD}: grad_out must have shape ({x.shape[0]}, {x.shape[1] // 2}) (x is [N, 2F]), "
                         f"got {tuple(grad_out.shape)}")


def _fake(x, probs):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def _fake_bwd(grad_out, x, probs):
    return x.new_empty(x.shape), probs.new_empty(probs.shape)


def _setup_context(ctx, inputs, output):
    x, probs = inputs
    ctx.save_for_backward(x, probs)


def _backward(ops, ctx, grad):
    x, probs = ctx.saved_tensors
    gx, gp = ops(BWD)(grad.contiguous(), x, probs)
    return gx, gp


# the native namespace's formula is C++ (csrc/cpu/autograd.cpp) when the extension is loaded
_library.define(_library.OpSpec(
    # (x [N,2F], probs [N]) -> [N,F] in x's dtype: silu(x[:, :F]) * x[:, F:] * probs[:, None] in fp32,
    # rounded once (Megatron-Core GroupedMLP's activation with the router probs)
    OP, "(Tensor x, Tensor probs) -> Tensor", fake=_fake, check=_check_fwd,
    backward=_backward, setup_context=_setup_context, public=False, backends=BACKENDS), __name__)
_library.define(_library.OpSpec(
    # -> (grad_x [N,2F] in x's dtype, grad_probs [N] in probs' dtype)
    BWD, "(Tensor grad_out, Tensor x, Tensor probs) -> (Tensor, Tensor)", fake=_fake_bwd,
    check=_check_bwd, public=False, backends=BACKENDS, backward_of=OP), __name__)


def namespace_for(t: Tensor) -> str:
    """The namespace whose kernel :func:`swiglu_probs` runs for a tensor on ``t``'s device now (the
    binding is made once, at import; this only reports it)."""
    return _library.BACKENDS[_backends.active_backend(OP, t.device)].namespace


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
    # the spec's check), not here as well
    return _library.op(OP)(x.contiguous(), probs.contiguous())
