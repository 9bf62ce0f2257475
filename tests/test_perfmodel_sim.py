"""The training-step simulator: analytic answers (FLOPs, memory, pipeline bubble, traffic, roofline),
plan ranking on a constructed case, the CLI, and the validation pipeline's plumbing (tiny shapes;
its accuracy is measured by ``python -m ascend_moe_ops.perfmodel.validate``, not asserted here)."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from ascend_moe_ops.perfmodel import load_table
from ascend_moe_ops.perfmodel.hardware import HardwareTable
from ascend_moe_ops.perfmodel.sim import (CONVENTIONS, PANGU_ULTRA_MOE, Cluster, FittedCosts, LayerGlue, LinkModel,
                                          ModelSpec, Op, Plan, RooflineCosts, flops_per_token, params,
                                          pipeline_schedule, search, simulate)
from ascend_moe_ops.perfmodel.sim import model as M
from ascend_moe_ops.perfmodel.sim import traffic as TR
from ascend_moe_ops.perfmodel.sim.audit import REPORTED, audit
from ascend_moe_ops.perfmodel.sim.clusters import a2_cluster, gpu_cluster
from ascend_moe_ops.perfmodel.sim.layers import moe_layer_ops

TINY = ModelSpec(name="tiny", layers=4, hidden=16, heads=2, q_lora_rank=0, kv_lora_rank=8, qk_nope_dim=4,
                 qk_rope_dim=2, v_dim=4, routed_experts=8, shared_experts=1, top_k=2, expert_ffn=6,
                 dense_layers=1, dense_ffn=12, vocab=32, seq_len=10)


def _chip(**over):
    p = {"cube_cores": 24, "vector_cores": 48, "clock_hz": 1.5e9, "cube_macs_per_cycle_fp16": 4096,
         "gm_bandwidth": 1.6e12, "hbm_capacity": 64e9}
    p.update(over)
    return HardwareTable.from_dict({"name": "chip", "title": "test chip", "version": "t", "params": {
        k: {"value": v, "unit": "-", "assumption": "a value made up for this test"} for k, v in p.items()}})


# ----------------------------------------------------------------------------- model arithmetic
def test_params_by_hand():
    H, nh = 16, 2
    attn = H * nh * 6 + H * (8 + 2) + 8 * nh * (4 + 4) + nh * 4 * H
    assert M.attention_params(TINY) == attn
    expert = 3 * H * 6
    p = params(TINY)
    moe_active = attn + 8 * H + 2 * expert + expert
    moe_total = attn + 8 * H + 8 * expert + expert
    dense = attn + 3 * H * 12
    assert p["active"] == 3 * moe_active + dense + 32 * H
    assert p["total"] == 3 * moe_total + dense + 2 * 32 * H


def test_pangu_counts_match_the_report():
    """The dims the report does not print (assumptions in the docs) give its 718B / 39B."""
    p = params(PANGU_ULTRA_MOE)
    assert p["total"] == pytest.approx(718e9, rel=0.01)
    assert p["active"] == pytest.approx(39e9, rel=0.015)


def test_flops_conventions():
    n = params(TINY)["active"]
    attn_fwd = 2 * TINY.seq_len * TINY.heads * (6 + 4)
    assert flops_per_token(TINY, "6N") == 6 * n
    assert flops_per_token(TINY, "6N+attn") == 6 * n + 3 * TINY.layers * attn_fwd / 2
    assert flops_per_token(TINY, "6N+attn(full)") == 6 * n + 3 * TINY.layers * attn_fwd
    assert flops_per_token(TINY, "8N+attn(recompute)") == pytest.approx(4 / 3 * flops_per_token(TINY, "6N+attn(full)"))
    with pytest.raises(ValueError, match="convention must be one of"):
        flops_per_token(TINY, "7N")


def test_activation_bytes_by_hand():
    b, H, K, F = 2, 16, 2, 6
    none = M.activation_bytes_per_token(TINY, recompute="none", tp=1, dtype_bytes=b)
    attn = (H + 0 + 2 * 6 + 8 + 2 + 2 * 8 + 2 * 4) * b + 4 * 2
    routed = H + K * H + K * 2 * F + K * F + K * H
    shared = H + 3 * 6
    assert none == attn + (routed + shared) * b
    sel = M.activation_bytes_per_token(TINY, recompute="selective", tp=1, dtype_bytes=b)
    assert none - sel == (2 * 8 + K * H + K * F) * b
    assert M.activation_bytes_per_token(TINY, recompute="full", tp=2, dtype_bytes=b) == b * H / 2
    with pytest.raises(ValueError, match="recompute must be one of"):
        M.activation_bytes_per_token(TINY, recompute="some")


def test_model_spec_rejects_bad_fields():
    with pytest.raises(ValueError, match="ModelSpec.top_k=9 exceeds"):
        TINY.replace(top_k=9)
    with pytest.raises(ValueError, match="ModelSpec.hidden must be a positive int"):
        TINY.replace(hidden=0)


def test_moe_layer_ops_flops():
    T, H, F, E, K = 64, 32, 16, 8, 2
    fwd, bwd = moe_layer_ops(T, H, F, E, K, dtype="float32")
    by = {o.name: o for o in fwd + bwd}
    N = T * K
    assert by["fc1"].flops == 2 * N * H * 2 * F and by["fc2"].flops == 2 * N * F * H
    assert by["fc1_bwd"].flops == 2 * by["fc1"].flops and by["fc2_bwd"].flops == 2 * by["fc2"].flops
    f2, b2 = moe_layer_ops(T, H, F, E, K, dtype="float32", recompute_permute=True, recompute_activation=True)
    assert [o.name for o in b2 if "recompute" in o.name] == ["swiglu(recompute)", "permute(recompute)"]
    with pytest.raises(ValueError, match="imbalance must be >= 1"):
        moe_layer_ops(T, H, F, E, K, imbalance=0.5)


# ----------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize("p, v, m", [(4, 1, 8), (4, 2, 8), (8, 2, 16), (2, 3, 4), (1, 1, 5)])
def test_pipeline_bubble_is_the_textbook_one(p, v, m):
    """Equal stages, no send cost: the event simulation gives (p-1)/(v*m+p-1) idle, i.e. 1F1B's
    (p-1)/(m+p-1) and the interleaved schedule's v-fold smaller bubble."""
    tf, tb = 1.0 / v, 2.0 / v
    makespan, events, in_flight = pipeline_schedule(p, v, m, lambda s, c: tf, lambda s, c: tb)
    ideal = m * 3.0
    assert 1 - ideal / makespan == pytest.approx((p - 1) / (v * m + p - 1))
    assert len(events) == 2 * p * v * m
    assert in_flight[0] == (min(m, p) if v == 1 else min(m * v, (p - 1) * 2 + (v - 1) * p + 1))
    for s in range(p):  # on one stage no two ops overlap
        ev = sorted((e for e in events if e["stage"] == s), key=lambda e: e["start"])
        assert all(a["end"] <= b["start"] + 1e-12 for a, b in zip(ev, ev[1:]))


def test_pipeline_interleaved_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of pp"):
        pipeline_schedule(4, 2, 6, lambda s, c: 1, lambda s, c: 1)


# ----------------------------------------------------------------------------- traffic
def _random_ids(world, T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(T, E, generator=g).topk(K, dim=1).indices for _ in range(world)]


def test_exact_traffic_flat_vs_hierarchical_small_case():
    """Rank 0 of 2 nodes x 2 ranks, E=8 (2 per rank), two tokens, counted by hand."""
    ids = [[[0, 4], [5, 6]], [[0, 1]], [[2, 3]], [[6, 7]]]
    flat = TR.exact_dispatch(ids, 8, 2, 4, algo="flat", dtype_bytes=2)
    hier = TR.exact_dispatch(ids, 8, 2, 4, algo="hierarchical", dtype_bytes=2)
    # rank 0 (node 0): slots on node 1 (experts 4..7): 4, 5, 6 -> 3 inter; none on rank 1 -> 0 intra
    assert (flat[0]["inter_node_rows"], flat[0]["intra_node_rows"]) == (3, 0)
    assert flat[0]["inter_node_bytes"] == 3 * 4 * 2
    # dedup: each token crosses to node 1 once -> 2 rows; forwarding: rank 0 forwards rank 2's
    # token [2, 3] (node 0? no: experts 2, 3 are on rank 1 of node 0) -> 1 row to rank 1
    assert (hier[0]["inter_node_rows"], hier[0]["intra_node_rows"]) == (2, 1)
    assert hier[0]["inter_node_bytes"] == 2 * (4 * 2 + 2 * 4 + 2 * 4)
    ag = TR.exact_dispatch(ids, 8, 2, 4, algo="allgather")
    assert ag[0]["inter_node_rows"] == 2 * 1 and ag[1]["inter_node_rows"] == 1


