"""AscendC backend on a real Ascend NPU (marker ``npu``: skipped where torch_npu is not installed;
the conftest adds the skip). On an NPU machine build the backend first (docs/ascend.md), then run
``python -m pytest -m npu tests/test_ascend_npu.py``. Everything here is UNVERIFIED until run there.

The one test without the marker checks that the package imports and reports the NPU backend's
status cleanly on a machine without torch_npu (this one runs in CI).
"""

import contextlib
import importlib.util

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops import _npu
from ascend_moe_ops.testing import assert_close_to_ref, torch_attention, torch_attention_grads, torch_mla_attention
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
    torch.library.opcheck(torch.ops.ascend_moe_ops.moe_permute.default, (tokens, routing, probs, 4, None, 1, None))
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


# ------------------------------------------------------------------ grouped GEMM on the Cube (NPU)
@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("trans_b", [False, True], ids=["nn", "nt"])
@pytest.mark.parametrize("case", ["odd_97x129x61", "zipf", "E256_sparse", "K0", "all_empty", "tiles"])
def test_npu_grouped_gemm_matches_reference(dtype, trans_b, case):
    dev = _device()
    from test_grouped_gemm import _inputs as gg_inputs
    x, w, sizes = gg_inputs(case, dtype, trans_b)
    out = amo.grouped_gemm(x.to(dev), w.to(dev), sizes.to(dev), trans_b=trans_b).cpu()
    with amo.use_backend("reference"):
        ref64 = amo.grouped_gemm(x.double(), w.double(), sizes, trans_b=trans_b)
        lowp = amo.grouped_gemm(x, w, sizes, trans_b=trans_b)
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp)
    assert (out[int(sizes.sum()):] == 0).all()
    xx, ww = x.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    amo.grouped_gemm(xx, ww, sizes.to(dev), trans_b=trans_b).sum().backward()
    assert (ww.grad.cpu()[sizes == 0] == 0).all(), "dW of an empty group is exactly zero"


@pytest.mark.npu
def test_npu_grouped_gemm_fp32_refused():
    dev = _device()
    x, w = torch.randn(8, 16, device=dev), torch.randn(1, 16, 16, device=dev)
    with pytest.raises(RuntimeError, match="float16/bfloat16"):
        amo.grouped_gemm(x, w, torch.tensor([8], device=dev))


@pytest.mark.npu
def test_npu_grouped_gemm_opcheck_and_baseline():
    """opcheck on PrivateUse1, and torch_npu's npu_grouped_matmul (split_item=3, group_type=0,
    cumulative group_list) as a baseline of the forward."""
    dev = _device()
    import torch_npu
    g = torch.Generator().manual_seed(0)
    sizes = torch.tensor([10, 0, 20, 1, 5])
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(5, 64, 48, generator=g) / 8).to(torch.bfloat16).to(dev)
    torch.library.opcheck(torch.ops.ascend_moe_ops.grouped_gemm.default, (x, w, sizes.to(dev), False))
    ours = amo.grouped_gemm(x[:36], w, sizes.to(dev))
    if not hasattr(torch_npu, "npu_grouped_matmul"):
        pytest.skip("this torch_npu has no npu_grouped_matmul")
    theirs = torch_npu.npu_grouped_matmul([x[:36]], [w], group_list=torch.cumsum(sizes, 0).to(dev),
                                          split_item=3, group_type=0)[0]
    with amo.use_backend("reference"):
        lowp = amo.grouped_gemm(x[:36].cpu(), w.cpu(), sizes)
        ref64 = amo.grouped_gemm(x[:36].cpu().double(), w.cpu().double(), sizes)
    assert_close_to_ref(ours.cpu(), ref64, dtype=torch.bfloat16, torch_lowp=lowp)
    assert_close_to_ref(theirs.cpu(), ref64, dtype=torch.bfloat16, torch_lowp=lowp, name="npu_grouped_matmul")


