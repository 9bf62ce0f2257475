// CPU flash attention, forward and backward (see flash_attention.h for the layout): seqlen_q !=
// seqlen_k with the causal mask aligned bottom-right (query i of a sequence with Lq queries and Lk
// keys sees keys j <= i + Lk - Lq), GQA/MQA (q head h reads kv head h / (Hq / Hkv)), any d_qk / d_v.
//
// Inputs are converted once to the accumulation type (fp32; fp64 for fp64 inputs), then every
// tile product is a BLAS call on strided tiles of those buffers (no per-tile copies): scores are
// two products when there is a shared key part (nope part with the per-head key, rope part with
// the single k_rope head), so k_rope is never expanded per head. The softmax is the online
// (running max / running sum) form, so no S x S matrix exists; causal runs skip fully masked
// key blocks.
//
// Threads: the forward runs over (sequence, q head, query block) items (largest first), the
// backward over (sequence, q head) items, each owning its rows of dq and of dk / dv (with GQA a
// per-q-head part of dk / dv, summed over each group afterwards in fixed order). Workers pull
// items from a shared counter (dynamic scheduling: a descheduled thread on a busy machine does
// not stall the others); the values never depend on which worker ran an item, so results are
// bitwise reproducible for any thread count. The rope-key gradient is summed over heads
// afterwards in fixed head order.
#include "cpu/flash_attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "common/flash_attention_checks.h"
#include "common/op_registry.h"
#include "common/registry.h"

// BLAS from the MKL that the x86 torch wheels link statically (column-major Fortran ABI). Weak:
// where the symbol is absent the tile products fall back to at::mm on the same buffers.
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
}

namespace amo {
namespace {

// Query and key block sizes (rows of the score tile). 128x128 tiles keep the per-call BLAS
// overhead small next to a 128x128x192 product while the causal diagonal waste stays at half a
// block per row. AMO_FA_BLOCK_M / AMO_FA_BLOCK_N (16..512) override them, for tuning only.
int64_t block_from_env(const char* name, int64_t dflt) {
  const char* s = std::getenv(name);
  if (!s) return dflt;
  const int64_t v = std::atoll(s);
  return (v >= 16 && v <= 512) ? v : dflt;
}
const int64_t kBlockM = block_from_env("AMO_FA_BLOCK_M", 128);
const int64_t kBlockN = block_from_env("AMO_FA_BLOCK_N", 128);

template <typename acc_t>
at::Tensor tile(const acc_t* p, int64_t rows, int64_t cols, int64_t ld) {
  auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
  return at::from_blob(const_cast<acc_t*>(p), {rows, cols}, {ld, 1}, opts);
}

// Row-major C[M,N] = alpha * op(A) op(B) + beta * C, op = transpose when ta/tb.
template <typename acc_t>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const acc_t* A, int64_t lda,
          const acc_t* B, int64_t ldb, acc_t beta, acc_t* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == acc_t(0) ? acc_t(0) : C[i * ldc + j] * beta;
    return;
  }
  const acc_t one = 1;
  // row-major C = A B  <=>  column-major C^T = B^T A^T
  const char tra = tb ? 'T' : 'N', trb = ta ? 'T' : 'N';
  const int m = (int)N, n = (int)M, k = (int)K, la = (int)ldb, lb = (int)lda, lc = (int)ldc;
  if constexpr (std::is_same_v<acc_t, float>) {
    if (sgemm_) { sgemm_(&tra, &trb, &m, &n, &k, &one, B, &la, A, &lb, &beta, C, &lc); return; }
  } else {
    if (dgemm_) { dgemm_(&tra, &trb, &m, &n, &k, &one, B, &la, A, &lb, &beta, C, &lc); return; }
  }
  auto a = ta ? tile(A, K, M, lda).t() : tile(A, M, K, lda);
  auto b = tb ? tile(B, N, K, ldb).t() : tile(B, K, N, ldb);
  auto c = tile(C, M, N, ldc);
  if (beta == acc_t(0)) at::mm_out(c, a, b); else c.addmm_(a, b, beta, 1);
}

