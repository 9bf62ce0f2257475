// ascend_moe_ops._ascendc_emu: the AscendC kernels of csrc/ascend/kernels, compiled with g++ against
// the emulation layer (csrc/ascend/emu, -DASCEND_MOE_OPS_EMU) and exposed with the ops' positional
// signatures and registered with the dispatcher as namespace ascend_moe_ops_emu, so the parity suites
// run the real kernel sources on CPU tensors (torch.ops.ascend_moe_ops_emu.<op>). The host side mirrors the NPU glue (csrc/ascend/moe_*.cpp):
// same row-map math (host/row_map.h), same tilings, one "launch" per kernel; blocks run one after
// another with the UB budget of the tiling enforced.
//
// Environment (tests only): ASCEND_MOE_OPS_EMU_AIV = vector core count (default 48, the 910B2);
// ASCEND_MOE_OPS_EMU_MAX_TILE_COLS = cap on the H-tile width (default none) to force multi-tile rows;
// ASCEND_MOE_OPS_EMU_UB_LIMIT = UB bytes the emulated core really has (default: the tiling's budget),
// to check that a tiling planning more UB than the core has is caught.
// Outputs are pre-filled with NaN, so a row a kernel forgets to write fails the tests.
#include <torch/extension.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "../common/checks.h"

#include "emu/kernel_operator_emu.h"
#include "host/emu_launcher.h"
#include "host/fa_kernels.h"
#include "host/grouped_gemm_host.h"
#include "host/moe_permute_host.h"
#include "host/moe_unpermute_host.h"
#include "tiling/flash_attention_tiling.h"


namespace {

using namespace amo_ascend;
using amo_ascend::host::EmuLauncher;
using at::Tensor;

ChipInfo emu_chip() {
  ChipInfo chip = Ascend910B2();
  if (const char* v = std::getenv("ASCEND_MOE_OPS_EMU_AIV")) chip.aivNum = static_cast<uint32_t>(std::max(1, std::atoi(v)));
  return chip;
}

uint32_t max_tile_cols() {
  const char* v = std::getenv("ASCEND_MOE_OPS_EMU_MAX_TILE_COLS");
  return v ? static_cast<uint32_t>(std::max(0, std::atoi(v))) : 0u;
}

uint64_t ub_limit(const ChipInfo& chip) {
  const char* v = std::getenv("ASCEND_MOE_OPS_EMU_UB_LIMIT");
  return v ? static_cast<uint64_t>(std::max(0, std::atoi(v))) : ub_budget(chip);
}

GM_ADDR gm(const Tensor& t) {
  return reinterpret_cast<GM_ADDR>(const_cast<void*>(t.data_ptr()));
}

// The kernel's real UB use (TPipe::InitBuffer calls) must be exactly what the tiling planned and
// the tiling tests checked against the budget.
void check_plan(uint64_t used, uint64_t planned, const char* kernel) {
  TORCH_CHECK(used == planned, "ascendc-emu: kernel ", kernel, " allocated ", used, " B of UB but its tiling planned ",
              planned, " B");
}

uint32_t checked_blocks(uint32_t blockDim, const ChipInfo& chip) {
  TORCH_CHECK(blockDim >= 1 && blockDim <= chip.aivNum, "ascendc-emu: blockDim ", blockDim, " outside [1, ", chip.aivNum,
              "] vector cores");
  return blockDim;
}

Tensor poisoned(at::IntArrayRef shape, const at::TensorOptions& opts) {
  return at::full(shape, std::numeric_limits<float>::quiet_NaN(), opts);
}

uint64_t addr(const Tensor& t) { return reinterpret_cast<uint64_t>(t.data_ptr()); }

// A phase kernel may use less than its tiling planned (the plan covers every phase), never more.
void check_ub(uint64_t used, const FlashAttentionTiling& t, const char* kernel) {
  TORCH_CHECK(used <= t.ubBytes, "ascendc-emu: kernel ", kernel, " allocated ", used, " B of UB but its tiling planned ",
              t.ubBytes, " B");
}

void check_cube(const ascend_emu::CubeMem& used, const FlashAttentionTiling& t, const char* kernel) {
  TORCH_CHECK(used.l1 <= t.l1Bytes && used.l0a <= t.l0aBytes && used.l0b <= t.l0bBytes && used.l0c <= t.l0cBytes,
              "ascendc-emu: kernel ", kernel, " allocated L1/L0A/L0B/L0C ", used.l1, "/", used.l0a, "/", used.l0b, "/",
              used.l0c, " B, more than its tiling planned (", t.l1Bytes, "/", t.l0aBytes, "/", t.l0bBytes, "/",
              t.l0cBytes, " B)");
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "ascendc-emu: ", name, " must be a cpu tensor, got ", t.device());
}

