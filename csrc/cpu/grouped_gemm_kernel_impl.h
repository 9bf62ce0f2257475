// grouped_gemm on the CPU, part 2 of 3: the tile kernels. One work item (grouped_gemm_kernel.h):
// the K loop cut into blocks; per block the operands are packed (grouped_gemm_pack.h) and an
// MR x 64 register-blocked micro-kernel (6 x 4 zmm accumulators) runs over every (row block, panel),
// accumulating in fp32 in the per-thread C tile, rounded once into the output dtype at the end (the
// bf16 micro-kernel rounds the last K block straight into the output); bf16 runs the AMX tile kernel
// instead where it is enabled. Each block also prefetches (into L2) the operands of the next block, or
// of the next item. Changes here: the arithmetic of a tile. Overview: grouped_gemm.cpp.
//
// This header is compiled once per instruction set: by grouped_gemm_kernel.cpp for the build's own
// target (x86-64-v3 in a portable build, the build CPU with -march=native) and, in a portable build,
// by grouped_gemm_kernel_{avx512,avx512_bf16,amx}.cpp under `#pragma GCC target`. Each copy lives in
// its own namespace (AMO_GG_NS, grouped_gemm_pack.h) and exports one TileKernels table
// (AMO_GG_DEFINE_TABLE); cpu/cpu_capability.cpp picks the table at run time.
#pragma once

#include "cpu/grouped_gemm_kernel.h"
#include "cpu/grouped_gemm_pack.h"

