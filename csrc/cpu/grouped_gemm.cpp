// grouped_gemm / grouped_gemm_dw on the CPU: a blocked, packed, multi-threaded AVX-512 kernel.
//
//   grouped_gemm(x [M,K], w [E,K,N] | [E,N,K] (trans_b), group_sizes [E]) -> [M,N]
//   grouped_gemm_dw(a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q],  out[e] = a_e^T b_e
//
// Both are lists of independent small GEMMs C = A.B with A(r,k) = A[r*rs + k*ks] and
// B(k,c) = B[k*ks + c*ns] (strides cover x, x^T, W and W^T without copies). The problem is cut
// into work items (group, M-tile, N-tile) that threads take from one atomic counter, so a single
// huge group and hundreds of tiny ones both keep every core busy. Inside an item (GotoBLAS
// style): the K loop is cut into KC blocks; each block of B is packed into NR=64-column
// micro-panels (bf16: VNNI pairs, two consecutive k of one column in one 32-bit word, the layout
// vdpbf16ps consumes; fp32/fp16: fp32 rows), and an MR x 64 register-blocked micro-kernel
// (6 x 4 zmm accumulators) runs over every (row block, panel), accumulating in fp32 in a
// per-thread C tile that is rounded once into the output dtype at the end.
//
// Each thread claims its next item one step ahead and prefetches (into L2) the operands of the
// next K block while it computes; large outputs come from amo::empty_large (common/alloc.h):
// reused, already faulted-in, huge-page blocks instead of fresh pages on every call. The bf16 micro-kernel rounds the last K block
// straight into the output.
//
// dtypes: bf16 -> AMX tiles (tdpbf16ps) where the CPU has AMX-BF16 and the OS grants the tile
// state (AMO_GG_AMX=0 switches it off), else _mm512_dpbf16_ps (AVX512_BF16), fp32 accumulation; fp32 -> FMA; fp16 ->
// converted to fp32 while packing (A and B), then the fp32 kernel; fp64 (oracle use only) ->
// at::mm per group. Built with -march=native; without AVX512_BF16/AVX512F the same drivers run
// the scalar fallback micro-kernel (correct, slow), so the extension still builds and works.
#include "common/alloc.h"
#include "common/bf16.h"
#include "common/vec.h"
#include "common/checks.h"
#include "common/registry.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AMO_GG_AVX512 1
#else
#define AMO_GG_AVX512 0
#endif
#if AMO_GG_AVX512 && defined(__AVX512BF16__)
#define AMO_GG_BF16DOT 1
#else
#define AMO_GG_BF16DOT 0
#endif
// AMX (Intel Sapphire Rapids and later): the bf16 tile kernel; compiled in when the build targets
// a CPU with AMX-TILE + AMX-BF16 (-march=native there), used when the CPU and the OS allow it.
#if AMO_GG_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMO_GG_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define AMO_GG_AMX 0
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

// Runtime blocking for bf16 (defaults above; AMO_GG_KC / AMO_GG_MC override them, for tuning only).
inline int64_t env_or(const char* name, int64_t dflt, int64_t lo, int64_t hi, int64_t mult) {
  const char* v = std::getenv(name);
  if (v == nullptr) return dflt;
  int64_t x = std::atoll(v) / mult * mult;
  return std::max(lo, std::min(hi, x));
}
inline int64_t kc_bf16() { static const int64_t v = env_or("AMO_GG_KC", KC_BF16, 32, KC_BF16, 32); return v; }
inline int64_t mc_rows() { static const int64_t v = env_or("AMO_GG_MC", MC, MR, MC, MR); return v; }

// software prefetch: 1 = into L2 (default), 2 = into L1, 0 = off (AMO_GG_PF, for tuning only)
inline int64_t pf_mode() { static const int64_t v = env_or("AMO_GG_PF", 1, 0, 2, 1); return v; }

// columns per item of the AMX forward / dX (AMO_GG_NC, read per call, for tuning only)
inline int64_t nc_amx() { return env_or("AMO_GG_NC", NC_MAX, NR, NC_MAX, NR); }

