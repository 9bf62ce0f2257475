"""grouped_gemm: every backend present vs the fp64 reference (forward and backward, trans_b both
ways), the reference vs a naive loop written from the contract, edge cases (E=1, many empty
groups, one group with every row, K=0, M=0, odd sizes, Zipf-skewed sizes, rows past the sum),
NaN hygiene, opcheck, torch.compile and bad input."""

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.testing import assert_close_to_ref
from conftest import backends, ops_of

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def zipf_sizes(E, total, alpha=1.2, gen=None):
    """Group sizes summing to ``total`` with a Zipf-like skew (random expert order)."""
    w = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** alpha
    w = w[torch.randperm(E, generator=gen)]
    sizes = torch.floor(w / w.sum() * total).to(torch.int64)
    sizes[int(torch.argmax(w))] += total - int(sizes.sum())
    return sizes


def random_sizes(E, total, gen=None, empty_frac=0.0):
    """Random sizes summing to ``total`` (some groups forced empty)."""
    if E == 0:
        return torch.zeros(0, dtype=torch.int64)
    keep = torch.rand(E, generator=gen) >= empty_frac
    if not keep.any():
        keep[0] = True
    cuts = torch.sort(torch.randint(0, total + 1, (int(keep.sum()) - 1,), generator=gen)).values
    parts = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([total])]))
    sizes = torch.zeros(E, dtype=torch.int64)
    sizes[keep] = parts
    return sizes


# name -> (M rows, K, N, E, sizes(gen) , rows used); rows past the used ones must come out zero
def _case(name, gen):
    if name == "E1":
        return 37, 64, 48, torch.tensor([30])
    if name == "E256_sparse":  # Pangu-like expert count, most groups empty
        return 50, 32, 24, random_sizes(256, 46, gen, empty_frac=0.9)
    if name == "one_group_all_rows":
        s = torch.zeros(8, dtype=torch.int64)
        s[5] = 40
        return 40, 48, 40, s
    if name == "K0":
        return 12, 0, 20, torch.tensor([5, 0, 7])
    if name == "M0":
        return 0, 16, 8, torch.zeros(4, dtype=torch.int64)
    if name == "all_empty":
        return 9, 16, 8, torch.zeros(3, dtype=torch.int64)
    if name == "odd_97x129x61":
        return 97, 129, 61, torch.tensor([30, 0, 41, 1, 20])
    if name == "zipf":
        return 300, 64, 80, zipf_sizes(16, 290, gen=gen)
    if name == "pangu_scaled":  # H 7680 -> 256, expert FFN 2048 -> 192, E 256 -> 8
        return 256, 256, 192, random_sizes(8, 256, gen)
    if name == "tiles":  # crosses every blocking boundary of the native kernel (MC, NC, KC)
        return 401, 300, 300, torch.tensor([260, 3, 0, 137])
    raise KeyError(name)


CASES = ["E1", "E256_sparse", "one_group_all_rows", "K0", "M0", "all_empty", "odd_97x129x61",
         "zipf", "pangu_scaled", "tiles"]
TRITON_CASES = {"E1", "E256_sparse", "one_group_all_rows", "K0", "M0", "all_empty", "odd_97x129x61"}


ASCENDC_NO_FP32 = ("the Ascend Cube kernel takes fp16/bf16 only (fp32 is not implemented on the Cube path); "
                   "its fp16 variants of these checks are in tests/test_ascend_grouped_gemm.py")


def _skip_unsupported(backend, dtype, case=None):
    if backend == "ascendc-emu" and dtype not in (torch.float16, torch.bfloat16):
        pytest.skip(ASCENDC_NO_FP32)
    if backend == "triton" and case is not None and case not in TRITON_CASES:
        pytest.skip("the Triton interpreter is slow: larger shapes run on GPUs (same code path)")


def _inputs(case, dtype, trans_b, seed=0):
    g = torch.Generator().manual_seed(seed)
    M, K, N, sizes = _case(case, g)
    E = sizes.numel()
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(E, N, K, generator=g) if trans_b else torch.randn(E, K, N, generator=g))
    w = (w / max(K, 1) ** 0.5).to(dtype)
    return x, w, sizes


