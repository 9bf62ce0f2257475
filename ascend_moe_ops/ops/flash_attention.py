"""``flash_attention``: training attention with the peers' API: seqlen_q != seqlen_k (bottom-right
causal), GQA/MQA, any ``d_qk`` / ``d_v`` (e.g. 192 / 128 for MLA), batch or packed varlen layout, two
LSE layouts; forward and backward without materializing the ``S_q x S_k`` score matrix."""

from __future__ import annotations

from typing import Optional

import torch

from .. import _library
from . import _contracts, checks

OP = "flash_attention_fwd"
BWD = "flash_attention_bwd"
Tensor = torch.Tensor
__all__ = ["flash_attention"]
# The AscendC kernels (csrc/ascend/kernels/flash_attention_*.cpp, on the CPU emulation layer) register
# themselves under ascend_moe_ops_emu: forward and backward, fp16/bf16 inputs only (fp32 raises: no
# fp32 Cube path; docs/ascend.md).


# ----------------------------------------------------------------------------- shared helpers
def pack_layout(name: str, x: Tensor, cu_seqlens: Optional[Tensor], max_seqlen: Optional[int],
                token_dims: int):
    """Turn ``[B, S, ...]`` (no ``cu_seqlens``) or packed ``[T, ...]`` into the kernels' packed
    form. Returns ``(cu_seqlens int32/int64 [B+1], max_seqlen, batch_shape or None)``. The values
    of ``cu_seqlens`` are checked at the op boundary."""
    if cu_seqlens is None:
        if token_dims != 2:
            raise ValueError(f"{name} must be [B, S, ...] without cu_seqlens (packed [T, ...] needs "
                             f"cu_seqlens), got shape {tuple(x.shape)}")
        B, S = x.shape[0], x.shape[1]
        cu = torch.arange(0, B + 1, dtype=torch.int32, device=x.device) * S
        return cu, S, (B, S)
    if token_dims != 1:
        raise ValueError(f"with cu_seqlens, {name} must be packed [T, ...], got shape "
                         f"{tuple(x.shape)}")
    cu, max_seqlen = _packed(cu_seqlens, max_seqlen, ("cu_seqlens", "max_seqlen"), x)
    return cu, max_seqlen, None