# ------------------------------------------------------------------ EP dispatcher on HCCL
# The gloo scenarios of tests/test_ep_dispatcher.py, run on HCCL: one process per NPU, each bound
# to its device with torch.npu.set_device(local_rank) before init_process_group("hccl"). The
# scenarios build their inputs and oracles on the CPU; the dispatcher is wrapped so that every
# tensor it receives moves to the rank's NPU (differentiably, so gradients flow back to the CPU
# leaves) and every tensor it returns comes back to the CPU. The collectives themselves therefore
# run on NPU tensors through HCCL. Launch recipe and HCCL_BUFFSIZE arithmetic: docs/ascend.md.

def _npu_count():
    try:
        import torch_npu  # noqa: F401
        return torch.npu.device_count()
    except Exception:
        return 0


def _tree(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_tree(o, fn) for o in obj)
    if isinstance(obj, list):
        return [_tree(o, fn) for o in obj]
    return obj


def _wrap_dispatcher_for_npu(device):
    from ascend_moe_ops.distributed import dispatcher as D

    def to_dev(t):
        return t.to(device)

    def to_cpu(t):
        return t.cpu() if t.device.type != "cpu" else t

    class _Pending:
        def __init__(self, p):
            self._p = p

        def wait(self):
            return _tree(self._p.wait(), to_cpu)

    def wrap(method):
        def inner(self, *args, **kwargs):
            args = _tree(args, to_dev)
            kwargs = {k: _tree(v, to_dev) for k, v in kwargs.items()}
            out = method(self, *args, **kwargs)
            if kwargs.get("async_op"):
                return _Pending(out)
            return _tree(out, to_cpu)
        return inner

    D.MoEDispatcher.dispatch = wrap(D.MoEDispatcher.dispatch)
    D.MoEDispatcher.combine = wrap(D.MoEDispatcher.combine)


def _hccl_worker(rank, world, local_size, port, outdir, names, backend="hccl"):
    import datetime
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for p in (root, os.path.join(root, "tests")):
        if p not in sys.path:
            sys.path.insert(0, p)
    import torch.distributed as dist
    import test_ep_dispatcher as T
    from _spawn import run_scenarios, setup_failure
    from ascend_moe_ops.distributed import EPTopology
    results = {}
    try:
        if backend == "hccl":
            import torch_npu  # noqa: F401
            local_rank = rank % torch.npu.device_count()
            torch.npu.set_device(local_rank)  # bind before the process group: HCCL uses the current device
            device = torch.device("npu", local_rank)
        else:  # CI self-test of this harness: gloo, tensors stay on the CPU
            torch.set_num_threads(1)
            device = torch.device("cpu")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=T.PG_TIMEOUT_S * 3))
        _wrap_dispatcher_for_npu(device)
        ctx = dict(rank=rank, world=world, local_size=local_size, topo=EPTopology(local_size=local_size))
        run_scenarios(T.scenario_calls(ctx, names), results, outdir, rank)
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        setup_failure(results, outdir, rank)


HCCL_WORLDS = {"2x2": (4, 2), "2x4": (8, 4), "1x4": (4, 4)}


def _run_scenarios(n, local, tmp_path, backend):
    import os
    import test_ep_dispatcher as T
    from _spawn import free_port, problems, spawn_ranks
    if backend == "hccl":
        os.environ.setdefault("HCCL_BUFFSIZE", "200")  # MB (the default); the scenarios' messages are far smaller
    names = list(T.SCENARIOS)
    per_rank, hung = spawn_ranks(_hccl_worker, n, (n, local, free_port(), str(tmp_path), names, backend),
                                 str(tmp_path), T.JOIN_TIMEOUT_S * 2)
    bad = ([f"hung ranks {hung}"] if hung else []) + problems(per_rank, hung, names)
    assert not bad, "\n".join(bad)


