"""Tiling of the AscendC kernels (csrc/ascend/tiling), checked through a small C++ driver: every
row and every H-column is covered exactly once, UB budgets hold with double buffering, buffers are
32-byte aligned, tails are right, blockDim <= the AIV core count, for real and odd shapes."""

import pytest

from _ascend_cxx import driver as _driver, run_json_lines

F32, F16, BF16 = 0, 1, 2
BYTES = {F32: 4, F16: 2, BF16: 2}
AIV = 48  # Ascend 910B2 defaults in tiling_common.h
UB, UB_RESERVED = 196608, 8192


@pytest.fixture(scope="module")
def driver():
    exe = _driver("ascend_tiling_driver", tilings=("moe_permute_tiling", "moe_unpermute_tiling"))
    return lambda lines: run_json_lines(exe, lines)


# (T, H, E, K): Pangu Ultra MoE (H=7680, E=256, K=8), DeepSeek-V3 (H=7168), odd and empty ones
SHAPES = [(4096, 7680, 256, 8), (4096, 7168, 256, 8), (37, 97, 7, 3), (1, 97, 4, 1), (0, 7680, 256, 8),
          (5, 1, 3, 2), (3, 16, 2, 2), (100, 4095, 8, 2), (49, 7681, 16, 4), (1, 0, 4, 2)]
CAPS = [0, 32, 48]  # 0 = no cap on the tile width; others force several tiles per row


def check_rows(t, rows):
    assert 1 <= t["blockDim"] <= min(t["aiv"], max(rows, 1)), t
    covered = []
    for first, count in t["blocks"]:
        assert count >= 0
        covered.extend(range(first, first + count))
    assert covered == list(range(rows)), "every row exactly once, in block order"
    counts = [c for _, c in t["blocks"]]
    assert max(counts) - min(counts) <= 1, "balanced split"