// ---- grouped GEMM (Cube, AIC-only kernels) ------------------------------------------------------------
// Test knobs: ASCEND_MOE_OPS_EMU_AIC = Cube core count (default 24); ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE =
// cap on baseM/baseN/baseK*stepK (default none) to force many tiles and K chunks on small shapes.
ChipInfo emu_cube_chip() {
  ChipInfo chip = Ascend910B2();
  if (const char* v = std::getenv("ASCEND_MOE_OPS_EMU_AIC")) {
    chip.aicNum = static_cast<uint32_t>(std::max(1, std::atoi(v)));
    chip.aivNum = 2 * chip.aicNum;  // A2/A3 AI Cores: one AIC and two AIVs each
  }
  return chip;
}

uint32_t cube_max_base() {
  const char* v = std::getenv("ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE");
  return v ? static_cast<uint32_t>(std::max(0, std::atoi(v))) : 0u;
}

// ---- flash attention forward (see kernels/flash_attention_*.cpp) ---------------------------------------
// Knobs: ASCEND_MOE_OPS_EMU_AIC, ASCEND_MOE_OPS_EMU_CUBE_MAX_BASE (caps baseM/baseN) as for grouped GEMM;
// ASCEND_MOE_OPS_FA_KERNELS=phases runs the phase kernels (four launches per key block, per pass in the
// backward) instead of the fused mixed kernels amo_fa_fused / amo_fab_fused (the default; the NPU glue
// reads the same variable: host/fa_kernels.h).

void check_mix(const ascend_emu::MixMem& used, const FlashAttentionTiling& t, const char* kernel) {
  check_cube(used.cube, t, kernel);
  TORCH_CHECK(used.ub == t.ubFusedBytes, "ascendc-emu: kernel ", kernel, " allocated ", used.ub,
              " B of UB per AIV but its tiling planned ", t.ubFusedBytes, " B");
}

// Checks and shapes shared by forward and backward (the emulator's twin of the NPU glue's check_inputs).
struct FaInputs {
  int64_t T, H, Dq, Dk, Dr, Dv, B, maxLen;
  bool rope;
  DType dt;
  Tensor q, k, v, kRope, cu;  // contiguous; kRope undefined without rope; cu int64
};

FaInputs fa_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& kRope,
                   const Tensor& cuSeqlens, int64_t maxSeqlen, const char* op) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  check_cpu(v, "v");
  check_cpu(cuSeqlens, "cu_seqlens");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "ascendc-emu ", op, ": q, k, v must be [T, H, D]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "ascendc-emu ", op,
              ": k and v must have q's dtype");
  FaInputs f{};
  f.dt = host::cube_dtype(q, op);
  f.T = q.size(0), f.H = q.size(1), f.Dq = q.size(2), f.Dk = k.size(2), f.Dv = v.size(2);
  f.rope = kRope.has_value() && kRope->defined();
  f.Dr = f.rope ? kRope->size(1) : 0;
  if (f.rope) TORCH_CHECK(kRope->scalar_type() == q.scalar_type(), "ascendc-emu ", op, ": k_rope dtype differs from q");
  TORCH_CHECK(f.Dq == f.Dk + f.Dr, "ascendc-emu ", op, ": q head dim must be Dk + Dr");
  TORCH_CHECK(f.H * f.Dq < 65536 && f.H * f.Dv < 65536, "ascendc-emu ", op, ": H * D must be < 65536 (16-bit copy strides)");
  f.cu = cuSeqlens.to(at::kLong).contiguous();
  f.B = f.cu.numel() - 1;
  const int64_t* cu = f.cu.data_ptr<int64_t>();
  f.maxLen = 0;
  for (int64_t b = 0; b < f.B; ++b) f.maxLen = std::max<int64_t>(f.maxLen, cu[b + 1] - cu[b]);
  TORCH_CHECK(f.maxLen <= maxSeqlen, "ascendc-emu ", op, ": max_seqlen ", maxSeqlen, " < longest sequence ", f.maxLen);
  f.q = q.contiguous(), f.k = k.contiguous(), f.v = v.contiguous();
  if (f.rope) f.kRope = kRope->contiguous();
  return f;
}

