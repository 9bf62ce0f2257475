// Native CPU moe_permute: group token rows by expert (expert-major, stable), dropless, drop-and-pad
// (capacity) or aligned groups. Contract and the exact spec: ascend_moe_ops/reference/moe_permute.py.
//
// One pass over the data:
//   1. map: per-chunk expert histograms over token chunks (parallel) + prefix sums give every slot
//      its destination row (a stable counting sort; the result does not depend on the chunking).
//      Capacity mode additionally sorts the slots of each overflowing expert by (prob desc,
//      position asc) to pick the kept ones.
//   2. copy: parallel over source tokens; each token row is read once (it stays in L1/L2) and
//      memcpy'd to each of its destination rows, with streaming stores for large outputs.
//   3. zero: rows that no slot fills (padding and the unused tail) are zeroed, nothing else.
// The [N, H] output is allocated with huge-page advice (common/alloc.h): on this machine first-touch
// faults of a fresh 500 MB output otherwise cost several times more than the copy itself.
// Row offsets are 64-bit (row * H * element size never overflows).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common/alloc.h"
#include "common/moe_permute_checks.h"
#include "common/op_registry.h"
#include "common/registry.h"
#include "common/vec.h"

namespace {

using at::Tensor;

// Map work below this many slots runs on the calling thread: it takes tens of microseconds, while
// waking a second thread can cost milliseconds when the cores are shared (measured here: 0.3 ms on
// one thread vs 100+ ms with two under a load average of 10).
constexpr int64_t kSerialSlots = int64_t(1) << 20;
// The row copy runs on the calling thread below this many output bytes (a few hundred microseconds
// of copying; under this machine's shared load a second thread's wake-up alone took milliseconds).
constexpr int64_t kSerialCopyBytes = int64_t(8) << 20;
// ... and, when the token matrix is at most this large (it stays in L2), in destination-row order.
constexpr int64_t kGatherTokenBytes = int64_t(1) << 20;

// Expert id of every slot of `routing` ([T, S] ids or bool mask), -1 when empty or out of [0, E).
std::vector<int32_t> slot_experts(const Tensor& routing, int64_t E) {
  const int64_t S = routing.size(1);
  std::vector<int32_t> eid(static_cast<size_t>(routing.numel()));
  auto fill = [&](auto* r) {
    using R = std::remove_const_t<std::remove_pointer_t<decltype(r)>>;
    const int64_t T = routing.size(0);
    at::parallel_for(0, T, std::max<int64_t>(1, kSerialSlots / std::max<int64_t>(S, 1)), [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        for (int64_t s = 0; s < S; ++s) {
          const int64_t i = t * S + s;
          int64_t id;
          if constexpr (std::is_same_v<R, bool>) {
            id = r[i] ? s : -1;  // mask routing: column s is expert s
          } else {
            id = static_cast<int64_t>(r[i]);
          }
          eid[i] = (id >= 0 && id < E) ? static_cast<int32_t>(id) : -1;
        }
      }
    });
  };
  switch (routing.scalar_type()) {
    case at::kBool: fill(routing.data_ptr<bool>()); break;
    case at::kInt: fill(routing.data_ptr<int32_t>()); break;
    case at::kLong: fill(routing.data_ptr<int64_t>()); break;
    default: TORCH_INTERNAL_ASSERT(false, "moe_permute: routing dtype ", routing.scalar_type());  // checked at the op
  }
  return eid;
}

