"""The op contracts at the op boundary, on every backend present: a catalogue of bad inputs run
through BOTH the public function and ``torch.ops.<backend namespace>.<op>`` directly (what
torch.compile graphs and other libraries call), asserting the error type and that the message names
the argument; and the valid edge cases (B = 0, H = 0, T = 0, empty groups) giving empty or zero
results instead of errors."""

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Type

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ascend_moe_ops as amo
from conftest import backends, ops_of

F16 = torch.float16
BIG = 1 << 40


def _f(*shape, dtype=F16, device="cpu"):
    return torch.randn(*shape).to(dtype).to(device)


@dataclass
class Case:
    id: str
    op: str
    direct: Optional[Callable[[], tuple]]    # arguments of torch.ops.<ns>.<op> (None: API rule only)
    public: Optional[Callable[[], object]]   # the same mistake through the public function
    exc: Type[Exception]                     # error of both (unless exc_direct is given)
    names: str                               # regex: the message names the argument
    exc_direct: Optional[Type[Exception]] = None


# ----------------------------------------------------------------------------------- moe_permute
def _perm(**kw):
    a = dict(tokens=_f(4, 8), routing=torch.tensor([[0, 1], [2, 0], [1, 1], [0, 2]]),
              probs=torch.rand(4, 2), num_experts=3, capacity=None, align=1, num_out_tokens=None)
    a.update(kw)
    return a


def _perm_direct(**kw):
    a = _perm(**kw)
    return (a["tokens"], a["routing"], a["probs"], a["num_experts"], a["capacity"], a["align"], a["num_out_tokens"])


def _perm_public(**kw):
    a = _perm(**kw)
    return lambda: amo.moe_permute(a["tokens"], a["routing"], a["probs"], num_experts=a["num_experts"],
                                   capacity=a["capacity"], align=a["align"], num_out_tokens=a["num_out_tokens"])


def _perm_case(id, exc, names, **kw):
    return Case(id, "moe_permute", lambda: _perm_direct(**kw), _perm_public(**kw), exc, names)


PERMUTE = [
    _perm_case("probs_shape", ValueError, "probs", probs=torch.rand(4, 3)),
    _perm_case("probs_dtype", TypeError, "probs", probs=torch.ones(4, 2, dtype=torch.int64)),
    _perm_case("probs_meta", ValueError, "probs", probs=torch.rand(4, 2, device="meta")),
    _perm_case("routing_rows", ValueError, "routing", routing=torch.zeros(5, 2, dtype=torch.int64)),
    _perm_case("routing_dtype", TypeError, "routing", routing=torch.zeros(4, 2)),
    _perm_case("routing_meta", ValueError, "routing", routing=torch.zeros(4, 2, dtype=torch.int64, device="meta")),
    _perm_case("routing_1d", ValueError, "routing", routing=torch.zeros(4, dtype=torch.int64), probs=None),
    _perm_case("id_too_big", ValueError, "routing", routing=torch.tensor([[0, 1], [2, 3], [0, 0], [1, 1]])),
    _perm_case("id_below_minus_one", ValueError, "routing", routing=torch.tensor([[0, 1], [2, -2], [0, 0], [1, 1]])),
    _perm_case("tokens_dtype", TypeError, "tokens", tokens=torch.ones(4, 8, dtype=torch.int32)),
    _perm_case("tokens_1d", ValueError, "tokens", tokens=_f(4)),
    _perm_case("capacity_zero", ValueError, "capacity", capacity=0),
    _perm_case("capacity_huge", ValueError, "capacity", capacity=BIG),
    _perm_case("capacity_align", ValueError, "align", capacity=3, align=2),
    _perm_case("capacity_and_num_out", ValueError, "num_out_tokens", capacity=2, num_out_tokens=8),
    _perm_case("align_zero", ValueError, "align", align=0),
    _perm_case("align_huge", ValueError, "align", align=BIG),
    _perm_case("num_out_huge", ValueError, "num_out_tokens", num_out_tokens=BIG),
    _perm_case("num_out_negative", ValueError, "num_out_tokens", num_out_tokens=-1),
    _perm_case("num_experts_huge", ValueError, "num_experts", num_experts=BIG),
    _perm_case("num_experts_zero", ValueError, "num_experts", num_experts=0, routing=torch.full((4, 2), -1)),
    _perm_case("mask_num_experts", ValueError, "num_experts", routing=torch.ones(4, 5, dtype=torch.bool),
               probs=None, num_experts=4),
]


# --------------------------------------------------------------------------------- moe_unpermute
def _unp(**kw):
    a = dict(permuted=_f(8, 8), row_id_map=torch.tensor([[0, 1], [2, 3], [4, -1]], dtype=torch.int32),
              probs=torch.rand(3, 2))
    a.update(kw)
    return a


def _unp_case(id, exc, names, **kw):
    return Case(id, "moe_unpermute", lambda: tuple(_unp(**kw).values()),
                lambda: amo.moe_unpermute(*_unp(**kw).values()), exc, names)


UNPERMUTE = [
    _unp_case("probs_shape", ValueError, "probs", probs=torch.rand(3, 3)),
    _unp_case("probs_meta", ValueError, "probs", probs=torch.rand(3, 2, device="meta")),
    _unp_case("map_dtype", TypeError, "row_id_map", row_id_map=torch.zeros(3, 2)),
    _unp_case("map_1d", ValueError, "row_id_map", row_id_map=torch.zeros(3, dtype=torch.int64), probs=None),
    _unp_case("row_too_big", ValueError, "row_id_map", row_id_map=torch.tensor([[0, 1], [2, 8], [3, -1]])),
    _unp_case("row_below_minus_one", ValueError, "row_id_map", row_id_map=torch.tensor([[0, 1], [2, -5], [3, -1]])),
    _unp_case("row_huge", ValueError, "row_id_map", row_id_map=torch.tensor([[0, 1], [2, BIG], [3, -1]])),
    _unp_case("permuted_dtype", TypeError, "permuted", permuted=torch.ones(8, 8, dtype=torch.int32)),
    _unp_case("permuted_1d", ValueError, "permuted", permuted=_f(8)),
    Case("bwd_grad_rows", "moe_unpermute_backward",
         lambda: (_f(2, 8), _f(8, 8), torch.tensor([[0, 1], [2, 3], [4, -1]]), None), None, ValueError, "grad_out"),
    Case("bwd_map_range", "moe_unpermute_backward",
         lambda: (_f(3, 8), _f(8, 8), torch.tensor([[0, 1], [2, 9], [4, -1]]), None), None, ValueError, "row_id_map"),
]


