"""The step simulator: a model, a cluster and a parallel plan -> a per-step timeline, step time,
memory per device, traffic per link class and MFU (with its FLOPs formula).

Method (bottom-up, as the Pangu Ultra MoE report's simulator): each layer is a list of ops
(:mod:`.layers`) priced by a :class:`~.costs.CostProvider`; communication (TP all-gather /
reduce-scatter with sequence parallelism, EP dispatch/combine per :mod:`.traffic`, pipeline
send/recv, DP gradient reduce-scatter + parameter all-gather) by a :class:`~.costs.LinkModel`.
A layer's time is its compute plus its communication, or ``max`` of the two when ``overlap``.
The pipeline is simulated event by event (1F1B, Megatron's interleaved order when ``vpp > 1``):
the step time, the bubble and the activations in flight come out of that schedule, not out of a
formula (a test checks it against ``(p-1)/(m+p-1)`` and ``(p-1)/(v*m+p-1)``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .costs import DTYPE_BYTES, CostProvider, LinkModel, Op
from .layers import attention_ops, dense_ffn_ops, moe_layer_ops
from .model import CONVENTIONS, RECOMPUTE, ModelSpec, activation_bytes_per_token, flops_per_token, layer_counts
from .traffic import ALGOS, expected_dispatch
from ...ops.checks import check_bool, check_float, check_int

__all__ = ["Plan", "PlanError", "Cluster", "StepResult", "simulate", "search", "pipeline_schedule", "layouts"]

SWAP = ("none", "activations")


class PlanError(ValueError):
    """A plan that is well formed but does not suit the model or the cluster (ep*etp not dividing
    tp*dp, ep not dividing the experts, tp not dividing the heads or an FFN, more virtual stages than
    layers, interleaving with microbatches not a multiple of pp, swapping without a host link).
    :func:`search` skips exactly these plans; every other error is raised."""


@dataclass(frozen=True)
class Plan:
    """A parallel plan. ``dp`` data-parallel replicas; ``ep`` expert-parallel ranks (carved out of
    ``tp * dp`` as in Megatron-Core, experts also split ``etp`` ways, default ``tp``);
    ``num_microbatches`` per replica per step of ``micro_batch`` sequences each."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dp: int = 1
    etp: Optional[int] = None
    micro_batch: int = 1
    num_microbatches: int = 1
    recompute: str = "none"
    swap: str = "none"
    overlap: bool = True
    a2a: str = "hierarchical"
    imbalance: float = 1.0
    sp: bool = True

    def __post_init__(self):
        for k in ("tp", "pp", "vpp", "ep", "dp", "micro_batch", "num_microbatches"):
            check_int(f"Plan.{k}", getattr(self, k), minimum=1)
        if self.etp is not None:
            check_int("Plan.etp (an int or None)", self.etp, minimum=1)
        check_bool("Plan.overlap", self.overlap)  # "no" is truthy: it used to mean overlap on
        check_bool("Plan.sp", self.sp)
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"Plan.recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.swap not in SWAP:
            raise ValueError(f"Plan.swap must be one of {SWAP}, got {self.swap!r}")
        if self.a2a not in ALGOS:
            raise ValueError(f"Plan.a2a must be one of {ALGOS}, got {self.a2a!r}")
        check_float("Plan.imbalance", self.imbalance, finite=True, minimum=1,
                    why=" (busiest device / mean load)")
        if (self.tp * self.dp) % (self.ep * self.expert_tp):
            raise PlanError(f"Plan: ep*etp = {self.ep}*{self.expert_tp} must divide tp*dp = {self.tp * self.dp}")
        if self.vpp > 1 and self.num_microbatches % self.pp:
            raise PlanError(f"Plan: with vpp > 1 the microbatches ({self.num_microbatches}) must be a "
                             f"multiple of pp={self.pp} (Megatron's interleaved schedule)")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def label(self) -> str:
        s = f"TP{self.tp} PP{self.pp}"
        if self.vpp > 1:
            s += f" VPP{self.vpp}"
        s += f" EP{self.ep} DP{self.dp} mb{self.micro_batch}x{self.num_microbatches} {self.a2a}"
        s += f" rc={self.recompute}" + (" swap" if self.swap != "none" else "") + ("" if self.overlap else " no-overlap")
        return s

    def replace(self, **kw) -> "Plan":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class Cluster:
    """Devices and links: per-op costs, the alpha-beta link model, device memory, host link
    (for swapping activations) and the device's memory bandwidth (optimizer step)."""

    name: str
    costs: CostProvider
    links: LinkModel
    memory_bytes: float
    memory_bw: float
    host_bw: float = 0.0

    def __post_init__(self):
        if not isinstance(self.costs, CostProvider):
            raise TypeError(f"Cluster.costs must be a CostProvider, got {type(self.costs).__name__}")
        if not isinstance(self.links, LinkModel):
            raise TypeError(f"Cluster.links must be a LinkModel, got {type(self.links).__name__}")
        check_float("Cluster.memory_bytes", self.memory_bytes, finite=True, minimum=0)
        check_float("Cluster.memory_bw", self.memory_bw, finite=True)
        if not self.memory_bw > 0:
            raise ValueError(f"Cluster.memory_bw must be > 0 (bytes/s of the optimizer step), got {self.memory_bw!r}")
        check_float("Cluster.host_bw", self.host_bw, finite=True, minimum=0, why=" (0: no host link)")

    @property
    def devices_per_node(self) -> int:
        return self.links.devices_per_node


