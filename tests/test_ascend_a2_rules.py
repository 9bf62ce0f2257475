"""Atlas A2 rules of the AscendC emulation layer (issues 12 and 30): every rule has a tiny kernel that breaks
it -- the emulator raises EmuError naming the rule, the kernel and the buffer/line, or computes what
the hardware computes -- and its corrected twin, which runs clean (tests/cpp/emu_a2_rules_driver.cpp).
The one-kernel-type-per-file rule is tests/test_ascend_kernel_files.py; the cross-core flag ids are
in tests/test_ascend_flash_attention.py (MIX_RULES)."""

import os
import re

import pytest

from _ascend_cxx import assert_emu_error, driver_fixture, rule_cases, run_case

CAUGHT = [
    # rule 1: InitConstValue counts 512-byte fractals on L0A/L0B: a 32-byte count overruns the buffer
    ("fill_l0a_in_32b_units", r"InitConstValue overrun: 1 x 64 blocks of 512 B on L0A .* holds 2048 B"
                              r" \[kernel fill_l0a_in_32b_units, AIC block 0\]"),
    ("fill_l0b_in_32b_units", r"InitConstValue overrun: 1 x 64 blocks of 512 B on L0B"),
    # rule 4: scalar GM accesses through the per-core data cache (64-byte lines)
    ("false_sharing", r"data cache \(lost write\): scalar SetValue\(1\) of a GlobalTensor<float> on AIV 1 writes GM "
                      r"line 0x[0-9a-f]+ \(64 B\) that AIV 0 wrote .* \[kernel false_sharing, AIV block 1\]"),
    ("dma_then_scalar_other_core", r"data cache \(lost write\).*AIV 0 wrote"),
    ("dma_over_own_dirty_line", r"DMA write of AIV 0 over GM line .* dirty in the data cache"),
    ("stale_read", r"data cache \(stale line\): scalar GetValue\(0\) of a GlobalTensor<float> on AIV 0 hits GM line .* cached by an earlier launch"
                   r".*DataCacheCleanAndInvalid.* \[kernel stale_read, AIV block 0\]"),
    # rule 7: Mmad destination alignment, ReduceMax work size
    ("mmad_dst_512_aligned", r"Mmad result \(L0C\): .* not 1024-byte aligned \[kernel mmad_dst_512_aligned"),
    ("reduce_max_small_work", r"ReduceMax work buffer .* 8 repeats need ceil\(2 \* repeats / 8\) \* 8 = 16 floats, "
                              r"it holds 8 \[kernel reduce_max_small_work"),
    # TPipe::InitBuffer's buffer counts on A2: <= 8 queue buffers per TPosition, <= 64 buffers per kernel
    ("nine_queue_buffers_on_a1", r"InitBuffer: 9 queue buffers on TPosition::A1 \(this queue's num=5\); A2 allows at "
                                 r"most 8 per TPosition .*\[kernel nine_queue_buffers_on_a1, AIC block 0\]"),
    ("sixty_five_buffers", r"InitBuffer: 65 buffers in one kernel; at most 64 .*\[kernel sixty_five_buffers"),
]

RESULTS = [
    # rule 1: the corrected twins zero the whole buffer; a 512-byte count on L1 (32-byte unit) fills 1/16
    ("fill_l0a_ok", "ok"),
    ("fill_l0b_ok", "ok"),
    ("fill_l1_ok", "ok"),
    ("fill_l1_in_512b_units_too_little", "not zeroed"),
    # rule 2: m = 1 runs GEMV, which reads L0A as ND: the zZ tile gives the wrong row; m = 16 is right
    ("gemv_m1", "wrong"),
    ("gemv_m_promoted", "ok"),
    # rule 4: one line per writer, or a DMA store; a DMA read sees GM, not the dirty cache line
    ("own_lines_ok", "2"),
    ("dma_store_ok", "2"),
    ("scalar_write_then_dma_read", "saw old"),
    ("scalar_write_clean_then_dma_read", "saw new"),
    ("stale_read_invalidated", "2"),
    # rule 7
    ("mmad_dst_1024_aligned", "ok"),
    ("reduce_max_ok", "ok"),
    ("eight_queue_buffers_on_a1", "ok"),
    ("sixty_four_buffers", "ok"),
]


a2_driver = driver_fixture("emu_a2_rules_driver")


@rule_cases(CAUGHT)
def test_a2_rule_is_caught(a2_driver, case, match):
    assert_emu_error(run_case(a2_driver, case), case, match)


@pytest.mark.parametrize("case, want", RESULTS, ids=[c[0] for c in RESULTS])
def test_a2_rule_twin(a2_driver, case, want):
    assert run_case(a2_driver, case) == want


