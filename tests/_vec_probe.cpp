// Test probe for csrc/common/vec.h (tests/test_vec.py): a few extern "C" entry points that run
// the vector layer's loads, stores, arithmetic, exp/sigmoid, reduction and streaming copies over
// caller buffers. tests/test_vec.py compiles this file once per instruction set (scalar fallback,
// AVX2, AVX-512 where the CPU has it) and compares the results bitwise and with PyTorch.
#include "common/vec.h"

#include <cstdint>

namespace V = amo::vec;

namespace {

// dtype codes shared with the test: 0 fp32, 1 bf16, 2 fp16, 3 fp64
template <typename Fn>
void with_type(int dtype, Fn fn) {
  switch (dtype) {
    case 0: fn(float{}); break;
    case 1: fn(c10::BFloat16{}); break;
    case 2: fn(c10::Half{}); break;
    default: fn(double{}); break;
  }
}

// a lane pattern that is not a prefix: loads must zero, stores must skip the other lanes
constexpr V::Mask kSparse = 0xA5C3u;

}  // namespace

extern "C" {

int amo_vec_isa() { return AMO_AVX512 ? 512 : (AMO_AVX2 ? 256 : 0); }

// out[i] = dtype_out(dtype_in in[i]) through load + store: full vectors, a sparse mask on every
// third vector (the other lanes of out are left as they were) and a tail mask for the rest.
void amo_vec_convert(int dtype_in, const void* in, int dtype_out, void* out, int64_t n) {
  with_type(dtype_in, [&](auto ti) {
    using TI = decltype(ti);
    with_type(dtype_out, [&](auto to) {
      using TO = decltype(to);
      const TI* src = static_cast<const TI*>(in);
      TO* dst = static_cast<TO*>(out);
      for (int64_t c = 0, j = 0; c < n; c += V::kWidth, ++j) {
        if (n - c >= V::kWidth && j % 3 != 2) {
          V::store(dst + c, V::load(src + c));
        } else {
          const V::Mask m = n - c >= V::kWidth ? kSparse : V::tail_mask(n - c);
          V::store(dst + c, V::load(src + c, m), m);
        }
      }
    });
  });
}

// Arithmetic on x, y of one dtype: f = exp(v / 4) * sigmoid(fma(v, 1.5, w) * v + (w - v)), v = x,
// w = y lane by lane (masked lanes of a tail load as 0); out gets f in the dtype (tails masked),
// red[j] = reduce_add of vector j's f (all 16 lanes), out_nt the full vectors with store_nt
// (out_nt must be 64-byte aligned).
void amo_vec_math(int dtype, const void* x, const void* y, int64_t n, void* out, float* red, void* out_nt) {
  with_type(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* xs = static_cast<const T*>(x);
    const T* ys = static_cast<const T*>(y);
    T* o = static_cast<T*>(out);
    T* ont = static_cast<T*>(out_nt);
    for (int64_t c = 0, j = 0; c < n; c += V::kWidth, ++j) {
      const V::Mask m = V::tail_mask(n - c);
      const V::VecF v = V::load(xs + c, m), w = V::load(ys + c, m);
      const V::VecF a = V::fma(v, V::set1(1.5f), w);
      const V::VecF b = V::add(V::mul(a, v), V::sub(w, v));
      const V::VecF f = V::mul(V::exp(V::mul(v, V::set1(0.25f))), V::sigmoid(b));
      V::store(o + c, f, m);
      red[j] = V::reduce_add(f);
      if (n - c >= V::kWidth) V::store_nt(ont + c, f);
    }
    V::sfence();
  });
}

void amo_vec_copy(char* dst, const char* src, int64_t bytes, int stream) { V::copy_bytes(dst, src, bytes, stream != 0); }

void amo_vec_zero(char* dst, int64_t bytes, int stream) { V::zero_bytes(dst, bytes, stream != 0); }

}  // extern "C"