// exp for x <= 0 (scores minus the running max). fp32: 2^n * poly(r), |r| <= ln2/2, degree-6
// Taylor (relative error ~1e-7), written so that the compiler vectorizes the loops using it. x is
// clamped to [-87, 0] (above 0, 2^n would overflow the exponent field: NaN).
#pragma omp declare simd
inline float exp_neg(float x) {
  x = std::min(std::max(x, -87.0f), 0.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float g = (t - n) * 0.6931471805599453f;
  float p = 1.0f / 720.0f;
  p = p * g + 1.0f / 120.0f;
  p = p * g + 1.0f / 24.0f;
  p = p * g + 1.0f / 6.0f;
  p = p * g + 0.5f;
  p = p * g + 1.0f;
  p = p * g + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
inline double exp_neg(double x) { return std::exp(x); }

// A [T, H, D] operand in the accumulation type, described by pointer and strides. The tile products
// take the token stride as the BLAS leading dimension, so each head's [T, D] slice must be a valid
// row-major matrix: unit column stride and a token stride of at least D (BLAS needs ld >= max(1, D))
// that fits an int. Anything else -- a token-expanded operand (token stride 0, a direct op call with
// `.expand`), overlapping rows, a transposed view -- is made contiguous first. The stride of a size-1
// dim is never stepped over and PyTorch leaves it arbitrary (a one-token [1, H, D] view can count as
// contiguous with a token stride of 0, 1 or 2**40, and `.contiguous()` keeps it): such a dim is
// described by its dense stride, so BLAS never sees it as a leading dimension.
template <typename acc_t>
struct Operand {
  at::Tensor holder;
  const acc_t* p = nullptr;
  int64_t st = 0, sh = 0, dim = 0;
  const acc_t* at(int64_t t, int64_t h) const { return p + t * st + h * sh; }
};

template <typename acc_t>
Operand<acc_t> operand(const at::Tensor& x) {
  const auto acc = c10::CppTypeToScalarType<acc_t>::value;
  at::Tensor t = x.scalar_type() == acc ? x : x.to(acc);
  const int64_t d = t.size(-1), ld = std::max<int64_t>(1, d);
  // dim i's stride, or `dense` where the dim has one element
  const auto stride = [&t](int64_t i, int64_t dense) { return t.size(i) == 1 ? dense : t.stride(i); };
  if (stride(-1, 1) != 1 || stride(0, ld) < ld || stride(0, ld) > std::numeric_limits<int>::max())
    t = t.contiguous();
  Operand<acc_t> o;
  o.holder = t;
  o.p = t.data_ptr<acc_t>();
  o.dim = d;
  o.st = stride(0, ld);
  o.sh = t.dim() == 3 ? t.stride(1) : 0;  // [T, D]: one head shared by all (a size-1 head dim: h is 0)
  return o;
}

std::vector<int64_t> bounds_of(const at::Tensor& cu_seqlens) {
  auto c = cu_seqlens.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Keys visible to the query at local position i of a sequence with Lq queries and Lk keys: all Lk,
// or with causal (bottom-right aligned) the first clamp(i + Lk - Lq + 1, 0, Lk).
inline int64_t visible_keys(bool causal, int64_t i, int64_t Lq, int64_t Lk) {
  return causal ? std::min(Lk, std::max<int64_t>(0, i + Lk - Lq + 1)) : Lk;
}

template <typename acc_t, typename scalar_t>
void fwd_kernel(const Operand<acc_t>& Q, const Operand<acc_t>& K, const Operand<acc_t>& V,
                const Operand<acc_t>* KR, const std::vector<int64_t>& cuq, const std::vector<int64_t>& cuk,
                int64_t H, int64_t Hkv, bool causal, acc_t scale, scalar_t* out, acc_t* lse, int64_t T) {
  const int64_t Dk = K.dim, Dr = KR ? KR->dim : 0, Dv = V.dim, group = H / Hkv;
  struct Item { int64_t b, h, q0, work; };
  std::vector<Item> items;
  for (size_t b = 0; b + 1 < cuq.size(); ++b) {
    const int64_t Lq = cuq[b + 1] - cuq[b], Lk = cuk[b + 1] - cuk[b];
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q0 = cuq[b]; q0 < cuq[b + 1]; q0 += kBlockM) {
        const int64_t last = std::min(kBlockM, cuq[b + 1] - q0) - 1 + q0 - cuq[b];
        items.push_back({(int64_t)b, h, q0, visible_keys(causal, last, Lq, Lk)});
      }
  }
  // largest blocks (most visible keys: the latest query blocks in causal runs) first, so the
  // dynamic schedule ends balanced
  if (causal) std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) {
    return x.work > y.work; });
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
  const int64_t n_items = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<acc_t> S(kBlockM * kBlockN), O(kBlockM * Dv), m(kBlockM), l(kBlockM);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const auto [b, h, q0, work] = items[it];
      const int64_t kh = h / group;
      const int64_t sq = cuq[b], eq = cuq[b + 1], sk = cuk[b];
      const int64_t Lq = eq - sq, Lk = cuk[b + 1] - sk, mq = std::min(kBlockM, eq - q0);
      std::fill(O.begin(), O.begin() + mq * Dv, acc_t(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), acc_t(0));
      const int64_t kv_end = sk + work;  // keys past the last row's visible ones are masked for all rows
      const acc_t* Qp = Q.at(q0, h);
      for (int64_t k0 = sk; k0 < kv_end; k0 += kBlockN) {
        const int64_t nk = std::min(kBlockN, kv_end - k0);
        gemm<acc_t>(false, true, mq, nk, Dk, Qp, Q.st, K.at(k0, kh), K.st, 0, S.data(), kBlockN);
        if (Dr) gemm<acc_t>(false, true, mq, nk, Dr, Qp + Dk, Q.st, KR->at(k0, 0), KR->st, 1, S.data(), kBlockN);
        for (int64_t r = 0; r < mq; ++r) {
          acc_t* srow = S.data() + r * kBlockN;
          const int64_t valid = std::min(nk, sk + visible_keys(causal, q0 - sq + r, Lq, Lk) - k0);
          if (valid <= 0) { std::fill(srow, srow + nk, acc_t(0)); continue; }
          // the scaled scores are stored (rounded once) before the max and the exp: the row max is then
          // one of them exactly, and its exp is exp(0) = 1 (a multiply-add contracted into the exp's
          // argument kept the exact product, off the rounded max by up to half its ulp: at products
          // near 1e22 that error, ~1e15, sent the max element's exp to 0 or NaN)
          acc_t mx = neg_inf;
#pragma omp simd reduction(max : mx)
          for (int64_t j = 0; j < valid; ++j) {
            srow[j] *= scale;
            mx = std::max(mx, srow[j]);
          }
          const acc_t mnew = std::max(m[r], mx);
          const acc_t alpha = m[r] == neg_inf ? acc_t(0) : exp_neg(m[r] - mnew);
          acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < valid; ++j) {
            const acc_t p = exp_neg(srow[j] - mnew);
            srow[j] = p;
            sum += p;
          }
          for (int64_t j = valid; j < nk; ++j) srow[j] = 0;
          l[r] = l[r] * alpha + sum;
          m[r] = mnew;
          if (alpha != acc_t(1)) {
            acc_t* orow = O.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) orow[d] *= alpha;
          }
        }
        gemm<acc_t>(false, false, mq, Dv, nk, S.data(), kBlockN, V.at(k0, kh), V.st, 1, O.data(), Dv);
      }
      // a row that sees no key has l = 0: out = 0, lse = -inf. Only that row: a NaN or +inf score makes
      // l NaN, and out and lse stay NaN (-inf is the no-key marker, never a result)
      for (int64_t r = 0; r < mq; ++r) {
        const acc_t inv = l[r] == acc_t(0) ? acc_t(0) : acc_t(1) / l[r];
        scalar_t* orow = out + ((q0 + r) * H + h) * Dv;
        const acc_t* src = O.data() + r * Dv;
        for (int64_t d = 0; d < Dv; ++d) orow[d] = static_cast<scalar_t>(src[d] * inv);
        // a +inf score (row max +inf): lse = +inf, the reference's logsumexp (m + log(NaN) would be NaN)
        lse[h * T + q0 + r] = l[r] == acc_t(0) ? neg_inf
                              : m[r] > std::numeric_limits<acc_t>::max() ? m[r] : m[r] + std::log(l[r]);
      }
    }
  });
}

