"""Benchmark of moe_permute / moe_unpermute (forward, and forward+backward of the round trip).

Run by ``python -m ascend_moe_ops.bench`` through :func:`run` (and :func:`parity`);
``python -m pytest bench`` collects the same cases for pytest-benchmark.

Shapes: ``ctx.shape`` (T, H, E, K of the preset: pangu T=4096, H=7680, E=256, top-8; quick
T=1024, H=1024, E=64, top-8; or the --tokens/--hidden/--experts/--topk flags), ``ctx.dtype``; routing balanced (top-8 of uniform scores) and skewed
(experts drawn with Zipf-like weights 1/(e+1)^1.2, so a few experts receive most tokens).

Peer, timed in the same process: Megatron-Core's pure-PyTorch ``moe_utils.permute/unpermute``
(routing as a ``[T, E]`` mask, dense ``[T, E]`` probs) from the installed megatron-core package;
if it cannot be imported, a reimplementation of its published algorithm (``_alg_permute`` below:
transpose the mask, masked_select the token ids, index_select the rows; unpermute: scale the rows by
the probs gathered the same way, scatter_add into a zero ``[T, H]`` buffer) labelled
"megatron-algorithm (reimplemented)". ``ASCEND_MOE_OPS_BENCH_NO_MCORE=1`` forces the latter.

Also timed: the Megatron drop-in ``ascend_moe_ops.integrations.megatron`` (same arguments and
outputs as the peer) on the default backend, unless that is the reference (which handles the
``[T, E]`` mask by materializing all ``T*E`` slots). The Triton backend is not timed on the CPU
(only its interpreter runs there); rows say which backends were left out and why.
"""

from __future__ import annotations

import os

import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _backends
from ascend_moe_ops.bench import Row, parity_row

OP = "moe_permute"
FULL_SHAPE = dict(T=4096, H=7680, E=256, K=8)  # Pangu Ultra MoE layer (issue 2 target shape)
QUICK_SHAPE = dict(T=1024, H=1024, E=64, K=8)  # 16 MiB of permuted bf16 rows: fits a 32 MiB L3 (see docs/benchmarks.md)
DTYPE = torch.bfloat16
ROUTINGS = ("balanced", "skewed")

PERMUTE_FORMULA = ("bytes = (T*H + N*H)*elt + T*K*16 + N*4  (read tokens, write N used rows; "
                   "index bytes: int64 ids, fp32 probs, int32 row_id_map, fp32 permuted probs)")
UNPERMUTE_FORMULA = ("bytes = (N*H + T*H)*elt + T*K*8  (read N used rows, write tokens; int32 "
                     "row_id_map, fp32 probs)")
UNPERMUTE_NOPROBS_FORMULA = "bytes = (N*H + T*H)*elt + T*K*4  (read N used rows, write tokens; int32 row_id_map)"
ROUND_TRIP_FORMULA = ("bytes = (4*T*H + 5*N*H)*elt  (permute + weighted unpermute, forward and "
                      "backward incl. the re-read of rows for d probs; index bytes left out)")


# ------------------------------------------------------------------------------------ peers
def _alg_permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False,
                 drop_and_pad=False):
    """Megatron-Core's published dropless permute algorithm, reimplemented (pure PyTorch)."""
    T = tokens.shape[0]
    by_expert = routing_map.bool().t().contiguous()  # [E, T]: expert-major, token order inside
    token_ids = torch.arange(T, device=tokens.device).expand_as(by_expert)
    sorted_indices = torch.masked_select(token_ids, by_expert)
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.masked_select(probs.t().contiguous(), by_expert)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def _alg_unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None,
                   fused=False, drop_and_pad=False):
    """Megatron-Core's published dropless unpermute algorithm, reimplemented (pure PyTorch)."""
    dtype = permuted_tokens.dtype
    rows = permuted_tokens
    if probs is not None:
        row_probs = torch.masked_select(probs.t().contiguous(), routing_map.t().contiguous())
        rows = rows * row_probs.unsqueeze(1)  # type promotion as in the original (fp32 probs)
    out = torch.zeros(restore_shape, dtype=rows.dtype, device=rows.device)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, rows.shape[1]), rows)
    return out.to(dtype)


