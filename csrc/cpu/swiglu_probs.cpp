// Native CPU swiglu_probs and its backward: the SwiGLU activation with the router probability of
// each row applied in the same pass (what Megatron-Core's GroupedMLP computes between its two
// grouped GEMMs). Spec: ascend_moe_ops/reference/swiglu_probs.py.
//
// Forward:  out[n, f] = silu(x[n, f]) * x[n, F + f] * probs[n]   (x [N, 2F], out [N, F])
// Backward: with s = sigmoid(a), a = x[n, f], b = x[n, F + f], g = grad_out[n, f], p = probs[n]:
//   dx[n, f]     = g * p * b * s * (1 + a * (1 - s))
//   dx[n, F + f] = g * p * a * s
//   dprobs[n]    = sum_f g * a * s * b
// Everything is computed in fp32 registers (fp64 for fp64 inputs) and rounded once to the output
// dtype; dprobs is summed over f in a fixed order (bitwise reproducible, any thread count). One pass
// over x forward (no [N, F] intermediates), one backward; only x and probs are needed for backward.
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "common/op_registry.h"
#include "common/vec.h"

namespace {

using at::Tensor;
namespace V = amo::vec;

// Rows x F below this many elements run on the calling thread (tens of microseconds). Was 2^20,
// set when the measurements ran on a loaded shared machine; on a quiet 2-core machine the
// T=256 call (2048 x 256) ran 0.67x Megatron-Core's compiled activation on one thread and 1.00-1.24x
// on two (2026-12-02, docs/benchmarks.md).
constexpr int64_t kSerialElems = int64_t(1) << 16;


void check_inputs(const char* op, const Tensor& x, const Tensor& probs) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK_VALUE(x.dim() == 2, op, ": x must be 2-D [N, 2F], got shape ", x.sizes());
  const auto is_float = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
  };
  TORCH_CHECK_TYPE(is_float(x.scalar_type()), op, ": x must have dtype in (float32, float16, bfloat16, float64), got ",
                   x.scalar_type());
  TORCH_CHECK_VALUE(x.size(1) % 2 == 0, op, ": x must have an even number of columns [N, 2F], got shape ", x.sizes());
  TORCH_CHECK_VALUE(probs.device() == x.device(), op, ": probs is on ", probs.device(), " but x is on ", x.device());
  TORCH_CHECK_TYPE(is_float(probs.scalar_type()), op,
                   ": probs must have dtype in (float32, float16, bfloat16, float64), got ", probs.scalar_type());
  TORCH_CHECK_VALUE(probs.dim() == 1 && probs.size(0) == x.size(0), op, ": probs must have shape (", x.size(0),
                    ",) (one per row of x), got ", probs.sizes());
}

int64_t grain_for(int64_t N, int64_t F) {
  return N * F < kSerialElems ? std::max<int64_t>(N, 1) : std::max<int64_t>(1, 16384 / std::max<int64_t>(F, 1));
}

Tensor swiglu_probs_cpu(const Tensor& x_in, const Tensor& probs_in) {
  check_inputs("swiglu_probs", x_in, probs_in);
  const Tensor x = x_in.contiguous();
  const int64_t N = x.size(0), F = x.size(1) / 2;
  Tensor out = at::empty({N, F}, x.options());
  if (N == 0 || F == 0) return out;
  if (x.scalar_type() == at::kDouble) {
    const Tensor p = probs_in.to(at::kDouble).contiguous();
    const double* xs = x.data_ptr<double>();
    const double* ps = p.data_ptr<double>();
    double* o = out.data_ptr<double>();
    at::parallel_for(0, N, grain_for(N, F), [&](int64_t nb, int64_t ne) {
      for (int64_t n = nb; n < ne; ++n)
        for (int64_t f = 0; f < F; ++f) {
          const double a = xs[n * 2 * F + f], b = xs[n * 2 * F + F + f];
          o[n * F + f] = a / (1.0 + std::exp(-a)) * b * ps[n];
        }
    });
    return out;
  }
  const Tensor p = probs_in.to(at::kFloat).contiguous();
  const float* ps = p.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_probs_cpu", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain_for(N, F), [&](int64_t nb, int64_t ne) {
      for (int64_t n = nb; n < ne; ++n) {
        const scalar_t* xa = xs + n * 2 * F;
        const scalar_t* xb = xa + F;
        scalar_t* on = o + n * F;
        const V::VecF pv = V::set1(ps[n]);
        for (int64_t f = 0; f < F; f += V::kWidth) {
          const V::Mask m = V::tail_mask(std::min<int64_t>(V::kWidth, F - f));
          const V::VecF a = V::load(xa + f, m), b = V::load(xb + f, m);
          V::store(on + f, V::mul(V::mul(V::mul(a, V::sigmoid(a)), b), pv), m);
        }
      }
    });
  });
  return out;
}