# ---------------------------------------------------------------------------------- grouped_gemm
def _gg(**kw):
    a = dict(x=_f(6, 4), weight=_f(3, 4, 5), group_sizes=torch.tensor([1, 2, 3]), trans_b=False)
    a.update(kw)
    return a


def _gg_case(id, exc, names, **kw):
    return Case(id, "grouped_gemm", lambda: tuple(_gg(**kw).values()),
                lambda: amo.grouped_gemm(*list(_gg(**kw).values())[:3], trans_b=_gg(**kw)["trans_b"]), exc, names)


GROUPED = [
    _gg_case("k_mismatch", ValueError, "weight.*K=5 but x has K=4", weight=_f(3, 5, 5)),
    _gg_case("k_mismatch_trans_b", ValueError, "weight.*K=5 but x has K=4", weight=_f(3, 4, 5), trans_b=True),
    _gg_case("sizes_len", ValueError, "group_sizes", group_sizes=torch.tensor([1, 2])),
    _gg_case("sizes_2d", ValueError, "group_sizes", group_sizes=torch.tensor([[1, 2, 3]])),
    _gg_case("sizes_dtype", TypeError, "group_sizes", group_sizes=torch.tensor([1.0, 2.0, 3.0])),
    _gg_case("sizes_negative", ValueError, "group_sizes", group_sizes=torch.tensor([4, -2, 3])),
    _gg_case("sizes_sum", ValueError, "group_sizes", group_sizes=torch.tensor([4, 2, 3])),
    _gg_case("sizes_sum_overflows_int64", ValueError, "group_sizes",
             group_sizes=torch.tensor([1 << 62, 1 << 62, 1 << 62])),
    _gg_case("sizes_wrap_to_small_sum", ValueError, "group_sizes",
             group_sizes=torch.tensor([(1 << 63) - 1, 2, 0])),
    _gg_case("sizes_meta", ValueError, "group_sizes", group_sizes=torch.tensor([1, 2, 3], device="meta")),
    _gg_case("weight_dtype", TypeError, "weight", weight=_f(3, 4, 5, dtype=torch.float32)),
    _gg_case("weight_meta", ValueError, "weight", weight=_f(3, 4, 5, device="meta")),
    _gg_case("weight_2d", ValueError, "weight", weight=_f(3, 4)),
    _gg_case("x_dtype", TypeError, "x", x=torch.ones(6, 4, dtype=torch.int64)),
    Case("dw_rows", "grouped_gemm_dw", lambda: (_f(6, 4), _f(5, 3), torch.tensor([1, 2, 3])),
         lambda: amo.grouped_gemm_dw(_f(6, 4), _f(5, 3), torch.tensor([1, 2, 3])), ValueError, "a and b"),
    Case("dw_sizes_overflow", "grouped_gemm_dw", lambda: (_f(6, 4), _f(6, 3), torch.tensor([1 << 62] * 4)),
         lambda: amo.grouped_gemm_dw(_f(6, 4), _f(6, 3), torch.tensor([1 << 62] * 4)), ValueError, "group_sizes"),
    Case("dw_sizes_meta", "grouped_gemm_dw", lambda: (_f(6, 4), _f(6, 3), torch.tensor([1, 2], device="meta")),
         None, ValueError, "group_sizes"),
]


# ------------------------------------------------------------------------------- flash attention
def _fa(**kw):
    """Arguments of flash_attention_fwd; ``cu_seqlens`` / ``max_seqlen`` set the q and k ones alike
    (the same tensor twice, as the public one-argument form passes them)."""
    cu = kw.pop("cu_seqlens", torch.tensor([0, 4, 6]))
    ms = kw.pop("max_seqlen", 4)
    a = dict(q=_f(6, 2, 8), k=_f(6, 2, 8), v=_f(6, 2, 8), k_rope=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
             max_seqlen_q=ms, max_seqlen_k=ms, causal=True, softmax_scale=0.35)
    a.update(kw)
    return a