# ----------------------------------------------------------------------------- op registration
def _fake(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    T, H, _ = q.shape
    return q.new_empty((T, H, v.shape[-1])), q.new_empty((H, T), dtype=_contracts.lse_dtype(q.dtype))


def _fake_bwd(grad_out, q, k, v, k_rope, out, lse, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    dkr = k_rope.new_empty(k_rope.shape) if k_rope is not None else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dkr


def _empty(q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """Tq = 0 (B = 0 too) or Hq = 0: valid, empty results; Tk = 0: no row sees a key (out = 0,
    lse = -inf). As the C++ kernels."""
    if q.shape[0] and q.shape[1] and k.shape[0]:
        return None
    T, H, _ = q.shape
    return (q.new_zeros((T, H, v.shape[-1])),
            q.new_full((H, T), float("-inf"), dtype=_contracts.lse_dtype(q.dtype)))


def _empty_bwd(grad_out, q, k, v, k_rope, *rest):
    if q.shape[0] and q.shape[1] and k.shape[0]:
        return None
    return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
            torch.zeros_like(k_rope) if k_rope is not None else q.new_empty((0,)))


def _setup_context(ctx, inputs, output):
    q, k, v, k_rope, cu_q, cu_k, max_q, max_k, causal, scale = inputs
    out, lse = output
    ctx.has_rope = k_rope is not None
    ctx.same_cu = cu_q is cu_k  # passed on as one tensor (what backends without varlen q/k accept)
    ctx.args = (max_q, max_k, causal, scale)
    ctx.save_for_backward(q, k, v, k_rope, out, lse, cu_q, cu_k)
    ctx.mark_non_differentiable(lse)


def _backward(ops, ctx, grad_out, _grad_lse):
    q, k, v, k_rope, out, lse, cu_q, cu_k = ctx.saved_tensors
    if ctx.same_cu:
        cu_k = cu_q
    max_q, max_k, causal, scale = ctx.args
    dq, dk, dv, dkr = ops(BWD)(grad_out.contiguous(), q, k, v, k_rope, out, lse, cu_q, cu_k, max_q, max_k,
                               causal, scale)
    return dq, dk, dv, (dkr if ctx.has_rope else None), None, None, None, None, None, None


_library.define(_library.OpSpec(
    # (q [Tq,Hq,Dq], k [Tk,Hkv,Dk], v [Tk,Hkv,Dv] (Hkv divides Hq: GQA/MQA, q head h uses kv head
    # h // (Hq // Hkv)), k_rope [Tk,Dr] or None (a key part shared by every head: then Dq = Dk + Dr
    # and score = q[:, :Dk]·k + q[:, Dk:]·k_rope), cu_seqlens_q / cu_seqlens_k [B+1] int32/int64
    # (packed sequences; sequence b has Lq_b queries and Lk_b keys), max_seqlen_q / max_seqlen_k
    # (>= the longest), causal (bottom-right aligned: query i sees keys j <= i + Lk_b - Lq_b),
    # softmax_scale) -> (out [Tq,Hq,Dv] in q's dtype, lse [Hq,Tq] natural-log logsumexp of the
    # scaled scores, fp32 (fp64 for fp64 inputs); a row that sees no key has out = 0 and lse = -inf)
    OP, "(Tensor q, Tensor k, Tensor v, Tensor? k_rope, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "int max_seqlen_q, int max_seqlen_k, bool causal, float softmax_scale) -> (Tensor, Tensor)",
    fake=_fake, check_meta=_contracts.flash_attention_fwd_meta, check=_contracts.flash_attention_fwd,
    backward=_backward, setup_context=_setup_context, empty=_empty), __name__)
_library.define(_library.OpSpec(
    # (grad_out [Tq,Hq,Dv], q, k, v, k_rope, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    # max_seqlen_k, causal, softmax_scale) -> (dq [Tq,Hq,Dq], dk [Tk,Hkv,Dk], dv [Tk,Hkv,Dv] (summed
    # over the q heads of each group), dk_rope [Tk,Dr] summed over heads (shape [0] without k_rope)),
    # all in q's dtype
    BWD, "(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor? k_rope, Tensor out, Tensor lse, "
         "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
         "float softmax_scale) -> (Tensor, Tensor, Tensor, Tensor)",
    fake=_fake_bwd, check_meta=_contracts.flash_attention_bwd_meta, check=_contracts.flash_attention_bwd,
    empty=_empty_bwd, backward_of=OP), __name__)


LSE_LAYOUTS = ("hs", "sh")


def _check_layout(q, k, v):
    """Layout checks the packing needs (the op boundary checks dtypes, devices, heads and head dims)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t)
    if q.dim() not in (3, 4):
        raise ValueError(f"q must be [B, S_q, H_q, D] or packed [T_q, H_q, D], got shape {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dim() != q.dim():
            raise ValueError(f"{name} must be {q.dim()}-D like q, got shape {tuple(t.shape)}")
    if q.dim() == 4 and k.shape[0] != q.shape[0]:
        raise ValueError(f"k must have the batch size {q.shape[0]} of q, got shape {tuple(k.shape)}")
    if tuple(v.shape[:-1]) != tuple(k.shape[:-1]):
        raise ValueError(f"v must have shape {tuple(k.shape[:-1])} + (D_v,) (the tokens and heads of k), "
                         f"got {tuple(v.shape)}")


def _varlen(cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The packed form's (cu_q, cu_k, max_q, max_k); ``cu_seqlens`` means q and k alike (then the same
    tensor is passed twice)."""
    if cu_seqlens is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("pass either cu_seqlens (q and k alike) or cu_seqlens_q and cu_seqlens_k, not both")
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q / max_seqlen_k go with cu_seqlens_q / cu_seqlens_k; with cu_seqlens "
                             "pass max_seqlen")
        return cu_seqlens, cu_seqlens, max_seqlen, max_seqlen
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        missing = "cu_seqlens_k" if cu_seqlens_k is None else "cu_seqlens_q"
        raise ValueError(f"{missing} is missing: cu_seqlens_q and cu_seqlens_k go together")
    if max_seqlen is not None:
        raise ValueError("max_seqlen goes with cu_seqlens; with cu_seqlens_q / cu_seqlens_k pass max_seqlen_q "
                         "and max_seqlen_k")
    return cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    softmax_scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                    max_seqlen: Optional[int] = None, cu_seqlens_q: Optional[Tensor] = None,
                    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
                    max_seqlen_k: Optional[int] = None, return_lse: bool = False,
                    lse_layout: str = "hs"):
    """Softmax attention ``softmax(q k^T * scale) v`` with online-softmax tiling.

    Args:
        q: ``[B, S_q, H_q, D_qk]``, or packed ``[T_q, H_q, D_qk]`` together with ``cu_seqlens``
            (or ``cu_seqlens_q``); fp32/fp16/bf16 (fp64 runs on the reference and native backends).
        k: ``[B, S_k, H_kv, D_qk]`` / packed ``[T_k, H_kv, D_qk]``. ``H_kv`` must divide ``H_q``
            (GQA; ``H_kv = 1`` is MQA): q head ``h`` uses kv head ``h // (H_q // H_kv)``.
        v: ``[B, S_k, H_kv, D_v]`` / ``[T_k, H_kv, D_v]``; ``D_v`` may differ from ``D_qk`` (both
            ways: 192/128 for MLA, 64/128 too; no padding).
        causal: bottom-right aligned, as flash-attention >= 2.1: in a sequence with ``L_q``
            queries and ``L_k`` keys, query ``i`` sees keys ``j <= i + L_k - L_q``; a query that
            sees no key gets ``out = 0``, ``lse = -inf`` and zero gradients. With ``L_q = L_k``
            that is the usual "keys ``<= i``". Default ``False`` (as flash-attention and SDPA;
            changed from ``True``: docs/design.md, Changes).
        softmax_scale: defaults to ``D_qk ** -0.5``; pass it explicitly for YaRN.
        cu_seqlens: ``[B+1]`` int32/int64 cumulative sequence starts of packed sequences, for q
            and k alike (``0 = c[0] <= c[1] <= ... <= c[B] = T``); empty sequences are allowed.
        max_seqlen: longest sequence; computed from ``cu_seqlens`` (one host sync) when omitted.
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the two-argument packed form
            (flash_attn_varlen_func's names): sequence ``b`` has queries
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
            of k / v; both ``[B+1]`` with the same B. Not combinable with ``cu_seqlens``.
        return_lse: also return the logsumexp of the scaled scores (natural log, fp32, fp64 for
            fp64 inputs; not differentiable).
        lse_layout: ``"hs"`` (default): ``[B, H_q, S_q]`` for batch input, ``[H_q, T_q]`` packed
            (flash-attention 2's layout); ``"sh"``: ``[B, S_q, H_q]`` / ``[T_q, H_q]`` (the peers'
            other layout). The op computes ``[H_q, T_q]``; ``"sh"`` is a transposed view of it.

    Returns:
        ``out`` ``[.., H_q, D_v]`` in ``q``'s dtype (and ``lse`` if asked). Differentiable w.r.t.
        ``q``, ``k`` and ``v`` (``dk``/``dv`` summed over the q heads of each kv head group);
        accumulation is fp32.
    """
    _check_layout(q, k, v)
    checks.check_bool("causal", causal)
    checks.check_bool("return_lse", return_lse)
    if lse_layout not in LSE_LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LSE_LAYOUTS}, got {lse_layout!r}")
    packed = (cu_seqlens, cu_seqlens_q, cu_seqlens_k)
    if any(c is not None for c in packed):
        if q.dim() != 3:
            raise ValueError(f"with cu_seqlens, q must be packed [T_q, H_q, D], got shape {tuple(q.shape)}")
        cu_q, cu_k, max_q, max_k = _varlen(cu_seqlens, max_seqlen, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k)
        names = ("cu_seqlens", "max_seqlen") if cu_seqlens is not None else None
        cu_q, max_q = _packed(cu_q, max_q, names or ("cu_seqlens_q", "max_seqlen_q"), q)
        if cu_seqlens is not None:
            cu_k, max_k = cu_q, max_q
        else:
            cu_k, max_k = _packed(cu_k, max_k, ("cu_seqlens_k", "max_seqlen_k"), q)
        batch = None
    else:
        if q.dim() != 4:
            raise ValueError(f"q must be [B, S_q, H_q, D] without cu_seqlens (packed [T, H, D] needs cu_seqlens), "
                             f"got shape {tuple(q.shape)}")
        for name, val in (("max_seqlen", max_seqlen), ("max_seqlen_q", max_seqlen_q),
                          ("max_seqlen_k", max_seqlen_k)):
            if val is not None:
                raise ValueError(f"{name} goes with the packed form (cu_seqlens); the batch form has none")
        B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]
        cu_q = torch.arange(0, B + 1, dtype=torch.int32, device=q.device) * Sq
        cu_k = cu_q if Sk == Sq else torch.arange(0, B + 1, dtype=torch.int32, device=q.device) * Sk
        max_q, max_k = Sq, Sk
        batch = (B, Sq)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5 if q.shape[-1] > 0 else 1.0  # D = 0 is refused at the op
    softmax_scale = checks.check_float("softmax_scale", softmax_scale)
    Hq, Hkv = q.shape[-2], k.shape[-2]
    Tq = q.shape[0] * q.shape[1] if batch is not None else q.shape[0]
    Tk = k.shape[0] * k.shape[1] if batch is not None else k.shape[0]
    qp = q.reshape(Tq, Hq, q.shape[-1])  # explicit T: H = 0 is valid
    kp, vp = (t.reshape(Tk, Hkv, t.shape[-1]) for t in (k, v))
    out, lse = _library.op(OP)(qp.contiguous(), kp.contiguous(), vp.contiguous(), None, cu_q, cu_k,
                               max_q, max_k, causal, softmax_scale)
    if batch is not None:
        out = out.view(*batch, Hq, v.shape[-1])
        lse = lse.view(Hq, *batch).permute(1, 0, 2) if lse_layout == "hs" else lse.view(Hq, *batch).permute(1, 2, 0)
    elif lse_layout == "sh":
        lse = lse.t()
    return (out, lse) if return_lse else out


def _packed(cu, max_len, names, like: Tensor):
    """Check one ``cu_seqlens``-like argument (a 1-D integer tensor on ``like``'s device; its values are
    checked at the op) and get its max length (one host synchronization when not given)."""
    name, max_name = names
    checks.check_tensor(name, cu, ndim=1, dtypes=checks.INDEX_DTYPES, device=like.device)
    if max_len is None:
        # one host synchronization; pass max_seqlen to avoid it (and under torch.compile)
        max_len = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    checks.check_int(max_name, max_len)
    return cu.contiguous(), max_len