inline int64_t pf_spread() { static const int64_t v = env_or("AMO_GG_PF_SPREAD", 1, 1, 8, 1); return v; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

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

// ------------------------------------------------------------------------------------------
// Micro-kernels: C[r][0..64) (+)= sum_k A(r,k) B(k, 0..64) for r < MRr.
#if AMO_GG_BF16DOT
// With `out` set (the last K block) the results are rounded to bf16 and stored straight into the
// output (columns < ncols); otherwise the fp32 partial sums go to C.
template <int MRr>
inline void ukr_bf16(const uint32_t* A, int64_t rs, int64_t ks, const uint32_t* B, int64_t kp_n,
                     float* C, int64_t ldc, bool first, uint16_t* out, int64_t ldo, int64_t ncols) {
  __m512 c[MRr][4];
  for (int r = 0; r < MRr; ++r)
    for (int j = 0; j < 4; ++j)
      c[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + r * ldc + 16 * j);
  const uint32_t* ap[MRr];
  for (int r = 0; r < MRr; ++r) ap[r] = A + r * rs;
  for (int64_t p = 0; p < kp_n; ++p) {
    const uint32_t* bp = B + p * NR;
    __m512bh b0 = (__m512bh)_mm512_load_si512(bp);
    __m512bh b1 = (__m512bh)_mm512_load_si512(bp + 16);
    __m512bh b2 = (__m512bh)_mm512_load_si512(bp + 32);
    __m512bh b3 = (__m512bh)_mm512_load_si512(bp + 48);
    for (int r = 0; r < MRr; ++r) {
      __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[r][p * ks]));
      c[r][0] = _mm512_dpbf16_ps(c[r][0], a, b0);
      c[r][1] = _mm512_dpbf16_ps(c[r][1], a, b1);
      c[r][2] = _mm512_dpbf16_ps(c[r][2], a, b2);
      c[r][3] = _mm512_dpbf16_ps(c[r][3], a, b3);
    }
  }
  if (out != nullptr) {
    for (int j = 0; j < 4; ++j) {
      const int64_t cnt = ncols - 16 * j;
      if (cnt <= 0) break;
      const __mmask16 mk = cnt >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cnt) - 1u);
      for (int r = 0; r < MRr; ++r)
        _mm256_mask_storeu_epi16(out + r * ldo + 16 * j, mk, vec::f32_to_bf16_bits(c[r][j]));
    }
    return;
  }
  for (int r = 0; r < MRr; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(C + r * ldc + 16 * j, c[r][j]);
}
#else
inline float bf16_lo(uint32_t w) { uint32_t u = w << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float bf16_hi(uint32_t w) { uint32_t u = w & 0xFFFF0000u; float f; std::memcpy(&f, &u, 4); return f; }
template <int MRr>
inline void ukr_bf16(const uint32_t* A, int64_t rs, int64_t ks, const uint32_t* B, int64_t kp_n,
                     float* C, int64_t ldc, bool first, uint16_t* out, int64_t ldo, int64_t ncols) {
  for (int r = 0; r < MRr; ++r) {
    float acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = first ? 0.f : C[r * ldc + j];
    for (int64_t p = 0; p < kp_n; ++p) {
      uint32_t a = A[r * rs + p * ks];
      for (int j = 0; j < NR; ++j) {
        uint32_t b = B[p * NR + j];
        acc[j] += bf16_lo(a) * bf16_lo(b) + bf16_hi(a) * bf16_hi(b);
      }
    }
    if (out != nullptr) {
      for (int j = 0; j < NR && j < ncols; ++j) out[r * ldo + j] = amo::bf16::from_f32(acc[j]);
    } else {
      for (int j = 0; j < NR; ++j) C[r * ldc + j] = acc[j];
    }
  }
}
#endif

template <int MRr>
inline void ukr_f32(const float* A, int64_t rs, int64_t ks, const float* B, int64_t kc, float* C,
                    int64_t ldc, bool first) {
#if AMO_GG_AVX512
  __m512 c[MRr][4];
  for (int r = 0; r < MRr; ++r)
    for (int j = 0; j < 4; ++j)
      c[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + r * ldc + 16 * j);
  const float* ap[MRr];
  for (int r = 0; r < MRr; ++r) ap[r] = A + r * rs;
  for (int64_t k = 0; k < kc; ++k) {
    const float* bp = B + k * NR;
    __m512 b0 = _mm512_load_ps(bp), b1 = _mm512_load_ps(bp + 16);
    __m512 b2 = _mm512_load_ps(bp + 32), b3 = _mm512_load_ps(bp + 48);
    for (int r = 0; r < MRr; ++r) {
      __m512 a = _mm512_set1_ps(ap[r][k * ks]);
      c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
      c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
      c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
      c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
    }
  }
  for (int r = 0; r < MRr; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(C + r * ldc + 16 * j, c[r][j]);
#else
  for (int r = 0; r < MRr; ++r) {
    float acc[NR];
    for (int j = 0; j < NR; ++j) acc[j] = first ? 0.f : C[r * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
      float a = A[r * rs + k * ks];
      for (int j = 0; j < NR; ++j) acc[j] += a * B[k * NR + j];
    }
    for (int j = 0; j < NR; ++j) C[r * ldc + j] = acc[j];
  }
#endif
}

template <typename Fn6, typename Fn5, typename Fn4, typename Fn3, typename Fn2, typename Fn1>
inline void dispatch_mr(int64_t mr, Fn6 f6, Fn5 f5, Fn4 f4, Fn3 f3, Fn2 f2, Fn1 f1) {
  switch (mr) {
    case 6: f6(); break;
    case 5: f5(); break;
    case 4: f4(); break;
    case 3: f3(); break;
    case 2: f2(); break;
    default: f1(); break;
  }
}

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
// Element conversion helpers
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
// One tile: out[m x n] = A[m x K] . B[K x n]; m <= MC, n <= NC.
struct Operand {
  const void* p;
  int64_t s0, s1;  // A: (row stride, k stride); B: (k stride, col stride)
};

// One work item's GEMM: out[m x n] (ldo) = A[m x K] . B[K x n].
struct TileArgs {
  int64_t m, n, K;
  Operand A, B;
  void* out;
  int64_t ldo;
  bool amx = false;  // bf16 only: run the AMX tile kernel (see amx_usable)
};

// ------------------------------------------------------------------------------------------
// AMX. Tiles: C 0..3 (fp32, 16 x 16 each: rows [0,16) x cols [0,16) / [16,32), rows [16,32) x
// the same), A 4..5 (16 rows x 16 bf16 pairs), B 6..7 (16 pairs x 16 columns, the VNNI layout the
// packed B panels already have: a panel row is 64 words, so a B tile is a 64-byte slice of 16
// consecutive panel rows, stride 256 bytes). One micro-step: 4 tile loads, 4 tdpbf16ps
// (16 x 16 x 32 MACs each), C stays in the tiles for the whole K block.
#if AMO_GG_AMX
inline bool amx_ready() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    // Linux keeps the tile data state off until a process asks (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// rows of the two A row blocks (ra0 in 1..16, ra1 in 0..16)
inline void amx_configure(int ra0, int ra1) {
  AmxConfig cfg;
  const int ra[2] = {ra0, ra1};
  for (int h = 0; h < 2; ++h) {
    if (ra[h] == 0) continue;
    cfg.rows[2 * h] = cfg.rows[2 * h + 1] = static_cast<uint8_t>(ra[h]);  // C tiles
    cfg.colsb[2 * h] = cfg.colsb[2 * h + 1] = 64;
    cfg.rows[4 + h] = static_cast<uint8_t>(ra[h]);  // A tile: ra rows x 16 pairs
    cfg.colsb[4 + h] = 64;
  }
  for (int t = 6; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }  // B tiles
  _tile_loadconfig(&cfg);
}

// C rows [0, ra0 + ra1) x cols [0, ldc) (+)= A . B over kp16 pairs (a multiple of 16, zero-padded).
// A row r, pair p at aw[r * a_ld + p]; B panel j at bpk + j * kp_max * NR.
template <bool TWO>
inline void amx_block(const uint32_t* aw, int64_t a_ld, const uint32_t* bpk, int64_t kp_max,
                      int64_t kp16, float* C, int64_t ldc, bool first) {
  const int64_t cs = ldc * 4;
  for (int64_t cc = 0; cc < ldc; cc += 32) {
    const uint32_t* bp = bpk + (cc / NR) * kp_max * NR + (cc % NR);
    float* c0 = C + cc;
    float* c1 = C + 16 * ldc + cc;
    if (first) {
      _tile_zero(0);
      _tile_zero(1);
      if (TWO) { _tile_zero(2); _tile_zero(3); }
    } else {
      _tile_loadd(0, c0, cs);
      _tile_loadd(1, c0 + 16, cs);
      if (TWO) { _tile_loadd(2, c1, cs); _tile_loadd(3, c1 + 16, cs); }
    }
    for (int64_t p0 = 0; p0 < kp16; p0 += 16) {
      _tile_loadd(6, bp + p0 * NR, NR * 4);
      _tile_loadd(7, bp + p0 * NR + 16, NR * 4);
      _tile_loadd(4, aw + p0, a_ld * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (TWO) {
        _tile_loadd(5, aw + 16 * a_ld + p0, a_ld * 4);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c0, cs);
    _tile_stored(1, c0 + 16, cs);
    if (TWO) { _tile_stored(2, c1, cs); _tile_stored(3, c1 + 16, cs); }
  }
}
#endif

// Software prefetch of the operands of the *next* K block (of this item, or of the item this
// thread runs next), spread over the micro-kernel calls of the current block so that the DRAM
// reads of the next weight tile overlap compute (a fine-grained expert's weight is used by only
// ~64 rows, so its latency would otherwise show).
struct Prefetcher {
  struct Range { const char* p; int64_t rows, row_bytes, stride; };
  Range r[2];
  int nr = 0, cur = 0;
  int64_t row = 0, off = 0, left = 0;
  void add(const void* p, int64_t rows, int64_t row_bytes, int64_t stride) {
    if (rows > 0 && row_bytes > 0 && nr < 2) {
      r[nr++] = {static_cast<const char*>(p), rows, row_bytes, stride};
      left += rows * ceil_div(row_bytes, 64);
    }
  }
  // the ranges read by the packing of K block [k0, k0 + kc) of `t` (elements of `es` bytes)
  void add_block(const TileArgs& t, int64_t k0, int64_t kc, int64_t es) {
    const char* a = static_cast<const char*>(t.A.p);
    const char* b = static_cast<const char*>(t.B.p);
    if (t.B.s1 == 1) add(b + k0 * t.B.s0 * es, kc, t.n * es, t.B.s0 * es);
    else if (t.B.s0 == 1) add(b + k0 * es, t.n, kc * es, t.B.s1 * es);
    if (t.A.s1 == 1) add(a + k0 * es, t.m, kc * es, t.A.s0 * es);
    else if (t.A.s0 == 1) add(a + k0 * t.A.s1 * es, kc, t.m * es, t.A.s1 * es);
  }
  int64_t lines() const { return pf_mode() == 0 ? 0 : left; }
  void step(int64_t n) {
#if AMO_GG_AVX512
    if (pf_mode() == 0) return;
    while (n-- > 0 && cur < nr) {
      const Range& g = r[cur];
      if (pf_mode() == 2) _mm_prefetch(g.p + row * g.stride + off, _MM_HINT_T0);
      else _mm_prefetch(g.p + row * g.stride + off, _MM_HINT_T1);
      --left;
      off += 64;
      if (off >= g.row_bytes) {
        off = 0;
        if (++row >= g.rows) { row = 0; ++cur; }
      }
    }
#else
    (void)n;
#endif
  }
};

#if AMO_GG_AMX
// The AMX version of tile_bf16 (same packing of B; A read in place for x rows, else packed as
// [row][pair]); fp32 partial sums in ws.c, rounded into the output once at the end.
inline void tile_bf16_amx(const TileArgs& t, const TileArgs* next, Workspace& ws) {
  const int64_t m = t.m, n = t.n, K = t.K, ldo = t.ldo;
  const Operand A = t.A, B = t.B;
  const uint16_t* a = static_cast<const uint16_t*>(A.p);
  const uint16_t* b = static_cast<const uint16_t*>(B.p);
  const int64_t npan = ceil_div(n, NR);
  const int64_t ldc = npan * NR;
  const int64_t kp_max = round_up(KC_BF16 / 2, 16);
  const bool a_direct = A.s1 == 1 && A.s0 % 2 == 0 && K % 32 == 0;  // x rows: whole 16-pair steps
  const int64_t full = m / 32 * 32;
  const int64_t tail = m - full;
  for (int64_t k0 = 0; k0 < K; k0 += KC_BF16) {
    const int64_t kc = std::min(KC_BF16, K - k0);
    const int64_t kp = (kc + 1) / 2;
    const int64_t kp16 = round_up(kp, 16);
    for (int64_t j = 0; j < npan; ++j) {
      const int64_t nn = std::min(NR, n - j * NR);
      uint32_t* dst = ws.b + j * kp_max * NR;
      if (B.s1 == 1) interleave_rows(b + k0 * B.s0 + j * NR, B.s0, kc, nn, dst, NR, NR);
      else pack_transposed_bf16(b + j * NR * B.s1 + k0, B.s1, kc, nn, dst, NR);
      if (kp16 > kp) std::memset(dst + kp * NR, 0, sizeof(uint32_t) * (kp16 - kp) * NR);
    }
    const uint32_t* aw;
    int64_t a_ld;
    if (a_direct) {
      // copy the block's x rows into ws.a, rows of kp16 pairs back to back: tile loads straight
      // from x rows whose stride is a multiple of 4 KiB (K = 2048: 32 rows on the same L1 sets)
      // evict each other, and the copy also pulls the prefetched rows from L2 once per block
      for (int64_t r = 0; r < m; ++r)
        std::memcpy(ws.a + r * kp16, a + r * A.s0 + k0, sizeof(uint32_t) * static_cast<size_t>(kp16));
      aw = ws.a;
      a_ld = kp16;
    } else {
      // A(r, k) at a[r * s0 + k * s1] with s0 == 1 (dW: A = a^T): interleave k-row pairs into
      // [pair][row] (ws.t), zero the pad pairs, transpose 16 x 16 blocks into [row][pair] (ws.a)
      const int64_t ld = round_up(m, 16);
      interleave_rows(a + k0 * A.s1, A.s1, kc, m, ws.t, ld, ld);
      if (kp16 > kp) std::memset(ws.t + kp * ld, 0, sizeof(uint32_t) * (kp16 - kp) * ld);
      for (int64_t r0 = 0; r0 < ld; r0 += 16)
        for (int64_t p0 = 0; p0 < kp16; p0 += 16) {
          __m512i r[16];
          for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(ws.t + (p0 + i) * ld + r0);
          transpose16x16_epi32(r);
          for (int i = 0; i < 16; ++i) _mm512_storeu_si512(ws.a + (r0 + i) * kp_max + p0, r[i]);
        }
      aw = ws.a;
      a_ld = kp_max;
    }
    const bool first = k0 == 0;
    // prefetch (L2) the next K block's operands, or the next item's first, spread over the row
    // blocks: a group's weights come from DRAM and AMX computes faster than they stream in
    Prefetcher pf;
    if (k0 + KC_BF16 < K) pf.add_block(t, k0 + KC_BF16, std::min(KC_BF16, K - k0 - KC_BF16), 2);
    else if (next != nullptr && next->K > 0) pf.add_block(*next, 0, std::min(KC_BF16, next->K), 2);
    const int64_t per_block = ceil_div(pf.lines(), std::max<int64_t>(1, ceil_div(m, 32)));
    if (full) {
      amx_configure(16, 16);
      for (int64_t i = 0; i < full; i += 32) {
        pf.step(per_block);
        amx_block<true>(aw + i * a_ld, a_ld, ws.b, kp_max, kp16, ws.c + i * ldc, ldc, first);
      }
    }
    pf.step(per_block);
    if (tail) {
      const int ra0 = static_cast<int>(std::min<int64_t>(16, tail));
      const int ra1 = static_cast<int>(tail - ra0);
      amx_configure(ra0, ra1);
      if (ra1) amx_block<true>(aw + full * a_ld, a_ld, ws.b, kp_max, kp16, ws.c + full * ldc, ldc, first);
      else amx_block<false>(aw + full * a_ld, a_ld, ws.b, kp_max, kp16, ws.c + full * ldc, ldc, first);
    }
  }
  _tile_release();
  c10::BFloat16* out = static_cast<c10::BFloat16*>(t.out);
  if (K == 0) zero_tile(m, n, out, ldo);
  else store_tile(ws.c, ldc, m, n, out, ldo);
}
#endif

// AMX for this call? Compiled in, CPU + OS allow it, and not switched off with AMO_GG_AMX=0 (read
// per call, so one process can time both kernels).
inline bool amx_wanted(at::ScalarType dt) {
#if AMO_GG_AMX
  if (dt != at::kBFloat16) return false;
  const char* v = std::getenv("AMO_GG_AMX");
  if (v != nullptr && v[0] == '0') return false;
  return amx_ready();
#else
  (void)dt;
  return false;
#endif
}

inline void tile_bf16(const TileArgs& t, const TileArgs* next, Workspace& ws) {
#if AMO_GG_AMX
  if (t.amx) {
    tile_bf16_amx(t, next, ws);
    return;
  }
#endif
  const int64_t m = t.m, n = t.n, K = t.K, ldo = t.ldo;
  const Operand A = t.A, B = t.B;
  c10::BFloat16* out = static_cast<c10::BFloat16*>(t.out);
  const uint16_t* a = static_cast<const uint16_t*>(A.p);
  const uint16_t* b = static_cast<const uint16_t*>(B.p);
  const int64_t npan = ceil_div(n, NR);
  const int64_t ldc = npan * NR;
  const int64_t kp_max = round_up(KC_BF16 / 2, 16);  // buffer layout (max block)
  const int64_t KCB = kc_bf16();
  // A read in place when each row holds its k pairs contiguously (x rows with even K)
  const bool a_direct = A.s1 == 1 && A.s0 % 2 == 0 && K % 2 == 0;
  for (int64_t k0 = 0; k0 < K; k0 += KCB) {
    const int64_t kc = std::min(KCB, K - k0);
    const int64_t kp = (kc + 1) / 2;
    for (int64_t j = 0; j < npan; ++j) {
      const int64_t nn = std::min(NR, n - j * NR);
      uint32_t* dst = ws.b + j * kp_max * NR;
      if (B.s1 == 1) {
        interleave_rows(b + k0 * B.s0 + j * NR, B.s0, kc, nn, dst, NR, NR);
      } else if (B.s0 == 1) {
        pack_transposed_bf16(b + j * NR * B.s1 + k0, B.s1, kc, nn, dst, NR);
      } else {
        // generic: columns as "rows" of pack_pairs_generic, then scattered into the panel
        for (int64_t p = 0; p < kp; ++p)
          for (int64_t c = 0; c < NR; ++c) {
            uint32_t lo = 0, hi = 0;
            if (c < nn) {
              lo = b[(k0 + 2 * p) * B.s0 + (j * NR + c) * B.s1];
              if (2 * p + 1 < kc) hi = b[(k0 + 2 * p + 1) * B.s0 + (j * NR + c) * B.s1];
            }
            dst[p * NR + c] = lo | (hi << 16);
          }
      }
    }
    // A row block starting at row i: aw + (i / MR) * abs_, element (r, p) at [r * ars + p * aks]
    const uint32_t* aw;
    int64_t ars, aks, abs_;
    if (a_direct) {
      aw = reinterpret_cast<const uint32_t*>(a + k0);
      ars = A.s0 / 2;
      aks = 1;
      abs_ = MR * ars;
    } else if (A.s0 == 1) {
      // columns of A contiguous (the dW case, A = a^T): interleave k-row pairs, then cut into
      // MR-row panels [block][kp][MR] so that the micro-kernel reads A sequentially
      const int64_t ld = round_up(m, 16);
      interleave_rows(a + k0 * A.s1, A.s1, kc, m, ws.t, ld, ld);
      for (int64_t i0 = 0; i0 < m; i0 += MR) {
        const int64_t mr = std::min(MR, m - i0);
        uint32_t* dst = ws.a + (i0 / MR) * kp_max * MR;
        const uint32_t* src = ws.t + i0;
#if AMO_GG_AVX512
        const __mmask8 mk = static_cast<__mmask8>((1u << mr) - 1u);
        for (int64_t p = 0; p < kp; ++p)
          _mm256_mask_storeu_epi32(dst + p * MR, mk, _mm256_maskz_loadu_epi32(mk, src + p * ld));
#else
        for (int64_t p = 0; p < kp; ++p)
          for (int64_t r = 0; r < mr; ++r) dst[p * MR + r] = src[p * ld + r];
#endif
      }
      aw = ws.a;
      ars = 1;
      aks = MR;
      abs_ = kp_max * MR;
    } else {
      pack_pairs_generic(a + k0 * A.s1, A.s0, A.s1, m, kc, ws.a, kp_max);
      aw = ws.a;
      ars = kp_max;
      aks = 1;
      abs_ = MR * kp_max;
    }
    const bool first = k0 == 0;
    Prefetcher pf;
    const bool last = k0 + KCB >= K;
    if (!last) pf.add_block(t, k0 + KCB, std::min(KCB, K - k0 - KCB), 2);
    else if (next != nullptr && next->K > 0) pf.add_block(*next, 0, std::min(KCB, next->K), 2);
    // issue the prefetches over the first 1/pf_spread() of this block's micro-kernel calls
    const int64_t per_call = ceil_div(pf.lines() * pf_spread(), npan * ceil_div(m, MR));
    for (int64_t j = 0; j < npan; ++j) {
      const uint32_t* bp = ws.b + j * kp_max * NR;
      for (int64_t i = 0; i < m; i += MR) {
        const int64_t mr = std::min(MR, m - i);
        pf.step(per_call);
        const uint32_t* aip = aw + (i / MR) * abs_;
        float* c = ws.c + i * ldc + j * NR;
        uint16_t* o = last ? reinterpret_cast<uint16_t*>(out) + i * ldo + j * NR : nullptr;
        const int64_t nc = n - j * NR;
        dispatch_mr(
            mr, [&] { ukr_bf16<6>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); },
            [&] { ukr_bf16<5>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); },
            [&] { ukr_bf16<4>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); },
            [&] { ukr_bf16<3>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); },
            [&] { ukr_bf16<2>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); },
            [&] { ukr_bf16<1>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc); });
      }
    }
  }
  if (K == 0) zero_tile(m, n, out, ldo);  // otherwise the last K block stored the results
}