std::tuple<Tensor, Tensor> swiglu_probs_backward_cpu(const Tensor& grad_in, const Tensor& x_in, const Tensor& probs_in) {
  constexpr const char* op = "swiglu_probs_backward";
  check_inputs(op, x_in, probs_in);
  const int64_t N = x_in.size(0), F = x_in.size(1) / 2;
  TORCH_CHECK_VALUE(grad_in.device() == x_in.device(), op, ": grad_out is on ", grad_in.device(), " but x is on ",
                    x_in.device());
  TORCH_CHECK_TYPE(grad_in.scalar_type() == x_in.scalar_type(), op, ": grad_out must have x's dtype ",
                   x_in.scalar_type(), ", got ", grad_in.scalar_type());
  TORCH_CHECK_VALUE(grad_in.dim() == 2 && grad_in.size(0) == N && grad_in.size(1) == F, op,
                    ": grad_out must have shape (", N, ", ", F, ") (x is [N, 2F]), got ", grad_in.sizes());
  const Tensor x = x_in.contiguous();
  const Tensor g = grad_in.contiguous();
  Tensor dx = at::empty({N, 2 * F}, x.options());
  if (x.scalar_type() == at::kDouble) {
    const Tensor p = probs_in.to(at::kDouble).contiguous();
    Tensor dp = at::zeros({N}, x.options());
    const double* xs = x.data_ptr<double>();
    const double* gs = g.data_ptr<double>();
    const double* ps = p.data_ptr<double>();
    double* d = dx.data_ptr<double>();
    double* dps = dp.data_ptr<double>();
    at::parallel_for(0, N, grain_for(N, F), [&](int64_t nb, int64_t ne) {
      for (int64_t n = nb; n < ne; ++n) {
        double acc = 0.0;
        for (int64_t f = 0; f < F; ++f) {
          const double a = xs[n * 2 * F + f], b = xs[n * 2 * F + F + f], gv = gs[n * F + f];
          const double s = 1.0 / (1.0 + std::exp(-a)), gp = gv * ps[n];
          d[n * 2 * F + f] = gp * b * s * (1.0 + a * (1.0 - s));
          d[n * 2 * F + F + f] = gp * a * s;
          acc += gv * a * s * b;
        }
        dps[n] = acc;
      }
    });
    return std::make_tuple(dx, dp.to(probs_in.scalar_type()));
  }
  const Tensor p = probs_in.to(at::kFloat).contiguous();
  Tensor dp = at::empty({N}, p.options());
  const float* ps = p.data_ptr<float>();
  float* dps = dp.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "swiglu_probs_backward_cpu", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* gs = g.data_ptr<scalar_t>();
    scalar_t* d = dx.data_ptr<scalar_t>();
    at::parallel_for(0, N, grain_for(N, F), [&](int64_t nb, int64_t ne) {
      const V::VecF one = V::set1(1.0f);
      for (int64_t n = nb; n < ne; ++n) {
        const scalar_t* xa = xs + n * 2 * F;
        const scalar_t* xb = xa + F;
        const scalar_t* gn = gs + n * F;
        scalar_t* da = d + n * 2 * F;
        scalar_t* db = da + F;
        const V::VecF pv = V::set1(ps[n]);
        V::VecF acc = V::zero();
        for (int64_t f = 0; f < F; f += V::kWidth) {
          const V::Mask m = V::tail_mask(std::min<int64_t>(V::kWidth, F - f));
          const V::VecF a = V::load(xa + f, m), b = V::load(xb + f, m), gv = V::load(gn + f, m);
          const V::VecF s = V::sigmoid(a);
          const V::VecF silu = V::mul(a, s);
          const V::VecF gp = V::mul(gv, pv);
          // s * (1 + a * (1 - s))
          const V::VecF dsilu = V::mul(s, V::fma(a, V::sub(one, s), one));
          V::store(da + f, V::mul(V::mul(gp, b), dsilu), m);
          V::store(db + f, V::mul(gp, silu), m);
          acc = V::fma(V::mul(gv, silu), b, acc);  // masked lanes loaded as zero
        }
        dps[n] = V::reduce_add(acc);
      }
    });
  });
  return std::make_tuple(dx, probs_in.scalar_type() == at::kFloat ? dp : dp.to(probs_in.scalar_type()));
}

}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(swiglu_probs, swiglu_probs_cpu)
AMO_CPU_KERNEL(swiglu_probs_backward, swiglu_probs_backward_cpu)
