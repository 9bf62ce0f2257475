// The op contracts of ascend_moe_ops, checked once at the op boundary of the C++ backends.
//
// Every C++ kernel registered with the dispatcher (csrc/cpu: namespace ascend_moe_ops_native and,
// when bound, ascend_moe_ops; csrc/ascend/emu_bindings.cpp: ascend_moe_ops_emu) calls the check of its
// op first, so a direct torch.ops.<namespace>.<op> call is validated exactly like a call through the
// Python wrapper. The Python backends (reference, triton) run the twin of each check, written in
// ascend_moe_ops/ops/_contracts.py with the same messages. Kernels only assert internal invariants.
//
// Errors: a wrong dtype (the backward ops' lse too) raises TypeError (TORCH_CHECK_TYPE); a wrong shape, device, size or value
// raises ValueError (TORCH_CHECK_VALUE). Every message starts with the op and names the argument.
// Sizes are checked for overflow BEFORE anything is allocated.
//
// No host synchronization: values are read here only for host (CPU) tensors. For device tensors
// (the NPU glue) a value check is a device-side assert (at::_assert_async, the twin of the Python
// side's torch._assert_async, with the same message): nothing is copied to the host, the launch
// is not delayed, and a bad value fails the stream asynchronously. tests/test_op_contracts.py runs
// these checks on device-like tensors that fail on any host copy.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace amo {
namespace checks {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

// row_id_map is int32: every row index must fit.
constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
// num_experts bound for id routing (the count outputs are [E] int64; 2^20 covers the
// million-expert designs); a mask routing carries its own E in its shape.
constexpr int64_t kMaxExperts = int64_t(1) << 20;

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

// Python tuple spelling, so the C++ and Python messages read the same: (4,), (2, 3), ()
inline std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "(";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  if (s.size() == 1) o << ",";
  o << ")";
  return o.str();
}

inline std::string dtypes_str(std::initializer_list<at::ScalarType> ok) {
  std::string names;
  for (auto t : ok) names += (names.empty() ? "" : ", ") + dtype_name(t);
  return names;
}

constexpr std::initializer_list<at::ScalarType> kFloatTypes = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble};
constexpr std::initializer_list<at::ScalarType> kIndexTypes = {at::kInt, at::kLong};

inline void dtype_in(const char* op, const char* name, const Tensor& t, std::initializer_list<at::ScalarType> ok) {
  bool found = false;
  for (auto d : ok) found = found || t.scalar_type() == d;
  TORCH_CHECK_TYPE(found, op, ": ", name, " must have dtype in (", dtypes_str(ok), "), got ", dtype_name(t.scalar_type()));
}

inline void same_dtype(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype in (",
                   dtype_name(like.scalar_type()), "), got ", dtype_name(t.scalar_type()));
}

inline void ndim(const char* op, const char* name, const Tensor& t, int64_t d, const char* layout) {
  TORCH_CHECK_VALUE(t.dim() == d, op, ": ", name, " must be ", d, "-D ", layout, ", got shape ", shape_str(t.sizes()));
}

inline void same_device(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  TORCH_CHECK_VALUE(t.device() == like.device(), op, ": ", name, " is on ", t.device(), " but the other inputs are on ",
                    like.device());
}

inline void shape_is(const char* op, const char* name, const Tensor& t, at::IntArrayRef expected, const char* what) {
  TORCH_CHECK_VALUE(t.sizes() == expected, op, ": ", name, " must have shape ", shape_str(expected), " (", what, "), got ",
                    shape_str(t.sizes()));
}

// A tensor of 2 floats/ints, a 2-D float tensor on `like`'s device, ... : the common first checks.
inline void float_tensor(const char* op, const char* name, const Tensor& t, int64_t d, const char* layout) {
  ndim(op, name, t, d, layout);
  dtype_in(op, name, t, kFloatTypes);
}

inline void like_tensor(const char* op, const char* name, const Tensor& t, const Tensor& like, int64_t d,
                        const char* layout) {
  ndim(op, name, t, d, layout);
  same_dtype(op, name, t, like);
  same_device(op, name, t, like);
}

// Position of flat index i in a tensor of shape s, spelled as a Python tuple.
inline std::string where_str(int64_t i, at::IntArrayRef s) {
  std::vector<int64_t> where(s.size());
  for (int64_t d = static_cast<int64_t>(s.size()) - 1; d >= 0; --d) {
    where[d] = i % s[d];
    i /= s[d];
  }
  return shape_str(where);
}