// fp32 and fp16 (converted to fp32 while packing).
template <typename T>
inline void tile_f32(const TileArgs& t, Workspace& ws) {
  const int64_t m = t.m, n = t.n, K = t.K, ldo = t.ldo;
  const Operand A = t.A, B = t.B;
  T* out = static_cast<T*>(t.out);
  const T* a = static_cast<const T*>(A.p);
  const T* b = static_cast<const T*>(B.p);
  constexpr bool is_f32 = std::is_same<T, float>::value;
  const int64_t npan = ceil_div(n, NR);
  const int64_t ldc = npan * NR;
  float* bpk = reinterpret_cast<float*>(ws.b);
  float* apk = reinterpret_cast<float*>(ws.a);
  for (int64_t k0 = 0; k0 < K; k0 += KC_F32) {
    const int64_t kc = std::min(KC_F32, K - k0);
    for (int64_t j = 0; j < npan; ++j) {
      const int64_t nn = std::min(NR, n - j * NR);
      float* dst = bpk + j * KC_F32 * NR;
      if (B.s1 == 1) {
        for (int64_t k = 0; k < kc; ++k) {
          const T* src = b + (k0 + k) * B.s0 + j * NR;
          float* d = dst + k * NR;
#if AMO_GG_AVX512
          for (int64_t c = 0; c < NR; c += 16) {
            const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(16, nn - c));
            const __mmask16 mk = cnt >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cnt) - 1u);
            __m512 v;
            if constexpr (is_f32) v = _mm512_maskz_loadu_ps(mk, src + c);
            else v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, src + c));
            _mm512_store_ps(d + c, v);
          }