def _fa_case(id, exc, names, exc_direct=None, **kw):
    def public():
        a = _fa(**kw)
        if a["cu_seqlens_q"] is a["cu_seqlens_k"] and a["max_seqlen_q"] == a["max_seqlen_k"]:
            packed = dict(cu_seqlens=a["cu_seqlens_q"], max_seqlen=a["max_seqlen_q"])
        else:
            packed = {n: a[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")}
        return amo.flash_attention(a["q"], a["k"], a["v"], causal=a["causal"], softmax_scale=a["softmax_scale"],
                                   **packed)
    return Case(id, "flash_attention_fwd", lambda: tuple(_fa(**kw).values()), public, exc, names, exc_direct)


def _fa_bwd(**kw):
    a = _fa()
    q, k, v, cu = a["q"], a["k"], a["v"], a["cu_seqlens_q"]
    b = dict(grad_out=_f(6, 2, 8), q=q, k=k, v=v, k_rope=None, out=_f(6, 2, 8),
             lse=torch.zeros(2, 6), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4, causal=True,
             softmax_scale=0.35)
    b.update(kw)
    return tuple(b.values())


ATTENTION = [
    _fa_case("k_shorter_than_q", ValueError, "cu_seqlens_k must end", k=_f(4, 2, 8), v=_f(4, 2, 8)),
    _fa_case("k_heads", ValueError, "k", k=_f(6, 3, 8)),
    _fa_case("k_head_dim", ValueError, "k head dim", k=_f(6, 2, 6)),
    _fa_case("v_shorter_than_q", ValueError, "v", v=_f(5, 2, 8)),
    _fa_case("k_dtype", TypeError, "k", k=_f(6, 2, 8, dtype=torch.float32)),
    _fa_case("q_dtype", TypeError, "q", q=torch.ones(6, 2, 8, dtype=torch.int32)),
    _fa_case("v_meta", ValueError, "v", v=_f(6, 2, 8, device="meta")),
    _fa_case("cu_meta", ValueError, "cu_seqlens", cu_seqlens=torch.tensor([0, 4, 6], device="meta")),
    _fa_case("cu_dtype", TypeError, "cu_seqlens", cu_seqlens=torch.tensor([0.0, 4.0, 6.0])),
    _fa_case("cu_end", ValueError, "cu_seqlens", cu_seqlens=torch.tensor([0, 4, 5])),
    _fa_case("cu_start", ValueError, "cu_seqlens", cu_seqlens=torch.tensor([1, 4, 6])),
    _fa_case("cu_decreasing", ValueError, "cu_seqlens", cu_seqlens=torch.tensor([0, 5, 3, 6])),
    _fa_case("max_seqlen_small", ValueError, "max_seqlen", max_seqlen=3),
    _fa_case("causal_not_bool", TypeError, "causal", exc_direct=RuntimeError, causal="no"),
    _fa_case("scale_inf", ValueError, "softmax_scale", softmax_scale=float("inf")),
    # a finite double that is inf in float32, the accumulation type below float64 inputs
    _fa_case("scale_inf_in_fp32", ValueError, "softmax_scale must be finite in float32", softmax_scale=1e39),
    # the two-length form (cu_seqlens_q / cu_seqlens_k) and GQA/MQA
    _fa_case("hq_not_multiple_of_hkv", ValueError, "k must have a number of heads", q=_f(6, 4, 8), k=_f(6, 3, 8),
             v=_f(6, 3, 8)),
    _fa_case("v_heads_differ_from_k", ValueError, "v must have shape", k=_f(6, 1, 8)),
    _fa_case("v_tokens_differ_from_k", ValueError, "v must have shape", k=_f(9, 2, 8),
             cu_seqlens_k=torch.tensor([0, 4, 9]), max_seqlen_k=5),
    _fa_case("cu_k_wrong_length", ValueError, "cu_seqlens_k must have the B\\+1 = 3 entries",
             cu_seqlens_k=torch.tensor([0, 6])),
    _fa_case("cu_k_wrong_last_value", ValueError, "cu_seqlens_k must end", cu_seqlens_k=torch.tensor([0, 4, 5])),
    _fa_case("cu_k_decreasing", ValueError, "cu_seqlens_k must be non-decreasing",
             cu_seqlens_k=torch.tensor([0, 5, 3]), k=_f(3, 2, 8), v=_f(3, 2, 8)),
    _fa_case("cu_k_dtype", TypeError, "cu_seqlens_k", cu_seqlens_k=torch.tensor([0.0, 4.0, 6.0])),
    _fa_case("cu_k_meta", ValueError, "cu_seqlens_k", cu_seqlens_k=torch.tensor([0, 4, 6], device="meta")),
    _fa_case("max_seqlen_k_small", ValueError, "max_seqlen_k", k=_f(9, 2, 8), v=_f(9, 2, 8),
             cu_seqlens_k=torch.tensor([0, 7, 9]), max_seqlen_k=6),
    Case("k_rope_tokens_of_q", "flash_attention_fwd",  # k_rope has k's tokens (no public argument)
         lambda: tuple(_fa(q=_f(6, 2, 12), k=_f(9, 2, 8), v=_f(9, 2, 8), k_rope=_f(6, 4),
                           cu_seqlens_k=torch.tensor([0, 4, 9]), max_seqlen_k=5).values()),
         None, ValueError, "k_rope must have shape \\(9, D_r\\)"),
    Case("bwd_lse_shape", "flash_attention_bwd", lambda: _fa_bwd(lse=torch.zeros(6, 2)), None, ValueError, "lse"),
    Case("bwd_lse_dtype", "flash_attention_bwd", lambda: _fa_bwd(lse=torch.zeros(2, 6, dtype=F16)), None,
         TypeError, "lse must be float32"),
    Case("bwd_grad_shape", "flash_attention_bwd", lambda: _fa_bwd(grad_out=_f(6, 2, 4)), None, ValueError,
         "grad_out"),
    Case("bwd_out_meta", "flash_attention_bwd", lambda: _fa_bwd(out=_f(6, 2, 8, device="meta")), None,
         ValueError, "out"),
]


# --------------------------------------------------------------------------------------------- MLA
H, DN, DR, DV, DC = 2, 8, 4, 8, 12


def _mla(**kw):
    a = dict(q=_f(5, H, DN + DR), c_kv=_f(5, DC), k_pe=_f(5, DR), w_kv_up=_f(H * (DN + DV), DC),
             cu_seqlens=torch.tensor([0, 5]), max_seqlen=5, num_heads=H, qk_nope_dim=DN, v_dim=DV,
             softmax_scale=0.3, causal=True, save_kv=False)
    a.update(kw)
    return a


def _mla_case(id, exc, names, exc_direct=None, **kw):
    def public():
        a = _mla(**kw)
        return amo.mla_attention(a["q"], a["c_kv"], a["k_pe"], a["w_kv_up"], num_heads=a["num_heads"],
                                 qk_nope_dim=a["qk_nope_dim"], v_dim=a["v_dim"],
                                 softmax_scale=a["softmax_scale"], causal=a["causal"],
                                 cu_seqlens=a["cu_seqlens"], max_seqlen=a["max_seqlen"])
    return Case(id, "mla_attention_fwd", lambda: tuple(_mla(**kw).values()), public, exc, names, exc_direct)


MLA = [
    _mla_case("w_shape", ValueError, "w_kv_up", w_kv_up=_f(H * 7, DC)),
    _mla_case("k_pe_dim", ValueError, "k_pe", k_pe=_f(5, DR + 2)),
    _mla_case("c_kv_dtype", TypeError, "c_kv", c_kv=_f(5, DC, dtype=torch.float32)),
    _mla_case("c_kv_meta", ValueError, "c_kv", c_kv=_f(5, DC, device="meta")),
    _mla_case("heads", ValueError, "num_heads", num_heads=3, w_kv_up=_f(3 * (DN + DV), DC)),
    _mla_case("no_rope_dim", ValueError, "qk_nope_dim", qk_nope_dim=DN + DR, w_kv_up=_f(H * (DN + DR + DV), DC)),
    _mla_case("cu_end", ValueError, "cu_seqlens", cu_seqlens=torch.tensor([0, 4])),
    _mla_case("causal_not_bool", TypeError, "causal", exc_direct=RuntimeError, causal="no"),
    _mla_case("scale_inf_in_fp32", ValueError, "softmax_scale must be finite in float32", softmax_scale=-1e39),
]

CATALOGUE = PERMUTE + UNPERMUTE + GROUPED + ATTENTION + MLA


def _params():
    for case in CATALOGUE:
        for backend in backends(case.op):
            yield pytest.param(case, backend, id=f"{case.op}-{case.id}-{backend}")


@pytest.mark.parametrize("case,backend", list(_params()))
def test_bad_input_is_refused_at_the_op_boundary(case, backend):
    if case.direct is not None:
        with pytest.raises(case.exc_direct or case.exc, match=case.names):
            ops_of(backend)(case.op)(*case.direct())
    if case.public is not None:
        with amo.use_backend(backend), pytest.raises(case.exc, match=case.names):
            case.public()


def test_catalogue_covers_every_op():
    from ascend_moe_ops import _library
    assert {c.op for c in CATALOGUE} == set(_library.SCHEMAS) - {"mla_attention_bwd"}


# ------------------------------------------------------------------------------- valid edge cases
def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", backends("flash_attention_fwd"))
@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 5, 0, 8), (2, 0, 2, 8)], ids=["B0", "H0", "S0"])
def test_attention_empty_batch_heads_or_tokens(backend, shape):
    q, k, v = (_f(*shape).requires_grad_() for _ in range(3))
    with amo.use_backend(backend):
        out, lse = amo.flash_attention(q, k, v, return_lse=True, causal=True)
        out.sum().backward()
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    assert q.grad.shape == shape and (q.grad == 0).all() and (k.grad == 0).all()


