"""Converters from ``group_sizes`` (rows per expert, as returned by ``moe_permute``) to the other
group formats in use. All stay on the tensor's device (no host synchronization)."""

from __future__ import annotations

import torch

from .ops import checks as _checks


def group_sizes_to_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative int32 end offsets ``[E]``: the ``offs`` argument of
    ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` for a 2-D x 3-D product."""
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    return torch.cumsum(group_sizes, 0, dtype=torch.int32)


def group_sizes_to_group_list(group_sizes: torch.Tensor, group_list_type: int = 1) -> torch.Tensor:
    """torch_npu ``npu_grouped_matmul`` ``group_list`` (int64).

    ``group_list_type=0``: cumulative end offsets (cumsum); ``1``: the per-group counts themselves.
    """
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    if group_list_type == 0:
        return torch.cumsum(group_sizes, 0, dtype=torch.int64)
    if group_list_type == 1:
        return group_sizes.to(torch.int64)
    raise ValueError(f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
