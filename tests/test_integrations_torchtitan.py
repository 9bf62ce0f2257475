"""ascend_moe_ops.integrations.torchtitan: the weight converters, and torchtitan's real MoE layer
patched vs unpatched, for both supported releases.

torchtitan 0.3.0 is the one requirements.txt installs: its cases (``v030`` in their names) run in
this process. The torchtitan 0.2.2 cases (``v022``) run here only where 0.2.2 is the importable
torchtitan; otherwise ``test_v022_cases_in_their_own_process`` runs them in a child pytest whose
path starts with a ``--no-deps --target`` install of torchtitan 0.2.2 (``.torchtitan-0.2.2`` at the
repository root, which the README's test command makes; ``ASCEND_MOE_OPS_TORCHTITAN_022`` names
another folder). Missing, that test skips, saying so, except under CI, where it fails.
"""

import copy
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ascend_moe_ops.integrations import torchtitan as tt
from ascend_moe_ops.nn import GroupedMLP
from ascend_moe_ops.testing import assert_close_to_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_converters_round_trip_and_math(dtype):
    g = torch.Generator().manual_seed(0)
    E, F_, H = 4, 6, 10
    w1 = torch.randn(E, F_, H, generator=g).to(dtype)
    w2 = torch.randn(E, H, F_, generator=g).to(dtype)
    w3 = torch.randn(E, F_, H, generator=g).to(dtype)
    mlp = tt.from_torchtitan_weights(w1, w2, w3)
    assert mlp.weight1.dtype == dtype and mlp.weight1.shape == (H, E * 2 * F_)
    for a, b in zip(tt.to_torchtitan_weights(mlp), (w1, w2, w3)):
        assert torch.equal(a, b)
    sizes = torch.tensor([3, 0, 4, 2])
    x = torch.randn(9, H, generator=g, dtype=torch.float64)
    m64 = tt.from_torchtitan_weights(w1.double(), w2.double(), w3.double())
    out = m64(x, sizes)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        xe = x[start:start + n]
        want = (F.silu(xe @ w1[e].double().T) * (xe @ w3[e].double().T)) @ w2[e].double().T
        torch.testing.assert_close(out[start:start + n], want, rtol=1e-6, atol=1e-6)
        start += n
    back = GroupedMLP(E, H, F_, dtype=dtype)
    tt.load_torchtitan_weights(back, w1, w2, w3)
    assert torch.equal(back.weight1, mlp.weight1) and torch.equal(back.weight2, mlp.weight2)


def test_converter_bad_shapes():
    w1, w2, w3 = torch.zeros(2, 3, 5), torch.zeros(2, 5, 3), torch.zeros(2, 3, 5)
    with pytest.raises(ValueError, match="w2 must have shape"):
        tt.from_torchtitan_weights(w1, w1, w3)
    with pytest.raises(ValueError, match="w3 must have the shape of w1"):
        tt.from_torchtitan_weights(w1, w2, w2)
    with pytest.raises(ValueError, match="w1 must be a 3-D tensor"):
        tt.from_torchtitan_weights(w1[0], w2, w3)
    with pytest.raises(ValueError, match="GroupedMLP has E=2, F=4"):
        tt.load_torchtitan_weights(GroupedMLP(2, 5, 4), w1, w2, w3)


# ---------------------------------------------------------------------------------------------
# torchtitan 0.2.2: the real MoE module (torchtitan.models.moe.moe)
# ---------------------------------------------------------------------------------------------

def _version():
    try:
        return tt.torchtitan_version()
    except RuntimeError as exc:
        pytest.skip(str(exc))


def _titan():
    version = _version()
    if version != "0.2.2":
        pytest.skip(f"torchtitan {version} here: the 0.2.2 cases run in "
                    "test_v022_cases_in_their_own_process")
    return importlib.import_module("torchtitan.models.moe.moe")


