"""Expert-parallel dispatcher on gloo: several processes simulate ``nodes x ranks-per-node``.

Spawning processes is the expensive part on a small machine, so each topology is one spawned
group (module-scoped fixture) that runs every scenario in order and reports one result per
scenario; the test functions below only look up their scenario's result. Every collective has a
timeout and the group has a join deadline, so a deadlock fails instead of hanging.

Oracle: a closed-form single-process computation in fp64 with toy experts ``y = x * (e + 1)``
(expert ``e``): ``out[t] = sum_k p[t,k] * (id[t,k] + 1) * x[t]`` over slots with ``id >= 0``.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import sys
import time

import pytest
import torch

from _spawn import free_port, problems, run_scenarios, setup_failure, spawn_ranks

WORLDS = {  # name -> (world size, ranks per node)
    "2x2": (4, 2),
    "3x2": (6, 2),
    "1x4": (4, 1 * 4),
    "2x3": (6, 3),
}
# 2x3 (three ranks per node) runs only the scenarios the node-deduplicated path changes
SUBSETS = {"2x3": ["stats", "modes_equal", "fp64_hierarchical", "async_hierarchical",
                   "zero_tokens_hierarchical", "skew_hierarchical", "expert_map_hierarchical",
                   "overlap_hierarchical"]}
# the pipeline's scheduling does not depend on the topology: its other modes run on 2x2 only
_SKIP = {"3x2": {"overlap_flat", "overlap_hierarchical_allgather", "overlap_order_flat",
                 "overlap_order_hierarchical", "overlap_retain_graph", "overlap_bad_args"},
         "1x4": {"overlap_flat", "overlap_hierarchical_allgather", "overlap_order_flat",
                 "overlap_order_hierarchical", "overlap_retain_graph", "overlap_bad_args"}}
PG_TIMEOUT_S = int(os.environ.get("EP_TEST_PG_TIMEOUT", 40))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOIN_TIMEOUT_S = 150  # one spawned group of the HCCL harness (tests/test_ascend_npu.py)


# ------------------------------------------------------------------ helpers run in the workers
def _inputs(world, T_per_rank, H, E, K, seed, dtype=torch.float64, empty_frac=0.1, skew=None,
            probs=True):
    """Inputs of every rank (each rank builds all of them from one seed, for the oracle)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(world):
        T = T_per_rank[r]
        x = torch.randn(T, H, generator=g, dtype=torch.float64)
        if skew is not None:
            ids = torch.tensor(skew, dtype=torch.int64)[torch.randint(0, len(skew), (T, K), generator=g)]
        else:
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
                torch.zeros(0, K, dtype=torch.int64)
        if T and K > 1 and skew is None:
            ids[::4, 1] = ids[::4, 0]  # duplicate expert ids in some rows
        ids[torch.rand(T, K, generator=g) < empty_frac] = -1
        p = torch.rand(T, K, generator=g, dtype=torch.float64) if probs else None
        gw = torch.randn(T, H, generator=g, dtype=torch.float64)  # upstream gradient
        out.append((x.to(dtype), ids, None if p is None else p.to(dtype if dtype != torch.bfloat16 else torch.float32), gw))
    return out


def _oracle(x, ids, p, gw):
    """fp64 closed form: (out, d tokens, d probs)."""
    x = x.double().clone().requires_grad_(True)
    w = (ids + 1).double() * (ids >= 0).double()
    pp = None
    if p is not None:
        pp = p.double().clone().requires_grad_(True)
        w = w * pp
    out = (w.unsqueeze(2) * x.unsqueeze(1)).sum(1)
    (out * gw).sum().backward()
    return out.detach(), x.grad, None if pp is None else pp.grad


def _toy_experts(expert_tokens, tpe, dispatcher):
    scale = torch.repeat_interleave(dispatcher.local_experts + 1, tpe).to(expert_tokens.dtype)
    return expert_tokens * scale.unsqueeze(1)


def _expected_expert_rows(all_inputs, dispatcher):
    """Rows each local expert must receive: (source rank, token, slot) order."""
    rows = []
    for e in dispatcher.local_experts.tolist():
        for (x, ids, _, _) in all_inputs:
            for t in range(ids.shape[0]):
                for k in range(ids.shape[1]):
                    if ids[t, k] == e:
                        rows.append(x[t])
    H = all_inputs[0][0].shape[1]
    return torch.stack(rows) if rows else torch.zeros(0, H, dtype=all_inputs[0][0].dtype)


def _round(disp, inp, *, async_op=False, check_rows=None):
    x, ids, p, gw = inp
    x = x.clone().requires_grad_(True)
    pr = None if p is None else p.clone().requires_grad_(True)
    if async_op:
        pend = disp.dispatch(x, ids, pr, async_op=True)
        overlap = (x.detach() * 2).sum()  # "shared expert" work while tokens are in flight
        et, tpe, h = pend.wait()
        y = _toy_experts(et, tpe, disp)
        pc = disp.combine(y, h, async_op=True)
        overlap = overlap + 1
        out = pc.wait()
    else:
        et, tpe, h = disp.dispatch(x, ids, pr)
        y = _toy_experts(et, tpe, disp)
        out = disp.combine(y, h)
    if check_rows is not None:
        assert et.shape == check_rows.shape, (et.shape, check_rows.shape)
        assert torch.equal(et.detach(), check_rows), "expert_tokens rows differ from the contract"
    assert tpe.dtype == torch.int64 and int(tpe.sum()) == et.shape[0]
    (out * gw.to(out.dtype)).sum().backward()
    return out.detach(), x.grad, None if pr is None else pr.grad, h


def _close(a, b, name):
    # fp64 runs are held to the fp64 bound when moe_unpermute runs the reference (fp64
    # accumulation for fp64); a compiled backend may accumulate in fp32: then the fp32 bound.
    import ascend_moe_ops
    from ascend_moe_ops.testing import assert_close_to_ref
    exact = ascend_moe_ops.active_backend("moe_unpermute", a.device) == "reference"
    assert_close_to_ref(a, b, dtype=torch.float64 if exact else torch.float32, name=name)


def _check_against_oracle(disp, all_inputs, rank, *, async_op=False, check_rows=True):
    rows = _expected_expert_rows(all_inputs, disp) if check_rows else None
    out, dx, dp, h = _round(disp, all_inputs[rank], async_op=async_op, check_rows=rows)
    ref, rdx, rdp = _oracle(*all_inputs[rank])
    _close(out, ref, "out")
    _close(dx, rdx, "d tokens")
    if rdp is not None:
        _close(dp, rdp, "d probs")
    return h


def scenario_fp64(ctx, algorithm, async_op=False):
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 2 * W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    T = [5 + 3 * r for r in range(W)]  # uneven T across ranks
    inputs = _inputs(W, T, 6, E, 4, seed=11)
    h = _check_against_oracle(disp, inputs, ctx["rank"], async_op=async_op)
    want = algorithm if algorithm != "auto" else disp.resolve_algorithm(4)
    assert h.algorithm == want


