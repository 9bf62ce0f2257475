"""Validation of the simulator's expert-parallel layer on the emulated two-node cluster.

Two network namespaces joined by a rate-limited veth pair (the EP benchmark's setup,
``bench/bench_ep_dispatcher.py --netns``), 2 ranks per node, gloo. In the same four processes,
in alternating rounds (``python -m ascend_moe_ops.perfmodel.validate_ep --out FILE [--rounds 3] [--runs 5]``):

* **calibration** (microbenchmarks): ``all_to_all_single`` over the inter-node group and over
  the intra-node group at a few sizes (fitted ``t = a + bytes / bw`` per link class), a tiny
  all-gather (latency of one collective), and the component ops of the layer
  (:func:`~.validate.component_steps`) at calibration shapes, all ranks at once (the contention of
  the real run included); and the **dispatcher's own exchange** -- ``MoEDispatcher`` dispatch ->
  identity experts -> combine through the layer's chunked pipeline
  (:func:`~ascend_moe_ops.distributed.moe_forward_overlapped`), forward and backward, no expert
  compute -- per algorithm and chunk count at the sizes :data:`EP_EXCHANGE_SIZES` (fitted
  ``t = a + b * bytes`` per algorithm and chunk count, :class:`ExchangeFit`);
* **validation**: ``nn.MoELayer(dispatcher=MoEDispatcher(algorithm))`` forward + backward, flat and
  hierarchical, ``overlap_chunks`` 1 and 4, at shapes never calibrated on (and, for the fit of
  ``rho``/``eta``, at :data:`EP_FIT_SHAPES`).

Prediction (:func:`predict_ep_layer`): ``t(c) = C(1 + rho) + comm(c) - eta*min(C, comm(c))(1 - 1/c)``,
with two competing communication forms (:data:`COMM_FORMS`):

* ``links``: ``C`` = the layer's ops on this rank (``T*K`` expert rows over ``E/world`` local
  experts, plus the dispatcher's own reordering: one extra permute/unpermute pair for flat, two
  for hierarchical) priced by the round's fit; ``comm(c)`` = per chunk and exchange (dispatch,
  combine, and their backward passes) the collectives' latency, each at its own group's
  ``lambda`` (per group -- every rank, the inter-node pair, the intra-node pair -- a burst of
  :data:`BURST` tiny all-gathers timed as one run, divided by :data:`BURST`) plus the bytes of each
  link class over its fitted bandwidth (:func:`~.sim.traffic.expected_dispatch`);
* ``exchange``: ``comm(c)`` = the exchange microbenchmark's fit for this algorithm and chunk
  count at the layer's exchanged bytes (:func:`exchange_bytes`); it includes the dispatcher's
  reordering, so ``C`` is the router and the experts only.

``rho`` and ``eta`` are fitted (:func:`fit_overlap`) on whole layers at the shapes
:data:`EP_FIT_SHAPES` (flat and hierarchical, every chunk count), none a validation shape; the
communication form, which of ``rho``/``eta`` are fitted at all (the overlap form:
:data:`OVERLAP_FORMS`) and whether one pair serves both dispatch algorithms or each has its own
(:data:`OVERLAP_SCOPES`) are chosen together by leave-one-shape-out over those fit shapes
(:func:`select_ep_model`); ``rho=0, eta=1`` (the ideal pipeline) is reported beside, and so is
each communication form's own best (a diagnostic). Timings: the harness (``measure(runs=..., setup=barrier)``), median
of the runs; a step's time is the slowest rank's; each figure the median over rounds, with the
spread over rounds; the layers are measured in a shuffled order per round (the same on every
rank). :func:`summarize_ep` re-runs the analysis of a saved report's ``raw`` records (the
exchange microbenchmark's records are among them).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from .. import _cli

__all__ = ["EP_CALIBRATION", "EP_VALIDATION", "EP_FIT_SHAPES", "EP_EXCHANGE_SIZES", "OVERLAP_FORMS",
           "OVERLAP_SCOPES", "COMM_FORMS", "overlap_terms", "predict_ep_layer", "fit_overlap", "select_overlap", "select_ep_model", "run_ep",
           "summarize_ep", "pooled_links", "pooled_exchange", "exchange_bytes", "LinkFit", "ExchangeFit"]

NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
#: compute calibration shapes (T, H, F, E_local_groups, K): E is the local expert count here
EP_CALIBRATION = [(256, 256, 128, 4, 4), (768, 320, 96, 4, 2), (512, 384, 192, 4, 3)]
#: validation shapes (T per rank, H, F, E global, K); each with flat/hierarchical x chunks 1/4
EP_VALIDATION = [(512, 256, 128, 16, 4), (384, 384, 192, 16, 6)]
#: the whole-layer shapes (T per rank, H, F, E global, K) the overlap terms rho and eta are fitted
#: on (flat and hierarchical, every chunk count), and the form of the overlap model chosen
#: (:func:`select_ep_model`); none is a validation shape. Their communication-to-compute ratios
#: bracket the validation shapes'.
EP_FIT_SHAPES = ((448, 320, 160, 16, 4), (256, 512, 256, 16, 8), (640, 192, 96, 16, 2))
#: the overlap model's forms: which of rho and eta are fitted (the others at the ideal, 0 and 1)
OVERLAP_FORMS = ("ideal", "rho", "eta", "rho+eta")
#: whether rho and eta are one pair for every dispatch algorithm (``shared``) or one pair per
#: algorithm (``per-algorithm``: the flat and the hierarchical exchange may contend with the expert
#: compute and overlap with it differently); chosen with the forms (:func:`select_ep_model`)
OVERLAP_SCOPES = ("shared", "per-algorithm")
#: the sizes (T per rank, H, E global, K) at which the dispatcher's own exchange is
#: microbenchmarked (:func:`exchange_bytes`, :class:`ExchangeFit`): dispatch + combine, forward and
#: backward, identity experts, per algorithm and chunk count. None shares T, H with a validation
#: shape (nor with a fit shape); their bytes bracket the validation shapes'.
EP_EXCHANGE_SIZES = ((192, 256, 16, 2), (576, 224, 16, 3), (320, 448, 16, 5), (288, 576, 16, 8))
#: how the communication ``comm(c)`` is priced: ``links`` (per chunk and exchange the collectives'
#: latency plus bytes over each link class's bandwidth) or ``exchange`` (the dispatcher's own
#: exchange, microbenchmarked, :class:`ExchangeFit`); chosen with the overlap form (:func:`select_ep_model`)
COMM_FORMS = ("links", "exchange")
#: back-to-back tiny all-gathers timed as one run: the per-collective latency is the run / BURST
BURST = 16
A2A_SIZES = (64 << 10, 256 << 10, 1 << 20)
CHUNKS = (1, 4)
ALGOS = ("flat", "hierarchical")


def _line(pts) -> tuple:
    """``(a, s)`` of ``t = a + s * x`` from ``(x, t)`` points (least squares), ``s`` kept above 0
    and ``a`` at least 0 (a negative intercept is clipped, the slope is kept)."""
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx, 1e-15) if sxx else 1e-15
    return max(my - slope * mx, 0.0), slope


class LinkFit:
    """``t = a + bytes / bw`` per link class from (bytes, seconds) samples (least squares)."""

    def __init__(self, samples: Dict[str, List[tuple]], latency: float, latency_by: Dict[str, float] = None):
        self.params = {cls: _line(pts) for cls, pts in samples.items()}
        self.latency = latency
        # per group ("world", "inter", "intra"): one collective's latency on that group; a group not
        # measured takes ``latency`` (the world group's)
        self.latency_by = dict(latency_by or {})

    def lat(self, group: str) -> float:
        return self.latency_by.get(group, self.latency)

    def time(self, cls: str, nbytes: float) -> float:
        a, s = self.params[cls]
        return a + s * nbytes if nbytes > 0 else 0.0

    def as_dict(self) -> dict:
        return {"latency_s": self.latency, "latency_by_group_s": self.latency_by,
                **{c: {"a_s": a, "bw_Bps": 1 / s} for c, (a, s) in self.params.items()}}


def exchange_bytes(T: int, H: int, E: int, K: int, *, algo: str, dtype: str = "float32") -> float:
    """Bytes one rank sends in one layer's exchanges (uniform routing,
    :func:`~.sim.traffic.expected_dispatch`): dispatch and combine, both link classes, forward and
    backward (the backward passes send the same bytes the other way)."""
    from .sim.costs import DTYPE_BYTES
    from .sim.traffic import expected_dispatch
    tr = expected_dispatch(T, K, E, H, nodes=NODES, local=LOCAL, algo=algo, dtype_bytes=DTYPE_BYTES[dtype])
    return 2.0 * (tr["inter_node_bytes"] + tr["intra_node_bytes"] + tr["combine_inter_node_bytes"]
                  + tr["combine_intra_node_bytes"])


class ExchangeFit:
    """The dispatcher's own exchange, microbenchmarked: ``t = a + b * bytes`` per algorithm and
    chunk count (least squares over the calibration sizes, ``bytes`` from :func:`exchange_bytes`).
    ``samples`` maps ``(algo, chunks)`` to ``(bytes, seconds)`` points. The measured time is the
    whole chunked exchange with no expert compute: the collectives, gloo's own work, and the
    dispatcher's reordering of the rows (its permutes/unpermutes)."""

    def __init__(self, samples: Dict[tuple, List[tuple]]):
        self.params = {(str(a), int(c)): _line(pts) for (a, c), pts in samples.items()}

    def time(self, algo: str, chunks: int, nbytes: float) -> float:
        try:
            a, s = self.params[(algo, int(chunks))]
        except KeyError:
            raise ValueError(f"ExchangeFit: no exchange microbenchmark for {algo} with {chunks} chunk(s) "
                             f"(measured: {sorted(self.params)})") from None
        return a + s * nbytes

    def as_dict(self) -> dict:
        return {f"{a}|{c}": {"a_s": p[0], "s_per_byte": p[1]} for (a, c), p in sorted(self.params.items())}


