"""ascend_moe_ops.nn: GroupedMLP / MoELayer vs a per-expert loop of dense MLPs (fp64), Megatron
parameter layout round trips, capacity mode, and a toy training run whose loss goes down."""

import pytest
import torch
import torch.nn.functional as F

import contextlib

from ascend_moe_ops import _backends
from ascend_moe_ops.nn import GroupedMLP, MoELayer
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
    layer16 = MoELayer(24, 6, 16, 2, init_std=0.2, dtype=torch.float16)
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
