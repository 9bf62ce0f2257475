"""Atlas A2 rules of the AscendC emulation layer (issue 12): every rule has a tiny kernel that breaks
it -- the emulator raises EmuError naming the rule, the kernel and the buffer/line, or computes what
the hardware computes -- and its corrected twin, which runs clean (tests/cpp/emu_a2_rules_driver.cpp).
The one-kernel-type-per-file rule is tests/test_ascend_kernel_files.py; the cross-core flag ids are
in tests/test_ascend_flash_attention.py (MIX_RULES)."""

import os

import pytest

from _ascend_cxx import ROOT, assert_emu_error, compile_cached, run_case

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
]


@pytest.fixture(scope="module")
def a2_driver():
    return compile_cached("emu_a2_rules_driver", [os.path.join(ROOT, "tests", "cpp", "emu_a2_rules_driver.cpp")])


@pytest.mark.parametrize("case, match", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_a2_rule_is_caught(a2_driver, case, match):
    assert_emu_error(run_case(a2_driver, case), case, match)


@pytest.mark.parametrize("case, want", RESULTS, ids=[c[0] for c in RESULTS])
def test_a2_rule_twin(a2_driver, case, want):
    assert run_case(a2_driver, case) == want
