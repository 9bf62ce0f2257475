"""Tiling of the grouped GEMM Cube kernels (csrc/ascend/tiling/grouped_gemm_tiling.*), through a C++
driver: every output tile covered exactly once across the AIC cores (forward, including the zero rows
past sum(group_sizes), and dW, including empty groups), L1/L0A/L0B/L0C budgets with double
buffering, 16 x 16 fractal alignment, blockDim <= the AIC count, for real and odd shapes."""

import pytest
import torch

from _ascend_cxx import driver as _driver, run_json_lines

NN, NT, DW = 0, 1, 2
F32, F16, BF16 = 0, 1, 2
AIC = 24
L1, L0A, L0B, L0C = 512 * 1024, 64 * 1024, 64 * 1024, 128 * 1024


@pytest.fixture(scope="module")
def driver():
    exe = _driver("grouped_gemm_tiling_driver", flags=("-O2",), tilings=("grouped_gemm_tiling",))

    def run(cases):
        return run_json_lines(exe, [" ".join(str(v) for v in (lay, M, K, N, dt, cap, aic, len(s), *s))
                                    for lay, M, K, N, dt, cap, aic, s in cases])

    return run


def zipf(E, total, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    w = w[torch.randperm(E, generator=g)]
    s = torch.floor(w / w.sum() * total).to(torch.int64)
    s[int(torch.argmax(w))] += total - int(s.sum())
    return s.tolist()


def uniform(E, total):
    return [total // E + (1 if e < total % E else 0) for e in range(E)]


# (name, M, K, N, sizes): fine-grained E=256 (Pangu-like), coarse E=32 (DeepSeek-MoE-like FFN 1408),
# Zipf, empty groups, one expert, K = 0, rows past the groups, odd sizes
SHAPES = [
    ("E256_fine", 16384, 512, 256, uniform(256, 16384)),
    ("E32_coarse", 8192, 2048, 1408, uniform(32, 8192)),
    ("zipf", 8192, 512, 256, zipf(64, 8000)),
    ("empty_groups", 1000, 96, 200, [0, 0, 300, 0, 0, 700, 0]),
    ("E1", 77, 33, 45, [60]),
    ("K0", 50, 0, 24, [20, 0, 30]),
    ("all_empty", 40, 16, 16, [0, 0, 0]),
    ("odd", 97, 129, 61, [30, 0, 41, 1, 20]),
]


def check_budgets(t):
    for k in ("baseM", "baseN", "baseK"):
        assert t[k] % 16 == 0 and t[k] > 0, "16 x 16 fractal alignment"
    assert t["l1Buffers"] >= 2 and t["l0Buffers"] >= 2, "double buffering of L1 and L0A/L0B"
    l1 = t["l1Buffers"] * (t["baseM"] * t["mPair"] * t["baseK"] * t["stepK"] + t["baseK"] * t["stepK"] * t["baseN"]) * 2
    l0a = t["l0Buffers"] * t["baseM"] * t["baseK"] * 2
    l0b = t["l0Buffers"] * t["baseK"] * t["baseN"] * 2
    l0c = t["l0cBuffers"] * t["baseM"] * t["baseN"] * 4
    assert (t["l1Bytes"], t["l0aBytes"], t["l0bBytes"], t["l0cBytes"]) == (l1, l0a, l0b, l0c)
    assert l1 <= L1 and l0a <= L0A and l0b <= L0B and l0c <= L0C
    for b in (l0a // t["l0Buffers"], l0b // t["l0Buffers"], l0c // t["l0cBuffers"]):
        assert b % 512 == 0, "every L0 buffer is whole 512-byte fractals"


@pytest.mark.parametrize("layout", [NN, NT, DW], ids=["nn", "nt", "dw"])
@pytest.mark.parametrize("cap", [0, 32])
def test_every_tile_exactly_once(driver, layout, cap):
    cases = [(layout, M, K, N, BF16, cap, AIC, s) for _, M, K, N, s in SHAPES
             if not (cap and M * N > 1 << 22)]  # the small cap on huge shapes only slows the check
    for (name, *_), t in zip([s for s in SHAPES if not (cap and s[1] * s[3] > 1 << 22)], driver(cases)):
        assert t["ok"], (name, t)
        assert t["coverage"] == "exact", (name, t["coverage"])
        if t["key"] == 0:
            continue
        check_budgets(t)
        assert 1 <= t["blockDim"] <= AIC
        assert len(t["items"]) == t["blockDim"]
        assert max(t["items"]) - min(t["items"]) <= 1, (name, "items strided evenly over cores")
        if cap:
            assert max(t["baseM"], t["baseN"], t["baseK"] * t["stepK"]) <= cap


def test_real_shape_blocks(driver):
    """The full-size base blocks on real shapes, all 24 AIC, 128 x 128 x 128 output tiles with two
    L0C tiles: a long reduction (K = 2048) pairs two M tiles per item (they share each B chunk in
    L1, one L0C tile each), stepK 2; a short one (K = 512, or dW over M / E = 64 rows) one M tile
    per item, the two L0C tiles alternating (Fixpipe overlapped with the next tile), stepK 4."""
    (t,) = driver([(NN, 8192, 2048, 1408, F16, 0, AIC, uniform(32, 8192))])
    assert (t["baseM"], t["baseN"], t["baseK"], t["stepK"], t["l0cBuffers"], t["mPair"]) == (128, 128, 128, 2, 2, 2)
    assert t["blockDim"] == AIC and t["l0cBytes"] == L0C and t["l0aBytes"] == L0A and t["l0bBytes"] == L0B
    assert t["l1Bytes"] == 2 * (256 * 256 + 256 * 128) * 2  # 384 KiB of 512
    assert t["coverage"] == "exact"
    for layout, M in ((NN, 16384), (DW, 16384)):
        (t,) = driver([(layout, M, 512, 256, F16, 0, AIC, uniform(256, M))])
        assert (t["baseM"], t["baseN"], t["baseK"], t["l0cBuffers"], t["mPair"]) == (128, 128, 128, 2, 1), layout
        assert t["l0cBytes"] == L0C and t["l0aBytes"] == L0A and t["l0bBytes"] == L0B
        assert t["l1Bytes"] == L1 and t["coverage"] == "exact"


def test_few_cores_and_edge_keys(driver):
    out = driver([(NN, 97, 129, 61, F16, 0, 3, [30, 0, 41, 1, 20]),
                  (DW, 97, 129, 61, F16, 0, 1, [30, 0, 41, 1, 20]),
                  (NN, 0, 16, 16, F16, 0, AIC, [0, 0]),
                  (DW, 10, 0, 16, F16, 0, AIC, [10]),
                  (DW, 0, 16, 16, F16, 0, AIC, [0, 0])])
    assert out[0]["blockDim"] == 3 and out[0]["coverage"] == "exact"
    assert out[1]["blockDim"] == 1 and out[1]["coverage"] == "exact"
    assert out[2]["key"] == 0 and out[3]["key"] == 0
    assert out[4]["key"] != 0 and out[4]["coverage"] == "exact", "dW of empty groups still writes zeros"


def test_fp32_is_refused(driver):
    (t,) = driver([(NN, 16, 16, 16, F32, 0, AIC, [16])])
    assert not t["ok"] and "fp16 and bf16" in t["error"]
