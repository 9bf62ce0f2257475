"""Expert parallelism on CPU: megatron-core's own ``MoELayer`` (alltoall dispatcher) in two
processes over gloo, EP=2, 8 experts (4 per rank), unpatched vs patched.

:func:`ep_worker` runs on each rank and saves, per case, what the test asserts: whether the
patched layer's output and gradients equal the unpatched ones bitwise, whether the experts received
the same rows, ``tokens_per_expert`` and probs, and an independent check of the probs the experts
received: every row the experts of this rank get is matched (by its exact hidden vector) to the
token of either rank it came from, and its prob must be that token's router prob for the row's
global expert.
"""

from __future__ import annotations

import warnings

import torch

CASES = {
    # name: (make_layer keyword arguments, patched layer built with moe_permute_fusion=True)
    "dropless_top2": (dict(topk=2), False),
    "dropless_top2_permute_fusion": (dict(topk=2), True),
    "drop_and_pad_top2": (dict(topk=2, capacity_factor=1.0), False),
    "top1_probs_on_input": (dict(topk=1, moe_apply_probs_on_input=True, moe_router_pre_softmax=True), False),
}
EXPERTS, HIDDEN, TOKENS = 8, 32, 32


def _capture(layer):
    seen = {}
    hooks = [layer.router.register_forward_hook(lambda m, a, out: seen.__setitem__("router", out)),
             layer.experts.register_forward_pre_hook(lambda m, a: seen.__setitem__("experts", a))]
    return seen, hooks


def _run(layer, x, go):
    from ascend_moe_ops.benchmark.suite._megatron_cpu import run_layer
    seen, hooks = _capture(layer)
    try:
        out = run_layer(layer, x, go)
    finally:
        for h in hooks:
            h.remove()
    h, tpe, p = seen["experts"]
    probs, routing_map = seen["router"]
    return out, (h.detach().clone(), torch.as_tensor(tpe).clone(), p.detach().clone()), \
        (probs.detach().clone(), routing_map.clone())


def _probs_follow_rows(rank, x, expert_in, router, local_experts):
    """The independent check (module doc); returns an error string or ''."""
    import torch.distributed as dist
    h, tpe, p = expert_in
    probs, routing_map = router
    xs = [torch.empty_like(x) for _ in range(2)]
    ps_ = [torch.empty_like(probs) for _ in range(2)]
    ms = [torch.empty_like(routing_map, dtype=torch.uint8) for _ in range(2)]
    dist.all_gather(xs, x.contiguous())
    dist.all_gather(ps_, probs.contiguous())
    dist.all_gather(ms, routing_map.to(torch.uint8).contiguous())
    X, P, M = torch.cat(xs), torch.cat(ps_), torch.cat(ms).bool()
    match = (h.unsqueeze(1) == X.unsqueeze(0)).all(-1)  # [rows, all tokens]
    if not bool((match.sum(1) == 1).all()):
        return "a row the experts received matches no token (or several)"
    token = match.float().argmax(1)
    expert = rank * local_experts + torch.repeat_interleave(torch.arange(local_experts), tpe.long())
    if h.shape[0] != int(tpe.sum()):
        return f"{h.shape[0]} rows but tokens_per_expert adds up to {int(tpe.sum())}"
    if not bool(M[token, expert].all()):
        return "a row went to an expert its token is not routed to"
    counts = torch.bincount(expert - rank * local_experts, minlength=local_experts)
    if not torch.equal(counts, M[:, rank * local_experts:(rank + 1) * local_experts].sum(0)):
        return f"rows per local expert {counts.tolist()} differ from the routing map's"
    if not torch.equal(p, P[token, expert]):
        return f"probs differ from the router's by {(p - P[token, expert]).abs().max().item()}"
    return ""


def ep_worker(rank, port, out_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from ascend_moe_ops.benchmark.suite._megatron_cpu import make_layer, megatron_world
        from ascend_moe_ops.integrations import megatron as mg
    torch.set_num_threads(1)
    targets = tuple(t for t in mg.PATCHABLE if t != "activation")
    results = {}
    with megatron_world(rank=rank, world_size=2, port=port):
        for name, (kw, fusion) in CASES.items():
            layer = make_layer(hidden=HIDDEN, experts=EXPERTS, **kw)
            g = torch.Generator().manual_seed(100 + rank)  # each rank its own tokens
            x = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
            go = torch.randn(TOKENS // 2, 2, HIDDEN, generator=g)
            ref, ref_in, _ = _run(layer, x, go)
            with mg.patched(targets=targets):
                patched_layer = layer
                if fusion:
                    patched_layer = make_layer(hidden=HIDDEN, experts=EXPERTS, moe_permute_fusion=True, **kw)
                    patched_layer.load_state_dict(layer.state_dict())
                got, got_in, router = _run(patched_layer, x, go)
                counts = dict(mg.call_counts)
            same = (torch.equal(ref[0], got[0]) and torch.equal(ref[2], got[2]) and set(ref[1]) == set(got[1])
                    and all(torch.equal(ref[1][k], got[1][k]) for k in ref[1]))
            same_in = all(torch.equal(a, b) for a, b in zip(ref_in, got_in))
            follow = _probs_follow_rows(rank, x.reshape(-1, HIDDEN), got_in, router,
                                        patched_layer.num_local_experts)
            results[name] = dict(bitwise=same, experts_inputs_equal=same_in, probs_check=follow,
                                 counts=counts, fusion=patched_layer.config.moe_permute_fusion,
                                 local_experts=patched_layer.num_local_experts, rows=got_in[0].shape[0])
    torch.save(results, out_path)
