"""The emulator's per-core pipe model (csrc/ascend/emu/pipe_model.h): every ordering rule it
models has a tiny kernel that breaks it (must be caught, with a message naming the rule, the
kernel, the buffer and the two instructions) and a corrected twin (must run clean); see
tests/cpp/emu_pipes_driver.cpp."""

import os

import pytest
import torch

import ascend_moe_ops as amo
from _ascend_cxx import assert_emu_error, driver_fixture, needs_emu, rule_cases, run_case
from ascend_moe_ops.testing import assert_close_to_ref

needs_emu = needs_emu("grouped_gemm")[1]

CAUGHT = [
    ("bad_v_mte2", r"pipe race \(write-after-write, missing sync V->MTE2\) in kernel bad_v_mte2, block 0: "
                   r"UB bytes \[0, 256\) of TBuf #0: Muls on PIPE_V \(issue #2, write\) and DataCopy \(GM->UB\) "
                   r"on PIPE_MTE2 \(issue #3, write\) are not ordered"),
    ("bad_mte2_v", r"pipe race \(read-after-write, missing sync MTE2->V\) in kernel bad_mte2_v.*"
                   r"DataCopy \(GM->UB\) on PIPE_MTE2 \(issue #1, write\) and Adds on PIPE_V \(issue #2, read\)"),
    ("bad_prefetch_same_half", r"pipe race \(read-after-write, missing sync MTE2->V\) in kernel bad_prefetch_same_half, "
                               r"block 0: UB bytes \[256, 512\) of TBuf #1: DataCopy \(GM->UB\) on PIPE_MTE2 "
                               r"\(issue #3, write\) and Add on PIPE_V \(issue #4, read\)"),
    ("bad_mte3_mte2", r"write-after-read, missing sync MTE3->MTE2.*DataCopy \(UB->GM\) on PIPE_MTE3"),
    ("bad_gm_mte3_mte2", r"pipe race \(read-after-write, missing sync MTE3->MTE2\) in kernel bad_gm_mte3_mte2, block 0: "
                         r"GM bytes \[0x[0-9a-f]+, 0x[0-9a-f]+\) of global memory: DataCopy \(UB->GM\) on PIPE_MTE3 "
                         r"\(issue #2, write\) and DataCopy \(GM->UB\) on PIPE_MTE2 \(issue #3, read\) are not ordered"),
    ("bad_tbuf_no_queue_sync", r"missing sync V->MTE2.*TBuf #0"),
    ("bad_wait_without_set", r"flag rule in kernel bad_wait_without_set.*WaitFlag<HardEvent::MTE2_V>\(0\) with no "
                             r"pending SetFlag"),
    ("bad_event_id", r"SetFlag<HardEvent::V_MTE2>\(8\): event ids are 0..7"),
    ("bad_cube_mte2_mte1", r"read-after-write, missing sync MTE2->MTE1.*L1 bytes \[0, 512\) of TBuf #0: "
                           r"DataCopy \(GM->L1, ND2NZ\) on PIPE_MTE2 .* LoadData \(L1->L0\) on PIPE_MTE1"),
    ("bad_cube_mte1_m", r"read-after-write, missing sync MTE1->M.*L0A .*LoadData \(L1->L0\) on PIPE_MTE1.*Mmad on PIPE_M"),
    ("bad_cube_m_fix", r"read-after-write, missing sync M->FIX.*L0C .*Mmad on PIPE_M.*Fixpipe \(L0C->GM\) on PIPE_FIX"),
    ("bad_cube_fix_m", r"write-after-read, missing sync FIX->M.*Fixpipe \(L0C->GM\) on PIPE_FIX.*Mmad on PIPE_M"),
    ("bad_l0_fill_mmad", r"read-after-write, missing sync MTE1->M.*L0A bytes \[0, \d+\) of TBuf #1: "
                         r"InitConstValue \(L0A/L0B\) on PIPE_MTE1 \(issue #1, write\) and Mmad on PIPE_M"),
    ("bad_l1_fill_nd2nz", r"same-pipe overlap in kernel bad_l1_fill_nd2nz, block 0: InitConstValue \(L1\) \(issue #1\) "
                          r"and DataCopy \(GM->L1, ND2NZ\) \(issue #2\) both write L1 bytes \[0, 512\) of TBuf #0 on "
                          r"PIPE_MTE2 with no PipeBarrier<PIPE_MTE2>\(\)"),
    ("bad_v_mte3_no_auto_sync", r"pipe race \(read-after-write, missing sync V->MTE3\) in kernel bad_v_mte3_no_auto_sync.*"
                                r"Adds on PIPE_V .* DataCopy \(UB->GM\) on PIPE_MTE3"),
    ("bad_pipe_m", r"PIPE_M rule in kernel bad_pipe_m, block 0: Mmad \(issue #2, m=32 n=64: 8 < 10 L0C fractals\) "
                   r"accumulates into L0C bytes \[0, 8192\) of TBuf #3 right after the Mmad of issue #1 with no "
                   r"PipeBarrier<PIPE_M>\(\)"),
]