// A device-side assert that `ok` (a 0-d bool tensor on the device) holds: no host synchronization.
inline void assert_async(const Tensor& ok, const std::string& msg) { at::_assert_async(ok, msg); }

// All values of an index tensor in [low, high): the first one outside is reported with its position
// (host tensors); a device-side assert for device tensors.
inline void index_range(const char* op, const char* name, const Tensor& idx, int64_t low, int64_t high) {
  if (idx.numel() == 0) return;
  if (!idx.device().is_cpu()) {
    std::ostringstream m;
    m << op << ": " << name << " has values outside [" << low << ", " << high << ")";
    assert_async(at::logical_or(idx < low, idx >= high).any().logical_not(), m.str());
    return;
  }
  const Tensor v = idx.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  const int64_t n = v.numel();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(p[i] >= low && p[i] < high, op, ": ", name, " has value ", p[i], " at index ",
                      where_str(i, v.sizes()), ", outside the valid range [", low, ", ", high, ")");
}

// Every row in [0, num_rows) referenced by at most one slot of `rows` (a row map from moe_permute never
// repeats a row; a repeated one makes the backward's scatter ill-defined). Run after index_range. Host
// tensors: the first slot (in flat order) whose row an earlier slot already references is reported,
// with that earlier slot; device tensors: per-row counts and a device-side assert. O(T*K + N) time,
// N bits (host) or N ints (device) of memory: less than the [N, H] rows themselves.
inline void unique_rows(const char* op, const char* name, const Tensor& rows, int64_t num_rows) {
  if (rows.numel() < 2 || num_rows == 0) return;
  const std::string tail = "; each row may be referenced at most once (the map moe_permute returns)";
  if (!rows.device().is_cpu()) {
    const Tensor flat = rows.reshape({-1}).to(at::kLong);
    // slots not kept (and rows out of range: the range assert does not stop the host) go to a spare bin
    const Tensor bins = at::where(at::logical_and(flat >= 0, flat < num_rows), flat, num_rows);
    const Tensor counts = at::zeros({num_rows + 1}, flat.options().dtype(at::kInt))
                              .scatter_add_(0, bins, at::ones_like(bins, bins.options().dtype(at::kInt)));
    assert_async((counts.slice(0, 0, num_rows) <= 1).all(),
                 std::string(op) + ": " + name + " refers to a row from more than one slot" + tail);
    return;
  }
  const Tensor v = rows.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  std::vector<bool> seen(static_cast<size_t>(num_rows), false);
  for (int64_t i = 0; i < v.numel(); ++i) {
    if (p[i] < 0) continue;
    if (seen[p[i]]) {
      int64_t first = 0;
      while (p[first] != p[i]) ++first;
      TORCH_CHECK_VALUE(false, op, ": ", name, " refers to row ", p[i], " from more than one slot, at ",
                        where_str(first, v.sizes()), " and ", where_str(i, v.sizes()), tail);
    }
    seen[p[i]] = true;
  }
}

// ---------------------------------------------------------------------------------------- moe_permute
// The output row count N of moe_permute, from shapes alone: the one C++ definition, used by the check
// below, the native kernel and the AscendC glue (the Python one: ops/_contracts.py::output_rows). T*S
// slots, E experts, capacity / num_out_tokens as the op takes them (nullopt = not given); the
// arguments must have passed moe_permute's checks (which bound every product below).
inline int64_t moe_permute_rows(int64_t T, int64_t S, int64_t E, std::optional<int64_t> capacity, int64_t align,
                                std::optional<int64_t> num_out_tokens) {
  if (capacity.has_value()) return E * *capacity;
  return num_out_tokens.value_or(T * S) + E * (align - 1);
}

