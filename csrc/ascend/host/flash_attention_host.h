// flash_attention_fwd and flash_attention_bwd on Ascend, written once for every launcher
// (host/launch.h: NpuLauncher, EmuLauncher).
//
// op-boundary checks (common/flash_attention_checks.h; GQA/MQA expand k/v to the q heads here and sum dk/dv per
// group) -> the Cube path's limits (fp16/bf16, 16-bit copy strides)
// -> cu_seqlens_q and cu_seqlens_k as int64 on q's device (device casts; the host code below never
// reads them: the caller's max_seqlen_q / max_seqlen_k, checked against the longest sequences at the
// op boundary, bound the work items and steps; the kernels walk the sequences, Lq != Lk allowed with
// bottom-right causal alignment, rows that see no key give out 0, lse -inf, zero gradients) -> tiling (tiling/flash_attention_tiling.h) -> GM workspaces sized by
// flash_attention_workspace() -> one uint64 argument block (FlashAttentionFwdArgs / BwdArgs) ->
// the kernels of kernels/flash_attention_*.cpp, with one copy of the tiling per launch (its `step`
// and `pass` fields set). Default, the fused mixed kernels:
//
//   forward : amo_fa_fused (one launch)
//   backward: amo_fab_delta (AIV); amo_fab_fused for pass KV, then for pass Q; amo_fab_dkrope (AIV, k_rope only)
//
// and with ASCEND_MOE_OPS_FA_KERNELS=phases (host/flash_attention_kernels.h) the phase kernels:
//
//   forward : for step j < steps: amo_fa_qk (AIC), amo_fa_softmax (AIV), amo_fa_pv (AIC), amo_fa_update (AIV)
//   backward: amo_fab_delta (AIV); for pass in (KV, Q): zero acc; for step j < steps:
//             amo_fab_qk (AIC), amo_fab_softmax (AIV), amo_fab_grad (AIC), amo_fab_acc (AIV);
//             amo_fab_dkrope (AIV, k_rope only)
//
// Outputs and workspaces come from Launcher::output (the kernels write every element before any
// read; on the emulator they start as NaN to prove it), except the phase kernels' running sums
// (acc), zeroed before each pass, and the phase forward's workspaces, zeroed. Schemas are defined
// in ascend_moe_ops/_library.py.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "../../common/flash_attention_checks.h"
#include "host/flash_attention_kernels.h"
#include "host/launch.h"
#include "tiling/flash_attention_tiling.h"

// The AscendC kernels this host code launches (entries of csrc/ascend/kernels; AMO_ASCEND_KERNEL: host/launch.h).
#include AMO_ASCEND_KERNEL_HEADER(amo_fa_qk)
AMO_ASCEND_KERNEL(amo_fa_qk, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fa_softmax)
AMO_ASCEND_KERNEL(amo_fa_softmax, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fa_pv)
AMO_ASCEND_KERNEL(amo_fa_pv, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fa_update)
AMO_ASCEND_KERNEL(amo_fa_update, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fa_fused)
AMO_ASCEND_KERNEL(amo_fa_fused, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_delta)
AMO_ASCEND_KERNEL(amo_fab_delta, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_qk)
AMO_ASCEND_KERNEL(amo_fab_qk, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_softmax)
AMO_ASCEND_KERNEL(amo_fab_softmax, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_grad)
AMO_ASCEND_KERNEL(amo_fab_grad, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_acc)
AMO_ASCEND_KERNEL(amo_fab_acc, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_dkrope)
AMO_ASCEND_KERNEL(amo_fab_dkrope, 2)
#include AMO_ASCEND_KERNEL_HEADER(amo_fab_fused)
AMO_ASCEND_KERNEL(amo_fab_fused, 2)

