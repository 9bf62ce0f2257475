// Native CPU kernels of two internal ops of the Megatron-Core adapter
// (ascend_moe_ops/integrations/megatron.py); specs: ascend_moe_ops/reference/megatron_paths.py.
//
// mask_permute: Megatron-Core's dropless permute of a [T, E] bool routing mask in one call: the
//   mask compaction (expert ids of each token), the expert-major stable row order, the permuted
//   token rows, the permuted probs and Megatron's sorted_indices. The mask is read once, 8 columns
//   per multiply (bytes 0/1 -> bits), and the routed experts of a row are then visited by
//   count-trailing-zeros: no per-column branch (at T=256, E=64 a branch per column of a random
//   mask costs more than the rest of the map). The rows are copied as in moe_permute.cpp.
// sort_chunks: Megatron-Core's sort_chunks_by_idxs: the input split into row chunks of
//   split_sizes, concatenated in the order sorted_idxs (a permutation of the chunks): one memcpy per
//   chunk. inverse=true undoes it (the backward).
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "common/alloc.h"
#include "common/op_registry.h"
#include "common/vec.h"

namespace {

using at::Tensor;

// Output bytes below which the row copy runs on the calling thread. Was 8 MiB (tuned on a loaded
// shared machine, where waking a second thread cost more than the copy); on a quiet 2-core machine
// the T=256 Megatron paths (4 MiB of rows) were 0.79-1.61x Megatron-Core's on one thread and
// 1.15-4.4x on two (2026-12-02, docs/benchmarks.md).
constexpr int64_t kSerialCopyBytes = int64_t(1) << 20;
// ... and token matrices up to this size are gathered in destination-row order (they stay in L2).
constexpr int64_t kGatherTokenBytes = int64_t(1) << 20;

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// 8 bytes that are each 0 or 1 -> 8 bits (byte i -> bit i).
inline uint64_t pack8(const uint8_t* p) {
  uint64_t x;
  std::memcpy(&x, p, 8);
  return (x * 0x0102040810204080ULL) >> 56;
}

// Bits of `n` <= 64 mask bytes.
inline uint64_t pack_bits(const uint8_t* p, int64_t n) {
  uint64_t bits = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) bits |= pack8(p + i) << i;
  for (; i < n; ++i) bits |= static_cast<uint64_t>(p[i] != 0) << i;
  return bits;
}

