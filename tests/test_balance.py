"""Tests of ascend_moe_ops.balance: aux losses (hand-computed references, every level), drop
accounting, the load predictor, the placement planner, replica routing, and the executor.

The group levels and the executor need several processes: one spawned group of 4 gloo ranks runs
every distributed scenario in order and reports one result per scenario and rank (the spawn is the
expensive part on a small machine). Every collective has a timeout and the group has a join
deadline, so a deadlock fails instead of hanging.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import re
import sys

import pytest
import torch

from ascend_moe_ops.balance import (DropStats, ExpertLoadPredictor, MoveCost, Placement, aux_loss,
                                    coefficient_of_variation,
                                    biased_topk, capacity_for, default_max_moves, drop_stats,
                                    expert_counts, imbalance, plan_placement, update_expert_bias,
                                    z_loss)
from ascend_moe_ops.testing import assert_close_to_ref
from _spawn import free_port, problems, run_scenarios, setup_failure, spawn_ranks

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PG_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 150


# ================================================================================================
# hand-computed references

def ref_aux(scores, ids, E, K, coeff, counts=None, n_tokens=None):
    """Loop reference in fp64: coeff * E * sum_e (c_e / (K * T)) * mean_t scores[t, e]."""
    s = scores.double()
    T = s.shape[0]
    if counts is None:
        counts = [0] * E
        for row in ids.tolist():
            for e in row:
                if e >= 0:
                    counts[e] += 1
        n_tokens = T
    total = 0.0
    for e in range(E):
        total = total + (counts[e] / (K * n_tokens)) * (s[:, e].sum() / T)
    return coeff * E * total


def test_aux_loss_hand_example():
    scores = torch.tensor([[.5, .3, .2], [.1, .6, .3], [.2, .2, .6], [.7, .2, .1]], requires_grad=True)
    ids = torch.tensor([[0], [1], [2], [0]])
    loss = aux_loss(scores, ids, coeff=0.1)
    # f = [2/4, 1/4, 1/4], P = [.375, .325, .3] -> 0.1 * 3 * (.1875 + .08125 + .075) = 0.103125
    assert abs(loss.item() - 0.103125) < 1e-7
    loss.backward()
    # dL/ds[t, e] = coeff * E * f_e / T
    expect = torch.tensor([0.1 * 3 * f / 4 for f in (.5, .25, .25)]).expand(4, 3)
    torch.testing.assert_close(scores.grad, expect)
    # uniform routing and scores give exactly coeff
    u = torch.full((6, 3), 1 / 3)
    assert abs(aux_loss(u, torch.tensor([[0], [1], [2]] * 2), coeff=0.01).item() - 0.01) < 1e-8


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_aux_loss_micro_batch(dtype):
    T, E, K = 37, 10, 3
    scores64 = torch.softmax(torch.randn(T, E, dtype=torch.float64), 1)
    ids = torch.topk(scores64, K, 1).indices
    ids[3, 1] = -1                                                   # an empty slot
    s = scores64.to(dtype).requires_grad_()
    loss = aux_loss(s, ids, coeff=0.02)
    assert loss.dtype == torch.float32
    ref = ref_aux(s.detach(), ids, E, K, 0.02)
    assert_close_to_ref(loss.detach(), torch.as_tensor(ref), dtype=torch.float32)
    loss.backward()
    c = expert_counts(ids, E).double()
    g_ref = (0.02 * E * c / (K * T) / T).expand(T, E)
    assert_close_to_ref(s.grad, g_ref, dtype=dtype)
    # a bool mask gives the same loss
    mask = torch.zeros(T, E, dtype=torch.bool)
    for t in range(T):
        for e in ids[t].tolist():
            if e >= 0:
                mask[t, e] = True
    torch.testing.assert_close(aux_loss(s.detach(), mask, coeff=0.02, topk=K), loss.detach())


def test_aux_loss_sequence_level():
    B, L, E, K = 3, 8, 6, 2
    scores = torch.softmax(torch.randn(B * L, E, dtype=torch.float64), 1).requires_grad_()
    ids = torch.topk(torch.randn(B * L, E), K, 1).indices
    loss = aux_loss(scores, ids, level="sequence", seq_len=L, coeff=0.1)
    ref = sum(ref_aux(scores.detach()[b * L:(b + 1) * L], ids[b * L:(b + 1) * L], E, K, 0.1)
              for b in range(B)) / B
    assert abs(loss.item() - float(ref)) < 1e-12
    loss.backward()
    for b in range(B):
        c = expert_counts(ids[b * L:(b + 1) * L], E).double()
        g = 0.1 * E * c / (K * L) / L / B
        torch.testing.assert_close(scores.grad[b * L:(b + 1) * L], g.expand(L, E))
    # one sequence == micro-batch level
    one = aux_loss(scores.detach(), ids, level="sequence", seq_len=B * L)
    torch.testing.assert_close(one, aux_loss(scores.detach(), ids))


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_aux_loss_zero_tokens(idx_dtype):
    """An empty micro-batch (a rank with no tokens) gives a zero loss and zero gradient, not NaN."""
    E, K = 5, 2
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        s = torch.zeros(0, E, dtype=dtype, requires_grad=True)
        ids = torch.zeros(0, K, dtype=idx_dtype)
        for kw in (dict(), dict(level="sequence", seq_len=4)):
            loss = aux_loss(s, ids, coeff=0.1, **kw)
            assert loss.item() == 0.0 and torch.isfinite(loss), (dtype, kw)
            loss.backward()
            assert s.grad is not None and s.grad.shape == (0, E)
        mask = torch.zeros(0, E, dtype=torch.bool)
        assert aux_loss(s.detach(), mask, topk=K).item() == 0.0
    # tokens whose slots are all empty (-1): f = 0 everywhere -> 0
    s = torch.softmax(torch.randn(3, E), 1)
    assert aux_loss(s, torch.full((3, K), -1, dtype=idx_dtype)).item() == 0.0


def test_aux_loss_errors():
    s = torch.rand(4, 3)
    ids = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="level must be one of"):
        aux_loss(s, ids, level="batch")
    with pytest.raises(ValueError, match="needs seq_len"):
        aux_loss(s, ids, level="sequence")
    with pytest.raises(ValueError, match="must divide the number of tokens"):
        aux_loss(s, ids, level="sequence", seq_len=3)
    with pytest.raises(ValueError, match="needs group="):
        aux_loss(s, ids, level="ep_group")
    with pytest.raises(RuntimeError, match="not initialized"):
        aux_loss(s, ids, level="global")
    with pytest.raises(ValueError, match="outside the valid range"):
        aux_loss(s, torch.full((4, 2), 3), level="micro_batch")
    with pytest.raises(ValueError, match="one row per token"):
        aux_loss(s, ids[:3])
    with pytest.raises(ValueError, match="topk is required"):
        aux_loss(s, torch.zeros(4, 3, dtype=torch.bool))


def test_z_loss_and_bias():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]], requires_grad=True)
    z = z_loss(logits, coeff=0.5)
    # lse = [log 2, log 4] -> 0.5 * (log2^2 + log4^2) / 2
    assert abs(z.item() - 0.5 * (math.log(2) ** 2 + math.log(4) ** 2) / 2) < 1e-6
    z.backward()
    assert logits.grad is not None
    bias = torch.zeros(4)
    update_expert_bias(bias, torch.tensor([10, 0, 5, 5]), rate=0.1)
    torch.testing.assert_close(bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))
    scores = torch.tensor([[0.5, 0.4, 0.1, 0.0]], requires_grad=True)
    idx, w = biased_topk(scores, torch.tensor([-1.0, 0.0, 0.0, 1.0]), 2)
    assert idx.tolist() == [[3, 1]]
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.4]]))
    w.sum().backward()                       # weights come from the unbiased scores
    assert scores.grad.tolist() == [[0.0, 1.0, 0.0, 1.0]]


def test_drop_stats():
    from ascend_moe_ops import moe_permute
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [0, -1], [3, 1]])
    st = drop_stats(ids, num_experts=4, capacity=2)
    assert isinstance(st, DropStats)
    assert st.routed.tolist() == [4, 3, 1, 1] and st.dropped.tolist() == [2, 1, 0, 0]
    torch.testing.assert_close(st.rate_per_expert, torch.tensor([0.5, 1 / 3, 0.0, 0.0]))
    assert abs(st.rate.item() - 3 / 9) < 1e-7
    # the same from the row_id_map of moe_permute in capacity mode
    res = moe_permute(torch.randn(5, 4), ids, torch.rand(5, 2), num_experts=4, capacity=2)
    st2 = drop_stats(ids, num_experts=4, row_id_map=res.row_id_map)
    assert st2.dropped.tolist() == st.dropped.tolist()
    # capacity factor: C = ceil(1.5 * 5 * 2 / 4) = 4 -> nothing dropped
    assert capacity_for(5, 2, 4, 1.5) == 4
    assert drop_stats(ids, num_experts=4, capacity_factor=1.5).dropped.sum() == 0
    with pytest.raises(ValueError, match="exactly one of capacity"):
        drop_stats(ids, num_experts=4)


@pytest.mark.parametrize("routing, err", [
    (torch.tensor([[5, 1]]), ValueError), (torch.tensor([[-2, 1]]), ValueError),
    (torch.tensor([[1.7, 0.2]]), TypeError), (torch.ones(2, 5, dtype=torch.bool), ValueError),
    (torch.tensor([1, 2]), ValueError)])
def test_expert_counts_rejects_what_aux_loss_rejects(routing, err):
    """expert_counts used to drop out-of-range ids, truncate float ids and count a mask of the
    wrong width; it now refuses the routing that aux_loss and drop_stats refuse, with the same
    error type, naming ``routing``."""
    with pytest.raises(err, match="^routing"):
        expert_counts(routing, 3)
    if routing.dim() == 2:
        for other in (lambda: aux_loss(torch.rand(routing.shape[0], 3), routing, topk=2),
                      lambda: drop_stats(routing, num_experts=3, capacity=1)):
            with pytest.raises(err, match="^routing"):
                other()
    with pytest.raises(ValueError, match="^num_experts must be >= 1"):
        expert_counts(torch.tensor([[0, 1]]), 0)
    assert expert_counts(torch.tensor([[2, -1], [2, 0]]), 3).tolist() == [1, 0, 2]


@pytest.mark.parametrize("args, name", [((10, 2, 0, 1.0), "num_experts"), ((10, 2, -4, 1.0), "num_experts"),
                                        ((-5, 2, 4, 1.0), "num_tokens"), ((10, 0, 4, 1.0), "topk"),
                                        ((10, -1, 4, 1.0), "topk")])
def test_capacity_for_rejects_bad_sizes(args, name):
    """Every size of the capacity rule is checked, not only capacity_factor: E = 0 was a
    ZeroDivisionError, a negative E or T a negative capacity, K = 0 a capacity of 0."""
    with pytest.raises(ValueError, match=rf"^{name} must be >= "):
        capacity_for(*args)
    with pytest.raises(TypeError, match="^num_experts must be an int"):
        capacity_for(10, 2, 4.0, 1.0)
    assert capacity_for(0, 2, 4, 1.5) == 0          # T = 0 is valid
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            capacity_for(10, 2, 4, bad)


def test_aux_loss_coeff_must_be_finite():
    scores, routing = torch.rand(6, 4).softmax(-1), torch.randint(0, 4, (6, 2))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="coeff must be a finite number"):
            aux_loss(scores, routing, coeff=bad)
    with pytest.raises(TypeError, match="coeff must be a float"):
        aux_loss(scores, routing, coeff="0.01")


def test_capacity_for_and_the_capacity_layer_compile_with_symbolic_sizes():
    """The docstring's promise: symbolic sizes and factor under torch.compile(dynamic=True) (a symbolic
    float cannot go through math.isfinite); the same capacity, and the MoE layer's output, as eager."""
    f = torch.compile(lambda x, cf: x[:capacity_for(x.shape[0], 2, 4, cf)], fullgraph=True, dynamic=True,
                      backend="eager")
    for T, cf in ((9, 1.5), (11, 1.25)):
        assert f(torch.randn(T, 2), cf).shape[0] == min(T, capacity_for(T, 2, 4, cf))
    from ascend_moe_ops.nn import MoELayer
    torch.manual_seed(0)
    layer = MoELayer(8, 4, 8, 2, capacity_factor=1.25)
    x = torch.randn(5, 8)
    torch.testing.assert_close(torch.compile(layer, fullgraph=True, dynamic=True, backend="eager")(x), layer(x))


