"""ascend_moe_ops.integrations.megatron.patch(): a real megatron-core MoELayer, patched vs unpatched.

The layer is megatron-core's own ``MoELayer`` (router, token dispatcher, SequentialMLP or
GroupedMLP) on CPU with world size 1 over gloo; Megatron's own CUDA-only calls are neutralized by
``bench/_megatron_cpu.py`` (documented in docs/integrations.md). Every path checked here is a pure
data movement or a fixed-order fp32 sum that Megatron's CPU path also produces, so outputs and
every gradient must be bitwise equal (measured: they are, in fp32 and bf16, top-2 and top-4) --
except with the "activation" target, whose fused SwiGLU x probs rounds once where Megatron rounds
after each step: that one is held to the 2x-PyTorch rule against an fp64 layer.
"""

import importlib
import importlib.metadata
import sys
import warnings

import pytest
import torch

from ascend_moe_ops.integrations import grouped_gemm as agg
from ascend_moe_ops.integrations import megatron as mg
from ascend_moe_ops.testing import assert_close_to_ref

try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.moe import moe_utils, token_dispatcher
    MCORE = importlib.metadata.version("megatron-core")
except Exception as exc:  # not installed
    moe_utils = token_dispatcher = None
    MCORE = f"megatron-core unavailable ({type(exc).__name__}: {exc})"

pytestmark = pytest.mark.skipif(moe_utils is None, reason=str(MCORE))

if moe_utils is not None:
    from ascend_moe_ops.benchmark.suite._megatron_cpu import make_layer, megatron_world, run_layer
    ORIG = {n: getattr(moe_utils, n) for n in ("permute", "unpermute", "sort_chunks_by_idxs")}
# every target but "activation" (the fused activation rounds once: close, not bitwise)
BITWISE = tuple(t for t in mg.PATCHABLE if t != "activation")


def _run_fp64_twin(layer, x, go, **make_kw):
    """Run an fp64 SequentialMLP layer holding ``layer``'s weights on ``x``/``go`` (the oracle)."""
    twin = make_layer(dtype=torch.float64, **make_kw)
    with torch.no_grad():
        for p64, p in zip(twin.parameters(), layer.parameters()):
            p64.copy_(p)
    return run_layer(twin, x.double(), go.double())


@pytest.fixture(scope="module")
def world():
    with megatron_world():
        yield


@pytest.fixture(autouse=True)
def _always_unpatched():
    mg.unpatch()
    yield
    mg.unpatch()


