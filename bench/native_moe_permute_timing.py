"""Standalone timing of the native (C++) moe_permute / moe_unpermute at the issue-2 target shape
(T=4096, H=7680, E=256, K=8, bf16, fp32 probs) against three copy-bandwidth references and a
re-implementation of Megatron-Core's pure-PyTorch ``moe_utils.permute/unpermute`` (mask routing,
index_select / scatter_add_; megatron-core is not installed here).

    python bench/native_moe_permute_timing.py [rounds]

Byte formulas (elt = 2 for bf16):
    permute   = (T*H read + N*H write) * elt + N*4 (probs out) + T*K*(8 ids + 4 probs + 4 map)
    unpermute = (N_kept*H read + T*H write) * elt + T*K*(4 map + 4 probs)
Copy references, all 2 x 256 MiB / t: ``dst.copy_(src)`` into a preallocated buffer (what
``ascend_moe_ops.bench`` uses), ``torch.empty_like(src).copy_(src)`` (allocates like the ops do), and
the same with the huge-page advice the native ops give their large outputs.

The rounds are interleaved: each round times every function back to back (min of 3 calls), ratios
are taken per round and the median over rounds is printed with its range, because the machine is
shared and its load drifts. The result depends strongly on how fresh output memory is obtained
(first-touch page faults); run it also under ``THP_MEM_ALLOC_ENABLE=1`` or with
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`` (memory reused, no faults) to see that.
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ascend_moe_ops as amo  # noqa: E402

T, H, E, K = 4096, 7680, 256, 8
dt = torch.bfloat16
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
INNER = 3

def t1(fn):
    ts = []
    for _ in range(INNER):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return min(ts)

def mcore_permute(tokens, routing_map, probs):
    num_tokens = tokens.shape[0]; num_experts = routing_map.shape[1]
    rm = routing_map.bool().T.contiguous()
    token_indices = torch.arange(num_tokens).unsqueeze(0).expand(num_experts, -1)
    sorted_indices = token_indices.masked_select(rm)
    permuted_probs = probs.T.contiguous().masked_select(rm)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices

def mcore_unpermute(permuted_tokens, sorted_indices, restore_shape, probs, routing_map):
    in_dtype = permuted_tokens.dtype
    permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
    permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
    out = torch.zeros(restore_shape, dtype=permuted_tokens.dtype)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, restore_shape[1]), permuted_tokens)
    return out.to(in_dtype)

g = torch.Generator().manual_seed(0)
tokens = torch.randn(T, H, generator=g).to(dt)
logits = torch.randn(T, E, generator=g)
topv, ids = torch.softmax(logits, -1).topk(K, dim=1)
probs = topv.float().contiguous()
rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, ids, True)
dense_probs = torch.zeros(T, E).scatter_(1, ids, probs)

src = torch.randn(256 << 18)  # 256 MiB fp32
dst = torch.empty_like(src)
res = amo.moe_permute(tokens, ids, probs, num_experts=E)
N = res.tokens.shape[0]; kept = int((res.row_id_map >= 0).sum())
perm_bytes = (T * H + N * H) * 2 + N * 4 + T * K * (8 + 4 + 4)
unperm_bytes = (kept * H + T * H) * 2 + T * K * (4 + 4)
mp = mcore_permute(tokens, rmap, dense_probs)
import ctypes
_libc = ctypes.CDLL("libc.so.6")
def empty_thp(like):
    t = torch.empty_like(like); p = t.data_ptr(); n = t.numel() * t.element_size(); hp = 2 << 20
    b = (p + hp - 1) & ~(hp - 1); e = (p + n) & ~(hp - 1)
    if e > b: _libc.madvise(ctypes.c_void_p(b), ctypes.c_size_t(e - b), 14)  # MADV_HUGEPAGE
    return t
fns = {
    "copy_pre": lambda: dst.copy_(src),
    "copy_fresh": lambda: torch.empty_like(src).copy_(src),
    "copy_fresh_thp": lambda: empty_thp(src).copy_(src),
    "permute": lambda: amo.moe_permute(tokens, ids, probs, num_experts=E),
    "unpermute": lambda: amo.moe_unpermute(res.tokens, res.row_id_map, probs),
    "mc_permute": lambda: mcore_permute(tokens, rmap, dense_probs),
    "mc_unpermute": lambda: mcore_unpermute(mp[0], mp[2], (T, H), dense_probs, rmap),
}
for f in fns.values(): f()
rows = {k: [] for k in fns}
for r in range(ROUNDS):
    for k, f in fns.items():
        rows[k].append(t1(f))
med = {k: statistics.median(v) for k, v in rows.items()}
cb = 2 * src.numel() * 4
copy_pre = [cb / t / 1e9 for t in rows["copy_pre"]]
copy_fresh = [cb / t / 1e9 for t in rows["copy_fresh"]]
print(f"threads={torch.get_num_threads()} rounds={ROUNDS}x(min of {INNER}); copy (prealloc dst.copy_) median {statistics.median(copy_pre):.1f} GB/s "
      f"[{min(copy_pre):.1f}..{max(copy_pre):.1f}]; copy (empty_like().copy_) {statistics.median(copy_fresh):.1f} GB/s [{min(copy_fresh):.1f}..{max(copy_fresh):.1f}]")
copy_thp = [cb / t / 1e9 for t in rows["copy_fresh_thp"]]
print(f"copy (huge-page-advised empty_like().copy_, the allocation our ops use) {statistics.median(copy_thp):.1f} GB/s [{min(copy_thp):.1f}..{max(copy_thp):.1f}]")
for name, b in (("permute", perm_bytes), ("unpermute", unperm_bytes)):
    gb = [b / t / 1e9 for t in rows[name]]
    pct_pre = [100 * x / c for x, c in zip(gb, copy_pre)]
    pct_fresh = [100 * x / c for x, c in zip(gb, copy_fresh)]
    sp = [m / t for m, t in zip(rows["mc_" + name], rows[name])]
    print(f"{name:9s} native {med[name]*1e3:7.2f} ms {statistics.median(gb):5.1f} GB/s [{min(gb):.1f}..{max(gb):.1f}] "
          f"= {statistics.median(pct_pre):5.1f}% of prealloc copy [{min(pct_pre):.0f}..{max(pct_pre):.0f}], "
          f"{statistics.median(pct_fresh):5.1f}% of fresh copy, {statistics.median([100 * x / c for x, c in zip(gb, copy_thp)]):5.1f}% of THP fresh copy | mcore {med['mc_'+name]*1e3:7.1f} ms "
          f"({b/med['mc_'+name]/1e9:.2f} GB/s) speed-up {statistics.median(sp):.2f}x [{min(sp):.1f}..{max(sp):.1f}]")