@pytest.mark.npu
@pytest.mark.parametrize("world", list(HCCL_WORLDS))
def test_ep_dispatcher_scenarios_on_hccl(world, tmp_path):
    """Every gloo scenario of tests/test_ep_dispatcher.py on HCCL (logical nodes on one machine)."""
    n, local = HCCL_WORLDS[world]
    if _npu_count() < n:
        pytest.skip(f"needs {n} NPUs, found {_npu_count()}")
    _run_scenarios(n, local, tmp_path, "hccl")


def test_hccl_harness_on_gloo(tmp_path):
    """The harness above (spawned ranks, wrapped dispatcher, result collection) on gloo with CPU
    tensors, 2 nodes x 2 ranks: runs in CI so the NPU test's own logic is not first tried on an NPU."""
    _run_scenarios(4, 2, tmp_path, "gloo")


# ------------------------------------------------------------------ flash attention (phase kernels, NPU)
# csrc/ascend/flash_attention.cpp launches the phase kernels of kernels/flash_attention_*.cpp; these tests
# compare forward and backward with the fp64 reference (2 x PyTorch's own low-precision error rule).
FA_SHAPES = {  # name: (H, Dk, Dr, Dv, sequence lengths)
    "mla_128+64_128": (4, 128, 64, 128, [1, 17, 300, 0, 129]),
    "plain_128": (4, 128, 0, 128, [200, 57, 1]),
    "plain_64_odd": (3, 64, 0, 64, [5, 130, 77]),
}


def _fa_inputs_npu(lens, H, Dk, Dr, Dv, seed=0):
    """The emulator tests' inputs (fp64) plus an output gradient."""
    from test_ascend_flash_attention import _fa_inputs
    q, k, v, kr, cu = _fa_inputs(lens, H, Dk, Dr, Dv, seed=seed)
    gout = torch.randn(q.shape[0], H, Dv, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return q, k, v, kr, gout, cu


def _fa_on(device, dtype, q, k, v, kr, gout, cu, max_seqlen, causal, scale):
    """Forward then backward of torch.ops.ascend_moe_ops on `device`, results on the CPU."""
    to = lambda t: None if t is None else t.to(dtype).to(device)
    qd, kd, vd, krd, gd = to(q), to(k), to(v), to(kr), to(gout)
    cud = cu.to(device)
    ops = torch.ops.ascend_moe_ops
    out, lse = ops.flash_attention_fwd(qd, kd, vd, krd, cud, max_seqlen, causal, scale)
    grads = ops.flash_attention_bwd(gd, qd, kd, vd, krd, out, lse, cud, max_seqlen, causal, scale)
    return [t.cpu() for t in (out, lse, *grads)]


@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(FA_SHAPES))
@pytest.mark.parametrize("forward", ["fused", "phases"])
def test_npu_flash_attention_matches_reference(dtype, causal, shape, forward, monkeypatch):
    monkeypatch.setenv("ASCEND_MOE_OPS_FA_KERNELS", forward)  # the mixed kernel, or the phase kernels
    dev = _device()
    H, Dk, Dr, Dv, lens = FA_SHAPES[shape]
    q, k, v, kr, gout, cu = _fa_inputs_npu(lens, H, Dk, Dr, Dv)
    scale = (Dk + Dr) ** -0.5
    ms = max(lens)
    ours = _fa_on(dev, dtype, q, k, v, kr, gout, cu, ms, causal, scale)
    with amo.use_backend("reference"):
        ref64 = _fa_on("cpu", torch.float64, q, k, v, kr, gout, cu, ms, causal, scale)
    lowp = torch_attention_grads(*(None if t is None else t.to(dtype) for t in (q, k, v, kr)), cu,
                                 gout.to(dtype), causal=causal, softmax_scale=scale)  # PyTorch's own
    assert ours[0].dtype == dtype and ours[1].dtype == torch.float32
    names = ["out", "lse", "dq", "dk", "dv", "dk_rope"]
    for name, o, r, lo in zip(names, ours, ref64, lowp):
        if name == "dk_rope" and not Dr:
            assert o.shape == (0,), "dk_rope is an empty [0] tensor without k_rope"
            continue
        assert_close_to_ref(o, r, dtype=dtype, torch_lowp=lo, name=f"npu flash_attention {name}")


