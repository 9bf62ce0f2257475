"""Chunked expert-parallel MoE pipeline: communication of one chunk overlaps expert compute of
another, forward and backward.

:func:`moe_forward_overlapped` splits the tokens of a rank into ``chunks`` contiguous pieces and
runs, per chunk, dispatch -> experts -> combine. The collectives (dispatch, combine and their
backward passes) run on one communication thread, in the same order on every rank; the experts
run on the calling thread. Forward, the communication thread works on the dispatch of chunk
``i+1`` and the combine of chunk ``i-1`` while the caller computes the experts of chunk ``i``.
Backward, the combine-gradient all-to-all of chunk ``i+1`` is launched before the expert backward
(data- and weight-gradient GEMMs) of chunk ``i`` starts, and the dispatch-gradient all-to-all of
chunk ``i-1`` runs meanwhile. A shared expert (``shared_fn``) fills the two gaps chunking leaves:
it runs while chunk 0's dispatch is on the link (forward) and its backward while chunk 0's
combine-gradient exchange is (backward).

The order is enforced, not left to thread timing: before the experts of chunk ``i`` start
(forward) the calling thread waits until the communication thread has issued the first
collective of chunk ``i+1``'s dispatch, and before chunk ``i``'s expert backward (its data- and
weight-gradient GEMMs) until it has issued chunk ``i+1``'s combine-gradient all-to-all. Those
waits cover only local preparation of the next chunk (the communication thread's queue holds
nothing newer in front of it). :func:`record_schedule` records the resulting event order (the
tests assert it).

Each chunk is its own small autograd graph (dispatch, experts, combine, separated by detached
leaves); one custom autograd Function ties them to the caller's graph and schedules their
backward passes. Results are those of the same chunks run one after the other (bitwise:
``overlap=False`` runs exactly that sequence on the calling thread); parameter gradients are
summed over chunks in chunk order.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from typing import Callable, List, Optional, Sequence

import torch

from ..ops import checks as _checks
from . import _autograd as C

Tensor = torch.Tensor

_RECORD: Optional[list] = None
_CLOCK: Optional[Callable[[], float]] = None
_RECORD_LOCK = threading.Lock()


@contextlib.contextmanager
def record_schedule(clock: Optional[Callable[[], float]] = None):
    """Record the pipeline's events (forward and backward) while the block runs; yields the list.

    Each event is a dict ``{"seq", "phase" ("fwd"/"bwd"), "event", "chunk", "thread",
    "detail", "t"}`` in the order it happened (``seq`` counts up across threads; ``t`` is
    ``clock()`` at the event when a ``clock`` is given, e.g. the benchmark harness's, else
    ``None``). Events: forward
    ``dispatch_launch`` (its first collective issued; ``detail`` names it), ``dispatch_done``,
    ``expert_start``, ``expert_end``, ``combine_launch``, ``combine_done``; backward
    ``combine_grad_launch`` (the first collective of the combine's backward: the combine-gradient
    all-to-all), ``combine_grad_done``, ``expert_bwd_start`` / ``expert_bwd_end`` (the expert
    backward: data- and weight-gradient GEMMs), ``dispatch_grad_launch``, ``dispatch_grad_done``;
    with a shared expert also ``shared_start`` / ``shared_end`` (forward) and ``shared_bwd_start``
    / ``shared_bwd_end`` (backward), chunk ``-1``.
    Every communication task also records ``<name>_start`` when the communication thread picks it
    up. A diagnostic for tests and profiling; one recording at a time per process."""
    global _RECORD, _CLOCK
    events: list = []
    _RECORD, _CLOCK = events, clock
    try:
        yield events
    finally:
        _RECORD, _CLOCK = None, None


def _event(phase: str, name: str, chunk: int, detail: str = "") -> None:
    rec = _RECORD
    if rec is not None:
        with _RECORD_LOCK:
            rec.append(dict(seq=len(rec), phase=phase, event=name, chunk=chunk,
                            thread=threading.current_thread().name, detail=detail,
                            t=None if _CLOCK is None else _CLOCK()))


class _CommTask:
    """One communication task of a chunk. ``launched`` is set when its first collective is
    issued (or when it ends without one); both moments are recorded."""

    def __init__(self, phase: str, name: str, chunk: int, fn):
        self.phase, self.name, self.chunk, self.fn = phase, name, chunk, fn
        self.launched = threading.Event()
        self.future = None

    def _hook(self, what: str) -> None:
        if not self.launched.is_set():
            _event(self.phase, self.name + "_launch", self.chunk, what)
            self.launched.set()

    def __call__(self):
        _event(self.phase, self.name + "_start", self.chunk)
        prev = getattr(C._launch_hook, "fn", None)
        C.on_launch(self._hook)
        try:
            return self.fn()
        finally:
            C.on_launch(prev)
            self._hook("(no collective)")
            _event(self.phase, self.name + "_done", self.chunk)

    def wait_launched(self) -> None:
        """Block until the first collective is issued (or the task has finished, also by error)."""
        while not self.launched.wait(0.01):
            if self.future is not None and self.future.done():
                return


def _submit(ex, phase, name, chunk, fn) -> _CommTask:
    task = _CommTask(phase, name, chunk, fn)
    task.future = ex.submit(task)
    return task


class _Inline:
    """Executor stand-in that runs each task at once (``overlap=False``)."""

    class _Done:
        def __init__(self, fn):
            self._value, self._error = None, None
            try:
                self._value = fn()
            except BaseException as e:  # re-raised by result(), like a Future
                self._error = e

        def result(self):
            if self._error is not None:
                raise self._error
            return self._value

    def submit(self, fn):
        return self._Done(fn)

    def shutdown(self, **kwargs):
        pass


def _same_device_initializer():
    """The current accelerator device is per thread: give the communication thread the caller's
    (NCCL/HCCL collectives and metadata tensors use it)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        return lambda: torch.cuda.set_device(dev)
    npu = getattr(torch, "npu", None)
    if npu is not None and hasattr(npu, "current_device"):
        try:
            dev = npu.current_device()
            return lambda: npu.set_device(dev)
        except Exception:  # pragma: no cover - torch_npu without a device
            pass
    return None


