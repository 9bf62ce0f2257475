// Native CPU moe_unpermute and its backward. Spec: ascend_moe_ops/reference/moe_unpermute.py.
//
// Forward: out[t] = sum_s w[t,s] * permuted[row_id_map[t,s]] over kept slots (0 <= row < N), in
// fp32 registers (AVX-512 FMA; fp16/bf16 converted on load and rounded to nearest even on store),
// slots in ascending order. Each output element is produced by one thread in a fixed order, so the
// result is bitwise identical run to run and for any thread count. Rows of slots that are not kept
// are never read. Parallel over tokens; a token's kept rows are summed in blocks of 128 columns
// held in 8 vector registers, so the [T, H] output is written once (streaming stores when large)
// and no [T*K, H] intermediate exists.
//
// Backward: grad_permuted[row] = w[t,s] * grad_out[t] (fp32 product stored in permuted's dtype),
// rows no slot points to are exactly zero; grad_probs[t,s] = <permuted[row], grad_out[t]> in fp32.
// fp64 inputs (permuted in the forward, grad_out in the backward) are computed in fp64 instead, as
// the reference does for its oracle runs.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <utility>
#include <tuple>
#include <vector>

#include "common/alloc.h"
#include "common/moe_unpermute_checks.h"
#include "common/op_registry.h"
#include "common/registry.h"
#include "common/vec.h"

namespace {

using at::Tensor;
namespace V = amo::vec;

// probs as contiguous fp32 [T, S] (the reference weights by probs.float()), or undefined. The kernels
// below are reached only through the dispatcher kernels at the end of this file, after the op's check
// (common/moe_unpermute_checks.h): shapes, dtypes, devices, row range and unique rows.
Tensor fp32_probs(const c10::optional<Tensor>& probs) {
  if (!probs.has_value() || !probs->defined()) return Tensor();
  return probs->to(at::kFloat).contiguous();
}

// Problems whose permuted rows total fewer bytes than this run on the calling thread: a few hundred
// microseconds of work, while waking a second thread took milliseconds under this machine's
// shared load (the same threshold as moe_permute's row copy).
inline bool small_problem(int64_t rows, int64_t H, size_t elem) {
  return rows * H * static_cast<int64_t>(elem) < (int64_t(8) << 20);
}

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

// Streaming stores need every row start aligned to one vector of T.
template <typename T>
bool rows_stream_aligned(const T* base, int64_t H) {
  const int64_t vbytes = V::kWidth * static_cast<int64_t>(sizeof(T));
  return (reinterpret_cast<uintptr_t>(base) % vbytes == 0) && ((H * static_cast<int64_t>(sizeof(T))) % vbytes == 0);
}

Tensor moe_unpermute_cpu(const Tensor& permuted_in, const Tensor& row_id_map_in, const c10::optional<Tensor>& probs_opt) {
  const Tensor probs = fp32_probs(probs_opt);
  const Tensor permuted = permuted_in.contiguous();
  const Tensor rows = row_id_map_in.to(at::kLong).contiguous();
  const int64_t N = permuted.size(0), H = permuted.size(1);
  const int64_t T = rows.size(0), S = rows.size(1);
  Tensor out = amo::empty_large({T, H}, permuted.options());
  if (T == 0 || H == 0) return out;
  const int64_t* map = rows.data_ptr<int64_t>();
  const float* pw = probs.defined() ? probs.data_ptr<float>() : nullptr;

  if (permuted.scalar_type() == at::kDouble) {
    // fp64 inputs accumulate in fp64, like the reference (the oracle runs); plain loops, slot order.
    const Tensor p64 = probs.defined() ? probs_opt->to(at::kDouble).contiguous() : Tensor();
    const double* w64 = p64.defined() ? p64.data_ptr<double>() : nullptr;
    const double* src = permuted.data_ptr<double>();
    double* dst = out.data_ptr<double>();
    at::parallel_for(0, T, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1))),
                     [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        double* o = dst + t * H;
        for (int64_t c = 0; c < H; ++c) o[c] = 0.0;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t r = map[t * S + s];
          if (r < 0 || r >= N) continue;
          const double w = w64 ? w64[t * S + s] : 1.0;
          const double* x = src + r * H;
          for (int64_t c = 0; c < H; ++c) o[c] += x[c] * w;
        }
      }
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, permuted.scalar_type(), "moe_unpermute_cpu", [&] {
    using T_ = scalar_t;
    const T_* src = permuted.data_ptr<T_>();
    T_* dst = out.data_ptr<T_>();
    const bool stream = T * H * static_cast<int64_t>(sizeof(T_)) >= V::kStreamBytes && rows_stream_aligned(dst, H);
    const int64_t grain = small_problem(N, H, sizeof(T_)) ? std::max<int64_t>(T, 1)
                                                          : std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1)));
    at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) {
      // the kept rows of token t (and of t + 1, prefetched while t is combined)
      std::vector<const T_*> rp(static_cast<size_t>(S)), rn(static_cast<size_t>(S));
      std::vector<float> w(static_cast<size_t>(S)), wn(static_cast<size_t>(S));
      auto gather = [&](int64_t t, std::vector<const T_*>& r_out, std::vector<float>& w_out) {
        int64_t nk = 0;
        for (int64_t s = 0; s < S; ++s) {
          const int64_t r = map[t * S + s];
          if (r < 0 || r >= N) continue;  // not kept (or out of range): never read
          r_out[nk] = src + r * H;
          w_out[nk] = pw ? pw[t * S + s] : 1.0f;
          ++nk;
        }
        return nk;
      };
      int64_t nk = tb < te ? gather(tb, rp, w) : 0;
      for (int64_t t = tb; t < te; ++t) {
        const int64_t nn = t + 1 < te ? gather(t + 1, rn, wn) : 0;
        if (stream)
          combine_row<T_, true>(dst + t * H, rp.data(), w.data(), nk, H, rn.data(), nn);
        else
          combine_row<T_, false>(dst + t * H, rp.data(), w.data(), nk, H, rn.data(), nn);
        std::swap(rp, rn);
        std::swap(w, wn);
        nk = nn;
      }
      if (stream) V::sfence();
    });
  });
  return out;
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

