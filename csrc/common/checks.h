// The op contracts of ascend_moe_ops, checked once at the op boundary of the C++ backends: the rules
// and the helpers every contract shares. Each op's contract, amo::checks::<op>, is in the files of its
// family, common/<family>_checks.h (common/op_list.h), next to nothing of another op.
//
// Every C++ kernel registered with the dispatcher (csrc/cpu: namespace ascend_moe_ops_native and,
// when bound, ascend_moe_ops; csrc/ascend/emu_bindings.cpp: ascend_moe_ops_emu) calls the check of its
// op first, so a direct torch.ops.<namespace>.<op> call is validated exactly like a call through the
// Python wrapper. The Python backends (reference, triton) run the twin of each check (the spec's
// check; the existing ops' are in ascend_moe_ops/ops/_contracts.py) with the same messages. Kernels
// only assert internal invariants.
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

// ---------------------------------------------------------------- attention (cu_seqlens, lse)
// cu_seqlens of `name`: [B+1] int32/int64 on like's device, starts at 0, non-decreasing, ends at T (the
// tokens of `of`), no sequence longer than max_seqlen. `entries`: the required B+1 (nullopt: any).
// softmax_scale finite in the kernels' accumulation type (float32 below float64 inputs: 1e39 is a
// finite double and inf in float32); the Python twin is _contracts._scale.
inline void softmax_scale_check(const char* op, double s, const Tensor& q) {
  const bool wide = q.scalar_type() == at::kDouble;
  TORCH_CHECK_VALUE(std::isfinite(s) && (wide || std::fabs(s) <= static_cast<double>(std::numeric_limits<float>::max())),
                    op, ": softmax_scale must be finite in ", wide ? "float64" : "float32",
                    " (the accumulation type), got ", s);
}

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

// The one-argument form (q and k alike: the same tokens, `cu_seqlens` and `max_seqlen`).
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

}  // namespace checks
}  // namespace amo
