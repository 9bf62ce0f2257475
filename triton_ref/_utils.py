"""Launch helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import os

import torch
import triton


def interpreted(t: torch.Tensor) -> bool:
    """True when kernels on ``t`` run in Triton's CPU interpreter (block sizes are then chosen to
    launch few programs: the interpreter's cost is per program and per op, not per element)."""
    return t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` unless the grid is empty (T = 0, H = 0, ...): Triton rejects empty grids."""
    if all(g > 0 for g in grid):
        kernel[grid](*args, **kwargs)


def block_h(H: int, t: torch.Tensor) -> int:
    """Columns per program. 1024 on both: on a GPU that is 8 bf16 (16 B) per thread with 4 warps;
    in the interpreter it makes one program per row for the test shapes (H <= 768)."""
    return max(16, min(triton.next_power_of_2(max(H, 1)), 1024))


def acc_dtype(dtype: torch.dtype):
    """Accumulation type: fp32 for fp32/fp16/bf16, fp64 for fp64 inputs."""
    import triton.language as tl
    return tl.float64 if dtype == torch.float64 else tl.float32