#include "common/bf16.h"
#include "common/vec.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace amo {
namespace grouped_gemm_cpu {
inline namespace AMO_GG_NS {

// Tuning knobs (for tuning only): k per bf16 block (AMO_GG_KC), software prefetch (AMO_GG_PF: 0 = off,
// 1 = into L2 (prefetcht1), 2 = into L1 (prefetcht0); unset: 2 for the AVX-512 tile kernel, 1 for
// AMX) and the share of a block's micro-kernel calls that issue the prefetches (1 / AMO_GG_PF_SPREAD).
// Into L1 measured 1.06x faster than into L2 on the fine-grained forward (E=256 x 64 rows, K=512,
// N=256: 11.6-12.8 ms vs 12.1-13.6 ms, 4 alternated process pairs, AMD EPYC with AVX512_BF16,
// 2 threads, 2026-12-02); AMX was not re-measured and keeps its L2 default.
inline int64_t kc_bf16() { static const int64_t v = env_or("AMO_GG_KC", KC_BF16, 32, KC_BF16, 32); return v; }
inline int64_t pf_mode(int64_t dflt) {
  static const int64_t v = env_or("AMO_GG_PF", -1, 0, 2, 1);
  return v < 0 ? dflt : v;
}
inline int64_t pf_spread() { static const int64_t v = env_or("AMO_GG_PF_SPREAD", 1, 1, 8, 1); return v; }

// Software prefetch of the operands of the *next* K block (of this item, or of the item this
// thread runs next), spread over the k steps of the current block's micro-kernel calls so that the
// DRAM reads of the next weight tile overlap compute (a fine-grained expert's weight is used by only
// ~64 rows, so its latency would otherwise show).
struct Prefetcher {
  struct Range { const char* p; int64_t rows, row_bytes, stride; };
  Range r[2];
  int nr = 0, cur = 0;
  const int mode;  // 0 off, 1 into L2, 2 into L1 (pf_mode)
  explicit Prefetcher(int m) : mode(m) {}
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
  int64_t lines() const { return mode == 0 ? 0 : left; }
  void step(int64_t n) {
#if AMO_GG_AVX512
    if (mode == 0) return;
    while (n-- > 0 && cur < nr) {
      const Range& g = r[cur];
      if (mode == 2) _mm_prefetch(g.p + row * g.stride + off, _MM_HINT_T0);
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

// ------------------------------------------------------------------------------------------
// Micro-kernels: C[r][0..64) (+)= sum_k A(r,k) B(k, 0..64) for r < MRr.
#if AMO_GG_BF16DOT
// With `out` set (the last K block) the results are rounded to bf16 and stored straight into the
// output (columns < ncols); otherwise the fp32 partial sums go to C.
template <int MRr>
// `npf` lines of `pf` are prefetched, spread evenly over the k loop: issued in one burst, they
// filled the miss buffers and stalled the loop (9.5 % of the fine-grained forward's samples sat on
// the instruction after a prefetcht1).
inline void ukr_bf16(const uint32_t* A, int64_t rs, int64_t ks, const uint32_t* B, int64_t kp_n,
                     float* C, int64_t ldc, bool first, uint16_t* out, int64_t ldo, int64_t ncols,
                     Prefetcher& pf, int64_t npf) {
  __m512 c[MRr][4];
  for (int r = 0; r < MRr; ++r)
    for (int j = 0; j < 4; ++j)
      c[r][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(C + r * ldc + 16 * j);
  const uint32_t* ap[MRr];
  for (int r = 0; r < MRr; ++r) ap[r] = A + r * rs;
  const int64_t gap = npf > 0 ? std::max<int64_t>(1, kp_n / npf) : 0;
  int64_t cd = gap;
  for (int64_t p = 0; p < kp_n; ++p) {
    if (gap && --cd == 0) {
      cd = gap;
      if (npf > 0) { pf.step(1); --npf; }
    }
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
  if (npf > 0) pf.step(npf);
  // Every index into c[][] below is a compile-time constant (fully unrolled loops, no early exit):
  // otherwise GCC keeps c[][] in memory and spills all 24 accumulators on every k step (the kernel
  // then ran at 34-39 % of a dense bf16 torch.mm, which runs at about the vdpbf16ps peak here,
  // instead of 84-103 %; 2026-12-02, docs/benchmarks.md).
  if (out != nullptr) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t cnt = ncols - 16 * j;  // masked stores with an empty mask touch no memory
      const __mmask16 mk = cnt >= 16 ? 0xFFFF : cnt <= 0 ? 0 : static_cast<__mmask16>((1u << cnt) - 1u);
#pragma GCC unroll 6
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
                     float* C, int64_t ldc, bool first, uint16_t* out, int64_t ldo, int64_t ncols,
                     Prefetcher& pf, int64_t npf) {
  pf.step(npf);
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
#elif AMO_GG_AVX2
  // the 64-column panel in four 16-column passes: MRr x 2 ymm accumulators + 2 B + 1 broadcast
  // fit the 16 ymm registers (every index below is a compile-time constant, so c stays in them)
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    __m256 c[MRr][2];
#pragma GCC unroll 6
    for (int r = 0; r < MRr; ++r) {
      c[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + r * ldc + 16 * q);
      c[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(C + r * ldc + 16 * q + 8);
    }
    const float* bq = B + 16 * q;
    for (int64_t k = 0; k < kc; ++k) {
      const __m256 b0 = _mm256_load_ps(bq + k * NR), b1 = _mm256_load_ps(bq + k * NR + 8);
#pragma GCC unroll 6
      for (int r = 0; r < MRr; ++r) {
        const __m256 a = _mm256_broadcast_ss(A + r * rs + k * ks);
        c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]);
        c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MRr; ++r) {
      _mm256_storeu_ps(C + r * ldc + 16 * q, c[r][0]);
      _mm256_storeu_ps(C + r * ldc + 16 * q + 8, c[r][1]);
    }
  }
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
// AMX. Tiles: C 0..3 (fp32, 16 x 16 each: rows [0,16) x cols [0,16) / [16,32), rows [16,32) x
// the same), A 4..5 (16 rows x 16 bf16 pairs), B 6..7 (16 pairs x 16 columns, the VNNI layout the
// packed B panels already have: a panel row is 64 words, so a B tile is a 64-byte slice of 16
// consecutive panel rows, stride 256 bytes). One micro-step: 4 tile loads, 4 tdpbf16ps
// (16 x 16 x 32 MACs each), C stays in the tiles for the whole K block.
#if AMO_GG_AMX
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
    pack_b_bf16(b, B.s0, B.s1, k0, kc, n, ws.b, kp_max, kp16);
    const uint32_t* aw;
    int64_t a_ld;
    if (a_direct) {
      stage_a_amx_rows(a + k0, A.s0, m, kp16, ws.a);  // x rows
      aw = ws.a;
      a_ld = kp16;
    } else {
      stage_a_amx_cols(a + k0 * A.s1, A.s1, kc, m, kp16, ws.t, ws.a, kp_max);  // A(r, k) at a[r + k * s1] (dW)
      aw = ws.a;
      a_ld = kp_max;
    }
    const bool first = k0 == 0;
    // prefetch (L2) the next K block's operands, or the next item's first, spread over the row
    // blocks: a group's weights come from DRAM and AMX computes faster than they stream in
    Prefetcher pf(static_cast<int>(pf_mode(1)));  // AMX
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
    pack_b_bf16(b, B.s0, B.s1, k0, kc, n, ws.b, kp_max);
    // A row block starting at row i: aw + (i / MR) * abs_, element (r, p) at [r * ars + p * aks]
    const uint32_t* aw;
    int64_t ars, aks, abs_;
    if (a_direct) {
      aw = reinterpret_cast<const uint32_t*>(a + k0);
      ars = A.s0 / 2;
      aks = 1;
      abs_ = MR * ars;
    } else if (A.s0 == 1) {
      // columns of A contiguous (the dW case, A = a^T): MR-row panels [block][kp][MR]
      pack_a_bf16_panels(a + k0 * A.s1, A.s1, kc, m, ws.t, ws.a, kp_max);
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
    Prefetcher pf(static_cast<int>(pf_mode(2)));
    const bool last = k0 + KCB >= K;
    if (!last) pf.add_block(t, k0 + KCB, std::min(KCB, K - k0 - KCB), 2);
    else if (next != nullptr && next->K > 0) pf.add_block(*next, 0, std::min(KCB, next->K), 2);
    // issue the prefetches over the first 1/pf_spread() of this block's micro-kernel calls
    const int64_t per_call = ceil_div(pf.lines() * pf_spread(), npan * ceil_div(m, MR));
    for (int64_t j = 0; j < npan; ++j) {
      const uint32_t* bp = ws.b + j * kp_max * NR;
      for (int64_t i = 0; i < m; i += MR) {
        const int64_t mr = std::min(MR, m - i);
        const uint32_t* aip = aw + (i / MR) * abs_;
        float* c = ws.c + i * ldc + j * NR;
        uint16_t* o = last ? reinterpret_cast<uint16_t*>(out) + i * ldo + j * NR : nullptr;
        const int64_t nc = n - j * NR;
        dispatch_mr(
            mr, [&] { ukr_bf16<6>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); },
            [&] { ukr_bf16<5>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); },
            [&] { ukr_bf16<4>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); },
            [&] { ukr_bf16<3>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); },
            [&] { ukr_bf16<2>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); },
            [&] { ukr_bf16<1>(aip, ars, aks, bp, kp, c, ldc, first, o, ldo, nc, pf, per_call); });
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
    pack_b_f32(b, B.s0, B.s1, k0, kc, n, bpk);
    const float* ap;
    int64_t ars, aks;
    if (is_f32) {
      ap = reinterpret_cast<const float*>(a) + k0 * A.s1;
      ars = A.s0;
      aks = A.s1;
    } else {
      pack_a_f32(a, A.s0, A.s1, k0, kc, m, apk);
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
void run_tile_impl(const TileArgs& t, const TileArgs* next, Workspace& ws) {
#if AMO_GG_BF16DOT
  if constexpr (std::is_same<T, c10::BFloat16>::value) tile_bf16(t, next, ws);
  else tile_f32<T>(t, ws);
#else
  tile_f32<T>(t, ws);  // bf16 too: converted while packing (no vdpbf16ps on these CPUs)
  (void)next;
#endif
}

}  // namespace AMO_GG_NS
}  // namespace grouped_gemm_cpu
}  // namespace amo

// Defines the TileKernels table `fn` of this unit's copy (one per unit, after including this header).
#define AMO_GG_DEFINE_TABLE(fn, level_name)                                                              \
  namespace amo {                                                                                        \
  namespace grouped_gemm_cpu {                                                                           \
  const TileKernels& fn() {                                                                              \
    static const TileKernels t{&AMO_GG_NS::run_tile_impl<float>, &AMO_GG_NS::run_tile_impl<c10::Half>, \
                               &AMO_GG_NS::run_tile_impl<c10::BFloat16>, AMO_GG_AMX != 0, level_name};  \
    return t;                                                                                            \
  }                                                                                                      \
  }                                                                                                      \
  }