#else
          for (int64_t c = 0; c < NR; ++c) d[c] = c < nn ? to_f32(src[c]) : 0.f;
#endif
        }
      } else {
        // transposed / generic: column by column (k contiguous when B.s0 == 1)
        for (int64_t c = 0; c < NR; ++c) {
          if (c < nn) {
            const T* src = b + k0 * B.s0 + (j * NR + c) * B.s1;
            for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = to_f32(src[k * B.s0]);
          } else {
            for (int64_t k = 0; k < kc; ++k) dst[k * NR + c] = 0.f;
          }
        }
      }
    }
    const float* ap;
    int64_t ars, aks;
    if (is_f32) {
      ap = reinterpret_cast<const float*>(a) + k0 * A.s1;
      ars = A.s0;
      aks = A.s1;
    } else {
      for (int64_t r = 0; r < m; ++r)
        for (int64_t k = 0; k < kc; ++k) apk[r * KC_F32 + k] = to_f32(a[r * A.s0 + (k0 + k) * A.s1]);
      ap = apk;
      ars = KC_F32;
      aks = 1;
    }
    const bool first = k0 == 0;
    for (int64_t j = 0; j < npan; ++j) {
      const float* bp = bpk + j * KC_F32 * NR;
      for (int64_t i = 0; i < m; i += MR) {
        const int64_t mr = std::min(MR, m - i);
        const float* ai = ap + i * ars;
        float* c = ws.c + i * ldc + j * NR;
        dispatch_mr(
            mr, [&] { ukr_f32<6>(ai, ars, aks, bp, kc, c, ldc, first); },
            [&] { ukr_f32<5>(ai, ars, aks, bp, kc, c, ldc, first); },
            [&] { ukr_f32<4>(ai, ars, aks, bp, kc, c, ldc, first); },
            [&] { ukr_f32<3>(ai, ars, aks, bp, kc, c, ldc, first); },
            [&] { ukr_f32<2>(ai, ars, aks, bp, kc, c, ldc, first); },
            [&] { ukr_f32<1>(ai, ars, aks, bp, kc, c, ldc, first); });
      }
    }
  }
  if (K == 0) {
    zero_tile(m, n, out, ldo);
    return;
  }
  store_tile(ws.c, ldc, m, n, out, ldo);
}