# ================================================================================================
# predictor

def test_predictor_robust_follows_a_burst():
    """A burst (x3 on one expert) is followed at once by ``robust``, while the quiet experts keep
    their smoothing; ``adaptive_ema`` (same bank, no jumps) lags behind the burst."""
    E, g = 8, torch.Generator().manual_seed(0)
    base = torch.full((E,), 400.0, dtype=torch.float64)
    rob = ExpertLoadPredictor(E, method="robust", horizon=1)
    ada = ExpertLoadPredictor(E, method="adaptive_ema", horizon=1)
    for t in range(80):
        lam = base.clone()
        if t >= 78:
            lam[3] = 1200.0                                   # the burst: its first 2 steps at x3
        x = torch.poisson(lam, generator=g)
        rob.update(x)
        ada.update(x)
    r, a = rob.predict(), ada.predict()
    assert abs(r[3] - 1200) < 100 and a[3] < r[3] - 100, (r[3], a[3])
    quiet = torch.arange(E) != 3
    assert (r[quiet] - 400).abs().max() < 60                 # within ~3 sigma of one count
    assert rob.shifts >= 1


def test_predictor_robust_steady_trace_not_disturbed():
    """On a stationary load (Poisson counts around fixed levels) ``robust`` estimates no drift,
    stays within the sampling noise of the true levels and its jump members (almost) never jump."""
    E, g = 32, torch.Generator().manual_seed(1)
    lam = torch.linspace(50.0, 800.0, E, dtype=torch.float64)
    rob = ExpertLoadPredictor(E, method="robust", horizon=10)
    for _ in range(300):
        rob.update(torch.poisson(lam, generator=g))
    r = rob.predict()
    assert abs(rob._q) < 1e-3, rob._q                      # relative drift variance per step ~ 0
    assert float(rob._kalman_gain().max()) < 0.3           # so the drift-tracking member smooths
    assert 0.7 < rob._d2 < 1.3, rob._d2                    # Poisson: dispersion 1
    assert ((r - lam).abs() / lam.sqrt()).max() < 3.0      # within 3 sigma of ONE count, smoother
    assert ((r - lam).abs() / lam.sqrt()).mean() < 1.0
    assert rob.shifts < 0.005 * 300 * E                    # < 0.5 % of the observations jump


def test_predictor_robust_estimates_drift():
    """On a geometric random walk (relative drift variance q per step) the pooled lag-1 / lag-2
    estimate finds q, and the drift-tracking (Kalman) member's gain grows with the expert's level
    (a hot expert's count carries less relative sampling noise, so it is smoothed less)."""
    E, g = 64, torch.Generator().manual_seed(2)
    q = 4e-3
    base = torch.linspace(100.0, 2000.0, E, dtype=torch.float64)
    logl = torch.zeros(E, dtype=torch.float64)
    rob = ExpertLoadPredictor(E, method="robust", horizon=5)
    for _ in range(400):
        logl = logl + q ** 0.5 * torch.randn(E, generator=g, dtype=torch.float64)
        rob.update(torch.poisson(base * logl.exp(), generator=g))
    assert 0.5 * q < rob._q < 2.0 * q, rob._q
    gain = rob._kalman_gain()
    assert ((gain > 0) & (gain < 1)).all()
    lvl = rob.predict()
    assert gain[int(lvl.argmax())] > gain[int(lvl.argmin())]
    # the forecast is within a few noise deviations of the true current level
    true = base * logl.exp()
    assert ((lvl - true).abs() / true.sqrt()).mean() < 2.0


def test_predictor_methods():
    E = 3
    seq = [torch.tensor([1.0, 10.0, 5.0]) * (t + 1) for t in range(6)]   # a linear ramp
    preds = {m: ExpertLoadPredictor(E, window=4, method=m, alpha=0.5, horizon=2)
             for m in ("last", "window_mean", "ema", "trend", "adaptive_ema", "robust")}
    for x in seq:
        for p in preds.values():
            p.update(x)
    torch.testing.assert_close(preds["last"].predict(), seq[-1].double())
    torch.testing.assert_close(preds["window_mean"].predict(), torch.stack(seq[-4:]).double().mean(0))
    ema = seq[0].double()
    for x in seq[1:]:
        ema = 0.5 * ema + 0.5 * x.double()
    torch.testing.assert_close(preds["ema"].predict(), ema)
    # a line is extrapolated exactly: the mean of steps 7 and 8 is step 7.5
    torch.testing.assert_close(preds["trend"].predict(), torch.tensor([1.0, 10.0, 5.0]).double() * 7.5)
    # on a ramp the adaptive EMA picks its fastest-following member
    assert preds["adaptive_ema"].predict()[1] > preds["ema"].predict()[1] * 0.98
    assert preds["robust"].predict()[1] > preds["ema"].predict()[1] * 0.98
    with pytest.raises(RuntimeError, match="before any update"):
        ExpertLoadPredictor(E).predict()
    assert ExpertLoadPredictor(E).method == "robust"
    with pytest.raises(ValueError, match="one count per expert"):
        preds["ema"].update(torch.zeros(4))
    with pytest.raises(ValueError, match="method must be one of"):
        ExpertLoadPredictor(E, method="arima")
    # bad counts: a clear error naming the argument, and nothing recorded
    p = ExpertLoadPredictor(E)
    for bad, what in ((torch.tensor([1.0, float("nan"), 2.0]), "entry 1 is nan"),
                      (torch.tensor([1, -3, 2]), "entry 1 is -3.0"),
                      (torch.tensor([float("inf"), 0.0, 2.0]), "entry 0 is inf")):
        with pytest.raises(ValueError, match="tokens_per_expert must be finite and non-negative "
                                             "counts of at most 2\\*\\*53: " + what):
            p.update(bad)
    assert p.steps == 0 and not p.history
    # bad counts after good ones are not recorded either: the forecast and the drift estimate
    # stay finite and unchanged
    for t in range(5):
        p.update(torch.tensor([10.0, 20.0, 30.0]) + t)
    before, q = p.predict(), p._q
    with pytest.raises(ValueError, match="entry 2 is nan"):
        p.update(torch.tensor([1.0, 2.0, float("nan")]))
    with pytest.raises(ValueError, match="entry 0 is -1.0"):
        p.update(torch.tensor([-1.0, 2.0, 3.0]))
    assert p.steps == 5 and torch.equal(p.predict(), before) and p._q == q
    assert torch.isfinite(p.predict()).all()