// Returns the output row count N (moe_permute_rows). num_out_tokens below the routed slot count is
// valid (the first rows in expert order are kept), so nothing here reads the routing data for it.
inline int64_t moe_permute(const Tensor& tokens, const Tensor& routing, const OptTensor& probs, int64_t num_experts,
                           std::optional<int64_t> capacity, int64_t align, std::optional<int64_t> num_out_tokens) {
  constexpr const char* op = "moe_permute";
  float_tensor(op, "tokens", tokens, 2, "[T, H]");
  ndim(op, "routing", routing, 2, "[T, K] (expert ids) or [T, E] (bool mask)");
  dtype_in(op, "routing", routing, {at::kBool, at::kInt, at::kLong});
  same_device(op, "routing", routing, tokens);
  TORCH_CHECK_VALUE(routing.size(0) == tokens.size(0), op, ": routing must have one row per token: tokens has ",
                    tokens.size(0), " rows, routing has shape ", shape_str(routing.sizes()));
  const bool mask = routing.scalar_type() == at::kBool;
  TORCH_CHECK_VALUE(num_experts >= 1, op, ": num_experts must be >= 1, got ", num_experts);
  if (mask) {
    TORCH_CHECK_VALUE(num_experts == routing.size(1), op, ": num_experts=", num_experts,
                      " does not match the routing mask's ", routing.size(1), " columns");
  } else {
    TORCH_CHECK_VALUE(num_experts <= kMaxExperts, op, ": num_experts=", num_experts,
                      " exceeds the supported maximum of 2^20 experts");
  }
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, tokens);
    shape_is(op, "probs", *probs, routing.sizes(), "the shape of routing");
  }
  TORCH_CHECK_VALUE(align >= 1, op, ": align must be >= 1, got ", align);
  const int64_t T = routing.size(0), S = routing.size(1), slots = T * S;
  TORCH_CHECK_VALUE(slots <= kMaxRows, op, ": routing has T*K = ", slots,
                    " slots; row_id_map is int32, so at most 2^31-1 are supported");
  if (capacity.has_value()) {
    const int64_t C = *capacity;
    TORCH_CHECK_VALUE(C >= 1, op, ": capacity must be >= 1, got ", C);
    TORCH_CHECK_VALUE(C % align == 0, op, ": align=", align, " must divide capacity=", C);
    TORCH_CHECK_VALUE(!num_out_tokens.has_value(), op,
                      ": num_out_tokens cannot be combined with capacity (the output has exactly num_experts * "
                      "capacity rows)");
    int64_t rows = 0;
    const bool overflow = c10::mul_overflows(num_experts, C, &rows);
    TORCH_CHECK_VALUE(!overflow && rows <= kMaxRows, op, ": capacity=", C, " is too large: num_experts * capacity = ",
                      num_experts, " * ", C, " rows exceeds 2^31-1 (row_id_map is int32)");
  } else {
    int64_t base = slots;
    if (num_out_tokens.has_value()) {
      base = *num_out_tokens;
      TORCH_CHECK_VALUE(base >= 0, op, ": num_out_tokens must be >= 0, got ", base);
      TORCH_CHECK_VALUE(base <= kMaxRows, op, ": num_out_tokens=", base,
                        " exceeds 2^31-1 rows (row_id_map is int32)");
    }
    int64_t pad = 0;
    const bool overflow = c10::mul_overflows(num_experts, align - 1, &pad);
    TORCH_CHECK_VALUE(!overflow && pad <= kMaxRows - base, op, ": align=", align,
                      " is too large: the output would have ", base, " + num_experts * (align - 1) rows, more than "
                      "2^31-1 (row_id_map is int32)");
  }
  if (!mask) index_range(op, "routing (expert ids)", routing, -1, num_experts);
  return moe_permute_rows(T, S, num_experts, capacity, align, num_out_tokens);
}

// -------------------------------------------------------------------------------------- moe_unpermute
inline void moe_unpermute(const Tensor& permuted, const Tensor& row_id_map, const OptTensor& probs) {
  constexpr const char* op = "moe_unpermute";
  float_tensor(op, "permuted", permuted, 2, "[N, H]");
  ndim(op, "row_id_map", row_id_map, 2, "[T, K]");
  dtype_in(op, "row_id_map", row_id_map, kIndexTypes);
  same_device(op, "row_id_map", row_id_map, permuted);
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, permuted);
    shape_is(op, "probs", *probs, row_id_map.sizes(), "the shape of row_id_map");
  }
  index_range(op, "row_id_map", row_id_map, -1, permuted.size(0));
  unique_rows(op, "row_id_map", row_id_map, permuted.size(0));
}

