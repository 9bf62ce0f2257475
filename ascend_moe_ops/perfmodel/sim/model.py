"""The model side of the step simulator: shapes, parameter counts, FLOPs and activation bytes.

Everything here is arithmetic on a :class:`ModelSpec` (no hardware): the formulas are written out
in the docstrings so that a printed MFU can quote the one it used.

Notation: ``L`` layers (``L_d`` dense, the rest MoE), ``H`` hidden, MLA with ``n_h`` heads,
query LoRA rank ``r_q`` (0 = a plain ``H -> n_h*d_qk`` projection), KV LoRA rank ``r_kv``,
``d_n``/``d_r``/``d_v`` the nope, rope and value head dims (``d_qk = d_n + d_r``); ``E`` routed
experts of FFN size ``F``, ``S_e`` shared experts of FFN size ``F_s``, top-``K``; dense FFN ``F_d``;
vocabulary ``V``; sequence ``s``. Every FFN is SwiGLU: ``3 * H * F`` weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict

from ...ops.checks import check_bool, check_int

__all__ = ["ModelSpec", "PANGU_ULTRA_MOE", "CONVENTIONS", "flops_per_token", "attention_params",
           "expert_params", "layer_counts", "params", "activation_bytes_per_token"]


def _pos_int(name, v, zero_ok=False):
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero_ok else 1):
        raise ValueError(f"ModelSpec.{name} must be a {'non-negative' if zero_ok else 'positive'} int, got {v!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer with MLA attention (DeepSeek-V3 / Pangu Ultra MoE family)."""

    name: str
    layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    routed_experts: int
    shared_experts: int
    top_k: int
    expert_ffn: int
    dense_layers: int = 0
    dense_ffn: int = 0
    shared_ffn: int = 0          # 0 = expert_ffn
    vocab: int = 0
    seq_len: int = 4096

    def __post_init__(self):
        for k in ("layers", "hidden", "heads", "kv_lora_rank", "qk_nope_dim", "v_dim",
                  "routed_experts", "top_k", "expert_ffn", "seq_len"):
            _pos_int(k, getattr(self, k))
        for k in ("q_lora_rank", "qk_rope_dim", "shared_experts", "dense_layers", "dense_ffn",
                  "shared_ffn", "vocab"):
            _pos_int(k, getattr(self, k), zero_ok=True)
        if self.top_k > self.routed_experts:
            raise ValueError(f"ModelSpec.top_k={self.top_k} exceeds routed_experts={self.routed_experts}")
        if self.dense_layers > self.layers:
            raise ValueError(f"ModelSpec.dense_layers={self.dense_layers} exceeds layers={self.layers}")
        if self.dense_layers and not self.dense_ffn:
            raise ValueError("ModelSpec.dense_ffn must be given when dense_layers > 0")

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    @property
    def qk_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    @property
    def shared_ffn_size(self) -> int:
        return self.shared_ffn or self.expert_ffn

    def replace(self, **kw) -> "ModelSpec":
        return dataclasses.replace(self, **kw)


#: Pangu Ultra MoE (arXiv 2505.04519, Table 1 / Sec. 2): 61 layers, H 7680, 256 routed + 1 shared
#: expert of FFN 2048, top-8, MLA with 128 heads. Dims the report does not print are assumptions,
#: listed in docs/perfmodel/training_sim.md with the check that they give its 39B active / 718B total.
PANGU_ULTRA_MOE = ModelSpec(
    name="Pangu Ultra MoE", layers=61, hidden=7680, heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_dim=128, qk_rope_dim=64, v_dim=128, routed_experts=256, shared_experts=1, top_k=8,
    expert_ffn=2048, dense_layers=3, dense_ffn=18432, vocab=153376, seq_len=4096)


# ----------------------------------------------------------------------------- parameters
def attention_params(m: ModelSpec) -> int:
    """MLA weights of one layer: ``W_q`` (``H*r_q + r_q*n_h*d_qk``, or ``H*n_h*d_qk`` without a
    query LoRA) + ``W_kv_down`` ``H*(r_kv + d_r)`` + ``W_kv_up`` ``r_kv*n_h*(d_n + d_v)`` +
    ``W_o`` ``n_h*d_v*H`` (norm weights left out)."""
    H, nh = m.hidden, m.heads
    q = H * m.q_lora_rank + m.q_lora_rank * nh * m.qk_dim if m.q_lora_rank else H * nh * m.qk_dim
    return (q + H * (m.kv_lora_rank + m.qk_rope_dim) + m.kv_lora_rank * nh * (m.qk_nope_dim + m.v_dim)
            + nh * m.v_dim * H)


def expert_params(m: ModelSpec, ffn: int | None = None) -> int:
    """One SwiGLU expert: ``3 * H * F``."""
    return 3 * m.hidden * (m.expert_ffn if ffn is None else ffn)


def layer_counts(m: ModelSpec) -> Dict[str, int]:
    """Weights of one MoE layer and one dense layer, split by kind."""
    return dict(
        attention=attention_params(m),
        router=m.routed_experts * m.hidden,
        routed_experts=m.routed_experts * expert_params(m),
        routed_active=m.top_k * expert_params(m),
        shared=m.shared_experts * expert_params(m, m.shared_ffn_size),
        dense_ffn=expert_params(m, m.dense_ffn) if m.dense_layers else 0,
    )