inline void copy_elem(char* dst, const char* src, int64_t bytes) {
  switch (bytes) {
    case 2: std::memcpy(dst, src, 2); break;
    case 4: std::memcpy(dst, src, 4); break;
    case 8: std::memcpy(dst, src, 8); break;
    default: std::memcpy(dst, src, static_cast<size_t>(bytes));
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> mask_permute_cpu(
    const Tensor& tokens_in, const Tensor& routing_map_in, const c10::optional<Tensor>& probs_opt,
    std::optional<int64_t> num_out_tokens) {
  constexpr const char* op = "mask_permute";
  TORCH_CHECK_VALUE(tokens_in.device().is_cpu(), op, ": tokens must be a CPU tensor, got ", tokens_in.device());
  TORCH_CHECK_VALUE(tokens_in.dim() == 2, op, ": tokens must be 2-D [T, H], got shape ", tokens_in.sizes());
  TORCH_CHECK_TYPE(is_float_dtype(tokens_in.scalar_type()), op,
                   ": tokens must have dtype in (float32, float16, bfloat16, float64), got ", tokens_in.scalar_type());
  TORCH_CHECK_VALUE(routing_map_in.device().is_cpu(), op, ": routing_map is on ", routing_map_in.device(),
                    " but tokens is on cpu");
  TORCH_CHECK_TYPE(routing_map_in.scalar_type() == at::kBool, op, ": routing_map must have dtype bool, got ",
                   routing_map_in.scalar_type());
  TORCH_CHECK_VALUE(routing_map_in.dim() == 2, op, ": routing_map must be 2-D [T, E], got shape ",
                    routing_map_in.sizes());
  TORCH_CHECK_VALUE(routing_map_in.size(0) == tokens_in.size(0), op,
                    ": routing_map must have one row per token: tokens has ", tokens_in.size(0),
                    " rows, routing_map has shape ", routing_map_in.sizes());
  const bool has_probs = probs_opt.has_value() && probs_opt->defined();
  if (has_probs) {
    const Tensor& p = *probs_opt;
    TORCH_CHECK_VALUE(p.device().is_cpu(), op, ": probs is on ", p.device(), " but tokens is on cpu");
    TORCH_CHECK_TYPE(is_float_dtype(p.scalar_type()), op,
                     ": probs must have dtype in (float32, float16, bfloat16, float64), got ", p.scalar_type());
    TORCH_CHECK_VALUE(p.sizes() == routing_map_in.sizes(), op, ": probs must have shape ",
                      routing_map_in.sizes(), " (the shape of routing_map), got ", p.sizes());
  }
  if (num_out_tokens.has_value())
    TORCH_CHECK_VALUE(*num_out_tokens >= 0, op, ": num_out_tokens must be >= 0, got ", *num_out_tokens);

  const Tensor tokens = tokens_in.contiguous();
  const Tensor mask = routing_map_in.contiguous();
  const Tensor probs = has_probs ? probs_opt->contiguous() : Tensor();
  const int64_t T = tokens.size(0), H = tokens.size(1), E = mask.size(1);
  TORCH_CHECK_VALUE(T * E <= std::numeric_limits<int32_t>::max(), op, ": routing_map has ", T * E,
                    " entries; the row map is int32, so it must have < 2^31");

  // ---- 1. the routed experts of each token as bit words; counts per token and per expert ----
  const int64_t W = (E + 63) / 64;
  const uint8_t* m = reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>());
  std::vector<uint64_t> bits(static_cast<size_t>(T * W));
  std::vector<int64_t> count(static_cast<size_t>(E) + 1, 0);
  int64_t S = 0, N = 0;
  for (int64_t t = 0; t < T; ++t) {
    int64_t c = 0;
    for (int64_t w = 0; w < W; ++w) {
      uint64_t b = pack_bits(m + t * E + w * 64, std::min<int64_t>(64, E - w * 64));
      bits[t * W + w] = b;
      c += __builtin_popcountll(b);
      while (b) {
        ++count[w * 64 + __builtin_ctzll(b)];
        b &= b - 1;
      }
    }
    S = std::max(S, c);
    N += c;
  }
  TORCH_CHECK_VALUE(!num_out_tokens.has_value() || *num_out_tokens == N, op, ": num_out_tokens=",
                    num_out_tokens.value_or(0), " must equal the ", N,
                    " routed slots of routing_map (Megatron's unfused path returns exactly them)");

  // ---- 2. rows: expert-major, token order inside an expert ----
  Tensor out = amo::empty_large({N, H}, tokens.options());
  Tensor out_probs = has_probs ? at::empty({N}, probs.options()) : at::empty({0}, tokens.options().dtype(at::kFloat));
  Tensor sorted_indices = at::empty({N}, tokens.options().dtype(at::kLong));
  Tensor row_id_map = at::empty({T, S}, tokens.options().dtype(at::kInt));
  Tensor expert_ids = at::empty({T, S}, tokens.options().dtype(at::kLong));
  int64_t* si = sorted_indices.data_ptr<int64_t>();
  int32_t* map = row_id_map.data_ptr<int32_t>();
  int64_t* ids = expert_ids.data_ptr<int64_t>();
  std::vector<int64_t> next(static_cast<size_t>(E) + 1, 0);
  for (int64_t e = 0, run = 0; e < E; ++e) {
    next[e] = run;
    run += count[e];
  }
  const char* psrc = has_probs ? static_cast<const char*>(probs.data_ptr()) : nullptr;
  char* pdst = has_probs ? static_cast<char*>(out_probs.data_ptr()) : nullptr;
  const int64_t pbytes = has_probs ? static_cast<int64_t>(probs.element_size()) : 0;
  for (int64_t t = 0; t < T; ++t) {
    int64_t s = t * S;
    for (int64_t w = 0; w < W; ++w) {
      uint64_t b = bits[t * W + w];
      while (b) {
        const int64_t e = w * 64 + __builtin_ctzll(b);
        b &= b - 1;
        const int64_t d = next[e]++;
        map[s] = static_cast<int32_t>(d);
        ids[s] = e;
        si[d] = t;
        if (has_probs) copy_elem(pdst + d * pbytes, psrc + (t * E + e) * pbytes, pbytes);
        ++s;
      }
    }
    for (; s < (t + 1) * S; ++s) {
      map[s] = -1;
      ids[s] = -1;
    }
  }

  // ---- 3. copy the token rows ----
  const int64_t row_bytes = H * static_cast<int64_t>(tokens.element_size());
  if (row_bytes > 0 && N > 0) {
    const char* src = static_cast<const char*>(tokens.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    const bool serial = N * row_bytes < kSerialCopyBytes;
    if (serial && T * row_bytes <= kGatherTokenBytes) {
      for (int64_t d = 0; d < N; ++d) std::memcpy(dst + d * row_bytes, src + si[d] * row_bytes, row_bytes);
    } else {
      // token order, parallel over tokens: each token row is read from memory once
      const bool stream = N * row_bytes >= amo::vec::kStreamBytes;
      const int64_t grain = serial ? std::max<int64_t>(T, 1)
                                   : std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, row_bytes * S));
      at::parallel_for(0, T, grain, [&](int64_t tb, int64_t te) {
        for (int64_t t = tb; t < te; ++t)
          for (int64_t s = 0; s < S; ++s) {
            const int64_t d = map[t * S + s];
            if (d < 0) break;  // the -1 slots are at the end of the token's row
            amo::vec::copy_bytes(dst + d * row_bytes, src + t * row_bytes, row_bytes, stream);
          }
        if (stream) amo::vec::sfence();
      });
    }
  }
  return std::make_tuple(out, out_probs, sorted_indices, row_id_map, expert_ids);
}