inline void moe_unpermute_backward(const Tensor& grad_out, const Tensor& permuted, const Tensor& row_id_map,
                                   const OptTensor& probs) {
  constexpr const char* op = "moe_unpermute_backward";
  float_tensor(op, "grad_out", grad_out, 2, "[T, H]");
  float_tensor(op, "permuted", permuted, 2, "[N, H] (or an [N, 0] stand-in without probs)");
  same_device(op, "permuted", permuted, grad_out);
  ndim(op, "row_id_map", row_id_map, 2, "[T, K]");
  dtype_in(op, "row_id_map", row_id_map, kIndexTypes);
  same_device(op, "row_id_map", row_id_map, grad_out);
  TORCH_CHECK_VALUE(grad_out.size(0) == row_id_map.size(0), op,
                    ": grad_out must have one row per row of row_id_map: grad_out has shape ",
                    shape_str(grad_out.sizes()), ", row_id_map ", shape_str(row_id_map.sizes()));
  if (probs.has_value()) {
    dtype_in(op, "probs", *probs, kFloatTypes);
    same_device(op, "probs", *probs, grad_out);
    shape_is(op, "probs", *probs, row_id_map.sizes(), "the shape of row_id_map");
    TORCH_CHECK_VALUE(permuted.size(1) == grad_out.size(1), op, ": permuted must have shape (N, ", grad_out.size(1),
                      ") with probs (the hidden size of grad_out), got ", shape_str(permuted.sizes()));
  }
  index_range(op, "row_id_map", row_id_map, -1, permuted.size(0));
  unique_rows(op, "row_id_map", row_id_map, permuted.size(0));
}

// --------------------------------------------------------------------------------------- grouped_gemm
// The one group-size check: 1-D int32/int64, one entry per group, on the input's device or the cpu,
// every entry in [0, rows] and sum <= rows (each entry is bounded first, so the int64 sum cannot
// overflow). `groups`: the required entry count (nullopt: any, grouped_gemm_dw). `values` = false for
// the metadata part only.
inline void group_sizes(const char* op, const Tensor& gs, std::optional<int64_t> groups, const Tensor& x, int64_t rows,
                        bool values) {
  ndim(op, "group_sizes", gs, 1, "[E]");
  dtype_in(op, "group_sizes", gs, kIndexTypes);
  TORCH_CHECK_VALUE(gs.device() == x.device() || gs.device().is_cpu(), op, ": group_sizes is on ", gs.device(),
                    " but the other inputs are on ", x.device(), " (group_sizes may live on their device or the cpu)");
  if (groups)
    TORCH_CHECK_VALUE(gs.size(0) == *groups, op, ": group_sizes must have one entry per expert: weight has ", *groups,
                      " experts, group_sizes has shape ", shape_str(gs.sizes()));
  if (!values || gs.numel() == 0) return;
  if (!gs.device().is_cpu()) {
    const Tensor g = gs.to(at::kLong);
    std::ostringstream m;
    m << op << ": group_sizes must be in [0, " << rows << "]";
    assert_async(at::logical_and(g >= 0, g <= rows).all(), m.str());
    assert_async(g.sum() <= rows, std::string(op) + ": sum(group_sizes) exceeds the number of input rows");
    return;
  }
  const Tensor v = gs.to(at::kLong).contiguous();
  const int64_t* p = v.data_ptr<int64_t>();
  // the first negative entry, then the first one above rows (the Python twin's order)
  for (int64_t e = 0; e < v.numel(); ++e)
    TORCH_CHECK_VALUE(p[e] >= 0, op, ": group_sizes must be non-negative, got ", p[e], " for group ", e);
  int64_t total = 0;
  for (int64_t e = 0; e < v.numel(); ++e) {
    TORCH_CHECK_VALUE(p[e] <= rows, op, ": sum(group_sizes) exceeds the ", rows, " rows of the input (group ", e,
                      " alone has ", p[e], ")");
    total += p[e];
  }
  TORCH_CHECK_VALUE(total <= rows, op, ": sum(group_sizes) = ", total, " exceeds the ", rows, " rows of the input");
}