def _run(backend, *args, **kwargs):
    with amo.use_backend(backend):
        return amo.grouped_gemm(*args, **kwargs)


def naive(x, w, sizes, trans_b):
    out = torch.zeros(x.shape[0], w.shape[1] if trans_b else w.shape[2], dtype=torch.float64)
    start = 0
    for e, g in enumerate(sizes.tolist()):
        for i in range(start, start + g):
            we = w[e].double().t() if trans_b else w[e].double()
            out[i] = x[i].double() @ we
        start += g
    return out


@pytest.mark.parametrize("case", ["E1", "E256_sparse", "K0", "M0", "odd_97x129x61", "zipf"])
@pytest.mark.parametrize("trans_b", [False, True])
def test_reference_matches_contract(case, trans_b):
    x, w, sizes = _inputs(case, torch.float64, trans_b)
    out = _run("reference", x, w, sizes, trans_b=trans_b)
    torch.testing.assert_close(out, naive(x, w, sizes, trans_b), rtol=1e-12, atol=1e-12)


def test_reference_without_host_sync_matches():
    """The accelerator formulation of the reference (row masks) equals the per-group loop."""
    from ascend_moe_ops.reference import grouped_gemm as ref
    x, w, sizes = _inputs("odd_97x129x61", torch.float64, False)
    gid = ref.row_groups(sizes, x.shape[0])
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    for e in range(w.shape[0]):
        out = torch.where((gid == e).unsqueeze(1), x @ w[e], out)
    torch.testing.assert_close(out, ref.grouped_gemm(x, w, sizes, False))


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("trans_b", [False, True], ids=["nn", "nt"])
def test_forward_matches_fp64(backend, dtype, case, trans_b):
    _skip_unsupported(backend, dtype, case)
    x, w, sizes = _inputs(case, dtype, trans_b)
    out = _run(backend, x, w, sizes, trans_b=trans_b)
    ref64 = _run("reference", x.double(), w.double(), sizes, trans_b=trans_b)
    lowp = _run("reference", x, w, sizes, trans_b=trans_b)
    assert out.dtype == dtype and out.shape == ref64.shape
    assert_close_to_ref(out, ref64, dtype=dtype, torch_lowp=lowp)
    used = int(sizes.sum())
    assert (out[used:] == 0).all(), "rows past sum(group_sizes) must be exactly zero"


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["E1", "E256_sparse", "K0", "odd_97x129x61", "zipf", "tiles"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["nn", "nt"])
def test_backward_matches_fp64(backend, dtype, case, trans_b):
    _skip_unsupported(backend, dtype, case)
    if backend == "triton" and case == "E256_sparse":
        pytest.skip("256 dW programs are slow in the interpreter; the forward covers E=256 there")
    x, w, sizes = _inputs(case, dtype, trans_b)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(x.shape[0], w.shape[1] if trans_b else w.shape[2], generator=g).to(dtype)

    def grads(bk, x0, w0, dy0):
        xx = x0.clone().requires_grad_()
        ww = w0.clone().requires_grad_()
        with amo.use_backend(bk):
            amo.grouped_gemm(xx, ww, sizes, trans_b=trans_b).backward(dy0)
        return xx.grad, ww.grad

    gx, gw = grads(backend, x, w, dy)
    rx, rw = grads("reference", x.double(), w.double(), dy.double())
    lx, lw = grads("reference", x, w, dy)
    assert_close_to_ref(gx, rx, dtype=dtype, torch_lowp=lx, name="grad x")
    assert_close_to_ref(gw, rw, dtype=dtype, torch_lowp=lw, name="grad weight")
    used = int(sizes.sum())
    assert (gx[used:] == 0).all(), "grad of rows past the sum must be exactly zero"
    empty = sizes == 0
    assert (gw[empty] == 0).all(), "grad of an empty group's weight must be exactly zero"


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_hygiene(backend, dtype):
    """NaN in unused rows or in the weights of empty groups never leaks; a NaN-poisoned heap does
    not leak into the output (every output element is written)."""
    _skip_unsupported(backend, dtype)
    x, w, sizes = _inputs("odd_97x129x61", dtype, False)
    used = int(sizes.sum())
    x[used:] = float("nan")
    w[sizes == 0] = float("nan")
    ref64 = _run("reference", x[:used].double(), w.double().nan_to_num(0.0), sizes)
    for _ in range(2):
        junk = torch.full((x.shape[0] * w.shape[2] * 4,), float("nan"), dtype=dtype)
        del junk  # freed NaN memory may be handed to the next allocation
        out = _run(backend, x, w, sizes)
        assert torch.isfinite(out).all()
    assert_close_to_ref(out[:used], ref64, dtype=dtype,
                        torch_lowp=_run("reference", x[:used], w.nan_to_num(0.0), sizes))
    assert (out[used:] == 0).all()
    xx = x.clone().requires_grad_()
    ww = w.clone().requires_grad_()
    with amo.use_backend(backend):
        amo.grouped_gemm(xx, ww, sizes).backward(torch.ones(x.shape[0], w.shape[2], dtype=dtype))
    assert (ww.grad[sizes == 0] == 0).all() and torch.isfinite(ww.grad[sizes != 0]).all()


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_int32_and_int64_sizes_agree(backend):
    _skip_unsupported(backend, torch.float32)
    x, w, sizes = _inputs("zipf" if backend != "triton" else "odd_97x129x61", torch.float32, False)
    a = _run(backend, x, w, sizes.to(torch.int32))
    b = _run(backend, x, w, sizes.to(torch.int64))
    assert torch.equal(a, b)


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_non_contiguous_inputs(backend):
    _skip_unsupported(backend, torch.float32)
    x, w, sizes = _inputs("odd_97x129x61", torch.float32, False)
    x_nc = torch.empty(x.shape[1], x.shape[0]).t()
    x_nc.copy_(x)
    w_nc = w.transpose(1, 2).contiguous().transpose(1, 2)  # [E, K, N] view of [E, N, K] storage
    assert not x_nc.is_contiguous() and not w_nc.is_contiguous()
    torch.testing.assert_close(_run(backend, x_nc, w_nc, sizes), _run(backend, x, w, sizes))


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_group_sizes_dw_direct(backend):
    """grouped_gemm_dw on its own (also the op behind the weight gradient) and its autograd."""
    _skip_unsupported(backend, torch.float32)
    g = torch.Generator().manual_seed(3)
    sizes = torch.tensor([5, 0, 9, 1])
    a = torch.randn(17, 11, generator=g, dtype=torch.float64)
    b = torch.randn(17, 7, generator=g, dtype=torch.float64)
    with amo.use_backend(backend):
        out = amo.grouped_gemm_dw(a.float(), b.float(), sizes)
    start, want = 0, torch.zeros(4, 11, 7, dtype=torch.float64)
    for e, n in enumerate(sizes.tolist()):
        want[e] = a[start:start + n].t() @ b[start:start + n]
        start += n
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert (out[1] == 0).all()
    aa, bb = a.clone().requires_grad_(), b.clone().requires_grad_()
    with amo.use_backend("reference"):
        torch.autograd.gradcheck(lambda p, q: amo.grouped_gemm_dw(p, q, sizes), (aa, bb))


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
@pytest.mark.parametrize("trans_b", [False, True])
def test_opcheck(backend, trans_b):
    _skip_unsupported(backend, torch.float32)
    x, w, sizes = _inputs("odd_97x129x61", torch.float32, trans_b)
    x, w = x[:40, :16].contiguous(), (w[:, :, :16] if trans_b else w[:, :16]).contiguous()
    sizes = torch.tensor([10, 0, 20, 1, 5])
    x.requires_grad_()
    w.requires_grad_()
    ops = ops_of(backend)  # the backend's own namespace
    torch.library.opcheck(ops("grouped_gemm"), (x, w, sizes, trans_b))
    torch.library.opcheck(ops("grouped_gemm_dw"), (x, torch.randn(40, 6, requires_grad=True), sizes))