@pytest.fixture
def cpu_histc(monkeypatch):
    """torchtitan's router calls ``torch.histc`` on int64 expert ids, which the CUDA kernel accepts
    (returning int64) but the CPU one rejects (``"histogram_cpu" not implemented for 'Long'``).
    Give the CPU the CUDA behaviour, for the patched and the unpatched runs alike."""
    orig = torch.histc

    def histc(t, *args, **kwargs):
        if t.is_floating_point():
            return orig(t, *args, **kwargs)
        return orig(t.float(), *args, **kwargs).to(t.dtype)

    monkeypatch.setattr(torch, "histc", histc)


def _make_moe(mod, dtype, *, score_before_experts, score_func="softmax", top_k=3, E=8, H=16, F_=12):
    torch.manual_seed(0)
    args = mod.MoEArgs(num_experts=E, num_shared_experts=1, top_k=top_k, score_func=score_func,
                       route_norm=True, route_scale=2.0, score_before_experts=score_before_experts,
                       use_grouped_mm=False, load_balance_coeff=1e-3)
    m = mod.MoE(args, dim=H, hidden_dim=F_)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
        m.expert_bias.normal_(0.0, 0.05)
    return m.to(dtype)


def _fwd_bwd(m, x):
    xx = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y = m(xx)
    g = torch.Generator().manual_seed(1)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return y.detach(), xx.grad, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("score_before_experts", [True, False], ids=["score_before", "score_after"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_v022_moe_patched_matches_unpatched(cpu_histc, dtype, score_before_experts):
    mod = _titan()
    m = _make_moe(mod, dtype, score_before_experts=score_before_experts,
                  score_func="softmax" if score_before_experts else "sigmoid")
    x = torch.randn(2, 10, 16).to(dtype)
    ref = _fwd_bwd(m, x)
    before = dict(tt.call_counts)
    assert tt.patch_moe(m) == 1 and tt.is_patched(m)
    got = _fwd_bwd(m, x)
    for op in ("moe_permute", "moe_unpermute", "grouped_gemm"):
        assert tt.call_counts[op] > before[op], op
    # the rule of ascend_moe_ops.testing: error vs the fp64 run of the same torchtitan module (same
    # weights, same routing) at most 2x the unpatched module's own error + the table's floor
    m64 = copy.deepcopy(m).double()
    tt.unpatch_moe(m64)
    r64 = _fwd_bwd(m64, x.double())
    assert torch.equal(m64.router(x.double(), m64.expert_bias)[1],
                       m.router(x, m.expert_bias)[1]), "fp64 reference routes differently"
    assert_close_to_ref(got[0], r64[0], dtype=dtype, torch_lowp=ref[0], name="output")
    assert_close_to_ref(got[1], r64[1], dtype=dtype, torch_lowp=ref[1], name="input grad")
    assert set(got[2]) == set(ref[2])
    for n in ref[2]:
        assert_close_to_ref(got[2][n], r64[2][n], dtype=dtype, torch_lowp=ref[2][n], name=f"grad {n}")
        if n.startswith("shared_experts."):  # same inputs, same code: bitwise
            assert torch.equal(got[2][n], ref[2][n]), n
    # unpatch: torchtitan's own forward again, bitwise its earlier result
    assert tt.unpatch_moe(m) == 1 and not tt.is_patched(m)
    counts = dict(tt.call_counts)
    again = _fwd_bwd(m, x)
    assert tt.call_counts == counts
    assert torch.equal(again[0], ref[0]) and torch.equal(again[1], ref[1])


def test_v022_permutation_is_torchtitans(cpu_histc):
    """The package's permute reproduces torchtitan's TokenReorderer order exactly (bitwise)."""
    import ascend_moe_ops as amo
    mod = _titan()
    m = _make_moe(mod, torch.bfloat16, score_before_experts=True)
    x = torch.randn(20, 16).to(torch.bfloat16)
    scores, idx, _ = m.router(x, m.expert_bias)
    s_sorted, tok_sorted, n_per_e = m.reorderer(scores, idx)
    for ids in (idx, idx.to(torch.int32)):
        res = amo.moe_permute(x, ids, scores, num_experts=8, num_out_tokens=idx.numel())
        assert torch.equal(res.tokens, x[tok_sorted // m.router.top_k])
        assert torch.equal(res.probs, s_sorted)
        assert torch.equal(res.group_sizes, n_per_e.to(torch.int64))


def test_v022_patch_moe_model_walk_idempotent_and_errors(cpu_histc):
    mod = _titan()
    model = torch.nn.Sequential(_make_moe(mod, torch.float32, score_before_experts=True),
                                _make_moe(mod, torch.float32, score_before_experts=False))
    assert tt.patch_moe(model) == 2
    assert tt.patch_moe(model) == 0  # idempotent
    assert all(tt.is_patched(m) for m in model)
    assert type(model[0]).forward is mod.MoE.forward  # the class is untouched
    assert tt.unpatch_moe(model) == 2 and tt.unpatch_moe(model) == 0
    with pytest.raises(ValueError, match="module: no torchtitan 0.2.2 MoE"):
        tt.patch_moe(torch.nn.Linear(2, 2))
    broken = _make_moe(mod, torch.float32, score_before_experts=True)
    del broken.reorderer
    with pytest.raises(RuntimeError, match="refusing to patch"):
        tt.patch_moe(torch.nn.Sequential(model[0], broken))
    assert not tt.is_patched(model[0])  # nothing changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_v022_converters_on_real_grouped_experts(dtype):
    mod = _titan()
    m = _make_moe(mod, dtype, score_before_experts=True)
    ex = m.experts
    mlp = tt.from_torchtitan_weights(ex.w1.detach(), ex.w2.detach(), ex.w3.detach())
    for a, b in zip(tt.to_torchtitan_weights(mlp), (ex.w1, ex.w2, ex.w3)):
        assert torch.equal(a, b)
    sizes = torch.tensor([3, 0, 4, 2, 0, 5, 1, 2])
    x = torch.randn(int(sizes.sum()), 16).to(dtype)
    with torch.no_grad():
        want = ex(x, sizes)  # torchtitan's own expert loop
        got = mlp(x, sizes)
    assert_close_to_ref(got, want, dtype=dtype, name="GroupedMLP vs torchtitan GroupedExperts")
    ex2 = mod.GroupedExperts(16, 12, 8, use_grouped_mm=False).to(dtype)
    w1, w2, w3 = tt.to_torchtitan_weights(mlp)
    with torch.no_grad():
        ex2.w1.copy_(w1), ex2.w2.copy_(w2), ex2.w3.copy_(w3)
        assert torch.equal(ex2(x, sizes), want)


def test_v022_converter_found_by_name_from_the_job_config(cpu_histc):
    """The trainer's route: --experimental.custom_import imports this module (which registers the
    converter), --model.converters names it, torchtitan's container applies it."""
    mod = _titan()
    from types import SimpleNamespace
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.model_converter import build_model_converters
    jc = ConfigManager().parse_args(["--experimental.custom_import", "ascend_moe_ops.integrations.torchtitan",
                                     "--model.converters", tt.CONVERTER_NAME])
    importlib.import_module(jc.experimental.custom_import)
    plain = SimpleNamespace(ep_enabled=False, tp_enabled=False, etp_enabled=False)
    model = torch.nn.Sequential(_make_moe(mod, torch.float32, score_before_experts=True))
    build_model_converters(jc, plain).convert(model)
    assert tt.is_patched(model[0])
    before = tt.call_counts["grouped_gemm"]
    model(torch.randn(1, 4, 16))
    assert tt.call_counts["grouped_gemm"] == before + 3
    with pytest.raises(RuntimeError, match="ep parallelism is on"):
        build_model_converters(jc, SimpleNamespace(ep_enabled=True, tp_enabled=False, etp_enabled=False))


@pytest.fixture
def gloo_world(tmp_path):
    """A one-process gloo group and a 1-D CPU mesh named as torchtitan names its FSDP dimension."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def _shard(m, mesh, experts):
    from torch.distributed.fsdp import fully_shard
    fully_shard(experts, mesh=mesh)  # torchtitan shards the experts on their own, then the block
    fully_shard(m, mesh=mesh)


def _plain_grads(grads):
    return {n: (g.full_tensor() if type(g).__name__ == "DTensor" else g) for n, g in grads.items()}


def _assert_same_run(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got_g = _plain_grads(got[2])
    for n, g in _plain_grads(want[2]).items():
        torch.testing.assert_close(got_g[n], g, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("order", ["patch_then_shard", "shard_then_patch"])
def test_v022_fsdp2_either_order(cpu_histc, gloo_world, order):
    """FSDP2 (one gloo rank): patching before or after fully_shard gives the unsharded patched
    module's output and gradients, bitwise. (The old refusal blamed EP/TP for FSDP's DTensors.)"""
    mod = _titan()
    m = _make_moe(mod, torch.float32, score_before_experts=True)
    x = torch.randn(2, 6, 16)
    ref = copy.deepcopy(m)
    tt.patch_moe(ref)
    want = _fwd_bwd(ref, x)
    if order == "patch_then_shard":
        tt.patch_moe(m)
        _shard(m, gloo_world, m.experts)
    else:
        _shard(m, gloo_world, m.experts)
        assert type(m.experts.w1).__name__ == "DTensor"
        assert tt.patch_moe(m) == 1
    before = tt.call_counts["grouped_gemm"]
    got = _fwd_bwd(m, x)
    assert tt.call_counts["grouped_gemm"] > before
    _assert_same_run(got, want)


def test_v022_sharded_weights_at_run_time_and_ep_are_refused_with_the_reason(cpu_histc, gloo_world):
    """Expert weights still sharded when the experts run (a DTensor no FSDP2 unit gathers) stop
    with the order FSDP2 needs; weights on an ``ep`` mesh dimension are refused at patch time."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.device_mesh import init_device_mesh
    mod = _titan()
    m = _make_moe(mod, torch.float32, score_before_experts=True)
    tt.patch_moe(m)
    m.experts.w1 = torch.nn.Parameter(distribute_tensor(m.experts.w1.detach(), gloo_world, [Shard(0)]))
    with pytest.raises(RuntimeError, match="still sharded DTensors when the experts run.*fully_shard"):
        m(torch.randn(1, 4, 16))
    ep = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    m2 = _make_moe(mod, torch.float32, score_before_experts=True)
    m2.experts.w2 = torch.nn.Parameter(distribute_tensor(m2.experts.w2.detach(), ep, [Shard(0)]))
    with pytest.raises(RuntimeError, match=r"mesh dimension\(s\) \['ep'\] \(expert/tensor parallelism\)"):
        tt.patch_moe(m2)
    assert not tt.is_patched(m2)


# ---------------------------------------------------------------------------------------------
# torchtitan 0.3.0: torchtitan.models.common.moe through its @override route
# ---------------------------------------------------------------------------------------------

OVERRIDE = "ascend_moe_ops.integrations.torchtitan.ascend_moe"


def _titan030():
    version = _version()
    if version != "0.3.0":
        pytest.skip(f"torchtitan {version} here; the 0.3.0 cases need torchtitan 0.3.0 (requirements.txt)")
    from torchtitan.models.common import config_utils
    return config_utils


def _moe_config_030(cu, *, score_func="softmax", E=8, H=16, F_=24, top_k=3, shared=True):
    # F_ and H multiples of 8: torch._grouped_mm (torchtitan's unpatched path) needs 16-byte strides
    return cu.make_moe_config(
        num_experts=E,
        router=cu.make_router_config(dim=H, num_experts=E, gate_param_init={}, top_k=top_k,
                                     score_func=score_func, route_norm=True, route_scale=2.0),
        routed_experts=cu.make_routed_experts_config(dim=H, hidden_dim=F_, num_experts=E, top_k=top_k,
                                                     param_init={}, comm_backend="standard"),
        shared_experts=(cu.make_ffn_config(dim=H, hidden_dim=F_, w1_param_init={}, w2w3_param_init={})
                        if shared else None))


def _overridden(cfg, name=OVERRIDE):
    from torchtitan.config import OverrideConfig, apply_overrides
    lines = apply_overrides(OverrideConfig(imports=[name]), cfg)
    assert lines, "the override claimed nothing"
    return cfg


def _moe_pair_030(cu, dtype, **kw):
    """(unpatched torchtitan MoE, the same weights built from the overridden config)."""
    torch.manual_seed(0)
    m0 = _moe_config_030(cu, **kw).build()
    with torch.no_grad():
        for p in m0.parameters():
            p.normal_(0.0, 0.3)
        m0.expert_bias_E.normal_(0.0, 0.05)
    m1 = _overridden(_moe_config_030(cu, **kw)).build()
    m1.load_state_dict(m0.state_dict())
    return m0.to(dtype), m1.to(dtype)


def _fp64_experts_loop(ex):
    """The expert math written out in fp64 (torchtitan 0.3.0 runs its experts in bf16)."""
    def forward(x, sizes):
        outs, start = [], 0
        for e, n in enumerate(sizes.tolist()):
            xe = x[start:start + n]
            h = F.silu(xe @ ex.w1_EFD[e].T) * (xe @ ex.w3_EFD[e].T)
            outs.append(h @ ex.w2_EDF[e].T)
            start += n
        return torch.cat(outs)
    return forward


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_v030_override_matches_unpatched(dtype, score_func):
    cu = _titan030()
    m0, m1 = _moe_pair_030(cu, dtype, score_func=score_func)
    assert type(m1.routed_experts.inner_experts).__name__ == "AscendGroupedExperts"
    assert type(m1.routed_experts.token_dispatcher).__name__ == "AscendTokenDispatcher"
    assert isinstance(m1.routed_experts.inner_experts, type(m0.routed_experts.inner_experts))
    x = torch.randn(2, 10, 16).to(dtype)
    ref = _fwd_bwd(m0, x)
    before = dict(tt.call_counts)
    got = _fwd_bwd(m1, x)
    assert tt.call_counts["moe_permute"] == before["moe_permute"] + 1
    assert tt.call_counts["moe_unpermute"] == before["moe_unpermute"] + 1
    assert tt.call_counts["grouped_gemm"] == before["grouped_gemm"] + 3
    m64 = copy.deepcopy(m0).double()
    m64.routed_experts.inner_experts.forward = _fp64_experts_loop(m64.routed_experts.inner_experts)
    r64 = _fwd_bwd(m64, x.double())
    assert torch.equal(m64.router(x.double(), m64.expert_bias_E)[1], m0.router(x, m0.expert_bias_E)[1]), \
        "fp64 reference routes differently"
    # the experts run in bf16 in both (torchtitan casts): bf16's row of the tolerance table
    assert_close_to_ref(got[0], r64[0], dtype=torch.bfloat16, torch_lowp=ref[0], name="output")
    assert_close_to_ref(got[1], r64[1], dtype=torch.bfloat16, torch_lowp=ref[1], name="input grad")
    assert set(got[2]) == set(ref[2])
    for n in ref[2]:
        assert_close_to_ref(got[2][n], r64[2][n], dtype=torch.bfloat16, torch_lowp=ref[2][n], name=f"grad {n}")
    assert torch.equal(m1.tokens_per_expert_E, m0.tokens_per_expert_E)  # the aux-loss-free counts


def test_v030_patch_moe_on_a_built_model_and_unpatch():
    cu = _titan030()
    m0, _ = _moe_pair_030(cu, torch.float32)
    model = torch.nn.Sequential(m0, copy.deepcopy(m0))
    x = torch.randn(2, 10, 16)
    ref = _fwd_bwd(model, x)
    assert tt.patch_moe(model) == 2 and tt.patch_moe(model) == 0
    before = dict(tt.call_counts)
    got = _fwd_bwd(model, x)
    assert tt.call_counts["grouped_gemm"] == before["grouped_gemm"] + 6
    assert tt.call_counts["moe_permute"] == before["moe_permute"] + 2
    assert_close_to_ref(got[0], ref[0].double(), dtype=torch.bfloat16, name="output vs unpatched")
    assert tt.unpatch_moe(model) == 2 and not tt.is_patched(model[0])
    counts = dict(tt.call_counts)
    again = _fwd_bwd(model, x)
    assert tt.call_counts == counts
    assert torch.equal(again[0], ref[0]) and torch.equal(again[1], ref[1])
    with pytest.raises(ValueError, match="module: no torchtitan 0.3.0 MoE"):
        tt.patch_moe(torch.nn.Linear(2, 2))


def test_v030_override_found_by_name_from_the_cli_config():
    """What ``python -m torchtitan.train --module deepseek_v3 --config deepseek_v3_debugmodel
    --override.imports ascend_moe_ops.integrations.torchtitan.ascend_moe`` does before building:
    parse, import the named override, apply it to every MoE layer of the model config."""
    _titan030()
    from torchtitan.config import ConfigManager, OverrideConfig, apply_overrides
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher
    cfg = ConfigManager().parse_args(["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
                                      "--override.imports", OVERRIDE])
    assert cfg.override.imports == [OVERRIDE]
    cfg2 = copy.deepcopy(cfg)
    lines = apply_overrides(cfg.override, cfg)
    moes = list(cfg.model_spec.model.traverse(MoE.Config))
    assert moes and len(lines) == len(moes), lines

    def kinds(c, cls):
        return [type(n).__qualname__ for _, n, _, _ in c.model_spec.model.traverse(cls)]
    assert kinds(cfg, GroupedExperts.Config) == ["AscendGroupedExperts.Config"] * len(moes)
    assert kinds(cfg, LocalTokenDispatcher.Config) == ["AscendTokenDispatcher.Config"] * len(moes)
    # the experts-only override keeps torchtitan's dispatcher
    apply_overrides(OverrideConfig(imports=["ascend_moe_ops.integrations.torchtitan.ascend_grouped_mm"]), cfg2)
    assert kinds(cfg2, GroupedExperts.Config) == ["AscendGroupedExperts.Config"] * len(moes)
    assert kinds(cfg2, LocalTokenDispatcher.Config) == ["AllToAllTokenDispatcher.Config"] * len(moes)
    # a model built from the overridden config holds the package's modules
    model_cfg = cfg.model_spec.model
    model_cfg.layers = model_cfg.layers[:2]
    with torch.device("meta"):
        model = model_cfg.build()
    moe = [m for m in model.modules() if isinstance(m, MoE)][0]
    assert type(moe.routed_experts.inner_experts).__name__ == "AscendGroupedExperts"


def test_v030_training_loss_equals_unpatched():
    """A small LM of torchtitan's modules (embedding -> its MoE -> head), AdamW, 6 steps: the
    loss curve with the override applied equals the unpatched one within bf16's tolerance (the
    experts run in bf16), and it falls."""
    cu = _titan030()
    from ascend_moe_ops.testing import TOLERANCES

    def lm(moe):
        torch.manual_seed(1)
        emb, head = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64)
        return torch.nn.ModuleDict(dict(emb=emb, moe=moe, head=head))

    m0, m1 = _moe_pair_030(cu, torch.float32)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 64, (4, 17), generator=g)
    curves = []
    for moe in (m0, m1):
        model = lm(moe)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(6):
            h = model["emb"](tokens[:, :-1])
            logits = model["head"](h + model["moe"](h))
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(torch.tensor(losses, dtype=torch.float64))
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(curves[1], curves[0], atol=atol, rtol=rtol)
    assert curves[1][-1] < curves[1][0]


@pytest.mark.parametrize("order", ["override_then_shard", "shard_then_patch"])
def test_v030_fsdp2_either_order(gloo_world, order):
    cu = _titan030()
    m0, m1 = _moe_pair_030(cu, torch.float32)
    x = torch.randn(2, 6, 16)
    want = _fwd_bwd(copy.deepcopy(m1), x)
    m = m1 if order == "override_then_shard" else m0
    _shard(m, gloo_world, m.routed_experts)
    if order == "shard_then_patch":
        assert type(m.routed_experts.inner_experts.w1_EFD).__name__ == "DTensor"
        assert tt.patch_moe(m) == 1
    before = tt.call_counts["grouped_gemm"]
    got = _fwd_bwd(m, x)
    assert tt.call_counts["grouped_gemm"] == before + 3
    _assert_same_run(got, want)


# ---------------------------------------------------------------------------------------------
# Either release
# ---------------------------------------------------------------------------------------------

def test_unsupported_version_is_named_with_what_to_install(monkeypatch):
    version = _version()
    import torchtitan
    monkeypatch.setattr(torchtitan, "__version__", "0.1.0")
    with pytest.raises(RuntimeError, match=r"torchtitan 0\.1\.0 is installed.*pip install torchtitan==0\.3\.0"):
        tt.patch_moe(torch.nn.Linear(2, 2))
    monkeypatch.setattr(tt, "_REGISTERED", [])
    with pytest.raises(RuntimeError, match=r"supports torchtitan 0\.3\.0 and 0\.2\.2 only"):
        tt.register()
    trainer = sys.modules.get("torchtitan.trainer", torchtitan)
    for name in ("torchtitan.train", "torchtitan.trainer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    tt._register_on_import()  # imported by a user's script: the refusal waits for the first call
    monkeypatch.setitem(sys.modules, "torchtitan.trainer", trainer)
    with pytest.raises(RuntimeError, match=r"torchtitan 0\.1\.0 is installed"):
        tt._register_on_import()  # imported by torchtitan's trainer (--override.imports): at once
    monkeypatch.setattr(torchtitan, "__version__", version)
    assert tt.register() == version


def _dir022():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return here, os.environ.get("ASCEND_MOE_OPS_TORCHTITAN_022") or os.path.join(here, ".torchtitan-0.2.2")


def test_v022_cases_in_their_own_process():
    """The 0.2.2 cases of this file, in a child pytest with torchtitan 0.2.2 first on the path."""
    if _version() == "0.2.2":
        pytest.skip("torchtitan 0.2.2 is the importable one: its cases ran in this process")
    root, target = _dir022()
    if not os.path.isdir(os.path.join(target, "torchtitan")):
        msg = (f"no torchtitan 0.2.2 install in {target}: the README's test command makes it "
               f"(pip install --no-deps --target .torchtitan-0.2.2 torchtitan==0.2.2)")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([target, root]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           os.path.abspath(__file__), "-k", "(v022 and not own_process) or unsupported_version"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    last = proc.stdout.strip().splitlines()[-1]
    m = re.search(r"(\d+) passed", last)
    # the 12 v022 cases and the version refusal, none skipped
    assert m and int(m.group(1)) >= 13 and "skipped" not in last, tail


def test_helpers_name_a_wrong_argument_type():
    """patch_moe(None) / unpatch_moe(None) and the weight helpers given a non-GroupedMLP or integer
    weights raised AttributeError or torch's requires-grad error."""
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        tt.patch_moe(None)
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        tt.unpatch_moe(None)
    with pytest.raises(TypeError, match="mlp must be an ascend_moe_ops.nn.GroupedMLP"):
        tt.to_torchtitan_weights(torch.nn.Linear(2, 2))
    w = torch.ones(2, 3, 4, dtype=torch.int64)
    with pytest.raises(TypeError, match="w1 must be a floating-point tensor"):
        tt.from_torchtitan_weights(w, torch.ones(2, 4, 3, dtype=torch.int64), w)