# ================================================================================================
# planner

def _valid(pl: Placement, E, R, S, replicas=False):
    s2e = pl.slot_to_expert
    assert s2e.shape == (R, S)
    c = torch.bincount(s2e[s2e >= 0], minlength=E)
    assert (c >= 1).all()
    if not replicas:
        assert (c == 1).all()


def test_plan_skewed_bounded_moves():
    E, R, S = 64, 8, 8
    g = torch.Generator().manual_seed(3)
    load = torch.exp(0.8 * torch.randn(E, generator=g, dtype=torch.float64)) * 100
    cur = Placement.contiguous(E, R, S)
    for budget in (0, 4, 10, None):
        pl = plan_placement(load, R, S, cur.expert_to_rank, max_moves=budget)
        _valid(pl, E, R, S)
        assert pl.moved <= (budget if budget is not None else E)
        moved = int((pl.expert_to_rank != cur.expert_to_rank).sum())
        assert moved == pl.moved
        assert abs(pl.imbalance_before - imbalance(cur.rank_loads(load))) < 1e-12
        assert abs(pl.imbalance_after - imbalance(pl.rank_loads(load))) < 1e-12
        if budget == 0:
            assert pl.imbalance_after == pl.imbalance_before and not pl.changed
        else:
            assert pl.imbalance_after < pl.imbalance_before
    # the default budget is E // 10 copies; max_moves=None is the free re-placement
    dflt = plan_placement(load, R, S, cur)
    assert dflt.moved <= default_max_moves(E) == 6 and dflt.changed
    free = plan_placement(load, R, S, cur, max_moves=None)
    assert free.imbalance_after < 0.05               # 64 lognormal experts: near-perfect
    assert free.moved > default_max_moves(E)         # ... at the price of many more moves
    assert free.imbalance_after < dflt.imbalance_after < dflt.imbalance_before
    # the baseline only trades between the extreme ranks; never better than the full search here
    base = plan_placement(load, R, S, cur, strategy="greedy_swap", max_moves=None)
    assert free.imbalance_after <= base.imbalance_after + 1e-12
    # from scratch (LPT + search): every expert counts as moved
    scratch = plan_placement(load, R, S, None)
    _valid(scratch, E, R, S)
    assert scratch.moved == E and scratch.imbalance_after < 0.05


