// Vectorized fp32 load/store of 16 elements of any float dtype (fp32, fp16, bf16, fp64), with an
// optional tail mask, for kernels that compute in fp32 and store in the tensor's dtype.
//
// With AVX-512 (a -march=native build on such a CPU, or a per-ISA unit of a portable build) a "vector" is one __m512; with AVX2 + FMA +
// F16C (and no AVX-512) two __m256; otherwise a plain 16-float struct that the compiler vectorizes
// as it can. The three give the same bits for every load, store, add, mul and fma (all IEEE fp32
// with one rounding; fma fused in all three); reduce_add sums in the same pairwise order in the
// AVX2 and scalar versions (tests/test_vec_avx2.py builds both and compares them bitwise). Conversions round exactly like
// c10::BFloat16 / c10::Half (round to nearest even, fp32 subnormals are not flushed; bf16: every
// NaN becomes 0x7FC0, the rounding of common/bf16.h), so a value stored here equals
// `tensor.float().to(dtype)` in PyTorch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/bf16.h"

#include <cmath>
#include <cstdint>
#include <cstring>

// A per-ISA unit of a portable build (cpu/grouped_gemm_kernel_<isa>.cpp,
// cpu/moe_unpermute_kernel_avx512.cpp) sets AMO_ISA_AVX512 and
// includes this header under `#pragma GCC target(...)`; every other unit follows its -march.
#if defined(AMO_ISA_AVX512)
#include <immintrin.h>
#define AMO_AVX512 AMO_ISA_AVX512
#define AMO_AVX2 (!AMO_ISA_AVX512)
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AMO_AVX512 1
#define AMO_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AMO_AVX512 0
#define AMO_AVX2 1
#else
#define AMO_AVX512 0
#define AMO_AVX2 0
#endif

// The functions live in a namespace named after the instruction set of the unit that compiles them
// (a per-ISA unit names its own, AMO_VEC_NS), so that units of one build compiled for different ISAs
// never share a function body.
#ifndef AMO_VEC_NS
#if AMO_AVX512
#define AMO_VEC_NS build_avx512
#elif AMO_AVX2
#define AMO_VEC_NS build_avx2
#else
#define AMO_VEC_NS build_scalar
#endif
#endif

