"""Converters from ``group_sizes`` (rows per expert, as returned by ``moe_permute``) to the other
group formats in use. All stay on the tensor's device (no host synchronization)."""

from __future__ import annotations

import torch

from .ops import checks as _checks


_INT32_MAX = 2 ** 31 - 1


def group_sizes_to_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative int32 end offsets ``[E]``: the ``offs`` argument of
    ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` for a 2-D x 3-D product.

    The offsets must fit int32 (what ``grouped_mm`` takes): every size is in ``[0, 2**31)`` and
    their sum ``<= 2**31 - 1``, else an error naming ``group_sizes`` instead of offsets that
    wrapped around. A ``ValueError`` for a CPU tensor in eager mode; on an accelerator, and under
    ``torch.compile``, a device-side assert (``RuntimeError``, no host synchronization)."""
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    # sizes bounded one by one first, so the int64 sum of at most 2**32 of them cannot wrap
    ends = torch.cumsum(group_sizes, 0, dtype=torch.int64)
    compiling = torch.compiler.is_compiling()
    if group_sizes.numel() and (compiling or not _checks.is_fake(group_sizes)):
        bad_size = (group_sizes < 0) | (group_sizes > _INT32_MAX)
        if group_sizes.device.type == "cpu" and not compiling:
            if bool(bad_size.any()):
                i = int(torch.nonzero(bad_size)[0, 0])
                raise ValueError(f"group_sizes has value {int(group_sizes[i])} at index {i}, outside "
                                 f"the valid range [0, {_INT32_MAX}]")
            if int(ends[-1]) > _INT32_MAX:
                raise ValueError(f"group_sizes sums to {int(ends[-1])}, more than the int32 offsets "
                                 f"hold ({_INT32_MAX}); grouped_mm's offs are int32")
        else:
            torch._assert_async(~bad_size.any() & (ends[-1] <= _INT32_MAX),
                                "group_sizes: a size outside [0, 2**31 - 1] or a sum over 2**31 - 1 "
                                "(the int32 offsets would wrap)")
    return ends.to(torch.int32)


def group_sizes_to_group_list(group_sizes: torch.Tensor, group_list_type: int = 1) -> torch.Tensor:
    """torch_npu ``npu_grouped_matmul`` ``group_list`` (int64).

    ``group_list_type=0``: cumulative end offsets (cumsum); ``1``: the per-group counts themselves.
    """
    _checks.check_tensor("group_sizes", group_sizes, ndim=1, dtypes=_checks.INDEX_DTYPES)
    _checks.check_int("group_list_type", group_list_type)
    # counts are >= 0 (a negative one would make the cumulative list non-monotone)
    _checks.check_values("group_sizes", group_sizes, lambda g: g < 0, ": sizes must be >= 0", "has a negative size")
    if group_list_type == 0:
        ends = torch.cumsum(group_sizes, 0, dtype=torch.int64)
        # sizes >= 0: an end below the one before it (or below 0) is a sum that wrapped past int64
        _checks.check_values("group_sizes", ends, lambda e: torch.cat([e[:1] < 0, e[1:] < e[:-1]]),
                             ": the cumulative group_list wraps past int64 (sizes sum over 2**63 - 1)",
                             "sums past int64 (the cumulative group_list would wrap)")
        return ends
    if group_list_type == 1:
        return group_sizes.to(torch.int64)
    raise ValueError(f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
