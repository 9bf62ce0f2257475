"""Unit tests of ascend_moe_ops.testing itself: the parity assertion must fail on what it claims to
catch (inf/NaN in the wrong places, errors above the 2x bound, shape mismatches) and pass on
legitimate results; the attention baselines must be what they say."""

import math

import pytest
import torch

from ascend_moe_ops.reference import flash_attention as ref
from ascend_moe_ops.testing import (ERROR_FACTOR, TOLERANCES, assert_close_to_ref, max_abs_err,
                                    poison_like, torch_attention, torch_attention_grads)

INF, NAN = math.inf, math.nan


def _t(*xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def test_exact_and_within_tolerance_pass():
    r = torch.linspace(-3, 3, 50, dtype=torch.float64)
    assert_close_to_ref(r.float(), r)
    assert_close_to_ref(r.to(torch.bfloat16), r)  # one bf16 rounding is inside the bf16 floor
    assert_close_to_ref(torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float64))


@pytest.mark.parametrize("out, ref64, where", [
    (_t(1.0, NAN), _t(1.0, 2.0), "NaN where the reference is finite"),
    (_t(1.0, INF), _t(1.0, 2.0), "inf where the reference is finite"),
    (_t(1.0, 2.0), _t(1.0, NAN), "finite where the reference is NaN"),
    (_t(1.0, 2.0), _t(1.0, INF), "finite where the reference is inf"),
    (_t(1.0, -INF), _t(1.0, INF), "-inf where the reference is +inf"),
    (_t(1.0, NAN), _t(1.0, -INF), "NaN where the reference is -inf"),
    (_t(INF, 2.0), _t(1.0, INF), "inf moved to another position"),
])
def test_nonfinite_positions_must_match(out, ref64, where):
    with pytest.raises(AssertionError, match="inf/NaN positions differ"):
        assert_close_to_ref(out.float(), ref64)


def test_matching_nonfinite_positions_pass_and_finite_part_is_still_checked():
    r = _t(1.0, NAN, INF, -INF, 2.0)
    assert_close_to_ref(_t(1.0, NAN, INF, -INF, 2.0).float(), r)
    assert_close_to_ref(_t(1.0, NAN, INF, -INF, 2.0).to(torch.bfloat16), r, torch_lowp=r.float())
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to_ref(_t(1.0, NAN, INF, -INF, 2.5).float(), r)


def test_two_x_rule_bound():
    r = torch.zeros(4, dtype=torch.float64)
    atol = TOLERANCES[torch.float16][0]
    lowp = _t(0.0, 0.0, 0.01, 0.0)  # PyTorch's own low-precision error: 0.01
    ok = _t(0.0, ERROR_FACTOR * 0.01, 0.0, 0.0)
    assert_close_to_ref(ok.half(), r, dtype=torch.float16, torch_lowp=lowp)
    bad = _t(0.0, ERROR_FACTOR * 0.01 + 2 * atol + 1e-3, 0.0, 0.0)
    with pytest.raises(AssertionError, match="first failure at \\(1,\\)"):
        assert_close_to_ref(bad.half(), r, dtype=torch.float16, torch_lowp=lowp)
    # without a baseline only the floor applies
    with pytest.raises(AssertionError):
        assert_close_to_ref(ok.half(), r, dtype=torch.float16)


def test_baseline_nonfinite_does_not_open_the_bound():
    """A NaN/inf in PyTorch's own low-precision run must not make every error acceptable."""
    r = torch.zeros(3, dtype=torch.float64)
    lowp = _t(NAN, INF, 0.0)
    with pytest.raises(AssertionError, match="max error"):
        assert_close_to_ref(_t(0.0, 0.0, 1.0).float(), r, torch_lowp=lowp)


def test_shape_mismatch_fails():
    with pytest.raises(AssertionError, match="shape"):
        assert_close_to_ref(torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="torch_lowp shape"):
        assert_close_to_ref(torch.zeros(3), torch.zeros(3, dtype=torch.float64), torch_lowp=torch.zeros(1))


def test_max_abs_err():
    assert max_abs_err(_t(1.0, 5.0, 3.0), _t(1.5, 5.0, 1.0)) == 2.0
    assert max_abs_err(torch.empty(0), torch.empty(0)) == 0.0
    assert max_abs_err(_t(1.0, 100.0), _t(1.0, INF)) == 0.0  # only the reference's finite positions
    assert max_abs_err(_t(NAN, 1.0), _t(1.0, 1.0)) == INF


def test_poison_like():
    p = poison_like(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert p.shape == (2, 3) and p.dtype == torch.bfloat16 and torch.isnan(p).all()


def test_torch_attention_baseline_matches_reference_in_fp64():
    """The baselines compute attention (checked in fp64 against the reference) with autograd
    gradients, in the inputs' own dtype."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 1, 6, 6, 13])
    q = torch.randn(13, 2, 12, generator=g, dtype=torch.float64)
    k = torch.randn(13, 2, 8, generator=g, dtype=torch.float64)
    kr = torch.randn(13, 4, generator=g, dtype=torch.float64)
    v = torch.randn(13, 2, 6, generator=g, dtype=torch.float64)
    do = torch.randn(13, 2, 6, generator=g, dtype=torch.float64)
    for causal in (True, False):
        out, lse = ref.flash_attention_fwd(q, k, v, kr, cu, cu, 7, 7, causal, 0.3)
        grads = ref.flash_attention_bwd(do, q, k, v, kr, out, lse, cu, cu, 7, 7, causal, 0.3)
        got = torch_attention_grads(q, k, v, kr, cu, do, causal=causal, softmax_scale=0.3)
        for a, b in zip(got, (out, lse) + tuple(grads)):
            torch.testing.assert_close(a.double(), b, atol=1e-6, rtol=1e-6)
    o, l = torch_attention(*(t.half() for t in (q, ref.full_keys(k, kr, 2), v)), cu, causal=True,
                           softmax_scale=0.3)
    assert o.dtype == torch.float16 and l.shape == (2, 13)