inline void grouped_gemm(const Tensor& x, const Tensor& weight, const Tensor& gs, bool trans_b) {
  constexpr const char* op = "grouped_gemm";
  float_tensor(op, "x", x, 2, "[M, K]");
  like_tensor(op, "weight", weight, x, 3, trans_b ? "[E, N, K]" : "[E, K, N]");
  const int64_t k_w = trans_b ? weight.size(2) : weight.size(1);
  TORCH_CHECK_VALUE(k_w == x.size(1), op, ": weight ", trans_b ? "[E, N, K]" : "[E, K, N]", " (trans_b=",
                    trans_b ? "True" : "False", ") has K=", k_w, " but x has K=", x.size(1), " (x ", shape_str(x.sizes()),
                    ", weight ", shape_str(weight.sizes()), ")");
  group_sizes(op, gs, weight.size(0), x, x.size(0), true);
}

inline void grouped_gemm_dw(const Tensor& a, const Tensor& b, const Tensor& gs) {
  constexpr const char* op = "grouped_gemm_dw";
  float_tensor(op, "a", a, 2, "[M, P]");
  like_tensor(op, "b", b, a, 2, "[M, Q]");
  TORCH_CHECK_VALUE(b.size(0) == a.size(0), op, ": a and b must have the same rows: a ", shape_str(a.sizes()), ", b ",
                    shape_str(b.sizes()));
  group_sizes(op, gs, std::nullopt, a, a.size(0), true);
}

// ------------------------------------------------------------------------------------ flash attention
// Shapes: q [Tq, Hq, Dq], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv], k_rope [Tk, Dr] (optional), cu_seqlens_q and
// cu_seqlens_k [B+1] (the same B), lse [Hq, Tq]. Hkv divides Hq (GQA/MQA). d_v > d_qk is valid.
// cu_seqlens of `name`: [B+1] int32/int64 on like's device, starts at 0, non-decreasing, ends at T (the
// tokens of `of`), no sequence longer than max_seqlen. `entries`: the required B+1 (nullopt: any).
inline void cu_seqlens(const char* op, const char* name, const char* max_name, const Tensor& cu, int64_t T,
                       const char* of, int64_t max_seqlen, const Tensor& like,
                       std::optional<int64_t> entries = std::nullopt) {
  ndim(op, name, cu, 1, "[B+1]");
  dtype_in(op, name, cu, kIndexTypes);
  same_device(op, name, cu, like);
  if (entries)
    TORCH_CHECK_VALUE(cu.numel() == *entries, op, ": ", name, " must have the B+1 = ", *entries,
                      " entries of cu_seqlens_q (one per sequence boundary), got shape ", shape_str(cu.sizes()));
  TORCH_CHECK_VALUE(cu.numel() >= 2 || (cu.numel() == 1 && T == 0), op, ": ", name,
                    " must have B+1 >= 2 entries (one entry only for B = 0 and no tokens), got shape ",
                    shape_str(cu.sizes()), " for T=", T, " tokens");
  TORCH_CHECK_VALUE(max_seqlen >= 0, op, ": ", max_name, " must be >= 0, got ", max_seqlen);
  if (!cu.device().is_cpu()) {
    const int64_t n = cu.numel();
    const Tensor d = cu.slice(0, 1, n) - cu.slice(0, 0, n - 1);
    const Tensor longest = n > 1 ? d.max() : cu.select(0, 0);
    std::ostringstream m;
    m << op << ": " << name << " must start at 0, be non-decreasing, end at the tokens of " << of
      << " and have no sequence longer than " << max_name;
    assert_async(at::logical_and(at::logical_and(cu.select(0, 0) == 0, cu.select(0, n - 1) == T),
                                 at::logical_and((d >= 0).all(), longest <= max_seqlen)),
                 m.str());
    return;
  }
  const Tensor v = cu.to(at::kLong).contiguous();
  const int64_t* c = v.data_ptr<int64_t>();
  const int64_t n = v.numel();
  TORCH_CHECK_VALUE(c[0] == 0, op, ": ", name, " must start at 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    TORCH_CHECK_VALUE(c[i + 1] >= c[i], op, ": ", name, " must be non-decreasing, got ", name, "[", i, "]=", c[i],
                      " > ", name, "[", i + 1, "]=", c[i + 1]);
    longest = std::max(longest, c[i + 1] - c[i]);
  }
  TORCH_CHECK_VALUE(c[n - 1] == T, op, ": ", name, " must end at the number of tokens of ", of, " T=", T, ", got ",
                    c[n - 1]);
  TORCH_CHECK_VALUE(longest <= max_seqlen, op, ": ", max_name, "=", max_seqlen,
                    " is smaller than the longest sequence (", longest, ")");
}