@pytest.mark.parametrize("backend", backends("flash_attention_fwd"))
def test_attention_packed_no_tokens_and_empty_sequences(backend):
    ops = ops_of(backend)
    q = _f(0, 2, 8)
    c3, c1 = torch.tensor([0, 0, 0]), torch.tensor([0])
    out, lse = ops("flash_attention_fwd")(q, q, q, None, c3, c3, 0, 0, True, 0.3)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0)
    out, lse = ops("flash_attention_fwd")(q, q, q, None, c1, c1, 0, 0, True, 0.3)  # B = 0
    assert out.shape == (0, 2, 8)
    # empty sequences between real ones
    q, k, v = _f(5, 2, 8), _f(5, 2, 8), _f(5, 2, 8)
    cu = torch.tensor([0, 0, 3, 3, 5])
    got = ops("flash_attention_fwd")(q, k, v, None, cu, cu, 3, 3, True, 0.3)[0]
    want = ops_of("reference")("flash_attention_fwd")(q.double(), k.double(), v.double(), None, cu, cu, 3, 3, True, 0.3)[0]
    _close(got, want)


@pytest.mark.parametrize("backend", backends("flash_attention_fwd"))
def test_dv_larger_than_dqk_is_valid_at_the_op(backend):
    """d_v > d_qk reaches every backend's kernels directly and is computed right."""
    q, k, v, do = _f(9, 2, 16), _f(9, 2, 16), _f(9, 2, 24), _f(9, 2, 24)
    cu = torch.tensor([0, 6, 9])
    ops, ref = ops_of(backend), ops_of("reference")
    out, lse = ops("flash_attention_fwd")(q, k, v, None, cu, cu, 6, 6, True, 0.25)
    d = [t.double() for t in (q, k, v)]
    o64, l64 = ref("flash_attention_fwd")(*d[:3], None, cu, cu, 6, 6, True, 0.25)
    _close(out, o64)
    grads = ops("flash_attention_bwd")(do, q, k, v, None, out, lse, cu, cu, 6, 6, True, 0.25)
    want = ref("flash_attention_bwd")(do.double(), *d, None, o64, l64, cu, cu, 6, 6, True, 0.25)
    for g, w in zip(grads[:3], want[:3]):
        _close(g, w)


@pytest.mark.parametrize("backend", backends("mla_attention_fwd"))
def test_mla_no_tokens(backend):
    a = _mla(q=_f(0, H, DN + DR), c_kv=_f(0, DC), k_pe=_f(0, DR), cu_seqlens=torch.tensor([0, 0]), max_seqlen=0)
    out, lse, kv = ops_of(backend)("mla_attention_fwd")(*a.values())
    assert out.shape == (0, H, DV) and lse.shape == (H, 0)


@pytest.mark.parametrize("backend", backends("moe_permute"))
def test_permute_no_tokens_and_empty_experts(backend):
    with amo.use_backend(backend):
        r = amo.moe_permute(_f(0, 8), torch.zeros(0, 2, dtype=torch.int64), num_experts=3)
        assert r.tokens.shape == (0, 8) and r.group_sizes.tolist() == [0, 0, 0]
        r = amo.moe_permute(_f(0, 8), torch.zeros(0, 2, dtype=torch.int64), num_experts=3, capacity=2)
        assert r.tokens.shape == (6, 8) and (r.tokens == 0).all()
        r = amo.moe_permute(_f(3, 8), torch.tensor([[2, 2], [2, -1], [-1, -1]]), num_experts=4)
        assert r.tokens_per_expert.tolist() == [0, 0, 3, 0]
        back = amo.moe_unpermute(r.tokens, r.row_id_map)
    assert back.shape == (3, 8) and (back[2] == 0).all()


