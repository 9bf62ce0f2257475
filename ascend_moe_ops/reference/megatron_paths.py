"""Reference (specification) of the Megatron-Core adapter's internal ops ``mask_permute`` and
``sort_chunks`` (``ascend_moe_ops/integrations/megatron.py``).

``mask_permute(tokens [T, H], routing_map [T, E] bool, probs [T, E] or None, num_out_tokens)``
is Megatron-Core's dropless ``permute``: with ``N`` = the routed entries of ``routing_map``
(``num_out_tokens``, when given, must equal ``N``), rows are expert-major and in token order inside
an expert, exactly ``arange(T).expand(E, T).masked_select(routing_map.T)``. Returns

* ``permuted_tokens [N, H] = tokens[sorted_indices]``;
* ``permuted_probs [N] = probs.T.masked_select(routing_map.T)`` in probs' dtype (shape ``[0]``
  fp32 without probs);
* ``sorted_indices [N]`` int64, the token of each row;
* ``row_id_map [T, S]`` int32, ``S`` = the most experts any token has: the row of the ``s``-th
  routed expert of token ``t`` (experts ascending), ``-1`` past the token's count;
* ``expert_ids [T, S]`` int64: that expert, ``-1`` past the count.

``sort_chunks(input [N, ...], split_sizes [C], sorted_idxs [C], probs [N, ...] or None, inverse)``
is Megatron-Core's ``sort_chunks_by_idxs``: ``input`` split into chunks of ``split_sizes`` rows
(they must add up to ``N``), concatenated in the order ``sorted_idxs`` (a permutation of the
chunks); ``probs`` likewise (shape ``[0]`` fp32 without). ``inverse=True`` undoes it: ``input``
holds the chunks in the order ``sorted_idxs`` and the result has them back in ``0..C-1`` order
(the backward of the forward call with the same sizes and order).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

Tensor = torch.Tensor


def mask_permute(tokens: Tensor, routing_map: Tensor, probs: Optional[Tensor],
                 num_out_tokens: Optional[int]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    T, E = routing_map.shape
    dev = tokens.device
    mt = routing_map.t().contiguous()
    si = torch.arange(T, device=dev).unsqueeze(0).expand(E, T).masked_select(mt)
    N = si.numel()
    if num_out_tokens is not None and num_out_tokens != N:
        raise ValueError(f"mask_permute: num_out_tokens={num_out_tokens} must equal the {N} routed slots of "
                         "routing_map (Megatron's unfused path returns exactly them)")
    out = tokens.index_select(0, si)
    pp = (probs.t().contiguous().masked_select(mt) if probs is not None
          else torch.empty(0, dtype=torch.float32, device=dev))
    row_et = (torch.cumsum(mt.reshape(-1).to(torch.int64), 0) - 1).view(E, T)  # row of each routed (e, t)
    S = int(routing_map.sum(1).max()) if T and E else 0
    key = torch.where(routing_map, torch.arange(E, device=dev).expand(T, E), torch.full((), E, device=dev))
    first = key.sort(1).values[:, :S]  # routed experts ascending, then E
    ids = torch.where(first < E, first, torch.full((), -1, device=dev))
    rows = row_et.t().gather(1, ids.clamp_min(0))
    row_id_map = torch.where(ids >= 0, rows, torch.full((), -1, device=dev)).to(torch.int32)
    # contiguous, as the fake and the native kernel give them (a transposed routing_map made
    # torch.where return transposed maps)
    return out, pp, si, row_id_map.contiguous(), ids.contiguous()


def sort_chunks(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor, probs: Optional[Tensor],
                inverse: bool) -> Tuple[Tensor, Tensor]:
    sizes, order = [int(s) for s in split_sizes.tolist()], [int(j) for j in sorted_idxs.tolist()]
    N = input.shape[0]
    if sum(sizes) != N or min(sizes, default=0) < 0:
        raise ValueError(f"sort_chunks: split_sizes must add up to the {N} rows of input (none negative), got {sizes}")
    if sorted(order) != list(range(len(sizes))):
        raise ValueError(f"sort_chunks: sorted_idxs must be a permutation of the {len(sizes)} chunks, got {order}")

    def move(t: Tensor) -> Tensor:
        if not inverse:
            parts = torch.split(t, sizes, dim=0)
            return torch.cat([parts[j] for j in order], dim=0) if parts else t.clone()
        parts = torch.split(t, [sizes[j] for j in order], dim=0)
        back = [None] * len(order)
        for k, j in enumerate(order):
            back[j] = parts[k]
        return torch.cat(back, dim=0) if back else t.clone()

    pp = move(probs) if probs is not None else torch.empty(0, dtype=torch.float32, device=input.device)
    return move(input), pp
