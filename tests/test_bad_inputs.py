"""A catalogue of bad and edge inputs × every backend × both entry points (the public function and
``torch.ops.<backend namespace>.<op>``), aimed at the clusters where answers used to go wrong:
``num_out_tokens`` below the routed count, a tampered ``row_id_map`` (duplicate rows) in backward,
zero-size dimensions, head dims a backend has no kernel for, and a TransformerEngine-style integer
``[T, E]`` routing map.

Every case has one expected outcome: an error whose message names the argument, or a result equal to
the reference's (the spec; fp64 where floats are compared). Each run is classified as

* ``ok``      the expected outcome;
* ``wrong``   a result where an error was expected, or a result that differs from the spec;
* ``crash``   an exception that is not the contract's (IndexError, a kernel assertion, ...);
* ``unclear`` an error where a result was expected, or an error that does not name the argument.

The test asserts ``ok`` for every run. ``python tests/test_bad_inputs.py`` prints the counts per
backend (the numbers quoted in docs/design.md)."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

if __name__ == "__main__":  # the counts script: the tests folder's helpers on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import backends, ops_of  # noqa: E402  (first: it sets TRITON_INTERPRET on cpu)
import ascend_moe_ops as amo  # noqa: E402

F32, F16 = torch.float32, torch.float16
ERRORS = (ValueError, TypeError, RuntimeError)


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _f(*shape, dtype=F32, seed=0, nc=False):
    """Normal values rounded to fp16 (so every dtype holds the same numbers); ``nc``: a
    non-contiguous tensor with those values (what a direct torch.ops call may pass)."""
    t = torch.randn(*shape, generator=_g(seed)).to(F16).to(dtype)
    return _nc(t) if nc else t


def _probs(shape, dt, seed, nc=False):
    """Router weights in [0, 1) rounded to fp16, as ``_f``."""
    p = torch.rand(shape, generator=_g(seed), dtype=torch.float64).to(F16).to(dt)
    return _nc(p) if nc else p


def _leaves(*ts):
    for t in ts:
        if t is not None:
            t.requires_grad_(True)


def _ex(t, name, ex):
    """``t`` as a token-expanded view (token stride 0, all tokens equal to the first) when ``name``
    is in ``ex``: what ``.expand`` of one token gives a direct torch.ops call."""
    return t[:1].expand(t.shape) if name in ex and t.shape[0] > 0 else t


def _nc(t):
    if t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    return torch.stack([t, t], -1)[..., 0]


CUBE_OPS = ("grouped_gemm", "grouped_gemm_dw", "flash_attention_fwd", "mla_attention_fwd")


def _dt(backend, op=""):
    """The spec runs in fp64; the AscendC Cube kernels take fp16/bf16 only (a documented limit),
    every other backend fp32."""
    if backend == "reference":
        return torch.float64
    return F16 if backend == "ascendc-emu" and op in CUBE_OPS else F32


@dataclass
class Case:
    """``run(backend, path)`` performs the call (path: ``"public"`` or ``"ops"``) and returns a
    tuple of tensors; ``error`` is the regex the message must match (the argument's name), or
    ``None`` when a result is expected: then ``run("reference", path)`` on the same inputs is the
    spec (fp64 inputs where ``f64`` builds them)."""
    id: str
    op: str
    run: Callable[[str, str], tuple]
    error: Optional[str] = None
    paths: tuple = ("public", "ops")
    exact: bool = False            # compare results bitwise (index outputs, pure copies)
    allow_error: Optional[str] = None  # a valid input a backend may refuse (a documented limit: fp32 on
    #                                    the Cube kernels, fp64 on Triton): a TypeError/ValueError
    #                                    naming this regex, or the spec's result


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(t for y in x for t in _tensors(y))
    return ()


def _same(a, b, exact) -> Optional[str]:
    a, b = _tensors(a), _tensors(b)
    if len(a) != len(b):
        return f"{len(a)} outputs, the spec has {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape:
            return f"output {i}: shape {tuple(x.shape)}, the spec has {tuple(y.shape)}"
        if x.numel() == 0:
            continue
        if x.is_floating_point() and not exact:
            xd, yd = x.double(), y.double()
            inf_x, inf_y = torch.isinf(xd), torch.isinf(yd)
            same_nonfinite = torch.equal(torch.isnan(xd), torch.isnan(yd)) and torch.equal(inf_x, inf_y) \
                and torch.equal(xd[inf_x], yd[inf_y])  # NaN where the spec has NaN, the same infinities
            fin = torch.isfinite(yd)
            if not same_nonfinite or not torch.allclose(xd[fin], yd[fin], rtol=2e-2, atol=2e-2):
                return f"output {i}: max diff {float((xd - yd).abs().nan_to_num(1e9).max()):.3g}"
        elif not torch.equal(x.to(y.dtype), y):
            return f"output {i}: {x.flatten()[:8].tolist()} != spec {y.flatten()[:8].tolist()}"
    return None


def outcome(case: Case, backend: str, path: str):
    """(``ok`` | ``wrong`` | ``crash`` | ``unclear``, detail)."""
    try:
        got = case.run(backend, path)
    except ERRORS as e:
        msg = str(e).split("\n")[0]
        if case.error is None and case.allow_error is not None and isinstance(e, (ValueError, TypeError)) \
                and re.search(case.allow_error, str(e)):
            return "ok", f"a documented limit: {msg}"
        if case.error is None:
            return "unclear", f"valid input refused: {type(e).__name__}: {msg}"
        if isinstance(e, (ValueError, TypeError)) or "Expected a value of type" in msg or "argument" in msg:
            if re.search(case.error, str(e)):
                return "ok", msg
        return "unclear", f"{type(e).__name__} does not name /{case.error}/: {msg}"
    except Exception as e:  # noqa: BLE001 - anything else is outside the contract
        return "crash", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if case.error is not None:
        return "wrong", "accepted a bad input (expected an error naming /" + case.error + "/)"
    if backend == "reference":
        return "ok", "the spec"
    try:
        want = case.run("reference", path)
    except Exception as e:  # noqa: BLE001
        return "unclear", f"the spec (reference) fails: {type(e).__name__}: {str(e).splitlines()[0]}"
    diff = _same(got, want, case.exact)
    return ("wrong", diff) if diff else ("ok", "")


# ------------------------------------------------------------------------------ call helpers
def _call(backend, path, op, public, args):
    """``public()`` under ``use_backend(backend)``, or ``torch.ops.<ns>.<op>(*args)``."""
    if path == "public":
        with amo.use_backend(backend):
            return public()
    return ops_of(backend)(op)(*args)


# ------------------------------------------------------------------------------------ moe_permute
ROUTING = torch.tensor([[0, 1], [2, -1], [0, 0], [1, 3], [3, 2], [1, 0]])  # 11 routed slots, E = 4
TE_MAP = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0], [0, 1, 0, 1], [0, 0, 1, 1], [0, 1, 1, 0], [0, 0, 1, 1]],
                      dtype=torch.int32)  # TransformerEngine's [T, E] int32 routing map: counts [1, 3, 4, 3]


def _permute(routing=ROUTING, probs=True, num_experts=4, capacity=None, align=1, num_out_tokens=None, H=8,
             backward=False, public_kw=None, nc=False, probs_fill=None, tamper=None, dtype=None):
    T = routing.shape[0]
    if nc:
        routing = _nc(routing)

    def run(backend, path):
        dt = dtype or _dt(backend)
        tokens = _f(T, H, dtype=dt, nc=nc)
        p = _probs(routing.shape, dt, 1, nc) if probs else None
        if p is not None and probs_fill is not None:
            p = probs_fill(p)
        if backward:
            _leaves(tokens, p)
        if path == "public":
            with amo.use_backend(backend):
                r = amo.moe_permute(tokens, routing, p, num_experts=num_experts, capacity=capacity, align=align,
                                    num_out_tokens=num_out_tokens, **(public_kw or {}))
            out = (r.tokens, r.probs, r.row_id_map, r.tokens_per_expert, r.group_sizes)
        else:
            out = ops_of(backend)("moe_permute")(tokens, routing, p, num_experts, capacity, align, num_out_tokens)
        if backward:
            if tamper is not None:  # the saved row map, changed behind autograd's back
                tamper(out[2].data)
            w = torch.linspace(-1, 1, out[0].numel(), dtype=dt).reshape(out[0].shape)
            loss = (out[0] * w).sum() + (out[1] * torch.arange(out[1].numel(), dtype=dt)).sum() if p is not None \
                else (out[0] * w).sum()
            grads = torch.autograd.grad(loss, [tokens] + ([p] if p is not None else []), allow_unused=True)
            return out + tuple(g if g is not None else torch.zeros(0) for g in grads)
        return out
    return run


def _perm_case(id, error=None, paths=("public", "ops"), allow_error=None, **kw):
    backward = kw.get("backward", False)
    if backward:  # autograd through torch.ops of a backend namespace: the public function only
        paths = ("public",)
    return Case(id, "moe_permute", _permute(**kw), error, paths, allow_error=allow_error)


def _nan_at(*where):
    def fill(p):
        p = p.clone()
        for w in where:
            p[w] = float("nan")
        return p
    return fill


def _repeat_row(rmap):
    rmap.view(-1)[1] = rmap.view(-1)[0]


PERMUTE = [
    # num_out_tokens below / at / above the 11 routed slots: TransformerEngine's rule (the first n rows
    # of the stable expert sort are kept), on every backend, with and without probs, align, a mask
    *[_perm_case(f"num_out_{n}", num_out_tokens=n) for n in (0, 1, 4, 10, 11, 15)],
    *[_perm_case(f"num_out_{n}_align4", num_out_tokens=n, align=4) for n in (0, 3, 7)],
    _perm_case("num_out_5_no_probs", num_out_tokens=5, probs=False),
    _perm_case("num_out_5_mask", routing=TE_MAP.bool(), num_out_tokens=5),
    _perm_case("num_out_0_mask_align2", routing=TE_MAP.bool(), num_out_tokens=0, align=2),
    _perm_case("num_out_3_backward", num_out_tokens=3, backward=True),
    _perm_case("num_out_3_mask_backward", routing=TE_MAP.bool(), num_out_tokens=3, backward=True),
    _perm_case("num_out_negative", "num_out_tokens", num_out_tokens=-1),
    # TransformerEngine's [T, E] routing map: rejected as ambiguous, or read as a mask when said so
    _perm_case("te_int32_map_as_ids", "routing", routing=TE_MAP, probs=False, paths=("public",)),
    _perm_case("te_int64_map_as_ids", "routing", routing=TE_MAP.long(), probs=False, paths=("public",)),
    _perm_case("te_uint8_map", "routing", routing=TE_MAP.to(torch.uint8), probs=False),
    _perm_case("te_int32_map_mask", routing=TE_MAP, probs=False, paths=("public",),
               public_kw=dict(map_type="mask")),
    _perm_case("te_uint8_map_mask", routing=TE_MAP.to(torch.uint8), paths=("public",),
               public_kw=dict(map_type="mask")),
    _perm_case("te_map_mask_bad_value", "routing", routing=TE_MAP * 2, paths=("public",),
               public_kw=dict(map_type="mask")),
    _perm_case("ids_topk_equals_e", routing=ROUTING.clamp(max=1), num_experts=2, probs=False, paths=("public",),
               public_kw=dict(map_type="index")),
    _perm_case("ids_topk_equals_e_ambiguous", "map_type", routing=ROUTING.clamp(max=1), num_experts=2,
               paths=("public",)),
    _perm_case("map_type_unknown", "map_type", paths=("public",), public_kw=dict(map_type="ids!")),
    _perm_case("map_type_index_bool", "map_type", routing=TE_MAP.bool(), paths=("public",),
               public_kw=dict(map_type="index")),
    # zero-size dimensions
    _perm_case("no_tokens", routing=torch.zeros(0, 2, dtype=torch.long)),
    _perm_case("no_tokens_capacity", routing=torch.zeros(0, 2, dtype=torch.long), capacity=3),
    _perm_case("hidden_0", H=0),
    _perm_case("hidden_0_capacity", H=0, capacity=2),
    _perm_case("topk_0", routing=torch.zeros(6, 0, dtype=torch.long)),
    _perm_case("topk_0_align", routing=torch.zeros(6, 0, dtype=torch.long), align=4),
    _perm_case("all_empty_slots", routing=torch.full((6, 2), -1)),
    _perm_case("mask_no_experts", "num_experts", routing=torch.zeros(6, 0, dtype=torch.bool), num_experts=0),
    _perm_case("capacity_1", capacity=1),
    _perm_case("capacity_drops_backward", capacity=2, backward=True),
    _perm_case("duplicate_ids", routing=torch.tensor([[1, 1], [1, 1], [0, 0], [2, 2], [1, -1], [3, 3]])),
    _perm_case("non_contiguous_routing", routing=torch.tensor([[0, 9, 1], [2, 9, -1], [0, 9, 0], [1, 9, 3],
                                                               [3, 9, 2], [1, 9, 0]])[:, ::2]),
    _perm_case("non_contiguous_all", nc=True),
    _perm_case("non_contiguous_capacity", nc=True, capacity=2),
    _perm_case("non_contiguous_mask", routing=TE_MAP.bool(), nc=True, num_out_tokens=7),
    # NaN probs under capacity: a NaN ranks below every number (dropped first), ties by position
    _perm_case("capacity_nan_probs", capacity=2, probs_fill=lambda p: torch.full_like(p, float("nan"))),
    _perm_case("capacity_some_nan_probs", capacity=2, probs_fill=_nan_at((0, 0), (3, 0), (5, 1))),
    _perm_case("capacity_nan_probs_mask", routing=TE_MAP.bool(), capacity=1, probs_fill=_nan_at((1, 1), (2, 1))),
    _perm_case("dropless_nan_probs", probs_fill=lambda p: torch.full_like(p, float("nan"))),
    # float64 tokens: computed, or refused naming tokens where a backend has no fp64 kernel
    _perm_case("tokens_float64", dtype=torch.float64, allow_error="tokens"),
    # the saved row map tampered with between forward and backward (a repeated row)
    _perm_case("backward_tampered_row_map", "row_id_map", backward=True, tamper=_repeat_row),
    _perm_case("backward_tampered_mask_row_map", "row_id_map", routing=TE_MAP.bool(), backward=True,
               tamper=_repeat_row),
]


# ---------------------------------------------------------------------------------- moe_unpermute
def _unpermute(rmap, probs=True, N=12, H=8, backward=False, direct_bwd=False, nc=False, tamper=None, dtype=None):
    T, S = rmap.shape
    if nc:
        rmap = _nc(rmap)

    rmap0 = rmap

    def run(backend, path):
        rmap = rmap0.clone()  # a fresh map per run (a tampering case changes it)
        dt = dtype or _dt(backend)
        perm = _f(N, H, dtype=dt, seed=2, nc=nc)
        p = _probs((T, S), dt, 3, nc) if probs else None
        if direct_bwd:
            g = _f(T, H, dtype=dt, seed=4, nc=nc)
            return ops_of(backend)("moe_unpermute_backward")(g, perm if p is not None else perm[:, :0], rmap, p)
        if backward:
            _leaves(perm, p)
        if path == "public":
            with amo.use_backend(backend):
                out = amo.moe_unpermute(perm, rmap, p)
        else:
            out = ops_of(backend)("moe_unpermute")(perm, rmap, p)
        if not backward:
            return (out,)
        if tamper is not None:  # the saved row map, changed behind autograd's back
            tamper(rmap.data)
        grads = torch.autograd.grad((out * _f(T, H, dtype=dt, seed=4)).sum(),
                                    [perm] + ([p] if p is not None else []))
        return (out,) + grads
    return run


def _unp_case(id, rmap, error=None, direct_bwd=False, allow_error=None, **kw):
    op = "moe_unpermute_backward" if direct_bwd else "moe_unpermute"
    paths = ("ops",) if direct_bwd else (("public",) if kw.get("backward") else ("public", "ops"))
    return Case(id, op, _unpermute(torch.as_tensor(rmap), direct_bwd=direct_bwd, **kw), error, paths,
                allow_error=allow_error)


DUP = [[0, 1], [2, -1], [1, 3], [4, 5]]   # row 1 referenced twice: a tampered map
GOOD = [[0, 1], [2, -1], [6, 3], [4, 5]]
UNPERMUTE = [
    _unp_case("duplicate_rows_forward", DUP, "row_id_map"),
    _unp_case("duplicate_rows_backward", DUP, "row_id_map", backward=True),
    _unp_case("duplicate_rows_backward_no_probs", DUP, "row_id_map", backward=True, probs=False),
    _unp_case("duplicate_rows_op_backward", DUP, "row_id_map", direct_bwd=True),
    _unp_case("duplicate_rows_op_backward_no_probs", DUP, "row_id_map", direct_bwd=True, probs=False),
    _unp_case("all_rows_the_same", [[3, 3], [3, 3], [3, -1], [3, 3]], "row_id_map", direct_bwd=True),
    _unp_case("valid_map_backward", GOOD, backward=True),
    _unp_case("valid_map_op_backward", GOOD, direct_bwd=True),
    _unp_case("int64_map", torch.tensor(GOOD, dtype=torch.int64)),
    _unp_case("no_rows", [[-1, -1], [-1, -1]], N=0),
    _unp_case("no_rows_backward", [[-1, -1], [-1, -1]], N=0, direct_bwd=True),
    _unp_case("hidden_0", GOOD, H=0),
    _unp_case("hidden_0_backward", GOOD, H=0, direct_bwd=True),
    _unp_case("no_tokens", torch.zeros(0, 2, dtype=torch.int32)),
    _unp_case("topk_0", torch.zeros(4, 0, dtype=torch.int32)),
    _unp_case("topk_0_backward", torch.zeros(4, 0, dtype=torch.int32), direct_bwd=True),
    _unp_case("non_contiguous", GOOD, nc=True),
    _unp_case("non_contiguous_backward", GOOD, nc=True, direct_bwd=True),
    _unp_case("backward_tampered_row_map", GOOD, "row_id_map", backward=True, tamper=_repeat_row),
    _unp_case("backward_tampered_row_map_no_probs", GOOD, "row_id_map", backward=True, probs=False,
              tamper=_repeat_row),
    _unp_case("permuted_float64", GOOD, dtype=torch.float64, allow_error="permuted"),
]


# ----------------------------------------------------------------------------------- grouped_gemm
def _gemm(M=6, K=4, N=5, sizes=(1, 2, 3), trans_b=False, dw=False, backward=False, nc=False, gs_dtype=torch.int64,
          dtype=None, tamper=None):
    gs0 = torch.tensor(sizes, dtype=gs_dtype)
    if nc:
        gs0 = _nc(gs0)
    E = gs0.numel()

    def run(backend, path):
        gs = gs0.clone()  # a fresh tensor per run (a tampering case changes it)
        dt = dtype or _dt(backend, "grouped_gemm")
        if dw:
            a, b = _f(M, K, dtype=dt, nc=nc), _f(M, N, dtype=dt, seed=1, nc=nc)
            return _call(backend, path, "grouped_gemm_dw", lambda: amo.grouped_gemm_dw(a, b, gs), (a, b, gs))
        x = _f(M, K, dtype=dt, nc=nc)
        w = _f(*((E, N, K) if trans_b else (E, K, N)), dtype=dt, seed=1, nc=nc)
        if backward:
            x.requires_grad_(True)
            w.requires_grad_(True)
        out = _call(backend, path, "grouped_gemm", lambda: amo.grouped_gemm(x, w, gs, trans_b=trans_b),
                    (x, w, gs, trans_b))
        if not backward:
            return (out,)
        if tamper is not None:  # the saved group sizes, changed behind autograd's back
            tamper(gs.data)
        return (out,) + torch.autograd.grad((out * _f(*out.shape, dtype=dt, seed=5)).sum(), [x, w])
    return run


def _gg_case(id, error=None, allow_error=None, **kw):
    op = "grouped_gemm_dw" if kw.get("dw") else "grouped_gemm"
    paths = ("public",) if kw.get("backward") else ("public", "ops")
    return Case(id, op, _gemm(**kw), error, paths, allow_error=allow_error)


GROUPED = [
    _gg_case("k_0", K=0),
    _gg_case("k_0_backward", K=0, backward=True),
    _gg_case("n_0", N=0),
    _gg_case("n_0_trans_b", N=0, trans_b=True),
    _gg_case("no_experts", sizes=()),
    _gg_case("no_experts_no_rows", M=0, sizes=()),
    _gg_case("rows_past_sum", sizes=(1, 0, 2)),
    _gg_case("rows_past_sum_backward", sizes=(1, 0, 2), backward=True),
    _gg_case("all_groups_empty_backward", sizes=(0, 0, 0), backward=True),
    _gg_case("one_expert_trans_b", sizes=(6,), trans_b=True),
    _gg_case("dw_k_0", K=0, dw=True),
    _gg_case("dw_no_experts", sizes=(), dw=True),
    _gg_case("dw_rows_past_sum", sizes=(2, 0, 1), dw=True),
    _gg_case("dw_negative", "group_sizes", sizes=(2, -1, 1), dw=True),
    _gg_case("non_contiguous", nc=True, sizes=(2, 0, 3)),
    _gg_case("non_contiguous_trans_b", nc=True, trans_b=True, gs_dtype=torch.int32),
    _gg_case("dw_non_contiguous", nc=True, dw=True),
    # dtypes a backend has no kernel for: computed right, or a TypeError naming the argument (Triton:
    # no fp64 tl.dot; the AscendC Cube kernels: fp16/bf16 only). bf16 on Triton's interpreter runs
    # as fp32 copies (the interpreter's bf16 tl.dot is wrong)
    _gg_case("float64", dtype=torch.float64, allow_error=r"grouped_gemm: x must have dtype"),
    _gg_case("float32", dtype=torch.float32, allow_error=r"grouped_gemm: x must have dtype"),
    _gg_case("bfloat16", dtype=torch.bfloat16),
    _gg_case("bfloat16_backward", dtype=torch.bfloat16, backward=True),
    _gg_case("dw_float64", dw=True, dtype=torch.float64, allow_error=r"grouped_gemm_dw: a must have dtype"),
    _gg_case("dw_bfloat16", dw=True, dtype=torch.bfloat16),
    # K past a backend's limit: computed, or a ValueError naming x and weight
    _gg_case("k_65536", M=2, K=65536, N=2, sizes=(2,), allow_error=r"x and weight"),
    _gg_case("backward_tampered_sizes", "group_sizes", backward=True, tamper=lambda gs: gs.__setitem__(0, -5)),
]


# -------------------------------------------------------------------------------- flash attention
def _attn(Tq=5, Tk=5, Hq=2, Hkv=2, D=8, Dv=None, causal=True, cu_q=None, cu_k=None, backward=False, Dr=0, nc=False,
          dtype=None, max_seqlen=None, ex=(), kr_empty=False):
    Dv = D if Dv is None else Dv
    cu_q = torch.tensor([0, Tq]) if cu_q is None else torch.tensor(cu_q)
    cu_k = torch.tensor([0, Tk]) if cu_k is None else torch.tensor(cu_k)
    mq = int((cu_q[1:] - cu_q[:-1]).max()) if cu_q.numel() > 1 else 0
    mk = int((cu_k[1:] - cu_k[:-1]).max()) if cu_k.numel() > 1 else 0
    if max_seqlen is not None:  # an upper bound far above the longest sequence (valid)
        mq = mk = max_seqlen
    if nc:
        cu_q, cu_k = _nc(cu_q), _nc(cu_k)

    def run(backend, path):
        dt = dtype or _dt(backend, "flash_attention_fwd")
        q, k = _f(Tq, Hq, D + Dr, dtype=dt, nc=nc), _f(Tk, Hkv, D, dtype=dt, seed=1, nc=nc)
        v = _f(Tk, Hkv, Dv, dtype=dt, seed=2, nc=nc)
        kr = _f(Tk, Dr, dtype=dt, seed=3, nc=nc) if Dr or kr_empty else None
        q, k, v = _ex(q, "q", ex), _ex(k, "k", ex), _ex(v, "v", ex)
        kr = _ex(kr, "k_rope", ex) if kr is not None else None
        scale = 0.3
        if path == "public":
            ts = (q, k, v) if not backward else tuple(t.requires_grad_(True) for t in (q, k, v))
            with amo.use_backend(backend):
                out, lse = amo.flash_attention(*ts, causal=causal, softmax_scale=scale, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, return_lse=True)
                if not backward:
                    return out, lse
                return (out, lse) + torch.autograd.grad((out * _f(*out.shape, dtype=dt, seed=6)).sum(), ts)
        ops = ops_of(backend)
        out, lse = ops("flash_attention_fwd")(q, k, v, kr, cu_q, cu_k, mq, mk, causal, scale)
        if not backward:
            return out, lse
        g = _ex(_f(*out.shape, dtype=dt, seed=6, nc=nc), "grad_out", ex)
        return (out, lse) + tuple(ops("flash_attention_bwd")(g, q, k, v, kr, out, lse, cu_q, cu_k, mq, mk, causal,
                                                             scale))
    return run


def _fa_case(id, error=None, paths=("public", "ops"), allow_error=None, **kw):
    return Case(id, "flash_attention_fwd", _attn(**kw), error, paths, allow_error=allow_error)


ATTENTION = [
    # zero-size dims: heads, tokens, keys, batch
    _fa_case("zero_heads", Hq=0, Hkv=0),
    _fa_case("zero_heads_backward", Hq=0, Hkv=0, backward=True),
    _fa_case("zero_q_heads_two_kv_heads", Hq=0, Hkv=2),
    _fa_case("zero_kv_heads", "k", Hq=2, Hkv=0),
    _fa_case("no_queries", Tq=0, cu_q=[0, 0]),
    _fa_case("no_keys", Tk=0, cu_k=[0, 0], backward=True),
    _fa_case("head_dim_0", "head dim", D=0),
    _fa_case("v_dim_0", "d_v|head dim", Dv=0),
    _fa_case("empty_sequence_between", Tq=6, Tk=6, cu_q=[0, 2, 2, 6], cu_k=[0, 2, 2, 6], backward=True),
    # head dims a backend may have no kernel for: computed right, or refused naming the head dim
    *[_fa_case(f"head_dim_{d}", D=d, backward=True) for d in (1, 3, 12, 72, 160, 264)],
    _fa_case("dv_1", Dv=1, backward=True),
    _fa_case("dv_larger_40_vs_8", Dv=40, backward=True),
    _fa_case("dqk_192_dv_128", D=192, Dv=128, Hq=1, Hkv=1, Tq=3, Tk=3),
    _fa_case("k_rope_dr_3", Dr=3, backward=True, paths=("ops",)),
    _fa_case("gqa_4_to_1", Hq=4, Hkv=1, backward=True),
    _fa_case("non_contiguous", nc=True, backward=True, paths=("ops",)),
    _fa_case("non_contiguous_k_rope", nc=True, Dr=4, backward=True, paths=("ops",)),
    # token-expanded operands (token stride 0) at torch.ops: the native kernel gave BLAS a leading
    # dimension of 0 (garbage, oneMKL's "Parameter 8 was incorrect") before 2026-12-07
    *[_fa_case(f"expanded_{'_'.join(ex)}", ex=ex, Dr=4, backward=True, paths=("ops",))
      for ex in (("q",), ("k",), ("v",), ("k_rope",), ("grad_out",), ("q", "k", "v", "k_rope", "grad_out"))],
    # a k_rope with no columns: a gradient of its shape [Tk, 0] (native gave [0], AscendC failed)
    _fa_case("k_rope_dr_0", kr_empty=True, backward=True, paths=("ops",)),
    # max_seqlen is an upper bound: a huge one is valid and must not launch a huge grid
    _fa_case("max_seqlen_huge", max_seqlen=1 << 40),
    _fa_case("max_seqlen_huge_backward", max_seqlen=1 << 40, backward=True, paths=("ops",)),
    # dtypes a backend has no kernel for (the AscendC Cube kernels: fp16/bf16 only)
    _fa_case("float32", dtype=torch.float32, backward=True, allow_error=r"flash_attention_(fwd|bwd): q must have dtype"),
    _fa_case("bfloat16", dtype=torch.bfloat16, backward=True),
    # heads x head dim past the AscendC copy-stride limit: computed, or a ValueError naming q and v
    _fa_case("heads_times_dim_65536", Tq=2, Tk=2, Hq=256, Hkv=256, D=256, allow_error=r"q and v have H \* Dq"),
]


# -------------------------------------------------------------------------------------------- MLA
def _mla(T=5, H=2, Dn=8, Dr=4, Dv=8, Dc=12, backward=False, cu=None, nc=False, dtype=None, ex=()):
    cu = torch.tensor([0, T]) if cu is None else torch.tensor(cu)
    ms = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if nc:
        cu = _nc(cu)

    def run(backend, path):
        dt = dtype or _dt(backend, "mla_attention_fwd")
        q, c, kpe = _f(T, H, Dn + Dr, dtype=dt, nc=nc), _f(T, Dc, dtype=dt, seed=1, nc=nc), _f(T, Dr, dtype=dt,
                                                                                              seed=2, nc=nc)
        w = _f(H * (Dn + Dv), Dc, dtype=dt, seed=3, nc=nc)
        q, c, kpe = _ex(q, "q", ex), _ex(c, "c_kv", ex), _ex(kpe, "k_pe", ex)
        if path == "public":
            ts = (q, c, kpe, w) if not backward else tuple(t.requires_grad_(True) for t in (q, c, kpe, w))
            with amo.use_backend(backend):
                out = amo.mla_attention(*ts, num_heads=H, qk_nope_dim=Dn, v_dim=Dv, softmax_scale=0.3, causal=True,
                                        cu_seqlens=cu, max_seqlen=ms)
            if not backward:
                return (out,)
            return (out,) + torch.autograd.grad((out * _f(*out.shape, dtype=dt, seed=6)).sum(), ts)
        ops = ops_of(backend)
        out, lse, kv = ops("mla_attention_fwd")(q, c, kpe, w, cu, ms, H, Dn, Dv, 0.3, True, False)
        if not backward:
            return out, lse
        g = _ex(_f(*out.shape, dtype=dt, seed=6, nc=nc), "grad_out", ex)
        return (out, lse) + tuple(ops("mla_attention_bwd")(g, q, c, kpe, w, out, lse, kv, cu, ms, H, Dn, Dv, 0.3,
                                                           True))
    return run


def _mla_case(id, error=None, paths=("public", "ops"), allow_error=None, **kw):
    return Case(id, "mla_attention_fwd", _mla(**kw), error, paths, allow_error=allow_error)


MLA = [
    _mla_case("zero_heads", "num_heads", H=0),
    _mla_case("no_tokens", T=0, cu=[0, 0]),
    _mla_case("latent_0", Dc=0, backward=True),
    _mla_case("rope_dim_1", Dr=1, backward=True),
    _mla_case("odd_dims", Dn=5, Dr=3, Dv=7, Dc=9, backward=True),
    _mla_case("dv_above_dqk_op", Dn=4, Dr=2, Dv=12, backward=True, paths=("ops",)),
    _mla_case("dv_above_dqk_public", "v_dim", Dn=4, Dr=2, Dv=12, paths=("public",)),
    _mla_case("real_dims_one_head", T=3, H=1, Dn=128, Dr=64, Dv=128, Dc=32),
    _mla_case("non_contiguous", nc=True, backward=True, paths=("ops",)),
    # token-expanded operands (token stride 0) at torch.ops (native: garbage before 2026-12-07)
    *[_mla_case(f"expanded_{'_'.join(ex)}", ex=ex, backward=True, paths=("ops",))
      for ex in (("q",), ("k_pe",), ("grad_out",), ("q", "c_kv", "k_pe", "grad_out"))],
    _mla_case("float32", dtype=torch.float32, backward=True, allow_error=r"mla_attention_(fwd|bwd): q must have dtype"),
    # num_heads * (qk_nope_dim + v_dim) = 65536 rows of w_kv_up: past the AscendC copy strides
    _mla_case("w_kv_up_rows_65536", T=2, H=256, Dn=128, Dr=64, Dv=128, Dc=16, allow_error="w_kv_up has shape"),
]

CATALOGUE = PERMUTE + UNPERMUTE + GROUPED + ATTENTION + MLA


def _params():
    for case in CATALOGUE:
        for backend in backends(case.op):
            for path in case.paths:
                yield pytest.param(case, backend, path, id=f"{case.op}-{case.id}-{backend}-{path}")


@pytest.mark.parametrize("case,backend,path", list(_params()))
def test_bad_or_edge_input(case, backend, path):
    kind, detail = outcome(case, backend, path)
    assert kind == "ok", f"{kind}: {detail}"


# ------------------------------------------------------------------ internal ops (adapters' kernels)
# swiglu_probs, mask_permute, sort_chunks: torch.ops of each backend that implements them (native,
# reference) and of the public namespace; a meta tensor next to cpu ones must be refused by the fake
# kernel too (the dispatcher sends such a call there).
def _meta(*shape, dtype=F32):
    return torch.empty(*shape, dtype=dtype, device="meta")


INTERNAL = [
    ("swiglu_probs", "x_float8", lambda: (torch.randn(6, 8).to(torch.float8_e5m2), torch.rand(6)), r"\bx\b"),
    ("swiglu_probs", "probs_float8", lambda: (torch.randn(6, 8), torch.rand(6).to(torch.float8_e5m2)), "probs"),
    ("swiglu_probs", "x_odd_columns", lambda: (torch.randn(6, 7), torch.rand(6)), r"\bx\b"),
    ("swiglu_probs", "probs_meta", lambda: (torch.randn(6, 8), _meta(6)), "probs"),
    ("swiglu_probs_backward", "grad_out_int", lambda: (torch.ones(6, 4, dtype=torch.int32), torch.randn(6, 8),
                                                       torch.rand(6)), "grad_out"),
    ("swiglu_probs_backward", "grad_out_dtype", lambda: (torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 8),
                                                         torch.rand(6)), "grad_out"),
    ("swiglu_probs_backward", "grad_out_meta", lambda: (_meta(6, 4), torch.randn(6, 8), torch.rand(6)), "grad_out"),
    ("swiglu_probs_backward", "grad_out_shape", lambda: (torch.randn(6, 5), torch.randn(6, 8), torch.rand(6)),
     "grad_out"),
    ("sort_chunks", "split_sizes_meta", lambda: (torch.randn(6, 3), torch.tensor([1, 2, 3], device="meta"),
                                                 torch.tensor([2, 0, 1]), None, False), "split_sizes"),
    ("sort_chunks", "sorted_idxs_meta", lambda: (torch.randn(6, 3), torch.tensor([1, 2, 3]),
                                                 torch.tensor([2, 0, 1], device="meta"), None, False), "sorted_idxs"),
    ("sort_chunks", "split_sizes_sum", lambda: (torch.randn(6, 3), torch.tensor([1, 2, 2]), torch.tensor([2, 0, 1]),
                                                None, False), "split_sizes"),
    # sizes whose int64 sum wraps to the row count (a crash, then an unsorted result, before 2026-12-07)
    ("sort_chunks", "split_sizes_sum_overflows", lambda: (torch.arange(6.).view(6, 1),
                                                          torch.tensor([2**63 - 1, 2**63 - 1, 8]),
                                                          torch.tensor([2, 1, 0]), None, False), "split_sizes"),
    ("sort_chunks", "split_sizes_sum_wraps", lambda: (torch.arange(6.).view(6, 1),
                                                      torch.tensor([2**62, 2**62, 2**62, 2**62 + 6]),
                                                      torch.tensor([3, 2, 1, 0]), None, False), "split_sizes"),
    ("sort_chunks", "sorted_idxs_repeated", lambda: (torch.randn(6, 3), torch.tensor([1, 2, 3]),
                                                     torch.tensor([0, 0, 1]), None, False), "sorted_idxs"),
    ("mask_permute", "routing_map_int32", lambda: (torch.randn(6, 8), TE_MAP, None, None), "routing_map"),
    ("mask_permute", "probs_meta", lambda: (torch.randn(6, 8), TE_MAP.bool(), _meta(6, 4), None), "probs"),
    ("mask_permute", "num_out_tokens_negative", lambda: (torch.randn(6, 8), TE_MAP.bool(), None, -1),
     "num_out_tokens"),
]


def _internal_params():
    from ascend_moe_ops import _library
    for op, id, args, names in INTERNAL:
        nss = [_library.NAMESPACE] + [_library.BACKENDS[b].namespace for b in backends(op)]
        for ns in nss:
            yield pytest.param(op, args, names, ns, id=f"{op}-{id}-{ns}")


@pytest.mark.parametrize("op,args,names,ns", list(_internal_params()))
def test_internal_op_bad_input(op, args, names, ns):
    from ascend_moe_ops import _library
    with pytest.raises((TypeError, ValueError), match=names):
        _library.op(op, ns)(*args())


def test_catalogue_ids_are_unique():
    ids = [(c.op, c.id) for c in CATALOGUE]
    assert len(ids) == len(set(ids))


def counts():
    """{backend: {kind: n}} and the list of non-ok runs."""
    table, bad = {}, []
    for p in _params():
        case, backend, path = p.values
        kind, detail = outcome(case, backend, path)
        table.setdefault(backend, {}).setdefault(kind, 0)
        table[backend][kind] += 1
        if kind != "ok":
            bad.append((kind, backend, path, case.op, case.id, detail))
    return table, bad


if __name__ == "__main__":
    table, bad = counts()
    for row in sorted(bad):
        print(*row, sep=" | ")
    total = {}
    for b, t in table.items():
        print(b, t)
        for k, n in t.items():
            total[k] = total.get(k, 0) + n
    print("total", total)