std::tuple<Tensor, Tensor> flash_attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                               const c10::optional<Tensor>& kRope, const Tensor& cuSeqlens,
                                               int64_t maxSeqlen, bool causal, double softmaxScale) {
  const FaInputs f = fa_inputs(q, k, v, kRope, cuSeqlens, maxSeqlen, "flash_attention_fwd");
  const int64_t T = f.T, H = f.H, Dv = f.Dv;
  const bool rope = f.rope;
  const Tensor &qc = f.q, &kc = f.k, &vc = f.v, &krc = f.kRope, &cu = f.cu;
  const ChipInfo chip = emu_cube_chip();
  FlashAttentionTiling t = compute_flash_attention_tiling(T, H, f.Dk, f.Dr, Dv, f.B, f.maxLen, causal, f.dt, chip,
                                                            cube_max_base());
  t.softmaxScale = static_cast<float>(softmaxScale);
  auto out = poisoned({T, H, Dv}, q.options());
  auto lse = poisoned({H, T}, q.options().dtype(at::kFloat));
  if (t.key == FlashAttentionTilingKey::kEmpty) return {out.zero_(), lse.fill_(-std::numeric_limits<float>::infinity())};
  const FlashAttentionWorkspace w = flash_attention_workspace(t);
  auto f32 = q.options().dtype(at::kFloat);
  ascend_emu::CubeMem caps{chip.l1Bytes, chip.l0aBytes, chip.l0bBytes, chip.l0cBytes};
  if (host::fa_fused()) {  // one mixed launch; workspaces are one slot per AI Core group, start as NaN
    host::check_fused_rows(t, "ascendc-emu flash_attention_fwd");
    Tensor sWs = poisoned({w.fusedScore}, f32), pWs = poisoned({w.fusedScore}, q.options());
    Tensor opWs = poisoned({w.fusedRows}, f32);
    FlashAttentionFwdArgs g{addr(qc), addr(kc), addr(vc), rope ? addr(krc) : 0, addr(cu), addr(sWs), addr(pWs),
                            addr(opWs), 0, 0, addr(out), addr(lse)};
    FlashAttentionTiling tt = t;
    ascend_emu::set_kernel("amo_fa_fused");
    auto used = ascend_emu::launch_mix(t.blockDim, ub_limit(chip), caps, amo_fa_fused, reinterpret_cast<GM_ADDR>(&g),
                                       reinterpret_cast<GM_ADDR>(&tt));
    check_mix(used, t, "amo_fa_fused");
    return {out, lse};
  }
  Tensor sWs = at::zeros({w.score}, f32), pWs = at::zeros({w.score}, q.options());
  Tensor opWs = at::zeros({w.rows}, f32), oWs = at::zeros({w.rows}, f32);
  Tensor stWs = at::zeros({w.state}, f32);
  FlashAttentionFwdArgs g{addr(qc), addr(kc), addr(vc), rope ? addr(krc) : 0, addr(cu), addr(sWs), addr(pWs),
                          addr(opWs), addr(oWs), addr(stWs), addr(out), addr(lse)};
  for (int64_t j = 0; j < w.steps; ++j) {
    FlashAttentionTiling tt = t;
    tt.step = static_cast<uint32_t>(j);
    auto tp = reinterpret_cast<GM_ADDR>(&tt);
    auto gp = reinterpret_cast<GM_ADDR>(&g);
    ascend_emu::set_kernel("amo_fa_qk");
    auto c1 = ascend_emu::launch_cube(t.blockDim, caps, amo_fa_qk, gp, tp);
    ascend_emu::set_kernel("amo_fa_softmax");
    check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fa_softmax, gp, tp), t, "amo_fa_softmax");
    ascend_emu::set_kernel("amo_fa_pv");
    auto c2 = ascend_emu::launch_cube(t.blockDim, caps, amo_fa_pv, gp, tp);
    ascend_emu::set_kernel("amo_fa_update");
    check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fa_update, gp, tp), t, "amo_fa_update");
    check_cube(c1, t, "amo_fa_qk");
    check_cube(c2, t, "amo_fa_pv");
  }
  return {out, lse};
}