def params(m: ModelSpec) -> Dict[str, int]:
    """``total`` and ``active`` (per token) weights; ``embedding`` (input table, no matmul FLOPs)
    and ``head`` (output projection ``V*H``, counted in ``active``)."""
    c = layer_counts(m)
    moe_total = c["attention"] + c["router"] + c["routed_experts"] + c["shared"]
    moe_active = c["attention"] + c["router"] + c["routed_active"] + c["shared"]
    dense = c["attention"] + c["dense_ffn"]
    emb = m.vocab * m.hidden
    total = m.moe_layers * moe_total + m.dense_layers * dense + 2 * emb
    active = m.moe_layers * moe_active + m.dense_layers * dense + emb
    return dict(total=total, active=active, embedding=emb, head=emb, moe_layer_total=moe_total,
                moe_layer_active=moe_active, dense_layer=dense)


# ----------------------------------------------------------------------------- FLOPs conventions
def attention_score_flops_fwd(m: ModelSpec, causal: bool) -> float:
    """Forward FLOPs per token per layer of ``QK^T`` and ``PV``: ``2*s*n_h*(d_qk + d_v)`` (every
    key), halved when ``causal`` (only the keys at or before the query)."""
    f = 2.0 * m.seq_len * m.heads * (m.qk_dim + m.v_dim)
    return f / 2 if causal else f


#: name -> (description, formula); see :func:`flops_per_token`
CONVENTIONS = {
    "6N": ("6 x active parameters (matmul weights incl. the output head)", "6*N_active"),
    "6N+attn": ("6N plus the attention score/value matmuls, causal (half the keys)",
                "6*N_active + 3*L*2*s*n_h*(d_qk+d_v)/2"),
    "6N+attn(full)": ("6N plus the attention matmuls over every key (PaLM / Megatron counting)",
                      "6*N_active + 3*L*2*s*n_h*(d_qk+d_v)"),
    "8N+attn(recompute)": ("6N+attn(full) plus one recomputed forward of everything (full recompute)",
                           "8*N_active + 4*L*2*s*n_h*(d_qk+d_v)"),
}


def flops_per_token(m: ModelSpec, convention: str = "6N") -> float:
    """Training FLOPs per token (forward + backward) under a named convention (:data:`CONVENTIONS`)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
    n = params(m)["active"]
    if convention == "6N":
        return 6.0 * n
    if convention == "6N+attn":
        return 6.0 * n + 3 * m.layers * attention_score_flops_fwd(m, causal=True)
    if convention == "6N+attn(full)":
        return 6.0 * n + 3 * m.layers * attention_score_flops_fwd(m, causal=False)
    return 8.0 * n + 4 * m.layers * attention_score_flops_fwd(m, causal=False)


# ----------------------------------------------------------------------------- activations
RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_token(m: ModelSpec, *, recompute: str = "none", tp: int = 1, sp: bool = True,
                               dtype_bytes: int = 2, moe: bool = True) -> float:
    """Bytes one layer keeps per token for its backward (one microbatch), on one device.

    ``recompute="none"``: attention keeps its input ``H``, the query latent ``r_q``, ``q``
    (``n_h*d_qk``), the KV latent ``r_kv + d_r``, ``K_nope, V`` (``n_h*(d_n + d_v)``), the attention
    output ``n_h*d_v`` and an fp32 LSE per head; the MoE layer keeps the router input ``H``, the
    permuted rows ``K*H``, the fc1 output ``K*2F/tp``, the SwiGLU output ``K*F/tp``, the expert
    output ``K*H`` (combine), and per shared expert ``H + 2F_s + F_s``.  ``"selective"`` (the report's
    fine-grained policy, what ``nn.MoELayer(recompute_permute, recompute_activation)`` and
    ``mla_attention(recompute="kv")`` do): minus the permuted rows, the SwiGLU outputs and
    ``K_nope, V``.  ``"full"``: only the layer input ``H``.  Tensor-parallel parts are divided by
    ``tp``; the ``H``-sized parts too when ``sp`` (sequence parallel).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    check_int("activation_bytes_per_token: tp", tp, minimum=1)
    check_int("activation_bytes_per_token: dtype_bytes", dtype_bytes, minimum=1)
    check_bool("activation_bytes_per_token: sp", sp)
    check_bool("activation_bytes_per_token: moe", moe)
    H, b = m.hidden, dtype_bytes
    hs = H / tp if sp else H
    if recompute == "full":
        return b * hs
    nh = m.heads
    kv_up = nh * (m.qk_nope_dim + m.v_dim) / tp
    attn = (hs + m.q_lora_rank + nh * m.qk_dim / tp + m.kv_lora_rank + m.qk_rope_dim + kv_up
            + nh * m.v_dim / tp) * b + 4 * nh / tp
    if recompute == "selective":
        attn -= kv_up * b
    if not moe:
        ffn = (hs + 3 * m.dense_ffn / tp) * b
        if recompute == "selective":
            ffn -= b * m.dense_ffn / tp
        return attn + ffn
    K, F = m.top_k, m.expert_ffn
    # rows of H: the permuted tokens and the expert outputs (full width: partial sums under expert
    # TP); rows of F: split over the (expert) tensor-parallel group
    routed = hs + K * H + (K * 2 * F + K * F) / tp + K * H
    if recompute == "selective":
        routed -= K * H + K * F / tp
    shared = m.shared_experts * (hs + 3 * m.shared_ffn_size / tp)
    return attn + (routed + shared) * b