@pytest.mark.parametrize("backend", backends("moe_permute"))
@pytest.mark.parametrize("n", [0, 3])
def test_permute_num_out_tokens_below_routed_is_valid(backend, n):
    """num_out_tokens below the 7 routed slots is not an error, also called directly at the op: the
    first n rows in expert order are kept (TransformerEngine's rule)."""
    tokens, routing = _f(4, 8), torch.tensor([[0, 1], [2, -1], [0, 0], [1, 1]])
    out, _, rmap, tpe, gs = ops_of(backend)("moe_permute")(tokens, routing, None, 3, None, 1, n)
    assert out.shape == (n, 8) and int(tpe.sum()) == n and torch.equal(tpe, gs)
    expect = {0: [[-1, -1], [-1, -1], [-1, -1], [-1, -1]], 3: [[0, -1], [-1, -1], [1, 2], [-1, -1]]}[n]
    assert rmap.tolist() == expect


@pytest.mark.parametrize("backend", backends("grouped_gemm"))
def test_grouped_gemm_empty_groups_and_no_rows(backend):
    with amo.use_backend(backend):
        x, w = _f(5, 4), _f(3, 4, 6)
        out = amo.grouped_gemm(x, w, torch.tensor([0, 0, 0]))
        assert (out == 0).all() and out.shape == (5, 6)
        out = amo.grouped_gemm(_f(0, 4), w, torch.tensor([0, 0, 0]))
        assert out.shape == (0, 6)
        dw = amo.grouped_gemm_dw(x, _f(5, 6), torch.tensor([0, 5, 0]))
        assert (dw[0] == 0).all() and (dw[2] == 0).all()


@pytest.mark.parametrize("factor", [0, -1.5, float("nan"), float("inf")])
def test_capacity_factor_must_be_positive(factor):
    from ascend_moe_ops.balance import capacity_for
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity_for(16, 2, 4, factor)
    with pytest.raises(ValueError, match="capacity_factor"):  # at construction, not at the first forward
        amo.nn.MoELayer(8, 4, 16, 2, capacity_factor=factor)


# ------------------------------------------- one rule, two languages: the Python/C++ pair agrees
def _cpp_checks():
    if "native" not in backends("moe_permute"):
        pytest.skip("the native extension is not built")
    from ascend_moe_ops import _C
    return _C


def _raised(fn, args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return type(e), str(e).splitlines()[0]
    return None


VALID = {  # a valid argument list per op (the cases above each change one argument of these)
    "moe_permute": _perm_direct, "moe_unpermute": lambda: tuple(_unp().values()),
    "moe_unpermute_backward": lambda: (_f(3, 8), _f(8, 8), torch.tensor([[0, 1], [2, 3], [4, -1]]), None),
    "grouped_gemm": lambda: tuple(_gg().values()),
    "grouped_gemm_dw": lambda: (_f(6, 4), _f(6, 3), torch.tensor([1, 2, 3])),
    "flash_attention_fwd": lambda: tuple(_fa().values()), "flash_attention_bwd": _fa_bwd,
    "mla_attention_fwd": lambda: tuple(_mla().values()),
    "mla_attention_bwd": lambda: (_f(5, H, DV), *list(_mla().values())[:4], _f(5, H, DV), torch.zeros(H, 5),
                                  torch.zeros(0, dtype=F16), *list(_mla().values())[4:11]),
}
DUPLICATE_ROWS = [  # a tampered row map: row 1 from two slots (the backward's scatter is ill-defined)
    Case("duplicate_rows", "moe_unpermute", lambda: tuple(_unp(row_id_map=torch.tensor([[0, 1], [2, 1], [4, -1]])).values()),
         None, ValueError, "row_id_map refers to row 1 from more than one slot, at \\(0, 1\\) and \\(1, 1\\)"),
    Case("bwd_duplicate_rows", "moe_unpermute_backward",
         lambda: (_f(3, 8), _f(8, 8), torch.tensor([[5, 1], [2, 3], [5, -1]]), None), None, ValueError,
         "row_id_map refers to row 5 from more than one slot, at \\(0, 0\\) and \\(2, 0\\)"),
]


def _pair_cases():
    for case in CATALOGUE + DUPLICATE_ROWS:
        if case.direct is not None and case.exc_direct is None:  # not a schema (argument-type) error
            yield pytest.param(case.op, case.direct, case.exc, case.names, id=f"{case.op}-{case.id}")
    for op, args in VALID.items():
        yield pytest.param(op, args, None, None, id=f"{op}-valid")


@pytest.mark.parametrize("op,args,exc,names", list(_pair_cases()))
def test_python_and_cpp_checks_agree(op, args, exc, names):
    """The Python contract (the op spec's ``check``) and its C++ twin (``amo::checks::<op>`` in
    csrc/common/<family>_checks.h, called alone through _C._check_<op>) accept and refuse the same
    inputs, with the same error type and message."""
    from ascend_moe_ops import _library
    C = _cpp_checks()
    a = args()
    py, cpp = _raised(_library.spec(op).check, a), _raised(getattr(C, f"_check_{op}"), a)
    assert py == cpp
    if exc is None:
        assert py is None
    else:
        assert py is not None and issubclass(py[0], exc) and re.search(names, py[1])


@pytest.mark.parametrize("case", DUPLICATE_ROWS, ids=lambda c: c.id)
@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_duplicate_rows_are_refused(case, backend):
    with pytest.raises(case.exc, match=case.names):
        ops_of(backend)(case.op)(*case.direct())


# ------------------------------------------------- no host synchronization on device tensors
class HostSync(AssertionError):
    pass


class _OnDevice(torch.Tensor):
    """A CPU tensor that reports a non-CPU device ("lazy": a device type built into torch with a
    device guard and no runtime to initialize). Every op on it runs inside :class:`_NoHostSync` on
    the CPU data."""

    @staticmethod
    def __new__(cls, data):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                device=torch.device("lazy", 0))
        t.data_ = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise HostSync(f"{func} ran outside the device-like mode")


