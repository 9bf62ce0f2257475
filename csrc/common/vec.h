// Vectorized fp32 load/store of 16 elements of any float dtype (fp32, fp16, bf16, fp64), with an
// optional tail mask, for kernels that compute in fp32 and store in the tensor's dtype.
//
// With AVX-512 (setup.py compiles with -march=native) a "vector" is one __m512; otherwise a plain
// 16-float struct that the compiler vectorizes as it can. Conversions round exactly like
// c10::BFloat16 / c10::Half (round to nearest even, fp32 subnormals are not flushed; bf16: every
// NaN becomes 0x7FC0, the rounding of common/bf16.h), so a value stored here equals
// `tensor.float().to(dtype)` in PyTorch.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/bf16.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AMO_AVX512 1
#else
#define AMO_AVX512 0
#endif

namespace amo {
namespace vec {

constexpr int64_t kWidth = 16;  // fp32 lanes per vector

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

#endif

}  // namespace vec
}  // namespace amo

namespace amo {
namespace vec {

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
#else
template <typename T>
inline void store_nt(T* p, VecF v) { store(p, v); }
inline void sfence() {}
#endif

// Copy `bytes` bytes from src to dst (no overlap). With `stream`, the 64-byte aligned body of dst is
// written with non-temporal stores (no read-for-ownership of the destination lines).
inline void copy_bytes(char* dst, const char* src, int64_t bytes, bool stream) {
#if AMO_AVX512
  if (stream && bytes >= 256) {
    int64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    if (head) std::memcpy(dst, src, head);
    int64_t i = head;
    for (; i + 256 <= bytes; i += 256) {
      __m512i a = _mm512_loadu_si512(src + i);
      __m512i b = _mm512_loadu_si512(src + i + 64);
      __m512i c = _mm512_loadu_si512(src + i + 128);
      __m512i d = _mm512_loadu_si512(src + i + 192);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
    }
    for (; i + 64 <= bytes; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
    if (i < bytes) std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, bytes);
}

// Zero `bytes` bytes at dst, streaming the aligned body when `stream`.
inline void zero_bytes(char* dst, int64_t bytes, bool stream) {
#if AMO_AVX512
  if (stream && bytes >= 256) {
    int64_t head = (64 - (reinterpret_cast<uintptr_t>(dst) & 63)) & 63;
    if (head) std::memset(dst, 0, head);
    int64_t i = head;
    const __m512i z = _mm512_setzero_si512();
    for (; i + 64 <= bytes; i += 64) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), z);
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

}  // namespace vec
}  // namespace amo
