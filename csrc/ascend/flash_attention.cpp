// Host glue of flash_attention_fwd and flash_attention_bwd for Ascend NPUs (dispatch key PrivateUse1).
//
// checks -> cu_seqlens as int64 on the device (a device op; never read on the host, so no
// synchronization: max_seqlen from the caller bounds the work items) -> tiling
// (tiling/flash_attention_tiling.h) -> GM workspaces sized by flash_attention_workspace() -> one
// uint64 argument block (FlashAttentionFwdArgs / FlashAttentionBwdArgs) uploaded like the tiling ->
// the kernels of kernels/flash_attention_*.cpp on the current NPU stream inside torch_npu's task queue,
// with one uploaded copy of the tiling per launch (its `step` and `pass` fields set). The launch
// sequence mirrors the emulator host (emu_bindings.cpp). Default, the fused mixed kernels:
//
//   forward : amo_fa_fused (one launch)
//   backward: amo_fab_delta (AIV); amo_fab_fused for pass KV, then for pass Q; amo_fab_dkrope (AIV, k_rope only)
//
// and with ASCEND_MOE_OPS_FA_KERNELS=phases (host/fa_kernels.h) the phase kernels:
//
//   forward : for step j < steps: amo_fa_qk (AIC), amo_fa_softmax (AIV), amo_fa_pv (AIC), amo_fa_update (AIV)
//   backward: amo_fab_delta (AIV); for pass in (KV, Q): zero acc; for step j < steps:
//             amo_fab_qk (AIC), amo_fab_softmax (AIV), amo_fab_grad (AIC), amo_fab_acc (AIV);
//             amo_fab_dkrope (AIV, k_rope only)
//
// fp16/bf16 only (fp32 is refused: not implemented on the Cube path). Outputs are at::empty: the
// kernels write every element of a tensor whose cu_seqlens end at T (the Python wrapper asserts that
// on the device). The schemas are defined in ascend_moe_ops/_library.py; this file only adds the
// implementations. UNVERIFIED: type-checked with g++ only (tests/test_ascend_glue.py), never compiled
// with the CANN toolkit nor run on an NPU (docs/ascend.md).
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "host/fa_kernels.h"
#include "host/npu_common.h"
#include "tiling/flash_attention_tiling.h"