def megatron_peer():
    """``(label, permute, unpermute)``: megatron-core if importable, else the reimplementation."""
    if os.environ.get("ASCEND_MOE_OPS_BENCH_NO_MCORE") != "1":
        try:
            import importlib.metadata
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from megatron.core.transformer.moe import moe_utils
            return (f"megatron-core {importlib.metadata.version('megatron-core')}",
                    moe_utils.permute, moe_utils.unpermute)
        except Exception:
            pass
    return "megatron-algorithm (reimplemented)", _alg_permute, _alg_unpermute


# ------------------------------------------------------------------------------------ inputs
def make_inputs(T, H, E, K, routing, device, dtype=DTYPE, seed=0):
    """tokens [T,H]; ids [T,K] int64 (distinct experts per token); probs [T,K] fp32; the same
    routing as Megatron takes it: mask [T,E] bool and dense probs [T,E]."""
    g = torch.Generator().manual_seed(seed)
    if routing == "balanced":
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    elif routing == "skewed":
        weights = (torch.arange(E, dtype=torch.float64) + 1.0) ** -1.2
        ids = torch.multinomial(weights.expand(T, E), K, replacement=False, generator=g)
    else:
        raise ValueError(f"unknown routing {routing!r}")
    probs = torch.randn(T, K, generator=g).softmax(-1)
    tokens = torch.randn(T, H, generator=g).to(dtype)
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    dense = torch.zeros(T, E).scatter_(1, ids, probs)
    to = dict(device=device)
    return (tokens.to(**to), ids.to(**to), probs.to(**to), mask.to(**to), dense.to(**to))


def _backends_to_time(device, wanted=lambda name: True):
    """Backends to time on ``device`` and a note on the ones left out."""
    names, skipped = [], []
    for b in _backends.BACKENDS:
        if not wanted(b):
            continue
        if b in _backends.available_backends(OP, device):
            if b == "triton" and device.type == "cpu":
                skipped.append("triton: runs only in the TRITON_INTERPRET interpreter on cpu, "
                               "useless for timing")
                continue
            if b == "ascendc-emu":
                skipped.append("ascendc-emu: the AscendC kernels on a CPU emulator that checks rules, "
                               "not speed; its timings mean nothing")
                continue
            names.append(b)
        else:
            skipped.append(f"{b}: {_backends.unavailable_reason(OP, b, device) or 'unavailable'}")
    return names, "; ".join(skipped)


# ------------------------------------------------------------------------------------ run
PATH_PERMUTE = "permute, top-k ids + probs -> rows + permuted probs (TE / torch_npu path)"
PATH_UNPERMUTE_PROBS = "unpermute, with probs (torch_npu / TE path)"
PATH_UNPERMUTE_NOPROBS = ("unpermute, no probs (Megatron-Core dispatcher path: probs are applied "
                          "inside the experts)")
PATH_TRIP = "permute + weighted unpermute, fwd+bwd (MoELayer path)"
PATH_MG_PERMUTE = "permute, routing map [T, E] + probs (Megatron-Core moe_utils.permute signature)"
PATH_MG_UNPERMUTE = ("unpermute, routing map, no probs (Megatron-Core dispatcher path, "
                     "moe_utils.unpermute signature)")


