"""The native bf16 grouped GEMM's kernels (AMX tiles where the CPU has them, AVX-512 BF16 tiles
otherwise; ``AMO_GG_AMX=0`` switches AMX off per call; per-group ATen mm, the default without AMX
for dX and dW when groups average >= 128 rows, forced with ``AMO_GG_MM=1``, its groups split over the
threads unless ``AMO_GG_MM_PAR=0``; ``AMO_GG_MM=0`` keeps the tiles)
against the fp64 reference, on shapes that
hit every edge of the AMX tiling: row tails (1..40 rows), K not a multiple of 32 (falls back to
AVX-512 in fwd/dX; zero-padded pairs in dW), column tails, trans_b, empty groups."""

import os

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _backends
from ascend_moe_ops.testing import assert_close_to_ref, cpu_flags

pytestmark = pytest.mark.skipif("native" not in _backends.available_backends("grouped_gemm", "cpu"),
                                reason="native backend not built")


@pytest.fixture(params=["amx-if-present", "avx512", "mm", "mm-one-group-at-a-time"])
def kernel(request, monkeypatch):
    monkeypatch.delenv("AMO_GG_MM_PAR", raising=False)
    if request.param == "avx512":
        monkeypatch.setenv("AMO_GG_AMX", "0")
        monkeypatch.setenv("AMO_GG_MM", "0")
    elif request.param.startswith("mm"):
        monkeypatch.setenv("AMO_GG_MM", "1")
        if request.param == "mm-one-group-at-a-time":
            monkeypatch.setenv("AMO_GG_MM_PAR", "0")
    else:
        monkeypatch.delenv("AMO_GG_AMX", raising=False)
        monkeypatch.delenv("AMO_GG_MM", raising=False)
    return request.param


CASES = [  # (sizes, K, N)
    ([1, 0, 17, 40, 32, 5], 64, 80),
    ([33, 16, 0, 48], 96, 64),
    ([7, 29], 80, 48),       # K % 32 != 0: fwd/dX take the AVX-512 kernel
    ([300, 3], 512, 272),    # more rows than one item (MC) and a column tail
    ([45, 0, 70], 64, 600),  # AMX items are 512 columns wide: a second N-tile with an 88-column tail
]


@pytest.mark.parametrize("sizes,K,N", CASES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_fwd_matches_reference(kernel, sizes, K, N, trans_b):
    g = torch.Generator().manual_seed(sum(sizes) + K)
    E, M = len(sizes), sum(sizes) + 3  # 3 rows past the groups must come out zero
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(E, N, K, generator=g) if trans_b else torch.randn(E, K, N, generator=g)).bfloat16()
    gs = torch.tensor(sizes)
    with amo.use_backend("native"):
        out = amo.grouped_gemm(x, w, gs, trans_b=trans_b)
    with amo.use_backend("reference"):
        ref = amo.grouped_gemm(x.double(), w.double(), gs, trans_b=trans_b)
        low = amo.grouped_gemm(x, w, gs, trans_b=trans_b)
    assert_close_to_ref(out, ref, dtype=torch.bfloat16, torch_lowp=low, name=f"fwd {kernel}")
    assert torch.equal(out[sum(sizes):], torch.zeros_like(out[sum(sizes):]))


@pytest.mark.parametrize("sizes,P,Q", [([1, 0, 17, 40, 33, 5], 64, 80), ([300, 3, 0], 272, 64)])
def test_dw_matches_reference(kernel, sizes, P, Q):
    g = torch.Generator().manual_seed(sum(sizes) + P)
    M = sum(sizes)
    a = torch.randn(M, P, generator=g).bfloat16()
    b = torch.randn(M, Q, generator=g).bfloat16()
    gs = torch.tensor(sizes)
    with amo.use_backend("native"):
        out = amo.grouped_gemm_dw(a, b, gs)
    with amo.use_backend("reference"):
        ref = amo.grouped_gemm_dw(a.double(), b.double(), gs)
        low = amo.grouped_gemm_dw(a, b, gs)
    assert_close_to_ref(out, ref, dtype=torch.bfloat16, torch_lowp=low, name=f"dW {kernel}")
    for e, s in enumerate(sizes):
        if s == 0:
            assert torch.equal(out[e], torch.zeros_like(out[e]))


