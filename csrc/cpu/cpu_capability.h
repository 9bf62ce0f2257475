// The CPU instruction-set level the native kernels run at, chosen at run time (as ATen does with
// ATEN_CPU_CAPABILITY): what the CPU and the OS support (CPUID, XGETBV; AMX also needs Linux's
// permission for the tile data state), lowered with ASCEND_MOE_OPS_CPU_CAPABILITY. A portable build
// (the default) compiles the hot grouped-GEMM tile kernels once per level, and the unpermute's
// per-token loops for AVX2 and AVX-512 (moe_unpermute_kernel.h), and runs the copies of the chosen
// level; a -march=native build has one copy, for the build CPU (docs/environment.md, README "Install").
#pragma once

namespace amo {
namespace cpu {

// Ordered: every level includes the ones below it.
enum class Capability : int { kAVX2 = 0, kAVX512 = 1, kAVX512_BF16 = 2, kAMX = 3 };

const char* name(Capability c);
// The highest level this CPU and OS support (AVX512 = F + BW + VL + DQ with the zmm state enabled;
// AVX512_BF16 adds AVX512_BF16; AMX adds AMX-TILE + AMX-BF16 and the tile data permission).
Capability detected();
// detected(), lowered to ASCEND_MOE_OPS_CPU_CAPABILITY when set (read once, at the first call; an
// unknown value raises an error naming the variable, a level above detected() warns and is ignored).
Capability chosen();
// AMX tiles can be used in this process (detected() is AMX; the permission has been granted).
bool amx_ready();

}  // namespace cpu
}  // namespace amo
