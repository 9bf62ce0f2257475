"""Drop-in MoE expert layers on top of the ops: ``GroupedMLP`` and ``MoELayer``.

Parameter layout (Megatron-Core, so a Megatron ``GroupedMLP`` checkpoint loads with
``load_state_dict`` once the module prefixes are mapped):

=======================================  ========================  ===========================================
this module                              shape                     Megatron-Core (``moe_grouped_gemm=True``)
=======================================  ========================  ===========================================
``GroupedMLP.weight1``                   ``[H, E * 2F]`` (gated)    ``mlp.experts.weight1`` (``GroupedMLP``)
``GroupedMLP.weight2``                   ``[E * F, H]``             ``mlp.experts.weight2``
``MoELayer.router.weight``               ``[E, H]``                 ``mlp.router.weight`` (``TopKRouter``)
``MoELayer.shared_experts.linear_fc1``   ``[2Fs, H]``               ``mlp.shared_experts.linear_fc1.weight``
``MoELayer.shared_experts.linear_fc2``   ``[H, Fs]``                ``mlp.shared_experts.linear_fc2.weight``
=======================================  ========================  ===========================================

As in Megatron, ``weight1.view(E, H, 2F)[e]`` is expert ``e``'s fc1 in ``[in, out]`` layout with
the gate half first (``[:, :F]``) and the up half second; ``weight2.view(E, F, H)[e]`` is its fc2.
A ``SequentialMLP`` checkpoint (``local_experts.<e>.linear_fc1.weight [2F, H]``,
``linear_fc2.weight [H, F]``) converts with :meth:`GroupedMLP.from_expert_weights`, and
:meth:`GroupedMLP.expert_weights` goes the other way.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..balance.aux_loss import capacity_for
from ..ops.grouped_gemm import grouped_gemm
from ..ops.moe_permute import moe_permute
from ..ops.moe_unpermute import moe_unpermute

Tensor = torch.Tensor


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` with ``gate, up = h.chunk(2, -1)`` (Megatron's gated-linear-unit order)."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class GroupedMLP(nn.Module):
    """``E`` SwiGLU expert MLPs applied to expert-major rows: fc1 grouped GEMM -> SwiGLU -> fc2.

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        ffn_hidden_size: ``F`` (per expert; fc1 produces ``2F`` for the gate and up halves).
        init_std: weights ~ N(0, init_std); fc2 uses ``init_std / sqrt(2 * num_layers)`` when
            ``num_layers`` is given (Megatron's output-layer scaling).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *,
                 init_std: float = 0.02, num_layers: Optional[int] = None, dtype=None, device=None):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        kw = dict(dtype=dtype, device=device)
        self.weight1 = nn.Parameter(torch.empty(hidden_size, num_experts * 2 * ffn_hidden_size, **kw))
        self.weight2 = nn.Parameter(torch.empty(num_experts * ffn_hidden_size, hidden_size, **kw))
        self.init_std = init_std
        self.out_std = init_std / math.sqrt(2.0 * num_layers) if num_layers else init_std
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight1, std=self.init_std)
        nn.init.normal_(self.weight2, std=self.out_std)

    def w1(self) -> Tensor:
        """``[E, H, 2F]`` view of ``weight1`` (what the grouped GEMM consumes)."""
        return self.weight1.view(self.num_experts, self.hidden_size, 2 * self.ffn_hidden_size)

    def w2(self) -> Tensor:
        """``[E, F, H]`` view of ``weight2``."""
        return self.weight2.view(self.num_experts, self.ffn_hidden_size, self.hidden_size)

    def forward(self, x: Tensor, group_sizes: Tensor) -> Tensor:
        """``x [M, H]`` expert-major rows, ``group_sizes [E]`` -> ``[M, H]`` (rows past the sum: 0)."""
        h = grouped_gemm(x, self.w1(), group_sizes)
        return grouped_gemm(swiglu(h), self.w2(), group_sizes)

    def expert_weights(self, e: int) -> Tuple[Tensor, Tensor]:
        """Expert ``e`` as ``nn.Linear`` weights: ``(fc1 [2F, H], fc2 [H, F])`` (copies)."""
        return self.w1()[e].t().detach().clone(), self.w2()[e].t().detach().clone()

    @torch.no_grad()
    def load_expert_weights(self, fc1: Sequence[Tensor], fc2: Sequence[Tensor]) -> None:
        """Load per-expert ``nn.Linear`` weights (``SequentialMLP`` layout): ``fc1[e] [2F, H]``,
        ``fc2[e] [H, F]``."""
        if len(fc1) != self.num_experts or len(fc2) != self.num_experts:
            raise ValueError(f"expected {self.num_experts} fc1 and fc2 weights, got {len(fc1)} and {len(fc2)}")
        self.w1().copy_(torch.stack([w.t() for w in fc1]))
        self.w2().copy_(torch.stack([w.t() for w in fc2]))

    @classmethod
    def from_expert_weights(cls, fc1: Sequence[Tensor], fc2: Sequence[Tensor], **kwargs) -> "GroupedMLP":
        two_f, hidden = fc1[0].shape
        m = cls(len(fc1), hidden, two_f // 2, dtype=fc1[0].dtype, device=fc1[0].device, **kwargs)
        m.load_expert_weights(fc1, fc2)
        return m

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn_hidden={self.ffn_hidden_size}"


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU MLP every token goes through (``linear_fc1 [2Fs, H]``, ``linear_fc2 [H, Fs]``)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, init_std: float = 0.02, dtype=None, device=None):
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype, device=device)
        nn.init.normal_(self.linear_fc1.weight, std=init_std)
        nn.init.normal_(self.linear_fc2.weight, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


class TopKRouter(nn.Module):
    """Linear router (``weight [E, H]``, fp32 logits) with softmax or sigmoid scores and top-k.

    ``score_func="softmax"``: softmax over all experts, then top-k (renormalized over the k when
    ``norm_topk_prob``). ``score_func="sigmoid"`` (DeepSeek-V3 / Pangu style): sigmoid scores, top-k,
    renormalized to sum 1 when ``norm_topk_prob`` (default for sigmoid).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: Optional[bool] = None, init_std: float = 0.02, dtype=None, device=None):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = (score_func == "sigmoid") if norm_topk_prob is None else norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``x [T, H]`` -> ``(topk_ids [T, k] int64, topk_probs [T, k] fp32, scores [T, E] fp32)``."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        probs, ids = scores.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        return ids, probs, scores


class MoELayer(nn.Module):
    """Mixture-of-experts FFN: router -> ``moe_permute`` -> :class:`GroupedMLP` -> ``moe_unpermute``
    (weighted by the router probs), plus an optional shared expert.

    Args:
        hidden_size, num_experts, ffn_hidden_size, top_k: ``H``, ``E``, per-expert ``F``, ``k``.
        score_func, norm_topk_prob: see :class:`TopKRouter`.
        shared_expert_ffn_hidden_size: ``Fs`` of a shared SwiGLU expert (``None`` = none).
        capacity_factor: ``None`` = dropless; else each expert takes at most
            ``C = ceil(capacity_factor * T * k / E)`` tokens (lowest probs dropped), padded to ``C``.
        dispatcher: an :class:`ascend_moe_ops.distributed.MoEDispatcher` for expert parallelism
            (``None`` = all experts on this device). The layer then holds only the dispatcher's
            local experts (``experts.num_experts == dispatcher.num_local_experts``); dropless.
        overlap_chunks: with a dispatcher, split the tokens into this many chunks and pipeline
            them (:func:`ascend_moe_ops.distributed.moe_forward_overlapped`): dispatch/combine of
            neighbouring chunks overlap the experts of the current one, forward and backward.
            ``1`` (default) = one piece.

    ``forward(x [..., H]) -> [..., H]`` in ``x``'s dtype. ``tokens_per_expert`` and ``scores`` of
    the last call are kept on the module (for load-balancing losses and logging).
    """

    def __init__(self, hidden_size: int, num_experts: int, ffn_hidden_size: int, top_k: int, *,
                 score_func: str = "softmax", norm_topk_prob: Optional[bool] = None,
                 shared_expert_ffn_hidden_size: Optional[int] = None,
                 capacity_factor: Optional[float] = None, init_std: float = 0.02,
                 dtype=None, device=None, dispatcher=None, overlap_chunks: int = 1):
        super().__init__()
        if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
            raise ValueError(f"overlap_chunks must be a positive int, got {overlap_chunks!r}")
        if dispatcher is None and overlap_chunks != 1:
            raise ValueError("overlap_chunks > 1 needs an expert-parallel dispatcher (there is no "
                             "communication to overlap on one device)")
        if dispatcher is not None and (dispatcher.num_experts != num_experts or capacity_factor is not None):
            raise ValueError(f"dispatcher must route num_experts={num_experts} experts (got "
                             f"{dispatcher.num_experts}) and the expert-parallel layer is dropless "
                             f"(capacity_factor=None, got {capacity_factor})")
        self.dispatcher = dispatcher
        self.overlap_chunks = overlap_chunks
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        kw = dict(dtype=dtype, device=device)
        self.router = TopKRouter(hidden_size, num_experts, top_k, score_func=score_func,
                                 norm_topk_prob=norm_topk_prob, init_std=init_std, **kw)
        n_local = num_experts if dispatcher is None else dispatcher.num_local_experts
        self.experts = GroupedMLP(n_local, hidden_size, ffn_hidden_size, init_std=init_std, **kw)
        self.shared_experts = (SharedExpertMLP(hidden_size, shared_expert_ffn_hidden_size, init_std=init_std, **kw)
                               if shared_expert_ffn_hidden_size else None)
        self.tokens_per_expert: Optional[Tensor] = None
        self.scores: Optional[Tensor] = None

    def capacity(self, num_tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return max(1, capacity_for(num_tokens, self.top_k, self.num_experts, self.capacity_factor))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        ids, probs, scores = self.router(tokens)
        if self.dispatcher is not None:  # expert parallel, optionally pipelined in chunks
            from ..distributed.overlap import moe_forward_overlapped
            out = moe_forward_overlapped(self.dispatcher, tokens, ids, probs,
                                         self.experts, list(self.experts.parameters()),
                                         chunks=self.overlap_chunks)
            if self.shared_experts is not None:
                out = out + self.shared_experts(tokens)
            self.tokens_per_expert = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            self.scores = scores
            return out.reshape(shape)
        perm = moe_permute(tokens, ids, probs, num_experts=self.num_experts,
                           capacity=self.capacity(tokens.shape[0]))
        expert_out = self.experts(perm.tokens, perm.group_sizes)
        out = moe_unpermute(expert_out, perm.row_id_map, probs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.tokens_per_expert = perm.tokens_per_expert
        self.scores = scores
        return out.reshape(shape)


__all__: List[str] = ["GroupedMLP", "MoELayer", "SharedExpertMLP", "TopKRouter", "swiglu"]
