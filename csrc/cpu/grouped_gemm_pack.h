// grouped_gemm on the CPU, part 1 of 3: the operand layouts. Blocking constants, the per-thread
// workspace, and the packing of one K block of A and B into the layouts the micro-kernels of
// grouped_gemm_kernel.cpp read (bf16: VNNI pairs, two consecutive k of one column in one 32-bit word;
// fp32/fp16: fp32 rows of NR=64 columns), the AMX staging of A rows, and the stores of the fp32
// result tiles into the output dtype. Changes here: a layout or a conversion. Pure data movement
// (plus the fp16 -> fp32 and fp32 -> bf16/fp16 conversions), inline: every routine runs inside the
// tile loops. Overview of the whole kernel: grouped_gemm.cpp.
#pragma once

#include "common/bf16.h"
#include "common/vec.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// The instruction set of this translation unit. A per-ISA unit (cpu/grouped_gemm_kernel_<isa>.cpp,
// portable builds) sets AMO_ISA_AVX512 / AMO_ISA_AVX512_BF16 / AMO_ISA_AMX itself and compiles this
// header under `#pragma GCC target(...)` (GCC does not define __AVX512F__ etc. for a target pragma);
// every other unit takes them from the compiler's -march (x86-64-v3 in a portable build, the build
// machine's CPU with -march=native).
#if defined(AMO_ISA_AVX512)
#include <immintrin.h>
#define AMO_GG_AVX512 AMO_ISA_AVX512
#define AMO_GG_AVX2 (!AMO_ISA_AVX512)
#define AMO_GG_BF16DOT AMO_ISA_AVX512_BF16
#define AMO_GG_AMX AMO_ISA_AMX
#else
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define AMO_GG_AVX512 1
#else
#define AMO_GG_AVX512 0
#endif
// AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3, Intel client cores, the portable build's baseline):
// an fp32 micro-kernel on ymm registers; bf16 and fp16 are converted to fp32 while packing and run it.
#if !AMO_GG_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AMO_GG_AVX2 1
#else
#define AMO_GG_AVX2 0
#endif
#if AMO_GG_AVX512 && defined(__AVX512BF16__)
#define AMO_GG_BF16DOT 1
#else
#define AMO_GG_BF16DOT 0
#endif
// AMX (Intel Sapphire Rapids and later): the bf16 tile kernel; compiled in when the unit targets a
// CPU with AMX-TILE + AMX-BF16, used when the CPU and the OS allow it (cpu/cpu_capability.cpp).
#if AMO_GG_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMO_GG_AMX 1
#else
#define AMO_GG_AMX 0
#endif
#endif

// Every inline function below lives in a namespace named after the instruction set it is compiled
// for (AMO_GG_NS), so that the units of one build that compile this header for different ISAs never
// share a function body (an AVX-512 copy picked by the linker for an AVX2 caller would crash on a
// CPU without AVX-512). Workspace and the constants are the same in all of them.
#ifndef AMO_GG_NS
#if AMO_GG_AMX
#define AMO_GG_NS build_amx
#elif AMO_GG_BF16DOT
#define AMO_GG_NS build_avx512_bf16
#elif AMO_GG_AVX512
#define AMO_GG_NS build_avx512
#elif AMO_GG_AVX2
#define AMO_GG_NS build_avx2
#else
#define AMO_GG_NS build_scalar
#endif
#endif

