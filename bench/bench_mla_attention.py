"""Benchmark of mla_attention and flash_attention (192/128), forward and forward+backward, plus the
activation memory saved for backward.

Run by ``python -m ascend_moe_ops.bench`` through :func:`run` (and :func:`parity`); the
``python -m pytest bench`` collects the same cases for pytest-benchmark.

Shapes: B=1, real MLA head dims (q/k 192 = nope 128 + rope 64, v 128, latent 512), bf16, causal;
``--full``: S=1024 with H=8 and S=2048 with H=16 (the issue's targets); quick: S=512, H=8.

Peer, timed in the same process: the naive PyTorch MLA a training framework writes without a
fused kernel: up-project the latent with ``F.linear``, expand the shared rope key to every head
and ``torch.cat`` it to the nope keys, then ``F.scaled_dot_product_attention(is_causal=True)``
(on the CPU with d_qk != d_v that is PyTorch's math path). For ``flash_attention`` the peer is
``scaled_dot_product_attention`` on the same q/k/v.

FLOP formula (attention only, the up-projection is the same GEMM in both and not counted):
forward ``2 * B*H * P * (Dqk + Dv)`` with ``P = S*(S+1)/2`` causal (query, key) pairs; forward +
backward adds ``2 * B*H * P * (2*Dqk + 2*Dv + Dqk)`` (backward: QK^T recompute, dP = dO V^T,
dV = P^T dO, dQ = dS K, dK = dS^T Q).

Saved-activation bytes are measured with ``torch.autograd.graph.saved_tensors_hooks`` (every tensor
autograd keeps for backward, counted once per storage), at H=128 as in the real models.
The Triton backend is not timed on the CPU (its interpreter says nothing about speed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ascend_moe_ops as amo
from ascend_moe_ops.bench import Row, parity_row

OP = "mla_attention"
DN, DR, DV, DC = 128, 64, 128, 512
DQK = DN + DR
SCALE = 0.1352  # DeepSeek-V3's YaRN-adjusted softmax scale
DTYPE = torch.bfloat16
FULL_CASES = [(1024, 8), (2048, 16)]
QUICK_CASES = [(512, 8)]
MEM_HEADS = 128
FWD_FORMULA = "flops = 2*B*H*P*(Dqk+Dv), P = S(S+1)/2 causal pairs, Dqk=192, Dv=128"
PATH_MLA = "MLA training attention from the latent (DeepSeek-V3 / Pangu MLA layer, recompute='kv')"
PATH_FA = "flash attention on expanded q/k 192, v 128 (what a framework calls after up-projecting)"
FWDBWD_FORMULA = "flops = 2*B*H*P*(Dqk+Dv) + 2*B*H*P*(3*Dqk+2*Dv) (bwd incl. QK^T recompute)"


def naive_mla(q, c_kv, k_pe, w_kv_up, H, scale=SCALE):
    """The peer: up-project, expand the rope key per head, concatenate, SDPA."""
    B, S, _ = c_kv.shape
    kv = F.linear(c_kv, w_kv_up).view(B, S, H, DN + DV)
    k_nope, v = kv.split([DN, DV], dim=-1)
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, H, DR)], dim=-1)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return o.transpose(1, 2)


def ours_mla(q, c_kv, k_pe, w_kv_up, H, recompute="kv"):
    return amo.mla_attention(q, c_kv, k_pe, w_kv_up, num_heads=H, qk_nope_dim=DN, v_dim=DV,
                             softmax_scale=SCALE, causal=True, recompute=recompute)


def make_inputs(S, H, device, dtype=DTYPE, B=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, DQK, generator=g).to(device, dtype)
    c = torch.randn(B, S, DC, generator=g).to(device, dtype)
    kpe = torch.randn(B, S, DR, generator=g).to(device, dtype)
    w = (torch.randn(H * (DN + DV), DC, generator=g) / DC ** 0.5).to(device, dtype)
    return q, c, kpe, w


def saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn(*inputs)`` runs."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    xs = [t.detach().requires_grad_() for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*xs)
    del out
    return sum(seen.values())


def memory_figures(device, S=64, H=MEM_HEADS):
    """Saved-activation bytes at H=128 (a ratio, so a short S suffices; the weight is left out:
    it is a parameter, not an activation)."""
    q, c, kpe, w = make_inputs(S, H, device)
    wbytes = w.numel() * w.element_size()
    res = {}
    for name, fn in (("naive", lambda q, c, k, w: naive_mla(q, c, k, w, H)),
                     ("recompute_kv", lambda q, c, k, w: ours_mla(q, c, k, w, H, "kv")),
                     ("recompute_none", lambda q, c, k, w: ours_mla(q, c, k, w, H, "none"))):
        res[name] = saved_bytes(fn, q, c, kpe, w) - wbytes
    # the naive module on CPU saves the S x S probabilities too; this is what it saves besides them
    probs = H * S * S * q.element_size()
    return dict(S=S, H=H, naive_saved_bytes=res["naive"], kv_saved_bytes=res["recompute_kv"],
                none_saved_bytes=res["recompute_none"],
                ratio_kv_vs_naive=round(res["recompute_kv"] / res["naive"], 4),
                ratio_none_vs_naive=round(res["recompute_none"] / res["naive"], 4),
                naive_attention_probs_bytes=probs,
                ratio_kv_vs_naive_without_probs=round(res["recompute_kv"] / max(1, res["naive"] - probs), 4))


def _flops(S, H, B=1):
    P = S * (S + 1) // 2
    fwd = 2 * B * H * P * (DQK + DV)
    return fwd, fwd + 2 * B * H * P * (3 * DQK + 2 * DV)


def _fwd_bwd(fn, inputs):
    xs = [t.detach().requires_grad_() for t in inputs]

    def step():
        out = fn(*xs)
        out.backward(torch.ones_like(out))
    return step


def run(ctx):
    rows = []
    dev = ctx.device
    backend = amo.active_backend("mla_attention_fwd", dev)
    mem = memory_figures(dev)
    for S, H in (QUICK_CASES if ctx.quick else FULL_CASES):
        case = f"B=1 S={S} H={H} 192/128 causal"
        fl_f, fl_fb = _flops(S, H)
        q, c, kpe, w = make_inputs(S, H, dev)
        mine = lambda q, c, k, w: ours_mla(q, c, k, w, H)  # noqa: E731
        peer = lambda q, c, k, w: naive_mla(q, c, k, w, H)  # noqa: E731
        with torch.no_grad():
            t_f = ctx.time(lambda: mine(q, c, kpe, w))
            p_f = ctx.time(lambda: peer(q, c, kpe, w))
        t_fb = ctx.time(_fwd_bwd(mine, (q, c, kpe, w)))
        p_fb = ctx.time(_fwd_bwd(peer, (q, c, kpe, w)))
        here = dict(saved_bytes_kv=saved_bytes(mine, q, c, kpe, w) - w.numel() * 2,
                    saved_bytes_naive=saved_bytes(peer, q, c, kpe, w) - w.numel() * 2)
        rows.append(Row(op="mla_attention", case=case + " fwd", backend=backend, dtype="bf16",
                        seconds=t_f, flops=fl_f, formula=FWD_FORMULA, limit="flops",
                        peers={"naive PyTorch MLA": p_f}, path=PATH_MLA))
        rows.append(Row(op="mla_attention", case=case + " fwd+bwd", backend=backend, dtype="bf16",
                        seconds=t_fb, flops=fl_fb, formula=FWDBWD_FORMULA, limit="flops",
                        peers={"naive PyTorch MLA": p_fb}, path=PATH_MLA,
                        extra=dict(here, **{f"H128_{k}": v for k, v in mem.items()})))
        # flash attention alone on the expanded 192-dim keys (q/k 192, v 128)
        k_full = torch.cat([c.new_zeros(1, S, H, DN).normal_(), kpe[:, :, None].expand(1, S, H, DR)], -1)
        v = torch.randn(1, S, H, DV).to(dev, DTYPE)
        fa = lambda q, k, v: amo.flash_attention(q, k, v, softmax_scale=SCALE, causal=True)  # noqa: E731
        sd = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=SCALE).transpose(1, 2)
        with torch.no_grad():
            t_f = ctx.time(lambda: fa(q, k_full, v))
            p_f = ctx.time(lambda: sd(q, k_full, v))
        t_fb = ctx.time(_fwd_bwd(fa, (q, k_full, v)))
        p_fb = ctx.time(_fwd_bwd(sd, (q, k_full, v)))
        b2 = amo.active_backend("flash_attention_fwd", dev)
        rows.append(Row(op="flash_attention", case=case + " fwd", backend=b2, dtype="bf16", seconds=t_f,
                        flops=fl_f, formula=FWD_FORMULA, limit="flops", peers={"torch SDPA": p_f},
                        path=PATH_FA))
        rows.append(Row(op="flash_attention", case=case + " fwd+bwd", backend=b2, dtype="bf16",
                        seconds=t_fb, flops=fl_fb, formula=FWDBWD_FORMULA, limit="flops",
                        peers={"torch SDPA": p_fb}, path=PATH_FA))
    return rows


def _out_and_grads(ins, H, do):
    xs = [t.detach().clone().requires_grad_() for t in ins]
    out = ours_mla(*xs, H)
    out.backward(do)
    return [out.detach()] + [t.grad for t in xs]


def parity(ctx):
    """mla_attention vs the fp64 reference on a small shape: the default backend (fp32 and bf16
    output), and, where the emulator is built, the AscendC path (ascendc-emu: the grouped GEMM and
    fused flash attention kernels) in bf16, output and every gradient."""
    out = []
    S, H = 64, 4
    backend = amo.active_backend("mla_attention_fwd", ctx.device)
    for dtype in (torch.float32, torch.bfloat16):
        ins = make_inputs(S, H, ctx.device, dtype=dtype)
        got = ours_mla(*ins, H)
        with amo.use_backend("reference"):
            ref = ours_mla(*(t.double() for t in ins), H)
            low = ours_mla(*ins, H)
        out.append(parity_row(OP, f"B=1 S={S} H={H} out", backend, got, ref, low))
    if "ascendc-emu" in amo.available_backends("mla_attention_fwd", ctx.device):
        ins = make_inputs(S, H, ctx.device, dtype=torch.bfloat16)
        do = torch.randn(1, S, H, DV, generator=torch.Generator().manual_seed(1)).to(ctx.device, torch.bfloat16)
        with amo.use_backend("ascendc-emu"):
            got = _out_and_grads(ins, H, do)
        with amo.use_backend("reference"):
            ref = _out_and_grads([t.double() for t in ins], H, do.double())
            low = _out_and_grads(ins, H, do)
        for name, a, r, lo in zip(("out", "dq", "dc_kv", "dk_pe", "dw_kv_up"), got, ref, low):
            out.append(parity_row(OP, f"B=1 S={S} H={H} {name}", "ascendc-emu", a, r, lo))
    return out
