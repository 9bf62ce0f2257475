// moe_unpermute on the CPU: the per-token loops of the forward and the backward (the one source of
// them; moe_unpermute.cpp has the op, its tensors and the parallel split). Spec and numerics:
// moe_unpermute.cpp's header.
//
// This header is compiled once per instruction set: by moe_unpermute_kernel.cpp for the build's own
// target (x86-64-v3 in a portable build, the build CPU with -march=native) and, in a portable build,
// by moe_unpermute_kernel_avx512.cpp under `#pragma GCC target`. Each copy lives in the namespace of
// its vector layer (AMO_VEC_NS, common/vec.h) and exports one Kernels table
// (AMO_UNPERMUTE_DEFINE_TABLE); moe_unpermute_kernel.cpp picks the table at run time. The vector
// layer gives the same bits on every instruction set (common/vec.h), so every copy gives the same
// results.
#pragma once

#include "cpu/moe_unpermute_kernel.h"

#include "common/vec.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace amo {
namespace unpermute_cpu {
inline namespace AMO_VEC_NS {

namespace V = amo::vec;

template <typename T, bool NT>
inline void put(T* p, V::VecF v) {
  if constexpr (NT) {
    V::store_nt(p, v);
  } else {
    V::store(p, v);
  }
}

// o[:H] = sum_k w[k] * rows[k][:H], fp32 accumulation in slot order. The `nn` rows `next` of the
// token this thread combines next are prefetched block by block, one token ahead: the K rows of a
// token lie at random places, and the hardware prefetchers restart on each of them (Pangu shape,
// T=4096, H=7680, K=8, bf16, 2 threads: 17.6-22.9 ms without, 16.3-17.5 ms with, 2 x 3 alternated
// rounds, 2026-12-02).
template <typename T, bool NT>
void combine_row(T* o, const T* const* rows, const float* w, int64_t nk, int64_t H,
                 const T* const* next = nullptr, int64_t nn = 0) {
  constexpr int64_t W = V::kWidth;
  constexpr int64_t B = 8 * W;
  constexpr int64_t kLine = 64;
  int64_t c = 0;
  for (; c + B <= H; c += B) {
    for (int64_t k = 0; k < nn; ++k) {
      const char* q = reinterpret_cast<const char*>(next[k] + c);
      for (int64_t b = 0; b < B * static_cast<int64_t>(sizeof(T)); b += kLine) __builtin_prefetch(q + b, 0, 2);
    }
    V::VecF a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
    V::VecF a4 = V::zero(), a5 = V::zero(), a6 = V::zero(), a7 = V::zero();
    for (int64_t k = 0; k < nk; ++k) {
      const V::VecF wk = V::set1(w[k]);
      const T* r = rows[k] + c;
      a0 = V::fma(V::load(r + 0 * W), wk, a0);
      a1 = V::fma(V::load(r + 1 * W), wk, a1);
      a2 = V::fma(V::load(r + 2 * W), wk, a2);
      a3 = V::fma(V::load(r + 3 * W), wk, a3);
      a4 = V::fma(V::load(r + 4 * W), wk, a4);
      a5 = V::fma(V::load(r + 5 * W), wk, a5);
      a6 = V::fma(V::load(r + 6 * W), wk, a6);
      a7 = V::fma(V::load(r + 7 * W), wk, a7);
    }
    put<T, NT>(o + c + 0 * W, a0);
    put<T, NT>(o + c + 1 * W, a1);
    put<T, NT>(o + c + 2 * W, a2);
    put<T, NT>(o + c + 3 * W, a3);
    put<T, NT>(o + c + 4 * W, a4);
    put<T, NT>(o + c + 5 * W, a5);
    put<T, NT>(o + c + 6 * W, a6);
    put<T, NT>(o + c + 7 * W, a7);
  }
  for (; c + W <= H; c += W) {
    V::VecF a = V::zero();
    for (int64_t k = 0; k < nk; ++k) a = V::fma(V::load(rows[k] + c), V::set1(w[k]), a);
    put<T, NT>(o + c, a);
  }
  if (c < H) {
    const V::Mask m = V::tail_mask(H - c);
    V::VecF a = V::zero();
    for (int64_t k = 0; k < nk; ++k) a = V::fma(V::load(rows[k] + c, m), V::set1(w[k]), a);
    V::store(o + c, a, m);
  }
}

// The forward over the tokens [tb, te) of one thread: gathers each token's kept rows (and those of
// the next token, prefetched while this one is combined) and combines them.
template <typename T>
void forward_range(const ForwardArgs& a, int64_t tb, int64_t te) {
  const T* src = static_cast<const T*>(a.src);
  T* dst = static_cast<T*>(a.dst);
  const int64_t N = a.N, H = a.H, S = a.S;
  std::vector<const T*> rp(static_cast<size_t>(S)), rn(static_cast<size_t>(S));
  std::vector<float> w(static_cast<size_t>(S)), wn(static_cast<size_t>(S));
  auto gather = [&](int64_t t, std::vector<const T*>& r_out, std::vector<float>& w_out) {
    int64_t nk = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = a.map[t * S + s];
      if (r < 0 || r >= N) continue;  // not kept (or out of range): never read
      r_out[nk] = src + r * H;
      w_out[nk] = a.w ? a.w[t * S + s] : 1.0f;
      ++nk;
    }
    return nk;
  };
  int64_t nk = tb < te ? gather(tb, rp, w) : 0;
  for (int64_t t = tb; t < te; ++t) {
    const int64_t nn = t + 1 < te ? gather(t + 1, rn, wn) : 0;
    if (a.stream)
      combine_row<T, true>(dst + t * H, rp.data(), w.data(), nk, H, rn.data(), nn);
    else
      combine_row<T, false>(dst + t * H, rp.data(), w.data(), nk, H, rn.data(), nn);
    std::swap(rp, rn);
    std::swap(w, wn);
    nk = nn;
  }
  if (a.stream) V::sfence();
}

inline void forward(const ForwardArgs& a, int64_t tb, int64_t te) {
  switch (a.dtype) {
    case at::kFloat: return forward_range<float>(a, tb, te);
    case at::kHalf: return forward_range<c10::Half>(a, tb, te);
    case at::kBFloat16: return forward_range<c10::BFloat16>(a, tb, te);
    default: return;  // not reached: moe_unpermute.cpp passes only these dtypes (kernel_dtype_ok)
  }
}

// grad row for one slot: d[:H] = w * g[:H]; returns <p[:H], g[:H]> when p != nullptr.
template <typename G, typename P, bool NT>
float backward_slot(P* d, const G* g, const P* p, float w, int64_t H) {
  constexpr int64_t W = V::kWidth;
  const V::VecF wv = V::set1(w);
  V::VecF a0 = V::zero(), a1 = V::zero(), a2 = V::zero(), a3 = V::zero();
  int64_t c = 0;
  for (; c + 4 * W <= H; c += 4 * W) {
    const V::VecF g0 = V::load(g + c), g1 = V::load(g + c + W), g2 = V::load(g + c + 2 * W),
                  g3 = V::load(g + c + 3 * W);
    put<P, NT>(d + c, V::mul(g0, wv));
    put<P, NT>(d + c + W, V::mul(g1, wv));
    put<P, NT>(d + c + 2 * W, V::mul(g2, wv));
    put<P, NT>(d + c + 3 * W, V::mul(g3, wv));
    if (p) {
      a0 = V::fma(V::load(p + c), g0, a0);
      a1 = V::fma(V::load(p + c + W), g1, a1);
      a2 = V::fma(V::load(p + c + 2 * W), g2, a2);
      a3 = V::fma(V::load(p + c + 3 * W), g3, a3);
    }
  }
  for (; c + W <= H; c += W) {
    const V::VecF gv = V::load(g + c);
    put<P, NT>(d + c, V::mul(gv, wv));
    if (p) a0 = V::fma(V::load(p + c), gv, a0);
  }
  if (c < H) {
    const V::Mask m = V::tail_mask(H - c);
    const V::VecF gv = V::load(g + c, m);
    V::store(d + c, V::mul(gv, wv), m);
    if (p) a0 = V::fma(V::load(p + c, m), gv, a0);
  }
  if (!p) return 0.f;
  return V::reduce_add(V::add(V::add(a0, a1), V::add(a2, a3)));
}

// The backward over the tokens [tb, te) of one thread: every kept slot's grad row and dot product.
template <typename G, typename P>
void backward_range(const BackwardArgs& a, int64_t tb, int64_t te) {
  const G* g = static_cast<const G*>(a.g);
  const P* x = static_cast<const P*>(a.x);
  P* d = static_cast<P*>(a.d);
  const int64_t N = a.N, H = a.H, S = a.S;
  for (int64_t t = tb; t < te; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t i = t * S + s;
      const int64_t r = a.map[i];
      if (r < 0 || r >= N) continue;
      a.filled[r] = 1;
      const float w = a.w ? a.w[i] : 1.0f;
      const float dot = a.stream ? backward_slot<G, P, true>(d + r * H, g + t * H, x ? x + r * H : nullptr, w, H)
                                 : backward_slot<G, P, false>(d + r * H, g + t * H, x ? x + r * H : nullptr, w, H);
      if (a.gp) a.gp[i] = dot;
    }
  }
  if (a.stream) V::sfence();
}