namespace amo {
namespace grouped_gemm_cpu {

// Blocking. NR: one micro-panel = 4 zmm of fp32 results. MR x NR accumulators = 24 of the 32 zmm.
constexpr int64_t NR = 64;
constexpr int64_t MR = 6;
constexpr int64_t MC = 264;      // max rows of an item (multiple of MR): one B pack serves them all
constexpr int64_t NC = 256;      // max cols of an item (multiple of NR)
constexpr int64_t NC_MAX = 512;  // the AMX forward's items: up to 512 cols (fewer re-reads of x rows)
constexpr int64_t KC_BF16 = 256; // k per block, bf16 (kp = 128 VNNI pairs: a 32 KiB B panel)
constexpr int64_t KC_F32 = 128;  // k per block, fp32/fp16 (a 32 KiB B panel)

// ------------------------------------------------------------------------------------------
// Per-thread workspace (64-byte aligned)
struct Workspace {
  static constexpr size_t kB = (NC_MAX / NR) * (KC_BF16 / 2 > KC_F32 ? KC_BF16 / 2 : KC_F32) * NR * 4;
  static constexpr size_t kA = MC * (KC_BF16 > KC_F32 ? KC_BF16 : KC_F32) * 4 + 64 * 4 * 16;
  static constexpr size_t kC = MC * NC_MAX * 4;
  static constexpr size_t kT = (KC_BF16 / 2) * (MC + 16) * 4;
  char* base;
  uint32_t* b;  // packed B panels (bf16 words or fp32)
  uint32_t* a;  // packed A (bf16 words or fp32)
  float* c;     // fp32 accumulator tile [MC][NC_MAX]
  uint32_t* t;  // scratch (interleaved A before it is cut into MR-row panels)
  Workspace() {
    base = static_cast<char*>(std::aligned_alloc(64, kB + kA + kC + kT));
    TORCH_CHECK(base != nullptr, "grouped_gemm: out of memory for the packing workspace");
    b = reinterpret_cast<uint32_t*>(base);
    a = reinterpret_cast<uint32_t*>(base + kB);
    c = reinterpret_cast<float*>(base + kB + kA);
    t = reinterpret_cast<uint32_t*>(base + kB + kA + kC);
  }
  ~Workspace() { std::free(base); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
};

inline namespace AMO_GG_NS {

// An integer tuning knob from the environment (AMO_GG_*: for tuning only), clamped to [lo, hi] and
// rounded down to a multiple of mult; dflt when unset.
inline int64_t env_or(const char* name, int64_t dflt, int64_t lo, int64_t hi, int64_t mult) {
  const char* v = std::getenv(name);
  if (v == nullptr) return dflt;
  int64_t x = std::atoll(v) / mult * mult;
  return std::max(lo, std::min(hi, x));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// ------------------------------------------------------------------------------------------
// bf16 packing (uint16 storage). dst words: dst[kp * ld + c] = (src(2kp, c), src(2kp+1, c)).

// Rows of src are k (stride ls), columns c contiguous: interleave row pairs. Rows >= nrows and
// columns in [ncols, ncols_pad) become zero; ncols_pad is a multiple of 16.
inline void interleave_rows(const uint16_t* src, int64_t ls, int64_t nrows, int64_t ncols,
                            uint32_t* dst, int64_t ld, int64_t ncols_pad) {
  const int64_t np = (nrows + 1) / 2;
#if AMO_GG_AVX512
  alignas(64) static const uint16_t idx_lo_a[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t idx_hi_a[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i idx_lo = _mm512_load_si512(idx_lo_a), idx_hi = _mm512_load_si512(idx_hi_a);
  for (int64_t p = 0; p < np; ++p) {
    const uint16_t* r0 = src + 2 * p * ls;
    const uint16_t* r1 = (2 * p + 1 < nrows) ? r0 + ls : nullptr;
    uint32_t* d = dst + p * ld;
    for (int64_t c0 = 0; c0 < ncols_pad; c0 += 32) {
      const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, ncols - c0));
      const __mmask32 m = cnt >= 32 ? 0xFFFFFFFFu : ((1u << cnt) - 1u);
      __m512i a = _mm512_maskz_loadu_epi16(m, r0 + c0);
      __m512i b = r1 ? _mm512_maskz_loadu_epi16(m, r1 + c0) : _mm512_setzero_si512();
      _mm512_storeu_si512(d + c0, _mm512_permutex2var_epi16(a, idx_lo, b));
      if (c0 + 16 < ncols_pad) _mm512_storeu_si512(d + c0 + 16, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
#else
  for (int64_t p = 0; p < np; ++p)
    for (int64_t c = 0; c < ncols_pad; ++c) {
      uint32_t lo = (c < ncols) ? src[2 * p * ls + c] : 0;
      uint32_t hi = (c < ncols && 2 * p + 1 < nrows) ? src[(2 * p + 1) * ls + c] : 0;
      dst[p * ld + c] = lo | (hi << 16);
    }
#endif
}

#if AMO_GG_AVX512
// 16x16 transpose of 32-bit elements held in r[0..16).
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i+q], 128-bit lane l: column 4l+q of rows 4i..4i+3
  for (int q = 0; q < 4; ++q) {
    __m512i v0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44);
    __m512i v1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xEE);
    __m512i w0 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
    __m512i w1 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}
#endif

// src(k, c) = src[c * ls + k] (k contiguous): dst[kp * ld + c] for kp < ceil(nk/2), c < 64 (a full
// panel; columns >= ncols are zero). ld >= 64. Writes kp rows rounded up to 16 (dst has room).
inline void pack_transposed_bf16(const uint16_t* src, int64_t ls, int64_t nk, int64_t ncols,
                                 uint32_t* dst, int64_t ld) {
  const int64_t np = (nk + 1) / 2;
#if AMO_GG_AVX512
  for (int64_t p0 = 0; p0 < np; p0 += 16) {
    const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(32, nk - 2 * p0));
    const __mmask32 m = cnt >= 32 ? 0xFFFFFFFFu : ((1u << cnt) - 1u);
    for (int64_t c0 = 0; c0 < NR; c0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = (c0 + i < ncols) ? _mm512_maskz_loadu_epi16(m, src + (c0 + i) * ls + 2 * p0)
                                : _mm512_setzero_si512();
      transpose16x16_epi32(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (p0 + j) * ld + c0, r[j]);
    }
  }
#else
  for (int64_t p = 0; p < np; ++p)
    for (int64_t c = 0; c < NR; ++c) {
      uint32_t lo = (c < ncols) ? src[c * ls + 2 * p] : 0;
      uint32_t hi = (c < ncols && 2 * p + 1 < nk) ? src[c * ls + 2 * p + 1] : 0;
      dst[p * ld + c] = lo | (hi << 16);
    }
#endif
}

// Generic (any strides) bf16 pair packing: dst[r * ld + kp] = (src(r, 2kp), src(r, 2kp+1)).
inline void pack_pairs_generic(const uint16_t* src, int64_t rs, int64_t ks, int64_t nr, int64_t nk,
                               uint32_t* dst, int64_t ld) {
  const int64_t np = (nk + 1) / 2;
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t p = 0; p < np; ++p) {
      uint32_t lo = src[r * rs + 2 * p * ks];
      uint32_t hi = (2 * p + 1 < nk) ? src[r * rs + (2 * p + 1) * ks] : 0;
      dst[r * ld + p] = lo | (hi << 16);
    }
}

// ------------------------------------------------------------------------------------------
// Element conversion, and the fp32 result tiles stored into the output dtype
template <typename T> inline float to_f32(T v) { return static_cast<float>(v); }

// Store an fp32 tile C[m][n] (ldc) into out (ldo) converting to T.
template <typename T>
inline void store_tile(const float* C, int64_t ldc, int64_t m, int64_t n, T* out, int64_t ldo) {
  for (int64_t r = 0; r < m; ++r) {
    const float* cr = C + r * ldc;
    T* o = out + r * ldo;
#if AMO_GG_AVX512
    int64_t c = 0;
    for (; c < n; c += 16) {
      const int64_t cnt = std::min<int64_t>(16, n - c);
      const __mmask16 mk = cnt >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cnt) - 1u);
      __m512 v = _mm512_loadu_ps(cr + c);
      if constexpr (std::is_same<T, float>::value) {
        _mm512_mask_storeu_ps(o + c, mk, v);
      } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
        _mm256_mask_storeu_epi16(o + c, mk, vec::f32_to_bf16_bits(v));
      } else {
        __m256i h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(o + c, mk, h);
      }
    }
#else
    for (int64_t c = 0; c < n; ++c) {
      if constexpr (std::is_same<T, c10::BFloat16>::value) o[c].x = amo::bf16::from_f32(cr[c]);
      else o[c] = static_cast<T>(cr[c]);
    }
#endif
  }
}

