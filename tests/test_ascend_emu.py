"""The AscendC emulation layer (csrc/ascend/emu) and the ascendc-emu backend.

* Rule enforcement: tiny kernels that each break one hardware/API rule must raise the emulator's
  error (misaligned DataCopy, UB overflow, queue protocol, use after free, ...).
* The real kernels with multi-tile rows and few cores (forced through the emu backend's test
  knobs), against the reference, and at a DeepSeek-V3 row size.
"""

import subprocess

import pytest
import torch

import ascend_moe_ops as amo
from _ascend_cxx import assert_emu_error, driver, driver_fixture, needs_emu as _needs_emu, rule_cases, run_case
from ascend_moe_ops.testing import assert_close_to_ref
from test_moe_permute import _inputs

needs_emu = _needs_emu("moe_permute")[1]

RULES = [
    ("misaligned_datacopy", "DataCopy \\(GM->UB\\) moves whole 32-byte blocks: 7 x float = 28 B"),
    ("ub_overflow", "UB overflow: queue #0 buffer 1 needs 102400 B"),
    ("unaligned_ub_operand", "not 32-byte aligned"),
    ("alloc_without_free", "all 2 buffers are in use"),
    ("dequeue_empty", "the queue is empty"),
    ("enqueue_past_depth", "queue depth 1 exceeded"),
    ("use_after_free", "after FreeTensor"),
    ("use_while_queued", "while it is queued"),
    ("leak_at_block_end", "block 0 ended with queue #0 buffer 0 still allocated"),
    ("free_foreign_tensor", "belongs to queue #0"),
    ("bf16_arithmetic", "no arithmetic for this type"),
    ("partial_overlap", "partially overlaps"),
    ("narrowing_cast_without_rounding", "CAST_RINT"),
    ("gm_out_of_bounds", "GM access out of bounds"),
    ("two_pipes", "a second TPipe"),
]


rules_driver = driver_fixture("emu_rules_driver")


@rule_cases(RULES)
def test_emulator_enforces_rule(rules_driver, case, match):
    assert_emu_error(run_case(rules_driver, case), case, match)


@pytest.mark.parametrize("case", ["ragged_datacopypad_ok", "uninitialized_ub_is_nan"])
def test_emulator_accepts_valid_kernel(rules_driver, case):
    assert run_case(rules_driver, case) == "ok"


@needs_emu
def test_emu_errors_surface_as_runtime_error(monkeypatch):
    """An emulated core with less UB than the tiling plans for: the kernel's TPipe::InitBuffer fails
    inside the backend and the emulator's error reaches Python as a RuntimeError."""
    tokens, routing, probs = _inputs(8, 4096, 4, 2, "index", torch.float32)
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_UB_LIMIT", "16384")
    with amo.use_backend("ascendc-emu"), pytest.raises(RuntimeError, match="AscendC emulator: UB overflow"):
        amo.moe_permute(tokens, routing, probs, num_experts=4)
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_MAX_TILE_COLS", "512")  # a tiling that fits: fine
    with amo.use_backend("ascendc-emu"):
        amo.moe_permute(tokens, routing, probs, num_experts=4)


