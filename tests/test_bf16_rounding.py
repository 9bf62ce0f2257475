"""The CPU side has one fp32 -> bf16 rounding (csrc/common/bf16.h, its 16-lane form in
csrc/common/vec.h): round to nearest even, every NaN -> 0x7FC0 (as c10::BFloat16; PyTorch's own
vectorized ``.to(torch.bfloat16)`` writes 0xFFFF instead, so NaNs are compared by position and
our canonical bits), overflow -> inf, otherwise the bits of ``tensor.to(torch.bfloat16)``. Checked bit for bit through the native kernels that store bf16
(grouped GEMM, both its micro-kernel store and its tile store, and unpermute) on fp32 values
chosen to be exact sums: ties to even both ways, values just off a tie, NaN made inside the kernel
(-inf * 0, whose x86 default NaN is negative: a sign-keeping conversion would give 0xFFC0), and
sums beyond the largest bf16."""

import pytest
import torch

import ascend_moe_ops as amo
from conftest import backends

B = torch.bfloat16
INF = float("inf")
# (a, b): the fp32 sum a + b is exact; a, b are bf16 values
PAIRS = [
    (1.0, 2.0 ** -8),                        # tie -> even (down to 1.0)
    (1.0 + 2.0 ** -7, 2.0 ** -8),            # tie -> even (up to 1 + 2^-6)
    (-1.0 - 2.0 ** -7, -2.0 ** -8),          # the same, negative
    (1.0, 2.0 ** -8 + 2.0 ** -15),           # just above a tie -> up
    (1.0 + 2.0 ** -7, 2.0 ** -8 - 2.0 ** -16),  # just below a tie -> down
    (3.0, 2.0 ** -7 + 2.0 ** -9),            # plain rounding
    (3.3895313892515355e38, 3.3895313892515355e38 * 2.0 ** -8),  # rounds past the largest bf16 -> inf
    (-INF, 0.0),                             # a*1 + b*1 = -inf (kept)
]


def _assert_bits(out, want_f32):
    """``out`` (bf16) has torch's rounding of ``want_f32`` bit for bit, and 0x7FC0 at its NaNs."""
    nan = torch.isnan(want_f32)
    got = out.view(torch.int16)
    assert torch.equal(torch.isnan(out), nan), "NaN positions"
    assert (got[nan] == 0x7FC0).all(), f"NaN bits {got[nan].tolist()[:4]}, expected 0x7FC0"
    want = want_f32.to(B).view(torch.int16)
    bad = (got != want) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.skipif("native" not in backends("grouped_gemm"), reason="native backend not built")
@pytest.mark.parametrize("N", [1, 80], ids=["N1", "N80"])  # one column / a full 64-column panel + tail
def test_native_grouped_gemm_bf16_rounding_is_torchs(N):
    rows = [[a, b] for a, b in PAIRS] + [[-INF, 1.0]]
    x = torch.tensor(rows, dtype=torch.float64).to(B)
    assert torch.equal(x.double(), torch.tensor(rows, dtype=torch.float64)), "inputs must be bf16 values"
    w = torch.ones(1, 2, N, dtype=B)
    w[0, :, 0] = torch.tensor([1.0, 1.0])
    # a NaN made in the kernel: row (-inf, 1) times column (0, 1) -> -inf * 0 + 1
    w[0, 0, N - 1] = 0.0
    sizes = torch.tensor([x.shape[0]])
    with amo.use_backend("native"):
        out = amo.grouped_gemm(x, w, sizes)
    want = x.float() @ w[0].float()
    assert torch.isnan(want[-1, N - 1])
    _assert_bits(out, want)


@pytest.mark.skipif("native" not in backends("moe_unpermute"), reason="native backend not built")
def test_native_unpermute_bf16_rounding_is_torchs():
    # out[t] = permuted[2t] + permuted[2t+1]: the same exact sums, through common/vec.h's store
    a = torch.tensor([p[0] for p in PAIRS], dtype=torch.float64)
    b = torch.tensor([p[1] for p in PAIRS], dtype=torch.float64)
    H = 16
    perm = torch.stack([a, b], 1).reshape(-1, 1).expand(-1, H).to(B).contiguous()
    perm[-1, -1] = float("nan")  # a NaN input row piece
    T = len(PAIRS)
    row_map = torch.arange(2 * T, dtype=torch.int32).reshape(T, 2)
    with amo.use_backend("native"):
        out = amo.moe_unpermute(perm, row_map)
    _assert_bits(out, perm.float()[0::2] + perm.float()[1::2])