def scenario_skew(ctx, algorithm):
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 2 * W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    # every slot goes to rank 0's experts: all other ranks receive zero rows
    inputs = _inputs(W, [6] * W, 5, E, 3, seed=12, skew=[0, 1])
    _check_against_oracle(disp, inputs, ctx["rank"])


def scenario_zero_tokens(ctx, algorithm):
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 2 * W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    T = [4] * W
    T[1] = 0  # a rank with no tokens at all
    T[-1] = 9
    inputs = _inputs(W, T, 5, E, 3, seed=13)
    _check_against_oracle(disp, inputs, ctx["rank"])
    # everything empty on every rank
    inputs = _inputs(W, [0] * W, 5, E, 3, seed=14)
    _check_against_oracle(disp, inputs, ctx["rank"])


def scenario_no_probs(ctx, algorithm):
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    disp = MoEDispatcher(ctx["topo"], 2 * W, algorithm=algorithm)
    inputs = _inputs(W, [7] * W, 4, 2 * W, 3, seed=15, probs=False)
    _check_against_oracle(disp, inputs, ctx["rank"])


def scenario_round_trip(ctx, algorithm):
    """Identity experts and unit probs: combine(dispatch(x)) == x * (number of kept slots)."""
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 4 * W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    _, ids, _, _ = _inputs(W, [8] * W, 16, E, 5, seed=16)[ctx["rank"]]
    # small integers: every partial sum is exact in fp32, so the result must be bitwise equal
    x = torch.randint(-8, 9, (8, 16)).float()
    for p in (torch.ones(ids.shape), None):
        et, tpe, h = disp.dispatch(x, ids, p)
        out = disp.combine(et, h)
        kept = (ids >= 0).sum(1, keepdim=True).float()
        assert torch.equal(out, x * kept), "round trip changed the tokens"


def scenario_bf16(ctx, algorithm):
    from ascend_moe_ops.distributed import MoEDispatcher
    from ascend_moe_ops.testing import assert_close_to_ref
    W = ctx["world"]
    E = 2 * W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    inputs = _inputs(W, [6 + r for r in range(W)], 32, E, 4, seed=17, dtype=torch.bfloat16)
    x, ids, p, gw = inputs[ctx["rank"]]
    out, dx, dp, _ = _round(disp, inputs[ctx["rank"]])
    assert out.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16
    ref, rdx, rdp = _oracle(x.double(), ids, p.double(), gw)
    # PyTorch's own bf16 computation of the same math, for the "2 x PyTorch error" rule
    w = ((ids + 1) * (ids >= 0)).to(torch.bfloat16) * p.to(torch.bfloat16)
    lowp = (w.unsqueeze(2) * x.unsqueeze(1)).sum(1)
    assert_close_to_ref(out, ref, dtype=torch.bfloat16, torch_lowp=lowp, name="bf16 out")
    lowp_dx = (w.unsqueeze(2) * gw.to(torch.bfloat16).unsqueeze(1)).sum(1)
    assert_close_to_ref(dx, rdx, dtype=torch.bfloat16, torch_lowp=lowp_dx, name="bf16 d tokens")
    lowp_dp = ((x.unsqueeze(1) * gw.to(torch.bfloat16).unsqueeze(1)).sum(2) *
               ((ids + 1) * (ids >= 0)).to(torch.bfloat16))
    assert_close_to_ref(dp.float(), rdp, dtype=torch.bfloat16, torch_lowp=lowp_dp, name="bf16 d probs")