// ---- flash attention backward (AIC + AIV phase kernels, two passes; see kernels/flash_attention_*.cpp) --
std::tuple<Tensor, Tensor, Tensor, Tensor> flash_attention_bwd(const Tensor& gradOut, const Tensor& q, const Tensor& k,
                                                               const Tensor& v, const c10::optional<Tensor>& kRope,
                                                               const Tensor& out, const Tensor& lse,
                                                               const Tensor& cuSeqlens, int64_t maxSeqlen, bool causal,
                                                               double softmaxScale) {
  check_cpu(gradOut, "grad_out");
  check_cpu(out, "out");
  check_cpu(lse, "lse");
  const FaInputs f = fa_inputs(q, k, v, kRope, cuSeqlens, maxSeqlen, "flash_attention_bwd");
  const int64_t T = f.T, H = f.H, Dq = f.Dq, Dk = f.Dk, Dr = f.Dr, Dv = f.Dv;
  const bool rope = f.rope;
  TORCH_CHECK(gradOut.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "ascendc-emu flash_attention_bwd: every input must have q's dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat, "ascendc-emu flash_attention_bwd: lse must be float32");
  TORCH_CHECK(gradOut.sizes() == out.sizes() && out.size(0) == T && out.size(1) == H && out.size(2) == Dv,
              "ascendc-emu flash_attention_bwd: grad_out and out must be [T, H, Dv]");
  const Tensor &qc = f.q, &kc = f.k, &vc = f.v, &krc = f.kRope, &cu = f.cu;
  auto oc = out.contiguous(), doc = gradOut.contiguous(), lc = lse.contiguous();
  const ChipInfo chip = emu_cube_chip();
  FlashAttentionTiling t = compute_flash_attention_bwd_tiling(T, H, Dk, Dr, Dv, f.B, f.maxLen, causal, f.dt, chip,
                                                              cube_max_base());
  t.softmaxScale = static_cast<float>(softmaxScale);
  auto dq = poisoned({T, H, Dq}, q.options()), dk = poisoned({T, H, Dk}, q.options()), dv = poisoned({T, H, Dv}, q.options());
  auto dkr = rope ? poisoned({T, Dr}, q.options()) : at::empty({0}, q.options());
  if (t.key == FlashAttentionTilingKey::kEmpty) return {dq.zero_(), dk.zero_(), dv.zero_(), dkr.zero_()};
  const FlashAttentionWorkspace w = flash_attention_workspace(t);
  auto f32 = q.options().dtype(at::kFloat);
  const bool fused = host::fa_fused();
  if (fused) host::check_fused_rows(t, "ascendc-emu flash_attention_bwd");
  const int64_t score = fused ? w.fusedScore : w.score, rowsWs = fused ? w.fusedRows : w.rows;
  // workspaces start as NaN (like fresh device memory could be), except acc, which the protocol zeroes
  Tensor delta = poisoned({w.delta}, f32), sWs = poisoned({score}, f32), dpWs = poisoned({score}, f32);
  Tensor pWs = poisoned({score}, q.options()), dsWs = poisoned({score}, q.options());
  Tensor part = poisoned({rowsWs}, f32), acc = fused ? at::empty({0}, f32) : at::zeros({w.rows}, f32);
  Tensor dkrh = poisoned({std::max<int64_t>(w.dkRopeHeads, 1)}, f32);
  FlashAttentionBwdArgs g{addr(qc), addr(kc), addr(vc), rope ? addr(krc) : 0, addr(cu), addr(oc), addr(doc), addr(lc),
                          addr(delta), addr(sWs), addr(dpWs), addr(pWs), addr(dsWs), addr(part), fused ? 0 : addr(acc),
                          rope ? addr(dkrh) : 0, addr(dq), addr(dk), addr(dv), rope ? addr(dkr) : 0};
  ascend_emu::CubeMem caps{chip.l1Bytes, chip.l0aBytes, chip.l0bBytes, chip.l0cBytes};
  auto gp = reinterpret_cast<GM_ADDR>(&g);
  FlashAttentionTiling tt = t;
  auto tp = reinterpret_cast<GM_ADDR>(&tt);
  ascend_emu::set_kernel("amo_fab_delta");
  check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fab_delta, gp, tp), t, "amo_fab_delta");
  for (FlashAttentionPass pass : {FlashAttentionPass::kBackwardKV, FlashAttentionPass::kBackwardQ}) {
    tt.pass = pass;
    if (fused) {
      ascend_emu::set_kernel("amo_fab_fused");
      check_mix(ascend_emu::launch_mix(t.blockDim, ub_limit(chip), caps, amo_fab_fused, gp, tp), t, "amo_fab_fused");
      continue;
    }
    acc.zero_();
    for (int64_t j = 0; j < w.steps; ++j) {
      tt.step = static_cast<uint32_t>(j);
      ascend_emu::set_kernel("amo_fab_qk");
      check_cube(ascend_emu::launch_cube(t.blockDim, caps, amo_fab_qk, gp, tp), t, "amo_fab_qk");
      ascend_emu::set_kernel("amo_fab_softmax");
      check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fab_softmax, gp, tp), t, "amo_fab_softmax");
      ascend_emu::set_kernel("amo_fab_grad");
      check_cube(ascend_emu::launch_cube(t.blockDim, caps, amo_fab_grad, gp, tp), t, "amo_fab_grad");
      ascend_emu::set_kernel("amo_fab_acc");
      check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fab_acc, gp, tp), t, "amo_fab_acc");
    }
  }
  if (rope) {
    ascend_emu::set_kernel("amo_fab_dkrope");
    check_ub(ascend_emu::launch(t.vecBlockDim, ub_limit(chip), amo_fab_dkrope, gp, tp), t, "amo_fab_dkrope");
  }
  return {dq, dk, dv, dkr};
}