CLEAN = ["ok_v_mte2", "ok_mte2_v", "ok_prefetch_other_half", "ok_mte3_mte2", "ok_gm_mte3_mte2", "ok_pipe_all", "ok_scalar_wait", "ok_queues",
         "ok_auto_sync_scalar_side", "ok_event_ids", "ok_cube_path", "ok_l0_fill_mmad", "ok_l1_fill_nd2nz", "ok_pipe_m",
         "ok_pipe_m_large"]


pipes_driver = driver_fixture("emu_pipes_driver")


@rule_cases(CAUGHT)
def test_pipe_model_catches(pipes_driver, case, match):
    assert_emu_error(run_case(pipes_driver, case), case, match)


@pytest.mark.parametrize("case", CLEAN)
def test_pipe_model_accepts_corrected_twin(pipes_driver, case):
    assert run_case(pipes_driver, case) == "ok"


def test_pipe_model_env_switch_turns_it_off(pipes_driver):
    """ASCEND_MOE_OPS_EMU_PIPES=off (debugging only) accepts a racy kernel; on by default."""
    env = dict(os.environ, ASCEND_MOE_OPS_EMU_PIPES="off")
    assert run_case(pipes_driver, "bad_v_mte2", env=env) == "ok"
    env["ASCEND_MOE_OPS_EMU_PIPES"] = "on"
    assert run_case(pipes_driver, "bad_v_mte2", env=env).startswith("EmuError")


def test_pipe_model_auto_sync_default_is_the_documented_set(pipes_driver):
    """By default only the scalar-related pairs (S <-> V/MTE2/MTE3) are compiler-inserted, as the public
    documentation lists them: a vector result stored from a TBuf without V -> MTE3 is a race.
    ASCEND_MOE_OPS_EMU_AUTOSYNC=wide (explicit option only) accepts it; `scalar` names the default."""
    env = dict(os.environ)
    env.pop("ASCEND_MOE_OPS_EMU_AUTOSYNC", None)
    assert run_case(pipes_driver, "bad_v_mte3_no_auto_sync", env=env).startswith("EmuError")
    env["ASCEND_MOE_OPS_EMU_AUTOSYNC"] = "scalar"
    assert_emu_error(run_case(pipes_driver, "bad_v_mte3_no_auto_sync", env=env), "documented auto-sync",
                     r"read-after-write, missing sync V->MTE3")
    env["ASCEND_MOE_OPS_EMU_AUTOSYNC"] = "wide"
    assert run_case(pipes_driver, "bad_v_mte3_no_auto_sync", env=env) == "ok"
    assert run_case(pipes_driver, "bad_v_mte2", env=env).startswith("EmuError"), "V -> MTE2 is never inserted"


def test_strict_model_is_on_in_this_run():
    """CI runs the emulated parity suites with the pipe model on: the debugging switch must not be set."""
    v = os.environ.get("ASCEND_MOE_OPS_EMU_PIPES", "on").lower()
    assert v not in ("0", "off", "false"), "ASCEND_MOE_OPS_EMU_PIPES turns the A2 pipe model off (debugging only)"


@needs_emu
def test_grouped_gemm_at_the_pipe_rules_trigger_shapes(monkeypatch):
    """The grouped GEMM kernel under the strict model where its syncs matter: 16 x 16 tiles
    ((m/16)(n/16) = 1 < 10: PIPE_M barriers between the K steps), K = 40 (K % 16 != 0: the L1 K-padding
    fill before the ND2NZ copy), a 1-row group, an empty group and zero rows past the groups (L0
    zero-fill handed to the Mmad)."""
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_PIPES", "on")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE", "16")
    monkeypatch.setenv("ASCEND_MOE_OPS_EMU_AIC", "2")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 40, generator=g).half()
    w = (torch.randn(3, 40, 20, generator=g) / 40 ** 0.5).half()
    sizes = torch.tensor([1, 0, 17])
    with amo.use_backend("ascendc-emu"):
        out = amo.grouped_gemm(x, w, sizes)
    with amo.use_backend("reference"):
        ref64 = amo.grouped_gemm(x.double(), w.double(), sizes)
        lowp = amo.grouped_gemm(x, w, sizes)
    assert_close_to_ref(out, ref64, dtype=torch.float16, torch_lowp=lowp)
    assert (out[18:] == 0).all()
