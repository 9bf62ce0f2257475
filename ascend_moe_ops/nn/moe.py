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
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import _library
from ..balance.aux_loss import capacity_for, check_capacity_factor, update_expert_bias
from ..ops import checks as _checks
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
        _checks.check_int("num_experts", num_experts, minimum=0)  # 0: an EP rank that owns no expert
        _checks.check_int("hidden_size", hidden_size, minimum=1)
        _checks.check_int("ffn_hidden_size", ffn_hidden_size, minimum=1)
        _check_init_std(init_std)
        if num_layers is not None:
            _checks.check_int("num_layers", num_layers, minimum=1)
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
        F, H = self.ffn_hidden_size, self.hidden_size
        for name, ws, shape in (("fc1", fc1, (2 * F, H)), ("fc2", fc2, (H, F))):
            for e, w in enumerate(ws):
                _checks.check_tensor(f"{name}[{e}]", w)
                _checks.check_shape(f"{name}[{e}]", w, shape, f"expert {e}'s nn.Linear weight, [out, in]")
        self.w1().copy_(torch.stack([w.t() for w in fc1]))
        self.w2().copy_(torch.stack([w.t() for w in fc2]))

    @classmethod
    def from_expert_weights(cls, fc1: Sequence[Tensor], fc2: Sequence[Tensor], **kwargs) -> "GroupedMLP":
        """A GroupedMLP holding per-expert ``nn.Linear`` weights ``fc1[e] [2F, H]``, ``fc2[e] [H, F]``
        (one per expert, at least one; sizes, dtype and device from ``fc1[0]``)."""
        if len(fc1) == 0:
            raise ValueError("from_expert_weights needs at least one expert: fc1 and fc2 are empty")
        _checks.check_tensor("fc1[0]", fc1[0], ndim=2, dtypes=_checks.FLOAT_DTYPES)
        two_f, hidden = fc1[0].shape
        if two_f % 2:
            raise ValueError(f"fc1[0] must be [2F, H] (gate and up projections stacked), got an odd first dim "
                             f"{two_f} in shape {tuple(fc1[0].shape)}")
        m = cls(len(fc1), hidden, two_f // 2, dtype=fc1[0].dtype, device=fc1[0].device, **kwargs)
        m.load_expert_weights(fc1, fc2)
        return m

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_size}, ffn_hidden={self.ffn_hidden_size}"


class SharedExpertMLP(nn.Module):
    """A dense SwiGLU MLP every token goes through (``linear_fc1 [2Fs, H]``, ``linear_fc2 [H, Fs]``)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, init_std: float = 0.02, dtype=None, device=None):
        super().__init__()
        _checks.check_int("hidden_size", hidden_size, minimum=1)
        _checks.check_int("shared_expert_ffn_hidden_size", ffn_hidden_size, minimum=1)
        _check_init_std(init_std)
        self.linear_fc1 = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False, dtype=dtype, device=device)
        nn.init.normal_(self.linear_fc1.weight, std=init_std)
        nn.init.normal_(self.linear_fc2.weight, std=init_std)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_fc2(swiglu(self.linear_fc1(x)))


def _check_init_std(init_std) -> None:
    """The weights' N(0, init_std): a finite std >= 0 (torch's normal_ names no argument)."""
    _checks.check_float("init_std", init_std, finite=True, minimum=0)


def _check_hidden(x, hidden_size: int, what: str) -> None:
    """``x [..., H]`` floating point with ``H = hidden_size`` (shape and dtype checks only: no data
    read, compile-friendly). An integer ``x`` ran the router's gate in int64, which truncated the
    weights to 0 (uniform scores, no error)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what}: x must have a floating-point dtype, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != hidden_size:
        raise ValueError(f"{what}: x must have the hidden size {hidden_size} in its last dimension, "
                         f"got shape {tuple(x.shape)}")