def test_nan_in_x_stays_in_its_row(kernel):
    x = torch.randn(64, 64).bfloat16()
    x[5, 7] = float("nan")
    w = torch.randn(2, 64, 32).bfloat16()
    with amo.use_backend("native"):
        out = amo.grouped_gemm(x, w, torch.tensor([32, 32]))
    bad = torch.isnan(out.float()).any(1)
    assert bad[5] and int(bad.sum()) == 1


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the mm rule applies to AVX512_BF16 CPUs")
@pytest.mark.parametrize("kind,rows,path", [("fwd", 128, "0"), ("fwd", 64, "0"), ("dX", 128, "1"), ("dX", 127, "0"),
                                            ("dW", 128, "1"), ("dW", 127, "0")])
def test_default_path_rule(monkeypatch, kind, rows, path):
    """Without AMX (switched off here): the plain forward always runs the tile kernel; dX (trans_b)
    and dW take the per-group mm when the bf16 groups average >= 128 rows, the tile kernel below.
    The profiler sees the mm path's ATen calls, and the default output equals the forced path's."""
    monkeypatch.setenv("AMO_GG_AMX", "0")
    _check_default_path(monkeypatch, kind, rows, path)


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="the AMX rule applies to AMX-BF16 CPUs")
@pytest.mark.parametrize("kind,rows,path", [("fwd", 128, "1"), ("fwd", 127, "0"), ("dX", 128, "1"),
                                            ("dX", 64, "0"), ("dW", 128, "0"), ("dW", 64, "0")])
def test_default_path_rule_amx(monkeypatch, kind, rows, path):
    """With AMX: the forward and dX take the per-group mm (oneDNN's AMX GEMM) when the bf16 groups
    average >= 128 rows, the AMX tile kernel below; dW always runs the AMX tile kernel."""
    monkeypatch.delenv("AMO_GG_AMX", raising=False)
    # the AMX tile kernel and oneDNN's AMX GEMM give bitwise equal sums here: the profiler's
    # count of aten::mm calls is what tells the two paths apart
    _check_default_path(monkeypatch, kind, rows, path, paths_differ=False)


def _check_default_path(monkeypatch, kind, rows, path, paths_differ=True):
    g = torch.Generator().manual_seed(rows)
    sizes = torch.tensor([rows, 0, rows])
    x = torch.randn(int(sizes.sum()), 2048, generator=g).bfloat16()
    if kind == "dW":
        b = torch.randn(int(sizes.sum()), 80, generator=g).bfloat16()
        run = lambda: amo.grouped_gemm_dw(x, b, sizes)  # noqa: E731
    else:
        w = torch.randn(3, 80, 2048, generator=g).bfloat16() if kind == "dX" else \
            torch.randn(3, 2048, 80, generator=g).bfloat16()
        run = lambda: amo.grouped_gemm(x, w, sizes, trans_b=kind == "dX")  # noqa: E731
    with amo.use_backend("native"):
        monkeypatch.delenv("AMO_GG_MM", raising=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            default = run()
        monkeypatch.setenv("AMO_GG_MM", path)
        forced = run()
        if paths_differ and kind != "dW":
            monkeypatch.setenv("AMO_GG_MM", "0" if path == "1" else "1")
            other = run()
    mm_calls = sum(1 for e in prof.events() if e.name == "aten::mm")  # the mm path's at::mm_out
    assert mm_calls == (2 if path == "1" else 0)  # one per non-empty group, or none
    assert torch.equal(default, forced)
    if paths_differ and kind != "dW":  # dW's two paths give bitwise equal sums here; the profiler tells them apart
        assert not torch.equal(default, other)  # the two paths round differently: the rule is seen