template <typename T>
inline void run_tile(const TileArgs& t, const TileArgs* next, Workspace& ws) {
  if constexpr (std::is_same<T, c10::BFloat16>::value) tile_bf16(t, next, ws);
  else tile_f32<T>(t, ws);
}

// ------------------------------------------------------------------------------------------
// Work items and the threaded driver
struct Item {
  int64_t e, r0, m, c0, n;  // group, first row (within the group's A/out), rows, first col, cols
};

// Split `rows` into tiles of at most MC rows of nearly equal size (multiples of MR).
inline void split_rows(int64_t rows, std::vector<std::pair<int64_t, int64_t>>& out) {
  out.clear();
  if (rows <= 0) return;
  const int64_t nt = ceil_div(rows, mc_rows());
  const int64_t step = round_up(ceil_div(rows, nt), MR);
  for (int64_t r = 0; r < rows; r += step) out.emplace_back(r, std::min(step, rows - r));
}

template <typename Body>
void run_items(const std::vector<Item>& items, Body body) {
  const int64_t n_items = static_cast<int64_t>(items.size());
  if (n_items == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nth = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, nth, 1, [&](int64_t, int64_t) {
    Workspace ws;
    // each thread claims its next item one step ahead, so that it can prefetch its operands
    int64_t cur = next.fetch_add(1, std::memory_order_relaxed);
    while (cur < n_items) {
      const int64_t nxt = next.fetch_add(1, std::memory_order_relaxed);
      body(items[cur], nxt < n_items ? &items[nxt] : nullptr, ws);
      cur = nxt;
    }
  });
}