@pytest.mark.npu
def test_npu_flash_attention_autograd_and_larger_max_seqlen():
    """The public wrapper on NPU tensors (autograd -> flash_attention_bwd on PrivateUse1), with a
    max_seqlen above the longest sequence (only bounds the work items)."""
    dev = _device()
    lens, H, D = [64, 3, 190], 2, 64
    q, k, v, _, gout, cu = _fa_inputs_npu(lens, H, D, 0, D, seed=1)
    leaves = [t.to(torch.bfloat16).to(dev).requires_grad_() for t in (q, k, v)]
    out = amo.flash_attention(*leaves, causal=True, cu_seqlens=cu.to(dev), max_seqlen=300)
    out.backward(gout.to(torch.bfloat16).to(dev))
    with amo.use_backend("reference"):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        o64 = amo.flash_attention(*ref, causal=True, cu_seqlens=cu, max_seqlen=190)
        o64.backward(gout)
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]  # PyTorch's own bf16 attention
    olo, _ = torch_attention(*low, cu, causal=True, softmax_scale=D ** -0.5)
    olo.backward(gout.to(torch.bfloat16))
    assert_close_to_ref(out.detach().cpu(), o64.detach(), dtype=torch.bfloat16, torch_lowp=olo.detach(), name="out")
    for name, a, r, lo in zip("qkv", leaves, ref, low):
        assert_close_to_ref(a.grad.cpu(), r.grad, dtype=torch.bfloat16, torch_lowp=lo.grad, name=f"d{name}")


@pytest.mark.npu
def test_npu_flash_attention_refusals_and_empty():
    dev = _device()
    ops = torch.ops.ascend_moe_ops
    q = torch.randn(8, 2, 64, device=dev)
    cu = torch.tensor([0, 8], device=dev)
    with pytest.raises(RuntimeError, match="float16/bfloat16"):
        ops.flash_attention_fwd(q, q, q, None, cu, 8, True, 0.125)
    qh = q.half()
    with pytest.raises(ValueError, match="k head dim must equal"):
        ops.flash_attention_fwd(qh, qh[..., :32], qh, None, cu, 8, True, 0.125)
    e = torch.empty(0, 2, 64, dtype=torch.float16, device=dev)
    out, lse = ops.flash_attention_fwd(e, e, e, None, torch.tensor([0], device=dev), 0, True, 0.125)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)
    dq, dk, dv, dkr = ops.flash_attention_bwd(e, e, e, e, None, out, lse, torch.tensor([0], device=dev), 0, True, 0.125)
    assert dq.shape == e.shape and dk.shape == e.shape and dv.shape == e.shape and dkr.shape == (0,)


@pytest.mark.npu
@pytest.mark.parametrize("rope", [True, False], ids=["rope", "plain"])
def test_npu_flash_attention_opcheck(rope):
    dev = _device()
    Dk, Dr, Dv = (128, 64, 128) if rope else (64, 0, 64)
    q, k, v, kr, gout, cu = _fa_inputs_npu([9, 40], 2, Dk, Dr, Dv, seed=2)
    to = lambda t: None if t is None else t.to(torch.bfloat16).to(dev)
    args = (to(q), to(k), to(v), to(kr), cu.to(dev), 40, True, (Dk + Dr) ** -0.5)
    torch.library.opcheck(torch.ops.ascend_moe_ops.flash_attention_fwd.default, args)
    out, lse = torch.ops.ascend_moe_ops.flash_attention_fwd(*args)
    torch.library.opcheck(torch.ops.ascend_moe_ops.flash_attention_bwd.default,
                          (to(gout), *args[:4], out, lse, *args[4:]))