@needs_emu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("H", [97, 128, 200])
@pytest.mark.parametrize("mode", [dict(), dict(capacity=3), dict(align=4)], ids=["dropless", "capacity", "align"])
def test_multi_tile_rows_and_few_cores(monkeypatch, dtype, H, mode):
    """Tiles of 32 columns (several per row, ragged tails) on 3 cores, every op, vs the reference."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_MAX_TILE_COLS", "32")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIV", "3")
    T, E, K = 19, 6, 3
    tokens, routing, probs = _inputs(T, H, E, K, "index", dtype)
    with amo.use_backend("reference"):
        ref = amo.moe_permute(tokens, routing, probs, num_experts=E, **mode)
    with amo.use_backend("ascendc-emu"):
        res = amo.moe_permute(tokens, routing, probs, num_experts=E, **mode)
    for a, b in zip(res, ref):
        assert torch.equal(a, b)
    rows = torch.nan_to_num(ref.tokens.float() * 1.5 + 0.25).to(dtype)
    g = torch.randn(T, H).to(dtype)
    op_bwd = torch.ops.ascend_moe_ops.moe_unpermute_backward.default
    outs = {}
    for bk in ("ascendc-emu", "reference"):
        with amo.use_backend(bk):
            outs[bk] = (amo.moe_unpermute(rows, ref.row_id_map, probs), op_bwd(g, rows, ref.row_id_map, probs))
    with amo.use_backend("reference"):
        ref64 = amo.moe_unpermute(rows.double(), ref.row_id_map, probs.double())
        bwd64 = op_bwd(g.double(), rows.double(), ref.row_id_map, probs.double())
    assert_close_to_ref(outs["ascendc-emu"][0], ref64, dtype=dtype, torch_lowp=outs["reference"][0])
    assert_close_to_ref(outs["ascendc-emu"][1][0], bwd64[0], dtype=dtype, torch_lowp=outs["reference"][1][0],
                        name="grad permuted")
    assert_close_to_ref(outs["ascendc-emu"][1][1], bwd64[1], dtype=torch.float32,
                        torch_lowp=outs["reference"][1][1], name="grad probs")


@needs_emu
def test_deepseek_v3_row_size():
    """H = 7168 bf16 rows (one 14 KiB tile each) through permute and unpermute on 48 cores."""
    T, H, E, K = 64, 7168, 256, 8
    tokens, routing, probs = _inputs(T, H, E, K, "index", torch.bfloat16)
    with amo.use_backend("reference"):
        ref = amo.moe_permute(tokens, routing, probs, num_experts=E, align=16)
        back_ref = amo.moe_unpermute(ref.tokens, ref.row_id_map, probs)
    with amo.use_backend("ascendc-emu"):
        res = amo.moe_permute(tokens, routing, probs, num_experts=E, align=16)
        back = amo.moe_unpermute(res.tokens, res.row_id_map, probs)
    for a, b in zip(res, ref):
        assert torch.equal(a, b)
    assert torch.equal(back, back_ref), "fp32 slot-order sum: bitwise equal to the reference"


def test_emulated_float16_and_bfloat16_conversions_match_torch():
    """The emulator's fp32 -> fp16/bf16 conversions (round to nearest even, overflow, subnormals,
    NaN) and back agree with torch bit for bit on all fp16 values, their midpoints and random fp32."""
    exe = driver("emu_convert_driver")
    every_half = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    every_bf16 = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    mids = (every_half[:-1].double() + every_half[1:].double()).div(2).float()
    specials = torch.tensor([65504.0, 65519.99, 65520.0, 65536.0, 1e-8, 2.0 ** -25, 3 * 2.0 ** -26, -0.0,
                             float("inf"), float("-inf"), 3.0e38, -3.4e38, 1e-40])
    rand = torch.randn(200_000) * torch.logspace(-10, 10, 200_000)
    x = torch.cat([every_half, every_bf16, mids, specials, rand])
    x = x[~torch.isnan(x)]  # NaN payloads are not specified; checked separately below
    x = torch.cat([x, torch.tensor([float("nan")])])
    res = subprocess.run([exe], input=x.numpy().tobytes(), capture_output=True, check=True).stdout
    n = x.numel()
    h = torch.frombuffer(bytearray(res[: 2 * n]), dtype=torch.int16)
    b = torch.frombuffer(bytearray(res[2 * n: 4 * n]), dtype=torch.int16)
    hb = torch.frombuffer(bytearray(res[4 * n: 8 * n]), dtype=torch.float32)
    bb = torch.frombuffer(bytearray(res[8 * n:]), dtype=torch.float32)
    th, tb = x.to(torch.float16), x.to(torch.bfloat16)
    assert torch.equal(h[:-1], th.view(torch.int16)[:-1]), "fp32 -> fp16"
    assert torch.equal(b[:-1], tb.view(torch.int16)[:-1]), "fp32 -> bf16"
    assert torch.equal(hb[:-1], th.float()[:-1]) and torch.equal(bb[:-1], tb.float()[:-1]), "back to fp32"
    assert torch.isnan(hb[-1]) and torch.isnan(bb[-1])
