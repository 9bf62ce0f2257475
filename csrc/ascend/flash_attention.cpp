// flash_attention_fwd and flash_attention_bwd on Ascend: the host code of host/flash_attention_host.h (checks, tiling, workspaces, launch
// sequence), written once for every launcher, registered through host/register.h with this build's
// Launcher: EmuLauncher in the emulator extension (namespace ascend_moe_ops_emu, CPU tensors, run in
// CI), NpuLauncher on a CANN build (ascend_moe_ops, PrivateUse1; UNVERIFIED: type-checked with g++
// only, never compiled with the CANN toolkit nor run on an NPU, docs/ascend.md). Schemas are defined
// in ascend_moe_ops/_library.py.
#include "host/flash_attention_host.h"
#include "host/register.h"

AMO_ASCEND_OP(flash_attention_fwd)
AMO_ASCEND_OP(flash_attention_bwd)
