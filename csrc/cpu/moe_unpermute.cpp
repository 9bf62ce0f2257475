// Native CPU moe_unpermute and its backward. Spec: ascend_moe_ops/reference/moe_unpermute.py.
//
// Forward: out[t] = sum_s w[t,s] * permuted[row_id_map[t,s]] over kept slots (0 <= row < N), in
// fp32 registers (fp16/bf16 converted on load and rounded to nearest even on store),
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
//
// This file prepares the tensors and splits the tokens over the threads; the per-token loops of both
// directions are moe_unpermute_kernel_impl.h, compiled once per instruction set (in a portable build
// an AVX2 and an AVX-512 copy, chosen at run time with the grouped GEMM's level, cpu/cpu_capability.h;
// with -march=native one copy). The vector layer (common/vec.h) gives the same bits on every
// instruction set, so every copy gives the same results.
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
#include "cpu/moe_unpermute_kernel.h"

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

// Streaming stores need every row start aligned to one vector of the element type (es bytes each).
bool rows_stream_aligned(const void* base, int64_t H, int64_t es) {
  const int64_t vbytes = V::kWidth * es;
  return (reinterpret_cast<uintptr_t>(base) % vbytes == 0) && ((H * es) % vbytes == 0);
}

// The dtypes the per-token loops (moe_unpermute_kernel_impl.h) take: fp32, fp16, bf16, and for the
// backward's permuted / grad_permuted also fp64 (fp64 grad_out and the fp64 forward run plain loops here).
bool kernel_dtype_ok(at::ScalarType dt, bool fp64_ok) {
  return dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 || (fp64_ok && dt == at::kDouble);
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
  // fp32 / fp16 / bf16: the per-token loops of the chosen instruction set (moe_unpermute_kernel.h)
  const at::ScalarType dt = permuted.scalar_type();
  TORCH_INTERNAL_ASSERT(kernel_dtype_ok(dt, false), "moe_unpermute (CPU): unexpected dtype ", dt);
  const int64_t es = static_cast<int64_t>(permuted.element_size());
  amo::unpermute_cpu::ForwardArgs a;
  a.dtype = dt;
  a.src = permuted.data_ptr();
  a.dst = out.data_ptr();
  a.map = map;
  a.w = pw;
  a.N = N;
  a.H = H;
  a.S = S;
  a.stream = T * H * es >= V::kStreamBytes && rows_stream_aligned(out.data_ptr(), H, es);
  const int64_t grain = small_problem(N, H, es) ? std::max<int64_t>(T, 1)
                                               : std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1)));
  static const amo::unpermute_cpu::Kernels& k = amo::unpermute_cpu::kernels();
  at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) { k.forward(a, tb, te); });
  return out;
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
      const bool stream = N * H * static_cast<int64_t>(sizeof(P)) >= V::kStreamBytes && rows_stream_aligned(d, H, static_cast<int64_t>(sizeof(P)));
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
      TORCH_INTERNAL_ASSERT(kernel_dtype_ok(grad_out.scalar_type(), false) && kernel_dtype_ok(permuted.scalar_type(), true),
                            "moe_unpermute_backward (CPU): unexpected dtypes");
      amo::unpermute_cpu::BackwardArgs a;
      a.g_dtype = grad_out.scalar_type();
      a.p_dtype = permuted.scalar_type();
      a.g = g;
      a.x = x;
      a.d = d;
      a.map = map;
      a.w = pw;
      a.gp = gp;
      a.filled = filled.data();
      a.N = N;
      a.H = H;
      a.S = S;
      a.stream = stream;
      const int64_t grain = small_problem(N, H, sizeof(P)) ? std::max<int64_t>(T, 1)
                                                          : std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, H * std::max<int64_t>(S, 1)));
      static const amo::unpermute_cpu::Kernels& k = amo::unpermute_cpu::kernels();
      at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) { k.backward(a, tb, te); });
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