class TopKRouter(nn.Module):
    """Linear router (``weight [E, H]``) with softmax or sigmoid scores and top-k.

    ``score_func="softmax"``: softmax over all experts, then top-k (renormalized over the k when
    ``norm_topk_prob``). ``score_func="sigmoid"`` (DeepSeek-V3 / Pangu style): sigmoid scores, top-k,
    renormalized to sum 1 when ``norm_topk_prob`` (default for sigmoid).

    Options of the torchtitan / DeepSeek-V3 world:

    * ``router_dtype``: dtype of the gate matmul. ``None`` (default) = the input's dtype, as
      torchtitan's gate does (in bf16 an fp32 gate picks different experts for ~1 % of tokens);
      ``torch.float32`` on request. Scores are always computed from fp32 logits.
    * ``route_norm``: torchtitan's name for ``norm_topk_prob`` (give one of them).
    * ``route_scale``: the top-k probs are multiplied by it (after the normalization).
    * ``expert_bias=True``: an ``expert_bias [E]`` fp32 buffer (aux-loss-free load balancing,
      DeepSeek-V3): added to the scores for the top-k *selection only*; the returned probs are the
      unbiased scores of the selected experts. :meth:`update_expert_bias` applies the update rule.
      It and the ``tokens_per_expert`` counts stay fp32 when the module is cast (``.bfloat16()``,
      ``.half()``, ``.to(dtype)``: only the device of such a call applies to them).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk_prob: Optional[bool] = None, init_std: float = 0.02, dtype=None, device=None,
                 route_norm: Optional[bool] = None, route_scale: float = 1.0,
                 router_dtype: Optional[torch.dtype] = None, expert_bias: bool = False):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
            _checks.check_int(name, v, minimum=1)  # a bool is not an int here (top_k=True is not 1)
        _check_init_std(init_std)
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if route_norm is not None and norm_topk_prob is not None and route_norm != norm_topk_prob:
            raise ValueError(f"route_norm={route_norm} and norm_topk_prob={norm_topk_prob} disagree "
                             "(they are the same option; give one)")
        if router_dtype is not None and (not isinstance(router_dtype, torch.dtype)
                                         or not router_dtype.is_floating_point):
            raise ValueError(f"router_dtype must be None (the input's dtype) or a float dtype, got {router_dtype!r}")
        if not isinstance(route_scale, (int, float)) or isinstance(route_scale, bool) or not math.isfinite(route_scale):
            raise ValueError(f"route_scale must be a finite number, got {route_scale!r}")
        if norm_topk_prob is None:
            norm_topk_prob = route_norm
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.norm_topk_prob = (score_func == "sigmoid") if norm_topk_prob is None else norm_topk_prob
        self.route_scale = float(route_scale)
        self.router_dtype = router_dtype
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device))
        nn.init.normal_(self.weight, std=init_std)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device))
            # tokens routed to each expert since the last update (summed over micro-batches)
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32, device=device),
                                 persistent=False)
        else:
            self.expert_bias = None
            self.tokens_per_expert = None

    @property
    def route_norm(self) -> bool:
        return self.norm_topk_prob

    _FP32_BUFFERS = ("expert_bias", "tokens_per_expert")

    def _apply(self, fn, recurse=True):
        # .half() / .bfloat16() / .to(dtype) cast every float buffer; the balancing buffers stay fp32
        # (in bf16 the token counts stop being exact past 256 and a 1e-3 bias step vanishes), taking
        # only the device the conversion chose
        keep = {n: self._buffers[n] for n in self._FP32_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, recurse)
        for n, old in keep.items():
            new = self._buffers[n]
            if new.dtype != torch.float32:
                self._buffers[n] = old.to(device=new.device)
        return out

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """``x [T, H]`` -> ``(topk_ids [T, k] int64, topk_probs [T, k] fp32, scores [T, E] fp32)``."""
        _check_hidden(x, self.weight.shape[1], "TopKRouter")
        rd = x.dtype if self.router_dtype is None else self.router_dtype
        logits = F.linear(x.to(rd), self.weight.to(rd)).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        if self.expert_bias is None:
            probs, ids = scores.topk(self.top_k, dim=-1)
        else:
            ids = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
            probs = scores.gather(1, ids)
            if self.training:
                with torch.no_grad():
                    self.tokens_per_expert += torch.bincount(ids.reshape(-1), minlength=self.num_experts).float()
        if self.norm_topk_prob:
            probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.route_scale != 1.0:
            probs = probs * self.route_scale
        return ids, probs, scores

    @torch.no_grad()
    def update_expert_bias(self, rate: float = 1e-3, tokens_per_expert: Optional[Tensor] = None) -> Tensor:
        """Aux-loss-free balancing step (DeepSeek-V3): ``bias += rate * sign(mean(load) - load)``
        with ``load`` = ``tokens_per_expert`` (default: the tokens routed since the last update,
        which is then reset). Call it once per optimizer step (after all-reducing the load over
        the data-parallel group, if any). Returns the new bias."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs a router built with expert_bias=True")
        load = self.tokens_per_expert if tokens_per_expert is None else tokens_per_expert
        _checks.check_tensor("tokens_per_expert", load)
        # the one update rule and its checks (one count per expert, rate finite and >= 0, counts
        # finite and >= 0)
        update_expert_bias(self.expert_bias, load.to(self.expert_bias.device, torch.float32), rate=rate)
        if tokens_per_expert is None:
            self.tokens_per_expert.zero_()
        return self.expert_bias


