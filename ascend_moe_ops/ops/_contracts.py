"""The op contracts, checked at the op boundary: what every ``torch.ops.<namespace>.<op>`` call
passes through, whichever backend serves it.

An op's contract is the ``check`` (and ``check_meta``) of its spec (``_library.OpSpec``), given by
its op module: this module holds the shared helpers and the contracts of the ops defined before
contracts could live in their own module; a new op may define its contract in its op module (as
``swiglu_probs`` does) and adds nothing here.

* The C++ backends (native CPU kernels, the emulated AscendC glue) run the twin of each check,
  ``amo::checks::<op>`` in ``csrc/common/<family>_checks.h`` (same rules, same messages).
* The Python backends (reference, triton) run the spec's ``check`` in their registered kernel.
* Every namespace's fake (meta) kernel runs the spec's ``check_meta``: the metadata part (dtype,
  shape, device, sizes), so a meta-device input mixed with real ones, or a wrong shape under
  ``torch.compile``, is refused before anything is traced or allocated.

Errors: a wrong dtype raises ``TypeError`` (the lse of the backward ops too: it was a
``RuntimeError`` until 2026-12-07); a wrong shape, device, size or value ``ValueError``. Every
message starts with the op and names the argument. Value checks read the
data on the CPU; on accelerators they are device-side asserts (no host synchronization).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

Tensor = torch.Tensor
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_ROWS = 2 ** 31 - 1  # row_id_map is int32
MAX_EXPERTS = 2 ** 20   # id routing; the [E] count outputs are int64


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _shape(s) -> str:
    return str(tuple(s))


def is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake
    return _is_fake(t) or t.device.type == "meta"


def dtype_in(op, name, t, dtypes) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in ({', '.join(_name(d) for d in dtypes)}), "
                        f"got {_name(t.dtype)}")


def ndim(op, name, t, d, layout) -> None:
    if t.dim() != d:
        raise ValueError(f"{op}: {name} must be {d}-D {layout}, got shape {_shape(t.shape)}")


def same_device(op, name, t, like) -> None:
    if t.device != like.device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other inputs are on {like.device}")


def shape_is(op, name, t, expected: Sequence[int], what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {_shape(expected)} ({what}), got {_shape(t.shape)}")


def float_tensor(op, name, t, d, layout) -> None:
    ndim(op, name, t, d, layout)
    dtype_in(op, name, t, FLOAT_DTYPES)


def like_tensor(op, name, t, like, d, layout) -> None:
    ndim(op, name, t, d, layout)
    dtype_in(op, name, t, (like.dtype,))
    same_device(op, name, t, like)


def values_ok(op: Optional[str], name, t: Tensor, bad, rule: str, short: str) -> None:
    """The one value check: ``bad(t)`` (a bool mask of ``t``'s elements) is nowhere true. On the CPU
    a ValueError naming ``t``'s first bad element and ``rule``; elsewhere a device-side assert with
    ``short`` (no host synchronization); nothing for an empty or fake tensor. ``op`` prefixes the
    message (``None``: no prefix)."""
    if t.numel() == 0 or is_fake(t):
        return
    prefix = f"{op}: " if op else ""
    mask = bad(t)
    if t.device.type == "cpu":
        if bool(mask.any()):
            where = tuple(torch.nonzero(mask)[0].tolist())
            raise ValueError(f"{prefix}{name} has value {t[where].item()} at index {where}{rule}")
    else:
        torch._assert_async(~mask.any(), f"{prefix}{name} {short}")


def index_range(op: Optional[str], name, idx: Tensor, low: int, high: int) -> None:
    """All values in ``[low, high)`` (:func:`values_ok`)."""
    values_ok(op, name, idx, lambda t: (t < low) | (t >= high), f", outside the valid range [{low}, {high})",
              f"has values outside [{low}, {high})")


def unique_rows(op: str, name: str, rows: Tensor, num_rows: int) -> None:
    """Every row in ``[0, num_rows)`` is referenced by at most one slot of ``rows`` (a row map from
    moe_permute never repeats a row; a repeated one makes the backward's scatter ill-defined). Run
    after :func:`index_range`. On the CPU a ValueError naming the first slot (in flat order) whose row
    an earlier slot already references, and that earlier slot; elsewhere per-row counts and a
    device-side assert. O(T*K + N): less than the ``[N, H]`` rows themselves."""
    if rows.numel() < 2 or num_rows == 0 or is_fake(rows):
        return
    flat = rows.reshape(-1).to(torch.int64)
    # slots not kept (and, on a device where the range assert does not stop the host, rows out of
    # range) go to a spare bin
    bins = torch.where((flat >= 0) & (flat < num_rows), flat, num_rows)
    if rows.device.type == "cpu":
        if bool((torch.bincount(bins, minlength=num_rows + 1)[:num_rows] > 1).any()):
            first = {}
            for i, r in enumerate(flat.tolist()):
                if r >= 0 and r in first:
                    raise ValueError(f"{op}: {name} refers to row {r} from more than one slot, at "
                                     f"{_unravel(first[r], rows.shape)} and {_unravel(i, rows.shape)}; each "
                                     "row may be referenced at most once (the map moe_permute returns)")
                first.setdefault(r, i)
    else:
        counts = torch.zeros(num_rows + 1, dtype=torch.int32, device=rows.device)
        counts.scatter_add_(0, bins, torch.ones_like(bins, dtype=torch.int32))
        torch._assert_async((counts[:num_rows] <= 1).all(), f"{op}: {name} refers to a row from more than one "
                            "slot; each row may be referenced at most once (the map moe_permute returns)")


def _unravel(i: int, shape) -> tuple:
    where = []
    for d in reversed(shape):
        where.append(i % d)
        i //= d
    return tuple(reversed(where))


# ------------------------------------------------------------------------------------ moe_permute
def output_rows(num_tokens: int, slots: int, num_experts: int, capacity: Optional[int], align: int,
                num_out_tokens: Optional[int]) -> int:
    """The output row count N of moe_permute, from shapes alone: the one Python definition (used by
    the checks, the fake kernel, the reference and the Triton backend; the C++ one is
    ``amo::checks::moe_permute_rows`` in csrc/common/moe_permute_checks.h). Arguments as the op takes them
    (``None`` = not given), already checked."""
    if capacity is not None:
        return num_experts * capacity
    base = num_out_tokens if num_out_tokens is not None else num_tokens * slots
    return base + num_experts * (align - 1)


def moe_permute_meta(tokens, routing, probs, num_experts, capacity, align, num_out_tokens) -> int:
    op = "moe_permute"
    float_tensor(op, "tokens", tokens, 2, "[T, H]")
    ndim(op, "routing", routing, 2, "[T, K] (expert ids) or [T, E] (bool mask)")
    dtype_in(op, "routing", routing, (torch.bool,) + INDEX_DTYPES)
    same_device(op, "routing", routing, tokens)
    if routing.shape[0] != tokens.shape[0]:
        raise ValueError(f"{op}: routing must have one row per token: tokens has {tokens.shape[0]} rows, "
                         f"routing has shape {_shape(routing.shape)}")
    mask = routing.dtype == torch.bool
    if num_experts < 1:
        raise ValueError(f"{op}: num_experts must be >= 1, got {num_experts}")
    if mask and num_experts != routing.shape[1]:
        raise ValueError(f"{op}: num_experts={num_experts} does not match the routing mask's "
                         f"{routing.shape[1]} columns")
    if not mask and num_experts > MAX_EXPERTS:
        raise ValueError(f"{op}: num_experts={num_experts} exceeds the supported maximum of 2^20 experts")
    if probs is not None:
        dtype_in(op, "probs", probs, FLOAT_DTYPES)
        same_device(op, "probs", probs, tokens)
        shape_is(op, "probs", probs, routing.shape, "the shape of routing")
    if align < 1:
        raise ValueError(f"{op}: align must be >= 1, got {align}")
    T, S = routing.shape
    slots = T * S
    if slots > MAX_ROWS:
        raise ValueError(f"{op}: routing has T*K = {slots} slots; row_id_map is int32, so at most "
                         "2^31-1 are supported")
    if capacity is not None:
        if capacity < 1:
            raise ValueError(f"{op}: capacity must be >= 1, got {capacity}")
        if capacity % align:
            raise ValueError(f"{op}: align={align} must divide capacity={capacity}")
        if num_out_tokens is not None:
            raise ValueError(f"{op}: num_out_tokens cannot be combined with capacity (the output has "
                             "exactly num_experts * capacity rows)")
        if num_experts * capacity > MAX_ROWS:
            raise ValueError(f"{op}: capacity={capacity} is too large: num_experts * capacity = "
                             f"{num_experts} * {capacity} rows exceeds 2^31-1 (row_id_map is int32)")
    else:
        base = slots
        if num_out_tokens is not None:
            base = num_out_tokens
            if base < 0:
                raise ValueError(f"{op}: num_out_tokens must be >= 0, got {base}")
            if base > MAX_ROWS:
                raise ValueError(f"{op}: num_out_tokens={base} exceeds 2^31-1 rows (row_id_map is int32)")
        if num_experts * (align - 1) > MAX_ROWS - base:
            raise ValueError(f"{op}: align={align} is too large: the output would have {base} + "
                             "num_experts * (align - 1) rows, more than 2^31-1 (row_id_map is int32)")
    return output_rows(T, S, num_experts, capacity, align, num_out_tokens)


MAP_TYPES = ("index", "mask")


def routing_kind(routing: Tensor, num_experts: Optional[int], map_type: Optional[str]) -> Tensor:
    """The public ``moe_permute``'s reading of ``routing``: a bool ``[T, E]`` mask, or integer
    expert ids. ``map_type="mask"`` takes a ``[T, E]`` 0/1 routing map of any integer (or bool)
    dtype, TransformerEngine's format, and returns it as a bool mask; an integer ``[T, E]`` tensor
    with ``num_experts = E`` columns and no ``map_type`` is refused as ambiguous (ids with
    top-K = E, or a 0/1 map), never silently read as ids."""
    op = "moe_permute"
    if map_type is not None and map_type not in MAP_TYPES:
        raise ValueError(f"{op}: map_type must be 'index' (expert ids) or 'mask' (a [T, E] routing map), "
                         f"got {map_type!r}")
    if routing.dtype == torch.bool:
        if map_type == "index":
            raise ValueError(f"{op}: map_type='index' needs integer expert ids, but routing is a bool [T, E] mask")
        return routing
    if map_type == "mask":
        if routing.is_floating_point() or routing.is_complex():
            raise TypeError(f"{op}: routing with map_type='mask' must have an integer or bool dtype (1 = routed, "
                            f"0 = not), got {_name(routing.dtype)}")
        ndim(op, "routing", routing, 2, "[T, E] (a routing map)")
        index_range(op, "routing (a 0/1 routing map)", routing, 0, 2)
        return routing != 0
    if (map_type is None and routing.dim() == 2 and num_experts is not None and routing.shape[1] == num_experts
            and not routing.is_floating_point()):
        raise ValueError(
            f"{op}: routing is an integer tensor of shape {_shape(routing.shape)} with num_experts={num_experts} "
            "columns: that is either expert ids with top-K = num_experts or a [T, E] 0/1 routing map "
            "(TransformerEngine's format). Say which: map_type='mask' (or pass a bool mask) or map_type='index'")
    return routing


def moe_permute(tokens, routing, probs, num_experts, capacity, align, num_out_tokens) -> None:
    op = "moe_permute"
    moe_permute_meta(tokens, routing, probs, num_experts, capacity, align, num_out_tokens)
    if routing.dtype != torch.bool:
        index_range(op, "routing (expert ids)", routing, -1, num_experts)
    # num_out_tokens below the routed count is valid (the first rows are kept): nothing to compare
    # with the data, so no host synchronization for it


# ---------------------------------------------------------------------------------- moe_unpermute
def moe_unpermute_meta(permuted, row_id_map, probs) -> None:
    op = "moe_unpermute"
    float_tensor(op, "permuted", permuted, 2, "[N, H]")
    ndim(op, "row_id_map", row_id_map, 2, "[T, K]")
    dtype_in(op, "row_id_map", row_id_map, INDEX_DTYPES)
    same_device(op, "row_id_map", row_id_map, permuted)
    if probs is not None:
        dtype_in(op, "probs", probs, FLOAT_DTYPES)
        same_device(op, "probs", probs, permuted)
        shape_is(op, "probs", probs, row_id_map.shape, "the shape of row_id_map")


def moe_unpermute(permuted, row_id_map, probs) -> None:
    moe_unpermute_meta(permuted, row_id_map, probs)
    index_range("moe_unpermute", "row_id_map", row_id_map, -1, permuted.shape[0])
    unique_rows("moe_unpermute", "row_id_map", row_id_map, permuted.shape[0])


def moe_unpermute_backward_meta(grad_out, permuted, row_id_map, probs) -> None:
    op = "moe_unpermute_backward"
    float_tensor(op, "grad_out", grad_out, 2, "[T, H]")
    float_tensor(op, "permuted", permuted, 2, "[N, H] (or an [N, 0] stand-in without probs)")
    same_device(op, "permuted", permuted, grad_out)
    ndim(op, "row_id_map", row_id_map, 2, "[T, K]")
    dtype_in(op, "row_id_map", row_id_map, INDEX_DTYPES)
    same_device(op, "row_id_map", row_id_map, grad_out)
    if grad_out.shape[0] != row_id_map.shape[0]:
        raise ValueError(f"{op}: grad_out must have one row per row of row_id_map: grad_out has shape "
                         f"{_shape(grad_out.shape)}, row_id_map {_shape(row_id_map.shape)}")
    if probs is not None:
        dtype_in(op, "probs", probs, FLOAT_DTYPES)
        same_device(op, "probs", probs, grad_out)
        shape_is(op, "probs", probs, row_id_map.shape, "the shape of row_id_map")
        if permuted.shape[1] != grad_out.shape[1]:
            raise ValueError(f"{op}: permuted must have shape (N, {grad_out.shape[1]}) with probs (the "
                             f"hidden size of grad_out), got {_shape(permuted.shape)}")


def moe_unpermute_backward(grad_out, permuted, row_id_map, probs) -> None:
    moe_unpermute_backward_meta(grad_out, permuted, row_id_map, probs)
    index_range("moe_unpermute_backward", "row_id_map", row_id_map, -1, permuted.shape[0])
    unique_rows("moe_unpermute_backward", "row_id_map", row_id_map, permuted.shape[0])


# ----------------------------------------------------------------------------------- grouped_gemm
def group_sizes(op, gs, groups: int, x, rows: int, values: bool) -> None:
    """The one group-size check: 1-D int32/int64, one entry per group, on x's device or the cpu
    (never meta next to real inputs); values in [0, rows] each and sum <= rows (each entry is
    bounded first, so the int64 sum cannot overflow)."""
    ndim(op, "group_sizes", gs, 1, "[E]")
    dtype_in(op, "group_sizes", gs, INDEX_DTYPES)
    if gs.device != x.device and gs.device.type != "cpu":
        raise ValueError(f"{op}: group_sizes is on {gs.device} but the other inputs are on {x.device} "
                         "(group_sizes may live on their device or the cpu)")
    if groups >= 0 and gs.shape[0] != groups:
        raise ValueError(f"{op}: group_sizes must have one entry per expert: weight has {groups} experts, "
                         f"group_sizes has shape {_shape(gs.shape)}")
    if not values or gs.numel() == 0 or is_fake(gs):
        return
    g = gs.to(torch.int64)
    if g.device.type == "cpu":
        neg = torch.nonzero(g < 0)
        if neg.numel():
            e = int(neg[0, 0])
            raise ValueError(f"{op}: group_sizes must be non-negative, got {int(g[e])} for group {e}")
        big = torch.nonzero(g > rows)
        if big.numel():
            e = int(big[0, 0])
            raise ValueError(f"{op}: sum(group_sizes) exceeds the {rows} rows of the input (group {e} "
                             f"alone has {int(g[e])})")
        total = int(g.sum())
        if total > rows:
            raise ValueError(f"{op}: sum(group_sizes) = {total} exceeds the {rows} rows of the input")
    else:
        torch._assert_async(((g >= 0) & (g <= rows)).all(), f"{op}: group_sizes must be in [0, {rows}]")
        torch._assert_async(g.sum() <= rows, f"{op}: sum(group_sizes) exceeds the number of input rows")


def grouped_gemm_meta(x, weight, gs, trans_b, values: bool = False) -> None:
    op = "grouped_gemm"
    float_tensor(op, "x", x, 2, "[M, K]")
    layout = "[E, N, K]" if trans_b else "[E, K, N]"
    like_tensor(op, "weight", weight, x, 3, layout)
    k_w = weight.shape[2] if trans_b else weight.shape[1]
    if k_w != x.shape[1]:
        raise ValueError(f"{op}: weight {layout} (trans_b={trans_b}) has K={k_w} but x has K={x.shape[1]} "
                         f"(x {_shape(x.shape)}, weight {_shape(weight.shape)})")
    group_sizes(op, gs, weight.shape[0], x, x.shape[0], values)


def grouped_gemm(x, weight, gs, trans_b) -> None:
    grouped_gemm_meta(x, weight, gs, trans_b, values=True)


def grouped_gemm_dw_meta(a, b, gs, values: bool = False) -> None:
    op = "grouped_gemm_dw"
    float_tensor(op, "a", a, 2, "[M, P]")
    like_tensor(op, "b", b, a, 2, "[M, Q]")
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"{op}: a and b must have the same rows: a {_shape(a.shape)}, b {_shape(b.shape)}")
    group_sizes(op, gs, -1, a, a.shape[0], values)


def grouped_gemm_dw(a, b, gs) -> None:
    grouped_gemm_dw_meta(a, b, gs, values=True)


# -------------------------------------------------------------------------------- flash attention
# Shapes: q [Tq, Hq, Dq], k [Tk, Hkv, Dk], v [Tk, Hkv, Dv], k_rope [Tk, Dr] (optional), cu_seqlens_q and
# cu_seqlens_k [B+1] (the same B), lse [Hq, Tq]. Hkv divides Hq (GQA/MQA). d_v > d_qk is valid.
def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def cu_seqlens(op, cu, q, max_seqlen, values: bool, name: str = "cu_seqlens", max_name: str = "max_seqlen",
               T: Optional[int] = None, of: str = "q", like: Optional[Tensor] = None,
               entries: Optional[int] = None) -> None:
    """``cu`` [B+1] int32/int64 on ``like``'s (default q's) device: starts at 0, non-decreasing, ends at
    ``T`` (default the tokens of q), no sequence longer than ``max_seqlen``; ``entries``: the required
    B+1 (cu_seqlens_k: that of cu_seqlens_q)."""
    T = q.shape[0] if T is None else T
    like = q if like is None else like
    ndim(op, name, cu, 1, "[B+1]")
    dtype_in(op, name, cu, INDEX_DTYPES)
    same_device(op, name, cu, like)
    if entries is not None and cu.numel() != entries:
        raise ValueError(f"{op}: {name} must have the B+1 = {entries} entries of cu_seqlens_q (one per sequence "
                         f"boundary), got shape {_shape(cu.shape)}")
    if not (cu.numel() >= 2 or (cu.numel() == 1 and T == 0)):
        raise ValueError(f"{op}: {name} must have B+1 >= 2 entries (one entry only for B = 0 and no "
                         f"tokens), got shape {_shape(cu.shape)} for T={T} tokens")
    if max_seqlen < 0:
        raise ValueError(f"{op}: {max_name} must be >= 0, got {max_seqlen}")
    if not values or is_fake(cu):
        return
    if cu.device.type != "cpu":
        d = cu[1:] - cu[:-1]
        torch._assert_async((cu[0] == 0) & (cu[-1] == T) & (d >= 0).all()
                            & ((d.max() if d.numel() else cu[0]) <= max_seqlen),
                            f"{op}: {name} must start at 0, be non-decreasing, end at the tokens of {of} and "
                            f"have no sequence longer than {max_name}")
        return
    c = cu.tolist()
    if c[0] != 0:
        raise ValueError(f"{op}: {name} must start at 0, got {c[0]}")
    for i in range(len(c) - 1):
        if c[i + 1] < c[i]:
            raise ValueError(f"{op}: {name} must be non-decreasing, got {name}[{i}]={c[i]} > "
                             f"{name}[{i + 1}]={c[i + 1]}")
    if c[-1] != T:
        raise ValueError(f"{op}: {name} must end at the number of tokens of {of} T={T}, got {c[-1]}")
    longest = max((c[i + 1] - c[i] for i in range(len(c) - 1)), default=0)
    if longest > max_seqlen:
        raise ValueError(f"{op}: {max_name}={max_seqlen} is smaller than the longest sequence ({longest})")


def lse(op, t, q) -> None:
    want = lse_dtype(q.dtype)
    if t.dtype != want:
        raise TypeError(f"{op}: lse must be {_name(want)} (float64 for float64 inputs), got {_name(t.dtype)}")
    same_device(op, "lse", t, q)
    shape_is(op, "lse", t, (q.shape[1], q.shape[0]), "[H, T]")


_F32_MAX = float(torch.finfo(torch.float32).max)


def _scale(op, softmax_scale, q) -> None:
    # finite in the kernels' accumulation type (float32 below float64 inputs: 1e39 is a finite Python
    # float and inf in float32, where every score times it is inf or NaN)
    wide = q.dtype == torch.float64
    if not math.isfinite(softmax_scale) or (not wide and abs(softmax_scale) > _F32_MAX):
        raise ValueError(f"{op}: softmax_scale must be finite in {'float64' if wide else 'float32'} "
                         f"(the accumulation type), got {softmax_scale}")


def _attention(op, q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale, values) -> None:
    float_tensor(op, "q", q, 3, "[Tq, Hq, D_qk]")
    like_tensor(op, "k", k, q, 3, "[Tk, Hkv, D_k]")
    like_tensor(op, "v", v, q, 3, "[Tk, Hkv, D_v]")
    _, Hq, Dq = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    if not ((Hkv == 0 and Hq == 0) or (Hkv >= 1 and Hq % Hkv == 0)):
        raise ValueError(f"{op}: k must have a number of heads Hkv that divides the Hq={Hq} heads of q (GQA/MQA), "
                         f"got shape {_shape(k.shape)}")
    if v.shape[0] != Tk or v.shape[1] != Hkv:
        raise ValueError(f"{op}: v must have shape ({Tk}, {Hkv}, D) (the tokens and heads of k), got "
                         f"{_shape(v.shape)}")
    dr = 0
    if k_rope is not None:
        like_tensor(op, "k_rope", k_rope, q, 2, "[Tk, D_r]")
        if k_rope.shape[0] != Tk:
            raise ValueError(f"{op}: k_rope must have shape ({Tk}, D_r) (the tokens of k), got "
                             f"{_shape(k_rope.shape)}")
        dr = k_rope.shape[1]
    if Dq < 1 or v.shape[2] < 1:
        raise ValueError(f"{op}: head dims must be positive, got d_qk={Dq}, d_v={v.shape[2]}")
    if k.shape[2] + dr != Dq:
        raise ValueError(f"{op}: k head dim must equal q head dim {Dq} minus the k_rope dim {dr}, got "
                         f"{k.shape[2]}")
    _scale(op, softmax_scale, q)
    cu_seqlens(op, cu_q, q, max_q, values, "cu_seqlens_q", "max_seqlen_q")
    cu_seqlens(op, cu_k, q, max_k, values, "cu_seqlens_k", "max_seqlen_k", T=Tk, of="k",
               entries=cu_q.numel())


def flash_attention_fwd_meta(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale,
                             values=False) -> None:
    _attention("flash_attention_fwd", q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale, values)


def flash_attention_fwd(*args) -> None:
    flash_attention_fwd_meta(*args, values=True)


def flash_attention_bwd_meta(grad_out, q, k, v, k_rope, out, l, cu_q, cu_k, max_q, max_k, causal,
                             softmax_scale, values=False) -> None:
    op = "flash_attention_bwd"
    _attention(op, q, k, v, k_rope, cu_q, cu_k, max_q, max_k, softmax_scale, values)
    o_shape = (q.shape[0], q.shape[1], v.shape[2])
    for name, t in (("grad_out", grad_out), ("out", out)):
        like_tensor(op, name, t, q, 3, "[Tq, Hq, D_v]")
        shape_is(op, name, t, o_shape, "[Tq, Hq, D_v]")
    lse(op, l, q)


def flash_attention_bwd(*args) -> None:
    flash_attention_bwd_meta(*args, values=True)


# -------------------------------------------------------------------------------------------- MLA
def _mla(op, q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale, values) -> None:
    float_tensor(op, "q", q, 3, "[T, H, Dn + Dr]")
    for name, val in (("num_heads", H), ("qk_nope_dim", Dn), ("v_dim", Dv)):
        if val < 1:
            raise ValueError(f"{op}: {name} must be >= 1, got {val}")
    T, _, Dq = q.shape
    if q.shape[1] != H:
        raise ValueError(f"{op}: q must have num_heads={H} heads (dim 1), got shape {_shape(q.shape)}")
    if Dq - Dn < 1:
        raise ValueError(f"{op}: q head dim {Dq} must be qk_nope_dim={Dn} + a rope dim >= 1")
    like_tensor(op, "c_kv", c_kv, q, 2, "[T, Dc]")
    if c_kv.shape[0] != T:
        raise ValueError(f"{op}: c_kv must have shape ({T}, Dc) (the tokens of q), got {_shape(c_kv.shape)}")
    like_tensor(op, "k_pe", k_pe, q, 2, "[T, Dr]")
    shape_is(op, "k_pe", k_pe, (T, Dq - Dn), "tokens of q, rope dim = q head dim - qk_nope_dim")
    like_tensor(op, "w_kv_up", w, q, 2, "[H * (Dn + Dv), Dc]")
    shape_is(op, "w_kv_up", w, (H * (Dn + Dv), c_kv.shape[1]), "[num_heads*(qk_nope_dim+v_dim), latent dim]")
    _scale(op, softmax_scale, q)
    cu_seqlens(op, cu, q, max_seqlen, values)


def mla_attention_fwd_meta(q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale, causal, save_kv,
                           values=False) -> None:
    _mla("mla_attention_fwd", q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale, values)


def mla_attention_fwd(*args) -> None:
    mla_attention_fwd_meta(*args, values=True)


def mla_attention_bwd_meta(grad_out, q, c_kv, k_pe, w, out, l, kv, cu, max_seqlen, H, Dn, Dv,
                           softmax_scale, causal, values=False) -> None:
    op = "mla_attention_bwd"
    _mla(op, q, c_kv, k_pe, w, cu, max_seqlen, H, Dn, Dv, softmax_scale, values)
    o_shape = (q.shape[0], H, Dv)
    for name, t in (("grad_out", grad_out), ("out", out)):
        like_tensor(op, name, t, q, 3, "[T, H, Dv]")
        shape_is(op, name, t, o_shape, "[T, H, Dv]")
    lse(op, l, q)
    if kv.numel() != 0:
        like_tensor(op, "kv", kv, q, 2, "[T, H * (Dn + Dv)] (or shape [0] = recompute)")
        shape_is(op, "kv", kv, (q.shape[0], w.shape[0]), "[T, H * (Dn + Dv)], or shape [0] = recompute")


def mla_attention_bwd(*args) -> None:
    mla_attention_bwd_meta(*args, values=True)