// Runs `items` with the tile kernel of dtype `dt` (fp32, fp16 or bf16); `make_args(item, tag)`
// gives an item's TileArgs for element type decltype(tag). The next item's args go along for
// the prefetch.
template <typename MakeArgs>
void run_typed(at::ScalarType dt, const std::vector<Item>& items, MakeArgs make_args) {
  auto body = [&](auto tag) {
    using T = decltype(tag);
    run_items(items, [&](const Item& it, const Item* nx, Workspace& ws) {
      const TileArgs t = make_args(it, tag);
      if (nx) {
        const TileArgs tn = make_args(*nx, tag);
        run_tile<T>(t, &tn, ws);
      } else {
        run_tile<T>(t, nullptr, ws);
      }
    });
  };
  if (dt == at::kFloat) body(float{});
  else if (dt == at::kHalf) body(c10::Half{});
  else body(c10::BFloat16{});
}

std::vector<int64_t> host_sizes(const at::Tensor& group_sizes, int64_t rows, const char* what) {
  TORCH_CHECK(group_sizes.dim() == 1, what, ": group_sizes must be 1-D, got ", group_sizes.sizes());
  TORCH_CHECK(group_sizes.scalar_type() == at::kInt || group_sizes.scalar_type() == at::kLong,
              what, ": group_sizes must be int32 or int64, got ", group_sizes.scalar_type());
  at::Tensor gs = group_sizes.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> v(gs.data_ptr<int64_t>(), gs.data_ptr<int64_t>() + gs.numel());
  int64_t total = 0;
  for (size_t e = 0; e < v.size(); ++e) {
    TORCH_CHECK(v[e] >= 0, what, ": group_sizes must be non-negative, got ", v[e], " for group ", e);
    total += v[e];
  }
  TORCH_CHECK(total <= rows, what, ": sum(group_sizes) = ", total, " exceeds the ", rows,
              " rows of the input");
  return v;
}

