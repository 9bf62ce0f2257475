// ascend_moe_ops._ascendc_emu: the AscendC kernels of csrc/ascend/kernels, compiled with g++ against
// the emulation layer (csrc/ascend/emu, -DASCEND_MOE_OPS_EMU), registered with the dispatcher as
// namespace ascend_moe_ops_emu (dispatch key CPU), so the parity suites run the real kernel sources on
// CPU tensors (torch.ops.ascend_moe_ops_emu.<op>).
//
// This file holds no per-op code: every ASCENDC op of the op list (common/op_list.h) is registered by
// register_ascend (host/register.h), which calls the AMO_ASCEND_OP of its glue TU
// csrc/ascend/<family>.cpp: the host code of host/<family>_host.h, the same the NPU build registers
// for PrivateUse1, instantiated here with EmuLauncher (host/emu_launcher.h: CPU tensors, kernels on
// the emulator's blocks, allocations checked against the tilings; its test knobs are listed there).
// MLA on the Ascend path is a composition of these kernels in Python (ascend_moe_ops/ops/mla_attention.py).
#include <torch/extension.h>
#include <torch/library.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#include "host/register.h"

namespace {

void register_kernels(torch::Library& m) { amo_ascend::op_list::register_ascend(m); }

// The same kernels for another namespace's CPU key (ASCEND_MOE_OPS_BACKEND=ascendc-emu binds them to
// the public ascend_moe_ops at import); once per namespace, the Library objects live until exit.
void bind_cpu(const std::string& ns) {
  static std::set<std::string> done;
  static std::vector<std::unique_ptr<torch::Library>> libs;
  if (!done.insert(ns).second) return;
  libs.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns, c10::DispatchKey::CPU, __FILE__, __LINE__));
  register_kernels(*libs.back());
}

}  // namespace

TORCH_LIBRARY_IMPL(ascend_moe_ops_emu, CPU, m) { register_kernels(m); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "AscendC kernels of ascend_moe_ops run on the CPU emulation layer (csrc/ascend/emu); tests only. "
            "Importing it registers them with the dispatcher as namespace ascend_moe_ops_emu";
  m.def("_bind_cpu", &bind_cpu, "register the emulated kernels for namespace ns, dispatch key CPU", pybind11::arg("ns"));
  // The timeline recorder (emu/timeline.h; ascend_moe_ops/perfmodel/a2_timeline.py reads its JSON).
  m.def("_timeline_start", &ascend_emu::timeline::start,
        "record every following launch's instructions for the A2 timeline model; skip_compute: Cube "
        "instructions skip their arithmetic (timing only, results are garbage)",
        pybind11::arg("skip_compute") = false);
  m.def("_timeline_take", &ascend_emu::timeline::take_json,
        "the launches recorded since _timeline_start as JSON, and recording off");
}