namespace amo_ascend {
namespace npu {

namespace {

struct FaShape {
  int64_t T, H, Dq, Dk, Dr, Dv, B;
  bool rope;
  DType dt;
};

uint64_t addr(const at::Tensor& t) { return reinterpret_cast<uint64_t>(ptr(t)); }

// Checks shared by forward and backward; names the offending argument.
FaShape check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const c10::optional<at::Tensor>& kRope, const at::Tensor& cuSeqlens, int64_t maxSeqlen,
                     const char* op) {
  check_npu(q, "q");
  check_npu(k, "k");
  check_npu(v, "v");
  TORCH_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16, op,
              " (AscendC Cube kernels): q must be float16 or bfloat16 (fp32 accumulation in L0C), got ",
              q.scalar_type(), "; fp32 inputs are not implemented on the NPU path");
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": k dtype ", k.scalar_type(), " differs from q dtype ",
              q.scalar_type());
  TORCH_CHECK(v.scalar_type() == q.scalar_type(), op, ": v dtype ", v.scalar_type(), " differs from q dtype ",
              q.scalar_type());
  TORCH_CHECK(q.dim() == 3, op, ": q must be [T, H, Dq], got ", q.sizes());
  TORCH_CHECK(k.dim() == 3, op, ": k must be [T, H, Dk], got ", k.sizes());
  TORCH_CHECK(v.dim() == 3, op, ": v must be [T, H, Dv], got ", v.sizes());
  FaShape s{};
  s.T = q.size(0);
  s.H = q.size(1);
  s.Dq = q.size(2);
  s.Dk = k.size(2);
  s.Dv = v.size(2);
  TORCH_CHECK(k.size(0) == s.T && k.size(1) == s.H, op, ": k must have q's tokens and heads [", s.T, ", ", s.H,
              ", Dk], got ", k.sizes());
  TORCH_CHECK(v.size(0) == s.T && v.size(1) == s.H, op, ": v must have q's tokens and heads [", s.T, ", ", s.H,
              ", Dv], got ", v.sizes());
  s.rope = kRope.has_value() && kRope->defined();
  if (s.rope) {
    check_npu(*kRope, "k_rope");
    TORCH_CHECK(kRope->scalar_type() == q.scalar_type(), op, ": k_rope dtype ", kRope->scalar_type(),
                " differs from q dtype ", q.scalar_type());
    TORCH_CHECK(kRope->dim() == 2 && kRope->size(0) == s.T, op, ": k_rope must be [T=", s.T, ", Dr], got ",
                kRope->sizes());
    s.Dr = kRope->size(1);
  }
  TORCH_CHECK(s.Dq == s.Dk + s.Dr, op, ": q head dim ", s.Dq, " must equal Dk + Dr = ", s.Dk, " + ", s.Dr,
              " (k head dim + k_rope width)");
  TORCH_CHECK(s.H * s.Dq < 65536 && s.H * s.Dv < 65536, op, " (AscendC): H * Dq = ", s.H * s.Dq, " and H * Dv = ",
              s.H * s.Dv, " must be < 65536 (16-bit copy strides)");
  TORCH_CHECK(cuSeqlens.dim() == 1 && cuSeqlens.numel() >= 1, op, ": cu_seqlens must be [B + 1], got ",
              cuSeqlens.sizes());
  TORCH_CHECK(cuSeqlens.scalar_type() == at::kInt || cuSeqlens.scalar_type() == at::kLong, op,
              ": cu_seqlens must be int32 or int64, got ", cuSeqlens.scalar_type());
  TORCH_CHECK(maxSeqlen >= 0, op, ": max_seqlen must be >= 0, got ", maxSeqlen);
  s.B = cuSeqlens.numel() - 1;
  s.dt = q.scalar_type() == at::kHalf ? DType::kF16 : DType::kBF16;
  return s;
}

// The schema's seqlen_q != seqlen_k and GQA/MQA (Hkv != Hq) are not done by these kernels yet (one
// cu_seqlens and H heads for q and k): NotImplementedError naming the feature. cu_seqlens_q and
// cu_seqlens_k passed as the same tensor (the public function and MLA do for equal lengths) are not
// read; two different tensors are compared on the device (one synchronization).
void check_features(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cuQ, const at::Tensor& cuK,
                    const char* op) {
  TORCH_CHECK_NOT_IMPLEMENTED(k.dim() != 3 || q.dim() != 3 || k.size(1) == q.size(1), op,
                              ": AscendC backend: GQA/MQA (Hkv != Hq) not supported yet");
  const bool same = cuQ.is_same(cuK) ||
                    (q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && cuQ.numel() == cuK.numel() &&
                     at::equal(cuQ, cuK.to(cuQ.device(), cuQ.scalar_type())));
  TORCH_CHECK_NOT_IMPLEMENTED(same, op, ": AscendC backend: seqlen_q != seqlen_k not supported yet");
}

// cu_seqlens as int64 on q's device: a device copy/cast, no host read (its values are asserted on the
// device by the Python wrapper; max_seqlen >= every sequence length is the caller's promise).
at::Tensor device_cu(const at::Tensor& cuSeqlens, const at::Tensor& like) {
  return cuSeqlens.to(like.device(), at::kLong, /*non_blocking=*/true).contiguous();
}

// One kernel launch (every kernel takes (GM_ADDR gmArgs, GM_ADDR tiling)).
template <typename Launcher>
void launch_phase(const char* name, Launcher launcher, uint32_t blockDim, const at::Tensor& args,
                  const at::Tensor& tiling, std::vector<at::Tensor> keep) {
  keep.push_back(args);
  keep.push_back(tiling);
  run_on_stream(name, [=](aclrtStream stream) {
    return launcher(blockDim, stream, ptr(args), ptr(tiling));
  }, std::move(keep));
}

