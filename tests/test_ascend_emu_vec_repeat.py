"""The tensor high-dimension forms of the emulated AscendC vector API: repeatTimes, continuous and bit
masks, block / repeat strides, WholeReduceMax / WholeReduceSum and Brcb (csrc/ascend/emu), each
against an answer computed by hand in tests/cpp/emu_vec_repeat_driver.cpp, and the rules they check."""

import os

import pytest

from _ascend_cxx import assert_emu_error, driver_fixture, rule_cases, run_case

KNOWN = ["add_contiguous", "sub_mask_rows", "mul_bitmask", "max_broadcast_operand", "adds_dst_block_stride",
         "muls_exp_masked", "half_duplicate_bitmask", "whole_reduce_rows", "whole_reduce_sum_tree_order",
         "brcb_rows", "brcb_strided"]

RULES = [
    ("mask_too_large", "continuous mask 65 outside \\[1, 64\\]"),
    ("bitmask_high_word_fp32", "mask\\[1\\] must be 0"),
    ("repeat_past_operand", "192 elements needed"),
    ("stride_past_operand", "elements needed"),
    ("whole_reduce_index_order", "ORDER_ONLY_VALUE"),
    ("brcb_overlap", "overlap"),
]


driver = driver_fixture("emu_vec_repeat_driver")


@pytest.mark.parametrize("case", KNOWN)
def test_known_answer(driver, case):
    assert run_case(driver, case) == "ok"


@rule_cases(RULES)
def test_rule(driver, case, match):
    assert_emu_error(run_case(driver, case), case, match)