// Output [T, H, D] buffer of the backward (accumulation type, any token/head strides).
template <typename acc_t>
struct Grad {
  acc_t* p;
  int64_t st, sh;
  acc_t* at(int64_t t, int64_t h) const { return p + t * st + h * sh; }
};

template <typename acc_t>
Grad<acc_t> grad_of(at::Tensor& t) {
  TORCH_INTERNAL_ASSERT(t.stride(-1) == 1, "flash_attention: gradient buffers need a unit last stride");
  return {t.data_ptr<acc_t>(), t.stride(0), t.stride(1)};
}

// The gradient buffers are zero-filled by the caller (rows no query sees, and dq rows that see no
// key, stay 0); every product accumulates (beta = 1). dk / dv are those of q head h: the kv head's
// own rows when each kv head serves one q head, else a per-q-head part summed afterwards.
template <typename acc_t, typename scalar_t>
void bwd_kernel(const Operand<acc_t>& Q, const Operand<acc_t>& K, const Operand<acc_t>& V,
                const Operand<acc_t>* KR, const Operand<acc_t>& dO, const at::Tensor& out,
                const acc_t* lse, const std::vector<int64_t>& cuq, const std::vector<int64_t>& cuk,
                int64_t H, int64_t Hkv, bool causal, acc_t scale, int64_t T, int64_t Tk, Grad<acc_t> dq,
                Grad<acc_t> dk, Grad<acc_t> dv, acc_t* dkr_part) {
  const int64_t Dk = K.dim, Dr = KR ? KR->dim : 0, Dv = V.dim, group = H / Hkv;
  const scalar_t* O = out.data_ptr<scalar_t>();
  const int64_t o_st = out.stride(0), o_sh = out.stride(1);
  struct Item { int64_t b, h; };
  std::vector<Item> items;
  int64_t longest = 0;
  for (size_t b = 0; b + 1 < cuq.size(); ++b) {
    longest = std::max(longest, cuq[b + 1] - cuq[b]);
    for (int64_t h = 0; h < H; ++h)
      if (cuq[b + 1] > cuq[b] && cuk[b + 1] > cuk[b]) items.push_back({(int64_t)b, h});
  }
  const int64_t n_items = (int64_t)items.size();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n_items, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    std::vector<acc_t> P(kBlockM * kBlockN), dP(kBlockM * kBlockN), delta(longest);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < n_items;) {
      const auto [b, h] = items[it];
      const int64_t kh = h / group;
      const int64_t sq = cuq[b], eq = cuq[b + 1], sk = cuk[b], ek = cuk[b + 1];
      const int64_t Lq = eq - sq, Lk = ek - sk;
      // delta[t] = sum_d dO * O, the softmax-backward row term
      for (int64_t t = sq; t < eq; ++t) {
        const acc_t* g = dO.at(t, h);
        const scalar_t* o = O + t * o_st + h * o_sh;
        acc_t acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < Dv; ++d) acc += g[d] * static_cast<acc_t>(o[d]);
        delta[t - sq] = acc;
      }
      for (int64_t k0 = sk; k0 < ek; k0 += kBlockN) {
        const int64_t nk = std::min(kBlockN, ek - k0);
        acc_t* dKp = dk.at(k0, h);
        acc_t* dVp = dv.at(k0, h);
        acc_t* dKRp = Dr ? dkr_part + (h * Tk + k0) * Dr : nullptr;
        // the first query that sees key k0: local i with i + Lk - Lq >= k0 - sk
        const int64_t q_first = causal ? sq + std::max<int64_t>(0, (k0 - sk) - (Lk - Lq)) : sq;
        for (int64_t q0 = q_first; q0 < eq; q0 += kBlockM) {
          const int64_t mq = std::min(kBlockM, eq - q0);
          const acc_t* Qp = Q.at(q0, h);
          const acc_t* dOp = dO.at(q0, h);
          gemm<acc_t>(false, true, mq, nk, Dk, Qp, Q.st, K.at(k0, kh), K.st, 0, P.data(), kBlockN);
          if (Dr) gemm<acc_t>(false, true, mq, nk, Dr, Qp + Dk, Q.st, KR->at(k0, 0), KR->st, 1, P.data(), kBlockN);
          for (int64_t r = 0; r < mq; ++r) {
            acc_t* prow = P.data() + r * kBlockN;
            const acc_t L = lse[h * T + q0 + r];
            const int64_t valid =
                std::max<int64_t>(0, std::min(nk, sk + visible_keys(causal, q0 - sq + r, Lq, Lk) - k0));
            // scaled and rounded first, as in the forward (its lse came from those rounded products)
#pragma omp simd
            for (int64_t j = 0; j < valid; ++j) prow[j] *= scale;
#pragma omp simd
            for (int64_t j = 0; j < valid; ++j) prow[j] = exp_neg(prow[j] - L);
            for (int64_t j = valid; j < nk; ++j) prow[j] = 0;
          }
          // dV += P^T dO
          gemm<acc_t>(true, false, nk, Dv, mq, P.data(), kBlockN, dOp, dO.st, 1, dVp, dv.st);
          // dP = dO V^T
          gemm<acc_t>(false, true, mq, nk, Dv, dOp, dO.st, V.at(k0, kh), V.st, 0, dP.data(), kBlockN);
          // dS = P * (dP - delta) * scale   (stored in dP). A query row that sees one key only
          // (a one-key sequence, or the first visible query of a causal sequence) has P = 1 and
          // dP = delta mathematically, so dS = 0; computed, dP (a BLAS product) and delta (the
          // dO . O sum above, of the rounded O) differ in the last bits, so those rows are set
          // to exactly zero instead (as the rows that see no key).
          for (int64_t r = 0; r < mq; ++r) {
            const acc_t D = delta[q0 + r - sq];
            acc_t* drow = dP.data() + r * kBlockN;
            const acc_t* prow = P.data() + r * kBlockN;
            if (visible_keys(causal, q0 - sq + r, Lq, Lk) <= 1) { std::fill(drow, drow + nk, acc_t(0)); continue; }
#pragma omp simd
            for (int64_t j = 0; j < nk; ++j) drow[j] = prow[j] * (drow[j] - D) * scale;
          }
          acc_t* dQp = dq.at(q0, h);
          gemm<acc_t>(false, false, mq, Dk, nk, dP.data(), kBlockN, K.at(k0, kh), K.st, 1, dQp, dq.st);
          if (Dr) gemm<acc_t>(false, false, mq, Dr, nk, dP.data(), kBlockN, KR->at(k0, 0), KR->st, 1, dQp + Dk, dq.st);
          gemm<acc_t>(true, false, nk, Dk, mq, dP.data(), kBlockN, Qp, Q.st, 1, dKp, dk.st);
          if (Dr) gemm<acc_t>(true, false, nk, Dr, mq, dP.data(), kBlockN, Qp + Dk, Q.st, 1, dKRp, Dr);
        }
      }
    }
  });
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double softmax_scale) {
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), Dv = v.size(2);
  const auto acc = acc_type(q.scalar_type());
  auto out = at::zeros({T, H, Dv}, q.options());
  auto lse = at::full({H, T}, -std::numeric_limits<double>::infinity(), q.options().dtype(acc));
  const auto cuq = bounds_of(cu_seqlens_q), cuk = bounds_of(cu_seqlens_k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_attention_fwd", [&] {
    auto run = [&](auto zero) {
      using acc_t = decltype(zero);
      auto Q = operand<acc_t>(q), K = operand<acc_t>(k), V = operand<acc_t>(v);
      std::optional<Operand<acc_t>> KR;
      if (k_rope) KR = operand<acc_t>(*k_rope);
      fwd_kernel<acc_t, scalar_t>(Q, K, V, KR ? &*KR : nullptr, cuq, cuk, H, Hkv, causal, (acc_t)softmax_scale,
                                  out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>(), T);
    };
    if (acc == at::kDouble) run(double(0)); else run(float(0));
  });
  return {out, lse};
}

