"""mla_attention: every backend x dtype x (causal / not) x (batch / varlen) forward and backward
against the fp64 reference (2 x PyTorch's own error), bitwise-equal gradients between the two
recompute modes, saved-tensor hooks proving that recompute="kv" keeps no per-head K or V, opcheck,
torch.compile, bad input."""

import inspect

import pytest
import torch

import ascend_moe_ops as amo
from ascend_moe_ops.testing import assert_close_to_ref, torch_mla_attention
from conftest import attention_parity_grid, backends, ops_of, skip_reference_lowp

_DEFAULT_CAUSAL = inspect.signature(amo.mla_attention).parameters["causal"].default
OP = "mla_attention_fwd"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (H, Dn, Dr, Dv, Dc): the real 128/64/128/512 head dims with few heads on the fast paths,
# scaled down (16/8/16/32: still a split nope + rope score) in the Triton interpreter.
DIMS = {"triton": (2, 16, 8, 16, 32), "default": (2, 128, 64, 128, 512)}
VARLEN = {"triton": [0, 1, 12, 13, 30], "default": [0, 1, 98, 99, 160]}
BATCH = {"triton": (2, 13), "default": (2, 37)}
SCALE = 0.1352  # DeepSeek-V3's YaRN-adjusted scale, not 192 ** -0.5


def _key(backend):
    return "triton" if backend == "triton" else "default"


