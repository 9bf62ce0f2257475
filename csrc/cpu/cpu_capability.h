// The CPU instruction-set level the native kernels run at, chosen at run time (as ATen does with
// ATEN_CPU_CAPABILITY): what the CPU and the OS support (CPUID, XGETBV; AMX also needs Linux's
// permission for the tile data state), lowered with ASCEND_MOE_OPS_CPU_CAPABILITY. A portable build
// (the default) compiles the hot grouped-GEMM tile kernels once per level, and the unpermute's
// per-token loops for AVX2 and AVX-512 (moe_unpermute_kernel.h), and runs the copies of the chosen
// level; a -march=native build has one copy, for the build CPU (docs/environment.md, README "Install").
#pragma once

// The `#pragma GCC target` of each level's units in a portable build (grouped_gemm_kernel_{avx512,
// avx512_bf16,amx}.cpp, moe_unpermute_kernel_avx512.cpp), written once: units of one level must
// compile the vector layer's inline functions in its namespace with the same target, or the copies
// the linker keeps would differ. AMO_ISA_TARGET_PUSH(AMO_TARGET_AVX512) ... AMO_ISA_TARGET_POP().
#define AMO_TARGET_AVX512 "avx2,fma,f16c,bmi,bmi2,lzcnt,movbe,avx512f,avx512bw,avx512vl,avx512dq,avx512cd"
#define AMO_TARGET_AVX512_BF16 AMO_TARGET_AVX512, "avx512bf16"
#define AMO_TARGET_AMX AMO_TARGET_AVX512_BF16, "amx-tile,amx-bf16"
#define AMO_ISA_PRAGMA_(x) _Pragma(#x)
#define AMO_ISA_PRAGMA(x) AMO_ISA_PRAGMA_(x)
#define AMO_ISA_TARGET_PUSH(...) _Pragma("GCC push_options") AMO_ISA_PRAGMA(GCC target(__VA_ARGS__))
#define AMO_ISA_TARGET_POP() _Pragma("GCC pop_options")

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
