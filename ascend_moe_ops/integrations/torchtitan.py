"""torchtitan MoE expert weights <-> :class:`ascend_moe_ops.nn.GroupedMLP`.

torchtitan's ``GroupedExperts`` (checked against the source of torchtitan 0.2.2) keeps three
``nn.Linear``-layout tensors per layer::

    w1 [E, F, H]   gate projection   h = silu(x @ w1[e].T) * (x @ w3[e].T)
    w3 [E, F, H]   up projection
    w2 [E, H, F]   down projection   y = h @ w2[e].T

:class:`~ascend_moe_ops.nn.GroupedMLP` keeps Megatron-Core's two ``[in, out]`` tensors
(``weight1 [H, E*2F]`` with the gate half first, ``weight2 [E*F, H]``). The converters below map
one to the other exactly (pure copies, no arithmetic), both ways.

What is *not* here: a one-call swap of torchtitan's ``MoE`` module. torchtitan does not import
next to this project's pinned dependencies (see docs/integrations.md for the exact errors: its
package ``__init__`` pulls in ``tyro``, ``tokenizers`` and, from 0.3.0, ``spmd_types``), so such a
swap could not be tested against the real module and is not offered.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..nn.moe import GroupedMLP

Tensor = torch.Tensor

__all__ = ["from_torchtitan_weights", "to_torchtitan_weights", "load_torchtitan_weights"]


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