def _executor(overlap: bool):
    if overlap:
        return cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ascend_moe_ops_ep_comm",
                                     initializer=_same_device_initializer())
    return _Inline()


def _grad(outputs, inputs, grads, retain_graph: bool = False):
    """``torch.autograd.grad`` over the inputs that need it (``None`` for the others); with
    ``retain_graph`` the graph stays for another backward."""
    want = [i for i, t in enumerate(inputs) if t is not None and t.requires_grad]
    res: List[Optional[Tensor]] = [None] * len(inputs)
    if not want or not outputs.requires_grad:
        return res
    got = torch.autograd.grad(outputs, [inputs[i] for i in want], grads, allow_unused=True,
                              retain_graph=retain_graph)
    for i, g in zip(want, got):
        res[i] = g
    return res


def _leaf(t: Optional[Tensor], requires_grad: bool) -> Optional[Tensor]:
    return None if t is None else t.detach().requires_grad_(requires_grad)


def _run_forward(dispatcher, xs, ids, ps, expert_fn, overlap: bool, record: bool, side=None):
    """The pipelined forward; with ``record`` every chunk keeps its graph pieces. ``side`` (the
    shared expert, or ``None``) runs on the calling thread once the first chunk's dispatch has
    issued its first collective; returns ``(chunks, side's output)``."""
    n = len(xs)
    ex = _executor(overlap)
    grad_mode = torch.is_grad_enabled()

    def dispatch(i):
        with torch.set_grad_enabled(grad_mode):
            et, tpe, h = dispatcher.dispatch(xs[i], ids[i], ps[i], _chunks=n)
        return et, tpe, h

    def combine(i, y_leaf, h):
        with torch.set_grad_enabled(grad_mode):
            return dispatcher.combine(y_leaf, h)

    chunks = [dict() for _ in range(n)]
    try:
        fd = {i: _submit(ex, "fwd", "dispatch", i, lambda i=i: dispatch(i)) for i in range(min(2, n))}
        fc = {}
        side_out = None
        if side is not None:  # the shared expert hides the first dispatch, which nothing else can
            fd[0].wait_launched()
            _event("fwd", "shared_start", -1)
            with torch.set_grad_enabled(grad_mode):
                side_out = side()
            _event("fwd", "shared_end", -1)
        for i in range(n):
            et, tpe, h = fd.pop(i).future.result()
            if i + 1 < n:  # dispatch i+1 is issued before the experts of chunk i start
                fd[i + 1].wait_launched()
            et_leaf = _leaf(et, True) if record else et
            _event("fwd", "expert_start", i)
            y = expert_fn(et_leaf, tpe)  # overlaps dispatch i+1 and combine i-1
            _event("fwd", "expert_end", i)
            y_leaf = _leaf(y, True) if record else y
            if i + 2 < n:  # (queued ahead of combine i: it is waited for first)
                fd[i + 2] = _submit(ex, "fwd", "dispatch", i + 2, lambda j=i + 2: dispatch(j))
            fc[i] = _submit(ex, "fwd", "combine", i, lambda i=i, y_leaf=y_leaf, h=h: combine(i, y_leaf, h))
            chunks[i].update(et=et, et_leaf=et_leaf, y=y, y_leaf=y_leaf)
        for i in range(n):
            chunks[i]["out"] = fc.pop(i).future.result()
    finally:
        ex.shutdown(wait=True, cancel_futures=True) if overlap else None
    return chunks, side_out


