"""The large-output block cache of the native CPU ops (csrc/common/alloc.h): outputs of >= 2 MiB
come from pre-faulted, reused blocks. A reused block holds the previous output's bytes, so these
tests check that every output element is rewritten (grouped GEMM zero groups and rows past the
routed ones, permute), that the tensor is an ordinary resizable CPU tensor, and that the cap and
release work."""

import os
import subprocess
import sys

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _backends
from ascend_moe_ops.testing import assert_close_to_ref

pytestmark = pytest.mark.skipif("native" not in _backends.available_backends("grouped_gemm", "cpu"),
                                reason="native backend not built")

BIG = 8 << 20  # above the threshold in alloc.h (2 MiB)


def _C():
    from ascend_moe_ops import _C
    return _C


def _stats():
    return _C()._large_blocks_stats()


def test_stats_and_default_cap():
    s = _stats()
    assert set(s) == {"cached_bytes", "cached_blocks", "hits", "misses", "cap_bytes"}
    assert 0 < s["cap_bytes"] <= 2 << 30


def test_reused_block_is_fully_rewritten_grouped_gemm_dw():
    """dW [E, P, Q] of 8 MiB with most groups empty: the second call gets the first call's block
    (hit) holding its values, and must still write exact zeros for the empty groups."""
    E, P, Q = 64, 256, 256
    assert E * P * Q * 2 >= BIG
    gen = torch.Generator().manual_seed(0)
    _C()._large_blocks_release()
    for call, used in enumerate(([3, 5, 60], [0, 7, 33])):  # the second call's empty groups were full before
        sizes = torch.zeros(E, dtype=torch.int64)
        sizes[used] = torch.tensor([9, 4, 13])
        M = int(sizes.sum())
        a = torch.randn(M, P, generator=gen).bfloat16()
        b = torch.randn(M, Q, generator=gen).bfloat16()
        before = _stats()
        with amo.use_backend("native"):
            out = amo.grouped_gemm_dw(a, b, sizes)
        after = _stats()
        if call == 1:
            assert after["hits"] == before["hits"] + 1  # the first call's freed block, reused
        with amo.use_backend("reference"):
            ref = amo.grouped_gemm_dw(a.double(), b.double(), sizes)
        assert_close_to_ref(out, ref)
        empty = sizes == 0
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        del out


def test_reused_block_forward_rows_past_the_sum_are_zero():
    M, K, N, E = 4096, 64, 1024, 4  # out [M, N] bf16 = 8 MiB
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(E, K, N, generator=gen).bfloat16()
    for call in range(2):
        x = torch.randn(M, K, generator=gen).bfloat16() * (call + 1)
        sizes = torch.tensor([1000, 0, 2000, 96]) if call == 0 else torch.tensor([10, 0, 20, 6])
        with amo.use_backend("native"):
            out = amo.grouped_gemm(x, w, sizes)
        with amo.use_backend("reference"):
            ref = amo.grouped_gemm(x.double(), w.double(), sizes)
        assert_close_to_ref(out, ref)
        assert torch.equal(out[int(sizes.sum()):], torch.zeros_like(out[int(sizes.sum()):]))
        del out


def test_reused_block_permute_matches_reference():
    T, H, E, K = 512, 2048, 16, 4  # permuted [T*K, H] bf16 = 8 MiB
    gen = torch.Generator().manual_seed(2)
    for call in range(2):
        tokens = torch.randn(T, H, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        with amo.use_backend("native"):
            got = amo.moe_permute(tokens, ids, num_experts=E)
        with amo.use_backend("reference"):
            ref = amo.moe_permute(tokens, ids, num_experts=E)
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.row_id_map, ref.row_id_map)
        del got


def test_output_is_a_plain_resizable_tensor():
    with amo.use_backend("native"):
        out = amo.grouped_gemm(torch.randn(4096, 32).bfloat16(), torch.randn(1, 32, 1024).bfloat16(),
                               torch.tensor([4096]))
    assert out.is_contiguous() and out.device.type == "cpu" and out.untyped_storage().resizable()
    ref = out[:7].clone()
    out.resize_(8192, 1024)  # grows through the same allocator
    assert out.shape == (8192, 1024) and torch.equal(out[:7], ref)
    out.resize_(3, 5)
    assert out.shape == (3, 5)


def test_release_returns_every_cached_block():
    with amo.use_backend("native"):
        out = amo.grouped_gemm(torch.randn(4096, 32).bfloat16(), torch.randn(1, 32, 1024).bfloat16(),
                               torch.tensor([4096]))
    del out
    assert _stats()["cached_bytes"] >= BIG
    _C()._large_blocks_release()
    s = _stats()
    assert s["cached_bytes"] == 0 and s["cached_blocks"] == 0


def test_cap_zero_turns_the_cache_off():
    code = ("import torch, ascend_moe_ops as amo; from ascend_moe_ops import _C\n"
            "for _ in range(3):\n"
            "    with amo.use_backend('native'):\n"
            "        o = amo.grouped_gemm(torch.randn(4096, 32).bfloat16(), torch.randn(1, 32, 1024).bfloat16(),"
            " torch.tensor([4096]))\n"
            "    del o\n"
            "s = _C._large_blocks_stats(); print(s['cap_bytes'], s['cached_bytes'], s['hits'])\n")
    env = dict(os.environ, ASCEND_MOE_OPS_CPU_CACHE_MB="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "0", "0"]
