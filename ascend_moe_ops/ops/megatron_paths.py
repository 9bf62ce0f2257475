"""``mask_permute`` and ``sort_chunks``: Megatron-Core's dropless ``permute`` of a ``[T, E]``
routing mask and its ``sort_chunks_by_idxs``, each one native call.

Internal fused kernels of the Megatron-Core adapter (:mod:`ascend_moe_ops.integrations.megatron`),
not public ops: their schemas live in ``_library.INTERNAL_SCHEMAS`` and exist for two namespaces
only, the native C++ kernels (``csrc/cpu/mask_permute.cpp``, cpu) and the pure-PyTorch reference
(``reference/megatron_paths.py``, the spec), which the adapter uses where the native kernels are
not loaded. Both are differentiable (w.r.t. tokens / input and probs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _library
from . import _checks

Tensor = torch.Tensor
PERMUTE, SORT = "mask_permute", "sort_chunks"
NATIVE, REFERENCE = _library.INTERNAL_NAMESPACES


# ---------------------------------------------------------------- checks (fake and reference kernels)
def _check_permute(tokens, routing_map, probs, num_out_tokens):
    op = PERMUTE
    _checks.check_tensor(f"{op}: tokens", tokens, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.check_tensor(f"{op}: routing_map", routing_map, ndim=2, dtypes=(torch.bool,), device=tokens.device)
    if routing_map.shape[0] != tokens.shape[0]:
        raise ValueError(f"{op}: routing_map must have one row per token: tokens has {tokens.shape[0]} rows, "
                         f"routing_map has shape {tuple(routing_map.shape)}")
    if probs is not None:
        _checks.check_tensor(f"{op}: probs", probs, dtypes=_checks.FLOAT_DTYPES, device=tokens.device)
        if probs.shape != routing_map.shape:
            raise ValueError(f"{op}: probs must have shape {tuple(routing_map.shape)} (the shape of routing_map), "
                             f"got {tuple(probs.shape)}")
    if num_out_tokens is not None and num_out_tokens < 0:
        raise ValueError(f"{op}: num_out_tokens must be >= 0, got {num_out_tokens}")


def _check_sort(input, split_sizes, sorted_idxs, probs):
    op = SORT
    _checks.check_tensor(f"{op}: input", input)
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension")
    for name, t in (("split_sizes", split_sizes), ("sorted_idxs", sorted_idxs)):
        _checks.check_tensor(f"{op}: {name}", t, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if sorted_idxs.numel() != split_sizes.numel():
        raise ValueError(f"{op}: sorted_idxs must have one entry per chunk ({split_sizes.numel()}), "
                         f"got {sorted_idxs.numel()}")
    if probs is not None:
        _checks.check_tensor(f"{op}: probs", probs, device=input.device)
        if probs.dim() < 1 or probs.shape[0] != input.shape[0]:
            raise ValueError(f"{op}: probs must have one entry per row of input ({input.shape[0]}), "
                             f"got shape {tuple(probs.shape)}")


# ---------------------------------------------------------------- fake kernels
def _fake_permute(tokens, routing_map, probs, num_out_tokens):
    _check_permute(tokens, routing_map, probs, num_out_tokens)
    T, E = routing_map.shape
    ctx = torch.library.get_ctx()
    N = num_out_tokens if num_out_tokens is not None else ctx.new_dynamic_size()
    S = ctx.new_dynamic_size(max=E) if E > 0 else 0
    out = tokens.new_empty((N, tokens.shape[1]))
    pp = probs.new_empty((N,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    return (out, pp, tokens.new_empty((N,), dtype=torch.int64), tokens.new_empty((T, S), dtype=torch.int32),
            tokens.new_empty((T, S), dtype=torch.int64))


def _fake_sort(input, split_sizes, sorted_idxs, probs, inverse):
    _check_sort(input, split_sizes, sorted_idxs, probs)
    pp = probs.new_empty(probs.shape) if probs is not None else input.new_empty((0,), dtype=torch.float32)
    return input.new_empty(input.shape), pp


# ---------------------------------------------------------------- reference kernels
def _ref_permute(tokens, routing_map, probs, num_out_tokens):
    from ..reference.megatron_paths import mask_permute as f
    _check_permute(tokens, routing_map, probs, num_out_tokens)
    return f(tokens, routing_map, probs, num_out_tokens)


def _ref_sort(input, split_sizes, sorted_idxs, probs, inverse):
    from ..reference.megatron_paths import sort_chunks as f
    _check_sort(input, split_sizes, sorted_idxs, probs)
    return f(input, split_sizes, sorted_idxs, probs, inverse)


# ---------------------------------------------------------------- autograd
def _setup_permute(ctx, inputs, output):
    _, _, probs, _ = inputs
    ctx.probs_meta = None if probs is None else (tuple(probs.shape), probs.dtype, probs.device)
    ctx.save_for_backward(output[3], output[4])
    ctx.mark_non_differentiable(output[2], output[3], output[4])


def probs_grad(grad_pp: Tensor, row_id_map: Tensor, expert_ids: Tensor, shape, dtype, device) -> Tensor:
    """``[T, E]`` gradient of the dense probs from the ``[N]`` gradient of the permuted probs."""
    d = torch.zeros(shape, dtype=dtype, device=device)
    T, S = row_id_map.shape
    if S == 0 or grad_pp.numel() == 0:
        return d
    rows = row_id_map.to(torch.int64)
    empty = rows < 0
    vals = grad_pp.index_select(0, rows.clamp_min(0).view(-1)).view(T, S).masked_fill(empty, 0)
    return d.scatter_add_(1, expert_ids.clamp_min(0), vals)  # -1 slots add an exact 0


def _make_backward_permute(ns):
    unpermute = _library.op("moe_unpermute", ns)

    def backward(ctx, grad_out, grad_pp, *_):
        row_id_map, expert_ids = ctx.saved_tensors
        d_tokens = d_probs = None
        if ctx.needs_input_grad[0] and grad_out is not None:
            if ns == REFERENCE:
                from .. import _backends
                _backends.load("reference")  # its kernels are registered on first use
            d_tokens = unpermute(grad_out.contiguous(), row_id_map, None)  # permute's adjoint
        if ctx.probs_meta is not None and ctx.needs_input_grad[2] and grad_pp is not None:
            d_probs = probs_grad(grad_pp, row_id_map, expert_ids, *ctx.probs_meta)
        return d_tokens, None, d_probs, None
    return backward


def _setup_sort(ctx, inputs, output):
    _, split_sizes, sorted_idxs, probs, inverse = inputs
    ctx.has_probs, ctx.inverse = probs is not None, inverse
    ctx.save_for_backward(split_sizes, sorted_idxs)


def _make_backward_sort(ns):
    def backward(ctx, grad, grad_probs):
        split_sizes, sorted_idxs = ctx.saved_tensors
        want_probs = ctx.has_probs and ctx.needs_input_grad[3] and grad_probs is not None
        gi, gp = getattr(torch.ops, ns).sort_chunks.default(
            grad.contiguous(), split_sizes, sorted_idxs, grad_probs.contiguous() if want_probs else None,
            not ctx.inverse)
        return (gi if ctx.needs_input_grad[0] else None), None, None, (gp if want_probs else None), None
    return backward


for _ns in _library.INTERNAL_NAMESPACES:
    _lib = _library.LIBS[_ns]
    torch.library.register_fake(f"{_ns}::{PERMUTE}", _fake_permute, lib=_lib)
    torch.library.register_fake(f"{_ns}::{SORT}", _fake_sort, lib=_lib)
    torch.library.register_autograd(f"{_ns}::{PERMUTE}", _make_backward_permute(_ns), setup_context=_setup_permute,
                                    lib=_lib)
    torch.library.register_autograd(f"{_ns}::{SORT}", _make_backward_sort(_ns), setup_context=_setup_sort, lib=_lib)
for _key in ("CPU", "CUDA"):
    _library.LIBS[REFERENCE].impl(PERMUTE, _ref_permute, _key)
    _library.LIBS[REFERENCE].impl(SORT, _ref_sort, _key)


#: whether the native kernels of these ops are registered (the C++ extension is loaded)
native_loaded = _library.internal_native_loaded
#: the namespace the ops run in for a tensor: native on cpu when loaded, else reference
namespace_for = _library.internal_namespace_for


def mask_permute(tokens: Tensor, routing_map: Tensor, probs: Optional[Tensor] = None,
                 num_out_tokens: Optional[int] = None):
    """Megatron-Core's dropless permute of a ``[T, E]`` bool mask: ``(permuted_tokens [N, H],
    permuted_probs [N] ([0] without probs), sorted_indices [N] int64, row_id_map [T, S] int32,
    expert_ids [T, S] int64)``; spec: :mod:`ascend_moe_ops.reference.megatron_paths`."""
    return getattr(torch.ops, namespace_for(tokens)).mask_permute.default(tokens, routing_map, probs, num_out_tokens)


def sort_chunks(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor, probs: Optional[Tensor] = None,
                inverse: bool = False):
    """Megatron-Core's ``sort_chunks_by_idxs`` (``inverse=True``: its inverse): ``(output,
    permuted probs ([0] without probs))``; spec: :mod:`ascend_moe_ops.reference.megatron_paths`."""
    return getattr(torch.ops, namespace_for(input)).sort_chunks.default(input, split_sizes, sorted_idxs, probs,
                                                                        inverse)