def check_cols(t, hidden, bytes_per_elem_list, cap):
    c = t
    assert c["tileCols"] % c["alignElems"] == 0
    for b in bytes_per_elem_list:
        assert c["tileCols"] * b % 32 == 0, "every UB buffer is 32-byte aligned"
    assert c["alignElems"] * min(bytes_per_elem_list) == 32
    if cap:
        assert c["tileCols"] <= max(cap // c["alignElems"] * c["alignElems"], c["alignElems"])
    if hidden == 0:
        assert c["tileNum"] == 0
        return
    tiles = [(i * c["tileCols"], c["tileCols"]) for i in range(c["tileNum"] - 1)]
    tiles.append(((c["tileNum"] - 1) * c["tileCols"], c["tailCols"]))
    assert 1 <= c["tailCols"] <= c["tileCols"]
    cols = [x for start, n in tiles for x in range(start, start + n)]
    assert cols == list(range(hidden)), "every column exactly once"
    assert c["tileCols"] < hidden + c["alignElems"], "no tile wider than the aligned row"


def tail_mode(hidden, *byte_sizes):
    return int(any(hidden * b % 32 for b in byte_sizes))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_permute_tiling(driver, dtype):
    lines, cases = [], []
    for T, H, E, K in SHAPES:
        for N in sorted({T * K, T * K + E * 15, E * 40 if T else 0}):
            for cap in CAPS:
                lines.append(f"permute {N} {T} {H} {dtype} {cap}")
                cases.append((N, H, cap))
    for (N, H, cap), t in zip(cases, driver(lines)):
        assert "error" not in t, t
        b = BYTES[dtype]
        assert t["elemBytes"] == b and t["bufferNum"] >= 2
        check_rows(t, N)
        check_cols(t, H, [b], cap)
        # UB: copy queue (bufferNum tiles) + one zero tile, independently recomputed
        ub = (t["bufferNum"] + 1) * t["tileCols"] * b
        assert t["ubBytes"] == ub <= UB - UB_RESERVED
        assert t["tailMode"] == tail_mode(H, b)
        assert t["key"] == (0 if N == 0 or H == 0 else (1 if b == 2 else 2))


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("with_probs", [0, 1])
def test_unpermute_tiling(driver, dtype, with_probs):
    lines, cases = [], []
    for T, H, E, K in SHAPES:
        for cap in CAPS:
            lines.append(f"unpermute {T} {K} {T * K} {H} {dtype} {with_probs} {cap}")
            cases.append((T, H, cap))
    for (T, H, cap), t in zip(cases, driver(lines)):
        assert "error" not in t, t
        b = BYTES[dtype]
        check_rows(t, T)
        check_cols(t, H, [b, 4], cap)
        ub = t["tileCols"] * (2 * t["bufferNum"] * b + (8 if b != 4 else 0))
        assert t["bufferNum"] >= 2 and t["ubBytes"] == ub <= UB - UB_RESERVED
        assert t["tailMode"] == tail_mode(H, b)
        assert t["key"] == (0 if T == 0 or H == 0 else {F32: 1, F16: 2, BF16: 3}[dtype])


@pytest.mark.parametrize("xd, gd", [(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)])
@pytest.mark.parametrize("with_probs", [0, 1])
def test_unpermute_grad_tiling(driver, xd, gd, with_probs):
    lines, cases = [], []
    for T, H, E, K in SHAPES:
        for N in sorted({T * K, T * K + E * 15}):
            for cap in CAPS:
                lines.append(f"grad {T} {K} {N} {H} {xd} {gd} {with_probs} {cap}")
                cases.append((N, H, cap))
    for (N, H, cap), t in zip(cases, driver(lines)):
        assert "error" not in t, t
        xb, gb = BYTES[xd], BYTES[gd]
        check_rows(t, N)
        check_cols(t, H, [xb, gb, 4], cap)
        per_col = t["bufferNum"] * (gb + xb) + 4 + (4 if gb != 4 else 0)
        fixed = 0
        if with_probs:
            per_col += t["bufferNum"] * xb + (4 if xb != 4 else 0) + 8
            assert t["dotChunk"] % 8 == 0 and t["dotChunk"] >= min(max(t["formerRows"], 1), 1024)
            fixed = t["dotChunk"] * 4 + 32
        assert t["ubBytes"] == per_col * t["tileCols"] + fixed <= UB - UB_RESERVED
        assert t["tailMode"] == tail_mode(H, xb, gb)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_permute_token_major_tiling(driver, dtype):
    """slots > 0: the token-major loop splits the T source tokens over the cores (each token read
    once) and still the N output rows (the padding rows' zeros); the launch covers both splits."""
    lines, cases = [], []
    for T, H, E, K in SHAPES:
        for N in sorted({T * K, T * K + E * 15}):
            lines.append(f"permute {N} {T} {H} {dtype} 0 {K}")
            cases.append((N, T, K))
    for (N, T, K), t in zip(cases, driver(lines)):
        assert "error" not in t, t
        assert t["tokenMajor"] == 1 and t["slots"] == K
        check_rows(t, N)
        tok = dict(t["tokens"], aiv=t["aiv"])
        check_rows(tok, T)
        assert t["launchDim"] == max(t["blockDim"], tok["blockDim"]) <= AIV
    row_major, too_many = driver([f"permute 64 8 16 {dtype} 0 0", f"permute 64 1 16 {dtype} 0 65"])
    assert row_major["tokenMajor"] == 0 and row_major["launchDim"] == row_major["blockDim"]
    assert "slots must be in [0, 64]" in too_many["error"]


def test_real_shapes_use_every_core_and_big_tiles(driver):
    """Pangu Ultra MoE: T=4096, H=7680, K=8 -> 32768 rows over 48 cores, whole rows in one tile."""
    p, u = driver([f"permute {4096 * 8} 4096 7680 {BF16} 0", f"unpermute 4096 8 {4096 * 8} 7680 {BF16} 1 0"])
    assert p["blockDim"] == AIV and p["formerNum"] == 4096 * 8 % AIV and p["tailRows"] == 4096 * 8 // AIV
    assert p["tileNum"] == 1 and p["tailCols"] == 7680 and p["tailMode"] == 0
    assert u["blockDim"] == AIV and u["formerNum"] == 4096 % AIV and u["tileNum"] == 1
    # DeepSeek-V3 backward with probs in fp32 (36 B of UB per column): the row no longer fits
    ds = driver([f"grad 4096 8 {4096 * 8} 7168 {F32} {F32} 1 0"])[0]
    assert ds["tileNum"] == 2 and ds["tileCols"] + ds["tailCols"] == 7168


def test_small_chip_and_budget_errors(driver):
    """A smaller UB forces more tiles; a UB too small for one aligned group is a clear error."""
    small, tiny = driver(["chip 8 1024 0 permute 100 10 97 0 0", "chip 8 64 0 permute 100 10 97 0 0"])
    assert small["blockDim"] == 8 and small["ubBytes"] <= 1024 and small["tileNum"] > 1
    check_cols(small, 97, [4], 0)
    assert "exceeds the UB budget" in tiny["error"]
    bad = driver([f"grad 4 2 8 16 {F16} {BF16} 0 0", "permute -1 1 1 0 0"])
    assert "grad dtype" in bad[0]["error"] and "negative" in bad[1]["error"]