def _case_rows(ctx, shape, routing, peer):
    T, H, E, K = shape["T"], shape["H"], shape["E"], shape["K"]
    device = ctx.device
    DTYPE = ctx.dtype
    tokens, ids, probs, mask, dense = make_inputs(T, H, E, K, routing, device, dtype=DTYPE)
    N = T * K  # every slot is used (K distinct experts per token): static bound == used rows
    elt = tokens.element_size()
    tpe = mask.sum(0).double()
    base_extra = {"T": T, "H": H, "E": E, "K": K, "N_used": N, "routing": routing,
                  "max/mean tokens per expert": round(float(tpe.max() / tpe.mean()), 2),
                  "threads": torch.get_num_threads(), "peer": peer[0]}
    names, skipped = _backends_to_time(device, ctx.backend_wanted)
    if skipped:
        base_extra["not timed"] = skipped
    shape_s = f"T{T} H{H} E{E} K{K} {routing}"
    b_perm = (T * H + N * H) * elt + T * K * 16 + N * 4
    b_unperm = (N * H + T * H) * elt + T * K * 8
    b_unperm_np = (N * H + T * H) * elt + T * K * 4
    b_trip = (4 * T * H + 5 * N * H) * elt
    _, p_perm, p_unperm = peer
    timed = ctx.time
    # our rows alternate with the copy of their own working set, round by round (the % copy
    # column compares them per round; a copy timed once drifted 13.9-21.9 ms on one VM)
    vs_copy = getattr(ctx, "time_vs_copy", None) or (lambda fn, nbytes, rounds=5: timed(fn))

    # the peer, once per case
    p_rows, _, p_si = p_perm(tokens, mask, probs=dense, num_out_tokens=N)
    t_peer_perm = timed(lambda: p_perm(tokens, mask, probs=dense, num_out_tokens=N))
    t_peer_unperm = timed(lambda: p_unperm(p_rows, p_si, tokens.shape, probs=dense,
                                           routing_map=mask))
    t_peer_unperm_np = timed(lambda: p_unperm(p_rows, p_si, tokens.shape, routing_map=mask))
    x_p = tokens.clone().requires_grad_()
    pr_p = dense.clone().requires_grad_()
    g = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(DTYPE).to(device)

    def peer_trip():
        x_p.grad = pr_p.grad = None
        rows, _, si = p_perm(x_p, mask, num_out_tokens=N)
        p_unperm(rows, si, tokens.shape, probs=pr_p, routing_map=mask).backward(g)

    t_peer_trip = timed(peer_trip)
    # p_rows / p_si stay bound: the timed closures read them (a pytest replay calls them later)

    out = []
    for b in names:
        with amo.use_backend(b):
            res = amo.moe_permute(tokens, ids, probs, num_experts=E)
            rows, rmap = res.tokens, res.row_id_map
            t_perm = vs_copy(lambda: amo.moe_permute(tokens, ids, probs, num_experts=E), b_perm)
            t_unperm = vs_copy(lambda: amo.moe_unpermute(rows, rmap, probs), b_unperm)
            t_unperm_np = vs_copy(lambda: amo.moe_unpermute(rows, rmap), b_unperm_np)
            x = tokens.clone().requires_grad_()
            pr = probs.clone().requires_grad_()

            def trip():
                x.grad = pr.grad = None
                r = amo.moe_permute(x, ids, num_experts=E)
                amo.moe_unpermute(r.tokens, r.row_id_map, pr).backward(g)

            t_trip = vs_copy(trip, b_trip, rounds=3)
        if hasattr(ctx, "limit_now"):  # plain and alloc-copy of the same working sets, recorded
            for nb in (b_perm, b_unperm, b_unperm_np, b_trip):
                ctx.limit_now(nbytes=nb)
        dt = str(DTYPE).replace("torch.", "")
        out += [
            Row(op="moe_permute", case=f"fwd {shape_s}", backend=b, dtype=dt, seconds=t_perm,
                bytes=b_perm, formula=PERMUTE_FORMULA, peers={peer[0]: t_peer_perm},
                extra=dict(base_extra), path=PATH_PERMUTE),
            Row(op="moe_unpermute", case=f"fwd probs {shape_s}", backend=b, dtype=dt, seconds=t_unperm,
                bytes=b_unperm, formula=UNPERMUTE_FORMULA, peers={peer[0]: t_peer_unperm},
                extra=dict(base_extra, probs="weighted by fp32 probs"), path=PATH_UNPERMUTE_PROBS),
            Row(op="moe_unpermute", case=f"fwd no-probs {shape_s}", backend=b, dtype=dt,
                seconds=t_unperm_np, bytes=b_unperm_np, formula=UNPERMUTE_NOPROBS_FORMULA,
                peers={peer[0]: t_peer_unperm_np}, extra=dict(base_extra, probs="none"),
                path=PATH_UNPERMUTE_NOPROBS),
            Row(op="moe_permute+unpermute", case=f"fwd+bwd {shape_s}", backend=b, dtype=dt,
                seconds=t_trip, bytes=b_trip, formula=ROUND_TRIP_FORMULA,
                peers={peer[0]: t_peer_trip}, extra=dict(base_extra), path=PATH_TRIP),
        ]

    # the Megatron drop-in (integrations.megatron) on the default backend: what a swapped
    # import gets, including its index conversions. Not on the reference backend: it handles a
    # [T, E] mask by materializing all T*E slots (16 GB at the full shape) -- it is the spec.
    from ascend_moe_ops.integrations import megatron as mg
    default = _backends.active_backend(OP, device)
    if default == "reference" or not ctx.backend_wanted(default):
        return out
    a_rows, _, a_si = mg.permute(tokens, mask, probs=dense, num_out_tokens=N)
    t_a_perm = vs_copy(lambda: mg.permute(tokens, mask, probs=dense, num_out_tokens=N), b_perm)
    t_a_unperm = vs_copy(lambda: mg.unpermute(a_rows, a_si, tokens.shape, routing_map=mask),
                         b_unperm_np)
    extra = dict(base_extra, adapter="ascend_moe_ops.integrations.megatron (same arguments and "
                 "outputs as the peer; includes sorted_indices <-> row_id_map conversion)")
    out += [
        Row(op="moe_permute", case=f"megatron-adapter fwd {shape_s}", backend=default,
            dtype=str(DTYPE).replace("torch.", ""), seconds=t_a_perm, bytes=b_perm,
            formula=PERMUTE_FORMULA, peers={peer[0]: t_peer_perm}, extra=extra, path=PATH_MG_PERMUTE),
        Row(op="moe_unpermute", case=f"megatron-adapter fwd no-probs {shape_s}", backend=default,
            dtype=str(DTYPE).replace("torch.", ""), seconds=t_a_unperm, bytes=b_unperm_np,
            formula=UNPERMUTE_NOPROBS_FORMULA, peers={peer[0]: t_peer_unperm_np}, extra=extra,
            path=PATH_MG_UNPERMUTE),
    ]
    return out