namespace amo_ascend {
namespace host {

struct FaShape {
  int64_t T, Tk, H, Dq, Dk, Dr, Dv, B;
  bool rope;
  DType dt;
};

// What forward and backward share after the op-boundary checks: the backend's device, the Cube
// path's limits, the shapes.
template <class L>
FaShape fa_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& kRope,
                 const at::Tensor& cuSeqlens, const char* op) {
  L::check_device(q, "q");
  L::check_device(k, "k");
  L::check_device(v, "v");
  FaShape s{};
  // a k_rope of shape [Tk, 0] adds nothing to the scores: the kernels run without one (the backward
  // still returns a [Tk, 0] gradient, no_rope_grad)
  const bool given = kRope.has_value() && kRope->defined();
  if (given) L::check_device(*kRope, "k_rope");
  s.rope = given && kRope->size(1) > 0;
  s.dt = cube_dtype(q, op, "q");
  s.T = q.size(0), s.Tk = k.size(0), s.H = q.size(1), s.Dq = q.size(2), s.Dk = k.size(2), s.Dv = v.size(2);
  s.Dr = s.rope ? kRope->size(1) : 0;
  s.B = cuSeqlens.numel() - 1;
  TORCH_CHECK_VALUE(s.H * s.Dq < 65536 && s.H * s.Dv < 65536, op, ": q and v have H * Dq = ", s.H * s.Dq,
                    " and H * Dv = ", s.H * s.Dv, " (heads times head dim); the AscendC kernels need both < 65536 "
                    "(16-bit copy strides)");
  return s;
}

// The k_rope gradient when the kernels ran without a rope part: [Tk, 0] for a k_rope with no
// columns, [0] for none.
inline at::Tensor no_rope_grad(const c10::optional<at::Tensor>& kRope, int64_t Tk, const at::TensorOptions& o) {
  return kRope.has_value() && kRope->defined() ? at::zeros({Tk, 0}, o) : at::empty({0}, o);
}

// The tiling of one launch: a copy of t with its pass and step set.
template <class L>
at::Tensor step_tiling(const FlashAttentionTiling& t, FlashAttentionPass pass, int64_t step, const at::Tensor& like) {
  FlashAttentionTiling tt = t;
  tt.pass = pass;
  tt.step = static_cast<uint32_t>(step);
  return L::pod(tt, like);
}

inline LaunchPlan fa_cube(const FlashAttentionTiling& t, const ChipInfo& chip) {
  return cube_plan(t.blockDim, chip, t.l1Bytes, t.l0aBytes, t.l0bBytes, t.l0cBytes, /*exact=*/false);
}
inline LaunchPlan fa_vec(const FlashAttentionTiling& t, const ChipInfo& chip) {
  return vector_plan(t.vecBlockDim, chip, t.ubBytes, /*exact=*/false);  // one plan covers every phase
}
inline LaunchPlan fa_mix(const FlashAttentionTiling& t, const ChipInfo& chip) {
  return mix_plan(t.blockDim, chip, t.ubFusedBytes, t.l1Bytes, t.l0aBytes, t.l0bBytes, t.l0cBytes);
}

// GQA/MQA (Hkv < Hq) on these kernels, which take Hq key/value heads: the host expands k and v to
// the q heads (q head h reads kv head h / (Hq / Hkv), repeat_interleave on the device) and the
// backward sums the per-q-head dk / dv over each group in fp32, in fixed order (no atomics). Costs
// Hq / Hkv times the K/V memory; kernel-native GQA (the KV pass looping over the group's q heads) is
// left open (docs/ascend.md).
inline at::Tensor expand_kv_heads(const at::Tensor& t, int64_t group) {
  return group > 1 ? t.repeat_interleave(group, 1) : t;
}
inline at::Tensor sum_kv_group(const at::Tensor& g, int64_t group) {
  if (group == 1) return g;
  const int64_t T = g.size(0), Hq = g.size(1), D = g.size(2);
  return g.view({T, Hq / group, group, D}).to(at::kFloat).sum(2).to(g.scalar_type());
}

// cu_seqlens as the kernels read it: int64 on the device (one tensor when q and k share it).
inline std::pair<at::Tensor, at::Tensor> fa_cu(const at::Tensor& cuQ, const at::Tensor& cuK, const at::Device& dev) {
  auto cu = cuQ.to(dev, at::kLong, /*non_blocking=*/true).contiguous();
  auto cuk = cuK.is_same(cuQ) ? cu : cuK.to(dev, at::kLong, /*non_blocking=*/true).contiguous();
  return {cu, cuk};
}

template <class L>
std::tuple<at::Tensor, at::Tensor> flash_attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const c10::optional<at::Tensor>& kRope,
                                                       const at::Tensor& cuSeqlensQ, const at::Tensor& cuSeqlensK,
                                                       int64_t maxSeqlenQ, int64_t maxSeqlenK, bool causal,
                                                       double softmaxScale) {
  constexpr const char* op = "flash_attention_fwd";
  amo::checks::flash_attention_fwd(q, k, v, kRope, cuSeqlensQ, cuSeqlensK, maxSeqlenQ, maxSeqlenK, causal,
                                   softmaxScale);
  if (amo::checks::attention_is_empty(q, k)) return amo::checks::empty_attention_fwd(q, v);
  const int64_t group = q.size(1) / k.size(1);
  const FaShape s = fa_shape<L>(q, k, v, kRope, cuSeqlensQ, op);
  auto qc = q.contiguous(), kc = expand_kv_heads(k, group).contiguous(), vc = expand_kv_heads(v, group).contiguous();
  at::Tensor krc = s.rope ? kRope->contiguous() : at::Tensor();
  const ChipInfo chip = L::cube_chip(qc);
  FlashAttentionTiling t = compute_flash_attention_tiling(s.T, s.Tk, s.H, s.Dk, s.Dr, s.Dv, s.B, maxSeqlenQ, maxSeqlenK,
                                                          causal, s.dt, chip, L::cube_max_base());
  t.softmaxScale = static_cast<float>(softmaxScale);
  const auto f32 = qc.options().dtype(at::kFloat);
  if (t.key == FlashAttentionTilingKey::kEmpty)
    return {at::zeros({s.T, s.H, s.Dv}, qc.options()),
            at::full({s.H, s.T}, -std::numeric_limits<float>::infinity(), f32)};
  const auto [cu, cuk] = fa_cu(cuSeqlensQ, cuSeqlensK, qc.device());
  const FlashAttentionWorkspace ws = flash_attention_workspace(t);
  auto out = L::output({s.T, s.H, s.Dv}, qc.options());
  auto lse = L::output({s.H, s.T}, f32);
  if (fa_fused()) {
    // One mixed launch on blockDim AI Cores; one S / P / O_partial slot per AI Core (every slot row is
    // written before it is read, so no memset).
    check_fused_rows(t, "flash_attention_fwd");
    auto sWs = L::output({ws.fusedScore}, f32);
    auto pWs = L::output({ws.fusedScore}, qc.options());
    auto opWs = L::output({ws.fusedRows}, f32);
    const FlashAttentionFwdArgs a{gm_addr(qc),  gm_addr(kc),  gm_addr(vc),   gm_addr(krc), gm_addr(cu),
                                  gm_addr(cuk), gm_addr(sWs), gm_addr(pWs),  gm_addr(opWs), 0,
                                  0,            gm_addr(out), gm_addr(lse)};
    L::launch("amo_fa_fused", kernels::amo_fa_fused, fa_mix(t, chip), {qc, kc, vc, krc, cu, cuk, sWs, pWs, opWs, out, lse},
              L::pod(a, qc), step_tiling<L>(t, FlashAttentionPass::kForward, 0, qc));
    return {out, lse};
  }
  // Phase kernels (ASCEND_MOE_OPS_FA_KERNELS=phases): zeroed workspaces.
  auto sWs = at::zeros({ws.score}, f32);
  auto pWs = at::zeros({ws.score}, qc.options());
  auto opWs = at::zeros({ws.rows}, f32);
  auto oWs = at::zeros({ws.rows}, f32);
  auto stWs = at::zeros({ws.state}, f32);
  const FlashAttentionFwdArgs a{gm_addr(qc),  gm_addr(kc),  gm_addr(vc),   gm_addr(krc), gm_addr(cu),
                                gm_addr(cuk), gm_addr(sWs), gm_addr(pWs),  gm_addr(opWs), gm_addr(oWs),
                                gm_addr(stWs), gm_addr(out), gm_addr(lse)};
  auto args = L::pod(a, qc);
  const std::vector<at::Tensor> keep{qc, kc, vc, krc, cu, cuk, sWs, pWs, opWs, oWs, stWs, out, lse};
  for (int64_t j = 0; j < ws.steps; ++j) {
    auto tiling = step_tiling<L>(t, FlashAttentionPass::kForward, j, qc);
    L::launch("amo_fa_qk", kernels::amo_fa_qk, fa_cube(t, chip), keep, args, tiling);
    L::launch("amo_fa_softmax", kernels::amo_fa_softmax, fa_vec(t, chip), keep, args, tiling);
    L::launch("amo_fa_pv", kernels::amo_fa_pv, fa_cube(t, chip), keep, args, tiling);
    L::launch("amo_fa_update", kernels::amo_fa_update, fa_vec(t, chip), keep, args, tiling);
  }
  return {out, lse};
}