def predict_ep_layer(costs, links: LinkFit, T: int, H: int, F: int, E: int, K: int, *, algo: str,
                     chunks: int, dtype: str = "float32", rho: float = 0.0, eta: float = 1.0,
                     exchange: "ExchangeFit" = None) -> Dict[str, float]:
    """Predicted fwd+bwd seconds of one rank's EP MoE layer (see the module docstring):
    ``t(c) = C*(1 + rho) + comm(c) - eta * min(C, comm(c)) * (1 - 1/c)``.

    Communication form ``links`` (``exchange=None``): ``C`` = the layer's ops on this rank plus
    the dispatcher's reorderings, priced by ``costs``; ``comm(c)`` = per chunk and exchange the
    collectives' latency, plus the bytes of each link class over its fitted bandwidth (the bytes
    do not grow with ``c``, the latencies do). Form ``exchange`` (an :class:`ExchangeFit`):
    ``comm(c)`` = the microbenchmarked exchange of ``c`` chunks at this layer's bytes, which
    includes the dispatcher's reordering, so ``C`` holds the router and the experts only (no
    permute / unpermute). ``rho``: the layer's compute beyond its microbenchmarked ops (fitted);
    ``eta``: the fraction of the ideal overlap the chunked pipeline achieves (fitted).
    ``rho=0, eta=1`` is the ideal pipeline: ``C + comm`` for one chunk, ``max + min/c`` for ``c``."""
    from .sim.costs import DTYPE_BYTES
    from .sim.layers import moe_layer_ops
    from .sim.traffic import expected_dispatch
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks!r}")
    if algo not in ALGOS:
        raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
    f, b = moe_layer_ops(T, H, F, E, K, dtype=dtype, experts_per_device=E // WORLD)
    ops = f + b
    if exchange is not None:  # the reordering is in the exchange's microbenchmark
        compute = sum(costs.time(o) for o in ops if o.kind not in _REORDER_KINDS)
        comm = exchange.time(algo, chunks, exchange_bytes(T, H, E, K, algo=algo, dtype=dtype))
        hidden = _hideable(compute, comm, chunks)
        return dict(predicted_s=compute * (1.0 + rho) + comm - eta * hidden, compute_s=compute, comm_s=comm,
                    hideable_s=hidden)
    extra = 1 if algo == "flat" else 2
    by = {o.name: o for o in ops}
    ops += [by["permute"], by["unpermute"], by["permute_bwd"], by["unpermute_bwd"]] * extra
    compute = sum(costs.time(o) for o in ops)
    bts = DTYPE_BYTES[dtype]
    tr = expected_dispatch(T, K, E, H, nodes=NODES, local=LOCAL, algo=algo, dtype_bytes=bts)
    per = 1.0 / chunks
    # collectives per chunk, forward and backward (distributed/dispatcher.py), each at the latency
    # measured on its own group (a 2-rank exchange is not a 4-rank one): flat, 2 x 3 over every
    # rank (count header, slots + probs, token rows / the combine and the backward exchanges);
    # hierarchical, the count header over every rank, then 2 x 3 across nodes (2-rank groups) and
    # 2 x 3 within the node
    lat = (6 * links.lat("world") if algo == "flat"
           else links.lat("world") + 6 * (links.lat("inter") + links.lat("intra")))
    dispatch = links.time("inter", tr["inter_node_bytes"] * per) + links.time("intra", tr["intra_node_bytes"] * per)
    combine = (links.time("inter", tr["combine_inter_node_bytes"] * per)
               + links.time("intra", tr["combine_intra_node_bytes"] * per))
    comm = chunks * (2 * (dispatch + combine) + lat)
    hidden = _hideable(compute, comm, chunks)
    total = compute * (1.0 + rho) + comm - eta * hidden
    return dict(predicted_s=total, compute_s=compute, comm_s=comm, hideable_s=hidden)


def _hideable(compute: float, comm: float, chunks: int) -> float:
    """What a ``chunks``-deep pipeline can hide at best: ``min(C, comm) * (1 - 1/c)``."""
    return min(compute, comm) * (1.0 - 1.0 / chunks)


#: the op kinds of the layer that are the dispatcher's work in the EP layer (in the exchange form,
#: priced inside the exchange microbenchmark)
_REORDER_KINDS = ("permute", "unpermute", "permute_bwd", "unpermute_bwd")


def fit_overlap(points, form: str = "rho+eta") -> Dict[str, float]:
    """``rho`` and ``eta`` of :func:`predict_ep_layer` from ``(measured, compute, comm, hideable)``
    per layer: least squares in relative error (``m - C - comm = rho*C - eta*hideable`` is linear in
    both), ``eta`` kept in ``[0, 1]`` (a fraction of the ideal overlap; outside it, ``rho`` is refitted
    with ``eta`` at the bound). With no chunked layer among the points ``eta`` stays 1 (the ideal).
    ``form`` (:data:`OVERLAP_FORMS`) says which of the two are fitted; the others stay at the ideal
    pipeline's ``rho = 0``, ``eta = 1``."""
    import torch
    if form not in OVERLAP_FORMS:
        raise ValueError(f"fit_overlap: form must be one of {', '.join(OVERLAP_FORMS)}, got {form!r}")
    pts = [tuple(map(float, p)) for p in points]
    if not pts:
        raise ValueError("fit_overlap: no points")
    if form == "ideal":
        return dict(rho=0.0, eta=1.0)

    def solve(cols, y):
        A = torch.tensor(cols, dtype=torch.float64)
        return torch.linalg.lstsq(A, torch.tensor(y, dtype=torch.float64).unsqueeze(1),
                                  driver="gelsd").solution.squeeze(1).tolist()

    if form == "eta":
        if not any(h > 0 for m, c, k, h in pts):
            return dict(rho=0.0, eta=1.0)
        (eta,) = solve([[-h / m] for m, c, k, h in pts], [(m - c - k) / m for m, c, k, h in pts])
        return dict(rho=0.0, eta=min(max(eta, 0.0), 1.0))
    if form == "rho+eta" and any(h > 0 for m, c, k, h in pts):
        rho, eta = solve([[c / m, -h / m] for m, c, k, h in pts], [(m - c - k) / m for m, c, k, h in pts])
        if 0.0 <= eta <= 1.0:
            return dict(rho=rho, eta=eta)
        eta = min(max(eta, 0.0), 1.0)
    else:  # form "rho", or no chunked layer: eta at the ideal
        eta = 1.0
    (rho,) = solve([[c / m] for m, c, k, h in pts], [(m - c - k + eta * h) / m for m, c, k, h in pts])
    return dict(rho=rho, eta=eta)


def _overlap_predict(p, ov) -> float:
    m, c, k, h = p
    return c * (1 + ov["rho"]) + k - ov["eta"] * h


def select_overlap(groups: Dict[str, list], forms=OVERLAP_FORMS) -> Dict[str, object]:
    """The overlap form and its fit from the fit shapes' layers only: ``groups`` maps each fit
    shape to its ``(measured, compute, comm, hideable)`` points. :func:`select_ep_model` with one
    communication form and the shared scope: each form of ``forms`` is scored by
    leave-one-shape-out (mean accuracy ``1 - |p - m| / m``); the best wins (ties, within 1e-9, to
    the earlier, simpler form) and is refitted on every fit layer. With one fit shape there is
    nothing to leave out: the last form is used. Returns ``rho``, ``eta``, ``form``, ``loso``."""
    if not groups:
        raise ValueError("select_overlap: no fit shapes")
    one = {s: [(p[0], {"links": tuple(p[1:])}) for p in pts] for s, pts in groups.items()}
    m = select_ep_model(one, ("links",), tuple(forms), ("shared",))
    return dict(rho=m["rho"], eta=m["eta"], form=m["overlap"],
                loso={f.split("/", 1)[1]: v for f, v in m["loso"].items()})


def _point_algo(point):
    """The dispatch algorithm of a fit point ``(measured, by[, algo])`` (None when not recorded)."""
    return point[2] if len(point) > 2 else None


def _model_fit(points, form: str) -> Dict[str, object]:
    """Fit the pair ``"comm/overlap"`` (one ``rho``/``eta`` for every point) or
    ``"comm/overlap/per-algorithm"`` (one pair per dispatch algorithm, in ``by_algo``)."""
    comm, of, *scope = form.split("/")
    if not scope:
        return dict(fit_overlap([(p[0], *p[1][comm]) for p in points], of), comm=comm, overlap=of, scope="shared")
    by_algo = {}
    for algo in sorted({_point_algo(p) for p in points}):
        by_algo[algo] = fit_overlap([(p[0], *p[1][comm]) for p in points if _point_algo(p) == algo], of)
    return dict(comm=comm, overlap=of, scope="per-algorithm", by_algo=by_algo)


def overlap_terms(model, algo: str) -> Dict[str, float]:
    """``rho`` and ``eta`` of a fitted EP model (:func:`select_ep_model`) for dispatch ``algo``."""
    if model.get("scope") == "per-algorithm":
        return model["by_algo"][algo]
    return dict(rho=model["rho"], eta=model["eta"])


def _model_accuracy(model, point) -> float:
    m, by = point[0], point[1]
    return 1 - abs(_overlap_predict((m, *by[model["comm"]]), overlap_terms(model, _point_algo(point))) - m) / m


def select_ep_model(groups: Dict[str, list], comm_forms=COMM_FORMS, forms=OVERLAP_FORMS,
                    scopes=OVERLAP_SCOPES) -> Dict[str, object]:
    """The communication form (:data:`COMM_FORMS`), the overlap form (:data:`OVERLAP_FORMS`) and
    its scope (:data:`OVERLAP_SCOPES`) chosen together from the fit shapes' layers only, as
    :func:`select_overlap` chooses the overlap form: ``groups`` maps each fit shape to its
    ``(measured, {comm form: (compute, comm, hideable)}, algo)`` points (``algo`` may be left out:
    then only the shared scope is scored); each candidate ``"comm/overlap"`` (shared) or
    ``"comm/overlap/per-algorithm"`` is scored by leave-one-shape-out
    (:func:`~.sim.costs.leave_out_select`; ties to the earlier candidate: ``links`` before
    ``exchange``, simpler overlap forms first, shared before per-algorithm) and the best is
    refitted on every fit layer. Returns ``comm``, ``overlap``, ``scope``, ``rho`` and ``eta``
    (shared) or ``by_algo`` (per algorithm; :func:`overlap_terms` reads either), ``form`` (the
    candidate) and ``loso`` (every candidate's score). The communication forms are those of
    ``comm_forms`` every point has."""
    shapes = list(groups)
    if not shapes:
        raise ValueError("select_ep_model: no fit shapes")
    pts = [p for s in shapes for p in groups[s]]
    comms = [c for c in comm_forms if all(c in p[1] for p in pts)]
    if not comms:
        raise ValueError(f"select_ep_model: no communication form of {tuple(comm_forms)} priced on every fit layer")
    pairs = [f"{c}/{o}" for c in comms for o in forms]
    if "per-algorithm" in scopes and all(_point_algo(p) is not None for p in pts):
        pairs += [f"{c}/{o}/per-algorithm" for c in comms for o in forms]
    if "shared" not in scopes:
        pairs = [p for p in pairs if p.endswith("/per-algorithm")]
    scores = {}
    if len(shapes) >= 2:
        from .sim.costs import leave_out_select
        best, scores = leave_out_select([groups[s] for s in shapes], pairs, _model_fit, _model_accuracy)
    else:
        best = pairs[-1]
    return dict(_model_fit(pts, best), form=best, loso=scores)


# ----------------------------------------------------------------------------- worker
def _worker(a) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=a.init, rank=a.rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    from ..benchmark.timing import measure
    from ..distributed import EPTopology, MoEDispatcher
    from ..nn import MoELayer
    from .sim.costs import FittedCosts
    from .validate import _ops, component_steps
    cfg = json.loads(a.config)
    topo = EPTopology(local_size=LOCAL)

    def timed(fn, runs):
        t = measure(fn, runs=runs, warmup=1, setup=dist.barrier)
        v = torch.tensor([float(t)], dtype=torch.float64)  # median of the runs
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v)

    def a2a_case(group, n, nbytes):
        elems = max(1, nbytes // 4)
        x = torch.randn(n * elems)
        y = torch.empty_like(x)
        return lambda: dist.all_to_all_single(y, x, group=group)

    layers = {}
    inputs = {}
    for v in cfg["validation"] + cfg["fit_shapes"]:
        T, H, F, E, K = v
        g = torch.Generator().manual_seed(100 + a.rank)
        inputs[tuple(v)] = (torch.randn(T, H, generator=g), torch.randn(T, H, generator=g))
        for algo in ALGOS:
            torch.manual_seed(7)
            layers[(tuple(v), algo)] = MoELayer(H, E, F, K, dispatcher=MoEDispatcher(topo, E, algorithm=algo))

    from ..distributed.overlap import moe_forward_overlapped
    exch_inputs, exch_disp = {}, {}
    for (T, H, E, K) in cfg["exchange_sizes"]:
        for algo in ALGOS:  # construction is collective: the same order on every rank
            if (algo, E) not in exch_disp:
                exch_disp[(algo, E)] = MoEDispatcher(topo, E, algorithm=algo)
        g = torch.Generator().manual_seed(300 + a.rank)
        ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices  # K distinct uniform experts
        probs = torch.softmax(torch.randn(T, K, generator=g), dim=1)
        exch_inputs[(T, H, E, K)] = (torch.randn(T, H, generator=g), ids, probs, torch.randn(T, H, generator=g))

    def exchange_step(size, algo, chunks):
        """The dispatcher's exchange alone: dispatch -> identity experts -> combine, and backward."""
        T, H, E, K = size
        disp = exch_disp[(algo, E)]
        x, ids, probs, gy = exch_inputs[size]

        def step():
            xs, ps = x.detach().requires_grad_(), probs.detach().requires_grad_()
            moe_forward_overlapped(disp, xs, ids, ps, lambda rows, tpe: rows.view_as(rows), (),
                                   chunks=chunks, overlap=chunks > 1).backward(gy)
        return step

    def layer_step(key, algo, chunks):
        layer = layers[(key, algo)]
        x, gy = inputs[key]

        def step():
            layer.overlap_chunks = chunks
            layer.zero_grad(set_to_none=True)
            layer(x.detach().requires_grad_()).backward(gy)
        return step

    out = {"rounds": [], "exchange_sizes": cfg["exchange_sizes"]}
    for r in range(cfg["rounds"]):
        rnd = {"links": {"inter": [], "intra": []}, "compute": [], "layers": {}}
        for cls, group, n in (("inter", topo.inter_group, NODES), ("intra", topo.intra_group, LOCAL)):
            for s in cfg["a2a_sizes"]:
                # bytes this rank sends to the other member(s) of the group: (n-1) * s
                rnd["links"][cls].append(((n - 1) * s, timed(a2a_case(group, n, s), cfg["runs"])))
        small = torch.zeros(1)

        def burst(group, n):
            tiny = torch.zeros(n)

            def run():
                for _ in range(BURST):
                    dist.all_gather_into_tensor(tiny, small, group=group)
            return run
        rnd["latency_by"] = {cls: timed(burst(group, n), cfg["runs"]) / BURST for cls, group, n in
                             (("world", None, WORLD), ("inter", topo.inter_group, NODES),
                              ("intra", topo.intra_group, LOCAL))}
        rnd["latency"] = rnd["latency_by"]["world"]
        samples = []
        for (T, H, F, E, K) in cfg["calibration"]:
            steps = component_steps(T, H, F, E, K, "float32")
            ops = {op.name: op for op in _ops(T, H, F, E, K, "float32")}
            for name, fn in steps.items():
                t = timed(fn, cfg["runs"])
                samples.append((ops[name], t))
                rnd["compute"].append(dict(op=name, shape=[T, H, F, E, K], seconds=t))
        fit = FittedCosts.fit(samples)
        links = LinkFit(rnd["links"], rnd["latency"], rnd["latency_by"])
        rnd["fit"] = json.loads(fit.to_json())
        rnd["link_fit"] = links.as_dict()
        # the dispatcher's own exchange at the calibration sizes, every algorithm and chunk count
        rnd["exchange"] = []
        xcases = [(tuple(sz), algo, c) for sz in cfg["exchange_sizes"] for algo in ALGOS for c in cfg["chunks"]]
        random.Random(2000 + r).shuffle(xcases)
        for sz, algo, c in xcases:
            t = timed(exchange_step(sz, algo, c), cfg["runs"])
            rnd["exchange"].append(dict(size=list(sz), algo=algo, chunks=c, seconds=t,
                                        bytes=exchange_bytes(*sz, algo=algo)))
        xfit = _exchange_fit(rnd["exchange"]) if rnd["exchange"] else None
        rnd["exchange_fit"] = xfit.as_dict() if xfit else None
        cases = [(tuple(v), algo, c) for v in cfg["validation"] + cfg["fit_shapes"] for algo in ALGOS
                 for c in cfg["chunks"]]
        random.Random(1000 + r).shuffle(cases)  # same order on every rank; interleaved over rounds
        for v, algo, c in cases:
            m = timed(layer_step(v, algo, c), cfg["runs"])
            p = predict_ep_layer(fit, links, *v, algo=algo, chunks=c)
            rec = dict(measured_s=m, **p)
            if xfit is not None:
                px = predict_ep_layer(fit, links, *v, algo=algo, chunks=c, exchange=xfit)
                rec["exchange"] = {k: px[k] for k in ("compute_s", "comm_s", "hideable_s")}
            rnd["layers"][f"{list(v)}|{algo}|{c}"] = rec
        out["rounds"].append(rnd)
    if a.rank == 0:
        Path(a.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher
def _netns_helpers():
    """The EP benchmark's namespace helpers (the bench suite, installed with the package)."""
    return importlib.import_module("ascend_moe_ops.benchmark.suite.bench_ep_dispatcher")


def run_ep(*, rounds: int = 3, runs: int = 5, rate: str = "1gbit", timeout: float = 900,
           calibration=None, validation=None, fit_shapes=EP_FIT_SHAPES, a2a_sizes=A2A_SIZES, chunks=CHUNKS,
           exchange_sizes=EP_EXCHANGE_SIZES, log=print) -> dict:
    """Run the EP calibration/validation on the emulated two-node cluster; returns the report
    (``skipped`` with the reason when namespaces are unavailable)."""
    bench = _netns_helpers()
    why = bench.netns_unavailable()
    if why:
        return dict(skipped=f"the emulated two-node cluster cannot run here: {why}")
    cfg = dict(rounds=rounds, runs=runs, calibration=calibration or EP_CALIBRATION,
               validation=validation or EP_VALIDATION, fit_shapes=[list(f) for f in fit_shapes],
               a2a_sizes=list(a2a_sizes), exchange_sizes=[list(x) for x in exchange_sizes],
               chunks=list(chunks))
    cal_keys = {tuple(c[:3]) for c in cfg["calibration"]} | {tuple(f[:3]) for f in fit_shapes}
    exch_keys = {tuple(x[:2]) for x in exchange_sizes}
    for v in cfg["validation"]:
        if tuple(v[:3]) in cal_keys:
            raise AssertionError(f"EP validation shape {v} shares T, H, F with a calibration shape")
        if tuple(v[:2]) in exch_keys:
            raise AssertionError(f"EP validation shape {v} shares T, H with an exchange calibration size")
    fd, out = tempfile.mkstemp(suffix=".json", prefix="amo_ep_validate_")
    os.close(fd)
    start = time.monotonic()
    procs = []
    try:
        with bench.two_node_netns(rate) as nodes:
            init = f"tcp://{nodes[0][2]}:{random.randint(20000, 40000)}"
            for r in range(WORLD):
                ns, iface, _ = nodes[r // LOCAL]
                env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=iface)
                cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "ascend_moe_ops.perfmodel.validate_ep",
                       "--worker", "--rank", str(r), "--init", init, "--config", json.dumps(cfg), "--out", out]
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            bench.wait_group(procs, timeout, "EP validation")
        raw = json.loads(Path(out).read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        try:
            os.unlink(out)
        except OSError:
            pass
    log(f"EP validation done ({time.monotonic() - start:.0f} s)")
    return summarize_ep(raw, fit_shapes=fit_shapes, rate=rate, rounds=rounds, runs=runs,
                        seconds=time.monotonic() - start, calibration=cfg["calibration"])


class _NoCompute:
    def time(self, op) -> float:
        return 0.0


def pooled_links(rounds: List[dict]) -> LinkFit:
    """One :class:`LinkFit` from every round's link samples: per link class and size the median
    over rounds, then ``a + bytes / bw``; the latency is the median of the rounds' bursts."""
    samples = {}
    for cls in rounds[0]["links"]:
        by_size: Dict[float, List[float]] = {}
        for rd in rounds:
            for nbytes, t in rd["links"][cls]:
                by_size.setdefault(nbytes, []).append(t)
        samples[cls] = [(b, statistics.median(ts)) for b, ts in sorted(by_size.items())]
    by = {g: statistics.median(rd["latency_by"][g] for rd in rounds) for g in rounds[0].get("latency_by", {})}
    return LinkFit(samples, statistics.median(rd["latency"] for rd in rounds), by)


def _exchange_fit(records) -> ExchangeFit:
    samples: Dict[tuple, List[tuple]] = {}
    for rec in records:
        samples.setdefault((rec["algo"], int(rec["chunks"])), []).append((rec["bytes"], rec["seconds"]))
    return ExchangeFit(samples)


def pooled_exchange(rounds: List[dict]):
    """One :class:`ExchangeFit` from every round's exchange records: per algorithm, chunk count
    and size the median over rounds, then ``a + b * bytes``; ``None`` when the rounds have none
    (a report from before the exchange microbenchmark)."""
    by: Dict[tuple, List[float]] = {}
    for rd in rounds:
        for rec in rd.get("exchange") or ():
            by.setdefault((rec["algo"], int(rec["chunks"]), tuple(rec["size"]), rec["bytes"]), []).append(rec["seconds"])
    if not by:
        return None
    return _exchange_fit([dict(algo=a, chunks=c, bytes=b, seconds=statistics.median(ts))
                          for (a, c, _, b), ts in sorted(by.items())])


def summarize_ep(raw: dict, *, fit_shapes=EP_FIT_SHAPES, rate: str = "1gbit", rounds: int = 0, runs: int = 0,
                 seconds: float = 0.0, calibration=None, comm_forms=COMM_FORMS) -> dict:
    """The report from the workers' raw per-round records: medians over rounds, the
    communication form (:data:`COMM_FORMS`: the links' fit pooled over rounds, or the exchange
    microbenchmark pooled over rounds) and the overlap model's form and ``rho``/``eta``, chosen
    together from the fit shapes' layers only (:func:`select_ep_model`), the validation table (the
    fit shapes left out). ``by_comm_form`` gives, per communication form, the best overlap form on
    the fit shapes and the validation accuracy it would have had (a diagnostic: the choice is the
    fit shapes'). Also re-runs the analysis of a saved report:
    ``summarize_ep(json.load(f)["raw"], fit_shapes=...)`` (a report from before the exchange
    microbenchmark has the ``links`` form only)."""
    med = statistics.median
    keys = sorted(raw["rounds"][0]["layers"], key=lambda k: (k.split("|")[0], k.split("|")[1], int(k.split("|")[2])))
    links = pooled_links(raw["rounds"])  # one round's fit is noisy: pooled over rounds
    xfit = pooled_exchange(raw["rounds"])
    rows = {}
    for key in keys:
        shape, algo, c = key.split("|")
        v, c = json.loads(shape), int(c)
        per = [rd["layers"][key] for rd in raw["rounds"]]
        cl = med(p["compute_s"] for p in per)
        comm = predict_ep_layer(_NoCompute(), links, *v, algo=algo, chunks=c)["comm_s"]
        by = {"links": (cl, comm, _hideable(cl, comm, c))}
        if xfit is not None and all("exchange" in p for p in per):
            cx = med(p["exchange"]["compute_s"] for p in per)
            kx = predict_ep_layer(_NoCompute(), links, *v, algo=algo, chunks=c, exchange=xfit)["comm_s"]
            by["exchange"] = (cx, kx, _hideable(cx, kx, c))
        rows[key] = dict(measured_s=med(p["measured_s"] for p in per), by_comm=by,
                         measured_per_round=[p["measured_s"] for p in per])
    fit_keys = [json.dumps(list(f)) for f in fit_shapes]
    groups = {fk: [(r["measured_s"], r["by_comm"], k.split("|")[1]) for k, r in rows.items() if k.split("|")[0] == fk]
              for fk in fit_keys}
    ov = select_ep_model(groups, comm_forms)
    per_form = {cf: select_ep_model(groups, (cf,)) for cf in comm_forms
                if all(cf in r["by_comm"] for r in rows.values())}
    for r in rows.values():
        r["compute_s"], r["comm_s"], r["hideable_s"] = r["by_comm"][ov["comm"]]
    table = []
    for key in keys:
        shape, algo, c = key.split("|")
        if shape in fit_keys:
            continue
        r = rows[key]
        m = r["measured_s"]
        ideal = r["compute_s"] + r["comm_s"] - r["hideable_s"]
        p = _overlap_predict((m, r["compute_s"], r["comm_s"], r["hideable_s"]), overlap_terms(ov, algo))
        T, H, F, E, K = json.loads(shape)
        by_comm = {}
        for cf, mod in per_form.items():
            q = _overlap_predict((m, *r["by_comm"][cf]), overlap_terms(mod, algo))
            by_comm[cf] = dict(predicted_s=q, accuracy=1 - abs(q - m) / m, compute_s=r["by_comm"][cf][0],
                               comm_s=r["by_comm"][cf][1])
        table.append(dict(T=T, H=H, F=F, E=E, K=K, algo=algo, overlap_chunks=int(c), predicted_s=p, measured_s=m,
                          accuracy=1 - abs(p - m) / m, ideal_pipeline_s=ideal, ideal_accuracy=1 - abs(ideal - m) / m,
                          compute_s=r["compute_s"], comm_s=r["comm_s"], by_comm_form=by_comm,
                          measured_spread=(max(r["measured_per_round"]) - min(r["measured_per_round"])) / m,
                          measured_per_round=r["measured_per_round"]))
    acc = [r["accuracy"] for r in table]
    by_form = {cf: dict(mod, mean_accuracy=statistics.mean(t["by_comm_form"][cf]["accuracy"] for t in table),
                        worst_accuracy=min(t["by_comm_form"][cf]["accuracy"] for t in table))
               for cf, mod in per_form.items()}
    return dict(rate=rate, nodes=NODES, local=LOCAL, rounds=rounds or len(raw["rounds"]), runs=runs, seconds=seconds,
                validation=table, mean_accuracy=statistics.mean(acc), worst_accuracy=min(acc),
                ideal_mean_accuracy=statistics.mean(r["ideal_accuracy"] for r in table),
                ideal_worst_accuracy=min(r["ideal_accuracy"] for r in table),
                mean_measured_spread=statistics.mean(r["measured_spread"] for r in table),
                overlap_fit=ov, by_comm_form=by_form, fit_shapes=[list(f) for f in fit_shapes],
                fit_layers={k: rows[k] for k in keys if k.split("|")[0] in fit_keys},
                link_fits=[rd["link_fit"] for rd in raw["rounds"]], pooled_link_fit=links.as_dict(),
                exchange_fits=[rd.get("exchange_fit") for rd in raw["rounds"]],
                pooled_exchange_fit=xfit.as_dict() if xfit is not None else None,
                calibration_shapes=calibration, exchange_sizes=raw.get("exchange_sizes"),
                load_average=os.getloadavg(), raw=raw)


def _terms_text(model) -> str:
    if model.get("scope") == "per-algorithm":
        return "; ".join(f"{a}: rho={t['rho']:.3f}, eta={t['eta']:.3f}" for a, t in model["by_algo"].items())
    return f"rho={model['rho']:.3f}, eta={model['eta']:.3f}"


def format_ep_table(rep: dict) -> str:
    if "skipped" in rep:
        return rep["skipped"]
    lines = ["| T/rank | H | F | E | K | dispatch | overlap_chunks | compute ms (model) | comm ms (model) | "
             "predicted ms (model) | measured ms | spread over rounds | accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rep["validation"]:
        lines.append(f"| {r['T']} | {r['H']} | {r['F']} | {r['E']} | {r['K']} | {r['algo']} | {r['overlap_chunks']} | "
                     f"{1e3 * r['compute_s']:.1f} | {1e3 * r['comm_s']:.1f} | "
                     f"{1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} | {100 * r['measured_spread']:.0f} % | "
                     f"{100 * r['accuracy']:.1f} % |")
    ov = rep["overlap_fit"]
    lines.append(f"\nEP: mean accuracy {100 * rep['mean_accuracy']:.1f} %, worst {100 * rep['worst_accuracy']:.1f} % "
                 f"(ideal pipeline, rho=0 eta=1: {100 * rep['ideal_mean_accuracy']:.1f} % / "
                 f"{100 * rep['ideal_worst_accuracy']:.1f} %; communication / overlap form {ov.get('form', 'rho+eta')} "
                 f"chosen by leave-one-shape-out over the fit shapes {rep['fit_shapes']} ("
                 + ", ".join(f"{k} {100 * v:.1f} %" for k, v in ov.get("loso", {}).items())
                 + f"): {_terms_text(ov)}; mean spread over rounds {100 * rep['mean_measured_spread']:.0f} %; "
                 f"{rep['rounds']} rounds x {rep['runs']} runs, veth {rep['rate']}, {rep['seconds']:.0f} s)")
    for cf, mod in rep.get("by_comm_form", {}).items():
        lines.append(f"  with comm form {cf} (its best overlap form {mod['form'].split('/', 1)[1]}, {_terms_text(mod)}): "
                     f"mean {100 * mod['mean_accuracy']:.1f} %, worst {100 * mod['worst_accuracy']:.1f} %; per row "
                     + ", ".join(f"{100 * r['by_comm_form'][cf]['accuracy']:.1f}" for r in rep["validation"]) + " %")
    return "\n".join(lines)


def _report_path(text: str) -> str:
    """argparse type of --out: a file name (not a folder) whose folder exists or can be created."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, expected a file name")
    _cli.output_dir(str(Path(text).parent))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--init", default="", help=argparse.SUPPRESS)
    ap.add_argument("--config", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", type=lambda t: t and _report_path(t), help="JSON report file")
    ap.add_argument("--rounds", type=_cli.positive_int, default=3, help="calibrate/validate rounds (default 3)")
    ap.add_argument("--runs", type=_cli.positive_int, default=5, help="runs per measurement, median taken (default 5)")
    ap.add_argument("--rate", default="1gbit")
    a = ap.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    rep = run_ep(rounds=a.rounds, runs=a.runs, rate=a.rate, log=lambda s: print(s, file=sys.stderr))
    print(format_ep_table(rep))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(rep, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
