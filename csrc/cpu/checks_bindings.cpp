// Internal entry points to the C++ op contracts (common/checks.h) alone, with the argument lists of
// the op schemas (ascend_moe_ops/_library.py): _C._check_<op>(*args) raises exactly what the C++
// backends raise for those arguments and runs nothing else. For tests: the Python/C++ pair must agree
// case by case, and on device tensors the checks must never copy to the host
// (tests/test_op_contracts.py). No kernel is reachable from Python except through the dispatcher.
#include "common/checks.h"
#include "common/registry.h"

namespace {
using at::Tensor;
using OptTensor = c10::optional<Tensor>;
}  // namespace

AMO_REGISTER(checks) {
  namespace c = amo::checks;
  m.def("_check_moe_permute", &c::moe_permute);
  m.def("_check_moe_unpermute", &c::moe_unpermute);
  m.def("_check_moe_unpermute_backward", &c::moe_unpermute_backward);
  m.def("_check_grouped_gemm", &c::grouped_gemm);
  m.def("_check_grouped_gemm_dw", &c::grouped_gemm_dw);
  m.def("_check_flash_attention_fwd", &c::flash_attention_fwd);
  m.def("_check_flash_attention_bwd", &c::flash_attention_bwd);
  m.def("_check_mla_attention_fwd",
        [](const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w, const Tensor& cu,
           int64_t max_seqlen, int64_t H, int64_t Dn, int64_t Dv, double softmax_scale, bool /*causal*/,
           bool /*save_kv*/) { c::mla_attention_fwd(q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale); });
  m.def("_check_mla_attention_bwd",
        [](const Tensor& grad_out, const Tensor& q, const Tensor& c_kv, const Tensor& k_pe, const Tensor& w,
           const Tensor& out, const Tensor& lse, const Tensor& kv, const Tensor& cu, int64_t max_seqlen, int64_t H,
           int64_t Dn, int64_t Dv, double softmax_scale, bool /*causal*/) {
          c::mla_attention_bwd(grad_out, q, c_kv, k_pe, w, out, lse, kv, cu, max_seqlen, H, Dn, Dv, softmax_scale);
        });
}
