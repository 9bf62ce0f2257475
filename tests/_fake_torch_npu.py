"""CPU stand-ins for the four torch_npu ops bench/npu_check.py uses as baselines, so CI can run the
script's baseline code (argument plumbing, candidate fallbacks, autograd timing, the report). They
follow the documented semantics loosely and say nothing about the real torch_npu signatures."""

import torch
import torch.nn.functional as F

__version__ = "fake (tests/_fake_torch_npu.py)"


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    topk = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    return tokens[order // topk], order.int()


def npu_moe_token_unpermute(permuted, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    T, topk = probs.shape
    rows = torch.zeros_like(permuted).index_copy(0, sorted_indices.long(), permuted)
    return (rows.view(T, topk, -1) * probs.unsqueeze(-1).to(permuted.dtype)).sum(1)


def npu_grouped_matmul(x, weight, *, group_list, split_item, group_type):
    a, w = x[0], weight[0]
    ends = group_list.tolist()
    starts = [0] + ends[:-1]
    if group_type == 0:  # rows of a grouped
        return [torch.cat([a[s:e] @ w[i] for i, (s, e) in enumerate(zip(starts, ends))])]
    return [torch.stack([a[:, s:e] @ w[s:e] for s, e in zip(starts, ends)])]  # K axis grouped


def npu_fusion_attention(q, k, v, head_num, input_layout, atten_mask=None, scale=1.0, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0):
    if input_layout != "BSND":
        raise RuntimeError(f"fake: layout {input_layout} refused (exercises the script's fallback)")
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale)
    return (o.transpose(1, 2)[0],)