def test_expected_traffic_matches_exact_on_average():
    world, local, E, K, T, H = 8, 2, 32, 6, 3000, 4
    ids = _random_ids(world, T, E, K, seed=3)
    for algo in TR.ALGOS:
        exact = TR.exact_dispatch(ids, E, local, H, algo=algo)
        exp = TR.expected_dispatch(T, K, E, H, nodes=world // local, local=local, algo=algo)
        got = sum(r["inter_node_rows"] for r in exact) / world
        assert got == pytest.approx(exp["inter_node_rows"], rel=0.02), algo
        got = sum(r["intra_node_rows"] for r in exact) / world
        assert got == pytest.approx(exp["intra_node_rows"], rel=0.03), algo
    f = TR.expected_dispatch(T, K, E, H, nodes=4, local=2, algo="flat")
    h = TR.expected_dispatch(T, K, E, H, nodes=4, local=2, algo="hierarchical")
    assert h["inter_node_rows"] < f["inter_node_rows"]  # K=6 > N=4: dedup sends fewer rows


def _stats_worker(rank, world, local, port, outdir, E, K, H, T):
    import datetime
    import os
    import sys
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(__file__))
    from _spawn import dump_results
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from ascend_moe_ops.distributed import EPTopology, MoEDispatcher
        topo = EPTopology(local_size=local)
        ids = _random_ids(world, T, E, K, seed=11)[rank]
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(T, H, generator=g, dtype=torch.bfloat16)
        p = torch.rand(T, K, generator=g)
        out = {}
        for algo in ("flat", "hierarchical", "hierarchical_allgather"):
            h = MoEDispatcher(topo, E, algorithm=algo).dispatch(x, ids, p)[2]
            out[algo] = {k: int(v) for k, v in h.stats.items()}
        dump_results(out, outdir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # four spawned processes: ~10-30 s on 2 shared cores
def test_traffic_matches_the_dispatchers_own_counts(tmp_path):
    """2 nodes x 2 ranks (gloo): the simulator's exact counts equal ``handle.stats``."""
    from _spawn import free_port, spawn_ranks
    world, local, E, K, H, T = 4, 2, 16, 5, 8, 12
    per_rank, hung = spawn_ranks(_stats_worker, world, (world, local, free_port(), str(tmp_path), E, K, H, T),
                                 str(tmp_path), timeout=120)
    assert not hung and all(per_rank), per_rank
    ids = _random_ids(world, T, E, K, seed=11)
    for algo in ("flat", "hierarchical", "hierarchical_allgather"):
        ours = TR.exact_dispatch(ids, E, local, H, algo=algo, dtype_bytes=2, probs_bytes=4)
        for r in range(world):
            theirs = per_rank[r][algo]
            for k in ("inter_node_rows", "intra_node_rows", "inter_node_bytes", "intra_node_bytes"):
                assert ours[r][k] == theirs[k], (algo, r, k, ours[r], theirs)


# ----------------------------------------------------------------------------- costs
def test_roofline_analytic_cases():
    chip = _chip()
    c = RooflineCosts(chip, eff_compute=1.0, eff_memory=1.0, launch_s=0.0)
    peak = 24 * 4096 * 2 * 1.5e9
    assert c.peak_flops("bfloat16") == peak
    assert c.time(Op("copy", "copy", 0.0, 3.2e9)) == pytest.approx(3.2e9 / 1.6e12)  # copy = bytes / bw
    assert c.time(Op("mm", "gemm", 1e12, 1.0)) == pytest.approx(1e12 / peak)        # matmul = flops / peak
    c2 = c.with_launch_records({"mm": 1.25e-3})
    assert c2.time(Op("mm", "gemm", 1e12, 1.0)) == 1.25e-3 and "per-launch" in c2.label
    with pytest.raises(ValueError, match="eff_compute must be in"):
        RooflineCosts(chip, eff_compute=0.0)


def test_fitted_costs_recover_a_known_law():
    c_true = [2e-5, 1e-11, 5e-11, 3e-6]
    samples = []
    for i, (f, b, g) in enumerate([(1e9, 1e6, 4), (4e9, 3e6, 8), (2e8, 8e6, 64), (9e9, 2e7, 16), (5e8, 5e5, 2)]):
        op = Op(f"g{i}", "grouped_gemm", f, b, "float32", g)
        samples.append((op, c_true[0] + c_true[1] * f + c_true[2] * b + c_true[3] * g))
    fit = FittedCosts.fit(samples)
    for op, t in samples:
        assert fit.time(op) == pytest.approx(t, rel=1e-6)
    again = FittedCosts.from_json(fit.to_json())
    assert again.time(samples[0][0]) == pytest.approx(samples[0][1], rel=1e-6)
    with pytest.raises(KeyError, match="no calibration for 'permute/float32'"):
        fit.time(Op("p", "permute", 0, 1e6, "float32"))


def test_fitted_costs_curve_form_for_a_cache_knee():
    """A streaming op whose cost per byte doubles past a cache size (the SwiGLU of this machine:
    ~0.4 ns per element up to a few MB, ~0.8 past ~10 MB) has no single per-byte rate: the
    leave-one-out over its calibration samples picks the ``curve`` form, which interpolates the
    cost per byte in log(bytes) and reproduces every sample; a kind whose samples follow
    ``c0 + c2*bytes`` keeps ``linear``; kinds with FLOPs and kinds with too few samples are never
    curves; the form survives the JSON round trip."""
    from ascend_moe_ops.perfmodel.sim.costs import CURVE_MIN_SAMPLES, FittedCosts, _curve_time
    knee = lambda b: b * (0.4e-9 if b < 8e6 else 0.8e-9)  # noqa: E731
    sizes = (3e5, 1e6, 2.5e6, 5e6, 1.2e7, 2.4e7)
    samples = [(Op("s", "swiglu", 0.0, b, "float32"), knee(b)) for b in sizes]
    samples += [(Op("p", "permute", 0.0, b, "float32"), 2e-5 + b * 3e-10) for b in sizes]
    samples += [(Op("g", "grouped_gemm", 2e9 * i, 1e6 * i, "float32"), 1e-3 * i) for i in range(1, 7)]
    samples += [(Op("u", "unpermute", 0.0, b, "float32"), knee(b)) for b in sizes[:CURVE_MIN_SAMPLES - 1]]
    fit = FittedCosts.fit(samples)
    assert fit.forms["swiglu/float32"] == "curve" and fit.loo["swiglu/float32"]["curve"] > fit.loo["swiglu/float32"]["linear"]
    for b in sizes:
        assert fit.time(Op("s", "swiglu", 0.0, b, "float32")) == pytest.approx(knee(b), rel=1e-9)
    assert fit.forms["permute/float32"] == "linear"
    assert fit.time(Op("p", "permute", 0.0, 7e6, "float32")) == pytest.approx(2e-5 + 7e6 * 3e-10, rel=1e-6)
    assert fit.forms["grouped_gemm/float32"] == "linear" and "grouped_gemm/float32" not in fit.loo
    assert fit.forms["unpermute/float32"] == "linear" and "unpermute/float32" not in fit.loo
    # between two points the cost per byte moves linearly in log(bytes); held at the ends
    mid = (5e6 * 1.2e7) ** 0.5
    assert _curve_time([(5e6, 2e-3), (1.2e7, 9.6e-3)], mid) == pytest.approx(mid * (0.4e-9 + 0.8e-9) / 2, rel=1e-9)
    assert _curve_time([(5e6, 2e-3), (1.2e7, 9.6e-3)], 1e8) == pytest.approx(0.8e-9 * 1e8)
    back = FittedCosts.from_json(fit.to_json())
    assert back.forms == fit.forms and back.time(Op("s", "swiglu", 0.0, 3e6, "float32")) == fit.time(Op("s", "swiglu", 0.0, 3e6, "float32"))
    assert FittedCosts.fit(samples, curves=False).forms["swiglu/float32"] == "linear"


def test_layer_glue_recovers_a_known_law():
    """The per-dtype layer glue ``g0 + g2*bytes`` is recovered exactly from whole layers whose
    measured time is the summed ops plus that law (a negative g0 included); a single sample gives
    ``g0`` only; unknown dtypes and bad samples are refused."""
    from ascend_moe_ops.perfmodel.sim.costs import LayerGlue
    law = {"float32": (3e-3, 2e-11), "bfloat16": (-1e-3, 5e-11)}
    samples = []
    for dtype, (g0, g2) in law.items():
        for s, b in ((0.05, 1e8), (0.2, 6e8), (0.11, 3e8), (0.4, 2e9)):
            samples.append((dtype, s, b, s + g0 + g2 * b))
    glue = LayerGlue.fit(samples)
    for dtype, (g0, g2) in law.items():
        assert glue.coefs[dtype][0] == pytest.approx(g0, rel=1e-6, abs=1e-12)
        assert glue.coefs[dtype][1] == pytest.approx(g2, rel=1e-6)
        assert glue.time(dtype, 1e9) == pytest.approx(g0 + g2 * 1e9, rel=1e-6)
    ops = [Op("a", "permute", 0.0, 4e8, "float32"), Op("b", "permute", 0.0, 6e8, "float32")]

    class Half(FittedCosts):
        def time(self, op):
            return 0.5e-3
    assert glue.layer_time(Half(), ops) == pytest.approx(1e-3 + 3e-3 + 2e-11 * 1e9, rel=1e-6)
    one = LayerGlue.fit([("float32", 0.1, 1e8, 0.125)])
    assert one.coefs["float32"] == pytest.approx([0.025, 0.0, 0.0])
    with pytest.raises(KeyError, match="no calibration for dtype 'float16'"):
        glue.time("float16", 1.0)
    with pytest.raises(ValueError, match="bad sample"):
        LayerGlue.fit([("float32", 0.1, 1e8, 0.0)])


def test_layer_glue_select_picks_the_form_of_a_known_law():
    """Leave-one-out over the calibration layers picks the form that generated them: a layer 12 %
    slower than its summed ops gets ``scale``; layers equal to their summed ops get ``none`` (the
    tie goes to the simplest form); a constant offset gets ``const``. The chosen form's fit is
    exact and its leave-one-out accuracy is reported per form."""
    from ascend_moe_ops.perfmodel.sim.costs import LayerGlue
    base = [(0.05, 1e8), (0.2, 6e8), (0.11, 3e8), (0.4, 2e9), (0.07, 9e8)]
    samples = [("float32", s, b, 1.12 * s) for s, b in base] + [("bfloat16", s, b, s) for s, b in base] \
        + [("float16", s, b, s + 4e-3) for s, b in base]
    glue = LayerGlue.select(samples)
    assert glue.forms == {"float32": "scale", "bfloat16": "none", "float16": "const"}
    assert glue.coefs["float32"] == pytest.approx([0.0, 0.0, 0.12], abs=1e-9)
    assert glue.time("float32", 5e8, 0.3) == pytest.approx(0.036)
    assert glue.coefs["bfloat16"] == [0.0, 0.0, 0.0] and glue.coefs["float16"][0] == pytest.approx(4e-3)
    assert glue.loo["float32"]["scale"] == pytest.approx(1.0) and glue.loo["float32"]["none"] < 0.9
    assert set(glue.loo["bfloat16"]) == set(LayerGlue.FORMS)
    with pytest.raises(ValueError, match="form must be one of"):
        LayerGlue.fit(samples, form="quadratic")


def test_calibration_layers_cover_recompute_and_stay_off_validation():
    from ascend_moe_ops.perfmodel import validate as V
    layers = V.calibration_layers(V.CALIBRATION, ["bfloat16", "float32"])
    assert len(layers) == 2 * len(V.CALIBRATION)
    assert {(c[6], c[7]) for c in layers} == {(False, False), (True, False), (False, True), (True, True)}
    val = {tuple(v[:5]) for v in V.VALIDATION}
    assert not any(tuple(c[:5]) in val for c in layers)


# ----------------------------------------------------------------------------- simulate / search
def _cluster(inter_bw=2e9, memory=1e12):
    chip = _chip()
    return Cluster("test", RooflineCosts(chip), LinkModel(intra_bw=100e9, inter_bw=inter_bw, devices_per_node=8),
                   memory, 1.6e12, 10e9)


MID = ModelSpec(name="mid", layers=8, hidden=1024, heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_dim=64,
                qk_rope_dim=32, v_dim=64, routed_experts=64, shared_experts=1, top_k=8, expert_ffn=256,
                vocab=1000, seq_len=1024)


def test_simulate_memory_and_mfu_formula():
    cl = _cluster()
    plan = Plan(tp=2, pp=2, ep=4, dp=4, num_microbatches=4)
    r = simulate(MID, cl, plan)
    c = M.layer_counts(MID)
    p_dense = (4 * (c["attention"] + c["router"] + c["shared"]) + MID.vocab * MID.hidden) / 2
    p_exp = 4 * c["routed_experts"] / (4 * 2)
    assert r.breakdown["params_dense_per_device"] == pytest.approx(p_dense)
    assert r.breakdown["params_expert_per_device"] == pytest.approx(p_exp)
    assert r.memory["weights"] == pytest.approx(2 * (p_dense + p_exp))
    assert r.memory["optimizer"] == pytest.approx(12 * p_dense / 4 + 12 * p_exp / 1)
    tokens = 4 * 4 * MID.seq_len
    assert r.tokens_per_s == pytest.approx(tokens / r.step_s)
    for name in CONVENTIONS:
        assert r.mfu[name] == pytest.approx(r.tokens_per_s * flops_per_token(MID, name) / (16 * cl.costs.peak_flops("bfloat16")))
        assert "tokens/s" in r.mfu_formula[name]
    assert r.timeline and {e["kind"] for e in r.timeline} == {"F", "B"}
    with pytest.raises(ValueError, match="ep=3 must divide"):
        simulate(MID, cl, Plan(tp=1, ep=3, dp=3))


def test_plan_options_move_the_prediction_the_right_way():
    cl = _cluster(inter_bw=2e9)
    base = Plan(tp=1, pp=1, ep=16, dp=16, num_microbatches=2, a2a="flat", overlap=False)
    t = {k: simulate(MID, cl, base.replace(**kw)).step_s for k, kw in {
        "flat": {}, "hier": dict(a2a="hierarchical"), "overlap": dict(overlap=True),
        "imbalanced": dict(imbalance=1.5), "full": dict(recompute="full")}.items()}
    assert t["hier"] < t["flat"]          # K=8 > 2 nodes: fewer inter-node rows
    assert t["overlap"] < t["flat"]
    assert t["imbalanced"] > t["flat"]
    assert t["full"] > t["flat"]
    m = {rc: simulate(MID, cl, base.replace(recompute=rc)).memory["activations"] for rc in ("none", "selective", "full")}
    assert m["none"] > m["selective"] > m["full"]
    piped = Plan(tp=1, pp=4, ep=4, dp=4, num_microbatches=8)
    kept, swapped = simulate(MID, cl, piped), simulate(MID, cl, piped.replace(swap="activations"))
    assert kept.memory["in_flight_chunks"] == 4  # 1F1B: stage 0 holds p microbatches
    assert swapped.memory["activations"] == pytest.approx(kept.memory["activations"] / 4)
    assert swapped.step_s >= kept.step_s


def test_search_ranks_plans_on_a_constructed_case():
    """Slow inter-node links, top-8 over 2 nodes: every hierarchical plan outranks its flat twin,
    and the ranking is sorted by throughput."""
    cl = _cluster(inter_bw=1e9)
    ranked = search(MID, cl, 16, 16, tp=(1,), pp=(1,), vpp=(1,), ep=(16,), recompute=("none",),
                    a2a=("flat", "hierarchical"), top=10)
    assert [r.plan.a2a for r in ranked] == ["hierarchical", "flat"]
    assert ranked[0].tokens_per_s > ranked[1].tokens_per_s
    small = _cluster(memory=1e6)
    assert search(MID, small, 16, 16, tp=(1,), pp=(1,), vpp=(1,), ep=(16,)) == []


def test_gpu_tables_and_a2_cluster():
    h = gpu_cluster("h100")
    assert h.costs.peak_flops("bfloat16") == pytest.approx(989.4e12)
    assert load_table("h200")["hbm_capacity"] > load_table("h100")["hbm_capacity"]
    cl = a2_cluster(_chip())
    assert cl.devices_per_node == 8 and cl.links.inter_bw == load_table("cluster_a2")["inter_node_bandwidth"]


def test_shipped_a2_table_if_present():
    try:
        chip = load_table("a2")
    except ValueError:
        pytest.skip("the a2 hardware table is not in this tree")
    r = simulate(PANGU_ULTRA_MOE, a2_cluster(chip), Plan(tp=8, pp=16, vpp=2, ep=4, dp=48, num_microbatches=32,
                                                         recompute="selective"), timeline=False)
    assert 0 < r.mfu["6N"] < 1


def test_audit_implied_peak():
    rows = audit(PANGU_ULTRA_MOE, 300e12)
    r = rows[0]
    assert r["implied_peak"] == pytest.approx(REPORTED[0].tokens_per_s * r["flops_per_token"] / 6144 / 0.30)
    assert r["mfu"] * 300e12 == pytest.approx(r["implied_peak"] * 0.30)
    # the report's two figures are consistent with one another: same implied peak within 1 %
    by = {(x["figure"], x["convention"]): x["implied_peak"] for x in rows}
    for conv in CONVENTIONS:
        a, b = by[(REPORTED[0].label, conv)], by[(REPORTED[1].label, conv)]
        assert a == pytest.approx(b, rel=0.01)


def test_cli_writes_json_and_chart(tmp_path, capsys):
    from ascend_moe_ops.perfmodel.sim.__main__ import main
    assert main(["--cluster", "h100", "--tp", "8", "--pp", "4", "--vpp", "2", "--ep", "8", "--dp", "8",
                 "--microbatches", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(model)" in out and "MFU 6N (model)" in out
    d = json.loads((tmp_path / "sim.json").read_text())
    assert d["step_s"] > 0 and d["timeline"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "sim.png").stat().st_size > 1000


def test_validation_pipeline_plumbing(tmp_path):
    """The calibrate/validate pipeline end to end on tiny shapes (seconds): a report with one row
    per configuration, predictions from the fit, measurements from the harness. Accuracy is not
    asserted (tiny shapes are all overhead)."""
    from ascend_moe_ops.perfmodel import validate as V
    rep = V.run(tmp_path, rounds=1, tiny=True, min_run_time=0.01, layer_min_run_time=0.01, log=lambda s: None)
    assert len(rep["validation"]) == len(V.TINY_VALIDATION)
    for row in rep["validation"]:
        assert row["predicted_s"] > 0 and row["measured_s"] > 0
        assert row["accuracy"] == pytest.approx(1 - abs(row["predicted_s"] - row["measured_s"]) / row["measured_s"])
    assert json.loads((tmp_path / "validation.json").read_text())["rounds"] == 1
    assert "accuracy" in V.format_table(rep)
    for row in rep["validation"]:  # components + glue, the glue fitted on the calibration layers
        assert row["predicted_s"] == pytest.approx(row["components_s"] + row["glue_s"])
    assert set(rep["glue"]) == {"float32"} and len(rep["calibration_layers"]) == len(V.TINY_CALIBRATION)
    cpu = V.run(tmp_path / "cpu", rounds=1, tiny=True, min_run_time=0.01, layer_min_run_time=0.01,
                log=lambda s: None, clock="process", glue=False)
    assert cpu["clock"] == "process" and cpu["glue"] is None
    assert all(r["glue_s"] == 0 and r["predicted_s"] == r["components_s"] for r in cpu["validation"])
    with pytest.raises(ValueError, match="clock must be one of"):
        V.run(tmp_path, tiny=True, clock="gpu")
    with pytest.raises(ValueError, match="needs threads=1"):
        V.run(tmp_path, tiny=True, clock="process", threads=2)
    cal = {tuple(c) for c in V.CALIBRATION}
    assert not any(tuple(v[:5]) in cal for v in V.VALIDATION)
    assert len(V.VALIDATION) >= 12 and {v[5] for v in V.VALIDATION} == {"float32", "bfloat16"}


def test_ep_prediction_formula():
    """The EP layer's prediction: compute + communication without overlap, ``max + min / c`` with
    ``c`` chunks; the link fit recovers ``a + bytes / bw`` exactly."""
    from ascend_moe_ops.perfmodel.sim.costs import CostProvider
    from ascend_moe_ops.perfmodel.validate_ep import LinkFit, predict_ep_layer

    class Flat(CostProvider):
        def time(self, op):
            return 1e-3

    lf = LinkFit({"inter": [(1e6, 2e-3 + 1e6 / 1e8), (4e6, 2e-3 + 4e6 / 1e8)],
                  "intra": [(1e6, 1e-4 + 1e6 / 1e10), (2e6, 1e-4 + 2e6 / 1e10)]}, latency=5e-4)
    assert lf.as_dict()["inter"]["bw_Bps"] == pytest.approx(1e8)
    assert lf.time("inter", 3e6) == pytest.approx(2e-3 + 3e-2)
    one = predict_ep_layer(Flat(), lf, 256, 64, 32, 16, 4, algo="flat", chunks=1)
    assert one["predicted_s"] == pytest.approx(one["compute_s"] + one["comm_s"])
    four = predict_ep_layer(Flat(), lf, 256, 64, 32, 16, 4, algo="flat", chunks=4)
    big, small = max(four["compute_s"], four["comm_s"]), min(four["compute_s"], four["comm_s"])
    assert four["predicted_s"] == pytest.approx(big + small / 4)
    hier = predict_ep_layer(Flat(), lf, 256, 64, 32, 16, 4, algo="hierarchical", chunks=1)
    assert hier["compute_s"] > one["compute_s"]  # the two-stage reordering
    assert four["comm_s"] > one["comm_s"]  # every chunk pays the collectives' latency again


def test_ep_overlap_terms_known_answers():
    """``t(c) = C(1+rho) + comm - eta*min(C, comm)(1 - 1/c)``: rho scales the compute only, eta=0
    is no overlap at all (C(1+rho) + comm), eta=1 the ideal pipeline; :func:`fit_overlap` recovers
    rho and eta exactly from layers built with them, and eta stays 1 with one chunk only."""
    from ascend_moe_ops.perfmodel.sim.costs import CostProvider
    from ascend_moe_ops.perfmodel.validate_ep import EP_FIT_SHAPES, EP_VALIDATION, LinkFit, fit_overlap, predict_ep_layer

    class Flat(CostProvider):
        def time(self, op):
            return 1e-3

    lf = LinkFit({"inter": [(1e6, 1e6 / 1e8), (4e6, 4e6 / 1e8)], "intra": [(1e6, 1e6 / 1e10), (2e6, 2e6 / 1e10)]},
                 latency=5e-4)
    args = (Flat(), lf, 256, 64, 32, 16, 4)
    base = predict_ep_layer(*args, algo="flat", chunks=4)
    C, comm = base["compute_s"], base["comm_s"]
    assert base["hideable_s"] == pytest.approx(min(C, comm) * 0.75)
    none = predict_ep_layer(*args, algo="flat", chunks=4, rho=0.2, eta=0.0)
    assert none["predicted_s"] == pytest.approx(1.2 * C + comm)
    half = predict_ep_layer(*args, algo="flat", chunks=4, rho=0.2, eta=0.5)
    assert half["predicted_s"] == pytest.approx(1.2 * C + comm - 0.5 * min(C, comm) * 0.75)
    pts = []
    for algo in ("flat", "hierarchical"):
        for c in (1, 2, 4):
            p = predict_ep_layer(*args, algo=algo, chunks=c, rho=0.3, eta=0.6)
            pts.append((p["predicted_s"], p["compute_s"], p["comm_s"], p["hideable_s"]))
    got = fit_overlap(pts)
    assert got["rho"] == pytest.approx(0.3, rel=1e-6) and got["eta"] == pytest.approx(0.6, rel=1e-6)
    ones = [q for q in pts if q[3] == 0]
    assert fit_overlap(ones)["eta"] == 1.0 and fit_overlap(ones)["rho"] == pytest.approx(0.3, rel=1e-6)
    # a chunked layer slower than no overlap at all: eta is held at 0 and rho refitted
    worse = ones + [(q[1] * 1.3 + q[2] + 0.01, q[1], q[2], q[3]) for q in pts if q[3] > 0]
    w = fit_overlap(worse)
    assert w["eta"] == 0.0 and w["rho"] > 0
    # links pooled over rounds: the per-size median, so one disturbed round does not move the fit
    from ascend_moe_ops.perfmodel.validate_ep import pooled_links
    law = lambda b: 1e-3 + b / 5e7  # noqa: E731
    good = {"links": {"inter": [(b, law(b)) for b in (1e5, 1e6, 4e6)]}, "latency": 2e-3}
    bad = {"links": {"inter": [(b, 10 * law(b)) for b in (1e5, 1e6, 4e6)]}, "latency": 9e-3}
    pl = pooled_links([good, bad, good])
    assert pl.as_dict()["inter"]["bw_Bps"] == pytest.approx(5e7) and pl.latency == 2e-3
    assert pl.time("inter", 2e6) == pytest.approx(law(2e6))
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        predict_ep_layer(*args, algo="flat", chunks=0)
    with pytest.raises(ValueError, match="algo must be one of"):
        predict_ep_layer(*args, algo="ring", chunks=1)
    assert not {tuple(f) for f in EP_FIT_SHAPES} & {tuple(v) for v in EP_VALIDATION}
    # each collective at its own group's latency: the hierarchical dispatcher's 2-rank exchanges
    # (inter- and intra-node) are priced by those groups, its count header and the flat
    # dispatcher's exchanges by the whole group's; without per-group figures every group takes it
    by = LinkFit({"inter": [(1e6, 1e6 / 1e8), (4e6, 4e6 / 1e8)], "intra": [(1e6, 1e6 / 1e10), (2e6, 2e6 / 1e10)]},
                 latency=5e-4, latency_by={"world": 5e-4, "inter": 1e-4, "intra": 1e-5})
    for c in (1, 4):
        h0 = predict_ep_layer(*args, algo="hierarchical", chunks=c)["comm_s"]
        h1 = predict_ep_layer(Flat(), by, *args[2:], algo="hierarchical", chunks=c)["comm_s"]
        assert h0 - h1 == pytest.approx(c * (13 * 5e-4 - (5e-4 + 6 * 1.1e-4)), rel=1e-9)
        assert predict_ep_layer(Flat(), by, *args[2:], algo="flat", chunks=c)["comm_s"] == \
            pytest.approx(predict_ep_layer(*args, algo="flat", chunks=c)["comm_s"], rel=1e-12)
    pooled = pooled_links([{"links": {"inter": [(1e5, 1e-3)]}, "latency": 2e-3, "latency_by": {"inter": 1e-3}},
                           {"links": {"inter": [(1e5, 1e-3)]}, "latency": 4e-3, "latency_by": {"inter": 3e-3}},
                           {"links": {"inter": [(1e5, 1e-3)]}, "latency": 3e-3, "latency_by": {"inter": 2e-3}}])
    assert pooled.lat("inter") == 2e-3 and pooled.lat("intra") == 3e-3


def test_ep_overlap_form_chosen_by_leave_one_shape_out():
    """:func:`select_overlap` scores each overlap form by leaving one fit shape out: layers built
    with ``eta = 0.5`` and no compute excess pick ``eta`` (fitted exactly), layers of the ideal
    pipeline pick ``ideal`` (the simplest of the exact forms), layers with only a compute excess
    pick ``rho``; the per-form scores are reported. Fit shapes never validate."""
    from ascend_moe_ops.perfmodel.validate_ep import (EP_FIT_SHAPES, EP_VALIDATION, OVERLAP_FORMS, fit_overlap,
                                                      select_overlap)

    def layers(rho, eta, scale):
        out = []
        for c, k in ((0.1, 0.2), (0.3, 0.1), (0.2, 0.2)):
            c, k = c * scale, k * scale
            for chunks in (1, 4):
                h = min(c, k) * (1 - 1 / chunks)
                out.append((c * (1 + rho) + k - eta * h, c, k, h))
        return out
    for (rho, eta), want in (((0.0, 0.5), "eta"), ((0.0, 1.0), "ideal"), ((0.25, 1.0), "rho")):
        groups = {f"s{i}": layers(rho, eta, scale) for i, scale in enumerate((1.0, 1.7, 0.6))}
        got = select_overlap(groups)
        assert got["form"] == want and set(got["loso"]) == set(OVERLAP_FORMS)
        assert got["rho"] == pytest.approx(rho, abs=1e-9) and got["eta"] == pytest.approx(eta, abs=1e-9)
        assert got["loso"][want] == pytest.approx(1.0)
    assert fit_overlap(layers(0.0, 0.5, 1.0), "ideal") == {"rho": 0.0, "eta": 1.0}
    with pytest.raises(ValueError, match="form must be one of"):
        fit_overlap(layers(0.0, 0.5, 1.0), "both")
    assert len(EP_FIT_SHAPES) >= 3
    assert not {tuple(f[:3]) for f in EP_FIT_SHAPES} & {tuple(v[:3]) for v in EP_VALIDATION}


def test_ep_exchange_form_known_answers():
    """The ``exchange`` communication form: :class:`ExchangeFit` recovers ``a + b*bytes`` per
    algorithm and chunk count; :func:`predict_ep_layer` with it prices ``comm(c)`` at the layer's
    exchanged bytes and leaves the reordering (in the exchange's microbenchmark) out of ``C``;
    :func:`select_ep_model` picks the communication form the layers were built with, by
    leave-one-shape-out over the fit shapes; the calibration sizes never share T, H with a
    validation (or fit) shape."""
    from ascend_moe_ops.perfmodel.sim.costs import CostProvider
    from ascend_moe_ops.perfmodel.sim.traffic import expected_dispatch
    from ascend_moe_ops.perfmodel.validate_ep import (COMM_FORMS, EP_EXCHANGE_SIZES, EP_FIT_SHAPES, EP_VALIDATION,
                                                      ExchangeFit, LinkFit, exchange_bytes, predict_ep_layer,
                                                      select_ep_model)

    class Flat(CostProvider):
        def time(self, op):
            return 1e-3

    law = {("flat", 1): (2e-3, 1e-8), ("flat", 4): (9e-3, 1.5e-8), ("hierarchical", 1): (4e-3, 2e-8),
           ("hierarchical", 4): (1.5e-2, 2.5e-8)}
    xf = ExchangeFit({k: [(b, a + s * b) for b in (1e5, 1e6, 3e6)] for k, (a, s) in law.items()})
    for k, (a, s) in law.items():
        assert xf.time(*k, 2e6) == pytest.approx(a + s * 2e6)
    with pytest.raises(ValueError, match="no exchange microbenchmark"):
        xf.time("flat", 2, 1e6)
    tr = expected_dispatch(256, 4, 16, 64, nodes=2, local=2, algo="hierarchical", dtype_bytes=4)
    nb = exchange_bytes(256, 64, 16, 4, algo="hierarchical")
    assert nb == pytest.approx(2 * (tr["inter_node_bytes"] + tr["intra_node_bytes"] + tr["combine_inter_node_bytes"]
                                    + tr["combine_intra_node_bytes"]))
    assert exchange_bytes(256, 64, 16, 4, algo="flat") == pytest.approx(2 * 2 * 256 * 4 * 64 * 4 * 3 / 4)
    lf = LinkFit({"inter": [(1e6, 1e6 / 1e8), (4e6, 4e6 / 1e8)], "intra": [(1e6, 1e6 / 1e10), (2e6, 2e6 / 1e10)]},
                 latency=5e-4)
    args = (Flat(), lf, 256, 64, 32, 16, 4)
    for algo in ("flat", "hierarchical"):
        links = predict_ep_layer(*args, algo=algo, chunks=1)
        one = predict_ep_layer(*args, algo=algo, chunks=1, exchange=xf)
        # router + fc1 + swiglu + fc2 and their backward: 8 ops at 1 ms, no permute / unpermute
        assert one["compute_s"] == pytest.approx(8e-3) and links["compute_s"] > one["compute_s"]
        assert one["comm_s"] == pytest.approx(xf.time(algo, 1, exchange_bytes(256, 64, 16, 4, algo=algo)))
        assert one["predicted_s"] == pytest.approx(one["compute_s"] + one["comm_s"])
        four = predict_ep_layer(*args, algo=algo, chunks=4, exchange=xf)
        assert four["comm_s"] == pytest.approx(xf.time(algo, 4, exchange_bytes(256, 64, 16, 4, algo=algo)))
        big, small = max(four["compute_s"], four["comm_s"]), min(four["compute_s"], four["comm_s"])
        assert four["predicted_s"] == pytest.approx(big + small / 4)

    # layers built with one communication form (and eta = 0.5): that form is chosen, exactly
    def groups(truth):
        out = {}
        for i, (T, H) in enumerate(((256, 64), (384, 96), (192, 128))):
            pts = []
            for algo in ("flat", "hierarchical"):
                for c in (1, 4):
                    by = {}
                    for cf, x in (("links", None), ("exchange", xf)):
                        q = predict_ep_layer(Flat(), lf, T, H, 32, 16, 4, algo=algo, chunks=c, exchange=x)
                        by[cf] = (q["compute_s"], q["comm_s"], q["hideable_s"])
                    C, k, h = by[truth]
                    pts.append((C + k - 0.5 * h, by))
            out[f"s{i}"] = pts
        return out
    for truth in COMM_FORMS:
        got = select_ep_model(groups(truth))
        assert got["comm"] == truth and got["form"] == f"{truth}/eta" and got["eta"] == pytest.approx(0.5)
        assert got["loso"][f"{truth}/eta"] == pytest.approx(1.0)
        assert set(got["loso"]) == {f"{c}/{o}" for c in COMM_FORMS for o in ("ideal", "rho", "eta", "rho+eta")}
    # a report from before the exchange microbenchmark: the links form only
    old = {k: [(m, {"links": by["links"]}) for m, by in v] for k, v in groups("exchange").items()}
    assert select_ep_model(old)["comm"] == "links"
    with pytest.raises(ValueError, match="no communication form"):
        select_ep_model(old, ("exchange",))
    assert len(EP_EXCHANGE_SIZES) >= 3
    seen = {tuple(v[:2]) for v in EP_VALIDATION} | {tuple(f[:2]) for f in EP_FIT_SHAPES}
    assert not {tuple(x[:2]) for x in EP_EXCHANGE_SIZES} & seen


def test_ep_overlap_terms_per_algorithm():
    """:func:`select_ep_model` with the dispatch algorithm on each fit point: layers whose flat
    and hierarchical exchanges overlap differently (eta 0.2 and 0.8, rho 0.1 and 0.3) are fitted
    per algorithm, exactly, and :func:`overlap_terms` hands each algorithm its own terms; layers
    built with one pair keep the shared scope (a tie goes to the simpler, shared candidate)."""
    from ascend_moe_ops.perfmodel.validate_ep import OVERLAP_FORMS, overlap_terms, select_ep_model

    truth = {"flat": (0.1, 0.2), "hierarchical": (0.3, 0.8)}

    def groups(terms):
        out = {}
        for i, (C, k) in enumerate(((4e-3, 6e-3), (5e-3, 3e-3), (2e-3, 5e-3))):
            pts = []
            for algo in ("flat", "hierarchical"):
                for c in (1, 4):
                    kk = k * (1.5 if algo == "hierarchical" else 1.0) * (1 + 0.2 * (c - 1))
                    h = min(C, kk) * (1 - 1 / c)
                    rho, eta = terms[algo]
                    pts.append((C * (1 + rho) + kk - eta * h, {"exchange": (C, kk, h)}, algo))
            out[f"s{i}"] = pts
        return out

    got = select_ep_model(groups(truth), ("exchange",))
    assert got["scope"] == "per-algorithm" and got["form"] == "exchange/rho+eta/per-algorithm"
    assert got["loso"]["exchange/rho+eta/per-algorithm"] == pytest.approx(1.0)
    assert max(v for f, v in got["loso"].items() if not f.endswith("per-algorithm")) < 0.999
    for algo, (rho, eta) in truth.items():
        assert overlap_terms(got, algo) == pytest.approx(dict(rho=rho, eta=eta))
    shared = select_ep_model(groups({a: (0.1, 0.5) for a in truth}), ("exchange",))
    assert shared["scope"] == "shared" and shared["form"] == "exchange/rho+eta"
    assert overlap_terms(shared, "flat") == overlap_terms(shared, "hierarchical") == pytest.approx(dict(rho=0.1, eta=0.5))
    assert set(shared["loso"]) == {f"exchange/{o}{s}" for o in OVERLAP_FORMS for s in ("", "/per-algorithm")}
    # points without their algorithm (an older caller): the shared scope only
    two = {k: [p[:2] for p in v] for k, v in groups(truth).items()}
    assert select_ep_model(two, ("exchange",))["scope"] == "shared"


def test_ep_summarize_reanalyses_exchange_records():
    """:func:`summarize_ep` re-runs the analysis from the ``raw`` records alone: the exchange
    records (pooled over rounds: per size the median) give the exchange fit, and layers built with
    the exchange form and the ideal pipeline are predicted exactly, with ``exchange`` chosen;
    without the exchange records (an older report) the links form is used."""
    import json
    from ascend_moe_ops.perfmodel.sim.costs import CostProvider
    from ascend_moe_ops.perfmodel.validate_ep import (EP_FIT_SHAPES, EP_VALIDATION, ExchangeFit, LinkFit,
                                                      exchange_bytes, predict_ep_layer, summarize_ep)

    class Flat(CostProvider):
        def time(self, op):
            return 1e-3

    law = {("flat", 1): (2e-3, 1e-8), ("flat", 4): (9e-3, 1.5e-8), ("hierarchical", 1): (4e-3, 2e-8),
           ("hierarchical", 4): (1.5e-2, 2.5e-8)}
    sizes = ((192, 256, 16, 2), (576, 224, 16, 3), (320, 448, 16, 5))
    links = {"inter": [(b, 1e-3 + b / 5e7) for b in (6.5e4, 2.6e5, 1e6)],
             "intra": [(b, 1e-4 + b / 1e9) for b in (6.5e4, 2.6e5, 1e6)]}
    lf = LinkFit(links, 2e-3, {"world": 2e-3, "inter": 1e-3, "intra": 1e-3})
    xf = ExchangeFit({k: [(exchange_bytes(*s, algo=k[0]), a + b * exchange_bytes(*s, algo=k[0])) for s in sizes]
                      for k, (a, b) in law.items()})

    def rnd(scale):
        layers = {}
        for v in list(EP_VALIDATION) + list(EP_FIT_SHAPES):
            for algo in ("flat", "hierarchical"):
                for c in (1, 4):
                    p = predict_ep_layer(Flat(), lf, *v, algo=algo, chunks=c)
                    px = predict_ep_layer(Flat(), lf, *v, algo=algo, chunks=c, exchange=xf)
                    layers[f"{list(v)}|{algo}|{c}"] = dict(
                        measured_s=px["predicted_s"], **p,
                        exchange={k: px[k] for k in ("compute_s", "comm_s", "hideable_s")})
        exch = [dict(size=list(s), algo=a, chunks=c, bytes=exchange_bytes(*s, algo=a),
                     seconds=scale * (law[(a, c)][0] + law[(a, c)][1] * exchange_bytes(*s, algo=a)))
                for s in sizes for (a, c) in law]
        return dict(links=links, latency=2e-3, latency_by=lf.latency_by, layers=layers, exchange=exch,
                    link_fit=lf.as_dict(), exchange_fit=None)
    raw = json.loads(json.dumps({"rounds": [rnd(1.0), rnd(3.0), rnd(1.0)]}))  # one disturbed round
    rep = summarize_ep(raw)
    assert rep["overlap_fit"]["comm"] == "exchange" and rep["overlap_fit"]["overlap"] == "ideal"
    assert rep["mean_accuracy"] == pytest.approx(1.0) and rep["worst_accuracy"] == pytest.approx(1.0)
    assert len(rep["validation"]) == 4 * len(EP_VALIDATION) and set(rep["by_comm_form"]) == {"links", "exchange"}
    assert rep["pooled_exchange_fit"]["flat|4"]["a_s"] == pytest.approx(9e-3)
    for r in raw["rounds"]:
        del r["exchange"]
        for rec in r["layers"].values():
            del rec["exchange"]
    old = summarize_ep(raw)
    assert old["overlap_fit"]["comm"] == "links" and set(old["by_comm_form"]) == {"links"}
    assert old["pooled_exchange_fit"] is None


# ------------------------------------------------------------------ the command line's bad arguments
@pytest.mark.parametrize("argv, named", [
    # used to print an empty table and exit 0: no (tp, pp) layout divides 7 devices / a batch of 3
    (["--search", "--devices", "7", "--global-batch", "3"], "--search: no plan for --devices 7"),
    (["--search", "--devices", "0"], "argument --devices"),
    (["--search", "--global-batch", "-1"], "argument --global-batch"),
    (["--tp", "0"], "argument --tp"), (["--microbatches", "-2"], "argument --microbatches"),
    (["--imbalance", "0.5"], "argument --imbalance"), (["--imbalance", "nan"], "argument --imbalance"),
    (["--peak-tflops", "-1", "--audit"], "argument --peak-tflops"),
    (["--cluster", "nosuch"], "argument --cluster"), (["--model", "/nonexistent/m.json"], "argument --model"),
    (["--chip-table", "/nonexistent/a2.json"], "argument --chip-table"),
    (["--ep", "3"], "Plan.ep=3"), (["--pp", "3", "--microbatches", "32"], "multiple of pp"),
])
def test_sim_cli_bad_arguments_are_argparse_errors(argv, named, capsys, monkeypatch):
    from ascend_moe_ops.perfmodel.sim import __main__ as cli
    from ascend_moe_ops.perfmodel.sim import step
    monkeypatch.setattr(step, "search", lambda *a, **k: pytest.fail("searched with bad arguments"))
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_sim_cli_search_with_no_fitting_plan_says_so(capsys, monkeypatch):
    from ascend_moe_ops.perfmodel.sim import __main__ as cli
    from ascend_moe_ops.perfmodel.sim import step
    monkeypatch.setattr(step, "search", lambda *a, **k: [])  # every plan dropped (memory)
    assert cli.main(["--search", "--devices", "8", "--global-batch", "8"]) == 1
    err = capsys.readouterr().err
    assert "no plan for --devices 8 and --global-batch 8" in err
    assert step.layouts(7, 3) == [] and (1, 1, 8, 1) in step.layouts(8, 8)


# ------------------------------------------------------------------ bad arguments of the Python API
_S = dict(tp=(1,), pp=(1,), vpp=(1,), ep=(16,), recompute=("none",), a2a=("flat",))


@pytest.mark.parametrize("kw, exc, named", [
    # each used to be swallowed by search's loop and return [] ("no plan fits: try more devices")
    (dict(recompute=("selectiv",)), ValueError, "recompute must hold names out of none, selective, full, got 'selectiv'"),
    (dict(a2a=("hier",)), ValueError, "a2a must hold names out of flat, hierarchical, allgather, got 'hier'"),
    (dict(convention="6n"), ValueError, "convention must be one of"),
    (dict(imbalance=0.5), ValueError, "imbalance must be a finite number >= 1"),
    (dict(ep=(0,)), ValueError, "ep[0] must be >= 1, got 0"),
    (dict(dtype="int8"), ValueError, "dtype must be one of"),
    (dict(overlap="no"), TypeError, "overlap must be a bool"),
    (dict(recompute="none"), TypeError, "recompute must be a sequence of names"),
    # these divided by zero, or returned all plans but one (out[:-1])
    (dict(micro_batch=0), ValueError, "micro_batch must be >= 1"),
    (dict(tp=(0,)), ValueError, "tp[0] must be >= 1, got 0"),
    (dict(top=-1), ValueError, "top must be >= 0"),
])
def test_search_names_a_bad_argument(kw, exc, named):
    with pytest.raises(exc, match=re.escape(named)):
        search(MID, _cluster(), 16, 16, **{**_S, **kw})


def test_search_still_skips_plans_that_do_not_suit_the_model():
    from ascend_moe_ops.perfmodel.sim.step import PlanError, layouts
    # ep=3 divides neither the 64 experts nor tp*dp: infeasible plans are skipped, not errors
    assert search(MID, _cluster(), 16, 16, **{**_S, "ep": (3,)}) == []
    assert len(search(MID, _cluster(), 16, 16, **{**_S, "ep": (3, 16)})) == 1
    assert len(search(MID, _cluster(), 16, 16, **{**_S, "ep": (1, 2, 4, 16)}, top=None)) == 4
    with pytest.raises(PlanError, match="ep=3 must divide"):
        simulate(MID, _cluster(), Plan(tp=1, ep=3, dp=3))
    with pytest.raises(ValueError, match="devices must be >= 1"):
        layouts(0, 8)  # was ZeroDivisionError


@pytest.mark.parametrize("make, exc, named", [
    (lambda: Plan(imbalance=float("inf")), ValueError, "Plan.imbalance must be a finite number >= 1"),  # was OverflowError later
    (lambda: Plan(overlap="no"), TypeError, "Plan.overlap must be a bool"),  # "no" meant overlap on
    (lambda: Plan(sp=1), TypeError, "Plan.sp must be a bool"),
    (lambda: Plan(etp=True), TypeError, "Plan.etp (an int or None) must be an int, got bool"),
    (lambda: simulate(MID, _cluster(), Plan(), dtype="int8"), ValueError, "dtype must be one of"),  # was KeyError
    # an FFN the (expert) tensor parallelism does not divide gave fractional per-rank sizes
    (lambda: simulate(MID.replace(expert_ffn=250), _cluster(), Plan(tp=4, dp=1)), ValueError,
     "Plan.etp=4 must divide expert_ffn=250"),
    (lambda: simulate(TINY.replace(dense_ffn=13), _cluster(), Plan(tp=2, dp=1)), ValueError,
     "Plan.tp=2 must divide dense_ffn=13"),
    (lambda: simulate(MID, _cluster(), Plan(), convention="6n"), ValueError, "convention must be one of"),
])
def test_plan_and_simulate_name_bad_fields(make, exc, named):
    with pytest.raises(exc, match=re.escape(named)):
        make()


@pytest.mark.parametrize("make, named", [
    # memory_bw=0 divided by zero, -1 gave a step of -4.9e10 s; host_bw=NaN made swapping free
    (lambda c: dataclasses.replace(c, memory_bw=0.0), "Cluster.memory_bw must be > 0"),
    (lambda c: dataclasses.replace(c, memory_bw=-1.0), "Cluster.memory_bw must be > 0"),
    (lambda c: dataclasses.replace(c, memory_bw=float("nan")), "Cluster.memory_bw must be a finite number"),
    (lambda c: dataclasses.replace(c, host_bw=float("nan")), "Cluster.host_bw must be a finite number >= 0"),
    (lambda c: dataclasses.replace(c, memory_bytes=-1), "Cluster.memory_bytes must be a finite number >= 0"),
    # devices_per_node=0 divided by zero, -8 was accepted; a NaN latency made the JSON non-strict
    (lambda c: LinkModel(1e9, 1e9, devices_per_node=0), "LinkModel.devices_per_node must be >= 1"),
    (lambda c: LinkModel(1e9, 1e9, devices_per_node=-8), "LinkModel.devices_per_node must be >= 1"),
    (lambda c: LinkModel(1e9, 1e9, intra_latency=float("nan")), "LinkModel.intra_latency must be a finite number"),
    (lambda c: LinkModel(float("inf"), 1e9), "LinkModel.intra_bw must be a finite number"),
])
def test_cluster_and_links_checked_at_construction(make, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        make(_cluster())
    with pytest.raises(TypeError, match="devices_per_node must be an int"):
        LinkModel(1e9, 1e9, devices_per_node=2.5)


@pytest.mark.parametrize("records, kw, named", [
    ({"fc1": float("nan")}, {}, "launch records['fc1'] must be a finite number >= 0"),  # step_s was NaN
    ({"fc1": -1.0}, {}, "launch records['fc1'] must be a finite number >= 0"),  # accepted
    ({"fc_1": 1.0}, {}, "unknown op name 'fc_1'"),  # silently ignored
    (None, dict(launch_s=float("nan")), "launch_s must be a finite number >= 0"),
])
def test_a2_cluster_launch_records_checked(records, kw, named):
    with pytest.raises(ValueError, match=re.escape(named)) as e:
        a2_cluster(_chip(), launch_records=records, **kw)
    if "unknown" in named:
        assert "fc1" in str(e.value) and "attention_core" in str(e.value)
    cl = a2_cluster(_chip(), launch_records={"fc1": 1e-3, "head": 0.0})
    assert cl.costs.time(Op("fc1", "grouped_gemm", 1.0)) == 1e-3


@pytest.mark.parametrize("call, named", [
    (lambda: TR.expected_dispatch(100, 2, 16, 64, nodes=0, local=1, algo="flat"), "nodes must be >= 1"),
    (lambda: TR.expected_dispatch(100, 20, 16, 64, nodes=2, local=2, algo="flat"), "K=20 (experts per token) exceeds E=16"),
    (lambda: TR.expected_dispatch(-100, 2, 16, 64, nodes=2, local=2, algo="flat"), "T must be a finite number >= 0"),
    (lambda: TR.exact_dispatch([[[0, 1]], [[2, 3]]], 4, 0, 8, algo="flat"), "local must be >= 1"),
    (lambda: TR.exact_dispatch([[[0, 9]], [[2, 3]]], 4, 1, 8, algo="flat"), "topk_ids[0][0] holds expert id 9"),
    (lambda: pipeline_schedule(0, 1, 4, lambda s, c: 1, lambda s, c: 2), "pp must be >= 1"),
    (lambda: pipeline_schedule(2, 0, 2, lambda s, c: 1, lambda s, c: 2), "vpp must be >= 1"),
    (lambda: M.activation_bytes_per_token(MID, tp=0), "tp must be >= 1"),
    (lambda: LayerGlue.select([("bf16", 1.0, 1.0, 2.0)] * 3, forms=()), "forms must list at least one of"),
])
def test_sim_helpers_name_bad_arguments(call, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        call()


def _table_without(tmp_path, name, key):
    d = json.loads((Path(M.__file__).resolve().parents[1] / "hardware" / f"{name}.json").read_text())
    del d["params"][key]
    p = tmp_path / f"{name}_no_{key}.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_sim_cli_paths_and_chip_table_checked_before_work(tmp_path, capsys, monkeypatch):
    """Used to be tracebacks with exit 1 (NotADirectoryError, FileExistsError, KeyError 'clock_hz'),
    and a broken --chip-table was silently ignored with --cluster h100."""
    from ascend_moe_ops.perfmodel.sim import __main__ as cli
    from ascend_moe_ops.perfmodel.sim import clusters, step
    monkeypatch.setattr(step, "simulate", lambda *a, **k: pytest.fail("simulated with a bad flag"))
    monkeypatch.setattr(clusters, "a2_cluster", lambda *a, **k: pytest.fail("built a cluster with a bad flag"))
    f = tmp_path / "file"
    f.write_text("x")
    no_clock = _table_without(tmp_path, "a2", "clock_hz")
    for argv, named in [(["--out", str(f / "sub")], "argument --out: cannot create folder"),
                        (["--out", str(f)], "argument --out: " + repr(str(f)) + " exists and is not a folder"),
                        (["--chip-table", no_clock], "argument --chip-table: hardware table 'a2'"),
                        (["--cluster", "h100", "--chip-table", no_clock], "argument --chip-table: applies to --cluster a2 only")]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert named in err, err
        if "lacks" in err:
            assert "'clock_hz'" in err


@pytest.mark.parametrize("module, argv, named", [
    # tracebacks with exit 1 (ValueError, NotADirectoryError, a torch device RuntimeError), or, for
    # validate_ep --rounds 0, an IndexError after 15 s of setting up its processes; -1 was accepted
    ("validate", ["--rounds", "0"], "argument --rounds"),
    ("validate", ["--threads", "0"], "argument --threads"),
    ("validate", ["--min-run-time", "-1"], "argument --min-run-time"),
    ("validate", ["--layer-min-run-time", "nan"], "argument --layer-min-run-time"),
    ("validate", ["--device", "tpu"], "argument --device: must be cpu, cuda, cuda:N, npu or npu:N"),
    ("validate", ["--clock", "process", "--device", "cuda"], "argument --clock"),
    ("validate", ["--clock", "process", "--threads", "2"], "argument --clock: process needs --threads 1"),
    ("validate", ["--spec", "nosuch"], "argument --spec"),
    ("validate", ["--ep-rounds", "0"], "argument --ep-rounds"),
    ("validate", ["--out", "{file}/x"], "argument --out: cannot create folder"),
    ("validate_ep", ["--rounds", "0"], "argument --rounds"),
    ("validate_ep", ["--runs", "0"], "argument --runs"),
    ("validate_ep", ["--out", "{file}/x"], "argument --out"),
    ("validate_ep", ["--out", "{dir}"], "argument --out: "),
])
def test_validate_clis_check_flags_at_parse_time(module, argv, named, tmp_path, capsys, monkeypatch):
    import importlib
    mod = importlib.import_module(f"ascend_moe_ops.perfmodel.{module}")
    monkeypatch.setattr(mod, "run_ep" if module == "validate_ep" else "run",
                        lambda *a, **k: pytest.fail("ran with a bad flag"))
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file", dir=tmp_path) for a in argv]
    if module == "validate" and "--out" not in argv:
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        mod.main(["--tiny", "--no-ep", *argv] if module == "validate" else argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_valid_arguments_the_checks_must_keep_taking():
    """What the argument checks added on 2026-12-08 first refused and must take: numpy scalars and
    arrays where a Python number or a sequence is meant, a dispatch without probs (0 probs bytes),
    and an NPU for the validation's --device."""
    np = pytest.importorskip("numpy")
    from ascend_moe_ops.perfmodel import validate
    from ascend_moe_ops.perfmodel.sim import traffic as TR
    kw = dict(nodes=2, local=4, algo="hierarchical", dtype_bytes=2)
    none = TR.expected_dispatch(64, 8, 64, 1024, probs_bytes=0, **kw)
    four = TR.expected_dispatch(64, 8, 64, 1024, probs_bytes=4, **kw)
    assert 0 < none["inter_node_bytes"] < four["inter_node_bytes"]
    assert not Plan(overlap=np.bool_(False), tp=np.int64(2), dp=8).overlap
    assert len(search(MID, _cluster(), 16, 16, **{**_S, "ep": np.array([1, 2, 4, 16])}, top=np.int64(3))) == 3
    assert simulate(MID, _cluster(), Plan(tp=1, ep=16, dp=16, imbalance=np.float32(1.25))).step_s > 0
    for ok in ("cpu", "cuda", "cuda:1", "npu", "npu:0"):
        assert validate._device(ok) == ok
    with pytest.raises(TypeError, match=re.escape("Plan.overlap must be a bool, got int")):
        Plan(overlap=1)  # an int is still not a bool
    with pytest.raises(TypeError, match=re.escape("tp[0] must be an int, got numpy.float64")):
        search(MID, _cluster(), 16, 16, **{**_S, "tp": np.array([1.0, 2.5])})