def _inputs(T, H, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T // 2, 2, H, generator=g).to(dtype),  # [S, B, H] as Megatron feeds it
            torch.randn(T // 2, 2, H, generator=g).to(dtype))


def _assert_bitwise(ref, got):
    out_r, grads_r, dx_r = ref
    out_g, grads_g, dx_g = got
    assert torch.equal(out_r, out_g), f"output differs by {(out_r.float() - out_g.float()).abs().max()}"
    assert torch.equal(dx_r, dx_g), "input gradient differs"
    assert set(grads_r) == set(grads_g) and grads_r, "parameters with gradients differ"
    for name in grads_r:
        assert torch.equal(grads_r[name], grads_g[name]), f"gradient of {name} differs"


# ---------------------------------------------------------------- the real layer
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["dropless", "drop_and_pad"])
def test_moe_layer_patched_equals_unpatched(world, dispatcher, dtype, mode):
    layer = make_layer(dispatcher=dispatcher, dtype=dtype, topk=4,
                       capacity_factor=1.0 if mode == "drop_and_pad" else None)
    x, go = _inputs(32, 64, dtype)
    ref = run_layer(layer, x, go)
    with mg.patched() as report:
        got = run_layer(layer, x, go)
        counts = dict(mg.call_counts)
    assert "megatron.core.transformer.moe.token_dispatcher.permute" in report["permute"]
    assert counts["permute"] >= 1 and counts["unpermute"] >= 1, counts
    if dispatcher == "alltoall" and mode == "dropless":  # 8 local experts: chunks sorted twice
        assert counts["sort_chunks_by_idxs"] == 2, counts
    _assert_bitwise(ref, got)
    # and unpatched again afterwards: no call reaches the package
    again = run_layer(layer, x, go)
    assert mg.call_counts["permute"] == counts["permute"]
    _assert_bitwise(ref, again)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("mode", ["dropless", "drop_and_pad"])
def test_grouped_mlp_patched_equals_megatron_dispatch(world, dispatcher, mode):
    """GroupedMLP (bf16 only, Megatron's rule) cannot run unpatched without the CUDA grouped_gemm
    package, so the reference is Megatron's own permute/unpermute/sort-chunks with only the grouped
    GEMM fed from this package; then everything patched must give the same bits."""
    layer = make_layer(dispatcher=dispatcher, dtype=torch.bfloat16, topk=4, grouped_gemm=True,
                       capacity_factor=1.0 if mode == "drop_and_pad" else None)
    x, go = _inputs(32, 64, torch.bfloat16)
    with mg.patched(targets=("grouped_gemm",)):
        ref = run_layer(layer, x, go)
        assert mg.call_counts["grouped_gemm"] >= 2 and mg.call_counts["permute"] == 0
    with mg.patched(targets=BITWISE):
        got = run_layer(layer, x, go)
        assert mg.call_counts["grouped_gemm"] >= 2 and mg.call_counts["permute"] >= 1
    _assert_bitwise(ref, got)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_grouped_mlp_activation_patched_close_to_unpatched(world, dispatcher):
    """The "activation" target: GroupedMLP's SwiGLU x probs runs in the fused kernel (counted);
    output and every gradient are within the 2x-PyTorch rule of the fp64 layer, where PyTorch's own
    bf16 error is Megatron's unpatched GroupedMLP. (Megatron's moe_act recompute cannot run on CPU:
    its CheckpointWithoutOutput saves the CUDA RNG state.)"""
    extra = {}
    seq = make_layer(dispatcher=dispatcher, dtype=torch.bfloat16, topk=4)
    layer = make_layer(dispatcher=dispatcher, dtype=torch.bfloat16, topk=4, grouped_gemm=True, **extra)
    with torch.no_grad():
        layer.router.weight.copy_(seq.router.weight)
        layer.experts.weight1.copy_(torch.cat([e.linear_fc1.weight.t() for e in seq.experts.local_experts], 1))
        layer.experts.weight2.copy_(torch.cat([e.linear_fc2.weight.t() for e in seq.experts.local_experts], 0))
    x, go = _inputs(32, 64, torch.bfloat16)
    with mg.patched(targets=BITWISE):
        ref = run_layer(layer, x, go)
    with mg.patched() as report:
        got = run_layer(layer, x, go)
        assert mg.call_counts["activation"] >= 1, mg.call_counts
        assert report["activation"] == ["megatron.core.transformer.moe.experts.GroupedMLP.forward"]
    assert layer.experts.activation_func_with_probs is not mg._activation_with_probs  # restored
    r64 = _run_fp64_twin(seq, x, go, dispatcher=dispatcher, topk=4)  # the same math in fp64
    assert_close_to_ref(got[0], r64[0], dtype=torch.bfloat16, torch_lowp=ref[0], name="output")
    assert_close_to_ref(got[2], r64[2], dtype=torch.bfloat16, torch_lowp=ref[2], name="grad input")
    assert_close_to_ref(got[1]["router.weight"], r64[1]["router.weight"], dtype=torch.bfloat16,
                        torch_lowp=ref[1]["router.weight"], name="grad router")
    w1 = torch.cat([r64[1][f"experts.local_experts.{e}.linear_fc1.weight"].t() for e in range(8)], 1)
    w2 = torch.cat([r64[1][f"experts.local_experts.{e}.linear_fc2.weight"].t() for e in range(8)], 0)
    for name, want in (("experts.weight1", w1), ("experts.weight2", w2)):
        assert_close_to_ref(got[1][name], want.view(got[1][name].shape), dtype=torch.bfloat16,
                            torch_lowp=ref[1][name], name=f"grad {name}")


def test_activation_patch_leaves_other_activations_and_unpatches(world):
    from megatron.core.transformer.moe.experts import GroupedMLP
    original = GroupedMLP.forward
    gelu = make_layer(dtype=torch.bfloat16, topk=2, grouped_gemm=True,
                      activation_func=torch.nn.functional.gelu)
    x, go = _inputs(16, 64, torch.bfloat16)
    with mg.patched():
        assert GroupedMLP.forward is not original and GroupedMLP.forward.__wrapped__ is original
        run_layer(gelu, x, go)
        assert mg.call_counts["activation"] == 0  # only SwiGLU is fused
    assert GroupedMLP.forward is original


def test_grouped_mlp_matches_sequential_mlp(world):
    """The grouped GEMM computes what Megatron's SequentialMLP computes (same weights)."""
    seq = make_layer(dispatcher="alltoall", dtype=torch.bfloat16, topk=2)
    grp = make_layer(dispatcher="alltoall", dtype=torch.bfloat16, topk=2, grouped_gemm=True)
    with torch.no_grad():
        grp.router.weight.copy_(seq.router.weight)
        fc1 = [e.linear_fc1.weight for e in seq.experts.local_experts]
        fc2 = [e.linear_fc2.weight for e in seq.experts.local_experts]
        grp.experts.weight1.copy_(torch.cat([w.t() for w in fc1], 1))
        grp.experts.weight2.copy_(torch.cat([w.t() for w in fc2], 0))
    x, go = _inputs(32, 64, torch.bfloat16)
    ref = run_layer(seq, x, go)
    with mg.patched():
        got = run_layer(grp, x, go)
    ref64 = _run_fp64_twin(seq, x, go, dispatcher="alltoall", topk=2)
    assert_close_to_ref(got[0], ref64[0], dtype=torch.bfloat16, torch_lowp=ref[0], name="output")
    assert_close_to_ref(got[2], ref64[2], dtype=torch.bfloat16, torch_lowp=ref[2], name="grad input")


# ---------------------------------------------------------------- patch mechanics
def test_patch_rebinds_every_holder_and_unpatch_restores():
    report = mg.patch()
    assert mg.is_patched()
    for name in ("permute", "unpermute", "sort_chunks_by_idxs"):
        assert getattr(moe_utils, name).__wrapped__ is getattr(mg, name)
        assert getattr(token_dispatcher, name) is getattr(moe_utils, name)
        assert f"megatron.core.transformer.moe.moe_utils.{name}" in report[name]
    gg_util = sys.modules["megatron.core.transformer.moe.grouped_gemm_util"]
    assert gg_util.grouped_gemm_is_available() and gg_util.ops.gmm.__wrapped__ is agg.gmm
    assert mg.patch() is report  # idempotent
    assert mg.patch(targets=("permute",)) is report  # a subset of the active patch: no change
    assert "permute" in str(report)
    assert mg.unpatch() is report
    for name, fn in ORIG.items():
        assert getattr(moe_utils, name) is fn and getattr(token_dispatcher, name) is fn
    assert not gg_util.grouped_gemm_is_available()
    assert mg.unpatch() == {}  # second unpatch: nothing to do


def test_patch_subset_and_conflicting_targets():
    report = mg.patch(targets=("grouped_gemm",))
    assert moe_utils.permute is ORIG["permute"] and set(report) == {"grouped_gemm"}
    with pytest.raises(RuntimeError, match="already patched with targets"):
        mg.patch(targets=("permute",))
    mg.unpatch()
    with pytest.raises(ValueError, match="targets must be a subset"):
        mg.patch(targets=("permute", "dispatch"))


def test_modules_imported_later_are_patched(tmp_path, monkeypatch):
    (tmp_path / "amo_late_user.py").write_text(
        "from megatron.core.transformer.moe.moe_utils import permute, unpermute as unp\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("amo_late_user", None)
    report = mg.patch()
    late = importlib.import_module("amo_late_user")
    assert late.permute is moe_utils.permute and late.permute.__wrapped__ is mg.permute
    assert late.unp.__wrapped__ is mg.unpermute
    assert "amo_late_user.permute" in report["permute"] and "amo_late_user.unp" in report["unpermute"]
    mg.unpatch()
    assert late.permute is ORIG["permute"] and late.unp is ORIG["unpermute"]
    sys.modules.pop("amo_late_user", None)


def test_refuses_unknown_signature(monkeypatch):
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
                pad_multiple=None):  # a hypothetical newer signature
        raise AssertionError("never called")

    monkeypatch.setattr(moe_utils, "permute", permute)
    with pytest.raises(RuntimeError, match=r"moe_utils.permute has parameters .*pad_multiple.*refusing to patch"):
        mg.patch()
    assert not mg.is_patched() and moe_utils.unpermute is ORIG["unpermute"]


def test_context_manager_unpatches_on_error():
    with pytest.raises(KeyError):
        with mg.patched():
            assert moe_utils.permute is not ORIG["permute"]
            raise KeyError("boom")
    assert not mg.is_patched() and moe_utils.permute is ORIG["permute"]


# ---------------------------------------------------------------- sort_chunks_by_idxs vs Megatron
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sizes,order", [([3, 0, 5, 2, 4, 1], [2, 0, 5, 3, 1, 4]),  # zero-size chunk
                                         ([4], [0]), ([0, 0], [1, 0]), ([2, 7, 1], [0, 1, 2])])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
