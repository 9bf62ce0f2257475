"""A stand-in for the ``grouped_gemm`` package (the CUDA grouped GEMM Megatron-Core's ``GroupedMLP``
imports), built on :func:`ascend_moe_ops.grouped_gemm`, so ``moe_grouped_gemm=True`` runs on any
device the package supports (CPU included).

Megatron-Core reaches it as ``grouped_gemm_util.ops.gmm(a, b, batch_sizes, trans_b=...)``;
:func:`ascend_moe_ops.integrations.megatron.patch` binds this module there. It can also be used
directly::

    from ascend_moe_ops.integrations import grouped_gemm as gg
    y = gg.ops.gmm(x, w, batch_sizes)            # differentiable
    y = gg.backend.gmm(x, w, batch_sizes)        # no autograd (the raw kernel)
    dw = gg.backend.gmm(x, dy, batch_sizes, trans_a=True)   # [E, K, N] per-group x_e^T dy_e

The contract is the ``grouped_gemm`` package's: ``a [M, K]`` rows grouped by expert in order,
``b [E, K, N]`` (``[E, N, K]`` with ``trans_b``), ``batch_sizes [E]`` integer rows per expert (any
device; the package's CUDA kernel wants it on the CPU). Accumulation is in fp32; rows past
``sum(batch_sizes)`` are zero; an empty expert gets an exactly zero weight gradient.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from ..ops.grouped_gemm import grouped_gemm as _grouped_gemm
from ..ops.grouped_gemm import grouped_gemm_dw as _grouped_gemm_dw

Tensor = torch.Tensor

__all__ = ["ops", "backend", "gmm"]


def _sizes(batch_sizes: Tensor, device: torch.device) -> Tensor:
    if not isinstance(batch_sizes, torch.Tensor):
        raise TypeError(f"batch_sizes must be a torch.Tensor, got {type(batch_sizes).__name__}")
    # the grouped_gemm package takes CPU int64 sizes with device data; so does this stand-in
    return batch_sizes if batch_sizes.device == device else batch_sizes.to(device, non_blocking=True)


def gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_b: bool = False) -> Tensor:
    """``grouped_gemm.ops.gmm``: differentiable grouped GEMM (``out[rows of e] = a_e @ b[e]``)."""
    return _grouped_gemm(a, b, _sizes(batch_sizes, a.device), trans_b=bool(trans_b))


def _backend_gmm(a: Tensor, b: Tensor, batch_sizes: Tensor, trans_a: bool = False,
                 trans_b: bool = False, c: Optional[Tensor] = None) -> Tensor:
    """``grouped_gemm.backend.gmm``: the raw kernel, no autograd. ``trans_a=True`` computes the
    per-group ``a_e^T @ b_e`` (``a [M, K]``, ``b [M, N]`` -> ``[E, K, N]``), the weight gradient.
    ``c``, if given, receives the result (and is returned)."""
    if trans_a and trans_b:
        raise ValueError("trans_a and trans_b cannot both be set (the grouped_gemm package refuses it too)")
    with torch.no_grad():
        sizes = _sizes(batch_sizes, a.device)
        out = _grouped_gemm_dw(a, b, sizes) if trans_a else _grouped_gemm(a, b, sizes, trans_b=bool(trans_b))
    if c is not None:
        if c.shape != out.shape:
            raise ValueError(f"c must have shape {tuple(out.shape)}, got {tuple(c.shape)}")
        c.copy_(out)
        return c
    return out


ops = types.ModuleType(__name__ + ".ops", "grouped_gemm.ops-compatible namespace: gmm(a, b, batch_sizes, trans_b)")
ops.gmm = gmm
backend = types.ModuleType(__name__ + ".backend",
                           "grouped_gemm.backend-compatible namespace: gmm(a, b, batch_sizes, trans_a, trans_b, c)")
backend.gmm = _backend_gmm
