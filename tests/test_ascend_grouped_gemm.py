"""The grouped GEMM AscendC Cube kernels on the emulation layer (ascendc-emu backend) and the
Cube-side rules of the emulator.

* Rule enforcement: tiny Cube kernels that each break one rule raise the emulator's error (L0A/L0C
  capacity, Mmad dtypes / memories / fractal alignment / operand size / k range, ND2NZ overlap and
  destination, LoadData bounds, Fixpipe quantPre and stride, UB on an AIC core, L1 on an AIV core,
  vector ops on L1), and stale K padding shows up as NaN.
* The kernels with tiny base blocks and few cores (many tiles, several K chunks per tile, several
  items per core), dW with empty groups, the fp16 versions of the fp32-only checks of
  tests/test_grouped_gemm.py, and fp32 refused with a clear error.
"""

import pytest
import torch

import ascend_moe_ops as amo
from _ascend_cxx import assert_emu_error, driver_fixture, needs_emu as _needs_emu, rule_cases, run_case
from ascend_moe_ops.testing import assert_close_to_ref

needs_emu = _needs_emu("grouped_gemm")[1]

RULES = [
    ("l0a_overflow", "L0A overflow: queue #0 buffer 1 needs 40960 B"),
    ("l0c_overflow", "L0C overflow"),
    ("mmad_fp32_inputs", r"Mmad on \(float, float\) -> float: the emulated Cube takes \(half, half\)"),
    ("mmad_operand_in_wrong_memory", "lives in L0A, expected L0B"),
    ("mmad_unaligned_operand", "not 512-byte aligned"),
    ("mmad_operand_too_small", "1536 elements needed"),
    ("mmad_k_zero", r"must be in \[1, 4095\]"),
    ("nd2nz_overlapping_blocks", "column blocks would overlap"),
    ("nd2nz_into_l0", "lives in L0A, expected L1"),
    ("loaddata_past_l1", "LoadData source: 1280 elements needed"),
    ("fixpipe_quant_mismatch", "quantPre does not match"),
    ("fixpipe_src_stride", "multiple of 16"),
    ("ub_on_aic", "an AIC \\(Cube\\) core has no UB"),
    ("l1_on_aiv", "L1 buffers exist on AIC \\(Cube\\) cores only"),
    ("vector_op_on_l1", "lives in L1, not UB"),
]


cube_driver = driver_fixture("emu_cube_rules_driver")


@rule_cases(RULES)
def test_emulator_enforces_cube_rule(cube_driver, case, match):
    assert_emu_error(run_case(cube_driver, case), case, match)


def test_emulator_cube_path_and_k_padding(cube_driver):
    assert run_case(cube_driver, "ok_tile") == "ok"
    assert run_case(cube_driver, "k_padding_not_zeroed") == "nan", "stale K padding must poison the sum"
    assert run_case(cube_driver, "k_padding_zeroed") == "ok"


