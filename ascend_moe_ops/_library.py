"""The one registration point: every schema of ``torch.ops.ascend_moe_ops`` is defined here.

Native code never defines a schema; it only adds implementations:

* ``csrc/cpu`` (extension ``ascend_moe_ops._C``) and ``triton_ref/`` provide plain functions with
  the op's signature, which the CPU/CUDA router below calls (see ``_backends.py``);
* ``csrc/ascend`` registers ``TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m)`` on an Ascend
  build.

The op modules in ``ascend_moe_ops/ops`` hold the public wrappers, argument checks, fake (meta)
implementations and autograd formulas for these schemas.

Conventions: an ``int`` argument documented as "-1 = not given" stands for ``None`` in Python;
index outputs are int32 (row maps) or int64 (counts).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _backends

NAMESPACE = "ascend_moe_ops"
_lib = torch.library.Library(NAMESPACE, "DEF")

SCHEMAS = {
    # moe_permute(tokens [T,H], routing [T,K] int ids (-1 = empty) | [T,E] bool, probs same shape
    # as routing or None, num_experts, capacity (-1 = dropless), align (>=1), num_out_tokens
    # (-1 = static bound)) -> (permuted_tokens [N,H], permuted_probs [N] (shape [0] without probs),
    # row_id_map [T,K] int32 (-1 = not kept), tokens_per_expert [E] int64, group_sizes [E] int64)
    "moe_permute": "moe_permute(Tensor tokens, Tensor routing, Tensor? probs, int num_experts, "
                   "int capacity, int align, int num_out_tokens) "
                   "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    # moe_unpermute(permuted [N,H], row_id_map [T,K] int32/int64, probs [T,K] or None) -> [T,H]
    "moe_unpermute": "moe_unpermute(Tensor permuted, Tensor row_id_map, Tensor? probs) -> Tensor",
    # backward of moe_unpermute: (grad_permuted [N,H], grad_probs [T,K] (shape [0] without probs))
    "moe_unpermute_backward": "moe_unpermute_backward(Tensor grad_out, Tensor permuted, "
                              "Tensor row_id_map, Tensor? probs) -> (Tensor, Tensor)",
    # grouped_gemm(x [M,K], weight [E,K,N] (trans_b: [E,N,K]), group_sizes [E] int32/int64,
    # trans_b) -> [M,N]: rows of group e are x[off_e : off_e + group_sizes[e]]; rows past
    # sum(group_sizes) are zero
    "grouped_gemm": "grouped_gemm(Tensor x, Tensor weight, Tensor group_sizes, bool trans_b) -> Tensor",
    # grouped_gemm_dw(a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q]: out[e] = a_e^T . b_e over the
    # rows of group e (zero for an empty group). The weight gradient of grouped_gemm: (x, dy) for
    # trans_b=False, (dy, x) for trans_b=True.
    "grouped_gemm_dw": "grouped_gemm_dw(Tensor a, Tensor b, Tensor group_sizes) -> Tensor",
}

for _schema in SCHEMAS.values():
    _lib.define(_schema)


def op(name: str):
    """``torch.ops.ascend_moe_ops.<name>`` (default overload)."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _first_tensor_device(args) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def register_router(name: str, check: Optional[Callable] = None) -> None:
    """Register the CPU/CUDA kernel of op ``name``: optional value checks on the real inputs (the
    fake implementation never runs them), then the implementation chosen by ``_backends``."""

    def kernel(*args):
        if check is not None:
            check(*args)
        _, impl = _backends.resolve(name, _first_tensor_device(args))
        return impl(*args)

    kernel.__name__ = f"{name}_router"
    _lib.impl(name, kernel, "CPU")
    _lib.impl(name, kernel, "CUDA")