at::Tensor flash_attention_bwd_into(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, bool causal,
    double softmax_scale, at::Tensor dq, at::Tensor dk, at::Tensor dv) {
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), Tk = k.size(0);
  const int64_t Dr = k_rope ? k_rope->size(1) : 0;
  const auto acc = acc_type(q.scalar_type());
  TORCH_INTERNAL_ASSERT(dq.scalar_type() == acc && dk.scalar_type() == acc && dv.scalar_type() == acc,
                        "flash_attention: gradient buffers must have the accumulation dtype");
  auto dkr_part = at::zeros({Dr ? H : 0, Tk, Dr}, q.options().dtype(acc));
  dq.zero_();
  // GQA/MQA: each q head writes its own [Tk, D] part of dk / dv (item (sequence, q head) owns it),
  // summed over the heads of each group afterwards in fixed head order (no atomics, the same bits for
  // any thread count); with Hkv = Hq the kernel writes dk / dv directly
  const int64_t group = H / Hkv;
  at::Tensor dk_to = dk, dv_to = dv;
  if (group > 1) {
    dk_to = at::zeros({Tk, H, dk.size(2)}, q.options().dtype(acc));
    dv_to = at::zeros({Tk, H, dv.size(2)}, q.options().dtype(acc));
  } else {
    dk.zero_();
    dv.zero_();
  }
  auto lse_acc = lse.to(acc).contiguous();
  auto out_c = out.stride(-1) == 1 ? out : out.contiguous();
  const auto cuq = bounds_of(cu_seqlens_q), cuk = bounds_of(cu_seqlens_k);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "flash_attention_bwd", [&] {
    auto run = [&](auto zero) {
      using acc_t = decltype(zero);
      auto Q = operand<acc_t>(q), K = operand<acc_t>(k), V = operand<acc_t>(v), dO = operand<acc_t>(grad_out);
      std::optional<Operand<acc_t>> KR;
      if (k_rope) KR = operand<acc_t>(*k_rope);
      bwd_kernel<acc_t, scalar_t>(Q, K, V, KR ? &*KR : nullptr, dO, out_c, lse_acc.data_ptr<acc_t>(),
                                  cuq, cuk, H, Hkv, causal, (acc_t)softmax_scale, T, Tk, grad_of<acc_t>(dq),
                                  grad_of<acc_t>(dk_to), grad_of<acc_t>(dv_to),
                                  Dr ? dkr_part.data_ptr<acc_t>() : nullptr);
    };
    if (acc == at::kDouble) run(double(0)); else run(float(0));
  });
  if (group > 1) {
    for (int64_t kh = 0; kh < Hkv; ++kh) {
      auto dk_h = dk.select(1, kh), dv_h = dv.select(1, kh);
      dk_h.copy_(dk_to.select(1, kh * group));
      dv_h.copy_(dv_to.select(1, kh * group));
      for (int64_t g = 1; g < group; ++g) {
        dk_h.add_(dk_to.select(1, kh * group + g));
        dv_h.add_(dv_to.select(1, kh * group + g));
      }
    }
  }
  // a k_rope of shape [Tk, 0] gets a gradient of its own shape (not the [0] of "no k_rope")
  if (!Dr) return k_rope ? at::zeros({Tk, 0}, q.options()) : at::empty({0}, q.options());
  // sum the per-head parts in fixed head order: the same bits for any thread count
  auto dkr = dkr_part[0].clone();
  for (int64_t h = 1; h < H; ++h) dkr.add_(dkr_part[h]);
  return dkr.to(q.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, bool causal, double softmax_scale) {
  auto fopts = q.options().dtype(acc_type(q.scalar_type()));
  auto dq = at::empty(q.sizes(), fopts), dk = at::empty(k.sizes(), fopts), dv = at::empty(v.sizes(), fopts);
  auto dkr = flash_attention_bwd_into(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q,
                                      cu_seqlens_k, causal, softmax_scale, dq, dk, dv);
  const auto dt = q.scalar_type();
  return {dq.to(dt), dk.to(dt), dv.to(dt), dkr};
}

}  // namespace amo