# ---------------------------------------------------------------- memory options of MoELayer
def _gather_rows(tokens: Tensor, row_id_map: Tensor, num_rows: int) -> Tensor:
    """The permuted rows ``out[row_id_map[t, s]] = tokens[t]`` (unfilled rows zero), rebuilt from
    the tokens and the row map: the same bits ``moe_permute`` produced (a copy)."""
    standin = tokens.new_empty((num_rows, 0))
    return _library.op("moe_unpermute_backward")(tokens.contiguous(), standin, row_id_map, None)[0]


def _scale_rows(rows: Tensor, row_probs: Optional[Tensor]) -> Tensor:
    return rows if row_probs is None else (rows.float() * row_probs.unsqueeze(1)).to(rows.dtype)


class _PermutedFc1(torch.autograd.Function):
    """``h = grouped_gemm(scale(rows), w1)`` with ``rows`` the permuted tokens, saving only the
    tokens and the row map (``recompute_permute``): the ``[N, H]`` rows are rebuilt in backward."""

    @staticmethod
    def forward(ctx, tokens, rows, row_id_map, w1, group_sizes, row_probs):
        ctx.save_for_backward(tokens, row_id_map, w1, group_sizes, row_probs)
        ctx.num_rows = rows.shape[0]
        return _library.op("grouped_gemm")(_scale_rows(rows, row_probs).contiguous(), w1.contiguous(),
                                           group_sizes, False)

    @staticmethod
    def backward(ctx, dh):
        tokens, row_id_map, w1, group_sizes, row_probs = ctx.saved_tensors
        rows = _gather_rows(tokens, row_id_map, ctx.num_rows)
        dy = dh.contiguous()
        d_in = _library.op("grouped_gemm")(dy, w1.contiguous(), group_sizes, True)
        dw1 = _library.op("grouped_gemm_dw")(_scale_rows(rows, row_probs).contiguous(), dy, group_sizes)
        d_probs = None
        if row_probs is not None:
            d_probs = (d_in.float() * rows.float()).sum(1) if ctx.needs_input_grad[5] else None
            d_in = (d_in.float() * row_probs.unsqueeze(1)).to(d_in.dtype)
        d_tokens = _library.op("moe_unpermute")(d_in.contiguous(), row_id_map, None)
        return d_tokens, None, None, dw1, None, d_probs