template <typename G>
inline void backward_g(const BackwardArgs& a, int64_t tb, int64_t te) {
  switch (a.p_dtype) {
    case at::kFloat: return backward_range<G, float>(a, tb, te);
    case at::kHalf: return backward_range<G, c10::Half>(a, tb, te);
    case at::kBFloat16: return backward_range<G, c10::BFloat16>(a, tb, te);
    case at::kDouble: return backward_range<G, double>(a, tb, te);
    default: return;  // not reached (kernel_dtype_ok)
  }
}

inline void backward(const BackwardArgs& a, int64_t tb, int64_t te) {
  switch (a.g_dtype) {
    case at::kFloat: return backward_g<float>(a, tb, te);
    case at::kHalf: return backward_g<c10::Half>(a, tb, te);
    case at::kBFloat16: return backward_g<c10::BFloat16>(a, tb, te);
    default: return;  // not reached (kernel_dtype_ok)
  }
}

}  // namespace AMO_VEC_NS
}  // namespace unpermute_cpu
}  // namespace amo

// The table of one copy (at file scope of a unit that included this header, after any target pragma
// is popped): `const Kernels& fn()` returning this unit's forward and backward.
#define AMO_UNPERMUTE_DEFINE_TABLE(fn, level_name)                                     \
  namespace amo {                                                                      \
  namespace unpermute_cpu {                                                            \
  const Kernels& fn() {                                                                \
    static const Kernels k{&AMO_VEC_NS::forward, &AMO_VEC_NS::backward, level_name};  \
    return k;                                                                          \
  }                                                                                    \
  }                                                                                    \
  }
