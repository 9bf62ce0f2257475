"""torchtitan MoE expert weights <-> :class:`ascend_moe_ops.nn.GroupedMLP`.

torchtitan's ``GroupedExperts`` (checked against the source of torchtitan 0.2.2) keeps three
``nn.Linear``-layout tensors per layer::

    w1 [E, F, H]   gate projection   h = silu(x @ w1[e].T) * (x @ w3[e].T)
    w3 [E, F, H]   up projection
    w2 [E, H, F]   down projection   y = h @ w2[e].T

:class:`~ascend_moe_ops.nn.GroupedMLP` keeps Megatron-Core's two ``[in, out]`` tensors
(``weight1 [H, E*2F]`` with the gate half first, ``weight2 [E*F, H]``). The converters below map
one to the other exactly (pure copies, no arithmetic), both ways.

:func:`patch_moe` swaps the token reordering and the grouped experts of torchtitan's ``MoE``
module (``torchtitan.models.moe.MoE``, checked against torchtitan 0.2.2) for this package's
``moe_permute`` / ``moe_unpermute`` / ``grouped_gemm``, on one module or on every such module in a
model; :func:`unpatch_moe` restores torchtitan's own forward. The router, the shared experts, the
expert-bias bookkeeping and the parameters stay torchtitan's own (nothing is copied).
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..nn.moe import GroupedMLP

Tensor = torch.Tensor

__all__ = ["from_torchtitan_weights", "to_torchtitan_weights", "load_torchtitan_weights",
           "patch_moe", "unpatch_moe", "is_patched", "call_counts"]


def _check(w1: Tensor, w2: Tensor, w3: Tensor) -> Tuple[int, int, int]:
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
            raise ValueError(f"{name} must be a 3-D tensor, got {shape}")
    E, F, H = w1.shape
    if tuple(w3.shape) != (E, F, H):
        raise ValueError(f"w3 must have the shape of w1 {(E, F, H)} ([E, F, H]), got {tuple(w3.shape)}")
    if tuple(w2.shape) != (E, H, F):
        raise ValueError(f"w2 must have shape {(E, H, F)} ([E, H, F] for w1 {(E, F, H)}), got {tuple(w2.shape)}")
    if not (w1.dtype == w2.dtype == w3.dtype):
        raise ValueError(f"w1, w2, w3 must share a dtype, got {w1.dtype}, {w2.dtype}, {w3.dtype}")
    return E, F, H


@torch.no_grad()
def load_torchtitan_weights(mlp: GroupedMLP, w1: Tensor, w2: Tensor, w3: Tensor) -> GroupedMLP:
    """Copy torchtitan's ``(w1, w2, w3)`` into an existing :class:`GroupedMLP`; returns it."""
    E, F, H = _check(w1, w2, w3)
    if (mlp.num_experts, mlp.ffn_hidden_size, mlp.hidden_size) != (E, F, H):
        raise ValueError(f"GroupedMLP has E={mlp.num_experts}, F={mlp.ffn_hidden_size}, H={mlp.hidden_size}; "
                         f"the torchtitan weights have E={E}, F={F}, H={H}")
    fc1 = mlp.w1()  # [E, H, 2F]
    fc1[:, :, :F].copy_(w1.transpose(1, 2))
    fc1[:, :, F:].copy_(w3.transpose(1, 2))
    mlp.w2().copy_(w2.transpose(1, 2))  # [E, F, H]
    return mlp


def from_torchtitan_weights(w1: Tensor, w2: Tensor, w3: Tensor, **kwargs) -> GroupedMLP:
    """A new :class:`GroupedMLP` (dtype/device of ``w1``) holding torchtitan's expert weights."""
    E, F, H = _check(w1, w2, w3)
    mlp = GroupedMLP(E, H, F, dtype=w1.dtype, device=w1.device, **kwargs)
    return load_torchtitan_weights(mlp, w1, w2, w3)


@torch.no_grad()
def to_torchtitan_weights(mlp: GroupedMLP) -> Tuple[Tensor, Tensor, Tensor]:
    """``(w1 [E, F, H], w2 [E, H, F], w3 [E, F, H])`` copies of a :class:`GroupedMLP`'s weights."""
    F = mlp.ffn_hidden_size
    fc1 = mlp.w1()
    w1 = fc1[:, :, :F].transpose(1, 2).contiguous()
    w3 = fc1[:, :, F:].transpose(1, 2).contiguous()
    w2 = mlp.w2().transpose(1, 2).contiguous()
    return w1, w2, w3


# ---------------------------------------------------------------------------------------------
# One-call swap of torchtitan's MoE forward
# ---------------------------------------------------------------------------------------------

