"""AscendC flash attention, forward and backward (csrc/ascend/tiling/flash_attention_tiling.*): tiling
checked through a C++ driver -- every (query row, head) covered exactly once across the cores, the
causal key range of each query block, L1/L0A/L0B/L0C/UB budgets with double buffering, 16 x 16 fractal
alignment, blockDim <= the AIC count; for the backward's two passes, every gradient row written by
exactly one block and each item's blocks tiling exactly the rows it must visit -- for the MLA shape
(128 nope + 64 shared rope / 128), plain equal dims and odd varlen batches. Then parity of the
emulated kernels (ascendc-emu backend) with the fp64 reference, forward and backward; the fused
mixed kernels against the phase kernels; the emulator's cross-core flag rules."""

import math
import os
import re

import pytest
import torch

import ascend_moe_ops as amo
from _ascend_cxx import assert_emu_error, driver as _driver, driver_fixture, rule_cases, run_case, run_json_lines
from ascend_moe_ops import _backends
from ascend_moe_ops.reference import flash_attention as ref
from ascend_moe_ops.testing import assert_close_to_ref, torch_attention_grads

F32, F16, BF16 = 0, 1, 2
L1, L0A, L0B, L0C = 512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024
UB_BUDGET = 196608 - 8192


@pytest.fixture(scope="module")
def driver():
    exe = _driver("flash_attention_tiling_driver", flags=("-O2",), tilings=("flash_attention_tiling",))

    def run(cases, bwd=False):
        """cases: (H, Dk, Dr, Dv, causal, dtype, cap, aic, cu_q[, cu_k]) (cu_k = cu_q when absent)."""
        lines = []
        for H, Dk, Dr, Dv, causal, dt, cap, aic, cu, *cuk in cases:
            vals = (H, Dk, Dr, Dv, int(causal), dt, cap, aic, len(cu) - 1, *cu, *(cuk[0] if cuk else ()))
            lines.append(" ".join(str(v) for v in vals))
        return run_json_lines(exe, lines, ["bwd"] if bwd else [])

    return run


