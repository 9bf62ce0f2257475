"""Reference (specification) of ``swiglu_probs`` and its backward.

``out[n, f] = silu(x[n, f]) * x[n, F + f] * probs[n]`` for ``x [N, 2F]``, ``probs [N]``: the SwiGLU
activation with each row's router probability applied in the same step, as Megatron-Core's
``GroupedMLP`` does between its two grouped GEMMs. Computed in fp32 (fp64 for fp64 ``x``) and
rounded once to ``x``'s dtype. Backward, with ``s = sigmoid(a)``, ``a = x[n, f]``,
``b = x[n, F + f]``, ``g = grad_out[n, f]``, ``p = probs[n]``::

    grad_x[n, f]     = g * p * b * s * (1 + a * (1 - s))
    grad_x[n, F + f] = g * p * a * s
    grad_probs[n]    = sum_f g * a * s * b          (in probs' dtype)
"""

from __future__ import annotations

from typing import Tuple

import torch

Tensor = torch.Tensor


def _acc(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def swiglu_probs(x: Tensor, probs: Tensor) -> Tensor:
    acc = _acc(x)
    a, b = x.to(acc).chunk(2, dim=-1)
    return (a * torch.sigmoid(a) * b * probs.to(acc).unsqueeze(1)).to(x.dtype)


def swiglu_probs_backward(grad_out: Tensor, x: Tensor, probs: Tensor) -> Tuple[Tensor, Tensor]:
    acc = _acc(x)
    a, b = x.to(acc).chunk(2, dim=-1)
    g = grad_out.to(acc)
    s = torch.sigmoid(a)
    gp = g * probs.to(acc).unsqueeze(1)
    grad_a = gp * b * s * (1 + a * (1 - s))
    grad_b = gp * a * s
    grad_probs = (g * a * s * b).sum(1)
    return torch.cat([grad_a, grad_b], 1).to(x.dtype), grad_probs.to(probs.dtype)