def test_plan_move_cost_and_byte_budget():
    E, R, S = 64, 8, 8
    g = torch.Generator().manual_seed(5)
    load = torch.exp(0.8 * torch.randn(E, generator=g, dtype=torch.float64)) * 100
    cur = Placement.contiguous(E, R, S)
    # a SwiGLU expert H=64, F=32 in bf16 training with Adam: 2 B weight + 12 B fp32 master, m, v
    cost = MoveCost(3 * 64 * 32)
    assert cost.bytes_per_copy == 3 * 64 * 32 * 14
    pl = plan_placement(load, R, S, cur, move_cost=cost)
    assert 0 < pl.moved <= 6 and pl.moved_bytes == pl.moved * cost.bytes_per_copy
    # a byte budget of 2.5 copies allows 2
    pl2 = plan_placement(load, R, S, cur, move_cost=cost, max_move_bytes=5 * cost.bytes_per_copy // 2)
    assert pl2.moved <= 2 and pl2.moved_bytes <= 5 * cost.bytes_per_copy // 2
    assert pl2.imbalance_after < pl2.imbalance_before
    assert MoveCost(10, param_bytes=4, state_bytes=8, grad_bytes=4).bytes_per_copy == 160
    # no cost model: bytes are not reported
    assert plan_placement(load, R, S, cur).moved_bytes == 0
    with pytest.raises(ValueError, match="max_move_bytes needs move_cost"):
        plan_placement(load, R, S, cur, max_move_bytes=10)
    with pytest.raises(ValueError, match="max_moves must be"):
        plan_placement(load, R, S, cur, max_moves="half")
    with pytest.raises(TypeError, match="move_cost must be a MoveCost"):
        plan_placement(load, R, S, cur, move_cost=100)
    with pytest.raises(ValueError, match="params_per_expert must be >= 1"):
        MoveCost(0)
    with pytest.raises(ValueError, match="state_bytes must be a finite number >= 0"):
        MoveCost(10, state_bytes=-1.0)


def test_plan_replicas_respect_the_budget():
    """New replicas are copies too: with a current placement they stay within max_moves."""
    E, R, S = 32, 8, 5                                  # 40 slots: 8 spares
    load = torch.ones(E, dtype=torch.float64)
    load[:6] = torch.tensor([30.0, 20, 12, 10, 8, 6])
    cur = Placement.contiguous(E, R, S)
    for budget in (0, 1, 3, None):
        pl = plan_placement(load, R, S, cur, replicas=True, max_moves=budget)
        _valid(pl, E, R, S, replicas=True)
        if budget is not None:
            assert pl.moved <= budget
        if budget == 0:
            assert not pl.changed
    # unlimited: the hottest expert gets several replicas
    assert plan_placement(load, R, S, cur, replicas=True, max_moves=None).replica_count[0] >= 3


def test_plan_lpt_and_empty_slots():
    # 5 experts on 3 ranks x 2 slots: the optimum is {9}, {5, 2}, {4, 3}
    load = torch.tensor([9.0, 5.0, 4.0, 3.0, 2.0])
    pl = plan_placement(load, 3, 2, None)
    assert sorted(pl.rank_loads(load).tolist()) == [7.0, 7.0, 9.0]
    # an expert moves into an empty slot when that helps
    cur = torch.tensor([0, 0, 1, 1, 2])               # ranks: {9, 5}=14, {4, 3}=7, {2}=2
    pl = plan_placement(load, 3, 2, cur)
    assert pl.rank_loads(load).max() == 9.0 and pl.moved <= 2


def test_plan_drifting_trace():
    """Re-planning along a drifting trace keeps the realized imbalance well below static."""
    E, R, S, steps = 64, 8, 8, 200
    g = torch.Generator().manual_seed(0)
    x = 0.6 * torch.randn(E, generator=g, dtype=torch.float64)
    pred = ExpertLoadPredictor(E, window=8, method="ema", alpha=0.3)
    cur = Placement.contiguous(E, R, S)
    static = Placement.contiguous(E, R, S)
    imb_dyn, imb_st = [], []
    for t in range(steps):
        x = 0.99 * x + 0.6 * math.sqrt(1 - 0.99 ** 2) * torch.randn(E, generator=g, dtype=torch.float64)
        p = torch.exp(x) / torch.exp(x).sum()
        counts = torch.multinomial(p, 8192, replacement=True, generator=g).bincount(minlength=E).double()
        if t >= 20 and t % 10 == 0:
            new = plan_placement(pred.predict(), R, S, cur, max_moves=6)
            assert new.moved <= 6
            _valid(new, E, R, S)
            cur = new if new.changed else cur
        if t >= 60:
            imb_dyn.append(imbalance(cur.rank_loads(counts)))
            imb_st.append(imbalance(static.rank_loads(counts)))
        pred.update(counts)
    dyn, st = sum(imb_dyn) / len(imb_dyn), sum(imb_st) / len(imb_st)
    assert dyn < 0.5 * st, (dyn, st)


# quality goal (issue 13): at the default move budget (E // 10 per re-plan) the forecast's cut of
# the imbalance is >= 95 % of the cut the same planner gets from the true next-step load. Small,
# deterministic version of bench/bench_balance.py --oracle (64 experts on 8 x 8, 256 routed slots
# per expert and step as in the bench, 500 steps, seed 0); a quality assertion, not a timing one.
# The goal is NOT met on two cases, where the test asserts the measured shortfall bound and that
# the forecast reaches the causal ceiling (the same planner fed the true load of the last
# *observed* step): bursty at a 10-step interval (0.94 here; the next-step oracle sees the bursts
# that begin on the very step the placement starts serving, which no forecast can, and the
# ceiling reaches no more) and the fast drift at a 50-step interval (0.90 here, while the
# forecast beats the ceiling: 1.09 of it; the next-step oracle's advantage is knowing where the
# drift stands at the first served step, which a forecast from counts cannot know).
# Columns: trace, interval, share of the oracle's cut, share of the ceiling's cut, least cut (the
# fast drift leaves less to cut at a 50-step interval: 0.39 for the oracle).
QUALITY_CASES = [("lognormal_slow", 10, 0.95, 0.97, 0.4), ("lognormal_slow", 50, 0.95, 0.97, 0.4),
                 ("bursty", 10, 0.90, 0.97, 0.4), ("bursty", 50, 0.95, 0.97, 0.4),
                 ("lognormal_fast", 10, 0.95, 0.95, 0.4), ("lognormal_fast", 50, 0.84, 0.97, 0.3)]


@pytest.mark.parametrize("kind,interval,goal,ceiling_share,least", QUALITY_CASES)
def test_placement_reaches_its_oracle(kind, interval, goal, ceiling_share, least):
    from ascend_moe_ops.balance import traces
    E, R, S = 64, 8, 8
    p, counts = traces.make_trace(kind, 500, seed=0, num_experts=E, slots_per_step=16384)
    kw = dict(interval=interval, warmup=50, measure_from=100, min_improvement=0.02)
    ours = traces.replay(p, counts, R, S, **kw)                   # default predictor and budget
    oracle = traces.replay(p, counts, R, S, oracle="next_step", **kw)
    ceiling = traces.replay(p, counts, R, S, oracle="previous_step", **kw)
    assert ours["moves_max"] <= default_max_moves(E) == 6
    assert oracle["cut"] > least and ours["cut"] > least          # placement does real work here
    assert ours["cut"] >= goal * oracle["cut"], (ours["cut"], oracle["cut"])
    assert ours["cut"] >= ceiling_share * ceiling["cut"], (ours["cut"], ceiling["cut"])
    # the forecast beats the plain window mean (the old baseline predictor) or ties it
    base = traces.replay(p, counts, R, S, predictor=lambda: ExpertLoadPredictor(
        E, method="window_mean", horizon=interval), **kw)
    assert ours["cut"] >= base["cut"] - 0.01, (ours["cut"], base["cut"])


# issue 33 item 5: the default predictor must beat persistence (the same planner fed the counts of
# the last observed step, method="last") at the default budget. Small deterministic trace as in
# test_placement_reaches_its_oracle (64 experts on 8 x 8, 500 steps, seed 0). Pinned where the
# margin on this trace exceeds the planner's path noise (cuts here: lognormal_slow/10 86.7 vs
# 85.5 %, lognormal_slow/50 76.2 vs 72.9 %, lognormal_fast/10 64.2 vs 62.5 %); a fixed slow EMA
# (alpha 0.06) fails the fast-drift case (it lags). On bursty/10 the two tie within 0.1 point and
# at 50-step intervals on bursty and lognormal_fast persistence is ahead on this small trace (see
# docs/ops/balance.md section 6, where the full-size comparison over seeds is reported).
PERSISTENCE_CASES = [("lognormal_slow", 10), ("lognormal_slow", 50), ("lognormal_fast", 10)]


@pytest.mark.parametrize("kind,interval", PERSISTENCE_CASES)
def test_placement_beats_persistence(kind, interval):
    from ascend_moe_ops.balance import traces
    E, R, S = 64, 8, 8
    p, counts = traces.make_trace(kind, 500, seed=0, num_experts=E, slots_per_step=16384)
    kw = dict(interval=interval, warmup=50, measure_from=100, min_improvement=0.02)
    ours = traces.replay(p, counts, R, S, **kw)                   # default predictor and budget
    last = traces.replay(p, counts, R, S, predictor=lambda: ExpertLoadPredictor(
        E, method="last", horizon=interval), **kw)
    assert ours["cut"] > 0.3 and last["cut"] > 0.3                # placement does real work here
    assert ours["cut"] >= last["cut"], (ours["cut"], last["cut"])


def test_traces_deterministic_and_checked():
    from ascend_moe_ops.balance import traces
    a = traces.make_trace("bursty", 40, seed=3, num_experts=16, slots_per_step=2048)
    b = traces.make_trace("bursty", 40, seed=3, num_experts=16, slots_per_step=2048)
    assert all((x == y).all() for x, y in zip(a, b))
    p, counts = a
    assert p.shape == counts.shape == (40, 16) and (counts.sum(1) == 2048).all()
    assert (p <= 1 / 8 + 1e-12).all()                        # top-8 cap
    with pytest.raises(ValueError, match="kind must be one of"):
        traces.make_trace("spiky", 10)
    with pytest.raises(ValueError, match="oracle must be None"):
        traces.replay(p, counts, 4, 4, oracle="future")


def test_plan_trigger_and_threshold():
    load = torch.ones(16, dtype=torch.float64)
    load[0] = 1.5
    cur = Placement.contiguous(16, 4, 4)
    same = plan_placement(load, 4, 4, cur, cv_threshold=0.5)      # CV ~0.05 <= 0.5: no search
    assert not same.changed and same == cur and same.moved == 0
    # the best possible plan here cannot lower the imbalance by 0.5
    same = plan_placement(load, 4, 4, cur, min_improvement=0.5)
    assert not same.changed and same == cur
    assert same.cv_before is not None and same.cv_before > 0


def test_plan_replicas_and_routing():
    E, R, S = 8, 4, 3                                   # 12 slots: 4 spares
    load = torch.tensor([40.0, 10, 10, 10, 10, 10, 5, 5])
    pl = plan_placement(load, R, S, None, replicas=True)
    _valid(pl, E, R, S, replicas=True)
    rc = pl.replica_count
    assert rc.sum() == R * S and rc[0] >= 3             # the hot expert takes most spare slots
    for r in range(R):                                  # replicas on distinct ranks
        row = pl.slot_to_expert[r]
        assert row.unique().numel() == row.numel()
    assert pl.imbalance_after < 0.25
    # deterministic routing: replica (token % c) in ascending slot order
    ids = torch.tensor([[0, 1], [0, -1], [0, 2], [1, 0]])
    phys = pl.physical_slots(ids)
    assert torch.equal(phys, pl.physical_slots(ids))
    slots0 = pl.expert_slots()[0][: int(rc[0])]
    for t in range(4):
        for k in range(2):
            e = int(ids[t, k])
            if e < 0:
                assert phys[t, k] == -1
            else:
                c = int(rc[e])
                assert phys[t, k] == pl.expert_slots()[e][t % c]
                assert int(pl.slot_to_expert.flatten()[phys[t, k]]) == e
    # a hot expert's tokens are spread evenly over its replicas
    many = torch.zeros(1200, 1, dtype=torch.int64)
    counts = torch.bincount(pl.physical_slots(many).flatten(), minlength=R * S)[slots0]
    assert counts.max() - counts.min() <= 1


def test_placement_wrong_lengths_name_the_argument():
    """A wrong-length expert_load or token_index was a broadcasting RuntimeError (or, for a
    token_index that broadcast, a silently wrong routing); now a ValueError naming it."""
    pl = Placement.contiguous(4, 2, 2)
    with pytest.raises(ValueError, match=r"^expert_load must have shape \(4,\) \(one load per expert\), got \(3,\)"):
        pl.rank_loads(torch.ones(3))
    with pytest.raises(ValueError, match=r"^expert_load must have shape \(4,\)"):
        pl.rank_loads(torch.ones(1))                       # used to broadcast to 4 equal loads
    assert pl.rank_loads([1.0, 2.0, 3.0, 4.0]).tolist() == [3.0, 7.0]
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    for bad in (torch.arange(2), torch.arange(1), torch.arange(6).view(3, 2)):
        with pytest.raises(ValueError, match="^token_index must"):
            pl.physical_slots(ids, bad)
    with pytest.raises(TypeError, match="^token_index must have dtype"):
        pl.physical_slots(ids, torch.arange(3.0))
    assert torch.equal(pl.physical_slots(ids, torch.arange(3)), pl.physical_slots(ids))


def test_placement_errors():
    with pytest.raises(ValueError, match="do not fit"):
        plan_placement(torch.ones(10), 3, 3)
    with pytest.raises(ValueError, match="loses experts"):
        Placement(torch.tensor([[0, 1], [1, -1]]), 3)
    with pytest.raises(ValueError, match="distinct ranks"):
        Placement(torch.tensor([[0, 0], [1, 2]]), 3)
    with pytest.raises(ValueError, match="outside the valid range"):
        Placement(torch.tensor([[0, 5], [1, 2]]), 3)
    with pytest.raises(ValueError, match="puts 3 experts on rank 0"):
        Placement.from_expert_to_rank(torch.tensor([0, 0, 0, 1]), 2, 2)
    with pytest.raises(ValueError, match="has 4 experts but predicted_load"):
        plan_placement(torch.ones(5), 2, 4, torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="has replicas; pass replicas=True"):
        plan_placement(torch.ones(3), 2, 2, Placement(torch.tensor([[0, 1], [0, 2]]), 3))
    with pytest.raises(ValueError, match="finite and non-negative: entry 1 is -1.0"):
        plan_placement(torch.tensor([1.0, -1.0]), 2, 1)
    with pytest.raises(ValueError, match="predicted_load must be finite.*entry 0 is nan"):
        plan_placement(torch.tensor([float("nan"), 1.0]), 2, 1)
    with pytest.raises(ValueError, match="predicted_load must be finite.*entry 1 is inf"):
        plan_placement(torch.tensor([1.0, float("inf")]), 2, 1)


# ================================================================================================
# distributed scenarios (4 gloo ranks)

E_D, K_D, H_D, F_D = 8, 2, 6, 5


def _rank_data(r, E=6, K=2):
    g = torch.Generator().manual_seed(100 + r)
    T = 5 + r
    scores = torch.softmax(torch.randn(T, E, generator=g, dtype=torch.float64), 1)
    ids = torch.topk(torch.randn(T, E, generator=g), K, 1).indices
    return scores, ids


def scenario_aux_levels(ctx):
    import torch.distributed as dist
    rank, E, K = ctx["rank"], 6, 2
    groups = {"ep_group": ctx["ep_groups"], "dp_group": ctx["dp_groups"], "global": None}
    members = {"ep_group": ctx["ep_members"], "dp_group": ctx["dp_members"],
               "global": list(range(ctx["world"]))}
    scores, ids = _rank_data(rank, E, K)
    losses = {}
    for level in ("ep_group", "dp_group", "global"):
        group = groups[level]
        s = scores.clone().requires_grad_()
        loss = aux_loss(s, ids, level=level, group=group, coeff=0.1)
        losses[level] = loss.item()
        counts = [0] * E
        n = 0
        for m in members[level]:
            _, ids_m = _rank_data(m, E, K)
            n += ids_m.shape[0]
            for e in ids_m.flatten().tolist():
                counts[e] += 1
        ref = ref_aux(scores, ids, E, K, 0.1, counts=counts, n_tokens=n)
        assert abs(loss.item() - float(ref)) < 1e-12, (level, loss.item(), float(ref))
        loss.backward()
        g_ref = torch.tensor([0.1 * E * c / (K * n) / scores.shape[0] for c in counts],
                             dtype=torch.float64).expand_as(s)
        torch.testing.assert_close(s.grad, g_ref)
    # ep level differs from global and micro-batch (it is the middle level)
    mb = aux_loss(scores, ids, level="micro_batch", coeff=0.1)
    assert torch.isfinite(mb)
    assert losses["ep_group"] not in (losses["global"], mb.item()), (losses, mb.item())
    dist.barrier()


def scenario_group_helpers(ctx):
    import torch.distributed as dist
    rank, world = ctx["rank"], ctx["world"]
    E = 6
    _, ids = _rank_data(rank, E)
    local = expert_counts(ids, E)
    total = sum(expert_counts(_rank_data(r, E)[1], E) for r in range(world))
    st = drop_stats(ids, num_experts=E, capacity=2, group=dist.group.WORLD)
    drop_ref = sum((expert_counts(_rank_data(r, E)[1], E) - 2).clamp(min=0) for r in range(world))
    assert st.routed.tolist() == total.tolist() and st.dropped.tolist() == drop_ref.tolist()
    bias = torch.zeros(E)
    update_expert_bias(bias, local, rate=0.1, group=dist.group.WORLD)
    ref = 0.1 * torch.sign(total.float().mean() - total.float())
    torch.testing.assert_close(bias, ref)
    pred = ExpertLoadPredictor(E, window=2, method="window_mean", group=dist.group.WORLD)
    pred.update(local)
    torch.testing.assert_close(pred.predict(), total.double())


def scenario_num_experts_mismatch(ctx):
    """A different num_experts per rank in the group collectives (aux_loss's group levels,
    update_expert_bias, drop_stats, ExpertLoadPredictor.update): the same ValueError naming the
    argument and the per-rank values on every rank (one tiny all-gather through
    check_consistent), not a gloo abort; the group stays usable."""
    import torch.distributed as dist
    rank, world = ctx["rank"], ctx["world"]
    E = 4 if rank == 0 else 5
    world_group = dist.group.WORLD
    vals = re.escape(f"differs between ranks: ranks {list(range(1, world))} disagree with rank 0: "
                     f"per-rank values {[4] + [5] * (world - 1)}")
    g = torch.Generator().manual_seed(rank)
    scores = torch.rand(6, E, generator=g).softmax(-1)
    ids = torch.randint(0, E, (6, 2), generator=g)
    with pytest.raises(ValueError, match=re.escape("num_experts E (scores.shape[1]) ") + vals):
        aux_loss(scores, ids, level="global")
    if rank in ctx["ep_members"] and 0 in ctx["ep_members"]:  # E 4 vs 5 in rank 0's EP group
        with pytest.raises(ValueError, match=re.escape(
                "num_experts E (scores.shape[1]) differs between ranks: ranks [1] disagree with "
                "rank 0: per-rank values [4, 5]")):
            aux_loss(scores, ids, level="ep_group", group=ctx["ep_groups"])
    else:  # the other EP group agrees (E = 5): no error there
        assert torch.isfinite(aux_loss(scores, ids, level="ep_group", group=ctx["ep_groups"]))
    with pytest.raises(ValueError, match=re.escape("num_experts E (bias.shape[0]) ") + vals):
        update_expert_bias(torch.zeros(E), torch.rand(E), group=world_group)
    with pytest.raises(ValueError, match=re.escape("num_experts ") + vals):
        drop_stats(ids, num_experts=E, capacity=2, group=world_group)
    with pytest.raises(ValueError, match=re.escape("num_experts (ExpertLoadPredictor) ") + vals):
        ExpertLoadPredictor(E, group=world_group).update(torch.rand(E))
    # still usable, and equal E passes
    scenario_group_helpers(ctx)


ARG_ERROR_TIMEOUT_S = 5   # the groups of scenario_one_rank_bad_arguments: a hang fails fast


def scenario_one_rank_bad_arguments(ctx):
    """Rank 1 passes a bad argument to each group collective of balance (aux_loss's group
    levels, update_expert_bias, drop_stats, ExpertLoadPredictor.update, PlacementExecutor.apply)
    while the others pass good ones: rank 1 raises its own error naming the argument, every
    other rank of the group a ValueError naming rank 1 and the function, at once (the flag rides
    on check_consistent's first all-gather; before, the peers waited in the collective until the
    process-group timeout: short here, ARG_ERROR_TIMEOUT_S). Each group stays usable: the good
    call that follows works."""
    import time
    import torch.distributed as dist
    from ascend_moe_ops.balance import PlacementExecutor
    rank, world, E = ctx["rank"], ctx["world"], 6
    timeout = datetime.timedelta(seconds=ARG_ERROR_TIMEOUT_S)
    world_group = dist.new_group(list(range(world)), timeout=timeout)
    ep = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)][rank // 2]
    sync = dist.new_group(list(range(world)), timeout=timeout)   # keeps the ranks in step
    bad = rank == 1
    scores, ids = _rank_data(rank, E)
    local = expert_counts(ids, E)
    total = sum(expert_counts(_rank_data(r, E)[1], E) for r in range(world))

    def expect(fn, caller, own, group_ranks=range(world)):
        t0 = time.time()
        if bad:
            with pytest.raises((ValueError, TypeError), match=own):
                fn()
        elif 1 in group_ranks:
            with pytest.raises(ValueError, match=re.escape(
                    f"{caller}: ranks [1] rejected their arguments (the error is raised on those ranks)")):
                fn()
        else:
            fn()
        took = time.time() - t0
        assert took < ARG_ERROR_TIMEOUT_S / 2, (caller, took)
        dist.barrier(group=sync)   # (before the fix: rank 1 waits here, its peers in `fn`)

    # aux_loss: an expert id out of range at the global level, a wrong shape at the EP level
    bad_ids = torch.full_like(ids, E) if bad else ids
    expect(lambda: aux_loss(scores, bad_ids, level="global", group=world_group), "aux_loss",
           "routing")
    short = ids[:-1] if bad else ids
    expect(lambda: aux_loss(scores, short, level="ep_group", group=ep), "aux_loss",
           "routing must have one row per token", ctx["ep_members"])
    loss = aux_loss(scores, ids, level="global", group=world_group, coeff=0.1)
    assert abs(loss.item() - float(ref_aux(scores, ids, E, 2, 0.1, counts=total.tolist(),
                                           n_tokens=sum(5 + r for r in range(world))))) < 1e-12
    assert torch.isfinite(aux_loss(scores, ids, level="ep_group", group=ep))
    # update_expert_bias: a NaN count (the bias stays untouched on every rank)
    bias = torch.zeros(E)
    counts = local.float()
    if bad:
        counts[0] = float("nan")
    expect(lambda: update_expert_bias(bias, counts, rate=0.1, group=world_group),
           "update_expert_bias", "tokens_per_expert")
    assert torch.equal(bias, torch.zeros(E))
    update_expert_bias(bias, local, rate=0.1, group=world_group)
    torch.testing.assert_close(bias, 0.1 * torch.sign(total.float().mean() - total.float()))
    # drop_stats: a 1-D routing, then a negative capacity
    expect(lambda: drop_stats(ids.flatten() if bad else ids, num_experts=E, capacity=2,
                              group=world_group), "drop_stats", "routing")
    expect(lambda: drop_stats(ids, num_experts=E, capacity=-1 if bad else 2, group=world_group),
           "drop_stats", "capacity")
    st = drop_stats(ids, num_experts=E, capacity=2, group=world_group)
    assert st.routed.tolist() == total.tolist()
    # ExpertLoadPredictor.update: one count too many (nothing recorded on any rank)
    pred = ExpertLoadPredictor(E, window=2, method="window_mean", group=world_group)
    expect(lambda: pred.update(torch.ones(E + 1) if bad else local), "ExpertLoadPredictor.update",
           "tokens_per_expert")
    assert pred.steps == 0
    pred.update(local)
    torch.testing.assert_close(pred.predict(), total.double())
    # PlacementExecutor.apply: not a Placement
    S = E_D // world
    p0 = Placement.contiguous(E_D, world, S)
    ex = PlacementExecutor(p0, _make_params(p0, rank), group=world_group)
    expect(lambda: ex.apply("p0" if bad else p0), "PlacementExecutor.apply", "new must be a Placement")
    assert ex.apply(_permuted_placement(world, S))["copies"] > 0


def _global_weights(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    w1 = torch.randn(E_D, H_D, F_D, generator=g, dtype=dtype) * 0.5
    w2 = torch.randn(E_D, F_D, H_D, generator=g, dtype=dtype) * 0.5
    return w1, w2


def _tokens(r, step=0):
    g = torch.Generator().manual_seed(1000 * step + 10 + r)
    T = 6 + r
    x = torch.randn(T, H_D, generator=g, dtype=torch.float64)
    logits = torch.randn(T, E_D, generator=g, dtype=torch.float64)
    logits[:, 0] += 1.5                                    # expert 0 is hot
    top = torch.topk(torch.softmax(logits, 1), K_D, 1)
    probs = top.values / top.values.sum(1, keepdim=True)
    tgt = torch.randn(T, H_D, generator=g, dtype=torch.float64)
    return x, top.indices, probs, tgt


# the dispatcher's permute/unpermute accumulate in fp32 (the op contract), so comparisons with the
# dense fp64 reference, or between layouts that sum a token's slots differently, use fp32 tolerances;
# before/after a re-placement the same rows meet in the same order and must agree to fp64 rounding.
REF_TOL = dict(rtol=1e-5, atol=1e-6)
SAME_TOL = dict(rtol=1e-12, atol=1e-12)


def _expert_fn(x, w1, w2):
    return torch.tanh(x @ w1) @ w2


def _dense_reference(world, step=0):
    """Loss over every rank's tokens with the global weights; returns (outputs per rank, grads)."""
    w1, w2 = _global_weights()
    w1.requires_grad_()
    w2.requires_grad_()
    outs, total = [], 0.0
    for r in range(world):
        x, ids, probs, tgt = _tokens(r, step)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(K_D):
                e = int(ids[t, k])
                out[t] = out[t] + probs[t, k] * _expert_fn(x[t:t + 1], w1[e], w2[e])[0]
        outs.append(out.detach())
        total = total + (out * tgt).sum()
    total.backward()
    return outs, w1.grad, w2.grad


def _layer_forward(ctx, dispatcher, executor, params, step=0):
    rank = ctx["rank"]
    x, ids, probs, tgt = _tokens(rank, step)
    rows, tpe, handle = dispatcher.dispatch(x, executor.route(ids), probs)
    outs, start = [], 0
    for i, n in enumerate(tpe.tolist()):
        outs.append(_expert_fn(rows[start:start + n], params[0][i], params[1][i]))
        start += n
    y = torch.cat(outs) if outs else rows[:0, :H_D]
    out = dispatcher.combine(y, handle)
    (out * tgt).sum().backward()
    return out.detach()


def _check_dense(ctx, executor, params, out, ref):
    """Step 0 (the initial weights): output and expert-weight gradients against
    ``ref = _dense_reference(world)``."""
    ref_out, ref_g1, ref_g2 = ref
    torch.testing.assert_close(out, ref_out[ctx["rank"]], **REF_TOL)
    g = _gather_global(executor, [params[0].grad, params[1].grad], ctx["world"])
    torch.testing.assert_close(g[0], ref_g1, **REF_TOL)
    torch.testing.assert_close(g[1], ref_g2, **REF_TOL)


def _make_params(placement, rank):
    w1, w2 = _global_weights()
    s2e = placement.slot_to_expert[rank]
    p1 = torch.zeros((len(s2e), H_D, F_D), dtype=torch.float64)
    p2 = torch.zeros((len(s2e), F_D, H_D), dtype=torch.float64)
    for i, e in enumerate(s2e.tolist()):
        if e >= 0:
            p1[i], p2[i] = w1[e], w2[e]
    return [torch.nn.Parameter(p1), torch.nn.Parameter(p2)]


def _gather_global(executor, tensors, world):
    """Per global expert view ``[E, ...]`` of ``[S, ...]`` tensors, checking that every replica of an
    expert holds the same values."""
    import torch.distributed as dist
    pl = executor.placement
    flat = pl.slot_to_expert.flatten().tolist()
    out = []
    for t in tensors:
        buf = torch.empty((world * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype)
        dist.all_gather_into_tensor(buf, t.detach().contiguous(), group=executor.group)
        g = torch.zeros((pl.num_experts,) + tuple(t.shape[1:]), dtype=t.dtype)
        seen = set()
        for p, e in enumerate(flat):
            if e < 0:
                continue
            if e in seen:
                torch.testing.assert_close(buf[p], g[e], **SAME_TOL)
            else:
                g[e] = buf[p]
                seen.add(e)
        out.append(g)
    return out


def _permuted_placement(R, S):
    """A placement that moves most experts (deterministic)."""
    e2r = torch.tensor([(e * 3 + 1) % (R * S) // S for e in range(R * S)])
    return Placement.from_expert_to_rank(e2r, R, S)


def scenario_executor_moves(ctx):
    """Weights, grads and Adam state follow their experts; no dispatcher needed."""
    import torch.distributed as dist
    from ascend_moe_ops.balance import PlacementExecutor
    rank, world = ctx["rank"], ctx["world"]
    S = E_D // world
    p0 = Placement.contiguous(E_D, world, S)
    params = _make_params(p0, rank)
    opt = torch.optim.Adam(params, lr=0.01)
    ex = PlacementExecutor(p0, params, optimizer=opt)
    assert ex.mode == "expert"
    # a per-expert synthetic gradient: expert e gets (e + 1) * weight
    for p in params:
        owners = ex.placement.slot_to_expert[rank]
        p.grad = p.detach() * (owners.double() + 1).view(-1, *([1] * (p.dim() - 1)))
    opt.step()
    before = _gather_global(ex, [params[0], opt.state[params[0]]["exp_avg"],
                                 opt.state[params[0]]["exp_avg_sq"], params[0].grad], world)
    info = ex.apply(_permuted_placement(world, S))
    assert info["copies"] > 0
    after = _gather_global(ex, [params[0], opt.state[params[0]]["exp_avg"],
                                opt.state[params[0]]["exp_avg_sq"], params[0].grad], world)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    # cost model: a copy carries weight + grad + Adam m, v of both tensors (fp64 here), and the
    # executor moves exactly the planner's copies and bytes
    cost = MoveCost(2 * H_D * F_D, param_bytes=8, state_bytes=16, grad_bytes=8)
    assert ex.bytes_per_copy == cost.bytes_per_copy == 2 * H_D * F_D * 32
    load = torch.where(ex.placement.expert_to_rank < 2, 5.0, 1.0).double()   # ranks 0, 1 hot
    plan = plan_placement(load, world, S, ex.placement, max_moves=4, move_cost=cost)
    # two swaps of a hot with a cold expert balance the ranks at 6 each: 4 copies
    assert plan.changed and plan.moved == 4 and plan.moved_bytes == 4 * cost.bytes_per_copy
    assert plan.imbalance_after == 0.0
    before = _gather_global(ex, [params[1], opt.state[params[1]]["exp_avg_sq"], params[1].grad], world)
    info = ex.apply(plan)
    assert info["copies"] == plan.moved and info["bytes"] == plan.moved_bytes
    sent = torch.tensor([info["sent_bytes"]], dtype=torch.int64)
    dist.all_reduce(sent)
    assert int(sent) == info["bytes"]
    after = _gather_global(ex, [params[1], opt.state[params[1]]["exp_avg_sq"], params[1].grad], world)
    for a, b in zip(before, after):
        assert torch.equal(a, b)
    assert ex.apply(ex.placement) == {"copies": 0, "local": 0, "bytes": 0, "sent_bytes": 0}
    # mixed dtypes (one collective per dtype) and a non-contiguous tensor, written in place
    w1, _ = _global_weights()
    bias = torch.arange(E_D * H_D, dtype=torch.float64).view(E_D, H_D)
    m0 = Placement.contiguous(E_D, world, S)
    own = m0.slot_to_expert[rank]
    t64 = w1[own].clone()
    t16 = torch.empty(H_D, S, dtype=torch.bfloat16).t()             # [S, H], non-contiguous
    t16.copy_(bias[own].to(torch.bfloat16))
    mex = PlacementExecutor(m0, [t64, t16])
    assert mex.bytes_per_copy == H_D * F_D * 8 + H_D * 2
    minfo = mex.apply(_permuted_placement(world, S))
    own = mex.placement.slot_to_expert[rank]
    assert torch.equal(t64, w1[own]) and torch.equal(t16, bias[own].to(torch.bfloat16))
    assert minfo["bytes"] == minfo["copies"] * mex.bytes_per_copy
    # slot mode with replicas: 3 slots per rank, replicas of hot experts
    S3 = 3
    q0 = Placement.contiguous(E_D, world, S3)
    qparams = _make_params(q0, rank)
    qopt = torch.optim.SGD(qparams, lr=0.1, momentum=0.9)
    qex = PlacementExecutor(q0, qparams, optimizer=qopt)
    assert qex.mode == "slot"
    for p in qparams:
        p.grad = torch.ones_like(p)
    qopt.step()
    ref = _gather_global(qex, [qparams[1], qopt.state[qparams[1]]["momentum_buffer"]], world)
    load = torch.tensor([40.0, 10, 10, 10, 10, 10, 5, 5])
    qnew = plan_placement(load, world, S3, q0, replicas=True)
    assert qnew.has_replicas
    qex.apply(qnew)
    got = _gather_global(qex, [qparams[1], qopt.state[qparams[1]]["momentum_buffer"]], world)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # replica gradient sync: every replica ends with the sum over replicas
    for p in qparams:
        p.grad = torch.full_like(p, float(rank + 1))
    qex.sync_replica_grads()
    rc = qnew.replica_count
    for i, e in enumerate(qnew.slot_to_expert[rank].tolist()):
        if e >= 0 and rc[e] > 1:
            holders = [r for r in range(world) if e in qnew.slot_to_expert[r].tolist()]
            assert torch.all(qparams[0].grad[i] == float(sum(h + 1 for h in holders)))


def scenario_executor_errors(ctx):
    from ascend_moe_ops.balance import PlacementExecutor
    rank, world = ctx["rank"], ctx["world"]
    S = E_D // world
    p0 = Placement.contiguous(E_D, world, S)
    params = _make_params(p0, rank)
    ex = PlacementExecutor(p0, params)
    bad = _permuted_placement(world, S) if rank == 1 else p0
    with pytest.raises(ValueError, match="differs between ranks"):
        ex.apply(bad)
    with pytest.raises(ValueError, match="one row per local slot"):
        PlacementExecutor(p0, [torch.zeros(S + 1, 3)])
    with pytest.raises(ValueError, match="distinct ranks|ranks x"):
        ex.apply(Placement(torch.tensor([[0, 0]] * world), 1))
    from ascend_moe_ops.balance import check_consistent
    with pytest.raises(ValueError, match=re.escape("predicted_load differs between ranks: ranks [3]")):
        check_consistent(torch.ones(E_D) * (2.0 if rank == 3 else 1.0), None, "predicted_load")
    rep = plan_placement(torch.arange(1.0, E_D + 1), world, S + 1, None, replicas=True)
    with pytest.raises(ValueError, match="cannot hold replicas"):
        PlacementExecutor(rep, _make_params(rep, rank), mode="expert")


def scenario_layer_expert_mode(ctx):
    """After a re-placement the EP MoE layer's forward and backward are unchanged, and Adam
    continues exactly as without the re-placement (flat and hierarchical dispatch, 2 nodes x 2)."""
    for algorithm in ("hierarchical", "flat"):
        _layer_expert_mode(ctx, algorithm)


def _layer_expert_mode(ctx, algorithm):
    # flat: a token's slots are summed in the same order whatever the placement -> fp64-exact;
    # hierarchical: per-node partial sums (fp32 accumulation) group differently after a move
    tol = SAME_TOL if algorithm == "flat" else REF_TOL
    from ascend_moe_ops.balance import PlacementExecutor
    from ascend_moe_ops.distributed import MoEDispatcher
    rank, world, topo = ctx["rank"], ctx["world"], ctx["topo"]
    S = E_D // world
    ref = _dense_reference(world)
    p0, p1 = Placement.contiguous(E_D, world, S), _permuted_placement(world, S)
    results = {}
    for name, placements in (("A", [p0, p0, p0]), ("B", [p0, p1, p1])):
        params = _make_params(p0, rank)
        opt = torch.optim.Adam(params, lr=0.05)
        disp = MoEDispatcher(topo, E_D, algorithm=algorithm)
        ex = PlacementExecutor(p0, params, optimizer=opt, dispatcher=disp)
        for step, pl in enumerate(placements):
            if pl is not ex.placement and not torch.equal(pl.slot_to_expert, ex.placement.slot_to_expert):
                out_before = _layer_forward(ctx, disp, ex, params, step)
                g_before = _gather_global(ex, [params[0].grad, params[1].grad], world)
                opt.zero_grad(set_to_none=False)
                ex.apply(pl)
                assert torch.equal(disp.expert_to_rank, ex.placement.expert_to_rank)
                out_after = _layer_forward(ctx, disp, ex, params, step)
                g_after = _gather_global(ex, [params[0].grad, params[1].grad], world)
                torch.testing.assert_close(out_after, out_before, **tol)
                for a, b in zip(g_after, g_before):
                    torch.testing.assert_close(a, b, **tol)
                opt.zero_grad(set_to_none=False)
            out = _layer_forward(ctx, disp, ex, params, step)
            if step == 0:
                _check_dense(ctx, ex, params, out, ref)
            opt.step()
            opt.zero_grad(set_to_none=False)
        results[name] = _gather_global(ex, params + [opt.state[params[0]]["exp_avg_sq"]], world)
    for a, b in zip(results["A"], results["B"]):
        torch.testing.assert_close(a, b, **tol)
    ctx["expert_mode_final"] = results["A"]


def scenario_layer_slot_mode_replicas(ctx):
    """Slot mode with replicas: same outputs, gradients and optimizer trajectory as the
    unreplicated layer."""
    from ascend_moe_ops.balance import PlacementExecutor
    from ascend_moe_ops.distributed import MoEDispatcher
    rank, world, topo = ctx["rank"], ctx["world"], ctx["topo"]
    S = 3
    ref = _dense_reference(world)
    q0 = Placement.contiguous(E_D, world, S)
    load = torch.tensor([40.0, 10, 10, 10, 10, 10, 5, 5])
    q1 = plan_placement(load, world, S, q0, replicas=True)
    assert q1.has_replicas
    params = _make_params(q0, rank)
    opt = torch.optim.Adam(params, lr=0.05)
    disp = MoEDispatcher(topo, world * S, algorithm="flat")
    ex = PlacementExecutor(q0, params, optimizer=opt, dispatcher=disp)
    assert ex.mode == "slot"
    for step in range(3):
        if step == 1:
            opt.zero_grad(set_to_none=False)
            ex.apply(q1)
        out = _layer_forward(ctx, disp, ex, params, step)
        ex.sync_replica_grads()
        if step == 0:
            _check_dense(ctx, ex, params, out, ref)
        opt.step()
        opt.zero_grad(set_to_none=False)
    final = _gather_global(ex, params + [opt.state[params[0]]["exp_avg_sq"]], world)
    if "expert_mode_final" in ctx:
        for a, b in zip(final, ctx["expert_mode_final"]):
            torch.testing.assert_close(a, b, **REF_TOL)
    # replica routing is deterministic across calls and ranks
    _, ids, _, _ = _tokens(rank)
    assert torch.equal(ex.route(ids), ex.route(ids))
    from ascend_moe_ops.balance import check_consistent
    check_consistent(ex.route(_tokens(0)[1]), ex.group, "route() of the same ids")


SCENARIOS = {
    "aux_levels": scenario_aux_levels,
    "group_helpers": scenario_group_helpers,
    "num_experts_mismatch": scenario_num_experts_mismatch,
    "one_rank_bad_arguments": scenario_one_rank_bad_arguments,
    "executor_moves": scenario_executor_moves,
    "executor_errors": scenario_executor_errors,
    "layer_expert_mode": scenario_layer_expert_mode,
    "layer_slot_mode_replicas": scenario_layer_slot_mode_replicas,
}


def _worker(rank, world, port, outdir):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    torch.set_num_threads(1)
    import warnings
    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from ascend_moe_ops.distributed import EPTopology
    results = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        ep = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        ctx = dict(rank=rank, world=world, ep_groups=ep[rank // 2], dp_groups=dp[rank % 2],
                   ep_members=[2 * (rank // 2), 2 * (rank // 2) + 1], dp_members=[rank % 2, rank % 2 + 2],
                   topo=EPTopology(local_size=2))
        run_scenarios([(name, functools.partial(fn, ctx)) for name, fn in SCENARIOS.items()],
                      results, outdir, rank, after_each=dist.barrier)
        dist.destroy_process_group()
    except Exception:
        setup_failure(results, outdir, rank)


_CACHE = {}


def _group_results(tmp_path_factory, world=4):
    if "res" not in _CACHE:
        outdir = str(tmp_path_factory.mktemp("balance_dist"))
        per_rank, hung = spawn_ranks(_worker, world, (world, free_port(), outdir), outdir, JOIN_TIMEOUT_S)
        _CACHE["res"] = (per_rank, hung)
    return _CACHE["res"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_distributed(scenario, tmp_path_factory):
    per_rank, hung = _group_results(tmp_path_factory)
    bad = problems(per_rank, hung, [scenario])
    if bad:
        pytest.fail("\n".join(bad))


@pytest.mark.parametrize("counts", [[3.0, float("nan"), 1.0, 0.0], [3.0, float("inf"), 1.0, 0.0], [3, -1, 1, 0]],
                         ids=["nan", "inf", "negative"])
def test_update_expert_bias_refuses_counts_that_would_corrupt_the_bias(counts):
    """A NaN, infinite or negative load count would make every expert's bias NaN (or move it the
    wrong way) for the rest of training: a ValueError naming tokens_per_expert, the bias untouched."""
    bias = torch.zeros(4)
    tpe = torch.tensor(counts)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        update_expert_bias(bias, tpe)
    assert torch.equal(bias, torch.zeros(4))
    update_expert_bias(bias, torch.tensor([3, 1, 1, 0]))  # valid counts still update
    assert torch.isfinite(bias).all() and bias[0] < 0 < bias[3]


def test_bias_update_and_selection_refuse_bad_arguments():
    """A NaN / infinite / negative rate would make every bias NaN (or push the wrong way) for the rest of
    training; the router's update goes through the same rule and checks; k above the experts and a bad
    current placement are named."""
    from ascend_moe_ops.nn.moe import TopKRouter
    for rate in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ValueError, match="rate must be a finite number >= 0"):
            update_expert_bias(torch.zeros(4), torch.tensor([1, 2, 3, 4]), rate=rate)
    r = TopKRouter(6, 4, 2, expert_bias=True)
    with pytest.raises(ValueError, match="rate must be a finite number >= 0"):
        r.update_expert_bias(float("nan"), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(ValueError, match="tokens_per_expert has value nan at index"):
        r.update_expert_bias(0.1, torch.tensor([1.0, float("nan"), 3.0, 4.0]))
    assert torch.equal(r.expert_bias, torch.zeros(4))  # nothing applied
    torch.testing.assert_close(r.update_expert_bias(0.1, torch.tensor([1.0, 2.0, 3.0, 4.0])),
                               torch.tensor([0.1, 0.1, -0.1, -0.1]))
    with pytest.raises(ValueError, match=re.escape("k must be <= the number of experts (columns of scores) 4, got 5")):
        biased_topk(torch.randn(3, 4), torch.zeros(4), 5)
    with pytest.raises(ValueError, match=re.escape("current (an [E] expert -> rank tensor or a Placement): "
                                                   "expert_to_rank puts 3 experts on rank 0")):
        plan_placement(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, 2, current=torch.tensor([0, 0, 0, 1]))


# ================================================================================================
# edge values found by an independent catalogue (2026-12-07 night)

def test_biased_topk_selects_in_fp32_and_refuses_a_nan_bias():
    """A small bias breaks bf16 ties (it was added in the scores' dtype, where 1e-3 next to 0.5 is
    lost), an fp64 bias keeps its precision, and a NaN bias is refused (it picked arbitrary experts)."""
    idx, w = biased_topk(torch.tensor([[0.5, 0.5]], dtype=torch.bfloat16), torch.tensor([0.0, 1e-3]), 1)
    assert idx.tolist() == [[1]] and w.dtype == torch.bfloat16
    idx, _ = biased_topk(torch.tensor([[1.0, 1.0]]), torch.tensor([0.0, 1e-9], dtype=torch.float64), 1)
    assert idx.tolist() == [[1]]
    with pytest.raises(ValueError, match="bias has value nan at index"):
        biased_topk(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([float("nan"), 0.0, 0.0]), 1)


def test_update_expert_bias_needs_an_fp32_or_fp64_finite_bias():
    with pytest.raises(TypeError, match="bias must have dtype in \\(float32, float64\\), got bfloat16"):
        update_expert_bias(torch.ones(2, dtype=torch.bfloat16), torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="bias has value nan"):
        update_expert_bias(torch.tensor([float("nan"), 0.0]), torch.tensor([1.0, 2.0]))


def test_planner_edge_values():
    """Huge finite loads are refused by name instead of giving NaN / negative metrics; complex and
    bool loads are refused; the metrics take int loads and are scale-free; the move budget and
    the move cost check their arguments."""
    with pytest.raises(ValueError, match="predicted_load is too large"):
        plan_placement(torch.tensor([1e308, 1e308, 1.0, 1.0], dtype=torch.float64), 2, 2)
    p = plan_placement(torch.tensor([1e300, 1e300, 1.0, 1.0], dtype=torch.float64), 2, 2)
    assert 0 <= p.imbalance_after < 1e-9 and 0 <= p.cv_after < 1e-9
    for bad in (torch.tensor([1 + 1j, 2j]), torch.tensor([True, False])):
        with pytest.raises(TypeError, match="predicted_load must have dtype"):
            plan_placement(bad, 2, 1)
    assert imbalance(torch.tensor([1, 2, 3])) == pytest.approx(0.5)
    assert imbalance(torch.tensor([1e300, 2e300, 3e300], dtype=torch.float64)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        default_max_moves(0)
    with pytest.raises(TypeError, match="num_experts must be an int"):
        default_max_moves(2.5)
    with pytest.raises(ValueError, match="param_bytes must be a finite number >= 0"):
        MoveCost(10, param_bytes=float("inf"))


def test_predictor_refuses_counts_past_2_pow_53():
    """Counts above 2**53 are not exact in fp64; at 1e300 the robust method's noise estimate
    overflowed and predicted NaN."""
    p = ExpertLoadPredictor(2, window=3, method="robust")
    with pytest.raises(ValueError, match="counts of at most 2\\*\\*53: entry 0 is 1e\\+300"):
        p.update(torch.tensor([1e300, 1e300], dtype=torch.float64))
    p.update(torch.tensor([2.0 ** 40, 2.0 ** 40], dtype=torch.float64))
    assert torch.isfinite(p.predict()).all()


def test_canonical_names_a_wrong_argument_type():
    from ascend_moe_ops.balance.executor import canonical
    with pytest.raises(TypeError, match="placement must be a Placement"):
        canonical(torch.tensor([[0]]))


def test_metrics_refuse_nan_and_negative_loads():
    """imbalance / coefficient_of_variation returned 0.0 ("perfectly balanced") for a NaN load and
    for all-negative loads, and rank_loads passed them through; now a ValueError naming the
    argument (the planner's rule: finite and non-negative)."""
    nan = float("nan")
    for fn in (imbalance, coefficient_of_variation):
        for bad in ([1.0, nan], [-1.0, -3.0], [1.0, float("inf")]):
            with pytest.raises(ValueError, match="^rank_loads has value .* finite and non-negative"):
                fn(torch.tensor(bad))
        assert fn(torch.zeros(3)) == 0.0
    pl = Placement.contiguous(4, 2, 2)
    for bad in ([1.0, nan, 1.0, 1.0], [1.0, -5.0, 1.0, 1.0]):
        with pytest.raises(ValueError, match="^expert_load has value .* finite and non-negative"):
            pl.rank_loads(torch.tensor(bad))


def test_placement_tables_cannot_be_changed_from_outside():
    """The cached expert_to_rank went stale when slot_to_expert was changed in place (and the new
    table was never checked): the placement now keeps its own copy and hands out copies."""
    s2e = torch.tensor([[0, 1], [2, 3]])
    p = Placement(s2e, 4)
    assert p.expert_to_rank.tolist() == [0, 0, 1, 1]
    s2e[0, 0], s2e[1, 0] = 2, 0                      # the constructor's argument
    t = p.slot_to_expert
    t[0, 0], t[1, 0] = 2, 0                          # what the attribute returned
    p.expert_to_rank[:] = 1                          # a derived map
    p.expert_slots()[:] = -1
    assert p.slot_to_expert.tolist() == [[0, 1], [2, 3]]
    assert p.expert_to_rank.tolist() == [0, 0, 1, 1]
    assert p.expert_slots().flatten().tolist() == [0, 1, 2, 3]
    assert p.physical_slots(torch.tensor([[2, 3]])).tolist() == [[2, 3]]
    assert p.rank_loads(torch.ones(4)).tolist() == [2.0, 2.0]
    with pytest.raises(AttributeError, match="cannot be reassigned"):
        p.slot_to_expert = torch.tensor([[2, 1], [0, 3]])
    q = Placement(torch.tensor([[2, 1], [0, 3]]), 4)
    assert q.expert_to_rank.tolist() == [1, 0, 0, 1] and q != p and p == Placement(s2e.new_tensor([[0, 1], [2, 3]]), 4)


def test_predictor_numeric_arguments_are_typed():
    with pytest.raises(TypeError, match="^alpha must be a float, got str"):
        ExpertLoadPredictor(4, alpha="0.5")
    with pytest.raises(TypeError, match="^alpha must be a float, got bool"):
        ExpertLoadPredictor(4, alpha=True)
    with pytest.raises(ValueError, match="alpha must be in"):
        ExpertLoadPredictor(4, alpha=float("nan"))
    with pytest.raises(TypeError, match="^window must be an int"):
        ExpertLoadPredictor(4, window=2.0)
    with pytest.raises(TypeError, match="^horizon must be an int"):
        ExpertLoadPredictor(4, horizon="1")
    assert ExpertLoadPredictor(4, alpha=1).alpha == 1.0
    np = pytest.importorskip("numpy")  # numpy scalars are numbers too (refused for a while on 2026-12-08)
    assert ExpertLoadPredictor(4, alpha=np.float32(0.5), window=np.int64(3)).alpha == 0.5
    with pytest.raises(TypeError, match="^alpha must be a float, got numpy.bool"):
        ExpertLoadPredictor(4, alpha=np.bool_(True))
