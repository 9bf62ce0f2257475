// Run-time choice of the CPU instruction-set level (cpu_capability.h), and its report to Python
// (ascend_moe_ops._C._cpu_capability(), read by the loader and the tests).
#include "cpu/cpu_capability.h"

#include "common/registry.h"
#include "cpu/grouped_gemm_kernel.h"
#include "cpu/moe_unpermute_kernel.h"

#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define AMO_X86 1
#else
#define AMO_X86 0
#endif

namespace amo {
namespace cpu {

namespace {

constexpr const char* kEnv = "ASCEND_MOE_OPS_CPU_CAPABILITY";

#if AMO_X86
unsigned long long xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

Capability detect() {
#if AMO_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return Capability::kAVX2;
  const bool osxsave = (c >> 27) & 1u;
  if (!osxsave) return Capability::kAVX2;
  const unsigned long long xcr0 = xgetbv0();
  unsigned b7 = 0, c7 = 0, d7 = 0, a7 = 0;
  if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return Capability::kAVX2;
  const bool zmm_state = (xcr0 & 0xE6ull) == 0xE6ull;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  const bool avx512 = zmm_state && ((b7 >> 16) & 1u) /*F*/ && ((b7 >> 17) & 1u) /*DQ*/ &&
                      ((b7 >> 30) & 1u) /*BW*/ && ((b7 >> 31) & 1u) /*VL*/;
  if (!avx512) return Capability::kAVX2;
  unsigned a71 = 0, b71 = 0, c71 = 0, d71 = 0;
  const bool bf16 = __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71) && ((a71 >> 5) & 1u);
  if (!bf16) return Capability::kAVX512;
  const bool amx_cpu = ((d7 >> 22) & 1u) /*AMX-BF16*/ && ((d7 >> 24) & 1u) /*AMX-TILE*/ &&
                       (xcr0 & 0x60000ull) == 0x60000ull;  // XTILECFG, XTILEDATA
#if defined(__linux__)
  // Linux keeps the tile data state off until a process asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
  if (amx_cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0) return Capability::kAMX;
#else
  (void)amx_cpu;
#endif
  return Capability::kAVX512_BF16;
#else
  return Capability::kAVX2;
#endif
}

Capability choose() {
  const Capability det = detected();
  const char* v = std::getenv(kEnv);
  if (v == nullptr || v[0] == '\0') return det;
  std::string s(v);
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  Capability want;
  if (s == "avx2") want = Capability::kAVX2;
  else if (s == "avx512") want = Capability::kAVX512;
  else if (s == "avx512_bf16") want = Capability::kAVX512_BF16;
  else if (s == "amx") want = Capability::kAMX;
  else TORCH_CHECK(false, kEnv, "=", v, " is not a level; expected one of avx2, avx512, avx512_bf16, amx");
  if (static_cast<int>(want) > static_cast<int>(det)) {
    TORCH_WARN(kEnv, "=", v, " is above what this CPU supports (", name(det), "); running at ", name(det));
    return det;
  }
  return want;
}

}  // namespace

const char* name(Capability c) {
  switch (c) {
    case Capability::kAMX: return "amx";
    case Capability::kAVX512_BF16: return "avx512_bf16";
    case Capability::kAVX512: return "avx512";
    default: return "avx2";
  }
}

Capability detected() {
  static const Capability c = detect();
  return c;
}

Capability chosen() {
  static const Capability c = choose();
  return c;
}

bool amx_ready() { return detected() == Capability::kAMX; }

}  // namespace cpu
}  // namespace amo

AMO_REGISTER(cpu_capability) {
  m.def(
      "_cpu_capability",
      [] {
        pybind11::dict d;
        d["detected"] = amo::cpu::name(amo::cpu::detected());
        d["chosen"] = amo::cpu::name(amo::cpu::chosen());
        d["grouped_gemm_kernels"] = amo::grouped_gemm_cpu::tile_kernels().name;
        d["unpermute_kernels"] = amo::unpermute_cpu::kernels().name;
#if AMO_PORTABLE_ISA
        d["build"] = "portable";
#else
        d["build"] = "march";
#endif
        return d;
      },
      "the CPU capability level: detected, chosen (after ASCEND_MOE_OPS_CPU_CAPABILITY), the grouped-GEMM "
      "tile kernels and the unpermute loops running, and the build kind (portable or a fixed -march)");
}