// The tiling of one phase launch: a copy of t with its pass and step set, uploaded once.
at::Tensor step_tiling(const FlashAttentionTiling& t, FlashAttentionPass pass, int64_t step, const at::Tensor& like) {
  FlashAttentionTiling tt = t;
  tt.pass = pass;
  tt.step = static_cast<uint32_t>(step);
  return upload_tiling(tt, like);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> flash_attention_fwd_npu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                           const c10::optional<at::Tensor>& kRope,
                                                           const at::Tensor& cuSeqlens, const at::Tensor& cuSeqlensK,
                                                           int64_t maxSeqlenQ, int64_t maxSeqlenK, bool causal,
                                                           double softmaxScale) {
  check_features(q, k, cuSeqlens, cuSeqlensK, "flash_attention_fwd");
  const int64_t maxSeqlen = std::max(maxSeqlenQ, maxSeqlenK);
  const FaShape s = check_inputs(q, k, v, kRope, cuSeqlens, maxSeqlen, "flash_attention_fwd");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor krc = s.rope ? kRope->contiguous() : at::Tensor();
  const ChipInfo chip = chip_info(qc);
  FlashAttentionTiling t =
      compute_flash_attention_tiling(s.T, s.H, s.Dk, s.Dr, s.Dv, s.B, maxSeqlen, causal, s.dt, chip);
  t.softmaxScale = static_cast<float>(softmaxScale);
  const auto f32 = qc.options().dtype(at::kFloat);
  if (s.T == 0 || t.key == FlashAttentionTilingKey::kEmpty)
    return {at::zeros({s.T, s.H, s.Dv}, qc.options()),
            at::full({s.H, s.T}, -std::numeric_limits<float>::infinity(), f32)};
  auto cu = device_cu(cuSeqlens, qc);
  const FlashAttentionWorkspace ws = flash_attention_workspace(t);
  auto out = at::empty({s.T, s.H, s.Dv}, qc.options());
  auto lse = at::empty({s.H, s.T}, f32);
  if (host::fa_fused()) {
    // One mixed launch on blockDim AI Cores; one S / P / O_partial slot per AI Core (every slot row is
    // written before it is read, so no memset).
    host::check_fused_rows(t, "flash_attention_fwd");
    auto sWs = at::empty({ws.fusedScore}, f32);
    auto pWs = at::empty({ws.fusedScore}, qc.options());
    auto opWs = at::empty({ws.fusedRows}, f32);
    const FlashAttentionFwdArgs a{addr(qc), addr(kc), addr(vc), s.rope ? addr(krc) : 0, addr(cu), addr(sWs),
                                  addr(pWs), addr(opWs), 0, 0, addr(out), addr(lse)};
    auto args = upload_tiling(a, qc);
    auto tiling = step_tiling(t, FlashAttentionPass::kForward, 0, qc);
    launch_phase("amo_fa_fused", aclrtlaunch_amo_fa_fused, t.blockDim, args, tiling,
                 {qc, kc, vc, krc, cu, sWs, pWs, opWs, out, lse});
    return {out, lse};
  }
  // Phase kernels (ASCEND_MOE_OPS_FA_KERNELS=phases): workspaces zeroed like the emulator's.
  auto sWs = at::zeros({ws.score}, f32);
  auto pWs = at::zeros({ws.score}, qc.options());
  auto opWs = at::zeros({ws.rows}, f32);
  auto oWs = at::zeros({ws.rows}, f32);
  auto stWs = at::zeros({ws.state}, f32);
  const FlashAttentionFwdArgs a{addr(qc),  addr(kc),  addr(vc), s.rope ? addr(krc) : 0, addr(cu),  addr(sWs),
                                addr(pWs), addr(opWs), addr(oWs), addr(stWs), addr(out), addr(lse)};
  auto args = upload_tiling(a, qc);
  const std::vector<at::Tensor> keep{qc, kc, vc, krc, cu, sWs, pWs, opWs, oWs, stWs, out, lse};
  for (int64_t j = 0; j < ws.steps; ++j) {
    auto tiling = step_tiling(t, FlashAttentionPass::kForward, j, qc);
    launch_phase("amo_fa_qk", aclrtlaunch_amo_fa_qk, t.blockDim, args, tiling, keep);
    launch_phase("amo_fa_softmax", aclrtlaunch_amo_fa_softmax, t.vecBlockDim, args, tiling, keep);
    launch_phase("amo_fa_pv", aclrtlaunch_amo_fa_pv, t.blockDim, args, tiling, keep);
    launch_phase("amo_fa_update", aclrtlaunch_amo_fa_update, t.vecBlockDim, args, tiling, keep);
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> flash_attention_bwd_npu(
    const at::Tensor& gradOut, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const c10::optional<at::Tensor>& kRope, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cuSeqlens,
    const at::Tensor& cuSeqlensK, int64_t maxSeqlenQ, int64_t maxSeqlenK, bool causal, double softmaxScale) {
  const char* op = "flash_attention_bwd";
  check_features(q, k, cuSeqlens, cuSeqlensK, op);
  const int64_t maxSeqlen = std::max(maxSeqlenQ, maxSeqlenK);
  const FaShape s = check_inputs(q, k, v, kRope, cuSeqlens, maxSeqlen, op);
  check_npu(gradOut, "grad_out");
  check_npu(out, "out");
  check_npu(lse, "lse");
  TORCH_CHECK(gradOut.scalar_type() == q.scalar_type(), op, ": grad_out dtype ", gradOut.scalar_type(),
              " differs from q dtype ", q.scalar_type());
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), op, ": out dtype ", out.scalar_type(), " differs from q dtype ",
              q.scalar_type());
  TORCH_CHECK(gradOut.dim() == 3 && gradOut.size(0) == s.T && gradOut.size(1) == s.H && gradOut.size(2) == s.Dv, op,
              ": grad_out must be [T, H, Dv] = [", s.T, ", ", s.H, ", ", s.Dv, "], got ", gradOut.sizes());
  TORCH_CHECK(out.dim() == 3 && out.size(0) == s.T && out.size(1) == s.H && out.size(2) == s.Dv, op,
              ": out must be [T, H, Dv] = [", s.T, ", ", s.H, ", ", s.Dv, "], got ", out.sizes());
  TORCH_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32 (the forward's), got ", lse.scalar_type());
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == s.H && lse.size(1) == s.T, op, ": lse must be [H, T] = [", s.H, ", ",
              s.T, "], got ", lse.sizes());
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto doc = gradOut.contiguous(), oc = out.contiguous(), lc = lse.contiguous();
  at::Tensor krc = s.rope ? kRope->contiguous() : at::Tensor();
  const ChipInfo chip = chip_info(qc);
  FlashAttentionTiling t =
      compute_flash_attention_bwd_tiling(s.T, s.H, s.Dk, s.Dr, s.Dv, s.B, maxSeqlen, causal, s.dt, chip);
  t.softmaxScale = static_cast<float>(softmaxScale);
  if (s.T == 0 || t.key == FlashAttentionTilingKey::kEmpty)
    return {at::zeros({s.T, s.H, s.Dq}, qc.options()), at::zeros({s.T, s.H, s.Dk}, qc.options()),
            at::zeros({s.T, s.H, s.Dv}, qc.options()),
            s.rope ? at::zeros({s.T, s.Dr}, qc.options()) : at::empty({0}, qc.options())};
  auto cu = device_cu(cuSeqlens, qc);
  const FlashAttentionWorkspace w = flash_attention_workspace(t);  // t.pass == kBackwardKV: backward sizes
  const auto f32 = qc.options().dtype(at::kFloat);
  // fused: one slot per AI Core and the running sums in UB (no acc); phases: per-item workspaces and
  // GM running sums zeroed before each pass
  const bool fused = host::fa_fused();
  if (fused) host::check_fused_rows(t, op);
  const int64_t score = fused ? w.fusedScore : w.score, rowsWs = fused ? w.fusedRows : w.rows;
  auto delta = at::empty({w.delta}, f32);
  auto sWs = at::empty({score}, f32);
  auto dpWs = at::empty({score}, f32);
  auto pWs = at::empty({score}, qc.options());
  auto dsWs = at::empty({score}, qc.options());
  auto part = at::empty({rowsWs}, f32);
  auto acc = at::empty({fused ? 0 : w.rows}, f32);
  auto dkRopeHeads = s.rope ? at::empty({w.dkRopeHeads}, f32) : at::empty({0}, f32);
  auto dq = at::empty({s.T, s.H, s.Dq}, qc.options());
  auto dk = at::empty({s.T, s.H, s.Dk}, qc.options());
  auto dv = at::empty({s.T, s.H, s.Dv}, qc.options());
  auto dkRope = s.rope ? at::empty({s.T, s.Dr}, qc.options()) : at::empty({0}, qc.options());
  // field order of FlashAttentionBwdArgs: inputs, delta, scores, gradient workspaces, dK_rope per head, outputs
  const FlashAttentionBwdArgs a{addr(qc),    addr(kc),   addr(vc),  s.rope ? addr(krc) : 0, addr(cu), addr(oc),
                                addr(doc),   addr(lc),   addr(delta), addr(sWs), addr(dpWs), addr(pWs), addr(dsWs),
                                addr(part),  addr(acc),  s.rope ? addr(dkRopeHeads) : 0,
                                addr(dq),    addr(dk),   addr(dv),  s.rope ? addr(dkRope) : 0};
  auto args = upload_tiling(a, qc);
  const std::vector<at::Tensor> keep{qc, kc, vc, krc, cu, oc, doc, lc, delta, sWs, dpWs, pWs, dsWs, part, acc,
                                     dkRopeHeads, dq, dk, dv, dkRope};
  // delta = rowsum(dout * out), once, with the tiling of the KV pass at step 0 (also used by amo_fab_dkrope)
  auto base = step_tiling(t, FlashAttentionPass::kBackwardKV, 0, qc);
  launch_phase("amo_fab_delta", aclrtlaunch_amo_fab_delta, t.vecBlockDim, args, base, keep);
  for (const FlashAttentionPass pass : {FlashAttentionPass::kBackwardKV, FlashAttentionPass::kBackwardQ}) {
    if (fused) {  // one mixed launch per pass
      launch_phase("amo_fab_fused", aclrtlaunch_amo_fab_fused, t.blockDim, args, step_tiling(t, pass, 0, qc), keep);
      continue;
    }
    acc.zero_();  // an NPU op on the same stream, queued before this pass's launches
    for (int64_t j = 0; j < w.steps; ++j) {
      auto tiling = step_tiling(t, pass, j, qc);
      launch_phase("amo_fab_qk", aclrtlaunch_amo_fab_qk, t.blockDim, args, tiling, keep);
      launch_phase("amo_fab_softmax", aclrtlaunch_amo_fab_softmax, t.vecBlockDim, args, tiling, keep);
      launch_phase("amo_fab_grad", aclrtlaunch_amo_fab_grad, t.blockDim, args, tiling, keep);
      launch_phase("amo_fab_acc", aclrtlaunch_amo_fab_acc, t.vecBlockDim, args, tiling, keep);
    }
  }
  if (s.rope)  // dK_rope = sum over heads of the per-head parts
    launch_phase("amo_fab_dkrope", aclrtlaunch_amo_fab_dkrope, t.vecBlockDim, args, base, keep);
  return {dq, dk, dv, dkRope};
}

}  // namespace npu
}  // namespace amo_ascend

TORCH_LIBRARY_IMPL(ascend_moe_ops, PrivateUse1, m) {
  m.impl("flash_attention_fwd", &amo_ascend::npu::flash_attention_fwd_npu);
  m.impl("flash_attention_bwd", &amo_ascend::npu::flash_attention_bwd_npu);
}