def _dedup_counts(all_inputs, E, W, G, me):
    """Exact rows of the deduplicated hierarchical dispatch, from every rank's routing:
    (inter-node rows ``me`` sends = sum over its tokens of the remote nodes hosting >= 1 of their
    experts, intra-node rows ``me`` forwards to the other ranks of its node)."""
    N, L = W // G, E // W
    node, lme = me // G, me % G
    ids = all_inputs[me][1]
    inter = 0
    for t in range(ids.shape[0]):
        nodes = {int(e) // L // G for e in ids[t].tolist() if e >= 0}
        inter += len(nodes - {node})
    intra = 0  # me = (node, lme) forwards each token of a rank (n, lme) once to every other rank
    for n in range(N):  # of its node owning >= 1 of the token's experts
        for t_ids in all_inputs[n * G + lme][1].tolist():
            owners = {e // L for e in t_ids if e >= 0}
            intra += len({o for o in owners if o // G == node and o != me})
    return inter, intra


def scenario_stats(ctx):
    """Measured rows equal the arithmetic: flat the exact remote slots; hierarchical_allgather
    Tmax*(N-1); hierarchical (dedup) the exact per-token count, never above the other two."""
    from ascend_moe_ops.distributed import MoEDispatcher
    topo, W, G = ctx["topo"], ctx["world"], ctx["local_size"]
    N, H, K, E = topo.num_nodes, 8, 6, 4 * W
    disps = {a: MoEDispatcher(topo, E, algorithm=a)
             for a in ("flat", "hierarchical", "hierarchical_allgather")}
    cases = {  # name -> (T per rank, skew)
        "uniform": ([10] * W, None),
        "uneven T": ([3 + 2 * r for r in range(W)], None),
        "empty rank": ([0 if r == 1 else 7 for r in range(W)], None),
        "skewed": ([9] * W, [0, 1, 2, E - 1]),  # experts of rank 0 and of the last rank
        "all empty": ([0] * W, None),
    }
    for seed, (name, (Ts, skew)) in enumerate(cases.items()):
        inputs = _inputs(W, Ts, H, E, K, seed=18 + seed, skew=skew)
        x, ids, p, _ = inputs[ctx["rank"]]
        T = Ts[ctx["rank"]]
        st = {a: d.dispatch(x, ids, p)[2].stats for a, d in disps.items()}
        owner = ids // (E // W)
        remote = int(((ids >= 0) & (owner // G != topo.node)).sum())
        local_other = int(((ids >= 0) & (owner // G == topo.node) & (owner != topo.rank)).sum())
        assert st["flat"]["inter_node_rows"] == remote, (name, st["flat"], remote)
        assert st["flat"]["inter_node_bytes"] == remote * H * 8
        assert st["flat"]["intra_node_rows"] == local_other
        tmax = max(Ts[n * G + topo.local_rank] for n in range(N))
        ag = st["hierarchical_allgather"]
        assert ag["inter_node_rows"] == tmax * (N - 1), (name, ag)
        assert ag["inter_node_bytes"] == tmax * (N - 1) * (H * 8 + K * 4 + K * 8)
        inter, intra = _dedup_counts(inputs, E, W, G, ctx["rank"])
        dd = st["hierarchical"]
        assert dd["inter_node_rows"] == inter, (name, dd, inter)
        assert dd["inter_node_bytes"] == inter * (H * 8 + K * 4 + K * 8)
        assert dd["intra_node_rows"] == intra, (name, dd, intra)
        assert dd["intra_node_bytes"] == intra * (H * 8 + K * 4 + K * 8)
        assert inter <= remote and inter <= T * (N - 1) <= ag["inter_node_rows"], (name, inter)
        if name == "skewed" and N > 1:  # the case of the issue: dedup strictly below flat
            assert inter < remote or T == 0, (inter, remote)
    # the combine mirrors the dispatch: one partial sum per (token, node) comes back
    x, ids, p, _ = _inputs(W, [10] * W, H, E, K, seed=30)[ctx["rank"]]
    hd = disps["hierarchical"].dispatch(x, ids, p)[2]
    everyone = [torch.zeros(1, dtype=torch.int64) for _ in range(W)]
    import torch.distributed as dist
    dist.all_gather(everyone, torch.tensor([hd.stats["inter_node_rows"]]), group=topo.group)
    total_sent = sum(int(v) for v in everyone)
    back = torch.tensor([hd.stats["combine_inter_node_rows"]])
    dist.all_reduce(back, group=topo.group)
    assert int(back) == total_sent, (int(back), total_sent)


def scenario_modes_equal(ctx):
    """flat, hierarchical and hierarchical_allgather give the same expert rows (bitwise), and
    outputs / gradients equal up to summation order (fp64), on skewed, empty and uneven input."""
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 2 * W
    algs = ("flat", "hierarchical", "hierarchical_allgather")
    disps = [MoEDispatcher(ctx["topo"], E, algorithm=a) for a in algs]
    for seed, (Ts, skew) in enumerate([([4 + 3 * r for r in range(W)], None),
                                       ([0 if r == W - 1 else 6 for r in range(W)], [0, E - 1])]):
        inputs = _inputs(W, Ts, 5, E, 4, seed=40 + seed, skew=skew)
        res = [_round(d, inputs[ctx["rank"]]) for d in disps]
        for (out, dx, dp, _), a in zip(res[1:], algs[1:]):
            _close(out, res[0][0], f"{a} out vs flat")
            _close(dx, res[0][1], f"{a} d tokens vs flat")
            _close(dp, res[0][2], f"{a} d probs vs flat")


def scenario_expert_map(ctx, algorithm):
    """A permuted placement (as the load balancer would install) and a later swap."""
    from ascend_moe_ops.distributed import MoEDispatcher
    W = ctx["world"]
    E = 3 * W
    m = torch.randperm(E, generator=torch.Generator().manual_seed(5)) % W
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm, expert_to_rank=m)
    assert disp.local_experts.tolist() == torch.nonzero(m == ctx["rank"]).flatten().tolist()
    inputs = _inputs(W, [5] * W, 4, E, 4, seed=20)
    _check_against_oracle(disp, inputs, ctx["rank"])
    m2 = torch.roll(m, 1)
    disp.set_expert_to_rank(m2)
    assert disp.local_experts.tolist() == torch.nonzero(m2 == ctx["rank"]).flatten().tolist()
    _check_against_oracle(disp, inputs, ctx["rank"])
    # uneven placement (rank 0 owns one extra expert, the last rank one fewer)
    m3 = torch.arange(E) // 3
    m3[3] = 0
    with pytest.raises(ValueError, match=re.escape("different numbers of experts")):
        disp.set_expert_to_rank(m3)
    du = MoEDispatcher(ctx["topo"], E, algorithm=algorithm, expert_to_rank=m3, allow_uneven=True)
    assert du.num_local_experts == (4 if ctx["rank"] == 0 else 2 if ctx["rank"] == 1 else 3)
    _check_against_oracle(du, inputs, ctx["rank"])


def scenario_errors(ctx):
    import ascend_moe_ops.distributed as amd
    from ascend_moe_ops.distributed import EPTopology, MoEDispatcher, SplitMismatchError
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    E = 2 * W
    with pytest.raises(ValueError, match=re.escape("not divisible by local_size")):
        EPTopology(topo.group, local_size=W + 1 if W > 2 else 3)
    with pytest.raises(ValueError, match=re.escape("not divisible by the EP world size")):
        MoEDispatcher(topo, E + 1)
    with pytest.raises(ValueError, match=re.escape("timeout must be a positive number")):
        EPTopology(topo.group, local_size=ctx["local_size"], timeout=-1)
    if W > 1:  # ranks splitting the group differently: an error on every rank, before any subgroup
        with pytest.raises(ValueError, match=re.escape("disagree on local_size (ranks per node): per-rank values")):
            EPTopology(topo.group, local_size=1 if rank == 0 else W)
    disp = MoEDispatcher(topo, E, algorithm="flat")
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=re.escape("outside the valid range")):
        disp.dispatch(x, torch.full((4, 2), E), None)
    with pytest.raises(ValueError, match=re.escape("probs must have shape")):
        disp.dispatch(x, torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 3))
    with pytest.raises(ValueError, match=re.escape("one row per token")):
        disp.dispatch(x, torch.zeros(5, 2, dtype=torch.long), None)
    # a map that differs between ranks is caught on every rank
    m = torch.arange(E) // 2
    if rank == 0:
        m = torch.roll(m, 2)
    with pytest.raises(ValueError, match=re.escape("differs between EP ranks")):
        disp.set_expert_to_rank(m)
    if W > 1:  # one rank's map breaks a local rule: its own error there, a named one on the others (no wait)
        bad = torch.arange(E) // 2
        if rank == W - 1:
            bad[0] = W  # out of range
        want = "outside the valid range" if rank == W - 1 else f"EP ranks [{W - 1}] rejected their expert_to_rank"
        with pytest.raises(ValueError, match=re.escape(want)):
            disp.set_expert_to_rank(bad)
        disp.set_expert_to_rank(torch.arange(E) // 2)  # the group is still usable

    # debug mode: a deliberately wrong split is caught before any data moves, on every rank
    send = [1] * W
    recv = [1] * W
    if rank == 0:
        send = [2] + [1] * (W - 1)
    with pytest.raises(SplitMismatchError, match=re.escape("rank 0 sends 2 rows to rank 0, which expects 1")):
        amd.all_to_all(torch.randn(W + 1, 3), send, recv, topo.group, debug=True)
    with pytest.raises(SplitMismatchError, match=re.escape("sends")):
        amd.check_splits([0] * W, [0] * (W - 1) + [int(rank == 0)], topo.group)
    dbg = MoEDispatcher(topo, E, algorithm="hierarchical", debug=True)
    ids = torch.zeros(4, 2, dtype=torch.long)
    # non-matching dtypes across ranks
    xx = torch.randn(4, 3, dtype=torch.float32 if rank == 1 else torch.float64)
    with pytest.raises(SplitMismatchError, match=re.escape("disagree on tokens dtype")):
        dbg.dispatch(xx, ids, None)
    # bad ids on one rank: that rank raises ValueError, every other rank a clear error too
    bad = torch.full((4, 2), E) if rank == W - 1 else ids
    if rank == W - 1:
        with pytest.raises(ValueError, match=re.escape("outside the valid range")):
            dbg.dispatch(x, bad, None)
    else:
        with pytest.raises(SplitMismatchError, match=re.escape(f"EP ranks [{W - 1}] rejected")):
            dbg.dispatch(x, bad, None)
    # the debug dispatcher still works on good input
    inputs = _inputs(W, [3] * W, 4, E, 2, seed=21)
    h = _check_against_oracle(dbg, inputs, rank)
    # combine with the wrong number of rows or without a handle (here on every rank): each rank
    # raises its own error after the combine's metadata exchange
    rows = int(h.tokens_per_local_expert.sum())
    with pytest.raises(ValueError, match=re.escape(f"expert_output must have {rows} rows")):
        dbg.combine(torch.zeros(rows + 1, 4, dtype=torch.float64), h)
    with pytest.raises(TypeError, match=re.escape("handle must be the DispatchHandle")):
        dbg.combine(torch.zeros(rows, 4), None)


def scenario_mismatch(ctx):
    """Shape/dtype disagreements between ranks raise a clear error naming the argument on every
    rank without debug mode (the metadata ride on the first count exchange), in every mode; the
    group stays usable afterwards."""
    from ascend_moe_ops.distributed import MoEDispatcher, SplitMismatchError
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    E = 2 * W
    with pytest.raises(ValueError, match=re.escape("EP ranks disagree on num_experts")):
        MoEDispatcher(topo, E if rank else 2 * E)
    ids = torch.randint(0, E, (4, 2))
    for alg in ("flat", "hierarchical", "hierarchical_allgather"):
        disp = MoEDispatcher(topo, E, algorithm=alg)
        with pytest.raises(SplitMismatchError, match=re.escape("disagree on hidden size H")):
            disp.dispatch(torch.randn(4, 3 if rank == 0 else 5), ids, None)
        with pytest.raises(SplitMismatchError, match=re.escape("disagree on top-k K")):
            disp.dispatch(torch.randn(4, 3), ids if rank == W - 1 else ids[:, :1], None)
        with pytest.raises(SplitMismatchError, match=re.escape("disagree on tokens dtype")):
            disp.dispatch(torch.randn(4, 3, dtype=torch.float16 if rank == 1 else torch.float32),
                          ids, None)
        with pytest.raises(SplitMismatchError, match=re.escape("disagree on probs")):
            disp.dispatch(torch.randn(4, 3), ids, torch.rand(4, 2) if rank == 0 else None)
        inputs = _inputs(W, [3] * W, 4, E, 2, seed=22)
        _check_against_oracle(disp, inputs, rank)  # still works


def scenario_overlap(ctx, algorithm):
    """moe_forward_overlapped / MoELayer(overlap_chunks=3): bitwise equal to the same chunks run
    one after the other, and to the unchunked layer except for the chunked weight-gradient sums
    (fp32 tolerance there). Uneven T, an empty rank, chunks with no tokens."""
    from ascend_moe_ops.distributed import MoEDispatcher, moe_forward_overlapped
    from ascend_moe_ops.nn import MoELayer
    from ascend_moe_ops.testing import assert_close_to_ref
    W, rank = ctx["world"], ctx["rank"]
    E, H, F, K = 2 * W, 16, 8, 3
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    torch.manual_seed(7)  # the same router and local experts on every rank
    layer = MoELayer(H, E, F, K, dispatcher=disp, shared_expert_ffn_hidden_size=8)
    assert layer.experts.num_experts == disp.num_local_experts
    with pytest.raises(ValueError, match=re.escape("needs an expert-parallel dispatcher")):
        MoELayer(H, E, F, K, overlap_chunks=2)
    with pytest.raises(ValueError, match=re.escape("dropless")):
        MoELayer(H, E, F, K, dispatcher=disp, capacity_factor=1.0)
    with pytest.raises(ValueError, match=re.escape("chunks must be a positive int")):
        moe_forward_overlapped(disp, torch.zeros(2, H), torch.zeros(2, K, dtype=torch.long), None,
                               layer.experts, chunks=0)
    T = 0 if rank == 1 else 5 + 3 * rank
    g = torch.Generator().manual_seed(60 + rank)
    x0 = torch.randn(T, H, generator=g)
    gy = torch.randn(T, H, generator=g)
    params = list(layer.parameters())

    def run(fn):
        x = x0.clone().requires_grad_(True)
        for q in params:
            q.grad = None
        out = fn(x)
        (out * gy).sum().backward()
        return [out.detach(), x.grad] + [None if q.grad is None else q.grad.clone() for q in params]

    def functional(overlap):
        def fn(x):
            ids, probs, _ = layer.router(x)
            return moe_forward_overlapped(disp, x, ids, probs, layer.experts,
                                          list(layer.experts.parameters()), chunks=3,
                                          overlap=overlap, shared_fn=layer.shared_experts,
                                          shared_params=list(layer.shared_experts.parameters()))
        return fn

    seq = run(functional(False))
    ovl = run(functional(True))
    assert ovl[1] is not None and ovl[2] is not None  # d tokens, d router weight
    assert all(q.grad is not None for q in layer.shared_experts.parameters())
    for a, b in zip(ovl, seq):
        assert (a is None and b is None) or torch.equal(a, b), \
            "overlapped != the same chunks run one after the other"
    layer.overlap_chunks = 1
    ref = run(layer)
    layer.overlap_chunks = 3
    chunked = run(layer)
    assert torch.equal(chunked[0], ref[0]), "overlapped layer output != unchunked layer output"
    assert torch.equal(chunked[1], ref[1]), "overlapped layer d tokens != unchunked"
    for a, b, (name, _) in zip(chunked[2:], ref[2:], layer.named_parameters()):
        assert_close_to_ref(a, b.double(), dtype=torch.float32, name=f"d {name} (chunked sums)")
    with torch.no_grad():  # inference path (no graphs kept)
        assert torch.equal(layer(x0), ref[0])


def scenario_overlap_order(ctx, algorithm):
    """The pipeline really overlaps: the recorded event order of one overlapped fwd+bwd (4 chunks)
    has, for every chunk i, chunk i+1's dispatch issued (on the communication thread) before
    chunk i's experts end (forward), and chunk i+1's combine-gradient all-to-all launched before
    chunk i's expert backward (its weight-gradient GEMMs) starts; expert work runs on the
    calling thread, collectives on the communication thread."""
    from ascend_moe_ops.distributed import MoEDispatcher, moe_forward_overlapped
    from ascend_moe_ops.distributed.overlap import record_schedule
    from ascend_moe_ops.nn import GroupedMLP, SharedExpertMLP
    W, rank = ctx["world"], ctx["rank"]
    E, H, K, n = 2 * W, 8, 2, 4
    disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm)
    torch.manual_seed(3)
    experts = GroupedMLP(disp.num_local_experts, H, 8)
    shared = SharedExpertMLP(H, 8)
    g = torch.Generator().manual_seed(70 + rank)
    T = 12 + rank
    x = torch.randn(T, H, generator=g, requires_grad=True)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    probs = torch.rand(T, K, generator=g, requires_grad=True)
    with record_schedule() as ev:
        out = moe_forward_overlapped(disp, x, ids, probs, experts, list(experts.parameters()),
                                     chunks=n, shared_fn=shared, shared_params=list(shared.parameters()))
        out.sum().backward()
    assert x.grad is not None and all(q.grad is not None for q in experts.parameters())
    assert all(q.grad is not None for q in shared.parameters())

    def at(phase, name, i):
        hits = [e for e in ev if (e["phase"], e["event"], e["chunk"]) == (phase, name, i)]
        assert len(hits) == 1, (phase, name, i, hits)
        return hits[0]

    main = at("fwd", "expert_start", 0)["thread"]
    for i in range(n):
        for phase, name in (("fwd", "dispatch_launch"), ("fwd", "combine_launch"),
                            ("bwd", "combine_grad_launch"), ("bwd", "dispatch_grad_launch")):
            assert at(phase, name, i)["thread"] != main, (phase, name, i)
        assert at("fwd", "expert_end", i)["thread"] == main
        assert at("bwd", "expert_bwd_start", i)["thread"] == main
        assert at("fwd", "dispatch_launch", i)["detail"].startswith("dispatch: ")
        launch = at("bwd", "combine_grad_launch", i)
        assert launch["detail"].startswith("combine: all-to-all") and \
            launch["detail"].endswith("(backward)"), launch
        if i + 1 < n:
            nxt = at("fwd", "dispatch_launch", i + 1)
            assert nxt["seq"] < at("fwd", "expert_end", i)["seq"], (i, nxt)
            nxt = at("bwd", "combine_grad_launch", i + 1)
            assert nxt["seq"] < at("bwd", "expert_bwd_start", i)["seq"], (i, nxt)
    # the shared expert runs on the calling thread while chunk 0's first transfer is out:
    # after its first collective was issued, before chunk 0's experts (forward) / expert backward
    for phase, pre, ev_name, post in (("fwd", "dispatch_launch", "shared_start", "expert_start"),
                                      ("bwd", "combine_grad_launch", "shared_bwd_start", "expert_bwd_start")):
        sh = at(phase, ev_name, -1)
        assert sh["thread"] == main
        assert at(phase, pre, 0)["seq"] < sh["seq"] < at(phase, post, 0)["seq"], (phase, sh)
    # backward of chunk i's experts comes after its own combine gradient arrived
    for i in range(n):
        assert at("bwd", "combine_grad_done", i)["seq"] < at("bwd", "expert_bwd_start", i)["seq"]


def scenario_auto(ctx):
    from ascend_moe_ops.distributed import MoEDispatcher
    topo = ctx["topo"]
    disp = MoEDispatcher(topo, 2 * ctx["world"])
    N = topo.num_nodes
    assert disp.resolve_algorithm(8) == ("flat" if N == 1 else "hierarchical")
    assert disp.resolve_algorithm(N) == "flat"


def scenario_subgroup(ctx):
    """EP group smaller than the enclosing one: independent 2-rank EP groups (2 nodes x 1 rank)."""
    import torch.distributed as dist
    from ascend_moe_ops.distributed import EPTopology
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    if W % 2:
        return
    pair = [topo.ranks[2 * (rank // 2)], topo.ranks[2 * (rank // 2) + 1]]  # global ranks
    sub = dist.new_group(pair, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
                         use_local_synchronization=True)
    topo2 = EPTopology(sub, local_size=1)
    assert (topo2.world_size, topo2.rank, topo2.num_nodes) == (2, rank % 2, 2)
    sub_ctx = dict(rank=rank % 2, world=2, local_size=1, topo=topo2)
    scenario_fp64(sub_ctx, "hierarchical")
    scenario_fp64(sub_ctx, "flat")


def scenario_auto_k_mismatch(ctx):
    """"auto" with a top-k that differs between ranks (one rank at K = N, resolving to flat, the
    others at K = N + 1, hierarchical when N > 1): the same SplitMismatchError on every rank as
    with an explicit algorithm (it used to abort a rank in gloo), and the group stays usable."""
    from ascend_moe_ops.distributed import MoEDispatcher, SplitMismatchError
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    E, N = 2 * W, topo.num_nodes
    disp = MoEDispatcher(topo, E)
    K = N if rank == 0 else N + 1
    with pytest.raises(SplitMismatchError, match=re.escape("EP ranks disagree on top-k K")):
        disp.dispatch(torch.randn(5, 3), torch.randint(0, E, (5, K)), torch.rand(5, K))
    _check_against_oracle(disp, _inputs(W, [3] * W, 4, E, N + 1, seed=23), rank)


def scenario_chunks_mismatch(ctx):
    """moe_forward_overlapped with a number of chunks that differs between ranks: the ranks would issue
    different numbers of collectives (gloo aborted a rank); now the first chunk's metadata exchange
    raises SplitMismatchError naming the chunks on every rank, and the group stays usable."""
    from ascend_moe_ops.distributed import MoEDispatcher, SplitMismatchError, moe_forward_overlapped
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    E = 2 * W
    for algorithm in ("flat", "hierarchical"):
        disp = MoEDispatcher(topo, E, algorithm=algorithm)
        x, ids, p = torch.randn(6, 3), torch.randint(0, E, (6, 2)), torch.rand(6, 2)
        with pytest.raises(SplitMismatchError, match=re.escape("EP ranks disagree on chunks")):
            moe_forward_overlapped(disp, x, ids, p, lambda t, n: 2 * t, chunks=2 if rank == 0 else 3)
        _check_against_oracle(disp, _inputs(W, [3] * W, 4, E, 2, seed=29), rank)


def scenario_zero_experts(ctx, algorithm):
    """allow_uneven with a rank (and, on 2-node topologies, a whole node) owning no expert:
    values and gradients of tokens and probs equal the closed form and flat's, and no rank skips
    a backward collective (the expert-less rank used to drop its probs from the graph: its peers
    waited for the backward all-to-all of the slots until the timeout)."""
    from ascend_moe_ops.distributed import MoEDispatcher
    W, G, rank = ctx["world"], ctx["local_size"], ctx["rank"]
    E = 2 * W
    maps = [torch.arange(E) % (W - 1)]  # the last rank owns nothing
    if W > G:
        maps.append(torch.arange(E) % (W - G) + G)  # node 0 owns nothing
    inputs = _inputs(W, [4, 0] + [3] * (W - 2), 4, E, 3, seed=24)
    for m in maps:
        disp = MoEDispatcher(ctx["topo"], E, algorithm=algorithm, expert_to_rank=m, allow_uneven=True)
        flat = MoEDispatcher(ctx["topo"], E, algorithm="flat", expert_to_rank=m, allow_uneven=True)
        assert disp.num_local_experts == int((m == rank).sum())
        _check_against_oracle(disp, inputs, rank)
        out, dx, dp, _ = _round(disp, inputs[rank])
        fout, fdx, fdp, _ = _round(flat, inputs[rank])
        _close(out, fout, "out vs flat")
        _close(dx, fdx, "d tokens vs flat")
        _close(dp, fdp, "d probs vs flat")


def scenario_combine_mismatch(ctx):
    """combine with an expert output whose hidden size or dtype differs between ranks, or with
    bad arguments on one rank: a clear error on every rank (one tiny all-gather in combine),
    never a gloo abort or a [T, H + 1] result; the group stays usable."""
    from ascend_moe_ops.distributed import MoEDispatcher, SplitMismatchError
    topo, W, rank = ctx["topo"], ctx["world"], ctx["rank"]
    E = 2 * W
    inputs = _inputs(W, [3] * W, 4, E, 2, seed=25)
    x, ids, p, _ = inputs[rank]
    for alg in ("flat", "hierarchical", "hierarchical_allgather"):
        disp = MoEDispatcher(topo, E, algorithm=alg)
        et, tpe, h = disp.dispatch(x, ids, p)
        eo = _toy_experts(et, tpe, disp)
        with pytest.raises(SplitMismatchError, match=re.escape(
                "EP ranks disagree on hidden size of expert_output (expert_output.shape[1]): "
                f"per-rank values {[4] + [5] * (W - 1)}")):
            disp.combine(eo if rank == 0 else torch.cat([eo, eo[:, :1]], 1), h)
        with pytest.raises(SplitMismatchError, match=re.escape("EP ranks disagree on expert_output dtype")):
            disp.combine(eo.float() if rank == 1 else eo, h)
        if rank == W - 1:
            with pytest.raises(ValueError, match=re.escape("expert_output must have")):
                disp.combine(torch.cat([eo, eo[:1]]), h)
        else:
            with pytest.raises(SplitMismatchError, match=re.escape(f"EP ranks [{W - 1}] rejected their combine")):
                disp.combine(eo, h)
        _check_against_oracle(disp, inputs, rank)  # still works


def scenario_overlap_retain_graph(ctx):
    """moe_forward_overlapped and MoELayer(overlap_chunks=2) support backward(retain_graph=True)
    twice, as plain dispatch/combine do (the second backward was a TypeError: the chunk graphs
    were freed); without retain_graph the second backward names it. A deepcopy of the layer (an EMA
    copy) shares the dispatcher (it was "cannot pickle 'ProcessGroup'") and computes the same."""
    import copy
    from ascend_moe_ops.distributed import MoEDispatcher, moe_forward_overlapped
    from ascend_moe_ops.nn import MoELayer
    W, rank = ctx["world"], ctx["rank"]
    E, H, F, K = 2 * W, 8, 6, 2
    for alg in ("flat", "hierarchical"):
        disp = MoEDispatcher(ctx["topo"], E, algorithm=alg)
        torch.manual_seed(3)
        layer = MoELayer(H, E, F, K, dispatcher=disp, shared_expert_ffn_hidden_size=4, overlap_chunks=2)
        g = torch.Generator().manual_seed(80 + rank)
        x = torch.randn(4 + rank, H, generator=g, requires_grad=True)
        ids, probs, _ = layer.router(x)
        out = moe_forward_overlapped(disp, x, ids, probs, layer.experts, list(layer.experts.parameters()),
                                     chunks=2, shared_fn=layer.shared_experts,
                                     shared_params=list(layer.shared_experts.parameters()))
        out.sum().backward(retain_graph=True)
        first = [x.grad.clone()] + [q.grad.clone() for q in layer.parameters()]
        out.sum().backward(retain_graph=True)
        second = [x.grad] + [q.grad for q in layer.parameters()]
        for a, b in zip(first, second):
            torch.testing.assert_close(b, 2 * a, rtol=1e-6, atol=1e-6)
        out.sum().backward()  # the last one frees the graphs
        with pytest.raises(RuntimeError, match="retain_graph=True"):
            out.sum().backward()
        y = layer(x)  # the layer's pipelined path
        y.sum().backward(retain_graph=True)
        y.sum().backward()
        ema = copy.deepcopy(layer)
        assert ema.dispatcher is disp and ema.experts.weight1 is not layer.experts.weight1
        with torch.no_grad():
            assert torch.equal(ema(x), layer(x))


def scenario_stale_handle(ctx):
    """A handle belongs to its dispatch: ranks combining handles of different dispatches (here
    rank 0 the older one, with the same row counts) raise SplitMismatchError on every rank (it was
    a silently wrong sum); combining one handle twice stays right; the group stays usable."""
    from ascend_moe_ops.distributed import MoEDispatcher, SplitMismatchError
    W, rank = ctx["world"], ctx["rank"]
    E = 2 * W
    x = torch.arange(8.).view(4, 2) + 10 * rank
    ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]]) % E
    for alg in ("flat", "hierarchical", "hierarchical_allgather"):
        disp = MoEDispatcher(ctx["topo"], E, algorithm=alg)
        et1, _, h1 = disp.dispatch(x, ids)
        et2, _, h2 = disp.dispatch(x, ids.roll(1, 0))
        assert (h1.dispatch_id, h2.dispatch_id) == (1, 2)
        assert et1.shape == et2.shape
        right = disp.combine(et2, h2)
        assert torch.equal(disp.combine(et2, h2), right)  # a handle may be combined twice
        with pytest.raises(SplitMismatchError, match=re.escape(
                "EP ranks disagree on the dispatch the handle comes from (handle.dispatch_id")):
            disp.combine(et2, h1 if rank == 0 else h2)
        assert torch.equal(disp.combine(et2, h2), right)


def scenario_overlap_bad_args(ctx):
    """moe_forward_overlapped names a non-tensor topk_idx / probs / tokens / param (a list was a raw
    AttributeError from tensor_split), before any collective (every rank passes the same)."""
    from ascend_moe_ops.distributed import MoEDispatcher, moe_forward_overlapped
    W = ctx["world"]
    disp = MoEDispatcher(ctx["topo"], 2 * W, algorithm="flat")
    x, ids = torch.randn(3, 4), torch.tensor([[0, 1]] * 3)
    fn = lambda t, s: t  # noqa: E731
    with pytest.raises(TypeError, match="^topk_idx must be a torch.Tensor, got list"):
        moe_forward_overlapped(disp, x, [[0, 1]] * 3, None, fn)
    # dtypes and shapes are the dispatcher's to check (in its first collective, as before 2026-12-08)
    with pytest.raises((TypeError, ValueError), match="topk_idx"):
        moe_forward_overlapped(disp, x, ids.float(), None, fn)
    with pytest.raises(TypeError, match="^probs must be a torch.Tensor, got list"):
        moe_forward_overlapped(disp, x, ids, [[0.5, 0.5]] * 3, fn)
    with pytest.raises(TypeError, match="^tokens must be a torch.Tensor, got list"):
        moe_forward_overlapped(disp, x.tolist(), ids, None, fn)
    with pytest.raises(ValueError, match="^tokens must be 2-D"):
        moe_forward_overlapped(disp, x[0], ids, None, fn)
    with pytest.raises(TypeError, match="^expert_fn must be callable"):
        moe_forward_overlapped(disp, x, ids, None, None)
    with pytest.raises(TypeError, match=re.escape("params[0] must be a torch.Tensor")):
        moe_forward_overlapped(disp, x, ids, None, fn, [1.0])
    assert moe_forward_overlapped(disp, x, ids, None, fn).shape == (3, 4)  # still works
    # params may be a generator (module.parameters()): read once, its tensors still get gradients
    w = torch.ones(4, requires_grad=True)
    out = moe_forward_overlapped(disp, x.requires_grad_(), ids, None, lambda t, s: t * w, (q for q in [w]), chunks=2)
    out.sum().backward()
    assert w.grad is not None  # None when the generator had been read by the argument checks


SCENARIOS = {}
for _alg in ("flat", "hierarchical", "hierarchical_allgather"):
    SCENARIOS[f"fp64_{_alg}"] = (scenario_fp64, (_alg,))
    SCENARIOS[f"async_{_alg}"] = (scenario_fp64, (_alg, True))
    SCENARIOS[f"skew_{_alg}"] = (scenario_skew, (_alg,))
    SCENARIOS[f"zero_tokens_{_alg}"] = (scenario_zero_tokens, (_alg,))
    SCENARIOS[f"overlap_{_alg}"] = (scenario_overlap, (_alg,))
    SCENARIOS[f"zero_experts_{_alg}"] = (scenario_zero_experts, (_alg,))
    if _alg == "hierarchical_allgather":
        continue  # its node stage is the deduplicated path's: the scenarios below run once there
    SCENARIOS[f"no_probs_{_alg}"] = (scenario_no_probs, (_alg,))
    SCENARIOS[f"overlap_order_{_alg}"] = (scenario_overlap_order, (_alg,))
    SCENARIOS[f"round_trip_{_alg}"] = (scenario_round_trip, (_alg,))
    SCENARIOS[f"bf16_{_alg}"] = (scenario_bf16, (_alg,))
    SCENARIOS[f"expert_map_{_alg}"] = (scenario_expert_map, (_alg,))
SCENARIOS["fp64_auto"] = (scenario_fp64, ("auto",))
SCENARIOS["stats"] = (scenario_stats, ())
SCENARIOS["modes_equal"] = (scenario_modes_equal, ())
SCENARIOS["mismatch"] = (scenario_mismatch, ())
SCENARIOS["errors"] = (scenario_errors, ())
SCENARIOS["auto"] = (scenario_auto, ())
SCENARIOS["auto_k_mismatch"] = (scenario_auto_k_mismatch, ())
SCENARIOS["chunks_mismatch"] = (scenario_chunks_mismatch, ())
SCENARIOS["combine_mismatch"] = (scenario_combine_mismatch, ())
SCENARIOS["subgroup"] = (scenario_subgroup, ())
SCENARIOS["overlap_retain_graph"] = (scenario_overlap_retain_graph, ())
SCENARIOS["stale_handle"] = (scenario_stale_handle, ())
SCENARIOS["overlap_bad_args"] = (scenario_overlap_bad_args, ())


def scenario_calls(ctx, names):
    """``(name, fn)`` pairs for :func:`_spawn.run_scenarios` (also used by the HCCL harness)."""
    return [(name, functools.partial(SCENARIOS[name][0], ctx, *SCENARIOS[name][1])) for name in names]


# ------------------------------------------------------------------ one spawned world for all
# Starting a rank process (importing torch) costs more CPU than most scenarios, so ONE spawned
# world of 8 gloo processes runs every topology and every fault, in phases separated by barriers
# of the default group (long timeout; it is used for nothing else):
#   1. ranks 0-3 run 2x2 while ranks 4-7 run 1x4;
#   2. ranks 0-5 run 3x2, then 2x3 (ranks 6 and 7 wait at the barrier);
#   3. ranks 0-3 run fault list "a" while ranks 4-7 run fault list "b" (see below).
# Every topology (and every fault) gets its own EP group (new_group over its ranks with the
# EP timeout); every collective has a timeout and the world a join deadline, so a deadlock fails
# the tests instead of hanging.
WORLD_SIZE = 8
PHASES = [[(0, ["2x2"]), (4, ["1x4"])], [(0, ["3x2", "2x3"])]]  # (first global rank, topologies)
FIRST_RANK = {name: first for phase in PHASES for first, names in phase for name in names}
FAULT_JOBS = [(0, "a"), (4, "b")]  # (first global rank, fault list)
WORLD_TIMEOUT_S = 600
WORLD_JOIN_TIMEOUT_S = int(os.environ.get("EP_TEST_JOIN_TIMEOUT", 480))


def _names(world, only=None):
    return [n for n in SUBSETS.get(world, list(SCENARIOS))
            if n not in _SKIP.get(world, ()) and (only is None or n in only)]


def _setup_rank():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for p in (_ROOT, os.path.join(_ROOT, "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore", message=".*runs the reference backend.*")


def _pad_group_count():
    """Make every rank hold as many process groups as the rank with the most (one-rank groups)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    mine = len(c10d._world.pg_names)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine)
    for _ in range(max(counts) - mine):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def _survivors():
    """Global ranks alive after the faults (each fault list's "dies" victim exits)."""
    dead = {first + victim for first, tag in FAULT_JOBS
            for _, _, victim, kind in FAULT_GROUPS[tag] if kind == "dies"}
    return [r for r in range(WORLD_SIZE) if r not in dead]


def _world_worker(rank, port, outdir, only, faults):
    _setup_rank()
    import torch.distributed as dist
    from ascend_moe_ops.distributed import EPTopology
    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=WORLD_SIZE,
                                timeout=datetime.timedelta(seconds=WORLD_TIMEOUT_S))
        # Every group is created up front. A subgroup made with use_local_synchronization=True
        # (EPTopology's subgroups of an explicit EP group) is named from its ranks and the number
        # of groups its creator already holds, so its members must hold equally many: the EP
        # groups are created by all ranks in one order (a non-member holds none of them, so the
        # counts are then padded), then the topologies of the fault lists (every rank creates
        # as many), then those of the scenario phases.
        jobs = [(first, name) for phase in PHASES for first, names in phase for name in names]
        eps = {}
        for first, name in jobs:
            eps[name] = dist.new_group(list(range(first, first + WORLDS[name][0])),
                                       timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        for first, tag in FAULT_JOBS:
            for fault in FAULT_GROUPS[tag]:
                eps[fault[0]] = dist.new_group(list(range(first, first + 4)),
                                               timeout=datetime.timedelta(seconds=FAULT_TIMEOUT_S))
        _pad_group_count()
        topos = {}
        for first, tag in FAULT_JOBS:
            if first <= rank < first + 4:
                for fault in FAULT_GROUPS[tag]:
                    topos[fault[0]] = EPTopology(eps[fault[0]], local_size=2)
        for first, name in jobs:
            if first <= rank < first + WORLDS[name][0]:
                topos[name] = EPTopology(eps[name], local_size=WORLDS[name][1])
        for phase in PHASES:
            for first, names in phase:
                for name in names:
                    world, local = WORLDS[name]
                    if not first <= rank < first + world:
                        continue
                    ctx = dict(rank=rank - first, world=world, local_size=local, topo=topos[name])
                    calls = [(f"{name}/{n}", fn) for n, fn in scenario_calls(ctx, _names(name, only))]
                    run_scenarios(calls, results, outdir, rank,
                                  log=bool(os.environ.get("EP_TEST_VERBOSE")))
            dist.barrier()
        if faults:
            for first, tag in FAULT_JOBS:
                if first <= rank < first + 4:
                    _run_faults(rank, first, FAULT_GROUPS[tag], topos, results, outdir)
    except Exception:
        setup_failure(results, outdir, rank)
    # rank 0 hosts the store the later groups rendezvous on: it stays until every surviving
    # rank is done (bounded), then everyone leaves without an orderly teardown (the fault groups
    # are broken on purpose)
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"ep_test_done_{rank}", "1")
        if rank == 0:
            store.wait([f"ep_test_done_{r}" for r in _survivors()], datetime.timedelta(seconds=60))
    except Exception:
        pass
    os._exit(0)


_CACHE = {}


def _world_results(tmp_path_factory):
    if "world" not in _CACHE:
        d = str(tmp_path_factory.mktemp("ep_world"))
        _CACHE["world"] = spawn_ranks(_world_worker, WORLD_SIZE, (free_port(), d, None, True), d,
                                      WORLD_JOIN_TIMEOUT_S)
    return _CACHE["world"]


@pytest.mark.parametrize("world,scenario", [(w, s) for w in WORLDS for s in _names(w)])
def test_ep_dispatcher(world, scenario, tmp_path_factory):
    per_rank, hung = _world_results(tmp_path_factory)
    first, n = FIRST_RANK[world], WORLDS[world][0]
    bad = problems(per_rank[first:first + n], [r - first for r in hung if first <= r < first + n],
                   [f"{world}/{scenario}"])
    if bad:
        pytest.fail("\n".join(bad))


# ------------------------------------------------------------------ faults
# Each fault runs on its own 4-rank EP group (2 nodes x 2) with a short timeout, so several
# faults share one set of processes. A victim rank raises inside
# dispatch (or skips combine) and stays alive, or dies (os._exit); every other rank must raise
# CollectiveError naming the collective within the timeout plus a margin. The two fault lists
# run at the same time on ranks 0-3 and 4-7 of the spawned world (they mostly wait on timeouts).
FAULT_TIMEOUT_S = 5
FAULT_MARGIN_S = float(os.environ.get("EP_TEST_FAULT_MARGIN", 8))  # loaded 2-core CI machines
FAULT_GROUPS = {  # fault list -> [(name, algorithm, victim, kind)]; "dies" must come last
    "a": [("flat_raise", "flat", 1, "raise"), ("allgather_raise", "hierarchical_allgather", 3, "raise"),
          ("hier_dies", "hierarchical", 1, "dies")],
    "b": [("hier_raise", "hierarchical", 2, "raise"),
          ("hier_skip_combine", "hierarchical", 0, "skip_combine"), ("flat_dies", "flat", 2, "dies")],
}
FAULTS = [f for group in FAULT_GROUPS.values() for f in group]
FAULT_FIRST = {name: first for first, tag in FAULT_JOBS for name, *_ in FAULT_GROUPS[tag]}


def _run_faults(grank, first, faults, topos, results, outdir):
    from _spawn import dump_results
    import ascend_moe_ops.distributed.dispatcher as D
    from ascend_moe_ops.distributed import MoEDispatcher
    world, rank = 4, grank - first
    for name, alg, victim, kind in faults:
        topo = topos[name]
        assert topo.timeout.total_seconds() == FAULT_TIMEOUT_S
        disp = MoEDispatcher(topo, 2 * world, algorithm=alg)
        x, ids, p, _ = _inputs(world, [6] * world, 4, 2 * world, 3, seed=50)[rank]
        et, _, h = disp.dispatch(x, ids, p)  # a good round first: connections are up
        disp.combine(et, h)
        original = D.moe_permute

        def boom(*args, **kwargs):
            if kind == "dies":
                os._exit(3)
            raise RuntimeError("injected fault")

        t0 = time.time()
        try:
            if rank == victim and kind != "skip_combine":
                D.moe_permute = boom
            et, _, h = disp.dispatch(x, ids, p)
            if rank == victim:  # stops participating: never calls combine
                raise RuntimeError("injected fault (skipped combine)")
            disp.combine(et, h)
            results[f"fault/{name}"] = ["no error", "", time.time() - t0]
        except Exception as e:
            results[f"fault/{name}"] = [type(e).__name__, str(e), time.time() - t0]
        finally:
            D.moe_permute = original
        dump_results(results, outdir, grank)
        if rank == victim:  # stay alive until every peer has given up on this group
            time.sleep(FAULT_TIMEOUT_S + 1)


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_ep_dispatcher_faults(fault, tmp_path_factory):
    name, alg, victim, kind = fault
    per_rank, hung = _world_results(tmp_path_factory)
    first = FAULT_FIRST[name]
    mine = [r - first for r in hung if first <= r < first + 4]
    assert not mine, f"ranks {mine} of the fault group hung"
    for r, res in enumerate(per_rank[first:first + 4]):
        res = res.get(f"fault/{name}") or res.get("__setup__")
        if r == victim:
            if kind != "dies":
                assert res is not None and "injected fault" in res[1], res
            continue
        assert res is not None, f"rank {r} reported nothing for {name}"
        etype, msg, secs = res
        assert etype == "CollectiveError", f"rank {r}: {etype}: {msg}"
        # (a rank whose part of the dispatch did not need the victim fails in the combine)
        assert msg.startswith(("dispatch: ", "combine: ")), msg
        assert "group of global ranks" in msg and "timeout 5 s" in msg, msg
        if kind == "skip_combine":
            assert msg.startswith("combine: "), msg
        assert secs <= FAULT_TIMEOUT_S + FAULT_MARGIN_S, f"rank {r}: error after {secs:.1f} s: {msg}"


if __name__ == "__main__":  # quick manual run: python tests/test_ep_dispatcher.py [scenario...]
    import tempfile
    only = sys.argv[1:] or None
    t0 = time.time()
    d = tempfile.mkdtemp()
    per_rank, hung = spawn_ranks(_world_worker, WORLD_SIZE, (free_port(), d, only, only is None), d,
                                 WORLD_JOIN_TIMEOUT_S)
    names = sorted({k for r in per_rank for k in r})
    print("\n".join(problems(per_rank, hung, [])) or "", f"hung: {hung}")
    for k in names:
        bad = [i for i, r in enumerate(per_rank) if k in r and r[k][0] not in ("ok", "CollectiveError")]
        print(k, "ok" if not bad else f"FAILED on ranks {bad}")
    print(f"{time.time() - t0:.1f}s")