#: calls through the patched forward, by op
call_counts = {"moe_permute": 0, "moe_unpermute": 0, "grouped_gemm": 0}

_MARK = "_ascend_moe_ops_patched"
_NEEDED = ("router", "reorderer", "experts", "shared_experts", "score_before_experts",
           "expert_bias", "tokens_per_expert")


def _moe_class():
    try:
        from torchtitan.models.moe.moe import MoE
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(f"torchtitan's MoE module cannot be imported: {type(exc).__name__}: {exc}") from exc
    return MoE


def _check_moe(m) -> None:
    missing = [a for a in _NEEDED if not hasattr(m, a)]
    missing += [f"experts.{a}" for a in ("w1", "w2", "w3", "num_experts") if not hasattr(m.experts, a)]
    missing += [f"router.{a}" for a in ("top_k",) if not hasattr(m.router, a)]
    if missing:
        raise RuntimeError(f"refusing to patch {type(m).__name__}: attributes {missing} not found "
                           "(only torchtitan 0.2.2's MoE layout is known)")
    if any(type(w).__name__ == "DTensor" for w in (m.experts.w1, m.experts.w2, m.experts.w3)):
        raise RuntimeError("refusing to patch: expert weights are DTensors (expert/tensor parallel "
                           "layouts are not supported by this swap)")


def _run_experts(experts, x: Tensor, sizes: Tensor) -> Tensor:
    import ascend_moe_ops as amo
    call_counts["grouped_gemm"] += 3
    h = torch.nn.functional.silu(amo.grouped_gemm(x, experts.w1, sizes, trans_b=True))
    h = h * amo.grouped_gemm(x, experts.w3, sizes, trans_b=True)
    return amo.grouped_gemm(h, experts.w2, sizes, trans_b=True)


def _patched_forward(self, x: Tensor) -> Tensor:
    """torchtitan 0.2.2 ``MoE.forward`` with the package's permute / grouped GEMM / unpermute."""
    import ascend_moe_ops as amo
    bs, slen, dim = x.shape
    x = x.view(-1, dim)
    top_scores, selected, num_tokens_per_expert = self.router(x, self.expert_bias)
    with torch.no_grad():
        self.tokens_per_expert.add_(num_tokens_per_expert)
    E = self.experts.num_experts
    call_counts["moe_permute"] += 1
    if self.score_before_experts:
        res = amo.moe_permute(x, selected, top_scores, num_experts=E, num_out_tokens=selected.numel(),
                                  map_type="index")
        routed = (res.tokens.to(torch.float32) * res.probs.reshape(-1, 1)).to(x.dtype)
    else:
        res = amo.moe_permute(x, selected, num_experts=E, num_out_tokens=selected.numel(),
                                  map_type="index")
        routed = res.tokens
    routed_out = _run_experts(self.experts, routed, res.group_sizes)
    out = self.shared_experts(x) if self.shared_experts is not None else None
    call_counts["moe_unpermute"] += 1
    if self.score_before_experts:
        out_experts = amo.moe_unpermute(routed_out, res.row_id_map)
    else:
        out_experts = amo.moe_unpermute(routed_out, res.row_id_map, top_scores)
    out_experts = out_experts.to(x.dtype)
    if out is None:
        return out_experts.reshape(bs, slen, dim)
    return (out + out_experts).reshape(bs, slen, dim)


def _targets(module):
    MoE = _moe_class()
    return [m for m in module.modules() if isinstance(m, MoE)]


def patch_moe(module) -> int:
    """Make torchtitan's ``MoE`` (``module`` itself or every one inside it) use this package's ops.

    Sets an instance-level ``forward`` (torchtitan's class is not touched, other instances keep
    their forward). Idempotent; returns the number of MoE modules newly patched. Raises
    ``RuntimeError`` (nothing changed) when a module does not have torchtitan 0.2.2's layout or its
    expert weights are DTensors, ``ValueError`` when ``module`` holds no torchtitan MoE.
    """
    targets = _targets(module)
    if not targets:
        raise ValueError(f"module: no torchtitan MoE found in {type(module).__name__}")
    for m in targets:
        _check_moe(m)
    n = 0
    for m in targets:
        if not getattr(m, _MARK, False):
            m.forward = _patched_forward.__get__(m, type(m))
            setattr(m, _MARK, True)
            n += 1
    return n


def unpatch_moe(module) -> int:
    """Undo :func:`patch_moe` on ``module`` (and every MoE inside it); returns how many were restored."""
    n = 0
    for m in _targets(module):
        if getattr(m, _MARK, False):
            del m.forward
            delattr(m, _MARK)
            n += 1
    return n


def is_patched(module) -> bool:
    return bool(getattr(module, _MARK, False))
