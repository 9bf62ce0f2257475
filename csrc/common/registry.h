// Registration of the native CPU kernels with the dispatcher, and the (internal) pybind11 module.
//
// Schemas live in ascend_moe_ops/_library.py (one definition per namespace); C++ only adds
// implementations. Each csrc/cpu/<op>.cpp registers its dispatcher kernels with
//     AMO_KERNELS(moe_permute) { m.impl("moe_permute", TORCH_FN(moe_permute_op)); }
// which (1) registers them for TORCH_LIBRARY_IMPL(ascend_moe_ops_native, CPU, m) when the extension
// is loaded, and (2) records the block so that amo::bind_cpu("ascend_moe_ops") can register the very
// same C++ functions for the public namespace's CPU key at run time (called once, at import, when the
// native backend is chosen): the dispatcher then calls the C++ kernel directly, no Python in between.
// Every registered kernel starts with its op's check from common/checks.h.
//
// AMO_REGISTER(name) { m.def(...); } adds plain pybind11 functions to ascend_moe_ops._C, for internal
// entry points only: the large-output block cache (cpu/large_blocks.cpp) and the op checks alone
// (cpu/checks_bindings.cpp). No kernel has a raw entry: every one is reached through its dispatcher
// kernel, after its op's check.
#pragma once

#include <torch/extension.h>
#include <torch/library.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

namespace amo {

using RegisterFn = void (*)(pybind11::module&);
using KernelFn = void (*)(torch::Library&);

inline std::vector<RegisterFn>& registry() {
  static std::vector<RegisterFn> fns;
  return fns;
}

inline std::vector<KernelFn>& kernel_registry() {
  static std::vector<KernelFn> fns;
  return fns;
}

struct Registrar {
  explicit Registrar(RegisterFn fn) { registry().push_back(fn); }
};

struct KernelRegistrar {
  explicit KernelRegistrar(KernelFn fn) { kernel_registry().push_back(fn); }
};

// Register every native kernel for namespace `ns`, dispatch key CPU (once per namespace; the
// torch::Library objects live until the process exits).
inline void bind_cpu(const std::string& ns) {
  static std::set<std::string> done;
  static std::vector<std::unique_ptr<torch::Library>> libs;
  if (!done.insert(ns).second) return;
  libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__));
  for (auto fn : kernel_registry()) fn(*libs.back());
}

}  // namespace amo

#define AMO_REGISTER(name)                                            \
  static void amo_register_##name(pybind11::module& m);               \
  static ::amo::Registrar amo_registrar_##name(&amo_register_##name); \
  static void amo_register_##name(pybind11::module& m)

#define AMO_KERNELS(name)                                                         \
  static void amo_kernels_##name(torch::Library& m);                              \
  static ::amo::KernelRegistrar amo_kernel_registrar_##name(&amo_kernels_##name); \
  TORCH_LIBRARY_IMPL(ascend_moe_ops_native, CPU, m) { amo_kernels_##name(m); }    \
  static void amo_kernels_##name(torch::Library& m)
