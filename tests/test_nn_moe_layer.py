"""ascend_moe_ops.nn: GroupedMLP / MoELayer vs a per-expert loop of dense MLPs (fp64), Megatron
parameter layout round trips, capacity mode, and a toy training run whose loss goes down."""

import re

import pytest
import torch
import torch.nn.functional as F

import contextlib

from ascend_moe_ops import _backends
from ascend_moe_ops.nn import GroupedMLP, MoELayer, SharedExpertMLP
from ascend_moe_ops.testing import assert_close_to_ref
from conftest import backends


@contextlib.contextmanager
def gg_backend(name):
    """Force ``name`` for the grouped GEMM ops only (permute/unpermute keep their default)."""
    with _backends.use_backend(name, ops=("grouped_gemm", "grouped_gemm_dw")):
        yield


def dense_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Megatron-style sequential experts: every routed (token, expert) pair through a dense MLP."""
    ids, probs, _ = layer.router(x)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        fc1, fc2 = layer.experts.w1()[e], layer.experts.w2()[e]  # [H, 2F], [F, H] (differentiable)
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = x[tok] @ fc1
        gate, up = h.chunk(2, -1)
        y = (F.silu(gate) * up) @ fc2
        out = out.index_add(0, tok, y * probs[tok, slot].to(x.dtype).unsqueeze(1))
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


def _grads(module, fn, x):
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = fn(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
@pytest.mark.parametrize("score_func, shared", [("softmax", None), ("sigmoid", 24)])
def test_moe_layer_matches_dense_loop_fp64(backend, score_func, shared):
    if backend == "triton":
        pytest.skip("the triton backend has no fp64 tl.dot; covered by the fp32 test")
    if backend == "ascendc-emu":
        pytest.skip("the Ascend Cube path takes fp16/bf16 only; covered by the fp16 test")
    torch.manual_seed(0)
    T, H, E, Fh, K = 40, 32, 8, 24, 3
    layer = MoELayer(H, E, Fh, K, score_func=score_func, shared_expert_ffn_hidden_size=shared,
                     dtype=torch.float64, init_std=0.2)
    x = torch.randn(T, H, dtype=torch.float64)
    with gg_backend(backend):
        y, gx, gp = _grads(layer, layer, x)
    ry, rgx, rgp = _grads(layer, lambda t: dense_moe(layer, t), x)
    # moe_unpermute accumulates in fp32 (its contract), so fp64 agreement is to ~1e-6
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-6)
    assert gp.keys() == rgp.keys()
    for n in gp:
        torch.testing.assert_close(gp[n], rgp[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {n}: {m}")


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_moe_layer_fp32_backends_agree(backend):
    if backend == "ascendc-emu":
        pytest.skip("the Ascend Cube path takes fp16/bf16 only; covered by the fp16 test")
    torch.manual_seed(1)
    layer = MoELayer(24, 6, 16, 2, init_std=0.2)
    x = torch.randn(2, 9, 24)
    with gg_backend(backend):
        y, gx, gp = _grads(layer, layer, x)
    with gg_backend("reference"):
        ry, rgx, rgp = _grads(layer, layer, x)
    assert y.shape == x.shape
    torch.testing.assert_close(y, ry, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, rgx, rtol=1e-4, atol=1e-5)
    for n in gp:
        torch.testing.assert_close(gp[n], rgp[n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_moe_layer_fp16_matches_fp64(backend):
    """Every backend (the Ascend Cube kernel included) in fp16 vs the fp64 layer, with the
    2x-PyTorch rule: the reference backend in fp16 is 'the same math done by PyTorch'."""
    torch.manual_seed(3)
    layer64 = MoELayer(24, 6, 16, 2, init_std=0.2, dtype=torch.float64)
    # an fp32 gate, as the fp64 oracle routes (the fp16 default gate could pick other experts)
    layer16 = MoELayer(24, 6, 16, 2, init_std=0.2, dtype=torch.float16, router_dtype=torch.float32)
    layer16.load_state_dict(layer64.state_dict())
    x = torch.randn(18, 24, dtype=torch.float64)
    with gg_backend(backend):
        y, gx, _ = _grads(layer16, layer16, x.half())
    with gg_backend("reference"):
        ly, lgx, _ = _grads(layer16, layer16, x.half())
    ry, rgx, _ = _grads(layer64, lambda t: dense_moe(layer64, t), x)
    assert_close_to_ref(y, ry, dtype=torch.float16, torch_lowp=ly, name="output")
    assert_close_to_ref(gx, rgx, dtype=torch.float16, torch_lowp=lgx, name="grad x")


def test_capacity_mode():
    torch.manual_seed(2)
    T, H, E, K = 32, 16, 4, 2
    x = torch.randn(T, H)
    big = MoELayer(H, E, 8, K, capacity_factor=float(E))  # capacity >= every load: no drops
    y_big = big(x)
    dropless = MoELayer(H, E, 8, K)
    dropless.load_state_dict(big.state_dict())
    torch.testing.assert_close(y_big, dropless(x))
    tight = MoELayer(H, E, 8, K, capacity_factor=0.5)
    tight.load_state_dict(big.state_dict())
    y_tight = tight(x)
    assert tight.capacity(T) == 8 and int(tight.tokens_per_expert.max()) <= 8
    assert not torch.allclose(y_tight, y_big)
    y_tight.sum().backward()
    assert torch.isfinite(tight.experts.weight1.grad).all()


def test_grouped_mlp_megatron_layout_round_trip():
    torch.manual_seed(3)
    E, H, Fh = 3, 10, 6
    fc1 = [torch.randn(2 * Fh, H) for _ in range(E)]
    fc2 = [torch.randn(H, Fh) for _ in range(E)]
    mlp = GroupedMLP.from_expert_weights(fc1, fc2)
    assert mlp.weight1.shape == (H, E * 2 * Fh) and mlp.weight2.shape == (E * Fh, H)
    for e in range(E):
        a, b = mlp.expert_weights(e)
        assert torch.equal(a, fc1[e]) and torch.equal(b, fc2[e])
    # forward equals the per-expert nn.Linear computation
    sizes = torch.tensor([4, 0, 5])
    x = torch.randn(11, H)
    out = mlp(x, sizes)
    start = 0
    for e, n in enumerate(sizes.tolist()):
        h = F.linear(x[start:start + n], fc1[e])
        want = F.linear(F.silu(h[:, :Fh]) * h[:, Fh:], fc2[e])
        torch.testing.assert_close(out[start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n
    assert (out[9:] == 0).all()
    sd = mlp.state_dict()
    assert set(sd) == {"weight1", "weight2"}


def test_training_lowers_loss():
    """A few Adam steps on a toy regression task (teacher: a random MoE layer)."""
    torch.manual_seed(4)
    T, H, E, Fh, K = 128, 16, 4, 32, 2
    teacher = MoELayer(H, E, Fh, K, init_std=0.3, shared_expert_ffn_hidden_size=16)
    student = MoELayer(H, E, Fh, K, init_std=0.3, shared_expert_ffn_hidden_size=16)
    x = torch.randn(T, H)
    with torch.no_grad():
        target = teacher(x)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = F.mse_loss(student(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_router_validation():
    with pytest.raises(ValueError, match="score_func"):
        MoELayer(8, 4, 8, 2, score_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(8, 4, 8, 5)


@pytest.mark.parametrize("options", [{}, {"recompute_permute": True}])
def test_wrong_hidden_size_names_x(options):
    """An input of the wrong hidden size was a reshape or matmul error ("shape '[-1, 8]' is
    invalid", "mat1 and mat2 shapes cannot be multiplied"); now a ValueError naming x and the
    hidden size, from a shape check only (the layer still compiles with fullgraph)."""
    from ascend_moe_ops.nn import TopKRouter
    layer = MoELayer(8, 4, 6, 2, **options)
    with pytest.raises(ValueError, match=r"^MoELayer: x must have the hidden size 8 in its last "
                                         r"dimension, got shape \(5, 7\)"):
        layer(torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"^MoELayer: x must have the hidden size 8.*got shape \(\)"):
        layer(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"^TopKRouter: x must have the hidden size 8 in its last "
                                         r"dimension, got shape \(3, 7\)"):
        TopKRouter(8, 4, 2)(torch.randn(3, 7))
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    if not options:
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, backend="eager")
        assert compiled(torch.randn(5, 8)).shape == (5, 8)


def test_router_and_layer_refuse_an_integer_x():
    """TopKRouter alone ran its gate in int64 on an integer x: the weights (~0.02) truncated to 0
    and the scores came out uniform, with no error. Now a TypeError naming x (MoELayer too)."""
    from ascend_moe_ops.nn import TopKRouter
    torch.manual_seed(0)
    r = TopKRouter(4, 4, 2)
    for dt in (torch.int64, torch.int32, torch.bool):
        with pytest.raises(TypeError, match=r"^TopKRouter: x must have a floating-point dtype, got torch\."):
            r(torch.tensor([[3, -1, 2, 5]]).to(dt))
    with pytest.raises(TypeError, match=r"^MoELayer: x must have a floating-point dtype"):
        MoELayer(4, 4, 6, 2)(torch.tensor([[3, -1, 2, 5]]))
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        assert r(torch.tensor([[3.0, -1.0, 2.0, 5.0]], dtype=dt))[2].dtype == torch.float32


# ---------------------------------------------------------------- router options (torchtitan / DeepSeek-V3)
def test_router_dtype_default_is_the_input_dtype():
    torch.manual_seed(5)
    T, H, E, K = 256, 64, 16, 4
    layer = MoELayer(H, E, 16, K, dtype=torch.bfloat16, init_std=0.2)
    x = torch.randn(T, H).bfloat16()
    ids, probs, scores = layer.router(x)
    logits = F.linear(x, layer.router.weight).float()  # a bf16 gate, as torchtitan's
    torch.testing.assert_close(scores, logits.softmax(-1), rtol=0, atol=0)
    fp32 = MoELayer(H, E, 16, K, dtype=torch.bfloat16, init_std=0.2, router_dtype=torch.float32)
    fp32.load_state_dict(layer.state_dict())
    _, _, s32 = fp32.router(x)
    torch.testing.assert_close(s32, F.linear(x.float(), layer.router.weight.float()).softmax(-1), rtol=0, atol=0)
    assert probs.dtype == torch.float32 and ids.dtype == torch.int64
    with pytest.raises(ValueError, match="router_dtype must be None"):
        MoELayer(H, E, 16, K, router_dtype=torch.int32)


def test_route_scale_and_route_norm():
    torch.manual_seed(6)
    layer = MoELayer(16, 8, 8, 3, score_func="sigmoid", route_norm=False, route_scale=2.5, init_std=0.3)
    assert layer.router.route_norm is False and layer.router.norm_topk_prob is False
    x = torch.randn(10, 16)
    ids, probs, scores = layer.router(x)
    torch.testing.assert_close(probs, scores.gather(1, ids) * 2.5)
    normed = MoELayer(16, 8, 8, 3, score_func="sigmoid", route_norm=True, route_scale=2.5, init_std=0.3)
    normed.load_state_dict(layer.state_dict())
    _, p2, _ = normed.router(x)
    torch.testing.assert_close(p2.sum(-1), torch.full((10,), 2.5))
    with pytest.raises(ValueError, match="route_norm=True and norm_topk_prob=False disagree"):
        MoELayer(16, 8, 8, 3, route_norm=True, norm_topk_prob=False)
    with pytest.raises(ValueError, match="route_scale must be a finite number"):
        MoELayer(16, 8, 8, 3, route_scale=float("nan"))


def test_expert_bias_selects_only_and_update_rule():
    torch.manual_seed(7)
    T, H, E, K = 64, 16, 8, 2
    layer = MoELayer(H, E, 8, K, score_func="sigmoid", expert_bias=True, init_std=0.3)
    x = torch.randn(T, H)
    bias = torch.zeros(E)
    bias[3] = 10.0  # expert 3 always selected; its prob stays its unbiased score
    layer.router.expert_bias.copy_(bias)
    ids, probs, scores = layer.router(x)
    assert (ids == 3).any(1).all()
    torch.testing.assert_close(probs, (scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True)))
    # the load accumulates over (training) forwards; the update is sign(mean - load) * rate
    layer.router.expert_bias.zero_()
    layer.router.tokens_per_expert.zero_()
    layer(x)
    layer(x)
    load = layer.router.tokens_per_expert.clone()
    assert load.sum() == 2 * T * K
    new = layer.update_expert_bias(rate=0.01)
    torch.testing.assert_close(new, 0.01 * torch.sign(load.mean() - load))
    assert layer.router.tokens_per_expert.sum() == 0  # reset after the update
    assert "router.expert_bias" in layer.state_dict()
    with pytest.raises(RuntimeError, match="expert_bias=True"):
        MoELayer(H, E, 8, K).update_expert_bias()
    with pytest.raises(ValueError, match="tokens_per_expert must have shape"):
        layer.update_expert_bias(tokens_per_expert=torch.ones(3))


@pytest.mark.parametrize("cast", ["bfloat16", "half", "double", "to_bf16"])
def test_balancing_buffers_stay_fp32_under_a_module_cast(cast):
    """expert_bias and tokens_per_expert are fp32 buffers (the docs): .bfloat16() / .half() / .double()
    / .to(dtype) cast the weights only. In bf16 the counts stopped being exact past 256 tokens (3 x 1000
    counted 3008) and a 1e-3 bias step vanished next to a bias of 1."""
    layer = MoELayer(4, 2, 4, 1, expert_bias=True)
    layer = layer.to(torch.bfloat16) if cast == "to_bf16" else getattr(layer, cast)()
    r = layer.router
    assert r.expert_bias.dtype == r.tokens_per_expert.dtype == torch.float32
    assert r.weight.dtype == {"bfloat16": torch.bfloat16, "half": torch.float16, "double": torch.float64,
                              "to_bf16": torch.bfloat16}[cast]
    for _ in range(3):
        layer(torch.randn(1000, 4, dtype=r.weight.dtype))
    assert r.tokens_per_expert.sum().item() == 3000
    r.expert_bias.fill_(1.0)
    layer.update_expert_bias(rate=1e-3, tokens_per_expert=torch.tensor([10.0, 0.0]))
    torch.testing.assert_close(r.expert_bias, torch.tensor([1.0 - 1e-3, 1.0 + 1e-3]))
    assert layer.state_dict()["router.expert_bias"].dtype == torch.float32


def dense_moe_scaled_first(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """score_before_experts oracle: every routed token scaled by its prob, then its expert MLP."""
    ids, probs, _ = layer.router(x)
    out = torch.zeros_like(x)
    for e in range(layer.num_experts):
        fc1, fc2 = layer.experts.w1()[e], layer.experts.w2()[e]
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = (x[tok] * probs[tok, slot].to(x.dtype).unsqueeze(1)) @ fc1
        gate, up = h.chunk(2, -1)
        out = out.index_add(0, tok, (F.silu(gate) * up) @ fc2)
    return out


def test_score_before_experts_matches_dense_loop_fp64():
    torch.manual_seed(8)
    layer = MoELayer(24, 6, 16, 3, score_func="sigmoid", score_before_experts=True, init_std=0.2,
                     dtype=torch.float64)
    x = torch.randn(30, 24, dtype=torch.float64)
    y, gx, gp = _grads(layer, layer, x)
    ry, rgx, rgp = _grads(layer, lambda t: dense_moe_scaled_first(layer, t), x)
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, rgx, rtol=1e-5, atol=1e-6)
    for n in gp:
        torch.testing.assert_close(gp[n], rgp[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"grad {n}: {m}")


# ---------------------------------------------------------------- memory options
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("score_before", [False, True], ids=["probs_in_combine", "score_before_experts"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75], ids=["dropless", "capacity"])
@pytest.mark.parametrize("options", [dict(recompute_permute=True), dict(recompute_activation=True),
                                     dict(recompute_permute=True, recompute_activation=True)],
                         ids=["permute", "activation", "both"])
def test_recompute_is_bitwise_equal(dtype, score_before, capacity_factor, options):
    """Recomputing rebuilds the same bits, so outputs and every gradient are bitwise equal."""
    torch.manual_seed(9)
    kw = dict(score_before_experts=score_before, capacity_factor=capacity_factor, init_std=0.2, dtype=dtype)
    plain = MoELayer(32, 8, 16, 3, **kw)
    rec = MoELayer(32, 8, 16, 3, **kw, **options)
    rec.load_state_dict(plain.state_dict())
    x = torch.randn(2, 21, 32).to(dtype)
    y, gx, gp = _grads(plain, plain, x)
    ry, rgx, rgp = _grads(rec, rec, x)
    assert torch.equal(y, ry) and torch.equal(gx, rgx)
    assert gp.keys() == rgp.keys()
    for n in gp:
        assert torch.equal(gp[n], rgp[n]), f"grad {n} differs"


def test_recompute_permute_saves_at_most_0_7x():
    from ascend_moe_ops.benchmark.suite import bench_moe_layer as bench
    mem = bench.memory_rows(dict(T=256, H=256, E=16, K=8, F=64))  # the benchmark shape scaled down
    assert mem["recompute_permute"] <= 0.7 * mem["none"], mem
    assert mem["recompute_activation"] < mem["none"], mem
    assert mem["recompute_permute + recompute_activation"] < mem["recompute_permute"], mem
    assert mem["score_before_experts + recompute_permute"] <= 0.7 * mem["score_before_experts"], mem


def test_offload_is_a_noop_with_a_warning_on_cpu():
    torch.manual_seed(10)
    plain = MoELayer(16, 4, 8, 2, init_std=0.2)
    off = MoELayer(16, 4, 8, 2, init_std=0.2, offload_activations=True)
    off.load_state_dict(plain.state_dict())
    x = torch.randn(12, 16)
    with pytest.warns(RuntimeWarning, match="offload_activations=True\\) on the CPU"):
        y = off(x)
    assert torch.equal(y, plain(x))


@pytest.mark.parametrize("bad, err", [(dict(top_k=True), TypeError), (dict(top_k=0), ValueError),
                                      (dict(hidden_size=0), ValueError), (dict(num_experts=2.0), TypeError),
                                      (dict(ffn_hidden_size=-1), ValueError)])
def test_sizes_are_ints_named_in_the_error(bad, err):
    """hidden_size, num_experts, ffn_hidden_size and top_k are positive ints (a bool is not taken as
    1; a negative size is not left to the parameter allocation's message)."""
    kw = dict(hidden_size=8, num_experts=4, ffn_hidden_size=6, top_k=2)
    kw.update(bad)
    (name,) = bad
    with pytest.raises(err, match=name):
        MoELayer(**kw)
    if name != "ffn_hidden_size":
        from ascend_moe_ops.nn import TopKRouter
        with pytest.raises(err, match=name):
            TopKRouter(kw["hidden_size"], kw["num_experts"], kw["top_k"])


@pytest.mark.parametrize("make, err, name", [
    (lambda: GroupedMLP(-1, 4, 4), ValueError, "num_experts"),
    (lambda: GroupedMLP(2.5, 4, 4), TypeError, "num_experts"),
    (lambda: GroupedMLP(2, 4, 0), ValueError, "ffn_hidden_size"),
    (lambda: GroupedMLP(2, 0, 4), ValueError, "hidden_size"),
    (lambda: GroupedMLP(2, 4, 4, num_layers=0), ValueError, "num_layers"),
    (lambda: GroupedMLP(2, 4, 4, init_std=float("nan")), ValueError, "init_std"),
    (lambda: MoELayer(4, 4, 4, 2, shared_expert_ffn_hidden_size=-3), ValueError, "shared_expert_ffn_hidden_size"),
    (lambda: MoELayer(4, 4, 4, 2, init_std=-1.0), ValueError, "init_std"),
    (lambda: SharedExpertMLP(4, 0), ValueError, "shared_expert_ffn_hidden_size"),
])
def test_module_constructors_name_the_bad_argument(make, err, name):
    """Every module constructor checks its sizes and init_std (they reached torch.empty / normal_,
    whose messages name no argument; GroupedMLP took ffn_hidden_size=0, which MoELayer refuses)."""
    with pytest.raises(err, match=name):
        make()
    assert GroupedMLP(0, 4, 4).weight1.shape == (4, 0)  # an EP rank that owns no expert
    assert MoELayer(4, 4, 4, 2, shared_expert_ffn_hidden_size=0).shared_experts is None


def test_layer_flags_capacity_and_input_dtype_are_checked():
    """Flags are bools ("no" was taken as True), capacity_factor is refused at construction (not at
    the first forward), and an input in another dtype than the layer's names x (the grouped GEMM's
    message named its weight)."""
    with pytest.raises(TypeError, match="score_before_experts must be a bool"):
        MoELayer(8, 6, 5, 2, score_before_experts="no")
    with pytest.raises(TypeError, match="recompute_permute must be a bool"):
        MoELayer(8, 6, 5, 2, recompute_permute=1)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="capacity_factor must be a finite number > 0"):
            MoELayer(8, 6, 5, 2, capacity_factor=bad)
    with pytest.raises(TypeError, match="MoELayer: x must have the layer's dtype torch.float32"):
        MoELayer(8, 6, 5, 2)(torch.randn(3, 8, dtype=torch.float64))


def test_copy_after_a_training_forward_and_bad_expert_weights():
    """copy.deepcopy after a forward with grad (an EMA or "best model" copy) works: the last call's scores
    are transient; per-expert weight lists are checked with the argument and expert named."""
    import copy
    torch.manual_seed(0)
    layer = MoELayer(6, 4, 5, 2)
    layer(torch.randn(3, 6)).sum().backward()
    c = copy.deepcopy(layer)
    assert c.scores is None and layer.scores is not None
    x = torch.randn(3, 6)
    assert torch.equal(c(x), layer(x))
    with pytest.raises(ValueError, match=re.escape("fc1[1] must have shape (10, 6)")):
        GroupedMLP.from_expert_weights([torch.randn(10, 6), torch.randn(8, 6)], [torch.randn(6, 5)] * 2)
    with pytest.raises(ValueError, match="needs at least one expert"):
        GroupedMLP.from_expert_weights([], [])
    with pytest.raises(ValueError, match=re.escape("fc2[0] must have shape (6, 5)")):
        GroupedMLP.from_expert_weights([torch.randn(10, 6)], [torch.randn(6, 4)])
