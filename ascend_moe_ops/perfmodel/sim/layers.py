"""The ops of one layer's forward and backward, as the simulator prices them.

:func:`moe_layer_ops` lists what ``ascend_moe_ops.nn.MoELayer`` runs (router, ``moe_permute``,
fc1 grouped GEMM, SwiGLU, fc2 grouped GEMM, ``moe_unpermute``, optional shared expert), in the
granularity the CPU calibration measures (one op per component and direction; the backward of a
grouped GEMM is its dX and dW together). :func:`attention_ops` lists an MLA attention block. FLOPs
and bytes are analytic; ``imbalance`` multiplies the routed-expert work of the busiest device.
"""

from __future__ import annotations

from typing import List, Tuple

from .costs import DTYPE_BYTES, Op
from .model import ModelSpec

__all__ = ["moe_layer_ops", "attention_ops", "dense_ffn_ops", "op_names"]


def _b(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}") from None


def moe_layer_ops(T: int, H: int, F: int, E: int, K: int, *, dtype: str = "bfloat16",
                  recompute_permute: bool = False, recompute_activation: bool = False,
                  shared_ffn: int = 0, tp: int = 1, imbalance: float = 1.0,
                  experts_per_device: int | None = None) -> Tuple[List[Op], List[Op]]:
    """``(forward ops, backward ops)`` of one MoE layer on ``T`` tokens (per device).

    ``N = T*K*imbalance/tp`` expert rows on the busiest device (``tp``: expert tensor parallel
    splits ``F``); fc1 ``2*N*H*2F`` FLOPs, fc2 ``2*N*F*H``, backward twice each (dX + dW).
    Router ``2*T*H*E``. Permute / unpermute move ``N*H`` elements each way.
    """
    for name, v in (("T", T), ("H", H), ("F", F), ("E", E), ("K", K), ("tp", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"moe_layer_ops: {name} must be a positive int, got {v!r}")
    if K > E:
        raise ValueError(f"moe_layer_ops: K={K} exceeds E={E}")
    if not imbalance >= 1.0:
        raise ValueError(f"moe_layer_ops: imbalance must be >= 1 (busiest device / mean), got {imbalance!r}")
    b = _b(dtype)
    G = experts_per_device or E
    Ff = F / tp
    N = T * K * imbalance
    rows = int(round(N))
    w1, w2 = G * H * 2 * Ff * b, G * Ff * H * b
    fwd = [
        Op("router", "router", 2.0 * T * H * E, (T * H + E * H) * b + 3 * T * E * 4, dtype, K, T),
        Op("permute", "permute", 0.0, 2.0 * N * H * b + T * K * 16, dtype, G, rows),
        Op("fc1", "grouped_gemm", 2.0 * N * H * 2 * Ff, (N * H + N * 2 * Ff) * b + w1, dtype, G, rows),
        Op("swiglu", "swiglu", 0.0, 3.0 * N * Ff * b, dtype, 1, rows),
        Op("fc2", "grouped_gemm", 2.0 * N * Ff * H, (N * Ff + N * H) * b + w2, dtype, G, rows),
        Op("unpermute", "unpermute", 0.0, (N * H + T * H) * b + T * K * 12, dtype, K, T),
    ]
    bwd = [
        Op("unpermute_bwd", "unpermute_bwd", 0.0, (2 * N * H + T * H) * b + T * K * 16, dtype, K, T),
        Op("fc2_bwd", "grouped_gemm_bwd", 4.0 * N * Ff * H, (2 * N * Ff + 2 * N * H) * b + 2 * w2, dtype, G, rows),
        Op("swiglu_bwd", "swiglu_bwd", 0.0, 5.0 * N * Ff * b, dtype, 1, rows),
        Op("fc1_bwd", "grouped_gemm_bwd", 8.0 * N * H * Ff, (2 * N * H + 4 * N * Ff) * b + 2 * w1, dtype, G, rows),
        Op("permute_bwd", "permute_bwd", 0.0, (N * H + T * H) * b + T * K * 8, dtype, K, T),
        Op("router_bwd", "router_bwd", 4.0 * T * H * E, (2 * T * H + 2 * E * H) * b + 4 * T * E * 4, dtype, K, T),
    ]
    if recompute_permute:  # the [N, H] rows rebuilt from the tokens before fc1's backward
        bwd.insert(3, Op("permute(recompute)", "permute", 0.0, 2.0 * N * H * b + T * K * 16, dtype, G, rows))
    if recompute_activation:  # SwiGLU recomputed from fc1's output before fc2's backward
        bwd.insert(1, Op("swiglu(recompute)", "swiglu", 0.0, 3.0 * N * Ff * b, dtype, 1, rows))
    if shared_ffn:
        fwd += dense_ffn_ops(T, H, shared_ffn, dtype=dtype, tp=tp, prefix="shared_")[0]
        bwd = dense_ffn_ops(T, H, shared_ffn, dtype=dtype, tp=tp, prefix="shared_")[1] + bwd
    return fwd, bwd


def dense_ffn_ops(T: int, H: int, F: int, *, dtype: str = "bfloat16", tp: int = 1,
                  prefix: str = "ffn_") -> Tuple[List[Op], List[Op]]:
    """A SwiGLU MLP on ``T`` tokens, ``F`` split over ``tp``: two GEMMs (``2*T*H*2F/tp`` and
    ``2*T*F*H/tp``), backward twice."""
    b, Ff = _b(dtype), F / tp
    fwd = [Op(prefix + "fc1", "gemm", 2.0 * T * H * 2 * Ff, (T * H + H * 2 * Ff + T * 2 * Ff) * b, dtype, 1, T),
           Op(prefix + "swiglu", "swiglu", 0.0, 3.0 * T * Ff * b, dtype, 1, T),
           Op(prefix + "fc2", "gemm", 2.0 * T * Ff * H, (T * Ff + Ff * H + T * H) * b, dtype, 1, T)]
    bwd = [Op(prefix + "fc2_bwd", "gemm", 4.0 * T * Ff * H, 2 * (T * Ff + Ff * H + T * H) * b, dtype, 1, T),
           Op(prefix + "swiglu_bwd", "swiglu_bwd", 0.0, 5.0 * T * Ff * b, dtype, 1, T),
           Op(prefix + "fc1_bwd", "gemm", 8.0 * T * H * Ff, 2 * (T * H + H * 2 * Ff + T * 2 * Ff) * b, dtype, 1, T)]
    return fwd, bwd


def attention_ops(m: ModelSpec, T: int, *, dtype: str = "bfloat16", tp: int = 1,
                  recompute_kv: bool = False) -> Tuple[List[Op], List[Op]]:
    """One MLA block on ``T`` tokens (``T/seq_len`` sequences): the query and KV down-projections
    (replicated over TP, as Megatron-Core does), the up-projections and ``W_o`` (split over
    ``tp``), and the attention core ``2*T*s*n_h*(d_qk + d_v)/2`` (causal) forward, 2.5x backward
    (dQ, dK, dV plus the recomputed scores of a flash-attention backward)."""
    b = _b(dtype)
    H, nh = m.hidden, m.heads / tp
    ops = []

    def mm(name, k, n):
        ops.append(Op(name, "gemm", 2.0 * T * k * n, (T * k + k * n + T * n) * b, dtype, 1, T))

    if m.q_lora_rank:
        mm("q_down", H, m.q_lora_rank)
        mm("q_up", m.q_lora_rank, nh * m.qk_dim)
    else:
        mm("q_proj", H, nh * m.qk_dim)
    mm("kv_down", H, m.kv_lora_rank + m.qk_rope_dim)
    mm("kv_up", m.kv_lora_rank, nh * (m.qk_nope_dim + m.v_dim))
    core = 2.0 * T * m.seq_len * nh * (m.qk_dim + m.v_dim) / 2
    attn_bytes = T * nh * (m.qk_dim * 2 + m.v_dim * 2) * b
    ops.append(Op("attention_core", "attention", core, attn_bytes, dtype, 1, T))
    mm("o_proj", nh * m.v_dim, H)
    fwd = list(ops)
    bwd = []
    for op in reversed(fwd):
        f = 2.5 if op.kind == "attention" else 2.0
        bwd.append(Op(op.name + "_bwd", op.kind, op.flops * f, op.bytes * 2, dtype, 1, T))
    if recompute_kv:
        kv = next(o for o in fwd if o.name == "kv_up")
        bwd.insert(len(bwd) - 2, Op("kv_up(recompute)", "gemm", kv.flops, kv.bytes, dtype, 1, T))
    return fwd, bwd


def op_names() -> tuple:
    """The name of every op the step simulator prices (any plan, any model): the keys per-launch
    records may override (:meth:`~.costs.RooflineCosts.with_launch_records`), plus ``head``."""
    m = ModelSpec(name="names", layers=2, hidden=8, heads=2, q_lora_rank=4, kv_lora_rank=4, qk_nope_dim=2,
                  qk_rope_dim=2, v_dim=2, routed_experts=4, shared_experts=1, top_k=2, expert_ffn=4,
                  dense_layers=1, dense_ffn=4, seq_len=4)
    ops = []
    for ml in (m, m.replace(q_lora_rank=0)):
        ops += sum(attention_ops(ml, 4, recompute_kv=True), [])
    ops += sum(moe_layer_ops(4, 8, 4, 4, 2, recompute_permute=True, recompute_activation=True, shared_ffn=4), [])
    ops += sum(dense_ffn_ops(4, 8, 4), [])
    names = ["head"]
    for o in ops:
        if o.name not in names:
            names.append(o.name)
    return tuple(names)