// MLA (q and k alike): the one-argument form.
inline void cu_seqlens(const char* op, const Tensor& cu, const Tensor& q, int64_t max_seqlen) {
  cu_seqlens(op, "cu_seqlens", "max_seqlen", cu, q.size(0), "q", max_seqlen, q);
}

inline at::ScalarType lse_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline void lse(const char* op, const Tensor& l, const Tensor& q) {
  const auto want = lse_dtype(q.scalar_type());
  // a TypeError, as every wrong dtype (it was a RuntimeError until 2026-12-07)
  TORCH_CHECK_TYPE(l.scalar_type() == want, op, ": lse must be ", dtype_name(want), " (float64 for float64 inputs), got ",
                   dtype_name(l.scalar_type()));
  same_device(op, "lse", l, q);
  shape_is(op, "lse", l, {q.size(1), q.size(0)}, "[H, T]");
}

inline void attention_common(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& k_rope,
                             const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
                             double softmax_scale) {
  float_tensor(op, "q", q, 3, "[Tq, Hq, D_qk]");
  like_tensor(op, "k", k, q, 3, "[Tk, Hkv, D_k]");
  like_tensor(op, "v", v, q, 3, "[Tk, Hkv, D_v]");
  const int64_t Hq = q.size(1), Dq = q.size(2), Tk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK_VALUE((Hkv == 0 && Hq == 0) || (Hkv >= 1 && Hq % Hkv == 0), op, ": k must have a number of heads Hkv ",
                    "that divides the Hq=", Hq, " heads of q (GQA/MQA), got shape ", shape_str(k.sizes()));
  TORCH_CHECK_VALUE(v.size(0) == Tk && v.size(1) == Hkv, op, ": v must have shape (", Tk, ", ", Hkv,
                    ", D) (the tokens and heads of k), got ", shape_str(v.sizes()));
  int64_t dr = 0;
  if (k_rope.has_value()) {
    like_tensor(op, "k_rope", *k_rope, q, 2, "[Tk, D_r]");
    TORCH_CHECK_VALUE(k_rope->size(0) == Tk, op, ": k_rope must have shape (", Tk, ", D_r) (the tokens of k), got ",
                      shape_str(k_rope->sizes()));
    dr = k_rope->size(1);
  }
  TORCH_CHECK_VALUE(Dq >= 1 && v.size(2) >= 1, op, ": head dims must be positive, got d_qk=", Dq, ", d_v=", v.size(2));
  TORCH_CHECK_VALUE(k.size(2) + dr == Dq, op, ": k head dim must equal q head dim ", Dq, " minus the k_rope dim ", dr,
                    ", got ", k.size(2));
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), op, ": softmax_scale must be finite, got ", softmax_scale);
  cu_seqlens(op, "cu_seqlens_q", "max_seqlen_q", cu_q, q.size(0), "q", max_q, q);
  cu_seqlens(op, "cu_seqlens_k", "max_seqlen_k", cu_k, Tk, "k", max_k, q, cu_q.numel());
}

inline void flash_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& k_rope,
                                const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
                                bool /*causal*/, double softmax_scale) {
  attention_common("flash_attention_fwd", q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale);
}

inline void flash_attention_bwd(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                                const OptTensor& k_rope, const Tensor& out, const Tensor& l, const Tensor& cu_q,
                                const Tensor& cu_k, int64_t max_q, int64_t max_k, bool /*causal*/,
                                double softmax_scale) {
  constexpr const char* op = "flash_attention_bwd";
  attention_common(op, q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale);
  const std::vector<int64_t> o_shape = {q.size(0), q.size(1), v.size(2)};
  like_tensor(op, "grad_out", grad_out, q, 3, "[Tq, Hq, D_v]");
  shape_is(op, "grad_out", grad_out, o_shape, "[Tq, Hq, D_v]");
  like_tensor(op, "out", out, q, 3, "[Tq, Hq, D_v]");
  shape_is(op, "out", out, o_shape, "[Tq, Hq, D_v]");
  lse(op, l, q);
}

