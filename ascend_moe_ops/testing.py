"""Test helpers shared by tests/ and bench/: the one tolerance table, and parity assertions against
the fp64 reference.

Rule for floats (the flash-attention rule): the fast path's max error against the fp64 reference
must be at most ``ERROR_FACTOR`` times the max error of the same computation done by PyTorch in the
same low precision, plus a small absolute floor from :data:`TOLERANCES` (which also bounds ops that
have no natural PyTorch low-precision counterpart). Index outputs must match exactly.
"""

from __future__ import annotations

from typing import Optional

import torch

ERROR_FACTOR = 2.0

# dtype -> (atol, rtol): the floor used together with the 2x rule, and the plain tolerance used
# when there is no low-precision PyTorch run to compare with. Data movement ops (permute) must be
# exact in every dtype; these only apply to arithmetic.
TOLERANCES = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cpu_flags() -> frozenset:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where there is none): which instruction-set
    paths a test can run here."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def tolerance(dtype: torch.dtype):
    return TOLERANCES[dtype]


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max ``|a - b|`` over the positions where ``b`` is finite (0 for empty tensors); inf where
    ``a`` is not finite there."""
    if a.numel() == 0:
        return 0.0
    a, b = torch.broadcast_tensors(a.double(), b.double())
    finite = torch.isfinite(b)
    if not finite.any():
        return 0.0
    d = (a[finite] - b[finite]).abs()
    return d.max().item() if torch.isfinite(d).all() else float("inf")


def _nonfinite_mismatch(o: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Bool mask: positions where ``o`` and ``r`` differ in being NaN, +inf or -inf."""
    return ((torch.isnan(o) != torch.isnan(r)) | (torch.isposinf(o) != torch.isposinf(r))
            | (torch.isneginf(o) != torch.isneginf(r)))


def assert_close_to_ref(out: torch.Tensor, ref64: torch.Tensor, *, dtype: Optional[torch.dtype] = None,
                        torch_lowp: Optional[torch.Tensor] = None, name: str = "output") -> None:
    """``out`` (any dtype) vs the fp64 reference ``ref64``.

    Non-finite values must sit exactly where the reference has them: NaN where it is NaN, +inf
    where +inf, -inf where -inf (a NaN or inf where the reference is finite fails, and so does a
    finite value, or another non-finite one, where the reference is NaN or inf). At the finite
    positions, with ``torch_lowp`` (PyTorch's own result in the same low precision) the bound is
    ``ERROR_FACTOR * err(torch_lowp) + atol + rtol*|ref|`` (``err`` taken where both the
    reference and ``torch_lowp`` are finite); without it, ``atol + rtol*|ref|``.
    """
    dtype = dtype or out.dtype
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    if out.numel() == 0:
        return
    o = out.double()
    r = ref64.double()
    mismatch = _nonfinite_mismatch(o, r)
    if mismatch.any():
        i = tuple(torch.nonzero(mismatch)[0].tolist())
        raise AssertionError(
            f"{name} ({dtype}): inf/NaN positions differ from the reference at "
            f"{int(mismatch.sum())} place(s); first at {i}: {o[i].item():.6g} vs reference "
            f"{r[i].item():.6g}")
    finite = torch.isfinite(r)
    atol, rtol = TOLERANCES[dtype]
    bound = atol + rtol * r.abs()
    if torch_lowp is not None:
        assert torch_lowp.shape == ref64.shape, (
            f"{name}: torch_lowp shape {tuple(torch_lowp.shape)} != reference {tuple(ref64.shape)}")
        lo = torch_lowp.double()
        both = finite & torch.isfinite(lo)
        bound = bound + ERROR_FACTOR * (max_abs_err(lo[both], r[both]) if both.any() else 0.0)
    err = torch.where(finite, (o - r).abs(), torch.zeros_like(r))
    bad = err > bound
    if bad.any():
        i = tuple(torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{name} ({dtype}): max error {err.max().item():.3e}; first failure at {i}: "
            f"{o[i].item():.6g} vs reference {r[i].item():.6g} (bound {bound[i].item():.3e})")


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of NaNs shaped like ``t`` (to check that garbage never leaks into used rows)."""
    return torch.full_like(t, float("nan"))


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                    causal: bool, softmax_scale: float):
    """PyTorch's own attention in the inputs' dtype: the low-precision baseline of the 2x rule for
    attention (as flash-attention's tests use: no upcast). Packed ``[T, H, D]`` inputs, one
    sequence at a time: ``scores = (q k^T) * scale`` (a matmul in the input dtype), the causal
    mask, ``torch.softmax`` and ``p @ v``, all in the input dtype; differentiable by autograd (that
    is the baseline of the gradients). Returns ``(out [T, H, Dv], lse [H, T])``, the LSE being
    ``torch.logsumexp`` of the same low-precision scores."""
    outs, lses = [], []
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * softmax_scale
        if causal:
            L = e - s
            mask = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        lses.append(torch.logsumexp(scores.detach(), dim=-1))
        outs.append(torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def torch_mla_attention(q, c_kv, k_pe, w_kv_up, cu_seqlens, *, num_heads: int, qk_nope_dim: int,
                        v_dim: int, causal: bool, softmax_scale: float):
    """PyTorch's own MLA in the inputs' dtype (baseline of the 2x rule): ``kv = linear(c_kv,
    w_kv_up)``, split per head into K_nope and V, the rope key appended to every head, then
    :func:`torch_attention`. Packed ``[T, ...]`` inputs; differentiable by autograd."""
    T = c_kv.shape[0]
    kv = torch.nn.functional.linear(c_kv, w_kv_up).view(T, num_heads, qk_nope_dim + v_dim)
    k = torch.cat([kv[..., :qk_nope_dim], k_pe[:, None, :].expand(-1, num_heads, -1)], dim=-1)
    return torch_attention(q, k, kv[..., qk_nope_dim:], cu_seqlens, causal=causal,
                           softmax_scale=softmax_scale)


def torch_attention_grads(q, k, v, k_rope, cu_seqlens, grad_out, *, causal: bool,
                          softmax_scale: float):
    """:func:`torch_attention` forward and autograd backward in the inputs' dtype, in the layout
    of the ``flash_attention_fwd/bwd`` ops (``k_rope [T, Dr]`` or None is appended to every
    head's key). Returns ``(out, lse, dq, dk, dv, dk_rope)`` (``dk_rope`` empty without it)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kr = None if k_rope is None else k_rope.detach().clone().requires_grad_()
    qq, kk, vv = leaves
    H = q.shape[1]
    keys = kk if kr is None else torch.cat([kk, kr[:, None, :].expand(-1, H, -1)], dim=-1)
    out, lse = torch_attention(qq, keys, vv, cu_seqlens, causal=causal, softmax_scale=softmax_scale)
    out.backward(grad_out)
    dkr = kr.grad if kr is not None else q.new_zeros((0,))
    return (out.detach(), lse.float(), qq.grad, kk.grad, vv.grad, dkr)


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
               causal: bool, softmax_scale: float) -> torch.Tensor:
    """PyTorch's fused attention (``scaled_dot_product_attention``) in the inputs' dtype, one
    packed sequence at a time; differentiable. On the CPU it accumulates in fp32 and rounds
    once, so it is the stricter of the two low-precision baselines (the oracle test holds the
    reference to it)."""
    outs = []
    bounds = [int(x) for x in cu_seqlens.tolist()]
    for s, e in zip(bounds[:-1], bounds[1:]):
        a = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]  # [1, H, L, D]
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            *a, is_causal=causal, scale=softmax_scale)[0].transpose(0, 1))
    return torch.cat(outs, 0)
