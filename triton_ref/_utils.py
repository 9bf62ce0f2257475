"""Launch helpers shared by the Triton kernels of this package."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreted(t: torch.Tensor) -> bool:
    """True when kernels on ``t`` run in Triton's CPU interpreter (block sizes are then chosen to
    launch few programs: the interpreter's cost is per program and per op, not per element)."""
    return t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` unless the grid is empty (T = 0, H = 0, ...): Triton rejects empty grids."""
    if all(g > 0 for g in grid):
        kernel[grid](*args, **kwargs)


def block_h(H: int, t: torch.Tensor) -> int:
    """Columns per program of the row-block kernels (zeroing): up to 1024 (on a GPU, 8 bf16 = 16 B per
    thread with 4 warps; in the interpreter, one column block for the test shapes, H <= 768)."""
    return max(16, min(triton.next_power_of_2(max(H, 1)), 1024))


def token_tile(H: int, t: torch.Tensor):
    """``(BLOCK_T, BLOCK_H)`` tile of the per-token kernels. GPU: 2 x 512 (1024 elements, 16 B per
    thread for bf16 with 4 warps; each token's piece is a contiguous 1 KiB bf16 run). Interpreter:
    up to 64 tokens x 1024 columns, so a test shape runs as one or a few programs (the
    interpreter's cost is Python overhead per op and program, a fraction of a millisecond here,
    nearly independent of the tile size: one token per program made the T=48, H=768 unpermute
    about 10x slower)."""
    if interpreted(t):
        return 64, max(16, min(triton.next_power_of_2(max(H, 1)), 1024))
    return 2, max(16, min(triton.next_power_of_2(max(H, 1)), 512))


def bf16_dot_in_interpreter(t: torch.Tensor) -> bool:
    """True when ``tl.dot`` on ``t`` would multiply bf16 tiles in the interpreter, which gives wrong
    products there (triton 3.9: results off by orders of magnitude). The ``tl.dot`` wrappers then
    run the kernel on fp32 copies of the bf16 values (exact) and round the result to bf16 once, the
    reference's rule (fp32 accumulation, one rounding); on a GPU the bf16 kernel runs as is."""
    return t.dtype == torch.bfloat16 and interpreted(t)


def to_fp32(*ts):
    """fp32 copies of the given tensors (``None`` stays ``None``)."""
    return tuple(None if t is None else t.float() for t in ts)


def acc_dtype(dtype: torch.dtype):
    """Accumulation type: fp32 for fp32/fp16/bf16, fp64 for fp64 inputs."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def rtne_bf16_workaround(out_dtype: torch.dtype, t: torch.Tensor) -> bool:
    """True when fp32 -> bf16 casts must be rounded by hand (:func:`cast_out`): triton 3.9's
    interpreter truncates fp32 -> bf16 (round toward zero; its ``"rtne"`` mode rounds ties up and
    can drop the carry into the exponent), whereas GPUs and PyTorch round to nearest even."""
    return out_dtype == torch.bfloat16 and interpreted(t)


@triton.jit
def cast_out(x, out_ty: tl.constexpr, RTNE_BF16: tl.constexpr):
    """``x.to(out_ty)``; with ``RTNE_BF16`` (out_ty is bf16, interpreter) an exact integer
    round-to-nearest-even of fp32 ``x`` to bf16, the rounding PyTorch and GPUs use."""
    if RTNE_BF16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        hi = tl.where(x != x, 0x7FC0, hi)  # NaN stays NaN
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ty)