// ---------------------------------------------------------------------------------------------- MLA
inline void mla_common(const char* op, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w,
                       const Tensor& cu, int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale) {
  float_tensor(op, "q", q, 3, "[T, H, Dn + Dr]");
  TORCH_CHECK_VALUE(H >= 1, op, ": num_heads must be >= 1, got ", H);
  TORCH_CHECK_VALUE(Dn >= 1, op, ": qk_nope_dim must be >= 1, got ", Dn);
  TORCH_CHECK_VALUE(Dv >= 1, op, ": v_dim must be >= 1, got ", Dv);
  const int64_t T = q.size(0), Dq = q.size(2);
  TORCH_CHECK_VALUE(q.size(1) == H, op, ": q must have num_heads=", H, " heads (dim 1), got shape ", shape_str(q.sizes()));
  TORCH_CHECK_VALUE(Dq - Dn >= 1, op, ": q head dim ", Dq, " must be qk_nope_dim=", Dn, " + a rope dim >= 1");
  like_tensor(op, "c_kv", c_kv, q, 2, "[T, Dc]");
  TORCH_CHECK_VALUE(c_kv.size(0) == T, op, ": c_kv must have shape (", T, ", Dc) (the tokens of q), got ",
                    shape_str(c_kv.sizes()));
  like_tensor(op, "k_pe", k_pe, q, 2, "[T, Dr]");
  shape_is(op, "k_pe", k_pe, {T, Dq - Dn}, "tokens of q, rope dim = q head dim - qk_nope_dim");
  like_tensor(op, "w_kv_up", w, q, 2, "[H * (Dn + Dv), Dc]");
  int64_t rows = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(H, Dn + Dv, &rows), op, ": num_heads * (qk_nope_dim + v_dim) overflows");
  shape_is(op, "w_kv_up", w, {rows, c_kv.size(1)}, "[num_heads*(qk_nope_dim+v_dim), latent dim]");
  TORCH_CHECK_VALUE(std::isfinite(softmax_scale), op, ": softmax_scale must be finite, got ", softmax_scale);
  cu_seqlens(op, cu, q, max_seqlen);
}

inline void mla_attention_fwd(const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w, const Tensor& cu,
                              int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
                              bool /*causal*/ = false, bool /*save_kv*/ = false) {
  mla_common("mla_attention_fwd", q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale);
}

inline void mla_attention_bwd(const Tensor& grad_out, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe,
                              const Tensor& w, const Tensor& out, const Tensor& l, const Tensor& kv, const Tensor& cu,
                              int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale,
                              bool /*causal*/ = false) {
  constexpr const char* op = "mla_attention_bwd";
  mla_common(op, q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale);
  const std::vector<int64_t> o_shape = {q.size(0), H, Dv};
  like_tensor(op, "grad_out", grad_out, q, 3, "[T, H, Dv]");
  shape_is(op, "grad_out", grad_out, o_shape, "[T, H, Dv]");
  like_tensor(op, "out", out, q, 3, "[T, H, Dv]");
  shape_is(op, "out", out, o_shape, "[T, H, Dv]");
  lse(op, l, q);
  if (kv.numel() != 0) {
    like_tensor(op, "kv", kv, q, 2, "[T, H * (Dn + Dv)] (or shape [0] = recompute)");
    shape_is(op, "kv", kv, {q.size(0), w.size(0)}, "[T, H * (Dn + Dv)], or shape [0] = recompute");
  }
}

// ---------------------------------------------------------------- valid empty cases (no kernel launch)
// Tq = 0 (also B = 0: cu_seqlens = [0]) or Hq = 0: empty outputs of the right shapes and dtypes; Tk = 0 (no
// keys at all): every query row sees no key, so out = 0, lse = -inf and every gradient is zero.
inline bool attention_is_empty(const Tensor& q) { return q.size(0) == 0 || q.size(1) == 0; }
inline bool attention_is_empty(const Tensor& q, const Tensor& k) { return attention_is_empty(q) || k.size(0) == 0; }

inline std::tuple<Tensor, Tensor> empty_attention_fwd(const Tensor& q, const Tensor& v) {
  return {at::zeros({q.size(0), q.size(1), v.size(2)}, q.options()),
          at::full({q.size(1), q.size(0)}, -std::numeric_limits<double>::infinity(),
                   q.options().dtype(lse_dtype(q.scalar_type())))};
}

}  // namespace checks
}  // namespace amo
