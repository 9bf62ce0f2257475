"""``mask_permute`` and ``sort_chunks``: Megatron-Core's dropless ``permute`` of a ``[T, E]``
routing mask and its ``sort_chunks_by_idxs``, each one native call.

Internal fused kernels of the Megatron-Core adapter (:mod:`ascend_moe_ops.integrations.megatron`),
not public ops: their specs are ``public=False`` and only two backends implement them, the native
C++ kernels (``csrc/cpu/mask_permute.cpp``, cpu) and the pure-PyTorch reference
(``reference/megatron_paths.py``, the spec). :func:`mask_permute` and :func:`sort_chunks` call
``torch.ops.ascend_moe_ops.<op>``, bound once at import like every op (native on cpu when the
extension is built, the reference everywhere else). Both are differentiable (w.r.t. tokens / input
and probs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _backends, _library
from . import checks as _checks

Tensor = torch.Tensor
PERMUTE, SORT = "mask_permute", "sort_chunks"
BACKENDS = (_library.NATIVE.name, _library.REFERENCE.name)
NATIVE, REFERENCE = (_library.BACKENDS[b].namespace for b in BACKENDS)


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


def _check_sort(input, split_sizes, sorted_idxs, probs, inverse=False):
    op = SORT
    _checks.check_tensor(f"{op}: input", input)
    if input.dim() < 1:
        raise ValueError(f"{op}: input must have at least one dimension")
    for name, t in (("split_sizes", split_sizes), ("sorted_idxs", sorted_idxs)):
        _checks.check_tensor(f"{op}: {name}", t, ndim=1, dtypes=_checks.INDEX_DTYPES)
        if t.device != input.device and t.device.type != "cpu":  # read on the host: never meta next to data
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device} ({name} may live "
                             "on input's device or the cpu)")
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
    T, E = routing_map.shape
    ctx = torch.library.get_ctx()
    N = num_out_tokens if num_out_tokens is not None else ctx.new_dynamic_size()
    # S (most experts of one token) is data-dependent, at most E; new_dynamic_size takes only a
    # static bound, so under dynamic shapes (E symbolic) S gets none
    S = (ctx.new_dynamic_size(max=E) if E > 0 else 0) if isinstance(E, int) else ctx.new_dynamic_size()
    out = tokens.new_empty((N, tokens.shape[1]))
    pp = probs.new_empty((N,)) if probs is not None else tokens.new_empty((0,), dtype=torch.float32)
    return (out, pp, tokens.new_empty((N,), dtype=torch.int64), tokens.new_empty((T, S), dtype=torch.int32),
            tokens.new_empty((T, S), dtype=torch.int64))


def _fake_sort(input, split_sizes, sorted_idxs, probs, inverse):
    pp = probs.new_empty(probs.shape) if probs is not None else input.new_empty((0,), dtype=torch.float32)
    return input.new_empty(input.shape), pp


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
    # no branch on the sizes (S and N are data-dependent under torch.compile): a leading zero
    # makes row -1 (an empty slot) read an exact 0, and empty maps or gradients are empty ops;
    # reshape: the saved maps may be non-contiguous (a direct call of a namespace's op)
    padded = torch.cat([grad_pp.new_zeros(1), grad_pp.reshape(-1)])
    vals = padded.index_select(0, (row_id_map.to(torch.int64) + 1).clamp_min(0).reshape(-1)).view(T, S)
    return d.scatter_add_(1, expert_ids.clamp_min(0), vals.to(dtype))  # -1 slots add an exact 0


def _backward_permute(ops, ctx, grad_out, grad_pp, *_):
    row_id_map, expert_ids = ctx.saved_tensors
    d_tokens = d_probs = None
    if ctx.needs_input_grad[0] and grad_out is not None:
        d_tokens = ops("moe_unpermute")(grad_out.contiguous(), row_id_map, None)  # permute's adjoint
    if ctx.probs_meta is not None and ctx.needs_input_grad[2] and grad_pp is not None:
        d_probs = probs_grad(grad_pp, row_id_map, expert_ids, *ctx.probs_meta)
    return d_tokens, None, d_probs, None


def _setup_sort(ctx, inputs, output):
    _, split_sizes, sorted_idxs, probs, inverse = inputs
    ctx.has_probs, ctx.inverse = probs is not None, inverse
    ctx.save_for_backward(split_sizes, sorted_idxs)


def _backward_sort(ops, ctx, grad, grad_probs):
    split_sizes, sorted_idxs = ctx.saved_tensors
    want_probs = ctx.has_probs and ctx.needs_input_grad[3] and grad_probs is not None
    gi, gp = ops(SORT)(grad.contiguous(), split_sizes, sorted_idxs, grad_probs.contiguous() if want_probs else None,
                       not ctx.inverse)
    return (gi if ctx.needs_input_grad[0] else None), None, None, (gp if want_probs else None), None


_library.define(_library.OpSpec(
    # (tokens [T,H], routing_map [T,E] bool, probs [T,E] or None, num_out_tokens (None, or the routed
    # count N)) -> (permuted_tokens [N,H], permuted_probs [N] (shape [0] without probs),
    # sorted_indices [N] int64, row_id_map [T,S] int32, expert_ids [T,S] int64 (S = most experts of a
    # token, -1 padded)): Megatron-Core's dropless permute (reference/megatron_paths.py)
    PERMUTE, "(Tensor tokens, Tensor routing_map, Tensor? probs, int? num_out_tokens) "
             "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_permute, check=_check_permute, backward=_backward_permute, setup_context=_setup_permute,
    public=False, backends=BACKENDS), __name__)
_library.define(_library.OpSpec(
    # (input [N,...], split_sizes [C], sorted_idxs [C] (a permutation), probs [N,...] or None, inverse)
    # -> (output [N,...], permuted probs (shape [0] without probs)): Megatron-Core's
    # sort_chunks_by_idxs; inverse=True undoes it
    SORT, "(Tensor input, Tensor split_sizes, Tensor sorted_idxs, Tensor? probs, bool inverse) -> (Tensor, Tensor)",
    fake=_fake_sort, check=_check_sort, backward=_backward_sort, setup_context=_setup_sort,
    public=False, backends=BACKENDS), __name__)


def native_loaded() -> bool:
    """Whether the native kernels of these ops are registered (the C++ extension is loaded)."""
    return _library.NATIVE.name in _backends.available_backends(PERMUTE)


def namespace_for(t: Tensor) -> str:
    """The namespace whose kernels the ops run for a tensor on ``t``'s device now (the binding is
    made once, at import; this only reports it)."""
    return _library.BACKENDS[_backends.active_backend(PERMUTE, t.device)].namespace


def mask_permute(tokens: Tensor, routing_map: Tensor, probs: Optional[Tensor] = None,
                 num_out_tokens: Optional[int] = None):
    """Megatron-Core's dropless permute of a ``[T, E]`` bool mask: ``(permuted_tokens [N, H],
    permuted_probs [N] ([0] without probs), sorted_indices [N] int64, row_id_map [T, S] int32,
    expert_ids [T, S] int64)``; spec: :mod:`ascend_moe_ops.reference.megatron_paths`."""
    return _library.op(PERMUTE)(tokens, routing_map, probs, num_out_tokens)


def sort_chunks(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor, probs: Optional[Tensor] = None,
                inverse: bool = False):
    """Megatron-Core's ``sort_chunks_by_idxs`` (``inverse=True``: its inverse): ``(output,
    permuted probs ([0] without probs))``; spec: :mod:`ascend_moe_ops.reference.megatron_paths`."""
    return _library.op(SORT)(input, split_sizes, sorted_idxs, probs, inverse)