def _inputs(M, K, N, sizes, dtype, trans_b, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = len(sizes)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = torch.randn(E, N, K, generator=g) if trans_b else torch.randn(E, K, N, generator=g)
    return x, (w / max(K, 1) ** 0.5).to(dtype), torch.tensor(sizes)


def _ref(fn, *args, **kw):
    with amo.use_backend("reference"):
        return fn(*args, **kw)


def _emu(fn, *args, **kw):
    with amo.use_backend("ascendc-emu"):
        return fn(*args, **kw)


@needs_emu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trans_b", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("aic, cap", [(3, 32), (1, 16), (5, 48)])
def test_small_tiles_few_cores(monkeypatch, dtype, trans_b, aic, cap):
    """Tiny base blocks force many M/N tiles, several L1 chunks and L0 steps per tile and several
    items per core; forward, dx and dW (with empty groups) against fp64."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", str(aic))
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", str(cap))
    sizes = [40, 0, 17, 1, 0, 33]
    x, w, s = _inputs(100, 83, 70, sizes, dtype, trans_b)
    out = _emu(amo.grouped_gemm, x, w, s, trans_b=trans_b)
    assert_close_to_ref(out, _ref(amo.grouped_gemm, x.double(), w.double(), s, trans_b=trans_b), dtype=dtype,
                        torch_lowp=_ref(amo.grouped_gemm, x, w, s, trans_b=trans_b))
    assert (out[91:] == 0).all()
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn(100, 70, generator=torch.Generator().manual_seed(2)).to(dtype)
    with amo.use_backend("ascendc-emu"):
        amo.grouped_gemm(xx, ww, s, trans_b=trans_b).backward(dy)
    rx, rw = x.double().requires_grad_(), w.double().requires_grad_()
    with amo.use_backend("reference"):
        amo.grouped_gemm(rx, rw, s, trans_b=trans_b).backward(dy.double())
    lx, lw = x.clone().requires_grad_(), w.clone().requires_grad_()
    with amo.use_backend("reference"):
        amo.grouped_gemm(lx, lw, s, trans_b=trans_b).backward(dy)
    assert_close_to_ref(xx.grad, rx.grad, dtype=dtype, torch_lowp=lx.grad, name="grad x")
    assert_close_to_ref(ww.grad, rw.grad, dtype=dtype, torch_lowp=lw.grad, name="grad weight")
    assert (ww.grad[torch.tensor(sizes) == 0] == 0).all()


@needs_emu
def test_fp32_is_refused_clearly():
    x, w, s = _inputs(8, 16, 16, [8], torch.float32, False)
    with amo.use_backend("ascendc-emu"), pytest.raises(TypeError, match="grouped_gemm: x must have dtype in .*float16/bfloat16 inputs only"):
        amo.grouped_gemm(x, w, s)
    with amo.use_backend("ascendc-emu"), pytest.raises(TypeError, match="grouped_gemm_dw: a must have dtype in .*float16/bfloat16 inputs only"):
        amo.grouped_gemm_dw(x, x, s)


@needs_emu
def test_fp16_int32_int64_sizes_and_non_contiguous():
    x, w, s = _inputs(97, 129, 61, [30, 0, 41, 1, 20], torch.float16, False)
    a = _emu(amo.grouped_gemm, x, w, s.to(torch.int32))
    assert torch.equal(a, _emu(amo.grouped_gemm, x, w, s.to(torch.int64)))
    x_nc = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype).t()
    x_nc.copy_(x)
    w_nc = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    assert torch.equal(_emu(amo.grouped_gemm, x_nc, w_nc, s), a)


@needs_emu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_dw_direct_empty_groups(dtype):
    g = torch.Generator().manual_seed(3)
    s = torch.tensor([5, 0, 9, 1, 0])
    a = torch.randn(17, 11, generator=g).to(dtype)
    b = torch.randn(17, 7, generator=g).to(dtype)
    out = _emu(amo.grouped_gemm_dw, a, b, s)
    assert_close_to_ref(out, _ref(amo.grouped_gemm_dw, a.double(), b.double(), s), dtype=dtype,
                        torch_lowp=_ref(amo.grouped_gemm_dw, a, b, s))
    assert (out[1] == 0).all() and (out[4] == 0).all()
    all_empty = _emu(amo.grouped_gemm_dw, a, b, torch.zeros(3, dtype=torch.int64))
    assert all_empty.shape == (3, 11, 7) and (all_empty == 0).all()


@needs_emu
@pytest.mark.parametrize("trans_b", [False, True])
def test_opcheck_fp16(trans_b):
    x, w, s = _inputs(40, 16, 12, [10, 0, 20, 1, 5], torch.float16, trans_b)
    x.requires_grad_()
    w.requires_grad_()
    with amo.use_backend("ascendc-emu"):
        torch.library.opcheck(torch.ops.ascend_moe_ops.grouped_gemm.default, (x, w, s, trans_b))
        torch.library.opcheck(torch.ops.ascend_moe_ops.grouped_gemm_dw.default,
                              (x, torch.randn(40, 6, dtype=torch.float16, requires_grad=True), s))


@needs_emu
def test_full_size_base_block():
    """The full 128 x 128 x 128 base block of a short reduction (K = 512: 4 K steps per L1 chunk,
    two L0C tiles) on the default 910B2 chip, with the backend's check that L1/L0A/L0B/L0C use
    equals the tiling's plan."""
    x, w, s = _inputs(300, 512, 256, [100, 0, 200], torch.bfloat16, False)
    out = _emu(amo.grouped_gemm, x, w, s)
    assert_close_to_ref(out, _ref(amo.grouped_gemm, x.double(), w.double(), s), dtype=torch.bfloat16,
                        torch_lowp=_ref(amo.grouped_gemm, x, w, s))


@needs_emu
@pytest.mark.parametrize("trans_b", [False, True], ids=["nn", "nt"])
def test_long_reduction_pairs_m_tiles(trans_b):
    """Reductions > 512 take items of two 128-row M sub-tiles sharing each B chunk in L1 (mPair 2,
    one L0C tile each): groups of 300 (256 + 44 rows), 260 (256 + 4) and 140 (128 + 12) rows, a
    ragged K (600, not a multiple of 16) and N (144); dW with one 600-row group (reduction 600) and
    K = 300 output rows (256 + 44)."""
    x, w, s = _inputs(700, 600, 144, [300, 0, 260, 140], torch.bfloat16, trans_b, seed=3)
    out = _emu(amo.grouped_gemm, x, w, s, trans_b=trans_b)
    assert_close_to_ref(out, _ref(amo.grouped_gemm, x.double(), w.double(), s, trans_b=trans_b),
                        dtype=torch.bfloat16, torch_lowp=_ref(amo.grouped_gemm, x, w, s, trans_b=trans_b))
    g = torch.Generator().manual_seed(4)
    a = torch.randn(600, 300, generator=g).to(torch.bfloat16)
    b = torch.randn(600, 144, generator=g).to(torch.bfloat16)
    sz = torch.tensor([600])
    dw = _emu(amo.grouped_gemm_dw, a, b, sz)
    assert_close_to_ref(dw, _ref(amo.grouped_gemm_dw, a.double(), b.double(), sz), dtype=torch.bfloat16,
                        torch_lowp=_ref(amo.grouped_gemm_dw, a, b, sz))


@needs_emu
@pytest.mark.parametrize("cap", [16, 32])
def test_dw_one_row_tiles_and_groups(monkeypatch, cap):
    """A2 trigger shapes for the weight gradient: K = 33 leaves 1-row output tiles (Mmad m = 1 would
    run GEMV on A2; the kernel promotes m to 16), a 1-row group (reduction of one row), an empty
    group, and K % 16 != 0."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "3")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", str(cap))
    g = torch.Generator().manual_seed(5)
    s = torch.tensor([20, 1, 0, 12])
    a = torch.randn(33, 33, generator=g).to(torch.float16)
    b = torch.randn(33, 18, generator=g).to(torch.float16)
    out = _emu(amo.grouped_gemm_dw, a, b, s)
    assert_close_to_ref(out, _ref(amo.grouped_gemm_dw, a.double(), b.double(), s), dtype=torch.float16,
                        torch_lowp=_ref(amo.grouped_gemm_dw, a, b, s))
    assert (out[2] == 0).all()