template <typename T>
inline void zero_tile(int64_t m, int64_t n, T* out, int64_t ldo) {
  for (int64_t r = 0; r < m; ++r) std::memset(static_cast<void*>(out + r * ldo), 0, sizeof(T) * n);
}

// ------------------------------------------------------------------------------------------
// One K block [k0, k0 + kc) of the operands, packed (called by the tile kernels per K block).

// B(k, c) = b[k * s0 + c * s1], bf16: the ceil(n / NR) panels of columns [j * NR, j * NR + NR) at
// dst + j * kp_max * NR, ceil(kc / 2) pair rows of NR words each (columns >= n zero). With
// pad_to > ceil(kc / 2) the pair rows up to pad_to are zeroed too (the AMX kernel's 16-pair steps).
inline void pack_b_bf16(const uint16_t* b, int64_t s0, int64_t s1, int64_t k0, int64_t kc, int64_t n,
                        uint32_t* dst_base, int64_t kp_max, int64_t pad_to = 0) {
  const int64_t npan = ceil_div(n, NR);
  const int64_t kp = (kc + 1) / 2;
  for (int64_t j = 0; j < npan; ++j) {
    const int64_t nn = std::min(NR, n - j * NR);
    uint32_t* dst = dst_base + j * kp_max * NR;
    if (s1 == 1) {
      interleave_rows(b + k0 * s0 + j * NR, s0, kc, nn, dst, NR, NR);
    } else if (s0 == 1) {
      pack_transposed_bf16(b + j * NR * s1 + k0, s1, kc, nn, dst, NR);
    } else {
      // generic strides: element by element
      for (int64_t p = 0; p < kp; ++p)
        for (int64_t c = 0; c < NR; ++c) {
          uint32_t lo = 0, hi = 0;
          if (c < nn) {
            lo = b[(k0 + 2 * p) * s0 + (j * NR + c) * s1];
            if (2 * p + 1 < kc) hi = b[(k0 + 2 * p + 1) * s0 + (j * NR + c) * s1];
          }
          dst[p * NR + c] = lo | (hi << 16);
        }
    }
    if (pad_to > kp) std::memset(dst + kp * NR, 0, sizeof(uint32_t) * (pad_to - kp) * NR);
  }
}

