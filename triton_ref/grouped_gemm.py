"""Triton kernels of ``grouped_gemm`` and ``grouped_gemm_dw`` (contract: ascend_moe_ops/reference/grouped_gemm.py).

Forward: one *persistent* kernel. ``NUM_PROGS`` programs walk a single list of work items
``(group, M-tile, N-tile)`` with stride ``NUM_PROGS``; the list is never materialized: every
program scans the group sizes on the device and skips the groups its next item is not in, so the
host never learns the sizes (no synchronization) and large and tiny groups share the programs
evenly. After the last group comes one pseudo-group for the rows past ``sum(group_sizes)``, whose
tiles store zeros, so every output element is written exactly once (no separate memset).

Weight gradient: one program per ``(group, P-tile, Q-tile)`` (a static grid: ``E`` is a shape);
it reduces over the group's rows, whose offset comes from a device-side cumsum. An empty group
reduces over nothing and stores exact zeros.

fp32/fp16/bf16 inputs, fp32 accumulation (``tl.dot`` with IEEE fp32 precision for fp32 inputs),
output in the input dtype. On CPU this runs under ``TRITON_INTERPRET=1`` (tests: fp32 and fp16
only, the interpreter's bf16 ``tl.dot`` is wrong, so there bf16 inputs run as fp32 copies and the
result is rounded to bf16 once).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._utils import bf16_dot_in_interpreter, to_fp32


@triton.jit
def _grouped_gemm_kernel(x_ptr, w_ptr, out_ptr, gs_ptr, M, N, K, E,
                         stride_xm, stride_we, stride_wk, stride_wn, stride_om,
                         NUM_PROGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    tile = pid.to(tl.int64)
    first_tile = tile * 0   # global index of the current group's first item
    start = tile * 0        # first row of the current group
    for e in range(0, E + 1):
        is_tail = e == E    # pseudo-group: rows past sum(group_sizes) -> zeros
        size = tl.load(gs_ptr + e, mask=e < E, other=0).to(tl.int64)
        size = tl.where(is_tail, M - start, size)
        g_tiles = tl.cdiv(size, BLOCK_M) * n_tiles
        while tile < first_tile + g_tiles:
            local = tile - first_tile
            mt = local // n_tiles
            nt = local % n_tiles
            rows = start + mt * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = nt * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < start + size
            cmask = cols < N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if not is_tail:
                w_base = w_ptr + (start * 0 + e) * stride_we  # int64 offset
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    kmask = ks < K
                    a = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                                mask=rmask[:, None] & kmask[None, :], other=0.0)
                    b = tl.load(w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                                mask=kmask[:, None] & cmask[None, :], other=0.0)
                    if IEEE:
                        acc += tl.dot(a, b, input_precision="ieee")
                    else:
                        acc += tl.dot(a, b)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                     acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])
            tile += NUM_PROGS
        first_tile += g_tiles
        start += size


@triton.jit
def _grouped_gemm_dw_kernel(a_ptr, b_ptr, out_ptr, gs_ptr, offs_ptr, P, Q,
                            stride_am, stride_bm,
                            BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                            IEEE: tl.constexpr):
    pid = tl.program_id(0)
    tiles_p = tl.cdiv(P, BLOCK_P)
    tiles_q = tl.cdiv(Q, BLOCK_Q)
    e = pid // (tiles_p * tiles_q)
    r = pid % (tiles_p * tiles_q)
    pt = r // tiles_q
    qt = r % tiles_q
    size = tl.load(gs_ptr + e).to(tl.int64)
    start = tl.load(offs_ptr + e).to(tl.int64)
    ps = pt * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = qt * BLOCK_Q + tl.arange(0, BLOCK_Q)
    pmask = ps < P
    qmask = qs < Q
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    for m0 in range(0, size, BLOCK_M):
        ms = m0 + tl.arange(0, BLOCK_M)
        mmask = ms < size
        rows = start + ms
        at = tl.load(a_ptr + rows[None, :] * stride_am + ps[:, None],
                     mask=pmask[:, None] & mmask[None, :], other=0.0)   # [BLOCK_P, BLOCK_M] = a_e^T
        bt = tl.load(b_ptr + rows[:, None] * stride_bm + qs[None, :],
                     mask=mmask[:, None] & qmask[None, :], other=0.0)   # [BLOCK_M, BLOCK_Q]
        if IEEE:
            acc += tl.dot(at, bt, input_precision="ieee")
        else:
            acc += tl.dot(at, bt)
    out = out_ptr + e.to(tl.int64) * P * Q + ps[:, None] * Q + qs[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & qmask[None, :])


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _on_amd() -> bool:
    """A ROCm build of torch (AMD GPU): tiles sized for 64 KiB of LDS."""
    return getattr(torch.version, "hip", None) is not None


def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs still exercise the persistent schedule


def gemm_config(dtype: torch.dtype) -> dict:
    """Tile sizes (and on a GPU, warps and pipeline stages) of the forward / dX kernel.

    GPU: the best of ``bench/gpu_tune_grouped_gemm.py``'s sweep on one H200 (2026-12-04, bf16,
    pangu shapes; docs/benchmarks-history.md): 128 x 256 x 64, 8 warps, 3 stages took 0.33 / 0.26 ms
    (fwd balanced / Zipf) and 0.38 / 0.25 ms (dX) where the earlier 64 x 128 x 32, 4 warps took
    0.44 / 0.48 and 0.53 / 0.46 ms; the fine-grained shape moved within +-6 %.
    AMD GPUs keep the earlier 64 x 128 x 32 tile (Triton's default warps and stages), fp32
    inputs take 64 x 64 x 32: the compile check (``aot_check``) finds the 128 x 256 x 64 tile needs
    96 KiB of LDS on MI300 (limit 64 KiB) and, in fp32, 192 KiB of shared memory (over an A100's
    163 KiB); in fp32 even 64 x 128 x 32 spilled (32 B on sm_90, 552 B on sm_80)."""
    if _interpreted():
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
    if _on_amd():
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)


def dw_config(dtype: torch.dtype) -> dict:
    """Tile sizes of the weight-gradient kernel (``BLOCK_P x BLOCK_Q`` outputs, ``BLOCK_M`` rows a step).

    GPU: 128 x 128 x 64, 4 warps, 3 stages, the best of the same H200 sweep: 0.30 / 0.31 / 0.20 ms
    (balanced / Zipf / fine) where 64 x 64 x 64 took 0.65 / 0.38 / 0.21 ms; fp32 and AMD keep
    64 x 64 x 64."""
    if _interpreted():
        return dict(BLOCK_P=32, BLOCK_Q=32, BLOCK_M=32)
    if dtype == torch.float32 or _on_amd():
        return dict(BLOCK_P=64, BLOCK_Q=64, BLOCK_M=64)
    return dict(BLOCK_P=128, BLOCK_Q=128, BLOCK_M=64, num_warps=4, num_stages=3)


def _check_dtype(t: torch.Tensor, op: str, name: str) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{op}: {name} must have dtype in (float32, float16, bfloat16) on the triton backend "
                        f"(tl.dot has no float64), got {str(t.dtype).replace('torch.', '')}; float64 runs on the "
                        "native and reference backends")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, trans_b: bool) -> torch.Tensor:
    _check_dtype(x, "grouped_gemm", "x")
    if bf16_dot_in_interpreter(x):
        return grouped_gemm(*to_fp32(x, weight), group_sizes, trans_b).to(x.dtype)
    x = x.contiguous()
    weight = weight.contiguous()
    M, K = x.shape
    E = weight.shape[0]
    N = weight.shape[1] if trans_b else weight.shape[2]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    gs = group_sizes.to(device=x.device, dtype=torch.int64).contiguous()  # the kernel reads gs[e] at gs_ptr + e
    # B(k, n) = weight[e, k, n] (trans_b=False) or weight[e, n, k] (trans_b=True)
    s_k, s_n = (weight.stride(2), weight.stride(1)) if trans_b else (weight.stride(1), weight.stride(2))
    cfg = gemm_config(x.dtype)
    _grouped_gemm_kernel[(_num_programs(x.device),)](
        x, weight, out, gs, M, N, K, E, x.stride(0), weight.stride(0), s_k, s_n, out.stride(0),
        NUM_PROGS=_num_programs(x.device), IEEE=x.dtype == torch.float32, **cfg)
    return out


def grouped_gemm_dw(a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    _check_dtype(a, "grouped_gemm_dw", "a")
    if bf16_dot_in_interpreter(a):
        return grouped_gemm_dw(*to_fp32(a, b), group_sizes).to(a.dtype)
    a = a.contiguous()
    b = b.contiguous()
    P, Q = a.shape[1], b.shape[1]
    E = group_sizes.shape[0]
    out = torch.empty((E, P, Q), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    gs = group_sizes.to(device=a.device, dtype=torch.int64).contiguous()
    offs = torch.cumsum(gs, 0) - gs
    cfg = dw_config(a.dtype)
    grid = (E * triton.cdiv(P, cfg["BLOCK_P"]) * triton.cdiv(Q, cfg["BLOCK_Q"]),)
    _grouped_gemm_dw_kernel[grid](a, b, out, gs, offs, P, Q, a.stride(0), b.stride(0),
                                  IEEE=a.dtype == torch.float32, **cfg)
    return out