def test_sort_chunks_matches_megatron(dtype, sizes, order, index_dtype):
    N, H = sum(sizes), 6
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g).to(dtype)
    p = torch.rand(N, generator=g)
    w = torch.randn(N, H, generator=g).to(dtype)
    sizes_t, order_t = torch.tensor(sizes, dtype=index_dtype), torch.tensor(order, dtype=index_dtype)

    def run(fn):
        xi, pi = x.clone().requires_grad_(), p.clone().requires_grad_()
        out, pp = fn(xi, sizes_t, order_t, probs=pi)
        ((out.float() * w.float()).sum() + (pp * torch.arange(N)).sum()).backward()
        return out, pp, xi.grad, pi.grad

    for a, b in zip(run(mg.sort_chunks_by_idxs), run(ORIG["sort_chunks_by_idxs"])):
        assert a.dtype == b.dtype and torch.equal(a, b)
    out, none = mg.sort_chunks_by_idxs(x.t().contiguous().t(), sizes_t, order_t)  # non-contiguous
    assert none is None and torch.equal(out, ORIG["sort_chunks_by_idxs"](x, sizes_t, order_t)[0])


def test_sort_chunks_bad_inputs():
    x = torch.randn(6, 2)
    with pytest.raises(ValueError, match="split_sizes must add up to the 6 rows"):
        mg.sort_chunks_by_idxs(x, torch.tensor([2, 3]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="sorted_idxs must have one entry per chunk"):
        mg.sort_chunks_by_idxs(x, torch.tensor([2, 4]), torch.tensor([1, 0, 2]))
    with pytest.raises(TypeError, match="split_sizes must have dtype"):
        mg.sort_chunks_by_idxs(x, torch.tensor([2.0, 4.0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="probs must have one entry per row"):
        mg.sort_chunks_by_idxs(x, torch.tensor([2, 4]), torch.tensor([1, 0]), probs=torch.rand(5))


# ---------------------------------------------------------------- the grouped_gemm stand-in
def _loop_gmm(a, b, sizes, trans_b=False):
    outs, start = [], 0
    for e, n in enumerate(sizes.tolist()):
        w = b[e].t() if trans_b else b[e]
        outs.append(a[start:start + n] @ w)
        start += n
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[1 if trans_b else 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_gemm_standin(dtype, trans_b):
    g = torch.Generator().manual_seed(1)
    sizes = torch.tensor([3, 0, 5, 1], dtype=torch.int64)  # an empty expert
    a = torch.randn(9, 16, generator=g).to(dtype)
    b = torch.randn(4, 12, 16, generator=g).to(dtype) if trans_b else torch.randn(4, 16, 12, generator=g).to(dtype)
    ai, bi = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = agg.ops.gmm(ai, bi, sizes, trans_b=trans_b)
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    ref = _loop_gmm(a64, b64, sizes, trans_b)
    lowp = _loop_gmm(a, b, sizes, trans_b)
    assert_close_to_ref(out, ref, dtype=dtype, torch_lowp=lowp)
    gy = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(gy)
    ref.backward(gy.double())
    al, bl = a.clone().requires_grad_(), b.clone().requires_grad_()
    _loop_gmm(al, bl, sizes, trans_b).backward(gy)
    assert_close_to_ref(ai.grad, a64.grad, dtype=dtype, torch_lowp=al.grad, name="grad a")
    assert_close_to_ref(bi.grad, b64.grad, dtype=dtype, torch_lowp=bl.grad, name="grad b")
    assert torch.equal(bi.grad[1], torch.zeros_like(bi.grad[1]))  # empty expert: exact zero
    raw = agg.backend.gmm(a, b, sizes, trans_b=trans_b)
    assert not raw.requires_grad and torch.equal(raw, out.detach())
    dw = agg.backend.gmm(a, gy, sizes, trans_a=True)  # [E, K, N]: the weight gradient
    want = bi.grad.transpose(1, 2) if trans_b else bi.grad
    assert torch.equal(dw, want)
    c = torch.empty_like(raw)
    assert agg.backend.gmm(a, b, sizes, trans_b=trans_b, c=c) is c and torch.equal(c, raw)
    with pytest.raises(ValueError, match="trans_a and trans_b cannot both be set"):
        agg.backend.gmm(a, b, sizes, trans_a=True, trans_b=True)


# ---------------------------------------------------------------- the CPU fast path of permute
@pytest.mark.parametrize("uniform", [True, False], ids=["topk", "ragged"])
def test_permute_row_blocks_match_megatron(uniform):
    """The [T, E] mask is compacted in row blocks of 32768 / E tokens: T spans several blocks
    (and a ragged mask pads blocks to different widths); the record kept on sorted_indices lets
    unpermute skip the rebuild, also with probs; a different routing_map object falls back."""
    T, H, E, K = 1100, 8, 32, 4  # blocks of 1024 rows: two blocks
    g = torch.Generator().manual_seed(7)
    ids = torch.rand(T, E, generator=g).topk(K, 1).indices
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
    if not uniform:
        mask[1050:, :] = False  # the second block has tokens with no expert
        mask[3, :] = True       # a token with every expert (block widths 32 and 4)
    x = torch.randn(T, H, generator=g)
    probs = torch.rand(T, E, generator=g) * mask
    ours = mg.permute(x, mask, probs=probs, num_out_tokens=int(mask.sum()))
    theirs = ORIG["permute"](x, mask, probs=probs, num_out_tokens=int(mask.sum()))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    rows = torch.randn(ours[0].shape, generator=g)
    for kw in (dict(routing_map=mask), dict(routing_map=mask, probs=probs), dict(routing_map=mask.clone()), {}):
        out = mg.unpermute(rows, ours[2], x.shape, **kw)
        ref = ORIG["unpermute"](rows, theirs[2], x.shape, **kw) if kw else \
            ORIG["unpermute"](rows, theirs[2], x.shape, routing_map=mask)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- Megatron's own switches
def _fusion_config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
                             moe_router_topk=2, use_cpu_initialization=True, moe_permute_fusion=True, **extra)


def test_permute_fusion_config_accepted_while_patched():
    """megatron-core 0.16.1 refuses moe_permute_fusion=True without TransformerEngine (its config
    imports TE's fused functions from moe_utils); patched, the config is accepted, and the names are
    gone again after unpatch (and never set when permute/unpermute/sort-chunks are not all patched)."""
    assert not hasattr(moe_utils, "fused_permute"), "TransformerEngine installed: this test assumes it is not"
    with pytest.raises((ImportError, ValueError), match="fused_permute|fused permutation"):
        _fusion_config()
    with mg.patched(targets=("permute", "unpermute", "grouped_gemm")) as report:
        assert "fused" not in report and not hasattr(moe_utils, "fused_permute")
        with pytest.raises((ImportError, ValueError)):
            _fusion_config()
    with mg.patched() as report:
        cfg = _fusion_config()
        assert cfg.moe_permute_fusion
        assert len(report["fused"]) == len(mg.FUSED_NAMES)
        for name, fn in mg.FUSED_NAMES.items():
            assert getattr(moe_utils, name) is fn
    for name in mg.FUSED_NAMES:
        assert not hasattr(moe_utils, name)
    with pytest.raises((ImportError, ValueError)):
        _fusion_config()


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_layer_with_permute_fusion(world, dispatcher):
    """A layer configured with moe_permute_fusion=True runs the package's functions (its fused=True
    calls) and gives the unfused, unpatched layer's bits; unpatched it fails as Megatron does without
    TransformerEngine."""
    plain = make_layer(dispatcher=dispatcher, topk=4)
    x, go = _inputs(32, 64, torch.float32)
    ref = run_layer(plain, x, go)
    with mg.patched(targets=BITWISE):
        fused = make_layer(dispatcher=dispatcher, topk=4, moe_permute_fusion=True)
        fused.load_state_dict(plain.state_dict())
        got = run_layer(fused, x, go)
        assert mg.call_counts["permute"] >= 1 and mg.call_counts["unpermute"] >= 1, mg.call_counts
        if dispatcher == "alltoall":
            assert mg.call_counts["sort_chunks_by_idxs"] == 2, mg.call_counts
    assert fused.config.moe_permute_fusion
    _assert_bitwise(ref, got)
    with pytest.raises(ValueError, match="fused_permute.* is not available"):
        run_layer(fused, x, go)


def test_fused_standins_match_megatron():
    """The stand-ins under TransformerEngine's names (Megatron's calling convention) give what
    Megatron's unfused functions give."""
    g = torch.Generator().manual_seed(5)
    T, H, E = 12, 8, 6
    mask = torch.zeros(T, E, dtype=torch.bool).scatter_(1, torch.rand(T, E, generator=g).topk(2, 1).indices, True)
    x = torch.randn(T, H, generator=g)
    probs = torch.rand(T, E, generator=g) * mask
    f = mg.FUSED_NAMES
    out, si = f["fused_permute"](x, mask, num_out_tokens=int(mask.sum()))
    ref_out, _, ref_si = ORIG["permute"](x, mask)
    assert torch.equal(out, ref_out) and torch.equal(si, ref_si)
    out, pp, si = f["fused_permute_with_probs"](x, probs, mask, num_out_tokens=-1)
    ref = ORIG["permute"](x, mask, probs=probs)
    assert all(torch.equal(a, b) for a, b in zip((out, pp, si), ref))
    rows = torch.randn(out.shape, generator=g)
    want = ORIG["unpermute"](rows, ref[2], x.shape, probs=probs, routing_map=mask)
    torch.testing.assert_close(f["fused_unpermute"](rows, si, merging_probs=probs, restore_shape=x.shape), want)
    torch.testing.assert_close(f["fused_unpermute"](rows, si), ORIG["unpermute"](rows, ref[2], x.shape))
    with pytest.raises(ValueError, match="row_id_map must be the sorted_indices"):
        f["fused_unpermute"](rows, ref[2].clone(), merging_probs=probs, restore_shape=x.shape)
    with pytest.raises(ValueError, match="map_type must be 'mask'"):
        f["fused_permute"](x, mask, map_type="index")
    sizes, order = torch.tensor([3, 0, 5, 4]), torch.tensor([2, 0, 3, 1])
    p = torch.rand(12, generator=g)
    want_x, want_p = ORIG["sort_chunks_by_idxs"](x, sizes, order, probs=p)
    assert torch.equal(f["fused_sort_chunks_by_index"](x, sizes, order), want_x)
    got_x, got_p = f["fused_sort_chunks_by_index_with_probs"](x, p, sizes, order)
    assert torch.equal(got_x, want_x) and torch.equal(got_p, want_p)


@pytest.mark.parametrize("installed", ["0.17.0", "0.16.0", "0.16.1rc0", "unknown"])
def test_patch_refuses_other_megatron_core_versions(monkeypatch, installed):
    monkeypatch.setattr(mg, "megatron_core_version", lambda: installed)
    with pytest.raises(RuntimeError) as info:
        mg.patch()
    msg = str(info.value)
    assert f"megatron-core {installed!r} is installed" in msg
    assert f"supports megatron-core {mg.SUPPORTED_MEGATRON_CORE} only" in msg
    assert f"pip install megatron-core=={mg.SUPPORTED_MEGATRON_CORE}" in msg
    assert not mg.is_patched() and moe_utils.permute is ORIG["permute"] and not hasattr(moe_utils, "fused_permute")
    monkeypatch.setattr(mg, "megatron_core_version", lambda: mg.SUPPORTED_MEGATRON_CORE + "+local")
    assert "permute" in mg.patch()  # the same release with a local build tag


@pytest.mark.slow  # two processes, each importing megatron-core: ~40 s on 2 shared cores
def test_expert_parallel_probs_reach_the_experts(tmp_path):
    """EP=2 (two processes over gloo, 4 of 8 experts per rank), alltoall dispatcher: dropless top-2,
    dropless top-2 with moe_permute_fusion, drop-and-pad top-2, top-1 with moe_apply_probs_on_input.
    On each rank the patched layer's output and gradients equal the unpatched ones bitwise, the
    experts receive the same rows, tokens_per_expert and probs, and every row's prob is its token's
    router prob for that row's global expert (tests/_megatron_ep.py)."""
    import multiprocessing

    from ascend_moe_ops.benchmark.suite._megatron_cpu import _free_port
    from _megatron_ep import CASES, ep_worker
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=ep_worker, args=(r, port, str(tmp_path / f"rank{r}.pt"))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0, 0], "an EP worker failed (its traceback is on stderr)"
    for r in range(2):
        results = torch.load(tmp_path / f"rank{r}.pt")
        assert set(results) == set(CASES)
        for name, res in results.items():
            assert res["local_experts"] == 4 and res["rows"] > 0, (r, name, res)
            assert res["fusion"] == CASES[name][1], (r, name)
            assert res["counts"]["permute"] == 1 and res["counts"]["unpermute"] == 1, (r, name, res)
            if "drop_and_pad" not in name:  # dropless: chunks sorted on dispatch and on combine
                assert res["counts"]["sort_chunks_by_idxs"] == 2, (r, name, res)
            assert res["probs_check"] == "", f"rank {r} {name}: {res['probs_check']}"
            assert res["experts_inputs_equal"], f"rank {r} {name}: the experts' inputs differ"
            assert res["bitwise"], f"rank {r} {name}: output or gradients differ from Megatron's"


# ---------------------------------------------------------------- a whole GPTModel trained
@pytest.mark.slow  # two small GPTModels trained 3 steps each, both expert modules: ~30-60 s on 2 shared cores
@pytest.mark.parametrize("grouped_gemm", [False, True], ids=["SequentialMLP", "GroupedMLP"])
def test_gpt_model_loss_curve_bitwise(world, grouped_gemm):
    """megatron-core's own GPTModel (local layer spec, MoE in every layer: 16 experts top-4, bf16,
    rope, byte tokens of standard-library sources, SGD with momentum), built twice from one seed and
    trained on the same batches: unpatched, and under patch() of every bitwise target. The loss of
    every step must be bitwise equal (the weights after each step feed the next loss), the
    package's permute / unpermute / sort-chunks must have run in the patched arm only, and the loss
    must fall (the model trains). bench/bench_megatron_gpt.py times the same two arms."""
    from ascend_moe_ops.benchmark.suite import bench_megatron_gpt as bg
    shape = dict(bg.QUICK_SHAPE, seq=128)
    arms = {p: bg.Arm("patched" if p else "unpatched", shape, grouped_gemm, p) for p in (False, True)}
    assert arms[True].targets == BITWISE
    assert arms[False].targets == (("grouped_gemm",) if grouped_gemm else None)
    counts = {}
    for tok, lab in bg.batches(shape, 4):
        for p, arm in arms.items():
            with arm.scope():
                arm.losses.append(arm.step(tok, lab))
                counts[p] = dict(mg.call_counts) if mg.is_patched() else None
    assert counts[False] is None or (counts[False]["permute"] == 0 and counts[False]["grouped_gemm"] > 0)
    assert counts[True]["permute"] == shape["layers"] and counts[True]["unpermute"] == shape["layers"], counts
    assert counts[True]["sort_chunks_by_idxs"] == 2 * shape["layers"], counts
    assert counts[True]["grouped_gemm"] == (2 * shape["layers"] if grouped_gemm else 0), counts
    ref, got = arms[False].losses, arms[True].losses
    assert all(torch.isfinite(x) for x in ref)
    assert [x.item() for x in got] == [x.item() for x in ref]
    for i, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {i}: loss {b.item()!r} patched vs {a.item()!r} unpatched"
    assert ref[-1] < ref[0], [x.item() for x in ref]
    # the two models really are the same network after training (every parameter bitwise equal)
    pu = dict(arms[False].model.named_parameters())
    for name, p in arms[True].model.named_parameters():
        assert torch.equal(p, pu[name]), f"parameter {name} differs after training"


def test_patch_targets_must_be_a_non_empty_sequence_of_names():
    """targets=None (a raw TypeError), a single string (read letter by letter) and an empty tuple (the
    module marked patched with nothing changed, a later patch() refused) are named errors."""
    with pytest.raises(TypeError, match="targets must be a sequence of names"):
        mg.patch(targets=None)
    with pytest.raises(TypeError, match="not a single string"):
        mg.patch(targets="permute")
    with pytest.raises(ValueError, match="targets must name at least one of"):
        mg.patch(targets=())
    assert not mg._State.active  # none of them patched anything