template <class L>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd(
    const at::Tensor& gradOut, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& kRope, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cuSeqlensQ,
    const at::Tensor& cuSeqlensK, int64_t maxSeqlenQ, int64_t maxSeqlenK, bool causal, double softmaxScale) {
  constexpr const char* op = "flash_attention_bwd";
  amo::checks::flash_attention_bwd(gradOut, q, k, v, kRope, out, lse, cuSeqlensQ, cuSeqlensK, maxSeqlenQ, maxSeqlenK,
                                   causal, softmaxScale);
  if (amo::checks::attention_is_empty(q, k))
    return {at::zeros_like(q), at::zeros_like(k), at::zeros_like(v),
            kRope.has_value() ? at::zeros_like(*kRope) : at::empty({0}, q.options())};
  const int64_t group = q.size(1) / k.size(1);
  const FaShape s = fa_shape<L>(q, k, v, kRope, cuSeqlensQ, op);
  L::check_device(gradOut, "grad_out");
  L::check_device(out, "out");
  L::check_device(lse, "lse");
  auto qc = q.contiguous(), kc = expand_kv_heads(k, group).contiguous(), vc = expand_kv_heads(v, group).contiguous();
  auto doc = gradOut.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor krc = s.rope ? kRope->contiguous() : at::Tensor();
  const ChipInfo chip = L::cube_chip(qc);
  FlashAttentionTiling t = compute_flash_attention_bwd_tiling(s.T, s.Tk, s.H, s.Dk, s.Dr, s.Dv, s.B, maxSeqlenQ,
                                                              maxSeqlenK, causal, s.dt, chip, L::cube_max_base());
  t.softmaxScale = static_cast<float>(softmaxScale);
  if (t.key == FlashAttentionTilingKey::kEmpty)
    return {at::zeros({s.T, s.H, s.Dq}, qc.options()), at::zeros(k.sizes(), qc.options()),
            at::zeros(v.sizes(), qc.options()),
            s.rope ? at::zeros({s.Tk, s.Dr}, qc.options()) : no_rope_grad(kRope, s.Tk, qc.options())};
  const auto [cu, cuk] = fa_cu(cuSeqlensQ, cuSeqlensK, qc.device());
  const FlashAttentionWorkspace w = flash_attention_workspace(t);  // t.pass == kBackwardKV: backward sizes
  const auto f32 = qc.options().dtype(at::kFloat);
  // fused: one slot per AI Core and the running sums in UB (no acc); phases: per-item workspaces and
  // GM running sums zeroed before each pass
  const bool fused = fa_fused();
  if (fused) check_fused_rows(t, op);
  const int64_t score = fused ? w.fusedScore : w.score, rowsWs = fused ? w.fusedRows : w.rows;
  auto delta = L::output({w.delta}, f32);
  auto sWs = L::output({score}, f32);
  auto dpWs = L::output({score}, f32);
  auto pWs = L::output({score}, qc.options());
  auto dsWs = L::output({score}, qc.options());
  auto part = L::output({rowsWs}, f32);
  auto acc = L::output({fused ? 0 : w.rows}, f32);
  auto dkRopeHeads = L::output({s.rope ? w.dkRopeHeads : 0}, f32);
  auto dq = L::output({s.T, s.H, s.Dq}, qc.options());
  auto dk = L::output({s.Tk, s.H, s.Dk}, qc.options());
  auto dv = L::output({s.Tk, s.H, s.Dv}, qc.options());
  auto dkRope = s.rope ? L::output({s.Tk, s.Dr}, qc.options()) : no_rope_grad(kRope, s.Tk, qc.options());
  // field order of FlashAttentionBwdArgs: inputs, delta, scores, gradient workspaces, dK_rope per head, outputs
  const FlashAttentionBwdArgs a{gm_addr(qc),   gm_addr(kc),   gm_addr(vc),  gm_addr(krc),  gm_addr(cu),
                                gm_addr(cuk),  gm_addr(oc),   gm_addr(doc),  gm_addr(lc),  gm_addr(delta), gm_addr(sWs),
                                gm_addr(dpWs), gm_addr(pWs),  gm_addr(dsWs), gm_addr(part), gm_addr(acc),
                                gm_addr(dkRopeHeads), gm_addr(dq), gm_addr(dk), gm_addr(dv), gm_addr(dkRope)};
  auto args = L::pod(a, qc);
  const std::vector<at::Tensor> keep{qc, kc, vc, krc, cu, cuk, oc, doc, lc, delta, sWs, dpWs, pWs, dsWs, part, acc,
                                     dkRopeHeads, dq, dk, dv, dkRope};
  // delta = rowsum(dout * out), once, with the tiling of the KV pass at step 0 (also used by amo_fab_dkrope)
  auto base = step_tiling<L>(t, FlashAttentionPass::kBackwardKV, 0, qc);
  L::launch("amo_fab_delta", kernels::amo_fab_delta, fa_vec(t, chip), keep, args, base);
  for (const FlashAttentionPass pass : {FlashAttentionPass::kBackwardKV, FlashAttentionPass::kBackwardQ}) {
    if (fused) {  // one mixed launch per pass
      L::launch("amo_fab_fused", kernels::amo_fab_fused, fa_mix(t, chip), keep, args, step_tiling<L>(t, pass, 0, qc));
      continue;
    }
    acc.zero_();  // on the NPU an op on the same stream, queued before this pass's launches
    for (int64_t j = 0; j < w.steps; ++j) {
      auto tiling = step_tiling<L>(t, pass, j, qc);
      L::launch("amo_fab_qk", kernels::amo_fab_qk, fa_cube(t, chip), keep, args, tiling);
      L::launch("amo_fab_softmax", kernels::amo_fab_softmax, fa_vec(t, chip), keep, args, tiling);
      L::launch("amo_fab_grad", kernels::amo_fab_grad, fa_cube(t, chip), keep, args, tiling);
      L::launch("amo_fab_acc", kernels::amo_fab_acc, fa_vec(t, chip), keep, args, tiling);
    }
  }
  if (s.rope)  // dK_rope = sum over heads of the per-head parts
    L::launch("amo_fab_dkrope", kernels::amo_fab_dkrope, fa_vec(t, chip), keep, args, base);
  return {dq, sum_kv_group(dk, group), sum_kv_group(dv, group), dkRope};
}

}  // namespace host
}  // namespace amo_ascend