class _SwigluFc2(torch.autograd.Function):
    """``grouped_gemm(swiglu(h), w2)`` saving only ``h`` (``recompute_activation``): the SwiGLU
    output (and its internals) are recomputed in backward."""

    @staticmethod
    def forward(ctx, h, w2, group_sizes):
        ctx.save_for_backward(h, w2, group_sizes)
        return _library.op("grouped_gemm")(swiglu(h).contiguous(), w2.contiguous(), group_sizes, False)

    @staticmethod
    def backward(ctx, dy):
        h, w2, group_sizes = ctx.saved_tensors
        with torch.enable_grad():
            hh = h.detach().requires_grad_()
            a = swiglu(hh)
        dy = dy.contiguous()
        d_a = _library.op("grouped_gemm")(dy, w2.contiguous(), group_sizes, True)
        dw2 = _library.op("grouped_gemm_dw")(a.detach().contiguous(), dy, group_sizes)
        (dh,) = torch.autograd.grad(a, hh, d_a)
        return dh, dw2, None


class MoELayer(nn.Module):
    """Mixture-of-experts FFN: router -> ``moe_permute`` -> :class:`GroupedMLP` -> ``moe_unpermute``
    (weighted by the router probs), plus an optional shared expert.

    Args:
        hidden_size, num_experts, ffn_hidden_size, top_k: ``H``, ``E``, per-expert ``F``, ``k``.
        score_func, norm_topk_prob: see :class:`TopKRouter`.
        route_norm, route_scale, router_dtype, expert_bias: router options of the torchtitan /
            DeepSeek-V3 world, see :class:`TopKRouter` (router dtype default: the input's).
        score_before_experts: multiply each permuted token by its router prob *before* the experts
            (torchtitan's default) and combine unweighted; ``False``: weight in the combine.
        recompute_permute: save only the tokens and the row map for backward; the ``[N, H]``
            permuted rows are rebuilt there (a copy) instead of being kept.
        recompute_activation: save only the fc1 output; SwiGLU (and its output, fc2's input) is
            recomputed in backward.
        offload_activations: on an accelerator, keep the tensors the experts save for backward
            (activations and permuted probs) in pinned host memory
            (``torch.autograd.graph.save_on_cpu``). On the CPU there is nothing to offload to: a
            no-op with a warning.
        shared_expert_ffn_hidden_size: ``Fs`` of a shared SwiGLU expert (``None`` = none).
        capacity_factor: ``None`` = dropless; else each expert takes at most
            ``C = ceil(capacity_factor * T * k / E)`` tokens (lowest probs dropped), padded to ``C``.
        dispatcher: an :class:`ascend_moe_ops.distributed.MoEDispatcher` for expert parallelism
            (``None`` = all experts on this device). The layer then holds only the dispatcher's
            local experts (``experts.num_experts == dispatcher.num_local_experts``); dropless.
        overlap_chunks: with a dispatcher, split the tokens into this many chunks and pipeline
            them (:func:`ascend_moe_ops.distributed.moe_forward_overlapped`): dispatch/combine of
            neighbouring chunks overlap the experts of the current one, forward and backward;
            the shared expert, if any, runs while the first chunk's dispatch (and, backward, its
            combine-gradient exchange) is on the link. ``1`` (default) = one piece, no overlap
            (everything on the calling thread, in order).

    ``forward(x [..., H]) -> [..., H]`` in ``x``'s dtype. ``tokens_per_expert`` and ``scores`` of
    the last call are kept on the module (for load-balancing losses and logging).
    """

    def __init__(self, hidden_size: int, num_experts: int, ffn_hidden_size: int, top_k: int, *,
                 route_norm: Optional[bool] = None, route_scale: float = 1.0, router_dtype=None,
                 expert_bias: bool = False, score_before_experts: bool = False, recompute_permute: bool = False,
                 recompute_activation: bool = False, offload_activations: bool = False,
                 score_func: str = "softmax", norm_topk_prob: Optional[bool] = None,
                 shared_expert_ffn_hidden_size: Optional[int] = None,
                 capacity_factor: Optional[float] = None, init_std: float = 0.02,
                 dtype=None, device=None, dispatcher=None, overlap_chunks: int = 1):
        super().__init__()
        for name, v in (("hidden_size", hidden_size), ("num_experts", num_experts),
                        ("ffn_hidden_size", ffn_hidden_size), ("top_k", top_k)):
            _checks.check_int(name, v, minimum=1)
        if capacity_factor is not None:  # refused here, not at the first forward
            check_capacity_factor(capacity_factor)
        for name, v in (("expert_bias", expert_bias), ("score_before_experts", score_before_experts),
                        ("recompute_permute", recompute_permute), ("recompute_activation", recompute_activation),
                        ("offload_activations", offload_activations)):
            _checks.check_bool(name, v)  # "no" is not False
        if shared_expert_ffn_hidden_size is not None:  # None or 0: no shared expert
            _checks.check_int("shared_expert_ffn_hidden_size", shared_expert_ffn_hidden_size, minimum=0)
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
        router_opts = dict(route_norm=route_norm, route_scale=route_scale, router_dtype=router_dtype,
                           expert_bias=expert_bias)
        if router_opts != dict(route_norm=None, route_scale=1.0, router_dtype=None, expert_bias=False):
            first = self.router  # same initial weights as without the options
            self.router = TopKRouter(hidden_size, num_experts, top_k, score_func=score_func,
                                     norm_topk_prob=norm_topk_prob, init_std=init_std, **kw, **router_opts)
            with torch.no_grad():
                self.router.weight.copy_(first.weight)
        self.score_before_experts = bool(score_before_experts)
        self.recompute_permute = bool(recompute_permute)
        self.recompute_activation = bool(recompute_activation)
        self.offload_activations = bool(offload_activations)
        if dispatcher is not None and (self.score_before_experts or self.recompute_permute
                                       or self.recompute_activation or self.offload_activations):
            raise ValueError("score_before_experts, recompute_permute, recompute_activation and "
                             "offload_activations are options of the single-device layer; they "
                             "cannot be combined with an expert-parallel dispatcher yet")
        self._warned_offload = False

    def update_expert_bias(self, rate: float = 1e-3, tokens_per_expert: Optional[Tensor] = None) -> Tensor:
        """See :meth:`TopKRouter.update_expert_bias` (needs ``expert_bias=True``)."""
        return self.router.update_expert_bias(rate, tokens_per_expert)

    def __getstate__(self):
        # The last call's router scores (``self.scores``, kept for the auxiliary loss) belong to that
        # call's autograd graph: transient, so a copy (``copy.deepcopy``, e.g. an EMA or "best model"
        # copy during training, which refuses non-leaf tensors) or a pickle starts without them.
        state = dict(super().__getstate__())
        state["scores"] = None
        return state

    def _experts_forward(self, tokens: Tensor, ids: Tensor, probs: Tensor):
        """permute -> experts -> unpermute with the memory options. Returns ``(out, perm)``."""
        cap = self.capacity(tokens.shape[0])
        plain = not (self.score_before_experts or self.recompute_permute or self.recompute_activation)
        if plain and not self.offload_activations:
            perm = moe_permute(tokens, ids, probs, num_experts=self.num_experts, capacity=cap,
                               map_type="index")
            return moe_unpermute(self.experts(perm.tokens, perm.group_sizes), perm.row_id_map, probs), perm
        offload = self.offload_activations and tokens.device.type != "cpu"
        if self.offload_activations and not offload and not self._warned_offload:
            warnings.warn("MoELayer(offload_activations=True) on the CPU: there is no device memory to "
                          "offload from; saved tensors stay where they are", RuntimeWarning, stacklevel=3)
            self._warned_offload = True
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else _nullcontext()
        with ctx:
            if plain:
                perm = moe_permute(tokens, ids, probs, num_experts=self.num_experts, capacity=cap,
                               map_type="index")
                return moe_unpermute(self.experts(perm.tokens, perm.group_sizes), perm.row_id_map, probs), perm
            sizes = perm_sizes = None
            w1, w2 = self.experts.w1(), self.experts.w2()
            if self.recompute_permute:
                perm = moe_permute(tokens.detach(), ids, probs, num_experts=self.num_experts, capacity=cap,
                                   map_type="index")
                perm_sizes = perm.group_sizes
                row_probs = perm.probs if self.score_before_experts else None
                h = _PermutedFc1.apply(tokens, perm.tokens.detach(), perm.row_id_map, w1, perm_sizes, row_probs)
            else:
                perm = moe_permute(tokens, ids, probs, num_experts=self.num_experts, capacity=cap,
                               map_type="index")
                perm_sizes = perm.group_sizes
                x_in = _scale_rows(perm.tokens, perm.probs if self.score_before_experts else None)
                h = grouped_gemm(x_in, w1, perm_sizes)
            sizes = perm_sizes
            if self.recompute_activation:
                y = _SwigluFc2.apply(h, w2, sizes)
            else:
                y = grouped_gemm(swiglu(h), w2, sizes)
            out = moe_unpermute(y, perm.row_id_map, None if self.score_before_experts else probs)
        return out, perm

    def _forward_with_options(self, x: Tensor) -> Tensor:
        """``forward`` with score_before_experts / recompute / offload options (one device)."""
        if getattr(self, "dispatcher", None) is not None:
            raise ValueError("score_before_experts, recompute_* and offload_activations are not "
                             "implemented with an expert-parallel dispatcher yet")
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        ids, probs, scores = self.router(tokens)
        out, perm = self._experts_forward(tokens, ids, probs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.tokens_per_expert = perm.tokens_per_expert
        self.scores = scores
        return out.reshape(shape)

    def capacity(self, num_tokens: int) -> Optional[int]:
        if self.capacity_factor is None:
            return None
        return max(1, capacity_for(num_tokens, self.top_k, self.num_experts, self.capacity_factor))

    def forward(self, x: Tensor) -> Tensor:
        _check_hidden(x, self.hidden_size, "MoELayer")
        w = self.experts.weight1
        if x.dtype != w.dtype:  # the grouped GEMMs take x and the expert weights in one dtype
            raise TypeError(f"MoELayer: x must have the layer's dtype {w.dtype} (its expert weights'; "
                            f"cast the module or the input), got {x.dtype}")
        if self.score_before_experts or self.recompute_permute or self.recompute_activation or self.offload_activations:
            return self._forward_with_options(x)
        shape = x.shape
        tokens = x.reshape(-1, self.hidden_size)
        ids, probs, scores = self.router(tokens)
        if self.dispatcher is not None:  # expert parallel, optionally pipelined in chunks
            from ..distributed.overlap import moe_forward_overlapped
            sh = self.shared_experts
            out = moe_forward_overlapped(self.dispatcher, tokens, ids, probs,
                                         self.experts, list(self.experts.parameters()),
                                         chunks=self.overlap_chunks, overlap=self.overlap_chunks > 1,
                                         shared_fn=sh,
                                         shared_params=() if sh is None else list(sh.parameters()))
            self.tokens_per_expert = torch.bincount(ids.reshape(-1), minlength=self.num_experts)
            self.scores = scores
            return out.reshape(shape)
        perm = moe_permute(tokens, ids, probs, num_experts=self.num_experts,
                           capacity=self.capacity(tokens.shape[0]), map_type="index")
        expert_out = self.experts(perm.tokens, perm.group_sizes)
        out = moe_unpermute(expert_out, perm.row_id_map, probs)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        self.tokens_per_expert = perm.tokens_per_expert
        self.scores = scores
        return out.reshape(shape)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


__all__: List[str] = ["GroupedMLP", "MoELayer", "SharedExpertMLP", "TopKRouter", "swiglu"]