def _skip(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and not torch.cuda.is_available():
        pytest.skip("tl.dot on bf16 is wrong in the Triton interpreter; bf16 Triton runs on GPU only")
    if backend == "ascendc-emu" and dtype == torch.float32:
        pytest.skip("no fp32 on the Ascend Cube path (the refusal is tested by test_ascend_path_refuses_fp32)")


def _fp(backend):
    """dtype of the fp32 tests on a backend: fp16 on the Ascend path (no fp32 Cube kernels)."""
    return torch.float16 if backend == "ascendc-emu" else torch.float32


def _inputs(tok, H, Dn, Dr, Dv, Dc, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*tok, H, Dn + Dr, generator=g, dtype=torch.float64)
    c = torch.randn(*tok, Dc, generator=g, dtype=torch.float64)
    kpe = torch.randn(*tok, Dr, generator=g, dtype=torch.float64)
    w = torch.randn(H * (Dn + Dv), Dc, generator=g, dtype=torch.float64) / Dc ** 0.5
    do = torch.randn(*tok, H, Dv, generator=g, dtype=torch.float64)
    return q, c, kpe, w, do


def _run(backend, tensors, dtype, dims, recompute="kv", **kw):
    H, Dn, Dr, Dv, Dc = dims
    *xs, do = (t.to(dtype).clone() for t in tensors)
    for t in xs:
        t.requires_grad_()
    with amo.use_backend(backend):
        out = amo.mla_attention(*xs, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, recompute=recompute, **kw)
        out.backward(do)
    return [out.detach()] + [t.grad for t in xs]


def _run_torch(tensors, dtype, dims, causal=None, softmax_scale=None, cu_seqlens=None):
    """PyTorch's own MLA in ``dtype`` (testing.torch_mla_attention, autograd): the 2x-rule
    baseline. Same return layout as :func:`_run`."""
    causal = _DEFAULT_CAUSAL if causal is None else causal
    H, Dn, Dr, Dv, Dc = dims
    q, c, kpe, w, do = (t.to(dtype).clone() for t in tensors)
    shapes = [t.shape for t in (q, c, kpe)]
    if cu_seqlens is None:  # [B, S, ...] -> packed [B*S, ...]
        B, S = q.shape[:2]
        cu_seqlens = torch.arange(B + 1) * S
        q, c, kpe, do = (t.flatten(0, 1) for t in (q, c, kpe, do))
    xs = [t.detach().requires_grad_() for t in (q, c, kpe, w)]
    out, _ = torch_mla_attention(*xs, cu_seqlens, num_heads=H, qk_nope_dim=Dn, v_dim=Dv,
                                 causal=causal, softmax_scale=softmax_scale)
    out.backward(do)
    grads = [t.grad for t in xs]
    return [out.detach().reshape(shapes[0][:-1] + (Dv,))] + [
        g.reshape(sh) for g, sh in zip(grads[:3], shapes)] + [grads[3]]


NAMES = ("out", "dq", "dc_kv", "dk_pe", "dw_kv_up")


@attention_parity_grid(OP, DTYPES)
def test_matches_reference(backend, dtype, causal, layout):
    _skip(backend, dtype)
    skip_reference_lowp(backend, dtype)
    dims = DIMS[_key(backend)]
    if layout == "batch":
        tensors = _inputs(BATCH[_key(backend)], *dims)
        kw = dict(causal=causal, softmax_scale=SCALE)
    else:
        cu = torch.tensor(VARLEN[_key(backend)], dtype=torch.int64)
        tensors = _inputs((int(cu[-1]),), *dims)
        kw = dict(causal=causal, softmax_scale=SCALE, cu_seqlens=cu)
    got = _run(backend, tensors, dtype, dims, **kw)
    ref = _run("reference", tensors, torch.float64, dims, **kw)
    low = _run_torch(tensors, dtype, dims, **kw)
    for name, a, r, lo in zip(NAMES, got, ref, low):
        assert_close_to_ref(a, r, dtype=dtype, torch_lowp=lo, name=f"{backend} {name}")


@pytest.mark.parametrize("backend", backends(OP))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_recompute_modes_bitwise_equal(backend, dtype):
    _skip(backend, dtype)
    dims = DIMS[_key(backend)]
    cu = torch.tensor(VARLEN[_key(backend)])
    tensors = _inputs((int(cu[-1]),), *dims, seed=5)
    a = _run(backend, tensors, dtype, dims, recompute="kv", cu_seqlens=cu, softmax_scale=SCALE)
    b = _run(backend, tensors, dtype, dims, recompute="none", cu_seqlens=cu, softmax_scale=SCALE)
    for name, x, y in zip(NAMES, a, b):
        assert torch.equal(x, y), f"{name} differs between recompute='kv' and 'none'"


def _saved(backend, recompute, dims, T=24):
    H, Dn, Dr, Dv, Dc = dims
    q, c, kpe, w, do = (t.to(_fp(backend)).requires_grad_() for t in _inputs((1, T), *dims))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with amo.use_backend(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = amo.mla_attention(q, c, kpe, w, num_heads=H, qk_nope_dim=Dn, v_dim=Dv,
                                softmax_scale=SCALE, recompute=recompute)
    return saved, (q, c, kpe, w, out)


@pytest.mark.parametrize("backend", backends(OP))
def test_recompute_kv_saves_no_per_head_k_or_v(backend):
    dims = DIMS[_key(backend)]
    H, Dn, Dr, Dv, Dc = dims
    T = 24
    saved, (q, c, kpe, w, out) = _saved(backend, "kv", dims, T)
    n = sum(t.numel() for t in saved)
    # q, c_kv, k_pe, w_kv_up, out, lse [H, T] and cu_seqlens [2]; nothing else
    expected = q.numel() + c.numel() + kpe.numel() + w.numel() + out.numel() + H * T + 2
    assert n == expected, [tuple(t.shape) for t in saved]
    allowed = {t.data_ptr() for t in (q, c, kpe, w, out)}
    for t in saved:
        ok = (t.numel() == 0 or t.data_ptr() in allowed or (tuple(t.shape) == (H, T) and t.dtype == torch.float32)
              or (t.dtype in (torch.int32, torch.int64) and t.dim() == 1))
        assert ok, f"unexpected saved tensor of shape {tuple(t.shape)} (a per-head K or V?)"
    saved_none, _ = _saved(backend, "none", dims, T)
    extra = sum(t.numel() for t in saved_none) - n
    assert extra == T * H * (Dn + Dv), "recompute='none' saves exactly the up-projected K_nope and V"


@pytest.mark.parametrize("backend", backends(OP))
def test_lse_of_a_nan_row_is_nan(backend):
    """A NaN in a query row gives that row lse NaN (the reference), not -inf, the marker of a row that
    sees no key (native, Triton and AscendC gave -inf before 2026-12-07); the other rows are unchanged."""
    H, Dn, Dr, Dv, Dc = DIMS["triton"]
    q, c, kpe, w, _ = (t.to(_fp(backend)) for t in _inputs((6,), H, Dn, Dr, Dv, Dc, seed=5))
    q[2, 1, 0] = float("nan")
    cu = torch.tensor([0, 6])
    out, lse, _ = ops_of(backend)(OP)(q, c, kpe, w, cu, 6, H, Dn, Dv, SCALE, True, False)
    _, want, _ = ops_of("reference")(OP)(q.double(), c.double(), kpe.double(), w.double(), cu, 6, H, Dn, Dv, SCALE,
                                         True, False)
    assert torch.isnan(want[1, 2]) and torch.isnan(lse[1, 2]), lse[1, 2]
    ok = ~torch.isnan(want)
    torch.testing.assert_close(lse[ok].double(), want[ok], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", backends(OP))
def test_opcheck(backend):
    H, Dn, Dr, Dv, Dc = DIMS["triton"]
    q, c, kpe, w, do = (t.to(_fp(backend)) for t in _inputs((10,), H, Dn, Dr, Dv, Dc))
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    ops = ops_of(backend)  # the backend's own namespace
    for save_kv in (False, True):
        args = tuple(t.clone().requires_grad_() for t in (q, c, kpe, w))
        torch.library.opcheck(ops("mla_attention_fwd"), args + (cu, 7, H, Dn, Dv, SCALE, True, save_kv))
    out, lse, kv = ops("mla_attention_fwd")(q, c, kpe, w, cu, 7, H, Dn, Dv, SCALE, True, False)
    torch.library.opcheck(ops("mla_attention_bwd"), (do, q, c, kpe, w, out, lse, kv, cu, 7, H, Dn, Dv, SCALE, True))


@pytest.mark.parametrize("backend", backends(OP))
@pytest.mark.parametrize("recompute", ["kv", "none"])
@pytest.mark.parametrize("layout", ["varlen", "batch"])
def test_zero_tokens_give_zero_gradients(backend, recompute, layout):
    """T = 0 (docs: valid, empty results) forward and backward on every backend: the Ascend
    composition's backward used to fail ("cannot reshape tensor of 0 elements into shape [0, -1]"),
    its kernels now take the op's empty case as the others do; the public op and the backend's
    namespace alike."""
    H, Dn, Dr, Dv, Dc = 2, 8, 4, 8, 12
    dt = _fp(backend)
    tok = (0,) if layout == "varlen" else (0, 5)
    kw = dict(cu_seqlens=torch.tensor([0, 0]), max_seqlen=0) if layout == "varlen" else {}
    xs = [torch.zeros(*s, dtype=dt, requires_grad=True)
          for s in (tok + (H, Dn + Dr), tok + (Dc,), tok + (Dr,), (H * (Dn + Dv), Dc))]
    with amo.use_backend(backend):
        out = amo.mla_attention(*xs, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, softmax_scale=SCALE,
                                recompute=recompute, **kw)
        assert out.shape == tok + (H, Dv)
        out.sum().backward()
    for x in xs:
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()
    # the backend's own ops, forward and backward, from the empty forward's saved tensors
    ops = ops_of(backend)
    q, c, kpe = (x.detach().reshape(-1, *x.shape[len(tok):]) for x in xs[:3])
    w = xs[3].detach()
    cu = torch.tensor([0, 0])
    o, lse, kv = ops(OP)(q, c, kpe, w, cu, 0, H, Dn, Dv, SCALE, False, recompute == "none")
    grads = ops("mla_attention_bwd")(torch.zeros_like(o), q, c, kpe, w, o, lse, kv, cu, 0, H, Dn, Dv, SCALE, False)
    for g, x in zip(grads, (q, c, kpe, w)):
        assert g.shape == x.shape and not g.any()


@pytest.mark.parametrize("backend", [b for b in backends(OP) if b == "ascendc-emu"])
def test_ascend_path_refuses_fp32(backend):
    H, Dn, Dr, Dv, Dc = DIMS["triton"]
    q, c, kpe, w, do = (t.float() for t in _inputs((6,), H, Dn, Dr, Dv, Dc))
    with amo.use_backend(backend), pytest.raises(TypeError, match="mla_attention_fwd: q must have dtype in \\(float16, bfloat16\\)"):
        amo.mla_attention(q, c, kpe, w, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, softmax_scale=SCALE,
                          cu_seqlens=torch.tensor([0, 6]))


def test_compile_fullgraph():
    H, Dn, Dr, Dv, Dc = DIMS["triton"]
    q, c, kpe, w, do = (t.float() for t in _inputs((2, 9), H, Dn, Dr, Dv, Dc))

    def f(q, c, kpe, w):
        return amo.mla_attention(q, c, kpe, w, num_heads=H, qk_nope_dim=Dn, v_dim=Dv,
                                 softmax_scale=SCALE) + 1.0

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    res = []
    for fn in (compiled, f):
        xs = [t.clone().requires_grad_() for t in (q, c, kpe, w)]
        y = fn(*xs)
        y.backward(do)
        res.append([y] + [x.grad for x in xs])
    for a, b in zip(*res):
        torch.testing.assert_close(a, b)


def test_k_pe_with_singleton_head_dim():
    H, Dn, Dr, Dv, Dc = DIMS["triton"]
    q, c, kpe, w, _ = (t.float() for t in _inputs((1, 6), H, Dn, Dr, Dv, Dc))
    kw = dict(num_heads=H, qk_nope_dim=Dn, v_dim=Dv, softmax_scale=SCALE)
    torch.testing.assert_close(amo.mla_attention(q, c, kpe[:, :, None, :], w, **kw),
                               amo.mla_attention(q, c, kpe, w, **kw))


@pytest.mark.parametrize("bad, match", [
    (dict(w_kv_up=torch.randn(2 * 30, 12)), r"w_kv_up must have shape \(64, 12\)"),
    (dict(q=torch.randn(1, 5, 3, 24)), "q must have num_heads=2 heads"),
    (dict(q=torch.randn(1, 5, 2, 16)), "must be qk_nope_dim=16 \\+ a rope dim"),
    (dict(k_pe=torch.randn(1, 5, 6)), "k_pe must have shape"),
    (dict(c_kv=torch.randn(1, 4, 12)), "c_kv must have shape"),
    (dict(c_kv=torch.randn(1, 5, 12).half()), "c_kv must have dtype"),
    (dict(recompute="all"), "recompute must be 'kv' or 'none'"),
    (dict(v_dim=32, w_kv_up=torch.randn(2 * 48, 12)), "v_dim=32 > d_qk=24 is not supported"),
    (dict(k_pe=torch.randn(1, 5, 8, device="meta")), "k_pe is on meta"),
    (dict(cu_seqlens=torch.tensor([0, 2, 1, 5])), "packed"),
])
def test_bad_inputs(bad, match):
    args = dict(q=torch.randn(1, 5, 2, 24), c_kv=torch.randn(1, 5, 12), k_pe=torch.randn(1, 5, 8),
                w_kv_up=torch.randn(2 * 32, 12), num_heads=2, qk_nope_dim=16, v_dim=16,
                softmax_scale=SCALE)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        amo.mla_attention(args.pop("q"), args.pop("c_kv"), args.pop("k_pe"), args.pop("w_kv_up"), **args)


def test_bad_cu_seqlens_packed():
    q, c, kpe = torch.randn(5, 2, 24), torch.randn(5, 12), torch.randn(5, 8)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        amo.mla_attention(q, c, kpe, torch.randn(64, 12), num_heads=2, qk_nope_dim=16, v_dim=16,
                          softmax_scale=SCALE, cu_seqlens=torch.tensor([0, 3, 2, 5]), max_seqlen=5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in backends(OP) if b == "native"])
def test_native_real_dims_longer_sequence(backend):
    """Real head dims, 16 heads, a 300-token sequence (three 128-row blocks, the last partial)."""
    dims = (16, 128, 64, 128, 512)
    cu = torch.tensor([0, 300, 301])
    tensors = _inputs((301,), *dims, seed=7)
    kw = dict(causal=True, softmax_scale=SCALE, cu_seqlens=cu)
    got = _run(backend, tensors, torch.bfloat16, dims, **kw)
    ref = _run("reference", tensors, torch.float64, dims, **kw)
    low = _run_torch(tensors, torch.bfloat16, dims, **kw)
    for name, a, r, lo in zip(NAMES, got, ref, low):
        assert_close_to_ref(a, r, dtype=torch.bfloat16, torch_lowp=lo, name=f"{backend} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_on_gpu_real_dims(dtype):
    """Triton on a CUDA GPU (bf16 included), real head dims, varlen, vs the fp64 reference."""
    dims = (4, 128, 64, 128, 512)
    cu = torch.tensor([0, 1, 98, 99, 300], device="cuda", dtype=torch.int32)
    tensors = [t.cuda() for t in _inputs((300,), *dims, seed=9)]
    kw = dict(causal=True, softmax_scale=SCALE, cu_seqlens=cu)
    got = _run("triton", tensors, dtype, dims, **kw)
    ref = _run("reference", tensors, torch.float64, dims, **kw)
    low = _run_torch(tensors, dtype, dims, **kw)
    for name, a, r, lo in zip(NAMES, got, ref, low):
        assert_close_to_ref(a, r, dtype=dtype, torch_lowp=lo, name=f"triton gpu {name}")