at::Tensor grouped_gemm_cpu(const at::Tensor& x_, const at::Tensor& w_, const at::Tensor& group_sizes,
                            bool trans_b) {
  TORCH_CHECK(x_.device().is_cpu() && w_.device().is_cpu(), "grouped_gemm (native): x and weight must be cpu tensors");
  TORCH_CHECK(x_.dim() == 2 && w_.dim() == 3, "grouped_gemm: x must be 2-D and weight 3-D, got ",
              x_.sizes(), " and ", w_.sizes());
  TORCH_CHECK(x_.scalar_type() == w_.scalar_type(), "grouped_gemm: x and weight dtypes differ: ",
              x_.scalar_type(), " vs ", w_.scalar_type());
  const at::Tensor x = x_.contiguous(), w = w_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), E = w.size(0);
  const int64_t N = trans_b ? w.size(1) : w.size(2);
  TORCH_CHECK((trans_b ? w.size(2) : w.size(1)) == K, "grouped_gemm: weight ", w.sizes(),
              " (trans_b=", trans_b, ") does not match x's K=", K);
  TORCH_CHECK(group_sizes.numel() == E, "grouped_gemm: group_sizes has ", group_sizes.numel(),
              " entries but weight has ", E, " experts");
  const std::vector<int64_t> gs = host_sizes(group_sizes, M, "grouped_gemm");
  at::Tensor out = amo::empty_large({M, N}, x.options());
  int64_t total = 0;
  for (int64_t g : gs) total += g;
  if (total < M) out.narrow(0, total, M - total).zero_();
  if (total == 0 || N == 0) return out;

  if (x.scalar_type() == at::kDouble) {  // oracle dtype: plain per-group matmuls
    int64_t off = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (gs[e]) {
        at::Tensor we = trans_b ? w[e].t() : w[e];
        at::Tensor oe = out.narrow(0, off, gs[e]);
        at::mm_out(oe, x.narrow(0, off, gs[e]), we);
      }
      off += gs[e];
    }
    return out;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "grouped_gemm: unsupported dtype ", x.scalar_type());

  const bool amx = amx_wanted(x.scalar_type()) && K % 32 == 0;  // x rows in whole 16-pair steps
  // items ordered (group, N-tile, M-tile): threads that work at the same time share the B tile.
  // AMX: wider N-tiles, so that each x row block is fetched fewer times per group
  const int64_t nc = amx ? nc_amx() : NC;
  std::vector<Item> items;
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    split_rows(gs[e], rows);
    for (int64_t c0 = 0; c0 < N; c0 += nc)
      for (auto& rm : rows) items.push_back({e, off + rm.first, rm.second, c0, std::min(nc, N - c0)});
    off += gs[e];
  }
  const int64_t wsE = trans_b ? N * K : K * N;
  const void* xv = x.data_ptr();
  const void* wv = w.data_ptr();
  void* ov = out.data_ptr();
  run_typed(x.scalar_type(), items, [&](const Item& it, auto tag) {
    using T = decltype(tag);
    const T* we = static_cast<const T*>(wv) + it.e * wsE;
    // B(k, c): trans_b=False w[e][k][c]; trans_b=True w[e][c][k]
    Operand B = trans_b ? Operand{we + it.c0 * K, 1, K} : Operand{we + it.c0, N, 1};
    return TileArgs{it.m, it.n, K, Operand{static_cast<const T*>(xv) + it.r0 * K, K, 1}, B,
                    static_cast<T*>(ov) + it.r0 * N + it.c0, N, amx};
  });
  return out;
}