def test_double_backward_reference():
    x, w, sizes = _inputs("odd_97x129x61", torch.float64, False)
    x, w = x[:30, :8].clone().requires_grad_(), w[:, :8, :5].clone().requires_grad_()
    sizes = torch.tensor([10, 0, 15, 1, 0])
    with amo.use_backend("reference"):
        torch.autograd.gradgradcheck(lambda a, b: amo.grouped_gemm(a, b, sizes), (x, w))


@pytest.mark.parametrize("trans_b", [False, True])
def test_compile_fullgraph(trans_b):
    x, w, sizes = _inputs("zipf", torch.float32, trans_b)

    def f(a, b, s):
        return (amo.grouped_gemm(a, b, s, trans_b=trans_b) * 2.0).relu().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled(xa, wa, sizes).backward()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    f(xb, wb, sizes).backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


@pytest.mark.parametrize("bad, match", [
    (dict(x=torch.randn(6)), "x must be 2-D"),
    (dict(x=torch.ones(6, 4, dtype=torch.int64)), "x must have dtype"),
    (dict(weight=torch.randn(3, 4)), "weight must be 3-D"),
    (dict(weight=torch.randn(3, 4, 5, dtype=torch.float64)), "weight must have dtype in \\(float32\\)"),
    (dict(weight=torch.randn(3, 5, 5)), "has K=5 but x has K=4"),
    (dict(weight=torch.randn(3, 4, 5), trans_b=True), "has K=5 but x has K=4"),
    (dict(weight=torch.randn(4, 4, 5)), "one entry per expert: weight has 4 experts"),
    (dict(group_sizes=torch.tensor([1.0, 2.0, 3.0])), "group_sizes must have dtype"),
    (dict(group_sizes=torch.tensor([[1, 2, 3]])), "group_sizes must be 1-D"),
    (dict(group_sizes=torch.tensor([4, 2, 3])), "sum\\(group_sizes\\) = 9 exceeds the 6 rows"),
    (dict(group_sizes=torch.tensor([4, -2, 3])), "group_sizes must be non-negative, got -2 for group 1"),
    (dict(weight=torch.randn(3, 4, 5, device="meta")), "weight is on meta"),
    (dict(trans_b=1), "trans_b must be a bool"),
])
@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_bad_inputs(backend, bad, match):
    args = dict(x=torch.randn(6, 4), weight=torch.randn(3, 4, 5), group_sizes=torch.tensor([1, 2, 3]),
                trans_b=False)
    args.update(bad)
    with amo.use_backend(backend), pytest.raises((ValueError, TypeError), match=match):
        amo.grouped_gemm(args["x"], args["weight"], args["group_sizes"], trans_b=args["trans_b"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in backends("grouped_gemm") if b != "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fine_grained_shape(backend, dtype):
    """Scaled-down fine-grained routing: 64 experts, Zipf sizes, K=512, N=256."""
    _skip_unsupported(backend, dtype)
    g = torch.Generator().manual_seed(0)
    sizes = zipf_sizes(64, 2000, gen=g)
    x = torch.randn(2048, 512, generator=g).to(dtype)
    w = (torch.randn(64, 512, 256, generator=g) / 512 ** 0.5).to(dtype)
    out = _run(backend, x, w, sizes)
    assert_close_to_ref(out, _run("reference", x.double(), w.double(), sizes), dtype=dtype,
                        torch_lowp=_run("reference", x, w, sizes))


def test_gpu_tile_defaults_are_the_sweeps_first_config(monkeypatch):
    """The Triton kernels' GPU tiles are the ones the GPU sweep lists first (its 'default' rows),
    so a sweep on the next GPU compares against what really runs."""
    from ascend_moe_ops.benchmark.suite import gpu_tune_grouped_gemm as tune
    from ascend_moe_ops.triton_ref import grouped_gemm as tg

    monkeypatch.setattr(tg, "_interpreted", lambda: False)
    monkeypatch.setattr(tg, "_on_amd", lambda: False)  # the sweep ran on an NVIDIA GPU
    g, d = tg.gemm_config(torch.bfloat16), tg.dw_config(torch.bfloat16)
    assert tuple(g[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")) == tune.FWD_CONFIGS[0]
    assert tuple(d[k] for k in ("BLOCK_P", "BLOCK_Q", "BLOCK_M", "num_warps", "num_stages")) == tune.DW_CONFIGS[0]