// ---- dispatcher kernels: the op-boundary checks (common/flash_attention_checks.h), the valid empty cases
// (Tq = 0, B = 0, Hq = 0: no kernel launch; Tk = 0: zeros), then the kernels ----
namespace {
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const std::optional<at::Tensor>& k_rope,
                                                          const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                          int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                                          double softmax_scale) {
  amo::checks::flash_attention_fwd(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale);
  if (amo::checks::attention_is_empty(q, k)) return amo::checks::empty_attention_fwd(q, v);
  return amo::flash_attention_fwd_cpu(q, k, v, k_rope, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      softmax_scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_op(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& k_rope, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double softmax_scale) {
  amo::checks::flash_attention_bwd(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   max_seqlen_k, causal, softmax_scale);
  if (amo::checks::attention_is_empty(q, k))
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v),
            k_rope ? at::zeros_like(*k_rope) : at::empty({0}, q.options())};
  return amo::flash_attention_bwd_cpu(grad_out, q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal, softmax_scale);
}
}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(flash_attention_fwd, flash_attention_fwd_op)
AMO_CPU_KERNEL(flash_attention_bwd, flash_attention_bwd_op)
AMO_OP_CONTRACT(flash_attention_fwd)
AMO_OP_CONTRACT(flash_attention_bwd)
