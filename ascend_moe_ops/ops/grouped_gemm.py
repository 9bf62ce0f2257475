"""``grouped_gemm``: one GEMM per expert over contiguous row groups (the MoE expert FFN).

Backward is built from the forward ops (registered at the op level, so every backend gets it):
``dx = grouped_gemm(dy, weight, group_sizes, trans_b=not trans_b)`` and
``dweight[e] = x_e^T dy_e`` (``dy_e^T x_e`` for ``trans_b``) from ``grouped_gemm_dw``.
"""

from __future__ import annotations

import torch

from .. import _backends, _library
from . import _checks

OP = "grouped_gemm"
DW = "grouped_gemm_dw"
Tensor = torch.Tensor

for _op in (OP, DW):
    _backends.register_impl(_op, "reference", "ascend_moe_ops.reference.grouped_gemm", _op)
    _backends.register_impl(_op, "native", "ascend_moe_ops._C", _op)
    _backends.register_impl(_op, "triton", "ascend_moe_ops.triton_ref.grouped_gemm", _op)
    # the AscendC Cube kernels on the CPU emulation layer (fp16/bf16 only; fp32 raises)
    _backends.register_impl(_op, "ascendc-emu", "ascend_moe_ops._ascendc_emu", _op)


def check_group_size_values(group_sizes: Tensor, num_rows: int) -> None:
    """``group_sizes >= 0`` and ``sum(group_sizes) <= num_rows``: a ValueError on the CPU, a
    device-side assert elsewhere (no host synchronization)."""
    if group_sizes.numel() == 0 or _checks.is_fake(group_sizes):
        return
    gs = group_sizes.to(torch.int64)
    if gs.device.type == "cpu":
        neg = torch.nonzero(gs < 0)
        if neg.numel():
            e = int(neg[0, 0])
            raise ValueError(f"group_sizes must be non-negative, got {int(gs[e])} for group {e}")
        total = int(gs.sum())
        if total > num_rows:
            raise ValueError(f"sum(group_sizes) = {total} exceeds the {num_rows} rows of the input")
    else:
        torch._assert_async((gs >= 0).all(), "group_sizes must be non-negative")
        torch._assert_async(gs.sum() <= num_rows, "sum(group_sizes) exceeds the number of input rows")


def _check_values(x, weight, group_sizes, trans_b):
    check_group_size_values(group_sizes, x.shape[0])


def _check_values_dw(a, b, group_sizes):
    check_group_size_values(group_sizes, a.shape[0])


@torch.library.register_fake(f"{_library.NAMESPACE}::{OP}")
def _fake(x, weight, group_sizes, trans_b):
    return x.new_empty((x.shape[0], weight.shape[1] if trans_b else weight.shape[2]))


@torch.library.register_fake(f"{_library.NAMESPACE}::{DW}")
def _fake_dw(a, b, group_sizes):
    return a.new_empty((group_sizes.shape[0], a.shape[1], b.shape[1]))


def _setup_context(ctx, inputs, output):
    x, weight, group_sizes, trans_b = inputs
    ctx.trans_b = trans_b
    ctx.save_for_backward(x, weight, group_sizes)


def _backward(ctx, grad_out):
    x, weight, group_sizes = ctx.saved_tensors
    dy = grad_out.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _library.op(OP)(dy, weight, group_sizes, not ctx.trans_b)
    if ctx.needs_input_grad[1]:
        dw = _library.op(DW)(dy, x, group_sizes) if ctx.trans_b else _library.op(DW)(x, dy, group_sizes)
    return dx, dw, None, None


def _setup_context_dw(ctx, inputs, output):
    a, b, group_sizes = inputs
    ctx.save_for_backward(a, b, group_sizes)


def _backward_dw(ctx, grad_out):
    # out[e] = a_e^T b_e  =>  da_e = b_e dout_e^T,  db_e = a_e dout_e
    a, b, group_sizes = ctx.saved_tensors
    g = grad_out.contiguous()
    da = _library.op(OP)(b, g, group_sizes, True) if ctx.needs_input_grad[0] else None
    db = _library.op(OP)(a, g, group_sizes, False) if ctx.needs_input_grad[1] else None
    return da, db, None


torch.library.register_autograd(f"{_library.NAMESPACE}::{OP}", _backward, setup_context=_setup_context)
torch.library.register_autograd(f"{_library.NAMESPACE}::{DW}", _backward_dw, setup_context=_setup_context_dw)
_library.register_router(OP, check=_check_values)
_library.register_router(DW, check=_check_values_dw)


def _check_group_sizes(group_sizes, num_groups: int) -> None:
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if group_sizes.shape[0] != num_groups:
        raise ValueError(f"group_sizes must have one entry per expert: weight has {num_groups} "
                         f"experts, group_sizes has shape {tuple(group_sizes.shape)}")


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
    _checks.check_tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("weight", weight, ndim=3, dtypes=(x.dtype,), device=x.device)
    _check_group_sizes(group_sizes, weight.shape[0])
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    k_w = weight.shape[2] if trans_b else weight.shape[1]
    if k_w != x.shape[1]:
        layout = "[E, N, K]" if trans_b else "[E, K, N]"
        raise ValueError(f"weight {layout} (trans_b={trans_b}) has K={k_w} but x has K={x.shape[1]} "
                         f"(x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    return _library.op(OP)(x.contiguous(), weight.contiguous(), group_sizes.contiguous(), trans_b)


def grouped_gemm_dw(a: Tensor, b: Tensor, group_sizes: Tensor) -> Tensor:
    """``out[e] = a_e^T @ b_e`` over the rows of group ``e`` → ``[E, P, Q]`` (zero for empty groups).

    ``a [M, P]`` and ``b [M, Q]`` share the row grouping of :func:`grouped_gemm`; this is its weight
    gradient (``grouped_gemm_dw(x, dy)``, or ``grouped_gemm_dw(dy, x)`` for ``trans_b=True``).
    """
    _checks.check_tensor("a", a, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor("b", b, ndim=2, dtypes=(a.dtype,), device=a.device)
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"a and b must have the same rows: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return _library.op(DW)(a.contiguous(), b.contiguous(), group_sizes.contiguous())
