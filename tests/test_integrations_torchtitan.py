"""ascend_moe_ops.integrations.torchtitan: weight converters (torchtitan w1/w2/w3 <-> GroupedMLP).

The first tests check the converters against the expert math written out; the ones below run the
real torchtitan ``MoE`` module (torchtitan 0.2.2, pinned in requirements.txt) on the CPU, patched
with ``patch_moe`` vs unpatched. They skip only if torchtitan is not importable.
"""

import copy
import importlib

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
# The real torchtitan MoE module
# ---------------------------------------------------------------------------------------------

def _titan():
    try:
        return importlib.import_module("torchtitan.models.moe.moe")
    except Exception as exc:
        pytest.skip(f"torchtitan is not importable here: {type(exc).__name__}: {exc}")


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
def test_real_moe_patched_matches_unpatched(cpu_histc, dtype, score_before_experts):
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


def test_real_moe_permutation_is_torchtitans(cpu_histc):
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


def test_patch_moe_model_walk_idempotent_and_errors(cpu_histc):
    mod = _titan()
    model = torch.nn.Sequential(_make_moe(mod, torch.float32, score_before_experts=True),
                                _make_moe(mod, torch.float32, score_before_experts=False))
    assert tt.patch_moe(model) == 2
    assert tt.patch_moe(model) == 0  # idempotent
    assert all(tt.is_patched(m) for m in model)
    assert type(model[0]).forward is mod.MoE.forward  # the class is untouched
    assert tt.unpatch_moe(model) == 2 and tt.unpatch_moe(model) == 0
    with pytest.raises(ValueError, match="module: no torchtitan MoE"):
        tt.patch_moe(torch.nn.Linear(2, 2))
    broken = _make_moe(mod, torch.float32, score_before_experts=True)
    del broken.reorderer
    with pytest.raises(RuntimeError, match="refusing to patch"):
        tt.patch_moe(torch.nn.Sequential(model[0], broken))
    assert not tt.is_patched(model[0])  # nothing changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_converters_on_real_grouped_experts(dtype):
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