// Prob of every slot as fp32 (the reference ranks by probs.float()).
std::vector<float> slot_probs_f32(const Tensor& probs) {
  Tensor p = probs.to(at::kFloat).contiguous();
  const float* src = p.data_ptr<float>();
  return std::vector<float>(src, src + p.numel());
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> moe_permute_cpu(
    const Tensor& tokens_in, const Tensor& routing_in, const c10::optional<Tensor>& probs_opt,
    int64_t num_experts, std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> num_out_tokens) {
  // The op's check (common/moe_permute_checks.h: amo::checks::moe_permute) ran first: the kernel is reached
  // only through moe_permute_op below.
  const bool has_probs = probs_opt.has_value() && probs_opt->defined();
  // Non-contiguous inputs are copied, never misread.
  const Tensor tokens = tokens_in.contiguous();
  const Tensor routing = routing_in.contiguous();
  const Tensor probs = has_probs ? probs_opt->contiguous() : Tensor();

  const int64_t T = tokens.size(0), H = tokens.size(1);
  const int64_t S = routing.size(1);
  const int64_t E = num_experts;
  const int64_t n_slots = T * S;
  const int64_t N = amo::checks::moe_permute_rows(T, S, E, capacity, align, num_out_tokens);

  Tensor out = amo::empty_large({N, H}, tokens.options());
  Tensor out_probs = has_probs ? at::zeros({N}, probs.options()) : at::empty({0}, tokens.options().dtype(at::kFloat));
  Tensor row_id_map = at::empty({T, S}, routing.options().dtype(at::kInt));
  Tensor tokens_per_expert = at::zeros({E}, routing.options().dtype(at::kLong));
  Tensor group_sizes = at::zeros({E}, routing.options().dtype(at::kLong));
  int32_t* map = row_id_map.data_ptr<int32_t>();
  int64_t* tpe = tokens_per_expert.data_ptr<int64_t>();
  int64_t* gsz = group_sizes.data_ptr<int64_t>();

  // ---- 1. map --------------------------------------------------------------------------------
  const std::vector<int32_t> eid = slot_experts(routing, E);

  // Token chunks: a fixed count independent of the thread count (results never depend on it).
  const int64_t n_chunks = std::max<int64_t>(1, std::min<int64_t>(T, 64));
  const int64_t chunk_tokens = T > 0 ? (T + n_chunks - 1) / n_chunks : 0;
  const int64_t chunk_grain = n_slots >= kSerialSlots ? 1 : n_chunks;  // inline when small
  std::vector<int64_t> hist(static_cast<size_t>(n_chunks * (E + 1)), 0);  // [chunk][E] counts
  // fn(hist row of chunk c, first slot, end slot) for every chunk c, in parallel when large
  auto for_each_chunk = [&](auto fn) {
    at::parallel_for(0, n_chunks, chunk_grain, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c)
        fn(hist.data() + c * (E + 1), std::min(T, c * chunk_tokens) * S, std::min(T, (c + 1) * chunk_tokens) * S);
    });
  };
  // hist[c][e] := first[e] + the slots of expert e in chunks before c (where chunk c's slots of
  // expert e go, in order)
  auto chunk_starts = [&](const std::vector<int64_t>& first) {
    for (int64_t e = 0; e < E; ++e) {
      int64_t run = first[e];
      for (int64_t c = 0; c < n_chunks; ++c) {
        int64_t& h = hist[c * (E + 1) + e];
        const int64_t k = h;
        h = run;
        run += k;
      }
    }
  };
  for_each_chunk([&](int64_t* h, int64_t s0, int64_t s1) {
    for (int64_t i = s0; i < s1; ++i)
      if (eid[i] >= 0) ++h[eid[i]];
  });
  std::vector<int64_t> count(E, 0);  // routed (pre-capacity) slots per expert
  for (int64_t c = 0; c < n_chunks; ++c)
    for (int64_t e = 0; e < E; ++e) count[e] += hist[c * (E + 1) + e];

  std::vector<int64_t> start(E + 1, 0);  // first row of each expert group
  std::vector<uint8_t> filled(static_cast<size_t>(N), 0);

  if (!capacity) {
    // Dropless: group e holds its kept slots, padded to a multiple of align. With num_out_tokens = n
    // only the first n routed slots in (expert, position) order are kept (the reference's rule):
    // expert e keeps what is left of n after the experts before it.
    int64_t before = 0;
    for (int64_t e = 0; e < E; ++e) {
      tpe[e] = num_out_tokens ? std::clamp<int64_t>(*num_out_tokens - before, 0, count[e]) : count[e];
      before += count[e];
      gsz[e] = (tpe[e] + align - 1) / align * align;
      start[e + 1] = start[e] + gsz[e];
    }
    chunk_starts(start);  // hist[c][e] := first destination row of chunk c's slots of expert e
    for_each_chunk([&](int64_t* next, int64_t s0, int64_t s1) {
      for (int64_t i = s0; i < s1; ++i) {
        const int32_t e = eid[i];
        if (e < 0) {
          map[i] = -1;
          continue;
        }
        const int64_t d = next[e]++;
        if (d - start[e] < tpe[e]) {
          map[i] = static_cast<int32_t>(d);
          filled[d] = 1;
        } else {
          map[i] = -1;  // past num_out_tokens
        }
      }
    });
  } else {
    // Capacity: counting sort of the slots into (expert, position) order, then per expert keep the
    // `capacity` best by (prob desc, position asc); kept slots get rows in position order.
    const int64_t C = *capacity;
    std::vector<int64_t> base(E + 1, 0);
    for (int64_t e = 0; e < E; ++e) base[e + 1] = base[e] + count[e];
    chunk_starts(base);  // hist[c][e] := where chunk c's slots of expert e go in `sorted`
    std::vector<int32_t> sorted(static_cast<size_t>(base[E]));
    for_each_chunk([&](int64_t* next, int64_t s0, int64_t s1) {
      for (int64_t i = s0; i < s1; ++i) {
        map[i] = -1;
        if (eid[i] >= 0) sorted[next[eid[i]]++] = static_cast<int32_t>(i);
      }
    });
    std::vector<float> key;
    if (has_probs) key = slot_probs_f32(probs);
    // a before b: higher prob first (NaN ranks last, as in torch.sort), then earlier position.
    auto better = [&](int32_t a, int32_t b) {
      const float ka = key[a], kb = key[b];
      const bool na = std::isnan(ka), nb = std::isnan(kb);
      if (na != nb) return nb;
      if (!na && ka != kb) return ka > kb;
      return a < b;
    };
    at::parallel_for(0, E, n_slots >= kSerialSlots ? 1 : std::max<int64_t>(E, 1), [&](int64_t eb, int64_t ee) {
      std::vector<int32_t> pick;
      std::vector<uint8_t> keep;
      for (int64_t e = eb; e < ee; ++e) {
        const int32_t* L = sorted.data() + base[e];
        const int64_t n = count[e];
        const int64_t kept = std::min(n, C);
        tpe[e] = kept;
        gsz[e] = C;
        if (n <= C || !has_probs) {
          // keep the first `kept` in position order
          for (int64_t r = 0; r < kept; ++r) {
            map[L[r]] = static_cast<int32_t>(e * C + r);
            filled[e * C + r] = 1;
          }
          continue;
        }
        pick.assign(L, L + n);
        keep.assign(static_cast<size_t>(n), 0);
        if (kept > 0) {
          std::nth_element(pick.begin(), pick.begin() + (kept - 1), pick.end(), better);
          const int32_t last = pick[kept - 1];  // the kept-th best slot: keep it and every better one
          for (int64_t j = 0; j < n; ++j) keep[j] = (L[j] == last || better(L[j], last)) ? 1 : 0;
        }
        int64_t r = 0;
        for (int64_t j = 0; j < n; ++j) {
          if (!keep[j]) continue;
          map[L[j]] = static_cast<int32_t>(e * C + r);
          filled[e * C + r] = 1;
          ++r;
        }
      }
    });
  }

  // ---- 2. copy rows ----
  const int64_t row_bytes = H * static_cast<int64_t>(tokens.element_size());
  const bool stream = N * row_bytes >= amo::vec::kStreamBytes;
  const char* src = static_cast<const char*>(tokens.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const char* psrc = has_probs ? static_cast<const char*>(probs.data_ptr()) : nullptr;
  char* pdst = has_probs ? static_cast<char*>(out_probs.data_ptr()) : nullptr;
  const int64_t pbytes = has_probs ? static_cast<int64_t>(probs.element_size()) : 0;
  // Small problems run on the calling thread: waking the OpenMP team costs more than the whole copy
  // when the cores are shared (see kSerialCopyBytes).
  const bool serial = N * row_bytes < kSerialCopyBytes;
  if ((row_bytes > 0 || has_probs) && serial && T * row_bytes <= kGatherTokenBytes) {
    // Destination order: the token rows stay in cache, and the output is written front to back
    // (measured here at T=256, H=1024, K=8, bf16: faster than the token-order scatter below).
    std::vector<int64_t> src_slot(static_cast<size_t>(N), -1);
    for (int64_t i = 0; i < n_slots; ++i)
      if (map[i] >= 0) src_slot[map[i]] = i;
    for (int64_t d = 0; d < N; ++d) {
      const int64_t i = src_slot[d];
      if (i < 0) continue;
      if (row_bytes > 0) std::memcpy(dst + d * row_bytes, src + (i / S) * row_bytes, row_bytes);
      if (has_probs) std::memcpy(pdst + d * pbytes, psrc + i * pbytes, pbytes);
    }
  } else if (row_bytes > 0 || has_probs) {
    // Token order, parallel over source tokens: each token row is read from memory once.
    const int64_t grain = serial ? std::max<int64_t>(T, 1)
                                 : std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, row_bytes * S));
    at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) {
      for (int64_t t = tb; t < te; ++t) {
        for (int64_t s = 0; s < S; ++s) {
          const int64_t i = t * S + s;
          const int64_t d = map[i];
          if (d < 0) continue;
          if (row_bytes > 0) amo::vec::copy_bytes(dst + d * row_bytes, src + t * row_bytes, row_bytes, stream);
          if (has_probs) std::memcpy(pdst + d * pbytes, psrc + i * pbytes, pbytes);
        }
      }
      if (stream) amo::vec::sfence();
    });
  }

  // ---- 3. zero the rows no slot filled (padding, unused tail) ----
  if (row_bytes > 0) amo::zero_rows(dst, filled, row_bytes, stream);
  return std::make_tuple(out, out_probs, row_id_map, tokens_per_expert, group_sizes);
}

}  // namespace

// ---- dispatcher kernel: the op-boundary check (common/moe_permute_checks.h), then the kernel ----
namespace {
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_permute_op(
    const at::Tensor& tokens, const at::Tensor& routing, const c10::optional<at::Tensor>& probs, int64_t num_experts,
    std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> num_out_tokens) {
  amo::checks::moe_permute(tokens, routing, probs, num_experts, capacity, align, num_out_tokens);
  return moe_permute_cpu(tokens, routing, probs, num_experts, capacity, align, num_out_tokens);
}
}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(moe_permute, moe_permute_op)
AMO_OP_CONTRACT(moe_permute)