namespace amo {
namespace vec {
inline namespace AMO_VEC_NS {

constexpr int64_t kWidth = 16;  // fp32 lanes per vector

// ---- exp / sigmoid ----------------------------------------------------------------------------
// exp(x) in fp32: Cephes expf (range reduction by ln 2 in two parts, degree-5 polynomial; about
// 1 ulp), x clamped to [-87, 88] first (a NaN input becomes -87, as max/min pick the second operand);
// 2^n applied by exact scaling. sigmoid(a) = 1 / (1 + exp(-a)). Both are written once (after the
// three versions) on per-version primitives -- sub, div, fnma, clamp, round_even, scale2 -- that
// are single IEEE fp32 operations in each, so every version gives the same bits.
namespace expc {
constexpr float kLo = -87.0f, kHi = 88.0f, kLog2e = 1.44269504088896341f;
constexpr float kSigmoidHi = 89.0f;  // round(89 * log2 e) = 128: at most 2^128 = +inf
constexpr float kC1 = 0.693359375f, kC2 = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace expc

#if AMO_AVX512

using VecF = __m512;
using Mask = __mmask16;

inline Mask tail_mask(int64_t n) {  // first n lanes (n in [0, 16])
  return n >= 16 ? static_cast<Mask>(0xFFFF) : static_cast<Mask>((1u << n) - 1u);
}
inline VecF zero() { return _mm512_setzero_ps(); }
inline VecF set1(float v) { return _mm512_set1_ps(v); }
inline VecF fma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF add(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline VecF mul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline float reduce_add(VecF a) { return _mm512_reduce_add_ps(a); }

// ---- loads -----------------------------------------------------------------------------------
inline VecF load(const float* p) { return _mm512_loadu_ps(p); }
inline VecF load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }

inline VecF bf16_bits_to_f32(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline VecF load(const c10::BFloat16* p) {
  return bf16_bits_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VecF load(const c10::BFloat16* p, Mask m) {
  return bf16_bits_to_f32(_mm256_maskz_loadu_epi16(m, p));
}
inline VecF load(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VecF load(const c10::Half* p, Mask m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline VecF load(const double* p) {
  __m256 lo = _mm512_cvtpd_ps(_mm512_loadu_pd(p));
  __m256 hi = _mm512_cvtpd_ps(_mm512_loadu_pd(p + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
inline VecF load(const double* p, Mask m) {
  __m256 lo = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(static_cast<__mmask8>(m & 0xFF), p));
  __m256 hi = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(static_cast<__mmask8>(m >> 8), p + 8));
  return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

// ---- stores ----------------------------------------------------------------------------------
inline void store(float* p, VecF v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, VecF v, Mask m) { _mm512_mask_storeu_ps(p, m, v); }

// fp32 -> bf16 bits: bf16::from_f32 (common/bf16.h) on 16 lanes: round to nearest even, NaN ->
// 0x7FC0. Integer math, so subnormals are rounded, not flushed (vcvtneps2bf16 would flush them).
// Every bf16 store of the native kernels goes through this or bf16::from_f32.
inline __m256i f32_to_bf16_bits(VecF v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb);
  __m512i out = _mm512_srli_epi32(rounded, 16);
  Mask nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  out = _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(out);
}
inline void store(c10::BFloat16* p, VecF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(v));
}
inline void store(c10::BFloat16* p, VecF v, Mask m) { _mm256_mask_storeu_epi16(p, m, f32_to_bf16_bits(v)); }
inline void store(c10::Half* p, VecF v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(c10::Half* p, VecF v, Mask m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store(double* p, VecF v) {
  _mm512_storeu_pd(p, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  _mm512_storeu_pd(p + 8, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}
inline void store(double* p, VecF v, Mask m) {
  _mm512_mask_storeu_pd(p, static_cast<__mmask8>(m & 0xFF), _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  _mm512_mask_storeu_pd(p + 8, static_cast<__mmask8>(m >> 8), _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}

// primitives of exp / sigmoid (defined once below for every version)
inline VecF sub(VecF a, VecF b) { return _mm512_sub_ps(a, b); }
inline VecF div(VecF a, VecF b) { return _mm512_div_ps(a, b); }
inline VecF fnma(VecF a, VecF b, VecF c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, fused
inline VecF clamp(VecF x, float lo, float hi) {  // a NaN x gives lo (max returns its second operand)
  return _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(lo)), _mm512_set1_ps(hi));
}
inline VecF round_even(VecF x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline VecF scale2(VecF p, VecF n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral

#elif AMO_AVX2

struct VecF {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
using Mask = uint32_t;  // bit i = lane i

inline Mask tail_mask(int64_t n) { return n >= 16 ? 0xFFFFu : ((1u << n) - 1u); }
inline VecF zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VecF set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VecF add(VecF a, VecF b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline VecF mul(VecF a, VecF b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline float reduce_add(VecF a) {  // the scalar version's order: lanes i + 8, then + 4, + 2, + 1
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  return _mm_cvtss_f32(s4);
}

// ---- loads: full vectors in registers; masked ones through a zero-filled lane buffer ----------
inline __m256 bf16x8_to_f32(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline VecF load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline VecF load(const c10::BFloat16* p) {
  return {bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VecF load(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VecF load(const double* p) {
  return {_mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 4)), _mm256_cvtpd_ps(_mm256_loadu_pd(p))),
          _mm256_set_m128(_mm256_cvtpd_ps(_mm256_loadu_pd(p + 12)), _mm256_cvtpd_ps(_mm256_loadu_pd(p + 8)))};
}
template <typename T>
inline VecF load(const T* p, Mask m) {
  if ((m & 0xFFFFu) == 0xFFFFu) return load(p);
  alignas(32) float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = (m >> i) & 1u ? static_cast<float>(p[i]) : 0.f;  // exact, or RNE for fp64
  return {_mm256_load_ps(buf), _mm256_load_ps(buf + 8)};
}

// ---- stores -----------------------------------------------------------------------------------
// fp32 -> bf16 bits on 8 lanes (bf16::from_f32: round to nearest even, NaN -> 0x7FC0), as 32-bit lanes
inline __m256i f32x8_to_bf16_bits32(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(_mm256_srli_epi32(rounded, 16), _mm256_set1_epi32(0x7FC0), nan);
}
// 16 bf16 values in lane order
inline __m256i f32_to_bf16_bits(VecF v) {
  const __m256i packed = _mm256_packus_epi32(f32x8_to_bf16_bits32(v.lo), f32x8_to_bf16_bits32(v.hi));
  return _mm256_permute4x64_epi64(packed, 0xD8);  // (lo 0-3, hi 0-3, lo 4-7, hi 4-7) -> lane order
}
inline __m256i f32_to_f16_bits(VecF v) {
  return _mm256_set_m128i(_mm256_cvtps_ph(v.hi, _MM_FROUND_TO_NEAREST_INT),
                          _mm256_cvtps_ph(v.lo, _MM_FROUND_TO_NEAREST_INT));
}
// plain (NT = false) or non-temporal (store_nt, below) stores of fp32 / bf16 / fp16 vectors
inline void put8(float* p, __m256 v, bool nt) { nt ? _mm256_stream_ps(p, v) : _mm256_storeu_ps(p, v); }
inline void put16(void* p, __m256i v, bool nt) {
  nt ? _mm256_stream_si256(static_cast<__m256i*>(p), v) : _mm256_storeu_si256(static_cast<__m256i*>(p), v);
}
template <bool NT> inline void store_as(float* p, VecF v) { put8(p, v.lo, NT); put8(p + 8, v.hi, NT); }
template <bool NT> inline void store_as(c10::BFloat16* p, VecF v) { put16(p, f32_to_bf16_bits(v), NT); }
template <bool NT> inline void store_as(c10::Half* p, VecF v) { put16(p, f32_to_f16_bits(v), NT); }
inline void store(float* p, VecF v) { store_as<false>(p, v); }
inline void store(c10::BFloat16* p, VecF v) { store_as<false>(p, v); }
inline void store(c10::Half* p, VecF v) { store_as<false>(p, v); }
inline void store(double* p, VecF v) {
  _mm256_storeu_pd(p, _mm256_cvtps_pd(_mm256_castps256_ps128(v.lo)));
  _mm256_storeu_pd(p + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(v.lo, 1)));
  _mm256_storeu_pd(p + 8, _mm256_cvtps_pd(_mm256_castps256_ps128(v.hi)));
  _mm256_storeu_pd(p + 12, _mm256_cvtps_pd(_mm256_extractf128_ps(v.hi, 1)));
}
template <typename T>
inline void store(T* p, VecF v, Mask m) {
  if ((m & 0xFFFFu) == 0xFFFFu) {
    store(p, v);
    return;
  }
  alignas(32) T buf[16];
  store(buf, v);
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1u) p[i] = buf[i];
}

// primitives of exp / sigmoid
inline VecF sub(VecF a, VecF b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline VecF div(VecF a, VecF b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline VecF fnma(VecF a, VecF b, VecF c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline VecF clamp(VecF x, float lo, float hi) {
  const __m256 l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
  return {_mm256_min_ps(_mm256_max_ps(x.lo, l), h), _mm256_min_ps(_mm256_max_ps(x.hi, l), h)};
}
inline VecF round_even(VecF x) {
  return {_mm256_round_ps(x.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(x.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p * 2^n with 2^n built in the exponent field: exact for n in [-126, 127] (all exp() passes)
inline __m256 pow2i(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline VecF scale2(VecF p, VecF n) { return {_mm256_mul_ps(p.lo, pow2i(n.lo)), _mm256_mul_ps(p.hi, pow2i(n.hi))}; }

#else  // portable fallback: same semantics, scalar code

struct VecF {
  float v[16];
};
using Mask = uint32_t;

inline Mask tail_mask(int64_t n) { return n >= 16 ? 0xFFFFu : ((1u << n) - 1u); }
inline VecF zero() { VecF r; for (int i = 0; i < 16; ++i) r.v[i] = 0.f; return r; }
inline VecF set1(float x) { VecF r; for (int i = 0; i < 16; ++i) r.v[i] = x; return r; }
inline VecF fma(VecF a, VecF b, VecF c) {
  VecF r; for (int i = 0; i < 16; ++i) r.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]); return r;
}
inline VecF add(VecF a, VecF b) { VecF r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i]; return r; }
inline VecF mul(VecF a, VecF b) { VecF r; for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i]; return r; }
inline float reduce_add(VecF a) {
  // pairwise, fixed order (deterministic)
  for (int w = 8; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) a.v[i] = a.v[i] + a.v[i + w];
  return a.v[0];
}
template <typename T>
inline VecF load(const T* p, Mask m = 0xFFFFu) {
  VecF r;
  for (int i = 0; i < 16; ++i) r.v[i] = (m >> i) & 1u ? static_cast<float>(p[i]) : 0.f;
  return r;
}
template <typename T>
inline void store(T* p, VecF x, Mask m = 0xFFFFu) {
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1u) p[i] = static_cast<T>(x.v[i]);
}
inline void store(c10::BFloat16* p, VecF x, Mask m = 0xFFFFu) {
  for (int i = 0; i < 16; ++i)
    if ((m >> i) & 1u) p[i].x = bf16::from_f32(x.v[i]);
}

// primitives of exp / sigmoid
inline VecF sub(VecF a, VecF b) { for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i]; return a; }
inline VecF div(VecF a, VecF b) { for (int i = 0; i < 16; ++i) a.v[i] /= b.v[i]; return a; }
inline VecF fnma(VecF a, VecF b, VecF c) {
  for (int i = 0; i < 16; ++i) c.v[i] = std::fma(-a.v[i], b.v[i], c.v[i]);
  return c;
}
inline VecF clamp(VecF x, float lo, float hi) {  // fmax/fmin return the non-NaN operand: NaN -> lo
  for (int i = 0; i < 16; ++i) x.v[i] = std::fmin(std::fmax(x.v[i], lo), hi);
  return x;
}
inline VecF round_even(VecF x) {  // nearbyint: the current rounding mode, round half to even by default
  for (int i = 0; i < 16; ++i) x.v[i] = std::nearbyint(x.v[i]);
  return x;
}
inline VecF scale2(VecF p, VecF n) {
  for (int i = 0; i < 16; ++i) p.v[i] = std::ldexp(p.v[i], static_cast<int>(n.v[i]));
  return p;
}

#endif

// exp / sigmoid, once for every version, on the primitives above
inline VecF exp(VecF x, float hi = expc::kHi) {  // hi: kHi, or kSigmoidHi (overflow to +inf past ~88.7)
  using namespace expc;
  x = clamp(x, kLo, hi);
  const VecF n = round_even(mul(x, set1(kLog2e)));
  VecF r = fnma(n, set1(kC1), x);
  r = fnma(n, set1(kC2), r);
  VecF p = set1(kP0);
  p = fma(p, r, set1(kP1));
  p = fma(p, r, set1(kP2));
  p = fma(p, r, set1(kP3));
  p = fma(p, r, set1(kP4));
  p = fma(p, r, set1(kP5));
  p = fma(p, mul(r, r), add(r, set1(1.0f)));
  return scale2(p, n);
}
// sigmoid's exp(-a) is clamped at 89 instead of 88: past ~88.7 it overflows to +inf (2^128 is the
// inf bit pattern in every version), so sigmoid(a) is exactly 0 for a < -88.7 (the true value is
// below 3e-39) and silu(a) = a * sigmoid(a) is -0 for huge negative a and NaN for -inf, as torch's;
// clamped at 88 it stayed 6e-39 and silu(-3e38) was -1.8, silu(-inf) -inf. Same bits as before for
// every a >= -88, and no extra instruction.
inline VecF sigmoid(VecF a) {
  const VecF one = set1(1.0f);
  return div(one, add(one, exp(sub(zero(), a), expc::kSigmoidHi)));
}

}  // namespace AMO_VEC_NS
}  // namespace vec
}  // namespace amo

namespace amo {
namespace vec {
inline namespace AMO_VEC_NS {

// Non-temporal (streaming) store of one full vector; `p` must be aligned to the vector's byte size
// (64 B for fp32, 32 B for fp16/bf16). Used for large outputs that would only evict useful cache
// lines; callers check alignment and fall back to store() otherwise. Call sfence() after the last.
#if AMO_AVX512
inline void store_nt(float* p, VecF v) { _mm512_stream_ps(p, v); }
inline void store_nt(c10::BFloat16* p, VecF v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), f32_to_bf16_bits(v));
}
inline void store_nt(c10::Half* p, VecF v) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void store_nt(double* p, VecF v) { store(p, v); }
inline void sfence() { _mm_sfence(); }
#elif AMO_AVX2
template <typename T>
inline void store_nt(T* p, VecF v) { store_as<true>(p, v); }
inline void store_nt(double* p, VecF v) { store(p, v); }
inline void sfence() { _mm_sfence(); }
#else
template <typename T>
inline void store_nt(T* p, VecF v) { store(p, v); }
inline void sfence() {}
#endif

#if AMO_AVX512
// one 64-byte line with a non-temporal store (d 64-byte aligned)
inline void stream_copy64(char* d, const char* s) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_loadu_si512(s));
}
inline void stream_zero64(char* d) { _mm512_stream_si512(reinterpret_cast<__m512i*>(d), _mm512_setzero_si512()); }
#elif AMO_AVX2
inline void stream_copy64(char* d, const char* s) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 32));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), a);
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), b);
}
inline void stream_zero64(char* d) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d), _mm256_setzero_si256());
  _mm256_stream_si256(reinterpret_cast<__m256i*>(d + 32), _mm256_setzero_si256());
}
#endif

// Copy `bytes` bytes from src to dst (no overlap). With `stream`, the 64-byte aligned body of dst is
// written with non-temporal stores (no read-for-ownership of the destination lines).
inline void copy_bytes(char* dst, const char* src, int64_t bytes, bool stream) {
#if AMO_AVX512 || AMO_AVX2
  if (stream && bytes >= 256) {
    const int64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    if (head) std::memcpy(dst, src, head);
    int64_t i = head;
    for (; i + 64 <= bytes; i += 64) stream_copy64(dst + i, src + i);
    if (i < bytes) std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// Zero `bytes` bytes at dst, streaming the aligned body when `stream`.
inline void zero_bytes(char* dst, int64_t bytes, bool stream) {
#if AMO_AVX512 || AMO_AVX2
  if (stream && bytes >= 256) {
    const int64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    if (head) std::memset(dst, 0, head);
    int64_t i = head;
    for (; i + 64 <= bytes; i += 64) stream_zero64(dst + i);
    if (i < bytes) std::memset(dst + i, 0, bytes - i);
    return;
  }
#endif
  (void)stream;
  std::memset(dst, 0, bytes);
}

// Outputs larger than this are written with streaming stores (they cannot stay in a 32 MiB L3
// shared with the inputs anyway). Measured here (T=4096, H=7680, K=8, bf16, 2 threads, shared
// machine): permute 132 ms with streaming stores vs 190 ms without; unpermute 80 vs 91 ms.
constexpr int64_t kStreamBytes = int64_t(16) << 20;

}  // namespace AMO_VEC_NS
}  // namespace vec
}  // namespace amo