// A(r, k) = a[r + k * ks] (columns of A contiguous: the dW case, A = a^T), bf16, rows [0, m) of the
// block starting at a: interleave k-row pairs into [pair][row] (tmp), then cut into MR-row panels
// [block][pair][MR] at dst + block * kp_max * MR, so that the micro-kernel reads A sequentially.
inline void pack_a_bf16_panels(const uint16_t* a, int64_t ks, int64_t kc, int64_t m, uint32_t* tmp, uint32_t* dst_base,
                               int64_t kp_max) {
  const int64_t kp = (kc + 1) / 2;
  const int64_t ld = round_up(m, 16);
  interleave_rows(a, ks, kc, m, tmp, ld, ld);
  for (int64_t i0 = 0; i0 < m; i0 += MR) {
    const int64_t mr = std::min(MR, m - i0);
    uint32_t* dst = dst_base + (i0 / MR) * kp_max * MR;
    const uint32_t* src = tmp + i0;
#if AMO_GG_AVX512
    const __mmask8 mk = static_cast<__mmask8>((1u << mr) - 1u);
    for (int64_t p = 0; p < kp; ++p)
      _mm256_mask_storeu_epi32(dst + p * MR, mk, _mm256_maskz_loadu_epi32(mk, src + p * ld));
#else
    for (int64_t p = 0; p < kp; ++p)
      for (int64_t r = 0; r < mr; ++r) dst[p * MR + r] = src[p * ld + r];
#endif
  }
}