_aten = torch.ops.aten
_SYNCS = {_aten._local_scalar_dense.default, _aten.nonzero.default, _aten.is_nonzero.default, _aten.equal.default,
          _aten.masked_select.default, _aten.item.default}


class _NoHostSync(TorchDispatchMode):
    """Runs ops on :class:`_OnDevice` tensors and fails on anything that would read device values on
    the host: ``.item()``/``bool()``/``int()``, ``.tolist()``, ``nonzero`` and boolean indexing, a copy
    to the CPU. Device-side asserts are recorded in ``asserts`` as (holds, message), not raised."""

    def __init__(self):
        super().__init__()
        self.asserts = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        kwargs = kwargs or {}
        if func in _SYNCS:
            raise HostSync(f"host synchronization: {func}")
        if func is _aten._to_copy.default and args and isinstance(args[0], _OnDevice) and \
                torch.device(kwargs.get("device") or "lazy").type == "cpu":
            raise HostSync("host synchronization: a copy of device values to the CPU")
        if func in (_aten._assert_async.msg, _aten._assert_async.default):
            self.asserts.append((bool(args[0].data_), args[1] if len(args) > 1 else ""))
            return None

        def unwrap(x):
            if isinstance(x, _OnDevice):
                return x.data_
            if isinstance(x, torch.device) and x.type == "lazy":
                return torch.device("cpu")
            return x
        kw = {k: ("cpu" if k == "device" and v is not None and torch.device(v).type == "lazy" else unwrap(v))
              for k, v in kwargs.items()}
        out = func(*tree_map(unwrap, args), **kw)
        return tree_map(lambda x: _OnDevice(x) if isinstance(x, torch.Tensor) else x, out)


def _on_device(args):
    return tuple(_OnDevice(a) if isinstance(a, torch.Tensor) else a for a in args)


def _check_fns(op):
    from ascend_moe_ops import _library
    fns = [pytest.param(_library.spec(op).check, id="python")]
    if "native" in backends("moe_permute"):
        from ascend_moe_ops import _C
        fns.append(pytest.param(getattr(_C, f"_check_{op}"), id="cpp"))
    return fns


def _sync_params():
    for op in VALID:
        for fn in _check_fns(op):
            yield pytest.param(op, fn.values[0], id=f"{op}-{fn.id}")


@pytest.mark.parametrize("op,check", list(_sync_params()))
def test_checks_never_copy_device_values_to_the_host(op, check):
    """Every op's check, Python and C++, on device tensors: no host copy of values; the value checks
    are device-side asserts, which hold for valid input."""
    args, mode = _on_device(VALID[op]()), _NoHostSync()
    with mode:
        check(*args)
    assert all(ok for ok, _ in mode.asserts), mode.asserts


BAD_VALUES = [  # a bad value per value check: caught by a device-side assert that names the argument
    ("moe_permute", lambda: _perm_direct(routing=torch.tensor([[0, 1], [2, 3], [0, 0], [1, 1]])), "routing"),
    ("moe_unpermute", lambda: tuple(_unp(row_id_map=torch.tensor([[0, 1], [2, 9], [4, -1]])).values()), "row_id_map"),
    ("moe_unpermute", DUPLICATE_ROWS[0].direct, "row_id_map refers to a row from more than one slot"),
    ("moe_unpermute_backward", DUPLICATE_ROWS[1].direct, "row_id_map refers to a row from more than one slot"),
    ("grouped_gemm", lambda: tuple(_gg(group_sizes=torch.tensor([4, 2, 3])).values()), "group_sizes"),
    ("grouped_gemm_dw", lambda: (_f(6, 4), _f(6, 3), torch.tensor([1, -2, 3])), "group_sizes"),
    ("flash_attention_fwd", lambda: tuple(_fa(cu_seqlens=torch.tensor([0, 5, 4])).values()), "cu_seqlens_q"),
    ("mla_attention_fwd", lambda: tuple(_mla(cu_seqlens=torch.tensor([0, 4])).values()), "cu_seqlens"),
]


@pytest.mark.parametrize("op,args,names", BAD_VALUES, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_VALUES)])
def test_device_value_checks_are_asynchronous_asserts(op, args, names):
    for check in _check_fns(op):
        a, mode = _on_device(args()), _NoHostSync()
        with mode:
            check.values[0](*a)
        failed = [m for ok, m in mode.asserts if not ok]
        assert failed and re.search(names, failed[0]), (check.id, mode.asserts)


@pytest.mark.parametrize("op,args", [
    ("moe_permute", _perm_direct), ("moe_permute", lambda: _perm_direct(capacity=2)),
    ("moe_permute", lambda: _perm_direct(num_out_tokens=3, align=2)),
    ("moe_permute", lambda: _perm_direct(routing=torch.rand(4, 3) > 0.5, num_experts=3, probs=torch.rand(4, 3))),
    ("moe_unpermute", VALID["moe_unpermute"]), ("moe_unpermute_backward", VALID["moe_unpermute_backward"]),
    ("moe_unpermute_backward", lambda: (_f(3, 8), _f(8, 8), torch.tensor([[0, 1], [2, 3], [4, -1]]),
                                        torch.rand(3, 2, dtype=F16))),
], ids=["ids", "capacity", "num_out_align", "mask", "unpermute", "unpermute_bwd", "unpermute_bwd_probs"])
def test_permute_ops_run_without_host_sync(op, args):
    """moe_permute / moe_unpermute promise no host synchronization: their check and their
    specification (the reference, which is also what runs on a device without a faster backend)
    together, on device tensors."""
    from ascend_moe_ops import _library
    kernel = _library.python_kernel("reference", op, "ascend_moe_ops_ref")
    a = args()
    want = kernel(*a)
    on_device, mode = _on_device(a), _NoHostSync()
    with mode:
        got = kernel(*on_device)
    assert all(ok for ok, _ in mode.asserts)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        assert torch.equal(g.data_, w)


