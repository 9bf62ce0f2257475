"""Rows and bytes an expert-parallel dispatch sends per link class (intra-node / inter-node).

Two forms: :func:`expected_dispatch` (uniform routing, ``K`` distinct experts per token, the
arithmetic of docs/ops/ep_dispatcher.md) for the simulator, and :func:`exact_dispatch` (from the
routing itself) which counts what ``ascend_moe_ops.distributed.MoEDispatcher`` reports in
``handle.stats`` (``inter_node_rows``/``_bytes``, ``intra_node_rows``/``_bytes``).

Layout: ``world = nodes * local`` EP ranks, rank ``r`` on node ``r // local``; expert ``e`` on
rank ``e // (E / world)``. Row bytes: flat ``H*b``; the hierarchical schemes also carry each
row's ``K`` int32 slot ids and ``K`` probs (``probs_bytes`` each).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from ...ops.checks import check_float, check_int

ALGOS = ("flat", "hierarchical", "allgather")

__all__ = ["ALGOS", "expected_dispatch", "exact_dispatch", "row_bytes", "node_miss_probability"]


def _check_sizes(where: str, **sizes) -> None:
    """Positive ints; ``probs_bytes`` may be 0 (a dispatch without probs sends none)."""
    for k, v in sizes.items():
        check_int(f"{where}: {k}", v, minimum=0 if k == "probs_bytes" else 1)


def _check_algo(algo: str) -> str:
    a = {"hierarchical_allgather": "allgather"}.get(algo, algo)
    if a not in ALGOS:
        raise ValueError(f"algo must be one of {', '.join(ALGOS)} (or hierarchical_allgather), got {algo!r}")
    return a


def row_bytes(algo: str, H: int, K: int, dtype_bytes: int, probs_bytes: int = 4) -> int:
    """Bytes of one dispatched row: ``H*b`` (flat), ``H*b + K*4 + K*probs_bytes`` (hierarchical)."""
    return H * dtype_bytes if _check_algo(algo) == "flat" else H * dtype_bytes + K * 4 + K * probs_bytes


def node_miss_probability(E: int, K: int, share: float) -> float:
    """Probability that none of a token's ``K`` distinct uniform experts falls in a set of
    ``share * E`` experts: ``prod_j (E - share*E - j) / (E - j)``."""
    miss = 1.0
    for j in range(K):
        miss *= max(0.0, (E - share * E - j)) / (E - j)
    return miss


def expected_dispatch(T: float, K: int, E: int, H: int, *, nodes: int, local: int, algo: str,
                      dtype_bytes: int = 2, probs_bytes: int = 4) -> Dict[str, float]:
    """Expected rows/bytes one rank sends in one dispatch (uniform routing), per link class.

    * flat: inter ``T*K*(N-1)/N``, intra ``T*K*(L-1)/(N*L)``;
    * hierarchical (dedup): inter ``T*(N-1)*(1 - miss(E/N))``; intra (forwarding inside the node)
      ``T*N*(L-1)*(1 - miss(E/(N*L)))``;
    * allgather: inter ``T*(N-1)``, intra as hierarchical.
    The combine sends the same rows back (``H*b`` each)."""
    a = _check_algo(algo)
    check_float("expected_dispatch: T", T, finite=True, minimum=0, why=" (tokens)")
    _check_sizes("expected_dispatch", K=K, E=E, H=H, nodes=nodes, local=local, dtype_bytes=dtype_bytes,
                 probs_bytes=probs_bytes)
    if K > E:
        raise ValueError(f"expected_dispatch: K={K} (experts per token) exceeds E={E}")
    N, L = nodes, local
    if a == "flat":
        inter, intra = T * K * (N - 1) / N, T * K * (L - 1) / (N * L)
    else:
        p_rank = 1.0 - node_miss_probability(E, K, 1.0 / (N * L))
        intra = T * N * (L - 1) * p_rank
        inter = T * (N - 1) * (1.0 - node_miss_probability(E, K, 1.0 / N)) if a == "hierarchical" else T * (N - 1)
    rb = row_bytes(a, H, K, dtype_bytes, probs_bytes)
    return dict(inter_node_rows=inter, intra_node_rows=intra, inter_node_bytes=inter * rb,
                intra_node_bytes=intra * rb, combine_inter_node_bytes=inter * H * dtype_bytes,
                combine_intra_node_bytes=intra * H * dtype_bytes)


def exact_dispatch(topk_ids: Sequence, E: int, local: int, H: int, *, algo: str, dtype_bytes: int = 2,
                   probs_bytes: int = 4) -> List[Dict[str, int]]:
    """Per rank, the rows/bytes it sends in one dispatch, from every rank's routing
    (``topk_ids[r]``: ``[T_r, K]`` expert ids, ``-1`` = empty slot; lists or tensors).

    flat: slots whose expert lives on another node (inter) / another rank of this node (intra);
    hierarchical: per token, the remote nodes hosting one of its experts (inter), and per received
    or local token the other ranks of the node hosting one of its experts (intra, counted at the
    forwarding rank); allgather: ``max_T_of_same_local_rank * (N-1)`` inter, intra as hierarchical."""
    a = _check_algo(algo)
    _check_sizes("exact_dispatch", E=E, local=local, H=H, dtype_bytes=dtype_bytes, probs_bytes=probs_bytes)
    world = len(topk_ids)
    if not world:
        raise ValueError("exact_dispatch: topk_ids must hold the routing of at least one rank")
    if world % local:
        raise ValueError(f"exact_dispatch: {world} ranks are not a multiple of local={local}")
    if E % world:
        raise ValueError(f"exact_dispatch: E={E} is not a multiple of the {world} ranks")
    N, per = world // local, E // world
    ids = [[[int(e) for e in row] for row in (r.tolist() if hasattr(r, "tolist") else r)] for r in topk_ids]
    K = max((len(row) for r in ids for row in r), default=0)
    for r, rows in enumerate(ids):
        for t, row in enumerate(rows):
            for e in row:
                if not -1 <= e < E:
                    raise ValueError(f"exact_dispatch: topk_ids[{r}][{t}] holds expert id {e}, outside [0, E={E}) "
                                     f"(-1 = empty slot)")
    out = []
    for r in range(world):
        node, lr = divmod(r, local)
        inter = intra = 0
        if a == "flat":
            for row in ids[r]:
                for e in row:
                    if e < 0:
                        continue
                    o = e // per
                    if o // local != node:
                        inter += 1
                    elif o != r:
                        intra += 1
        else:
            if a == "hierarchical":
                for row in ids[r]:
                    inter += len({(e // per) // local for e in row if e >= 0} - {node})
            else:
                inter = max(len(ids[n * local + lr]) for n in range(N)) * (N - 1)
            # forwarding inside this node: tokens of every rank with the same local index
            for n in range(N):
                for row in ids[n * local + lr]:
                    owners = {e // per for e in row if e >= 0}
                    intra += len({o for o in owners if o // local == node and o != r})
        rb = row_bytes(a, H, K, dtype_bytes, probs_bytes)
        out.append(dict(inter_node_rows=inter, intra_node_rows=intra, inter_node_bytes=inter * rb,
                        intra_node_bytes=intra * rb))
    return out