at::Tensor grouped_gemm_dw_cpu(const at::Tensor& a_, const at::Tensor& b_, const at::Tensor& group_sizes) {
  TORCH_CHECK(a_.device().is_cpu() && b_.device().is_cpu(), "grouped_gemm_dw (native): a and b must be cpu tensors");
  TORCH_CHECK(a_.dim() == 2 && b_.dim() == 2 && a_.size(0) == b_.size(0),
              "grouped_gemm_dw: a and b must be 2-D with the same rows, got ", a_.sizes(), " and ", b_.sizes());
  TORCH_CHECK(a_.scalar_type() == b_.scalar_type(), "grouped_gemm_dw: a and b dtypes differ: ",
              a_.scalar_type(), " vs ", b_.scalar_type());
  const at::Tensor a = a_.contiguous(), b = b_.contiguous();
  const int64_t M = a.size(0), P = a.size(1), Q = b.size(1);
  const std::vector<int64_t> gs = host_sizes(group_sizes, M, "grouped_gemm_dw");
  const int64_t E = static_cast<int64_t>(gs.size());
  at::Tensor out = amo::empty_large({E, P, Q}, a.options());
  if (out.numel() == 0) return out;
  if (a.scalar_type() == at::kDouble) {
    int64_t off = 0;
    for (int64_t e = 0; e < E; ++e) {
      at::Tensor oe = out[e];
      if (gs[e]) at::mm_out(oe, a.narrow(0, off, gs[e]).t(), b.narrow(0, off, gs[e]));
      else oe.zero_();
      off += gs[e];
    }
    return out;
  }
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16,
              "grouped_gemm_dw: unsupported dtype ", a.scalar_type());
  // items: (group, P-tile, Q-tile); the reduction runs over the group's rows (empty -> zeros)
  std::vector<Item> items;
  std::vector<int64_t> offs(E);
  std::vector<std::pair<int64_t, int64_t>> ptiles;
  split_rows(P, ptiles);
  int64_t off = 0;
  for (int64_t e = 0; e < E; ++e) {
    offs[e] = off;
    for (int64_t c0 = 0; c0 < Q; c0 += NC)
      for (auto& pm : ptiles) items.push_back({e, pm.first, pm.second, c0, std::min(NC, Q - c0)});
    off += gs[e];
  }
  const void* av = a.data_ptr();
  const void* bv = b.data_ptr();
  void* ov = out.data_ptr();
  const bool amx = amx_wanted(a.scalar_type());
  run_typed(a.scalar_type(), items, [&](const Item& it, auto tag) {
    using T = decltype(tag);
    const int64_t o = offs[it.e];
    Operand A{static_cast<const T*>(av) + o * P + it.r0, 1, P};  // A(r=p, k=row) = a[row][p]
    Operand B{static_cast<const T*>(bv) + o * Q + it.c0, Q, 1};  // B(k=row, c=q) = b[row][q]
    return TileArgs{it.m, it.n, gs[it.e], A, B, static_cast<T*>(ov) + it.e * P * Q + it.r0 * Q + it.c0, Q,
                    amx};
  });
  return out;
}

}  // namespace grouped_gemm_cpu
}  // namespace amo

AMO_REGISTER(grouped_gemm) {
  m.def("grouped_gemm", &amo::grouped_gemm_cpu::grouped_gemm_cpu,
        "grouped_gemm(x [M,K], weight [E,K,N] | [E,N,K], group_sizes [E], trans_b) -> [M,N]");
  m.def("grouped_gemm_dw", &amo::grouped_gemm_cpu::grouped_gemm_dw_cpu,
        "grouped_gemm_dw(a [M,P], b [M,Q], group_sizes [E]) -> [E,P,Q], out[e] = a_e^T b_e");
}

// ---- dispatcher kernels: the op-boundary checks (common/checks.h), then the kernels ----
namespace {
at::Tensor grouped_gemm_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& group_sizes, bool trans_b) {
  amo::checks::grouped_gemm(x, w, group_sizes, trans_b);
  return amo::grouped_gemm_cpu::grouped_gemm_cpu(x, w, group_sizes, trans_b);
}

at::Tensor grouped_gemm_dw_op(const at::Tensor& a, const at::Tensor& b, const at::Tensor& group_sizes) {
  amo::checks::grouped_gemm_dw(a, b, group_sizes);
  return amo::grouped_gemm_cpu::grouped_gemm_dw_cpu(a, b, group_sizes);
}
}  // namespace

AMO_KERNELS(grouped_gemm) {
  m.impl("grouped_gemm", TORCH_FN(grouped_gemm_op));
  m.impl("grouped_gemm_dw", TORCH_FN(grouped_gemm_dw_op));
}