# The internal ops (the adapters' fused kernels): their spec's check, and where the op promises no
# host synchronization its reference kernel too. mask_permute (its output row count is the routed
# count, read on the host, as Megatron-Core's permute) and sort_chunks (the chunk plan is read on the
# host; the native kernel takes cpu sizes) synchronize by design: only their checks are pinned.
INTERNAL_SYNC = {
    "swiglu_probs": (lambda: (_f(6, 8), torch.rand(6, dtype=F16)), True),
    "swiglu_probs_backward": (lambda: (_f(6, 4), _f(6, 8), torch.rand(6, dtype=F16)), True),
    "mask_permute": (lambda: (_f(4, 8), torch.rand(4, 3) > 0.5, torch.rand(4, 3), None), False),
    "sort_chunks": (lambda: (_f(6, 8), torch.tensor([1, 2, 3]), torch.tensor([2, 0, 1]), torch.rand(6), False),
                    False),
}


def test_host_sync_tests_cover_every_op():
    """Every op defined (public and internal) has a no-host-sync case here: a new op must add one."""
    from ascend_moe_ops import _library
    assert {s.name for s in _library.specs()} == set(VALID) | set(INTERNAL_SYNC)


@pytest.mark.parametrize("op", sorted(INTERNAL_SYNC))
def test_internal_ops_check_without_host_sync(op):
    from ascend_moe_ops import _library
    args, kernel_too = INTERNAL_SYNC[op]
    fns = [_library.spec(op).check]
    if kernel_too:
        fns.append(_library.python_kernel("reference", op, "ascend_moe_ops_ref"))
    for fn in fns:
        a = args()
        want = fn(*a)
        mode = _NoHostSync()
        with mode:
            got = fn(*_on_device(a))
        assert all(ok for ok, _ in mode.asserts)
        if want is not None:
            got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
            for g, w in zip(got, want):
                assert torch.equal(g.data_, w)


@contextlib.contextmanager
def _kernels_recorded():
    """The Triton launchers of triton_ref with every ``*_kernel`` replaced by a recorder: what the
    Python around the kernels does (allocations, views, grid sizes) runs, no kernel does."""
    import importlib
    from ascend_moe_ops import _library
    launches, saved = [], []

    class _Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((self.name, grid))

    for module in {_library.spec(op).module for op in _library.python_ops("triton")}:
        mod = importlib.import_module(f"{_library.TRITON.python_package}.{module}")
        for name, obj in list(vars(mod).items()):
            if name.endswith("_kernel") and hasattr(obj, "fn") and hasattr(obj, "__getitem__"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(name))
    try:
        yield launches
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


TRITON_SYNC = dict(VALID, **{
    "moe_permute/capacity": lambda: _perm_direct(capacity=2),
    "moe_permute/num_out_align": lambda: _perm_direct(num_out_tokens=3, align=2),
    "moe_permute/mask": lambda: _perm_direct(routing=torch.rand(4, 3) > 0.5, num_experts=3, probs=torch.rand(4, 3)),
    "grouped_gemm/int32_sizes_trans_b": lambda: tuple(_gg(group_sizes=torch.tensor([1, 2, 3], dtype=torch.int32),
                                                          weight=_f(3, 5, 4), trans_b=True).values()),
})


@pytest.mark.parametrize("case", sorted(TRITON_SYNC))
def test_triton_wrappers_without_host_sync(case):
    """The Triton backend's Python wrappers (triton_ref/<op module>.py) read nothing back from the
    device: run on device-like tensors with the kernels recorded instead of launched."""
    if "triton" not in backends("moe_permute"):
        pytest.skip("triton is not installed")
    import importlib
    from ascend_moe_ops import _library
    op = case.split("/")[0]
    if not _library.spec(op).implemented_by("triton"):
        pytest.skip(f"no triton kernel of {op}")
    module, attr = _library.python_impl("triton", op)
    fn = getattr(importlib.import_module(module), attr)
    args = _on_device(TRITON_SYNC[case]())
    with _kernels_recorded() as launches:
        with _NoHostSync():
            fn(*args)
    assert launches, "no kernel was launched"


def test_no_kernel_is_reachable_without_its_check():
    """The extension exposes no raw kernel entry (they once accepted what the contract refuses):
    only internal helpers (``_bind_cpu``, ``_check_<op>``, the large-block cache)."""
    C = _cpp_checks()
    assert [n for n in dir(C) if not n.startswith("_")] == []
    assert {f"_check_{op}" for op in VALID} <= set(dir(C))