def cu_of(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


# (name, H, Dk, Dr, Dv, sequence lengths)
SHAPES = [
    ("mla_192_128", 16, 128, 64, 128, [4096]),
    ("mla_varlen", 8, 128, 64, 128, [1, 17, 300, 1000, 0, 129]),
    ("plain_128", 8, 128, 0, 128, [2048, 2048]),
    ("plain_64", 4, 64, 0, 64, [5, 130, 77]),
    ("odd_dims", 3, 40, 24, 56, [33, 1, 64]),
    ("single_row", 1, 16, 0, 16, [1]),
]


def work(n):
    """ReduceMax work buffer bytes: ceil(2 * repeats / 8) * 8 floats (A2, no index), repeats = ceil(n / 64)."""
    return (2 * ((n + 63) // 64) + 7) // 8 * 8 * 4


FUSED_SLOTS = 4  # kFlashAttentionFusedSlots: GM slots per workspace and AI Core of the fused kernels


def fuse_extras(base, dbl):
    """The fused kernels' UB plan: the base, then the double buffers (bit 0) if they fit the budget;
    returns (bytes, fusedPipe). (No causal mask triangle since 2026-12-07: an added -inf mask turned a
    NaN or +inf score of a masked key into NaN.)"""
    if base + dbl > UB_BUDGET:
        return base, 0
    return base + dbl, 1


def check_budgets(t, Dk, Dr, Dv, causal):
    M, N, R = t["baseM"], t["baseN"], t["vecRows"]
    assert M % 16 == 0 and N % 16 == 0 and M > 0 and N > 0, "16 x 16 fractal alignment"
    assert t["l1Buffers"] >= 2 and t["l0Buffers"] >= 2 and t["ubBuffers"] >= 2, "double buffering"
    u16 = lambda x: (x + 15) // 16 * 16
    u8 = lambda x: (x + 7) // 8 * 8
    dk, dr, dv = u16(Dk), (u16(Dr) if Dr else 0), u16(Dv)
    l1 = M * (dk + dr) * 2 + t["l1Buffers"] * (N * (dk + dr + dv) * 2 + M * N * 2)
    # Q . K^T in column chunks of qkChunk (a multiple of 16, never below 64 or the other L0 operands)
    dq = min(dk, t["qkChunk"]) if t["qkChunk"] else dk
    assert dq % 16 == 0 and (dq == dk or dq >= max(64, dr, dv, N))
    l0a = t["l0Buffers"] * M * max(dq, dr, N) * 2
    l0b = t["l0Buffers"] * N * max(dq, dr, dv) * 2
    l0c = t["l0cBuffers"] * M * max(N, dv) * 4
    ub = t["ubBuffers"] * R * N * 4 + R * N * 2 + 2 * R * u8(Dv) * 4 + 3 * u8(R) * 4 + work(N) + 32
    assert (t["l1Bytes"], t["l0aBytes"], t["l0bBytes"], t["l0cBytes"], t["ubBytes"]) == (l1, l0a, l0b, l0c, ub)
    assert l1 <= L1 and l0a <= L0A and l0b <= L0B and l0c <= L0C and ub <= UB_BUDGET
    assert R == math.ceil(M / 2), "two AIVs per AIC split the query block"
    # fused kernel, per AIV, tile-wise: S tile, P tile, O and O_partial tiles, output tile (row stride
    # u8(Dv) when that is whole 32-byte blocks in bf16/fp16, else u16(Dv)), per-row broadcast blocks,
    # 12 state vectors (alpha of 2 blocks, m and l of 2 items in flight, 6 scratch), EmptyRow's 8 fp32
    # and output row
    ostride = u8(Dv) if u8(Dv) * 2 % 32 == 0 else u16(Dv)
    fused = R * N * 4 + R * N * 2 + 2 * R * u8(Dv) * 4 + R * ostride * 2 + u8(R) * 8 * 4 + 12 * u8(R) * 4 + 32 + \
        u16(Dv) * 2
    # AIV pipeline extras where they fit the UB the base plan leaves: a second S and P tile, and with
    # FUSED_SLOTS blocks in flight, 2 more alphas and the m, l of 2 more items (6 state vectors)
    fused, pipe = fuse_extras(fused, R * N * 4 + R * N * 2 + 3 * (FUSED_SLOTS - 2) * u8(R) * 4)
    assert t["ubFusedBytes"] == fused and fused <= UB_BUDGET and t["fusedPipe"] == pipe
    assert 1 <= t["vecBlockDim"] <= 2 * t["blockDim"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [0, 32])
def test_every_query_row_exactly_once(driver, causal, cap):
    cases = [(H, Dk, Dr, Dv, causal, F16, cap, 24, cu_of(lens)) for _, H, Dk, Dr, Dv, lens in SHAPES]
    for (name, H, Dk, Dr, Dv, lens), r in zip(SHAPES, driver(cases)):
        assert r["ok"], (name, r)
        assert r["coverage"] == "ok", (name, r)
        assert 1 <= r["blockDim"] <= 24, name
        if cap:
            assert r["baseM"] <= cap and r["baseN"] <= cap, name
        check_budgets(r, Dk, Dr, Dv, causal)


def test_mla_shape_uses_full_blocks(driver):
    (r,) = driver([(16, 128, 64, 128, True, BF16, 0, 24, [0, 4096])])
    assert r["ok"] and r["key"] == 2
    assert (r["baseM"], r["baseN"], r["vecRows"]) == (128, 128, 64)
    assert r["blockDim"] == 24


def test_wide_qk_heads_split_the_head_dim_not_the_blocks(driver):
    # Pangu / DeepSeek q/k heads of 192 without a shared rope key: a whole 192-wide Q row in each of two
    # L0A buffers would allow only 80-row blocks; Q . K^T as two Mmads (128 + 64 columns) keeps 128 x 128
    (r,) = driver([(2, 192, 0, 128, True, BF16, 0, 24, [0, 4096])])
    assert r["ok"] and (r["baseM"], r["baseN"], r["qkChunk"]) == (128, 128, 128)
    check_budgets(r, 192, 0, 128, True)
    # heads that fit whole keep one Mmad
    (r,) = driver([(16, 128, 64, 128, True, BF16, 0, 24, [0, 4096])])
    assert r["qkChunk"] == 128 and r["baseM"] == 128


def test_few_items_few_cores(driver):
    (r,) = driver([(1, 64, 0, 64, False, F16, 0, 24, [0, 5])])
    assert r["ok"] and r["blockDim"] == 1 and r["items"] == 1 and r["baseM"] == 16


def test_empty_and_refusals(driver):
    empty, f32, huge, wide = driver([(4, 64, 0, 64, False, F16, 0, 24, [0, 0, 0]),
                                     (4, 64, 0, 64, False, F32, 0, 24, [0, 8]),
                                     (4, 4000, 0, 4000, False, F16, 0, 24, [0, 8]),
                                     (4, 1024, 0, 1024, False, F16, 0, 24, [0, 8])])
    assert empty["ok"] and empty["key"] == 0 and empty["items"] == 0
    assert not f32["ok"] and "fp16 and bf16" in f32["error"]
    assert not huge["ok"] and "too large" in huge["error"]
    # below the Mmad limit, but a gradient row of 2048 fp32 is past the vector tiles' row stride
    assert not wide["ok"] and "Dk=1024, Dr=0, Dv=1024" in wide["error"] and "2040" in wide["error"]


# seqlen_q != seqlen_k: (name, H, Dk, Dr, Dv, lens_q, lens_k). Per sequence more keys, no keys, no
# queries, fewer keys (causal: the first Lq - Lk queries see no key), one query, one key, and with
# 16-row blocks whole query blocks that see no key (Lq = 70 queries, Lk = 3 keys).
QK_SHAPES = [
    ("varlen", 2, 16, 8, 16, [3, 4, 0, 9, 1, 5, 70], [7, 0, 2, 4, 6, 1, 3]),
    ("sq_lt_sk", 3, 24, 0, 24, [5, 17], [40, 33]),
    ("sq_gt_sk", 1, 32, 16, 32, [40, 33], [5, 17]),
    ("mla", 8, 128, 64, 128, [300, 1], [1000, 129]),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [0, 16])
def test_seqlen_q_ne_seqlen_k_items(driver, causal, cap):
    """Forward walk with separate cu_seqlens_q / cu_seqlens_k: every (query row, head) once, each item's
    key range from cu_seqlens_k (bottom-right causal, checked by brute force in the driver), items
    without keys counted; blocks sized by the longer side, steps by the keys."""
    cases = [(H, Dk, Dr, Dv, causal, F16, cap, 3, cu_of(lq), cu_of(lk)) for _, H, Dk, Dr, Dv, lq, lk in QK_SHAPES]
    for (name, H, Dk, Dr, Dv, lq, lk), r in zip(QK_SHAPES, driver(cases)):
        assert r["ok"] and r["coverage"] == "ok", (name, r)
        assert r["items"] == H * sum(-(-n // r["baseM"]) for n in lq), name
        assert r["steps"] == -(-max(lk) // r["baseN"]), name
        check_budgets(r, Dk, Dr, Dv, causal)
    v = driver([cases[0]])[0]
    b = v["baseM"]
    # keyless items: the Lk = 0 sequence (4 queries), and causal the query blocks of the 70 / 3
    # sequence whose last row i sees no key (i + 3 - 70 < 0)
    want = 2 * (1 + (sum(1 for i in range(0, 70, b) if min(i + b, 70) - 1 + 3 - 70 < 0) if causal else 0))
    assert v["keyless"] == want


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [0, 16])
def test_bwd_seqlen_q_ne_seqlen_k_rows(driver, causal, cap):
    """Backward walks with separate q / k sequences: every dk/dv row (KV pass) and dq row (Q pass)
    written once -- items without blocks (a sequence without queries; query blocks that see no key)
    through one zero-writing entry -- and each item visiting exactly the rows it must, first block flagged."""
    cases = [(H, Dk, Dr, Dv, causal, BF16, cap, 3, cu_of(lq), cu_of(lk)) for _, H, Dk, Dr, Dv, lq, lk in QK_SHAPES]
    for (name, H, Dk, Dr, Dv, lq, lk), r in zip(QK_SHAPES, driver(cases, bwd=True)):
        assert r["ok"] and r["coverage"] == "ok", (name, r)
        # one workspace bound for both passes: the longer of the two sides
        assert r["items"] == H * len(lq) * -(-max(lq + lk) // r["baseM"]), name
        check_bwd_budgets(r, Dk, Dr, Dv, causal)


def test_seqlen_k_without_keys_is_empty(driver):
    """No key anywhere (Tk = 0): the empty tiling (the host returns out 0, lse -inf, zero grads)."""
    fwd, = driver([(2, 16, 0, 16, True, F16, 0, 3, [0, 5, 9], [0, 0, 0])])
    bwd, = driver([(2, 16, 0, 16, True, F16, 0, 3, [0, 5, 9], [0, 0, 0])], bwd=True)
    assert fwd["ok"] and fwd["key"] == 0 and bwd["ok"] and bwd["key"] == 0


def check_bwd_budgets(t, Dk, Dr, Dv, causal):
    b, R = t["baseM"], t["vecRows"]
    assert t["baseN"] == b and b % 16 == 0 and b > 0, "square 16-aligned blocks"
    assert t["l1Buffers"] >= 2 and t["l0Buffers"] >= 2, "double buffering planned"
    u16 = lambda x: (x + 15) // 16 * 16
    u8 = lambda x: (x + 7) // 8 * 8
    dq = min(u16(Dk), t["qkChunk"]) if t["qkChunk"] else u16(Dk)  # head-dim chunk of the Q / K products
    assert dq % 16 == 0 and (dq == u16(Dk) or dq >= max(64, u16(Dr) if Dr else 0, u16(Dv), b))
    W = max(b, dq, u16(Dr) if Dr else 0, u16(Dv))
    gc = u8(Dk) + u8(Dr) + u8(Dv)
    assert t["gradCols"] == gc and gc % 8 == 0, "gradient rows of whole 32-byte blocks"
    l1, l0a, l0b, l0c = 2 * t["l1Buffers"] * b * W * 2, t["l0Buffers"] * b * W * 2, t["l0Buffers"] * b * W * 2, \
        t["l0cBuffers"] * b * W * 4
    d = u16(max(Dv, Dr))
    # tile-wise amo_fab_delta when Dv % 16 == 0: R rows of dout, out and their fp32 casts (within 64 KiB,
    # R a multiple of 8 in [8, 64]), the R sums and a chunk's partials
    R_d = min(64, max(8, 65536 // (Dv * 12) // 8 * 8)) if Dv % 16 == 0 else 0
    assert t["deltaRows"] == R_d
    # tile-wise amo_fab_dkrope when Dr > 0 and Dr % 16 == 0: R tokens of the running sum, two head rows
    # (fp32) and the rounded output (within 64 KiB, R a multiple of 8 in [8, 128])
    R_k = min(128, max(8, 65536 // (Dr * 14) // 8 * 8)) if Dr and Dr % 16 == 0 else 0
    assert t["dkropeRows"] == R_k
    ub = max(2 * b * 4 + 2 * b * 2, 2 * gc * 4 + u16(max(Dk, Dr, Dv)) * 2,
             2 * d * 4 + 2 * d * 2 + work(d) + 32, R_d * Dv * 12 + 2 * u8(R_d) * 4, R_k * Dr * 14)
    assert (t["l1Bytes"], t["l0aBytes"], t["l0bBytes"], t["l0cBytes"], t["ubBytes"]) == (l1, l0a, l0b, l0c, ub)
    assert l1 <= L1 and l0a <= L0A and l0b <= L0B and l0c <= L0C and ub <= UB_BUDGET
    assert R == math.ceil(b / 2)
    # fused pass kernel, per AIV, in chunks of c = min(R, 16) rows: S, dP (fp32), P, dS tiles, the running
    # sums of its R gradient rows, a chunk of product rows (fp32) and of output rows, lse and delta,
    # delta as loaded and the broadcast blocks, the row-wise output row
    c = min(R, 16)
    fused = 2 * c * b * 4 + 2 * c * b * 2 + R * gc * 4 + c * gc * 4 + c * gc * 2 + 2 * u8(c) * 4 + 2 * u8(c) * 8 * 4 + \
        u16(max(Dk, Dr, Dv)) * 2
    # extras where they fit: a second chunk of S, dP, P, dS, lse, delta (and delta as loaded) and of
    # product rows
    fused, pipe = fuse_extras(fused, 2 * c * b * 4 + 2 * c * b * 2 + 2 * u8(c) * 4 + u8(c) * 8 * 4 + c * gc * 4)
    assert t["ubFusedBytes"] == fused and fused <= UB_BUDGET and t["fusedPipe"] == pipe
    assert 1 <= t["vecBlockDim"] <= 2 * t["blockDim"]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [0, 16, 32])
def test_bwd_every_gradient_row_exactly_once(driver, causal, cap):
    cases = [(H, Dk, Dr, Dv, causal, BF16, cap, 5, cu_of(lens)) for _, H, Dk, Dr, Dv, lens in SHAPES]
    for (name, H, Dk, Dr, Dv, lens), r in zip(SHAPES, driver(cases, bwd=True)):
        assert r["ok"], (name, r)
        assert r["coverage"] == "ok", (name, r)
        assert 1 <= r["blockDim"] <= 5, name
        if cap:
            assert r["baseM"] <= cap, name
        check_bwd_budgets(r, Dk, Dr, Dv, causal)


def test_bwd_mla_and_plain_192_block_sizes(driver):
    mla, plain = driver([(16, 128, 64, 128, True, BF16, 0, 24, [0, 4096]),
                         (16, 192, 0, 128, True, BF16, 0, 24, [0, 4096])], bwd=True)
    assert mla["ok"] and plain["ok"]
    # MLA: W = 128, 128 x 128 blocks fit double-buffered L0A (2 x 128 x 128 x 2 B = 64 KiB).
    # Plain 192/128: a whole 192-wide row would need 2 x b x 192 x 2 B <= 64 KiB -> b = 80; in head-dim
    # chunks of 128 (Q . K^T in two K-chunks, dK and dQ in two N-chunks) W = 128 and b = 128.
    assert (mla["baseM"], mla["gradCols"]) == (128, 128 + 64 + 128)
    assert (plain["baseM"], plain["gradCols"], plain["qkChunk"]) == (128, 192 + 128, 128)
    assert mla["blockDim"] == 24 and mla["vecBlockDim"] == 48
    # causal: the KV pass skips blocks above the diagonal: 16 heads x (32 * 33 / 2) blocks per pass
    assert mla["blocks"] == 2 * 16 * 32 * 33 // 2


def test_fused_deal_balances_causal_items(driver):
    """The fused kernels deal items to the AI Core with the least work so far, each sequence's longest
    first (flash_attention_fused_schedule, the host twin of FaDeal): at the Pangu attention shape (S =
    1024, H = 8, 128-row blocks, 24 AI Cores) the busiest core runs 13 of the 288 causal blocks (mean 12)
    where item % 24 gave one core 24; every item is dealt once with its block count (checked by the
    driver against flash_attention_schedule / _bwd_schedule)."""
    pangu = (8, 128, 64, 128, True, BF16, 0, 24, [0, 1024])
    (f,) = driver([pangu])
    (b,) = driver([pangu], bwd=True)
    assert f["coverage"] == "ok" and b["coverage"] == "ok"
    assert (f["fusedMax"], f["plainMax"]) == (13, 24)
    assert (b["fusedMaxKV"], b["plainMaxKV"], b["fusedMaxQ"], b["plainMaxQ"]) == (13, 24, 13, 24)
    # packed sequences, causal and not, Lq != Lk: never more than the item % cores deal here, and every
    # item dealt exactly once
    cases = [(8, 128, 64, 128, causal, BF16, 0, 24, cu_of([1, 17, 300, 1000, 0, 129]), cu_of([1, 17, 300, 1000, 0, 129]))
             for causal in (True, False)]
    cases += [(4, 64, 0, 64, causal, F16, 32, 24, [0, 100, 150, 400], [0, 300, 320, 330]) for causal in (True, False)]
    for r, rb in zip(driver(cases), driver(cases, bwd=True)):
        assert r["coverage"] == "ok" and rb["coverage"] == "ok", (r, rb)
        assert r["fusedMax"] <= r["plainMax"], r
        assert rb["fusedMaxKV"] <= rb["plainMaxKV"] and rb["fusedMaxQ"] <= rb["plainMaxQ"], rb


def test_bwd_refusals(driver):
    f32, huge = driver([(4, 64, 0, 64, False, F32, 0, 24, [0, 8]),
                        (4, 4000, 0, 4000, False, F16, 0, 24, [0, 8])], bwd=True)
    assert not f32["ok"] and "fp16 and bf16" in f32["error"]
    assert not huge["ok"] and "too large" in huge["error"]


# ---------------------------------------------------------------------------------------------------
# Parity of the emulated AscendC kernels (ascendc-emu backend) with the fp64 reference, using the
# "2 x PyTorch's own error in the same low precision" rule; forward, then backward; fp16/bf16 only.
EMU = "ascendc-emu"
FWD = "flash_attention_fwd"
needs_emu = pytest.mark.skipif(EMU not in _backends.available_backends(FWD, "cpu"),
                               reason="the ascendc-emu extension is not built")


def _fa_inputs(lens, H, Dk, Dr, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, Dk + Dr, generator=g, dtype=torch.float64)
    k = torch.randn(T, H, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)
    kr = torch.randn(T, Dr, generator=g, dtype=torch.float64) if Dr else None
    cu = torch.tensor(cu_of(lens), dtype=torch.int32)
    return q, k, v, kr, cu


def _torch_lowp(q, k, v, kr, cu, causal, scale, dtype, do=None):
    """PyTorch's own attention in ``dtype`` (the 2x-rule baseline): (out, lse, dq, dk, dv, dk_rope)."""
    do = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64) if do is None else do
    return torch_attention_grads(q.to(dtype), k.to(dtype), v.to(dtype), None if kr is None else kr.to(dtype),
                                 cu, do.to(dtype), causal=causal, softmax_scale=scale)


def _fa_check(lens, H, Dk, Dr, Dv, dtype, causal, scale=None):
    q, k, v, kr, cu = _fa_inputs(lens, H, Dk, Dr, Dv)
    scale = scale if scale is not None else (Dk + Dr) ** -0.5
    ms = max(lens) if lens else 0
    args = lambda dt: (q.to(dt), k.to(dt), v.to(dt), None if kr is None else kr.to(dt), cu, cu, ms, ms, causal, scale)
    with amo.use_backend(EMU):
        out, lse = torch.ops.ascend_moe_ops.flash_attention_fwd(*args(dtype))
    assert out.dtype == dtype and lse.dtype == torch.float32
    o64, l64 = ref.flash_attention_fwd(*args(torch.float64))
    olo, llo = _torch_lowp(q, k, v, kr, cu, causal, scale, dtype)[:2]
    assert_close_to_ref(out, o64, dtype=dtype, torch_lowp=olo, name="ascendc-emu out")
    assert_close_to_ref(lse, l64, dtype=dtype, torch_lowp=llo, name="ascendc-emu lse")


BWD = "flash_attention_bwd"


def _fab_check(lens, H, Dk, Dr, Dv, dtype, causal, scale=None, seed=0):
    """Backward of the emulated kernels vs the fp64 reference; out/lse come from the emulated forward
    (what autograd saves on this backend)."""
    q, k, v, kr, cu = _fa_inputs(lens, H, Dk, Dr, Dv, seed=seed)
    do = torch.randn(q.shape[0], H, Dv, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    scale = scale if scale is not None else (Dk + Dr) ** -0.5
    ms = max(lens) if lens else 0
    args = lambda dt: (q.to(dt), k.to(dt), v.to(dt), None if kr is None else kr.to(dt))
    o64, l64 = ref.flash_attention_fwd(*args(torch.float64), cu, cu, ms, ms, causal, scale)
    want = ref.flash_attention_bwd(do, *args(torch.float64), o64, l64, cu, cu, ms, ms, causal, scale)
    lowp = _torch_lowp(q, k, v, kr, cu, causal, scale, dtype, do)[2:]
    with amo.use_backend(EMU):
        oemu, lemu = torch.ops.ascend_moe_ops.flash_attention_fwd(*args(dtype), cu, cu, ms, ms, causal, scale)
        got = torch.ops.ascend_moe_ops.flash_attention_bwd(do.to(dtype), *args(dtype), oemu, lemu, cu, cu, ms, ms,
                                                           causal, scale)
    for name, g, w, lo in zip(("dq", "dk", "dv", "dk_rope"), got, want, lowp):
        if kr is None and name == "dk_rope":
            assert g.numel() == 0
            continue
        assert g.dtype == dtype and g.shape == w.shape, name
        assert_close_to_ref(g, w, dtype=dtype, torch_lowp=lo, name=f"ascendc-emu {name}")


#: the emulated kernels' forward and backward, each checked against the fp64 reference
CHECKS = {"fwd": _fa_check, "bwd": _fab_check}


@needs_emu
@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "plain"])
def test_emu_matches_reference_varlen(monkeypatch, check, dtype, causal, rope):
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")  # many query and key blocks per item
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "3")
    Dk, Dr, Dv = (32, 16, 32) if rope else (24, 0, 24)
    CHECKS[check]([1, 17, 40, 0, 5], 2, Dk, Dr, Dv, dtype, causal)


@needs_emu
@pytest.mark.parametrize("check, lens", [("fwd", [33, 20]), ("bwd", [150, 20])], ids=list(CHECKS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emu_mla_shape(check, lens, causal):
    # MLA: 128 nope + 64 shared rope, d_v = 128, default (full 128 x 128) tiles; the backward sums
    # dK_rope over the heads
    CHECKS[check](lens, 2, 128, 64, 128, torch.bfloat16, causal)


@needs_emu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emu_wide_qk_heads_in_head_dim_chunks(monkeypatch, causal):
    """q/k heads of 200 (no rope key) at the default 128 x 128 blocks: Q . K^T as two Mmads of 128 and
    72 columns (the second zero-padded to 80) accumulating in L0C, the backward's dK and dQ products in
    two column chunks each; forward and backward against the fp64 reference, and fused == phase kernels
    bitwise (forward and backward)."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "2")
    _fa_check([130, 7], 1, 200, 0, 64, torch.bfloat16, causal)
    _fab_check([130, 7], 1, 200, 0, 64, torch.bfloat16, causal)
    _assert_fused_equals_phases(monkeypatch, [130, 7], 1, 200, 0, 64, causal=causal, seeds=(2, 3))


@needs_emu
def test_emu_backward_dk_rope_tiles(monkeypatch):
    """amo_fab_dkrope tile-wise (Dr % 16 == 0): 290 key tokens in tiles of 128 on 2 AIVs (core 0 takes
    tiles 0 and 2, the last one partial), 4 heads (the next head's rows load into the other buffer
    while this one is added), against the fp64 reference."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "1")
    _fab_check([200, 90], 4, 32, 16, 32, torch.bfloat16, True)


@needs_emu
@pytest.mark.parametrize("check", list(CHECKS))
def test_emu_one_token_and_odd_dims(check):
    CHECKS[check]([1], 1, 16, 0, 16, torch.float16, True)
    CHECKS[check]([19, 3], 3, 40, 8, 56, torch.float16, False, scale=0.31)


# seqlen_q != seqlen_k on the emulated kernels: per sequence (Lq, Lk) more keys, no keys, no queries,
# fewer keys, one query, one key, and 40 queries on 3 keys (causal: 37 rows and two whole 16-row query
# blocks see no key), then 5 queries on 37 keys (causal: the queries see the last keys of 3 key blocks).
QK_LENS = ([3, 4, 0, 9, 1, 5, 40, 5], [7, 0, 2, 4, 6, 1, 3, 37])


def _dense_lowp(q, k, v, kr, cu_q, cu_k, causal, scale, do):
    """Dense masked attention in the inputs' dtype with autograd (PyTorch's own error for the 2x
    rule): query i of a sequence sees keys j <= i + Lk - Lq when causal; a row that sees no key gives
    out 0 and lse -inf. Returns (out, lse, dq, dk, dv, dk_rope)."""
    qq, kk, vv, rr = (None if t is None else t.detach().clone().requires_grad_() for t in (q, k, v, kr))
    H = q.shape[1]
    keys = kk if rr is None else torch.cat([kk, rr[:, None, :].expand(-1, H, -1)], -1)
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for sq, eq, sk, ek in zip(bq[:-1], bq[1:], bk[:-1], bk[1:]):
        Lq, Lk = eq - sq, ek - sk
        s = torch.einsum("ihd,jhd->hij", qq[sq:eq], keys[sk:ek]) * scale
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]
        allowed = (j <= i + Lk - Lq) if causal else torch.ones(Lq, Lk, dtype=torch.bool)
        seen = allowed.any(-1)
        s = s.masked_fill(~allowed, float("-inf")).masked_fill(~seen[:, None], 0.0)
        p = torch.softmax(s, -1) * seen[:, None]
        outs.append(torch.einsum("hij,jhd->ihd", p, vv[sk:ek]))
        lses.append(torch.where(seen, torch.logsumexp(s, -1), torch.full((H, Lq), float("-inf"), dtype=s.dtype)))
    out = torch.cat(outs)
    out.backward(do)
    return (out.detach(), torch.cat(lses, 1).float(), qq.grad, kk.grad, vv.grad,
            q.new_zeros((0,)) if rr is None else rr.grad)


def _qk_inputs(lens_q, lens_k, H, Dk, Dr, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(lens_q), sum(lens_k)
    q = torch.randn(Tq, H, Dk + Dr, generator=g, dtype=torch.float64)
    k = torch.randn(Tk, H, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(Tk, H, Dv, generator=g, dtype=torch.float64)
    kr = torch.randn(Tk, Dr, generator=g, dtype=torch.float64) if Dr else None
    do = torch.randn(Tq, H, Dv, generator=g, dtype=torch.float64)
    return q, k, v, kr, do, torch.tensor(cu_of(lens_q), dtype=torch.int32), torch.tensor(cu_of(lens_k), dtype=torch.int32)


def _emu_fwd_bwd(qkv, do, cu_q, cu_k, mq, mk, causal, scale):
    with amo.use_backend(EMU):
        out, lse = torch.ops.ascend_moe_ops.flash_attention_fwd(*qkv, cu_q, cu_k, mq, mk, causal, scale)
        grads = torch.ops.ascend_moe_ops.flash_attention_bwd(do, *qkv, out, lse, cu_q, cu_k, mq, mk, causal, scale)
    return (out, lse) + tuple(grads)


@needs_emu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "plain"])
def test_emu_seqlen_q_ne_seqlen_k(monkeypatch, causal, rope):
    """Separate cu_seqlens_q / cu_seqlens_k on the fused kernels (16 x 16 blocks, 3 AI Cores), forward
    and backward against the fp64 reference with the 2x rule, and the exact edge values: rows that
    see no key give out 0, lse -inf and dq 0; keys of a sequence without queries get dk, dv (and
    dk_rope) 0; a row that sees exactly one key gets dq 0."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "3")
    Dk, Dr, Dv = (32, 16, 32) if rope else (24, 0, 24)
    lens_q, lens_k = QK_LENS
    q, k, v, kr, do, cu_q, cu_k = _qk_inputs(lens_q, lens_k, 2, Dk, Dr, Dv, seed=2)
    mq, mk, scale, dt = max(lens_q), max(lens_k), 0.21, torch.bfloat16
    lo = lambda t: None if t is None else t.to(dt)  # noqa: E731
    got = _emu_fwd_bwd(tuple(lo(t) for t in (q, k, v, kr)), do.to(dt), cu_q, cu_k, mq, mk, causal, scale)
    o64, l64 = ref.flash_attention_fwd(q, k, v, kr, cu_q, cu_k, mq, mk, causal, scale)
    want = (o64, l64) + tuple(ref.flash_attention_bwd(do, q, k, v, kr, o64, l64, cu_q, cu_k, mq, mk, causal, scale))
    lowp = _dense_lowp(*(lo(t) for t in (q, k, v, kr)), cu_q, cu_k, causal, scale, do.to(dt))
    for name, a, w, b in zip(("out", "lse", "dq", "dk", "dv", "dk_rope"), got, want, lowp):
        if kr is None and name == "dk_rope":
            assert a.numel() == 0
            continue
        assert a.shape == w.shape, name
        assert_close_to_ref(a, w, dtype=dt, torch_lowp=b, name=f"ascendc-emu Sq != Sk {name}")
    out, lse, dq, dk, dv, dkr = got
    # sequence 1: 4 queries (rows 3..6), no key
    assert (out[3:7] == 0).all() and torch.isneginf(lse[:, 3:7]).all() and (dq[3:7] == 0).all()
    # sequence 2: no query, keys 7..8
    assert (dk[7:9] == 0).all() and (dv[7:9] == 0).all() and (kr is None or (dkr[7:9] == 0).all())
    if causal:  # sequence 6: 40 queries (rows 22..61) on 3 keys: rows 22..58 see none, row 59 one
        assert (out[22:59] == 0).all() and torch.isneginf(lse[:, 22:59]).all() and (dq[22:59] == 0).all()
        assert torch.isfinite(lse[:, 59:62]).all() and (dq[59] == 0).all() and dq[60:62].abs().max() > 0
    else:
        assert torch.isfinite(lse[:, 7:]).all()


@needs_emu
@pytest.mark.parametrize("schedule", ["run-to-block", "switch"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emu_seqlen_q_ne_seqlen_k_fused_equals_phases(monkeypatch, causal, schedule):
    """With separate q / k sequences (and items without keys or queries) the fused and the phase
    kernels still do the same arithmetic in the same order: bitwise equal results."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "3")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_MIX_SCHEDULE", schedule)
    lens_q, lens_k = QK_LENS
    q, k, v, kr, do, cu_q, cu_k = _qk_inputs(lens_q, lens_k, 2, 32, 16, 32, seed=6)
    qkv = tuple(t.to(torch.bfloat16) for t in (q, k, v, kr))
    res = {}
    for mode in ("fused", "phases"):
        monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", mode)
        res[mode] = _emu_fwd_bwd(qkv, do.to(torch.bfloat16), cu_q, cu_k, max(lens_q), max(lens_k), causal, 0.17)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dk_rope"), res["fused"], res["phases"]):
        assert torch.equal(a, b), f"{name}: fused and phase kernels differ"


@needs_emu
def test_emu_autograd_through_flash_attention(monkeypatch):
    """The public op on the ascendc-emu backend: forward and backward both run the AscendC kernels
    and the gradients match the fp64 reference (2 x PyTorch's own fp16 error)."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "32")
    g = torch.Generator().manual_seed(5)
    B, S, H, Dq, Dv = 2, 37, 2, 48, 32
    q, k = (torch.randn(B, S, H, Dq, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, S, H, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, Dv, generator=g, dtype=torch.float64)

    def grads(dtype, backend):
        leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
        with amo.use_backend(backend):
            out = amo.flash_attention(*leaves, causal=True)
            out.backward(do.to(dtype))
        return [out] + [t.grad for t in leaves]

    def torch_grads(dtype):  # PyTorch's own attention in fp16: the 2x-rule baseline
        cu = torch.arange(B + 1) * S
        res = torch_attention_grads(*(t.to(dtype).flatten(0, 1) for t in (q, k, v)), None, cu,
                                    do.to(dtype).flatten(0, 1), causal=True, softmax_scale=Dq ** -0.5)
        return [r.reshape(t.shape) for r, t in zip((res[0],) + res[2:5], (do, q, k, v))]

    got, want, lowp = grads(torch.float16, EMU), grads(torch.float64, "reference"), torch_grads(torch.float16)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, want, lowp):
        assert_close_to_ref(a, b, dtype=torch.float16, torch_lowp=c, name=f"ascendc-emu autograd {name}")


@needs_emu
def test_emu_backward_rejects_fp32_and_bad_lse():
    q, k, v, kr, cu = _fa_inputs([4], 1, 16, 0, 16)
    o = torch.zeros(4, 1, 16)
    with amo.use_backend(EMU), pytest.raises(TypeError, match="flash_attention_bwd: q must have dtype in \\(float16, bfloat16\\)"):
        torch.ops.ascend_moe_ops.flash_attention_bwd(o, q.float(), k.float(), v.float(), None, o,
                                                     torch.zeros(1, 4), cu, cu, 4, 4, True, 0.25)
    qh, kh, vh, oh = (t.half() for t in (q, k, v, o))
    with amo.use_backend(EMU), pytest.raises(TypeError, match="lse must be float32"):
        torch.ops.ascend_moe_ops.flash_attention_bwd(oh, qh, kh, vh, None, oh, torch.zeros(1, 4, dtype=torch.float16),
                                                     cu, cu, 4, 4, True, 0.25)


@needs_emu
def test_emu_rejects_fp32():
    q, k, v, kr, cu = _fa_inputs([4], 1, 16, 0, 16)
    with amo.use_backend(EMU), pytest.raises(TypeError, match="flash_attention_fwd: q must have dtype in \\(float16, bfloat16\\)"):
        torch.ops.ascend_moe_ops.flash_attention_fwd(q.float(), k.float(), v.float(), None, cu, cu, 4, 4, True, 0.25)


# ---------------------------------------------------------------------------------------------------
# The fused forward (one mixed AIC + AIV launch) and the emulator's cross-core flag rules.
MIX_RULES = [
    ("deadlock", "deadlock: every live block of the AI Core group waits"),
    ("one_aiv_sets", "deadlock"),
    ("set_never_waited", "cross-core flag 3 was set but never waited for"),
    ("mode0", "only mode 2"),
    ("flag_id_12", "one of 11..14, which SyncAll uses internally"),
    ("flag_id_16", "outside 0..15"),
    ("too_many_sets", "set more than 15 times"),
]


mix_driver = driver_fixture("emu_mix_rules_driver", flags=("-pthread",))


def _mix(exe, case, schedule=None):
    env = dict(os.environ)
    env.pop("ASCEND_MOE_OPS_EMU_MIX_SCHEDULE", None)
    if schedule:
        env["ASCEND_MOE_OPS_EMU_MIX_SCHEDULE"] = schedule
    return run_case(exe, case, env=env, timeout=60)


@rule_cases(MIX_RULES)
def test_emulator_enforces_cross_core_rule(mix_driver, case, match):
    assert_emu_error(_mix(mix_driver, case), case, re.escape(match))


def test_emulator_mixed_launch_ids_and_ping_pong(mix_driver):
    assert _mix(mix_driver, "flag_id_15_ok") == "ok", "flag 15 is free (11..14: SyncAll)"
    assert _mix(mix_driver, "ok_pingpong") == "ok"
    assert _mix(mix_driver, "ok_pingpong", "switch") == "ok"
    vals = [float(x) for x in _mix(mix_driver, "ids").split()]
    # 3 AI Cores: AIC blocks 0..2 (GetBlockNum 3, ratio 1), AIV blocks 0..5 (ratio 2)
    assert vals[:3] == [311.0] * 3 and vals[8:14] == [322.0] * 6


def test_emulator_schedules_expose_a_missing_handshake(mix_driver):
    """A producer that rewrites its slot without waiting for the consumers' flag. The schedules alone
    would show it only under the default one (run until blocked: the consumers read overwritten data;
    "switch" happens to hide it); the cross-core GM model (emu/gm_model.h) names the race under both."""
    for schedule in (None, "switch"):
        assert_emu_error(_mix(mix_driver, "racy_no_ack", schedule), "racy_no_ack",
                         r"GM race between cores \((read-after-write|write-after-read)\) .* on AIC 0 \(PIPE_S\)")


@needs_emu
@pytest.mark.parametrize("schedule", ["run-to-block", "switch"])
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "plain"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_emu_fused_kernels_equal_phase_kernels(monkeypatch, rope, causal, schedule):
    """The fused mixed kernels (forward; backward one launch per pass) and the phase kernels do the same
    arithmetic in the same order: bitwise equal out, lse, dq, dk, dv, dk_rope (16 x 16 blocks, 3 AI
    Cores, varlen with an empty sequence)."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "3")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_MIX_SCHEDULE", schedule)
    Dk, Dr, Dv = (32, 16, 32) if rope else (24, 0, 24)
    _assert_fused_equals_phases(monkeypatch, [1, 17, 40, 0, 5], 2, Dk, Dr, Dv, causal=causal, seeds=(4, 9), scale=0.17)


def _assert_fused_equals_phases(monkeypatch, lens, H, Dk, Dr, Dv, causal, seeds, scale=0.2):
    """Forward and backward with the fused and with the phase kernels (bf16): bitwise equal outputs."""
    q, k, v, kr, cu = _fa_inputs(lens, H, Dk, Dr, Dv, seed=seeds[0])
    do = torch.randn(q.shape[0], H, Dv, generator=torch.Generator().manual_seed(seeds[1])).to(torch.bfloat16)
    qkv = tuple(None if t is None else t.to(torch.bfloat16) for t in (q, k, v, kr))
    m = max(lens)
    res = {}
    for mode in ("fused", "phases"):
        monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", mode)
        with amo.use_backend(EMU):
            out, lse = torch.ops.ascend_moe_ops.flash_attention_fwd(*qkv, cu, cu, m, m, causal, scale)
            grads = torch.ops.ascend_moe_ops.flash_attention_bwd(do, *qkv, out, lse, cu, cu, m, m, causal, scale)
        res[mode] = (out, lse) + tuple(grads)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dk_rope"), res["fused"], res["phases"]):
        assert torch.equal(a, b), f"{name}: fused and phase kernels differ"


@needs_emu
@pytest.mark.parametrize("schedule", ["run-to-block", "switch"])
def test_emu_fused_bwd_kv_pass_short_last_query_block(monkeypatch, schedule):
    """Issue 30: in the KV pass an AIV whose half of a query block is empty (40 queries = blocks of 16,
    16 and 8 rows, baseM 16: AIV 1 has no row of the last block) sets CrossCoreSetFlag<2, PIPE_MTE3>
    with no store pending; the flag must still cover its part-slot loads (MTE2) of the block before
    last, which the AIC then overwrites. The kernel orders MTE2 -> MTE3 before the set; without it the
    cross-core GM model raises "GM race between cores (write-after-read)". Fused == phases bitwise."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "1")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_MIX_SCHEDULE", schedule)
    _assert_fused_equals_phases(monkeypatch, [40], 1, 24, 0, 24, causal=False, seeds=(11, 12))


@needs_emu
def test_emu_kernels_variable_is_checked(monkeypatch):
    monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", "fast")
    q, k, v, kr, cu = _fa_inputs([4], 1, 16, 0, 16)
    with amo.use_backend(EMU), pytest.raises(RuntimeError, match="ASCEND_MOE_OPS_FA_KERNELS must be 'fused' or 'phases'"):
        torch.ops.ascend_moe_ops.flash_attention_fwd(q.half(), k.half(), v.half(), None, cu, cu, 4, 4, True, 0.25)