def _join(outs, side_out):
    out = torch.cat(outs)  # a fresh tensor: the shared expert's output is added in place
    return out if side_out is None else out.add_(side_out)


class _Pipeline(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg, tokens, probs, *params):
        dispatcher, topk_idx, expert_fn, n, overlap, shared_fn, n_exp = cfg
        with torch.enable_grad():
            xs = [_leaf(x, tokens.requires_grad) for x in tokens.tensor_split(n)]
            ps = ([None] * n if probs is None else
                  [_leaf(p, probs.requires_grad) for p in probs.tensor_split(n)])
            ids = list(topk_idx.tensor_split(n))
            x_sh = None if shared_fn is None else _leaf(tokens, tokens.requires_grad)
            chunks, y_sh = _run_forward(dispatcher, xs, ids, ps, expert_fn, overlap, record=True,
                                        side=None if shared_fn is None else lambda: shared_fn(x_sh))
        ctx.cfg, ctx.xs, ctx.ps, ctx.chunks, ctx.params = cfg, xs, ps, chunks, params
        ctx.x_sh, ctx.y_sh = x_sh, y_sh
        ctx.has_probs = probs is not None
        return _join([c["out"].detach() for c in chunks], None if y_sh is None else y_sh.detach())

    @staticmethod
    def backward(ctx, g):
        _, _, _, n, overlap, _, n_exp = ctx.cfg
        if ctx.chunks is None:
            raise RuntimeError("moe_forward_overlapped: trying to backward through its graph a second "
                               "time (its chunk graphs were freed after the first backward); pass "
                               "retain_graph=True to the first backward to backward twice")
        # backward(retain_graph=True) keeps the chunk graphs for another backward, as plain
        # dispatch/combine do; otherwise they are freed here (private torch API: without it the
        # graphs are freed and a second backward raises the error above)
        keep_fn = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
        keep = bool(keep_fn()) if keep_fn is not None else False
        chunks, xs, ps = ctx.chunks, ctx.xs, ctx.ps
        params, sh_params = list(ctx.params[:n_exp]), list(ctx.params[n_exp:])
        sizes = [x.shape[0] for x in xs]
        gs = list(g.split(sizes))
        ex = _executor(overlap)

        def combine_bwd(i):  # the combine's backward: dispatch-direction all-to-alls
            c = chunks[i]
            dy, dp = _grad(c["out"], [c["y_leaf"], ps[i]], gs[i].contiguous(), keep)
            return dy, dp

        def dispatch_bwd(i, det):  # the dispatch's backward: combine-direction all-to-alls
            c = chunks[i]
            if det is None or not c["et"].requires_grad:
                return None, None
            return tuple(_grad(c["et"], [xs[i], ps[i]], det, keep))

        dx: List[Optional[Tensor]] = [None] * n
        dps: List[Optional[Tensor]] = [None] * n
        dparams: List[Optional[Tensor]] = [None] * len(params)
        dx_sh: Optional[Tensor] = None
        dsh: List[Optional[Tensor]] = [None] * len(sh_params)
        try:
            fcb = {i: _submit(ex, "bwd", "combine_grad", i, lambda i=i: combine_bwd(i))
                   for i in range(min(2, n))}
            if ctx.y_sh is not None:  # the shared expert's backward hides the first exchange
                fcb[0].wait_launched()
                _event("bwd", "shared_bwd_start", -1)
                got = _grad(ctx.y_sh, [ctx.x_sh] + sh_params, g.contiguous(), keep)
                dx_sh, dsh = got[0], got[1:]
                _event("bwd", "shared_bwd_end", -1)
            fdb = {}
            for i in range(n):
                dy, dps[i] = fcb.pop(i).future.result()
                if i + 2 < n:
                    fcb[i + 2] = _submit(ex, "bwd", "combine_grad", i + 2, lambda j=i + 2: combine_bwd(j))
                if i + 1 < n:  # chunk i+1's combine-gradient exchange goes out before these GEMMs
                    fcb[i + 1].wait_launched()
                c = chunks[i]
                _event("bwd", "expert_bwd_start", i)
                got = _grad(c["y"], [c["et_leaf"]] + params, dy, keep) if dy is not None else \
                    [None] * (1 + len(params))
                _event("bwd", "expert_bwd_end", i)
                for k, gp in enumerate(got[1:]):
                    if gp is not None:
                        dparams[k] = gp if dparams[k] is None else dparams[k] + gp
                fdb[i] = _submit(ex, "bwd", "dispatch_grad", i, lambda i=i, det=got[0]: dispatch_bwd(i, det))
            for i in range(n):
                dxi, dpi = fdb.pop(i).future.result()
                dx[i] = dxi
                if dpi is not None:
                    dps[i] = dpi if dps[i] is None else dps[i] + dpi
        finally:
            ex.shutdown(wait=True, cancel_futures=True) if overlap else None
        if not keep:
            ctx.chunks = ctx.x_sh = ctx.y_sh = None  # free the graphs

        def cat(parts, leaves):
            if leaves[0] is None or not leaves[0].requires_grad:
                return None
            return torch.cat([d if d is not None else torch.zeros_like(x)
                              for d, x in zip(parts, leaves)])

        dtokens, dprobs = cat(dx, xs), cat(dps, ps)
        if dx_sh is not None:
            dtokens = dx_sh if dtokens is None else dtokens + dx_sh
        return (None, dtokens, dprobs) + tuple(dparams) + tuple(dsh)