def run(ctx):
    shape = ctx.shape
    peer = megatron_peer()
    rows = []
    for routing in ROUTINGS:
        rows += _case_rows(ctx, shape, routing, peer)
    return rows


def parity(ctx):
    """Every timed backend vs the fp64 reference on a small shape (bf16 and fp32), and the
    Megatron drop-in vs the peer (exact data movement)."""
    T, H, E, K = 64, 96, 16, 4
    out = []
    names, _ = _backends_to_time(ctx.device)
    if "ascendc-emu" in _backends.available_backends(OP, ctx.device):
        names = names + ["ascendc-emu"]  # the AscendC kernels on the emulator: parity only, never timed
    for dtype in (torch.float32, torch.bfloat16):
        tokens, ids, probs, mask, dense = make_inputs(T, H, E, K, "skewed", ctx.device, dtype=dtype)
        dt = str(dtype).replace("torch.", "")
        with amo.use_backend("reference"):
            ref = amo.moe_permute(tokens.double(), ids, probs.double(), num_experts=E)
            rows = (ref.tokens * 1.5).to(dtype)  # stand-in expert outputs
            ref_out = amo.moe_unpermute(rows.double(), ref.row_id_map, probs.double())
            lowp = amo.moe_unpermute(rows, ref.row_id_map, probs)
        for b in names:
            with amo.use_backend(b):
                res = amo.moe_permute(tokens, ids, probs, num_experts=E)
                y = amo.moe_unpermute(rows, ref.row_id_map, probs)
            out.append(parity_row("moe_permute", f"T{T} H{H} E{E} K{K} {dt} tokens", b,
                                  res.tokens, ref.tokens))
            out.append(parity_row("moe_permute", f"T{T} H{H} E{E} K{K} row_id_map", b,
                                  res.row_id_map, ref.row_id_map))
            out.append(parity_row("moe_unpermute", f"T{T} H{H} E{E} K{K} {dt}", b, y, ref_out, lowp))
        if dtype == DTYPE:
            from ascend_moe_ops.integrations import megatron as mg
            label, p_perm, _ = megatron_peer()
            theirs = p_perm(tokens, mask, probs=dense)
            ours = mg.permute(tokens, mask, probs=dense)
            for name, a, b in zip(("tokens", "probs", "sorted_indices"), ours, theirs):
                out.append(parity_row("megatron-adapter", f"permute {name} vs {label}",
                                      _backends.active_backend(OP, ctx.device), a, b))
    return out