std::tuple<Tensor, Tensor> moe_unpermute_backward_cpu(const Tensor& grad_out_in, const Tensor& permuted_in,
                                                      const Tensor& row_id_map_in,
                                                      const c10::optional<Tensor>& probs_opt) {
  const Tensor probs = fp32_probs(probs_opt);
  const int64_t H = grad_out_in.size(1);
  const Tensor grad_out = grad_out_in.contiguous();
  const Tensor permuted = probs.defined() ? permuted_in.contiguous() : permuted_in;
  const Tensor rows = row_id_map_in.to(at::kLong).contiguous();
  const int64_t N = permuted.size(0);
  const int64_t T = rows.size(0), S = rows.size(1);

  Tensor grad_permuted = amo::empty_large({N, H}, grad_out.options().dtype(permuted.scalar_type()));
  Tensor grad_probs = probs.defined() ? at::zeros({T, S}, probs.options())
                                      : at::empty({0}, grad_out.options().dtype(at::kFloat));
  const int64_t* map = rows.data_ptr<int64_t>();
  const float* pw = probs.defined() ? probs.data_ptr<float>() : nullptr;
  float* gp = probs.defined() ? grad_probs.data_ptr<float>() : nullptr;
  std::vector<uint8_t> filled(static_cast<size_t>(N), 0);
  Tensor grad_probs64;  // set by the fp64 path

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad_out.scalar_type(), "moe_unpermute_backward_cpu", [&] {
    using G = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, permuted.scalar_type(), "moe_unpermute_backward_cpu", [&] {
      using P = scalar_t;
      const G* g = grad_out.data_ptr<G>();
      const P* x = probs.defined() && H > 0 ? permuted.data_ptr<P>() : nullptr;
      P* d = grad_permuted.data_ptr<P>();
      const bool stream = N * H * static_cast<int64_t>(sizeof(P)) >= V::kStreamBytes && rows_stream_aligned(d, H);
      if constexpr (std::is_same_v<G, double>) {
        // fp64 grad_out: products and dot products in fp64, like the reference; plain loops.
        const Tensor p64 = probs.defined() ? probs_opt->to(at::kDouble).contiguous() : Tensor();
        const double* w64 = p64.defined() ? p64.data_ptr<double>() : nullptr;
        std::vector<double> dots(static_cast<size_t>(gp ? T * S : 0), 0.0);
        at::parallel_for(0, T, std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1))),
                         [&](int64_t tb, int64_t te) {
          for (int64_t t = tb; t < te; ++t) {
            const G* gt = g + t * H;  // G is double here
            for (int64_t s = 0; s < S; ++s) {
              const int64_t i = t * S + s;
              const int64_t r = map[i];
              if (r < 0 || r >= N) continue;
              filled[r] = 1;
              const double w = w64 ? w64[i] : 1.0;
              P* dr = d + r * H;
              for (int64_t c = 0; c < H; ++c) dr[c] = static_cast<P>(w * static_cast<double>(gt[c]));
              if (x) {
                const P* xr = x + r * H;
                double acc = 0.0;
                for (int64_t c = 0; c < H; ++c) acc += static_cast<double>(xr[c]) * static_cast<double>(gt[c]);
                dots[i] = acc;
              }
            }
          }
        });
        if (gp) grad_probs64 = at::from_blob(dots.data(), {T, S}, at::TensorOptions().dtype(at::kDouble)).clone();
        amo::zero_rows(reinterpret_cast<char*>(d), filled, H * static_cast<int64_t>(sizeof(P)), false);
        return;
      }
      const int64_t grain = small_problem(N, H, sizeof(P)) ? std::max<int64_t>(T, 1)
                                                          : std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1)));
      at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t) {
          for (int64_t s = 0; s < S; ++s) {
            const int64_t i = t * S + s;
            const int64_t r = map[i];
            if (r < 0 || r >= N) continue;
            filled[r] = 1;
            const float w = pw ? pw[i] : 1.0f;
            const float dot = stream ? backward_slot<G, P, true>(d + r * H, g + t * H, x ? x + r * H : nullptr, w, H)
                                     : backward_slot<G, P, false>(d + r * H, g + t * H, x ? x + r * H : nullptr, w, H);
            if (gp) gp[i] = dot;
          }
        }
        if (stream) V::sfence();
      });
      // rows no slot points to: exactly zero
      amo::zero_rows(reinterpret_cast<char*>(d), filled, H * static_cast<int64_t>(sizeof(P)), stream);
    });
  });
  if (grad_probs64.defined()) grad_probs = grad_probs64;
  if (probs.defined() && grad_probs.scalar_type() != probs_opt->scalar_type()) grad_probs = grad_probs.to(probs_opt->scalar_type());
  return std::make_tuple(grad_permuted, grad_probs);
}

}  // namespace

// ---- dispatcher kernels: the op-boundary checks (common/moe_unpermute_checks.h), then the kernels ----
namespace {
at::Tensor moe_unpermute_op(const at::Tensor& permuted, const at::Tensor& row_id_map,
                            const c10::optional<at::Tensor>& probs) {
  amo::checks::moe_unpermute(permuted, row_id_map, probs);
  return moe_unpermute_cpu(permuted, row_id_map, probs);
}

std::tuple<at::Tensor, at::Tensor> moe_unpermute_backward_op(const at::Tensor& grad_out, const at::Tensor& permuted,
                                                             const at::Tensor& row_id_map,
                                                             const c10::optional<at::Tensor>& probs) {
  amo::checks::moe_unpermute_backward(grad_out, permuted, row_id_map, probs);
  return moe_unpermute_backward_cpu(grad_out, permuted, row_id_map, probs);
}
}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(moe_unpermute, moe_unpermute_op)
AMO_CPU_KERNEL(moe_unpermute_backward, moe_unpermute_backward_op)
AMO_OP_CONTRACT(moe_unpermute)
AMO_OP_CONTRACT(moe_unpermute_backward)