# ----------------------------------------------------------------------------------- second derivatives
# The backward ops (moe_unpermute_backward, flash_attention_bwd, mla_attention_bwd, swiglu_probs_backward)
# have no formula of their own: a gradient of the gradient is exact on the reference (autograd records
# through its PyTorch kernels) and raises, naming the op and the backend, on the others (it used to be
# torch's fallback: a one-time warning and zeros). First-order gradients, create_graph=True included,
# are unchanged.
def _double_cases(dtype):
    """op -> (forward op, backward op, leaves, f(*leaves) -> output through the public function,
    PyTorch's own f for the oracle)."""
    from ascend_moe_ops import testing
    from ascend_moe_ops.ops import swiglu_probs as sp
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    rm = torch.tensor([[0, 3], [2, -1], [1, 4]], dtype=torch.int32)
    keep = (rm >= 0).unsqueeze(-1)

    def unpermute_torch(y, p=None):
        w = keep * (1 if p is None else p.unsqueeze(-1))
        return (y[rm.long().clamp(min=0)] * w).sum(1)

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    H, Dn, Dr, Dv, Dc, scale = 2, 4, 2, 4, 6, 0.4
    return {
        "moe_unpermute": ("moe_unpermute", "moe_unpermute_backward", (r(5, 3),),
                          lambda y: amo.moe_unpermute(y, rm), unpermute_torch),
        "moe_unpermute/probs": ("moe_unpermute", "moe_unpermute_backward", (r(5, 3), r(3, 2)),
                                lambda y, p: amo.moe_unpermute(y, rm, p), unpermute_torch),
        "flash_attention": ("flash_attention_fwd", "flash_attention_bwd", (r(7, 2, 4), r(7, 2, 4), r(7, 2, 4)),
                            lambda q, k, v: amo.flash_attention(q, k, v, causal=True, softmax_scale=scale,
                                                                cu_seqlens=cu, max_seqlen=4),
                            lambda q, k, v: testing.torch_attention(q, k, v, cu, causal=True, softmax_scale=scale)[0]),
        "mla_attention": ("mla_attention_fwd", "mla_attention_bwd",
                          (r(7, H, Dn + Dr), r(7, Dc), r(7, Dr), r(H * (Dn + Dv), Dc)),
                          lambda q, c, kp, w: amo.mla_attention(q, c, kp, w, num_heads=H, qk_nope_dim=Dn, v_dim=Dv,
                                                                softmax_scale=scale, causal=True, cu_seqlens=cu,
                                                                max_seqlen=4),
                          lambda q, c, kp, w: testing.torch_mla_attention(q, c, kp, w, cu, num_heads=H, qk_nope_dim=Dn,
                                                                          v_dim=Dv, causal=True, softmax_scale=scale)[0]),
        "swiglu_probs": ("swiglu_probs", "swiglu_probs_backward", (r(5, 6), torch.rand(5, generator=g).to(dtype)),
                         sp.swiglu_probs,
                         lambda x, p: torch.nn.functional.silu(x[:, :3]) * x[:, 3:] * p[:, None]),
    }


DOUBLE = sorted(_double_cases(torch.float64))


def _first_and_second(f, leaves, create_graph=True, second=True):
    """Gradients of a fixed weighting of ``f``'s output squared, then (``second``) of a weighting of
    those."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = f(*leaves)
    wt = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    grads = torch.autograd.grad((out.pow(2) * wt).sum(), leaves, create_graph=create_graph)
    if not second:
        return grads, None
    total = sum((gr * torch.linspace(1, 2, gr.numel(), dtype=gr.dtype).view(gr.shape)).sum() for gr in grads)
    return grads, torch.autograd.grad(total, leaves, allow_unused=True)


def _double_backends(case):
    fwd, bwd = _double_cases(torch.float64)[case][:2]
    return [pytest.param(case, b, id=f"{case}-{b}") for b in backends(fwd)]


def _use(backend, fwd, bwd):
    from ascend_moe_ops import _library
    return amo.use_backend(backend, ops=None if _library.spec(fwd).public else [fwd, bwd])


@pytest.mark.parametrize("case,backend", [p for c in DOUBLE for p in _double_backends(c)
                                          if p.values[1] != "reference"])
def test_double_backward_raises_naming_the_op_and_backend(case, backend):
    dtype = torch.float16 if "attention" in case else torch.float32  # the Ascend attention kernels: fp16/bf16
    fwd, bwd, leaves, f, _ = _double_cases(dtype)[case]
    with _use(backend, fwd, bwd):
        plain, _ = _first_and_second(f, leaves, create_graph=False, second=False)
        with pytest.raises(NotImplementedError, match=rf"^{bwd} \(the backward of {fwd}\): double backward .* "
                                                        rf"not supported on the {re.escape(backend)} backend.*reference"):
            graph, _ = _first_and_second(f, leaves)
        graph, _ = _first_and_second(f, leaves, second=False)  # create_graph=True, never differentiated
    for a, b in zip(plain, graph):
        assert torch.equal(a, b.detach()), case


@pytest.mark.parametrize("case", DOUBLE)
def test_reference_double_backward_is_exact(case):
    """The reference's second derivative vs PyTorch's autograd of the same function, fp64; first-order
    gradients with create_graph=True equal the plain ones."""
    from ascend_moe_ops.testing import assert_close_to_ref
    fwd, bwd, leaves, f, f_torch = _double_cases(torch.float64)[case]
    with _use("reference", fwd, bwd):
        plain, _ = _first_and_second(f, leaves, create_graph=False, second=False)
        grads, second = _first_and_second(f, leaves)
    want_grads, want_second = _first_and_second(f_torch, leaves)
    for a, b, w in zip(plain, grads, want_grads):
        assert torch.equal(a, b.detach())
        assert_close_to_ref(b.detach(), w, name=f"{case} gradient")
    for i, (s, w) in enumerate(zip(second, want_second)):
        w = torch.zeros_like(leaves[i]) if w is None else w
        assert_close_to_ref(torch.zeros_like(w) if s is None else s, w, name=f"{case} second derivative {i}")


@pytest.mark.parametrize("backend", backends("moe_unpermute"))
def test_double_backward_of_a_backend_namespace(backend):
    """torch.ops.<backend namespace> directly (no use_backend): the same rule."""
    y = torch.randn(3, 2, requires_grad=True)
    rm = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    (g,) = torch.autograd.grad(ops_of(backend)("moe_unpermute")(y, rm, None).pow(2).sum(), y, create_graph=True)
    if backend == "reference":
        assert torch.equal(torch.autograd.grad(g.sum(), y)[0], torch.tensor([[4.0, 4], [4, 4], [2, 2]]))
    else:
        with pytest.raises(NotImplementedError, match=f"moe_unpermute_backward .* on the {backend} backend"):
            torch.autograd.grad(g.sum(), y)
