"""``grouped_gemm``: one GEMM per expert over contiguous row groups (the MoE expert FFN).

Backward is built from the forward ops (registered at the op level, so every backend gets it):
``dx = grouped_gemm(dy, weight, group_sizes, trans_b=not trans_b)`` and
``dweight[e] = x_e^T dy_e`` (``dy_e^T x_e`` for ``trans_b``) from ``grouped_gemm_dw``.
"""

from __future__ import annotations

import torch

from .. import _library
from . import _contracts, checks

OP = "grouped_gemm"
DW = "grouped_gemm_dw"
Tensor = torch.Tensor
__all__ = ["grouped_gemm", "grouped_gemm_dw"]


def _fake(x, weight, group_sizes, trans_b):
    return x.new_empty((x.shape[0], weight.shape[1] if trans_b else weight.shape[2]))


def _fake_dw(a, b, group_sizes):
    return a.new_empty((group_sizes.shape[0], a.shape[1], b.shape[1]))


def _setup_context(ctx, inputs, output):
    x, weight, group_sizes, trans_b = inputs
    ctx.trans_b = trans_b
    ctx.save_for_backward(x, weight, group_sizes)


def _backward(ops, ctx, grad_out):
    x, weight, group_sizes = ctx.saved_tensors
    dy = grad_out.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = ops(OP)(dy, weight, group_sizes, not ctx.trans_b)
    if ctx.needs_input_grad[1]:
        dw = ops(DW)(dy, x, group_sizes) if ctx.trans_b else ops(DW)(x, dy, group_sizes)
    return dx, dw, None, None


def _setup_context_dw(ctx, inputs, output):
    a, b, group_sizes = inputs
    ctx.save_for_backward(a, b, group_sizes)


def _backward_dw(ops, ctx, grad_out):
    # out[e] = a_e^T b_e  =>  da_e = b_e dout_e^T,  db_e = a_e dout_e
    a, b, group_sizes = ctx.saved_tensors
    g = grad_out.contiguous()
    da = ops(OP)(b, g, group_sizes, True) if ctx.needs_input_grad[0] else None
    db = ops(OP)(a, g, group_sizes, False) if ctx.needs_input_grad[1] else None
    return da, db, None


_library.define(_library.OpSpec(
    # (x [M,K], weight [E,K,N] (trans_b: [E,N,K]), group_sizes [E] int32/int64, trans_b) -> [M,N]:
    # rows of group e are x[off_e : off_e + group_sizes[e]]; rows past sum(group_sizes) are zero
    OP, "(Tensor x, Tensor weight, Tensor group_sizes, bool trans_b) -> Tensor",
    fake=_fake, check_meta=_contracts.grouped_gemm_meta, check=_contracts.grouped_gemm,
    backward=_backward, setup_context=_setup_context), __name__)
_library.define(_library.OpSpec(
    # (a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q]: out[e] = a_e^T . b_e over the rows of group e
    # (zero for an empty group). The weight gradient of grouped_gemm: (x, dy) for trans_b=False,
    # (dy, x) for trans_b=True.
    DW, "(Tensor a, Tensor b, Tensor group_sizes) -> Tensor",
    fake=_fake_dw, check_meta=_contracts.grouped_gemm_dw_meta, check=_contracts.grouped_gemm_dw,
    backward=_backward_dw, setup_context=_setup_context_dw), __name__)


def grouped_gemm(x: Tensor, weight: Tensor, group_sizes: Tensor, *, trans_b: bool = False) -> Tensor:
    """Grouped matrix product: ``out[rows of e] = x[rows of e] @ weight[e]`` for every expert ``e``.

    Args:
        x: ``[M, K]`` fp32/fp16/bf16 (fp64 too) activations; the rows of expert ``e`` are the
            contiguous block ``[off_e, off_e + group_sizes[e])``, ``off_e = sum(group_sizes[:e])``
            (the layout :func:`moe_permute` produces).
        weight: ``[E, K, N]``, or ``[E, N, K]`` with ``trans_b=True`` (``nn.Linear`` layout);
            same dtype and device as ``x``.
        group_sizes: ``[E]`` int32/int64 rows per expert (``moe_permute(...).group_sizes``), on
            any device. Entries may be zero; ``sum(group_sizes) <= M``.
        trans_b: use ``weight[e].T``.

    Returns:
        ``[M, N]`` in ``x``'s dtype, accumulated in fp32 (fp64 for fp64). Rows past
        ``sum(group_sizes)`` are exactly zero. Differentiable w.r.t. ``x`` and ``weight``
        (``dweight[e]`` is exactly zero for an empty group). No host synchronization on
        accelerators: sizes and values are checked with device-side asserts there.
    """
    for name, t in (("x", x), ("weight", weight), ("group_sizes", group_sizes)):
        checks.check_tensor(name, t)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    return _library.op(OP)(x.contiguous(), weight.contiguous(), group_sizes.contiguous(), trans_b)


def grouped_gemm_dw(a: Tensor, b: Tensor, group_sizes: Tensor) -> Tensor:
    """``out[e] = a_e^T @ b_e`` over the rows of group ``e`` → ``[E, P, Q]`` (zero for empty groups).

    ``a [M, P]`` and ``b [M, Q]`` share the row grouping of :func:`grouped_gemm`; this is its weight
    gradient (``grouped_gemm_dw(x, dy)``, or ``grouped_gemm_dw(dy, x)`` for ``trans_b=True``).
    """
    for name, t in (("a", a), ("b", b), ("group_sizes", group_sizes)):
        checks.check_tensor(name, t)
    return _library.op(DW)(a.contiguous(), b.contiguous(), group_sizes.contiguous())