#if AMO_GG_AMX
// AMX staging of A, rows [0, m) as [row][pair], kp16 pairs per row (a multiple of 16).
// x rows (A(r, k) = a[r * rs + k], k contiguous, rs even): rows of kp16 pairs copied back to back
// into dst (row stride kp16): tile loads straight from x rows whose stride is a multiple of 4 KiB
// (K = 2048: 32 rows on the same L1 sets) evict each other, and the copy also pulls the prefetched
// rows from L2 once per block.
inline void stage_a_amx_rows(const uint16_t* a, int64_t rs, int64_t m, int64_t kp16, uint32_t* dst) {
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(dst + r * kp16, a + r * rs, sizeof(uint32_t) * static_cast<size_t>(kp16));
}

// A(r, k) = a[r + k * ks] (dW: A = a^T): interleave k-row pairs into [pair][row] (tmp), zero the pad
// pairs up to kp16, transpose 16 x 16 blocks into [row][pair] at dst (row stride kp_max).
inline void stage_a_amx_cols(const uint16_t* a, int64_t ks, int64_t kc, int64_t m, int64_t kp16, uint32_t* tmp,
                             uint32_t* dst, int64_t kp_max) {
  const int64_t kp = (kc + 1) / 2;
  const int64_t ld = round_up(m, 16);
  interleave_rows(a, ks, kc, m, tmp, ld, ld);
  if (kp16 > kp) std::memset(tmp + kp * ld, 0, sizeof(uint32_t) * (kp16 - kp) * ld);
  for (int64_t r0 = 0; r0 < ld; r0 += 16)
    for (int64_t p0 = 0; p0 < kp16; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(tmp + (p0 + i) * ld + r0);
      transpose16x16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (r0 + i) * kp_max + p0, r[i]);
    }
}
#endif

// B(k, c) = b[k * s0 + c * s1], fp32, or fp16 / bf16 (converted): the ceil(n / NR) panels at
// dst_base + j * KC_F32 * NR, kc rows of NR floats each (columns >= n zero).
template <typename T>
inline void pack_b_f32(const T* b, int64_t s0, int64_t s1, int64_t k0, int64_t kc, int64_t n, float* dst_base) {
  constexpr bool is_f32 = std::is_same<T, float>::value;
  const int64_t npan = ceil_div(n, NR);
  for (int64_t j = 0; j < npan; ++j) {
    const int64_t nn = std::min(NR, n - j * NR);
    float* dst = dst_base + j * KC_F32 * NR;
    if (s1 == 1) {
      for (int64_t k = 0; k < kc; ++k) {
        const T* src = b + (k0 + k) * s0 + j * NR;
        float* d = dst + k * NR;
#if AMO_GG_AVX512
        for (int64_t c = 0; c < NR; c += 16) {
          const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(16, nn - c));
          const __mmask16 mk = cnt >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cnt) - 1u);
          __m512 v;
          if constexpr (is_f32) v = _mm512_maskz_loadu_ps(mk, src + c);
          else if constexpr (std::is_same<T, c10::BFloat16>::value)  // AVX-512 without AVX512_BF16
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, src + c)), 16));
          else v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src + c));
          _mm512_store_ps(d + c, v);
        }
#else
        for (int64_t c = 0; c < NR; ++c) d[c] = c < nn ? to_f32(src[c]) : 0.f;
#endif
      }
    } else {
      // transposed / generic: column by column (k contiguous when s0 == 1)
      for (int64_t c = 0; c < NR; ++c) {
        if (c < nn) {
          const T* src = b + k0 * s0 + (j * NR + c) * s1;
          for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = to_f32(src[k * s0]);
        } else {
          for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = 0.f;
        }
      }
    }
  }
}

// A(r, k) = a[r * rs + k * ks], fp16: rows [0, m) of K block [k0, k0 + kc) converted to fp32 rows of
// stride KC_F32 at dst (fp32 A is read in place).
template <typename T>
inline void pack_a_f32(const T* a, int64_t rs, int64_t ks, int64_t k0, int64_t kc, int64_t m, float* dst) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t k = 0; k < kc; ++k) dst[r * KC_F32 + k] = to_f32(a[r * rs + (k0 + k) * ks]);
}

}  // namespace AMO_GG_NS
}  // namespace grouped_gemm_cpu
}  // namespace amo