@dataclass
class StepResult:
    plan: Plan
    step_s: float
    tokens_per_s: float
    memory: Dict[str, float]
    traffic: Dict[str, float]
    mfu: Dict[str, float]
    mfu_formula: Dict[str, str]
    breakdown: Dict[str, float]
    timeline: List[dict] = field(default_factory=list)
    fits: bool = True
    notes: List[str] = field(default_factory=list)

    def as_dict(self, timeline: bool = True) -> dict:
        d = dict(plan=dataclasses.asdict(self.plan), plan_label=self.plan.label(), step_s=self.step_s,
                 tokens_per_s=self.tokens_per_s, memory=self.memory, traffic=self.traffic, mfu=self.mfu,
                 mfu_formula=self.mfu_formula, breakdown=self.breakdown, fits=self.fits, notes=self.notes)
        if timeline:
            d["timeline"] = self.timeline
        return d


# ----------------------------------------------------------------------------- pipeline
def pipeline_schedule(pp: int, vpp: int, m: int, t_fwd, t_bwd, p2p: float = 0.0):
    """Event simulation of 1F1B (``vpp == 1``) or Megatron's interleaved 1F1B (``vpp > 1``).

    ``t_fwd(stage, chunk)`` / ``t_bwd(stage, chunk)``: seconds of one microbatch's chunk; ``p2p``:
    seconds of a send between neighbouring stages. Returns ``(makespan, events, max_in_flight)``:
    events are ``dict(stage, chunk, mb, kind, start, end)``; ``max_in_flight[s]`` is the largest
    number of chunk-forwards on stage ``s`` whose backward had not run yet (activations held)."""
    for name, v in (("pp", pp), ("vpp", vpp), ("m", m)):
        check_int(f"pipeline_schedule: {name}", v, minimum=1)
    check_float("pipeline_schedule: p2p", p2p, finite=True, minimum=0)
    if vpp > 1 and m % pp:
        raise PlanError(f"pipeline_schedule: m={m} must be a multiple of pp={pp} when vpp > 1")
    total = m * vpp

    def fwd_id(k):  # k-th forward of a stage -> (mb, chunk)
        if vpp == 1:
            return k, 0
        group = k // (pp * vpp)
        return group * pp + k % pp, (k // pp) % vpp

    def bwd_id(k):
        mb, c = fwd_id(k)
        return mb, vpp - 1 - c

    orders = []
    for s in range(pp):
        warm = min(total, (pp - s - 1) if vpp == 1 else (pp - s - 1) * 2 + (vpp - 1) * pp)
        seq = [("F", k) for k in range(warm)]
        f, b = warm, 0
        while f < total or b < total:
            if f < total:
                seq.append(("F", f))
                f += 1
            if b < total and (b < f):
                seq.append(("B", b))
                b += 1
        orders.append(seq)
    done: Dict[tuple, float] = {}
    pos = [0] * pp
    free = [0.0] * pp
    in_flight = [0] * pp
    max_flight = [0] * pp
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, k = orders[s][pos[s]]
                mb, c = fwd_id(k) if kind == "F" else bwd_id(k)
                if kind == "F":
                    dep = None if (s == 0 and c == 0) else ((s - 1, c, mb, "F") if s > 0 else (pp - 1, c - 1, mb, "F"))
                else:
                    if s == pp - 1 and c == vpp - 1:
                        dep = (s, c, mb, "F")
                    elif s < pp - 1:
                        dep = (s + 1, c, mb, "B")
                    else:
                        dep = (0, c + 1, mb, "B")
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p if dep[0] != s else 0.0)
                start = max(free[s], ready)
                dur = t_fwd(s, c) if kind == "F" else t_bwd(s, c)
                end = start + dur
                done[(s, c, mb, kind)] = end
                free[s] = end
                events.append(dict(stage=s, chunk=c, mb=mb, kind=kind, start=start, end=end))
                in_flight[s] += 1 if kind == "F" else -1
                max_flight[s] = max(max_flight[s], in_flight[s])
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the orders above never deadlock
            raise RuntimeError("pipeline_schedule: schedule deadlocked")
    return max(free), events, max_flight