// The chunk sizes and order as int64 host vectors (checked: sizes >= 0, sum == rows, order a
// permutation of the chunks). The messages print the values as c10::IntArrayRef does, "[2, 0, 1]":
// the reference's messages show the Python list so.
void chunk_plan(const char* op, const Tensor& split_sizes, const Tensor& sorted_idxs, int64_t rows,
                std::vector<int64_t>& sizes, std::vector<int64_t>& order) {
  auto read = [&](const char* name, const Tensor& t, std::vector<int64_t>& v) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong || t.scalar_type() == at::kInt, op, ": ", name,
                     " must have dtype in (int32, int64), got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, op, ": ", name, " must be 1-D, got shape ", t.sizes());
    const Tensor c = t.contiguous();
    v.resize(static_cast<size_t>(c.numel()));
    if (c.scalar_type() == at::kLong) {
      const int64_t* p = c.data_ptr<int64_t>();
      std::copy(p, p + c.numel(), v.begin());
    } else {
      const int32_t* p = c.data_ptr<int32_t>();
      std::copy(p, p + c.numel(), v.begin());
    }
  };
  read("split_sizes", split_sizes, sizes);
  read("sorted_idxs", sorted_idxs, order);
  const int64_t n = static_cast<int64_t>(sizes.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(order.size()) == n, op, ": sorted_idxs must have one entry per chunk (", n,
                    "), got ", order.size());
  // Each size is bounded by the row count before it is added, and the running sum by the row count
  // too: no int64 overflow (sizes of 2^63 - 1 summed to `rows` modulo 2^64 and reached the copy).
  int64_t total = 0;
  for (int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0 && s <= rows - total, op, ": split_sizes must add up to the ", rows,
                      " rows of input (none negative), got ", c10::IntArrayRef(sizes));
    total += s;
  }
  TORCH_CHECK_VALUE(total == rows, op, ": split_sizes must add up to the ", rows, " rows of input (none negative), got ",
                    c10::IntArrayRef(sizes));
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (int64_t j : order) {
    TORCH_CHECK_VALUE(j >= 0 && j < n && !seen[j], op, ": sorted_idxs must be a permutation of the ", n,
                      " chunks, got ", c10::IntArrayRef(order));
    seen[j] = 1;
  }
}