# ---------------------------------------------------------------------------------------------------
# Issue 30: GM written by several cores (emu/gm_model.h), atomic accumulation, CrossCoreSetFlag's pipe,
# scalar access to UB positions only, the tiling read at a reused address (tests/cpp/emu_gm_rules_driver.cpp).
GM_CAUGHT = [
    ("gm_overlap_writes", r"GM race between cores \(write-after-write\) in kernel gm_overlap_writes: GM bytes "
                          r"\[0x[0-9a-f]+, 0x[0-9a-f]+\) written by DataCopy \(UB->GM\) on AIV 0 \(PIPE_MTE3\) and written "
                          r"by DataCopy \(UB->GM\) on AIV 1 \(PIPE_MTE3\) in the same launch, with no ordering.*"
                          r"\[kernel gm_overlap_writes, AIV block 1\]"),
    # the 32-byte DataCopy of a 24-byte row spills 8 bytes into the next core's row
    ("gm_tail_spill", r"GM race between cores \(write-after-write\) in kernel gm_tail_spill: GM bytes "
                      r"\[0x([0-9a-f]+), 0x([0-9a-f]+)\) written by DataCopy \(UB->GM\) on AIV 0"),
    ("gm_rmw", r"GM race between cores \(read-after-write\) in kernel gm_rmw: .* written by DataCopy \(UB->GM\) on AIV 0 "
               r"\(PIPE_MTE3\) and read by DataCopy \(GM->UB\) on AIV 1 \(PIPE_MTE2\)"),
    ("gm_atomic_mixed_types", r"\(PIPE_MTE3, atomic add float\) and written by .* \(PIPE_MTE3, atomic add int32_t\).*"
                              r"atomic accumulation in two different types"),
    ("gm_atomic_then_none", r"written by DataCopy \(UB->GM\) on AIV 0 \(PIPE_MTE3\) and written by DataCopy \(UB->GM\) on "
                            r"AIV 1 \(PIPE_MTE3, atomic add float\)"),
    ("gm_scalar_race", r"GM race between cores \(read-after-write\) .* written by GlobalTensor::SetValue on AIV 0 "
                       r"\(PIPE_S\) and read by GlobalTensor::GetValue on AIV 1 \(PIPE_S\)"),
    # CrossCoreSetFlag<mode, pipe>: the flag covers that pipe's earlier work only
    ("xflag_fix_set_on_m", r"GM race between cores \(read-after-write\) in kernel xflag_fix_set_on_m \(AIV\): .* written by "
                           r"Fixpipe \(L0C->GM\) on AIC 0 \(PIPE_FIX\) and read by DataCopy \(GM->UB\) on AIV 0 \(PIPE_MTE2\)"),
    ("xflag_mte3_no_store", r"GM race between cores \(write-after-read\) in kernel xflag_mte3_no_store \(AIC\): .* read by "
                            r"DataCopy \(GM->UB\) on AIV 0 \(PIPE_MTE2\) and written by Fixpipe \(L0C->GM\) on AIC 0"),
    ("xflag_pipe_s", r"CrossCoreSetFlag<2, PIPE_S>: .* PIPE_S and PIPE_ALL are not allowed for modes 0..2 on A2 "
                     r"\[kernel xflag_pipe_s, AIC block 0\]"),
    ("xflag_pipe_all", r"CrossCoreSetFlag<2, PIPE_ALL>: .* not allowed"),
    # scalar GetValue / SetValue: UB positions only
    ("scalar_l0c_read", r"scalar GetValue on a LocalTensor of TBuf #0 in L0C: the scalar unit reaches UB only "
                        r"\(VECIN/VECCALC/VECOUT\).* \[kernel scalar_l0c_read, AIC block 0\]"),
    ("scalar_l1_write", r"scalar SetValue on a LocalTensor of TBuf #1 in L1"),
    # a tiling read with raw scalar loads at an address an earlier launch read
    ("tiling_raw_stale", r"data cache \(stale line\): scalar GetValue\(0\) of a GlobalTensor<uint32_t> on AIV 0 hits GM line "
                         r".* cached by an earlier launch .* \[kernel tiling_raw_stale, AIV block 0\]"),
]

GM_RESULTS = [
    ("gm_tail_pad_ok", "1 2"),               # row 0 ends with block 0's value, row 1 starts with block 1's
    ("gm_atomic_add_ok", "2 0"),             # 1 + 1 from two cores; bytes nobody wrote stay 0
    ("gm_atomic_half", "2048"),              # 2048 + 1 + 1 accumulated in half: each sum rounds back to 2048
    ("gm_scalar_own_lines_ok", "1 1"),
    ("xflag_fix_set_on_fix_ok", "ok"),
    ("xflag_mte3_after_mte2_ok", "ok"),
    ("tiling_copy_ok", "5"),                 # CopyTiling invalidates the lines first: the second upload is seen
]


gm_driver = driver_fixture("emu_gm_rules_driver", flags=("-DASCEND_MOE_OPS_EMU", "-pthread"))


@rule_cases(GM_CAUGHT)
def test_gm_rule_is_caught(gm_driver, case, match):
    out = run_case(gm_driver, case)
    assert_emu_error(out, case, match)
    if case == "gm_tail_spill":  # exactly the 8 spilled bytes (floats 6, 7 of row 0 = floats 0, 1 of row 1)
        lo, hi = (int(x, 16) for x in re.search(match, out).groups())
        assert hi - lo == 8


@pytest.mark.parametrize("case, want", GM_RESULTS, ids=[c[0] for c in GM_RESULTS])
def test_gm_rule_twin(gm_driver, case, want):
    assert run_case(gm_driver, case) == want


def test_gm_model_is_off_with_the_pipe_model(gm_driver):
    """ASCEND_MOE_OPS_EMU_PIPES=off (debugging only) also turns the cross-core GM model off; the atomic
    accumulation itself is functional and stays."""
    env = dict(os.environ, ASCEND_MOE_OPS_EMU_PIPES="off")
    assert run_case(gm_driver, "gm_overlap_writes", env=env) == "ok"
    assert run_case(gm_driver, "gm_atomic_add_ok", env=env) == "2 0"