# ----------------------------------------------------------------------------- the simulator
def _ep_layout(plan: Plan, dpn: int) -> Tuple[int, int]:
    """(nodes, ranks per node) of one EP group: TP innermost, then EP, node-major."""
    local = max(1, min(plan.ep, dpn // min(plan.tp, dpn)))
    while plan.ep % local:
        local -= 1
    return plan.ep // local, local


def _check_common(dtype: str, convention: str) -> None:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")


def _sum(costs: CostProvider, ops: Iterable[Op]) -> float:
    return sum(costs.time(op) for op in ops)


def simulate(model: ModelSpec, cluster: Cluster, plan: Plan, *, dtype: str = "bfloat16",
             convention: str = "6N+attn", timeline: bool = True) -> StepResult:
    """Simulate one training step. ``convention``: the FLOPs convention of the headline MFU (every
    convention of :data:`~.model.CONVENTIONS` is reported too)."""
    _check_common(dtype, convention)
    for name, v, typ in (("model", model, ModelSpec), ("cluster", cluster, Cluster), ("plan", plan, Plan)):
        if not isinstance(v, typ):
            raise TypeError(f"simulate: {name} must be a {typ.__name__}, got {type(v).__name__}")
    if model.routed_experts % plan.ep:
        raise PlanError(f"Plan.ep={plan.ep} must divide routed_experts={model.routed_experts}")
    if model.heads % plan.tp:
        raise PlanError(f"Plan.tp={plan.tp} must divide heads={model.heads}")
    # the simulator splits these FFNs over (expert) tensor parallelism: a fraction of a column is no plan
    ffns = [("expert_ffn", model.expert_ffn, "etp", plan.expert_tp)]
    if model.shared_experts:
        ffns.append(("shared_ffn", model.shared_ffn_size, "etp", plan.expert_tp))
    if model.dense_layers:
        ffns.append(("dense_ffn", model.dense_ffn, "tp", plan.tp))
    for fname, f, pname, p in ffns:
        if f % p:
            raise PlanError(f"Plan.{pname}={p} must divide {fname}={f} (the FFN is split {p} ways)")
    b = DTYPE_BYTES[dtype]
    costs, links = cluster.costs, cluster.links
    dpn = cluster.devices_per_node
    T = plan.micro_batch * model.seq_len  # tokens of one microbatch (one TP group)
    H, tp = model.hidden, plan.tp
    notes = []
    tp_inter = tp > dpn

    # -- one layer of each kind, one microbatch: compute and communication, fwd and bwd
    selective = plan.recompute == "selective"
    a_f, a_b = attention_ops(model, T, dtype=dtype, tp=tp, recompute_kv=selective)
    m_f, m_b = moe_layer_ops(T, H, model.expert_ffn, model.routed_experts, model.top_k, dtype=dtype,
                             recompute_permute=selective, recompute_activation=selective,
                             shared_ffn=model.shared_ffn_size * model.shared_experts, tp=plan.expert_tp,
                             imbalance=plan.imbalance, experts_per_device=model.routed_experts // plan.ep)
    d_f, d_b = dense_ffn_ops(T, H, model.dense_ffn or model.expert_ffn, dtype=dtype, tp=tp)
    comp = {"attn": (_sum(costs, a_f), _sum(costs, a_b)), "moe": (_sum(costs, m_f), _sum(costs, m_b)),
            "dense": (_sum(costs, d_f), _sum(costs, d_b))}
    # TP with sequence parallelism: all-gather before and reduce-scatter after each of the two
    # blocks, forward and backward (the activation T*H*b)
    tp_block = (2 * links.ring("all_gather", T * H * b, tp, tp_inter)) if tp > 1 else 0.0
    # EP dispatch + combine of the T/tp tokens of this device
    nodes, local = _ep_layout(plan, dpn)
    tr = expected_dispatch(T / tp if plan.sp else T, model.top_k, model.routed_experts, H, nodes=nodes,
                           local=local, algo=plan.a2a, dtype_bytes=b) if plan.ep > 1 else None
    if tr is not None:
        inter_msgs = (nodes - 1) * (1 if plan.a2a != "flat" else local)
        d_t = links.transfer(tr["intra_node_bytes"], tr["inter_node_bytes"], max(local - 1, 1), max(inter_msgs, 1))
        c_t = links.transfer(tr["combine_intra_node_bytes"], tr["combine_inter_node_bytes"],
                             max(local - 1, 1), max(inter_msgs, 1))
        if plan.a2a != "flat" and nodes > 1:  # inter hop, then the intra hop: in series
            d_t = (links.transfer(0, tr["inter_node_bytes"], 1, inter_msgs)
                   + links.transfer(tr["intra_node_bytes"], 0, local - 1, 1))
            c_t = (links.transfer(0, tr["combine_inter_node_bytes"], 1, inter_msgs)
                   + links.transfer(tr["combine_intra_node_bytes"], 0, local - 1, 1))
        ep_comm = d_t + c_t
    else:
        ep_comm = 0.0
    # expert tensor parallel: the received rows are all-gathered / reduce-scattered inside the TP group
    etp = plan.expert_tp
    etp_comm = 2 * links.ring("all_gather", T * model.top_k * H * b * plan.imbalance, etp, etp > dpn) if etp > 1 else 0.0

    def block(cf, cb, comm_f, comm_b):
        if plan.overlap:
            return max(cf, comm_f), max(cb, comm_b)
        return cf + comm_f, cb + comm_b

    af, ab = block(*comp["attn"], tp_block, tp_block)
    mf, mb_ = block(comp["moe"][0], comp["moe"][1], tp_block + ep_comm + etp_comm, tp_block + ep_comm + etp_comm)
    df, db = block(*comp["dense"], tp_block, tp_block)
    layer = {"moe": (af + mf, ab + mb_), "dense": (af + df, ab + db)}
    if plan.recompute == "full":  # backward re-runs the forward (its communication too)
        layer = {k: (f, bw + f) for k, (f, bw) in layer.items()}
    # swapping activations to the host: both directions overlapped with the layer's compute
    act_tok = {k: activation_bytes_per_token(model, recompute=plan.recompute, tp=tp, sp=plan.sp,
                                             dtype_bytes=b, moe=(k == "moe")) for k in layer}
    if plan.swap == "activations":
        if cluster.host_bw <= 0:
            raise PlanError(f"Plan.swap='activations' needs the cluster's host bandwidth (host_bw), got {cluster.host_bw}")
        for k, (f, bw) in list(layer.items()):
            sw = act_tok[k] * T / cluster.host_bw
            layer[k] = (max(f, sw), max(bw, sw))

    # -- layers to virtual stages (first layers dense), the output head on the last one
    L, pp, v = model.layers, plan.pp, plan.vpp
    chunks = pp * v
    if L < chunks:
        raise PlanError(f"Plan: pp*vpp = {chunks} virtual stages exceed the {L} layers")
    base, extra = divmod(L, chunks)
    bounds, start = [], 0
    for k in range(chunks):
        n = base + (1 if k < extra else 0)
        bounds.append((start, start + n))
        start += n
    V = model.vocab
    head_f = head_b = 0.0
    if V:
        hf = [Op("head", "gemm", 2.0 * T * H * V / tp, (T * H + H * V / tp + T * V / tp) * b, dtype, 1, T)]
        head_f = _sum(costs, hf)
        head_b = 2 * head_f

    def chunk_layers(s, c):
        lo, hi = bounds[c * pp + s]
        dense = max(0, min(hi, model.dense_layers) - lo)
        return dense, (hi - lo) - dense

    def t_f(s, c):
        dn, mo = chunk_layers(s, c)
        t = dn * layer["dense"][0] + mo * layer["moe"][0]
        return t + (head_f if (c * pp + s) == chunks - 1 else 0.0)

    def t_b(s, c):
        dn, mo = chunk_layers(s, c)
        t = dn * layer["dense"][1] + mo * layer["moe"][1]
        return t + (head_b if (c * pp + s) == chunks - 1 else 0.0)

    p2p = links.transfer(0, T * H * b / (tp if plan.sp else 1), 1, 1) if pp > 1 else 0.0
    m = plan.num_microbatches
    makespan, events, in_flight = pipeline_schedule(pp, v, m, t_f, t_b, p2p)

    # -- parameters per device (the heaviest stage) and the DP gradient / optimizer work
    c = layer_counts(model)
    dense_w = c["attention"] + c["router"] + c["shared"]
    per_stage = []
    for s in range(pp):
        dn = mo = 0
        for ch in range(v):
            a, bb = chunk_layers(s, ch)
            dn, mo = dn + a, mo + bb
        p_dense = (dn * (c["attention"] + c["dense_ffn"]) + mo * dense_w) / tp
        p_exp = mo * c["routed_experts"] / (plan.ep * etp)
        if s == 0 and V:
            p_dense += V * H / tp
        if s == pp - 1 and V:
            p_dense += V * H / tp
        per_stage.append((p_dense, p_exp, s))
    p_dense, p_exp, s_heavy = max(per_stage, key=lambda x: x[0] + x[1])
    edp = plan.tp * plan.dp // (plan.ep * etp)
    # Megatron distributed optimizer: bf16 weights (2) + fp32 grads (4) + fp32 master, m, v (12)
    # sharded over the data-parallel group of each kind of parameter
    state = {"weights": 2 * (p_dense + p_exp), "grads": 4 * (p_dense + p_exp),
             "optimizer": 12 * p_dense / plan.dp + 12 * p_exp / max(edp, 1)}
    act_chunk = []
    for s in range(pp):
        worst = 0.0
        for ch in range(v):
            dn, mo = chunk_layers(s, ch)
            worst = max(worst, T * (dn * act_tok["dense"] + mo * act_tok["moe"]))
        act_chunk.append(worst)
    acts = [in_flight[s] * act_chunk[s] * (0.0 if plan.swap == "activations" else 1.0) for s in range(pp)]
    if plan.swap == "activations":  # one chunk's activations stay resident while it runs
        acts = [act_chunk[s] for s in range(pp)]
    s_act = max(range(pp), key=lambda s: acts[s] + (per_stage[s][0] + per_stage[s][1]) * 18)
    memory = dict(state, activations=acts[s_act], in_flight_chunks=in_flight[s_act])
    memory["total"] = state["weights"] + state["grads"] + state["optimizer"] + acts[s_act]
    memory["capacity"] = cluster.memory_bytes
    fits = memory["total"] <= cluster.memory_bytes

    dp_inter = plan.tp * plan.dp > dpn
    dp_t = (links.ring("reduce_scatter", 4 * p_dense, plan.dp, dp_inter)
            + links.ring("all_gather", 2 * p_dense, plan.dp, dp_inter)
            + links.ring("reduce_scatter", 4 * p_exp, edp, dp_inter)
            + links.ring("all_gather", 2 * p_exp, edp, dp_inter))
    last_b = t_b(s_heavy, 0)
    dp_exposed = max(0.0, dp_t - last_b) if plan.overlap else dp_t
    opt_bytes = 16 * (p_dense / plan.dp + p_exp / max(edp, 1)) * 2  # read + write fp32 states and grads
    opt_t = opt_bytes / cluster.memory_bw
    step = makespan + dp_exposed + opt_t

    tokens = plan.dp * m * T
    tps = tokens / step
    world = plan.world
    mfu, formula = {}, {}
    for name, (desc, f) in CONVENTIONS.items():
        fpt = flops_per_token(model, name)
        mfu[name] = tps * fpt / (world * costs.peak_flops(dtype))
        formula[name] = (f"MFU = tokens/s * ({f}) / (devices * peak) = {tps:.4g} * {fpt:.4g} / "
                         f"({world} * {costs.peak_flops(dtype):.4g})")
    ideal = m * sum(t_f(s_heavy, ch) + t_b(s_heavy, ch) for ch in range(v))
    bubble = max(0.0, 1.0 - ideal / makespan) if makespan > 0 else 0.0
    layers_moe = model.moe_layers
    traffic = {}
    if tr is not None:
        per_layer = 2 * (tr["inter_node_bytes"] + tr["combine_inter_node_bytes"])
        per_layer_i = 2 * (tr["intra_node_bytes"] + tr["combine_intra_node_bytes"])
        moe_dev = sum(chunk_layers(s_heavy, ch)[1] for ch in range(v))
        traffic.update(ep_inter_node_bytes=per_layer * moe_dev * m, ep_intra_node_bytes=per_layer_i * moe_dev * m,
                       ep_inter_rows_per_dispatch=tr["inter_node_rows"],
                       ep_intra_rows_per_dispatch=tr["intra_node_rows"], ep_nodes=nodes, ep_local=local)
    n_layers_dev = sum(sum(chunk_layers(s_heavy, ch)) for ch in range(v))
    traffic["tp_bytes"] = (4 * 2 * (tp - 1) / tp * T * H * b * n_layers_dev * m) if tp > 1 else 0.0
    traffic["pp_bytes"] = 2 * 2 * T * H * b / (tp if plan.sp else 1) * m * v if pp > 1 else 0.0
    traffic["dp_bytes"] = (2 * (plan.dp - 1) / plan.dp * 6 * p_dense + 2 * (edp - 1) / max(edp, 1) * 6 * p_exp)
    breakdown = dict(pipeline_s=makespan, bubble_fraction=bubble, dp_exposed_s=dp_exposed, dp_total_s=dp_t,
                     optimizer_s=opt_t, p2p_s=p2p,
                     layer_moe_fwd_s=layer["moe"][0], layer_moe_bwd_s=layer["moe"][1],
                     layer_dense_fwd_s=layer["dense"][0], layer_dense_bwd_s=layer["dense"][1],
                     attn_compute_fwd_s=comp["attn"][0], moe_compute_fwd_s=comp["moe"][0],
                     ep_comm_per_layer_s=ep_comm, tp_comm_per_block_s=tp_block, etp_comm_per_layer_s=etp_comm,
                     head_fwd_s=head_f, params_dense_per_device=p_dense, params_expert_per_device=p_exp)
    if not fits:
        notes.append(f"does not fit: {memory['total'] / 2**30:.1f} GiB > {cluster.memory_bytes / 2**30:.1f} GiB")
    return StepResult(plan, step, tps, memory, traffic, mfu, formula, breakdown,
                      events if timeline else [], fits, notes)


SEARCH_TP = (1, 2, 4, 8)
SEARCH_PP = (1, 2, 4, 8, 16)


def _int_choices(name: str, values) -> tuple:
    """A non-empty sequence of positive ints (the values search tries for ``name``)."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of positive ints, got {type(values).__name__}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must list at least one value, got ()")
    return tuple(check_int(f"{name}[{i}]", v, minimum=1) for i, v in enumerate(values))


def _name_choices(name: str, values, valid: Sequence[str]) -> tuple:
    """A non-empty sequence of names out of ``valid`` (a misspelt one is an error, not "no plan")."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a sequence of names out of {', '.join(valid)}, got {values!r}")
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} must list at least one of {', '.join(valid)}, got ()")
    bad = [v for v in values if v not in valid]
    if bad:
        raise ValueError(f"{name} must hold names out of {', '.join(valid)}, got {', '.join(map(repr, bad))}")
    return values


def layouts(devices: int, global_batch: int, micro_batch: int = 1, tp: Sequence[int] = SEARCH_TP,
            pp: Sequence[int] = SEARCH_PP) -> List[tuple]:
    """The ``(tp, pp, dp, microbatches)`` that :func:`search` considers: ``tp * pp`` divides
    ``devices`` and ``dp * micro_batch`` divides ``global_batch`` (``dp = devices / (tp * pp)``)."""
    check_int("devices", devices, minimum=1)
    check_int("global_batch", global_batch, minimum=1)
    check_int("micro_batch", micro_batch, minimum=1)
    tp, pp = _int_choices("tp", tp), _int_choices("pp", pp)
    out = []
    for t, p in itertools.product(tp, pp):
        if devices % (t * p):
            continue
        d = devices // (t * p)
        if global_batch % (d * micro_batch):
            continue
        out.append((t, p, d, global_batch // (d * micro_batch)))
    return out


def search(model: ModelSpec, cluster: Cluster, devices: int, global_batch: int, *,
           tp: Sequence[int] = SEARCH_TP, pp: Sequence[int] = SEARCH_PP,
           vpp: Sequence[int] = (1, 2), ep: Sequence[int] = (1, 2, 4, 8, 16, 32),
           recompute: Sequence[str] = ("none", "selective", "full"), a2a: Sequence[str] = ALGOS,
           micro_batch: int = 1, overlap: bool = True, imbalance: float = 1.0,
           dtype: str = "bfloat16", top: Optional[int] = 10, convention: str = "6N+attn",
           only_fitting: bool = True) -> List[StepResult]:
    """Every valid plan on ``devices`` devices for ``global_batch`` sequences per step, simulated
    and ranked by throughput (plans that do not fit in memory dropped unless ``only_fitting=False``);
    the ``top`` best (all of them with ``top=None``).

    The arguments are checked first (a misspelt recompute mode or A2A algorithm, an imbalance below
    1, a zero in ``tp`` ... is a ValueError / TypeError naming the argument). Then the combinations
    that do not suit the model or the cluster (:class:`PlanError`: ep*etp not dividing tp*dp, ep not
    dividing the experts, tp not dividing the heads or an FFN, more virtual stages than layers,
    interleaving with microbatches not a multiple of pp) are skipped, as are ``vpp > 1`` without a
    pipeline and ``a2a`` other than flat with ``ep == 1`` (the same plan)."""
    tp, pp = _int_choices("tp", tp), _int_choices("pp", pp)
    vpp, ep = _int_choices("vpp", vpp), _int_choices("ep", ep)
    recompute = _name_choices("recompute", recompute, RECOMPUTE)
    a2a = _name_choices("a2a", a2a, ALGOS)
    check_bool("overlap", overlap)
    check_bool("only_fitting", only_fitting)
    check_float("imbalance", imbalance, finite=True, minimum=1, why=" (busiest device / mean load)")
    if top is not None:
        check_int("top", top, minimum=0)
    _check_common(dtype, convention)
    if not isinstance(model, ModelSpec):
        raise TypeError(f"search: model must be a ModelSpec, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"search: cluster must be a Cluster, got {type(cluster).__name__}")
    out = []
    shapes = {(t, p): (d, m) for t, p, d, m in layouts(devices, global_batch, micro_batch, tp, pp)}
    for t, p, v, e, rc, algo in itertools.product(tp, pp, vpp, ep, recompute, a2a):
        if (t, p) not in shapes:
            continue
        d, m = shapes[(t, p)]
        if e == 1 and algo != ALGOS[0]:
            continue
        try:
            plan = Plan(tp=t, pp=p, vpp=v, ep=e, dp=d, micro_batch=micro_batch, num_microbatches=m,
                        recompute=rc, a2a=algo, overlap=overlap, imbalance=imbalance)
            if v > 1 and p == 1:
                continue
            r = simulate(model, cluster, plan, dtype=dtype, convention=convention, timeline=False)
        except PlanError:  # a combination that does not suit the model or the cluster
            continue
        if r.fits or not only_fitting:
            out.append(r)
    out.sort(key=lambda r: -r.tokens_per_s)
    return out if top is None else out[:top]