// ---- dispatcher kernels (namespace ascend_moe_ops_emu, dispatch key CPU) ---------------------------------
// The op-boundary checks (common/checks.h, shared with the native CPU kernels), the valid empty attention
// cases, then the emulated glue above. MLA on the Ascend path is a composition of these kernels in Python
// (ascend_moe_ops/ops/mla_attention.py), registered there.
std::tuple<Tensor, Tensor> flash_attention_fwd_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const c10::optional<Tensor>& kRope, const Tensor& cuSeqlens,
                                                  int64_t maxSeqlen, bool causal, double softmaxScale) {
  amo::checks::flash_attention_fwd(q, k, v, kRope, cuSeqlens, maxSeqlen, causal, softmaxScale);
  if (amo::checks::attention_is_empty(q)) return amo::checks::empty_attention_fwd(q, v);
  return flash_attention_fwd(q, k, v, kRope, cuSeqlens, maxSeqlen, causal, softmaxScale);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> flash_attention_bwd_op(const Tensor& gradOut, const Tensor& q, const Tensor& k,
                                                                  const Tensor& v, const c10::optional<Tensor>& kRope,
                                                                  const Tensor& out, const Tensor& lse,
                                                                  const Tensor& cuSeqlens, int64_t maxSeqlen,
                                                                  bool causal, double softmaxScale) {
  amo::checks::flash_attention_bwd(gradOut, q, k, v, kRope, out, lse, cuSeqlens, maxSeqlen, causal, softmaxScale);
  if (amo::checks::attention_is_empty(q))
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v),
            kRope.has_value() ? at::zeros_like(*kRope) : at::empty({0}, q.options())};
  return flash_attention_bwd(gradOut, q, k, v, kRope, out, lse, cuSeqlens, maxSeqlen, causal, softmaxScale);
}

void register_kernels(torch::Library& m) {
  m.impl("moe_permute", TORCH_FN(host::moe_permute<EmuLauncher>));
  m.impl("moe_unpermute", TORCH_FN(host::moe_unpermute<EmuLauncher>));
  m.impl("moe_unpermute_backward", TORCH_FN(host::moe_unpermute_backward<EmuLauncher>));
  m.impl("grouped_gemm", TORCH_FN(host::grouped_gemm<EmuLauncher>));
  m.impl("grouped_gemm_dw", TORCH_FN(host::grouped_gemm_dw<EmuLauncher>));
  m.impl("flash_attention_fwd", TORCH_FN(flash_attention_fwd_op));
  m.impl("flash_attention_bwd", TORCH_FN(flash_attention_bwd_op));
}

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
}
