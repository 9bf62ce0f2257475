"""AscendC backend on a real Ascend NPU (marker ``npu``: skipped where torch_npu is not installed;
the conftest adds the skip). On an NPU machine build the backend first (docs/ascend.md), then run
``python -m pytest -m npu tests/test_ascend_npu.py``. Everything here is UNVERIFIED until run there.

The one test without the marker checks that the package imports and reports the NPU backend's
status cleanly on a machine without torch_npu (this one runs in CI).
"""

import importlib.util

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _npu
from ascend_moe_ops.testing import assert_close_to_ref
from test_moe_permute import _inputs

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(48, 768, 256, 8), (33, 97, 7, 3), (1, 97, 7, 1), (256, 7168, 256, 8)]
MODES = [dict(), dict(capacity=3), dict(align=16)]


def test_package_works_without_torch_npu():
    st = _npu.status()
    if importlib.util.find_spec("torch_npu") is None:
        assert st == "not loaded: torch_npu is not installed"
    assert st.startswith(("loaded", "not loaded"))


def _device():
    if not _npu.status().startswith("loaded"):
        pytest.skip(f"AscendC backend: {_npu.status()}")
    import torch_npu  # noqa: F401
    return torch.device("npu:0")


@pytest.mark.npu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}xH{}xE{}xK{}".format(*s))
@pytest.mark.parametrize("mode", MODES, ids=["dropless", "capacity", "align"])
def test_npu_permute_unpermute_match_reference(dtype, shape, mode):
    dev = _device()
    T, H, E, K = shape
    tokens, routing, probs = _inputs(T, H, E, K, "index", dtype)
    with amo.use_backend("reference"):
        ref = amo.moe_permute(tokens, routing, probs, num_experts=E, **mode)
        back_ref = amo.moe_unpermute(ref.tokens, ref.row_id_map, probs)
    res = amo.moe_permute(tokens.to(dev), routing.to(dev), probs.to(dev), num_experts=E, **mode)
    for a, b in zip(res, ref):
        assert torch.equal(a.cpu(), b)
    back = amo.moe_unpermute(res.tokens, res.row_id_map, probs.to(dev))
    back64 = amo.moe_unpermute(ref.tokens.double(), ref.row_id_map, probs.double())
    assert_close_to_ref(back.cpu(), back64, dtype=dtype, torch_lowp=back_ref)
    assert torch.equal(back, amo.moe_unpermute(res.tokens, res.row_id_map, probs.to(dev))), "deterministic"


@pytest.mark.npu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_npu_backward_matches_reference(dtype):
    dev = _device()
    T, H, E, K = 29, 200, 6, 3
    tokens, routing, probs = _inputs(T, H, E, K, "index", dtype)
    g = torch.randn(T, H).to(dtype)

    def grads(device, x, p, gout):
        x = x.to(device).clone().requires_grad_()
        p = p.to(device).clone().requires_grad_()
        r = amo.moe_permute(x, routing.to(device), p, num_experts=E, align=4)
        amo.moe_unpermute(r.tokens, r.row_id_map, p).backward(gout.to(device))
        return x.grad.cpu(), p.grad.cpu()

    gx, gp = grads(dev, tokens, probs, g)
    with amo.use_backend("reference"):
        rx, rp = grads("cpu", tokens.double(), probs.double(), g.double())
        lx, lp = grads("cpu", tokens, probs, g)
    assert_close_to_ref(gx, rx, dtype=dtype, torch_lowp=lx, name="grad tokens")
    assert_close_to_ref(gp, rp, dtype=torch.float32, torch_lowp=lp, name="grad probs")


@pytest.mark.npu
def test_npu_opcheck():
    dev = _device()
    tokens, routing, probs = _inputs(10, 64, 4, 2, "index", torch.float32)
    tokens, routing, probs = tokens.to(dev), routing.to(dev), probs.to(dev)
    torch.library.opcheck(torch.ops.ascend_moe_ops.moe_permute.default, (tokens, routing, probs, 4, -1, 1, -1))
    out = amo.moe_permute(tokens, routing, probs, num_experts=4)
    torch.library.opcheck(torch.ops.ascend_moe_ops.moe_unpermute.default, (out.tokens, out.row_id_map, probs))


@pytest.mark.npu
def test_npu_matches_torch_npu_moe_token_permute():
    """Baseline: torch_npu's own npu_moe_token_permute (dropless top-k, no empty slots) gives the same
    expert-major, stable row order."""
    dev = _device()
    import torch_npu
    if not hasattr(torch_npu, "npu_moe_token_permute"):
        pytest.skip("this torch_npu has no npu_moe_token_permute")
    T, H, E, K = 64, 256, 16, 4
    tokens = torch.randn(T, H, dtype=torch.bfloat16)
    routing = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ours = amo.moe_permute(tokens.to(dev), routing.to(dev), num_experts=E)
    theirs = torch_npu.npu_moe_token_permute(tokens.to(dev), routing.to(dev))[0]
    assert torch.equal(ours.tokens.cpu(), theirs.cpu())