// Copy the chunks of `src` ([rows, row_bytes] bytes) into `dst` in the chunk order (or back).
void copy_chunks(char* dst, const char* src, int64_t row_bytes, const std::vector<int64_t>& sizes,
                 const std::vector<int64_t>& order, bool inverse) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  if (row_bytes == 0 || n == 0) return;
  std::vector<int64_t> start(static_cast<size_t>(n), 0);
  for (int64_t i = 1; i < n; ++i) start[i] = start[i - 1] + sizes[i - 1];
  // (dst row, src row, rows) of each chunk in the order of `order`
  std::vector<int64_t> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
  int64_t run = 0, total = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int64_t c = order[j];
    a[j] = inverse ? start[c] : run;
    b[j] = inverse ? run : start[c];
    run += sizes[c];
  }
  total = run;
  const int64_t bytes = total * row_bytes;
  const bool stream = bytes >= amo::vec::kStreamBytes;
  const int64_t grain = bytes < kSerialCopyBytes ? n : 1;
  at::parallel_for(0, n, grain, [&](int64_t jb, int64_t je) {
    for (int64_t j = jb; j < je; ++j) {
      const int64_t c = order[j];
      amo::vec::copy_bytes(dst + a[j] * row_bytes, src + b[j] * row_bytes, sizes[c] * row_bytes, stream);
    }
    if (stream) amo::vec::sfence();
  });
}

std::tuple<Tensor, Tensor> sort_chunks_cpu(const Tensor& input_in, const Tensor& split_sizes,
                                           const Tensor& sorted_idxs, const c10::optional<Tensor>& probs_opt,
                                           bool inverse) {
  constexpr const char* op = "sort_chunks";
  TORCH_CHECK_VALUE(input_in.device().is_cpu(), op, ": input must be a CPU tensor, got ", input_in.device());
  TORCH_CHECK_VALUE(input_in.dim() >= 1, op, ": input must have at least one dimension");
  const int64_t rows = input_in.size(0);
  const bool has_probs = probs_opt.has_value() && probs_opt->defined();
  if (has_probs) {
    const Tensor& p = *probs_opt;
    TORCH_CHECK_VALUE(p.device().is_cpu(), op, ": probs is on ", p.device(), " but input is on cpu");
    TORCH_CHECK_VALUE(p.dim() >= 1 && p.size(0) == rows, op, ": probs must have one entry per row of input (", rows,
                      "), got shape ", p.sizes());
  }
  std::vector<int64_t> sizes, order;
  chunk_plan(op, split_sizes, sorted_idxs, rows, sizes, order);
  const Tensor input = input_in.contiguous();
  Tensor out = amo::empty_large(input.sizes(), input.options());
  const int64_t row_bytes = rows ? input.numel() / rows * static_cast<int64_t>(input.element_size()) : 0;
  copy_chunks(static_cast<char*>(out.data_ptr()), static_cast<const char*>(input.data_ptr()), row_bytes, sizes, order,
              inverse);
  Tensor out_probs;
  if (has_probs) {
    const Tensor p = probs_opt->contiguous();
    out_probs = at::empty(p.sizes(), p.options());
    const int64_t pb = rows ? p.numel() / rows * static_cast<int64_t>(p.element_size()) : 0;
    copy_chunks(static_cast<char*>(out_probs.data_ptr()), static_cast<const char*>(p.data_ptr()), pb, sizes, order,
                inverse);
  } else {
    out_probs = at::empty({0}, input.options().dtype(at::kFloat));
  }
  return std::make_tuple(out, out_probs);
}

}  // namespace

// Registered from the op list (common/op_list.h, common/op_registry.h).
AMO_CPU_KERNEL(mask_permute, mask_permute_cpu)
AMO_CPU_KERNEL(sort_chunks, sort_chunks_cpu)