def moe_forward_overlapped(dispatcher, tokens: Tensor, topk_idx: Tensor, probs: Optional[Tensor],
                           expert_fn: Callable[[Tensor, Tensor], Tensor],
                           params: Sequence[Tensor] = (), *, chunks: int = 2,
                           overlap: bool = True, shared_fn: Optional[Callable[[Tensor], Tensor]] = None,
                           shared_params: Sequence[Tensor] = ()) -> Tensor:
    """Expert-parallel MoE ``combine(experts(dispatch(tokens)))`` in ``chunks`` pipelined pieces.

    Args:
        dispatcher: a :class:`~ascend_moe_ops.distributed.MoEDispatcher`.
        tokens: ``[T, H]`` this rank's tokens (``T`` may differ between ranks, even be 0).
        topk_idx: ``[T, K]`` global expert ids (``-1`` = empty slot).
        probs: ``[T, K]`` router weights or ``None``.
        expert_fn: ``expert_fn(expert_tokens [R, H], tokens_per_local_expert [L]) -> [R, H']``,
            e.g. an :class:`ascend_moe_ops.nn.GroupedMLP` of the local experts.
        params: the tensors ``expert_fn`` uses that need gradients (e.g.
            ``list(experts.parameters())``); their gradients are computed chunk by chunk and
            summed in chunk order.
        chunks: number of pieces; the tokens are cut with ``tensor_split`` (sizes differ by at most
            one). Every rank must use the same value (each dispatch's metadata exchange carries it: a
            difference raises :class:`SplitMismatchError` on every rank). ``1`` = no pipelining.
        overlap: ``False`` runs the same chunks one after the other on the calling thread (the
            reference the overlapped run equals bitwise).
        shared_fn: a shared expert ``shared_fn(tokens [T, H]) -> [T, H']`` (e.g. an
            :class:`ascend_moe_ops.nn.SharedExpertMLP`) or ``None``. Its output is added to the
            result (``routed + shared``, as in :class:`ascend_moe_ops.nn.MoELayer`); it runs on the
            calling thread while the first chunk's dispatch is on the link, and its backward while
            the first combine-gradient exchange is — the two transfers the chunked pipeline alone
            cannot hide (DeepSeek-V3 / Pangu Ultra MoE layers have one shared expert).
        shared_params: the tensors ``shared_fn`` uses that need gradients.

    Returns:
        ``[T, H']``, differentiable w.r.t. ``tokens``, ``probs``, ``params`` and ``shared_params``.
        ``backward(retain_graph=True)`` keeps the chunk graphs for another backward; without it
        they are freed, and a second backward raises a ``RuntimeError`` naming ``retain_graph``.

    Errors: a ``tokens`` / ``topk_idx`` / ``probs`` / ``params`` entry that is not a tensor, a
    non-callable ``expert_fn`` raise ``TypeError`` naming it, on the calling rank before any
    collective; dtypes and shapes of ``topk_idx`` / ``probs`` are checked by the dispatcher in its
    first collective (the ranks that passed them raise their error, the others
    :class:`SplitMismatchError`). With ``chunks > 1`` the communication thread may already have
    entered the next chunk's exchange on a rank whose arguments were bad while its peers stopped at
    the first: that rank then waits out the process-group timeout (a ``CollectiveError``).

    Every rank issues the same collectives in the same order (one communication thread per
    call). Do not run other collectives on the dispatcher's groups while a call (or its
    backward) is in progress.
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    # only what cutting the arguments into chunks needs is checked here, on the calling rank: the
    # dtypes and shapes of topk_idx / probs are the dispatcher's, whose first collective reports a bad
    # argument on every rank at once (a local raise here would leave the peers waiting)
    _checks.check_tensor("tokens", tokens, ndim=2)
    _checks.check_tensor("topk_idx", topk_idx)
    if probs is not None:
        _checks.check_tensor("probs", probs)
    if not callable(expert_fn):
        raise TypeError(f"expert_fn must be callable, got {type(expert_fn).__name__}")
    # tuples first: a generator (e.g. module.parameters()) is read once
    params, shared_params = tuple(params), tuple(shared_params) if shared_fn is not None else ()
    for name, ts in (("params", params), ("shared_params", shared_params)):
        for i, t in enumerate(ts):
            _checks.check_tensor(f"{name}[{i}]", t)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (tokens, probs) + params + shared_params)
    if not needs_grad:
        xs = list(tokens.tensor_split(chunks))
        ps = [None] * chunks if probs is None else list(probs.tensor_split(chunks))
        out, side_out = _run_forward(dispatcher, xs, list(topk_idx.tensor_split(chunks)), ps, expert_fn,
                                     overlap, record=False,
                                     side=None if shared_fn is None else lambda: shared_fn(tokens))
        return _join([c["out"] for c in out], side_out)
    cfg = (dispatcher, topk_idx, expert_fn, chunks, overlap, shared_fn, len(params))
    return _Pipeline.apply(cfg, tokens, probs, *params, *shared_params)


__all__ = ["moe_forward_overlapped", "record_schedule"]