@pytest.mark.npu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(128, 128), (192, 128)], ids=["d128", "mla_192_128"])
def test_npu_flash_attention_vs_npu_fusion_attention(causal, dims):
    """Baseline (optional): torch_npu's npu_fusion_attention in the TND (varlen) layout, both compared
    with the fp64 reference. Skipped where this torch_npu lacks the op or refuses the shape."""
    dev = _device()
    import torch_npu
    if not hasattr(torch_npu, "npu_fusion_attention"):
        pytest.skip("this torch_npu has no npu_fusion_attention")
    Dqk, Dv = dims
    lens, H = [100, 257, 31], 4
    q, k, v, _, _, cu = _fa_inputs_npu(lens, H, Dqk, 0, Dv, seed=3)
    scale = Dqk ** -0.5
    bf = lambda t: t.to(torch.bfloat16).to(dev)
    ours, _ = torch.ops.ascend_moe_ops.flash_attention_fwd(bf(q), bf(k), bf(v), None, cu.to(dev), max(lens), causal, scale)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1).to(dev) if causal else None
    ends = cu[1:].tolist()
    try:
        theirs = torch_npu.npu_fusion_attention(bf(q), bf(k), bf(v), H, "TND", atten_mask=mask, scale=scale,
                                                actual_seq_qlen=ends, actual_seq_kvlen=ends,
                                                sparse_mode=3 if causal else 0)[0]
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"npu_fusion_attention refuses this case: {str(exc)[:200]}")
    with amo.use_backend("reference"):
        ref64, _ = torch.ops.ascend_moe_ops.flash_attention_fwd(q, k, v, None, cu, max(lens), causal, scale)
    lowp, _ = torch_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), cu,
                              causal=causal, softmax_scale=scale)  # PyTorch's own bf16 attention
    assert_close_to_ref(ours.cpu(), ref64, dtype=torch.bfloat16, torch_lowp=lowp, name="ascend_moe_ops")
    assert_close_to_ref(theirs.cpu(), ref64, dtype=torch.bfloat16, torch_lowp=lowp, name="npu_fusion_attention")


@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("recompute", ["kv", "none"])
def test_npu_mla_attention_matches_reference(dtype, recompute):
    """MLA on the NPU: the Python composition of the AscendC kernels (grouped GEMM up-projection,
    flash attention with the shared rope key) served on PrivateUse1; forward and backward vs fp64."""
    dev = _device()
    H, Dn, Dr, Dv, Dc = 4, 128, 64, 128, 512
    cu = torch.tensor([0, 1, 98, 99, 160])
    T = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(T, H, Dn + Dr, generator=g, dtype=torch.float64)
    c = torch.randn(T, Dc, generator=g, dtype=torch.float64)
    kpe = torch.randn(T, Dr, generator=g, dtype=torch.float64)
    w = torch.randn(H * (Dn + Dv), Dc, generator=g, dtype=torch.float64) / Dc ** 0.5
    do = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)

    def run(dt, device, backend=None):
        xs = [t.to(dt).to(device).requires_grad_() for t in (q, c, kpe, w)]
        ctx = amo.use_backend(backend) if backend else contextlib.nullcontext()
        with ctx:
            out = amo.mla_attention(*xs, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, softmax_scale=0.1352,
                                    cu_seqlens=cu.to(device), max_seqlen=97, recompute=recompute, causal=True)
            out.backward(do.to(dt).to(device))
        return [out.detach().cpu()] + [t.grad.cpu() for t in xs]

    got = run(dtype, dev)
    want = run(torch.float64, "cpu", "reference")
    xs = [t.to(dtype).requires_grad_() for t in (q, c, kpe, w)]  # PyTorch's own MLA in dtype
    olo, _ = torch_mla_attention(*xs, cu, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, causal=True,
                                 softmax_scale=0.1352)
    olo.backward(do.to(dtype))
    low = [olo.detach()] + [t.grad for t in xs]
    for name, a, b, lo in zip(("out", "dq", "dc_kv", "dk_pe", "dw"), got, want, low):
        assert_close_to_ref(a, b, dtype=dtype, torch_lowp=lo, name=f"npu mla {name}")
