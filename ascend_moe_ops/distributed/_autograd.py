"""Differentiable collectives used by the dispatcher (only ops HCCL, NCCL and gloo all have).

* all-to-all (``all_to_all_single`` with uneven splits): backward = the same all-to-all with the
  input and output splits swapped;
* all-gather into one tensor: backward = reduce-scatter (sum);
* reduce-scatter (sum): backward = all-gather.

Each forward can run asynchronously: pass a :class:`Pending` and the forward returns at once with
the output tensor (its data is valid after ``pending.wait()``); the Work objects are kept in the
``Pending``. Backward passes always run synchronously. A group of size one never calls the
backend (the data is copied), so a one-node topology costs no inter-node call.
"""

from __future__ import annotations

import threading
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

Tensor = torch.Tensor

# torch >= 2.13 renamed the single-tensor forms (the old names warn); older torch / torch_npu
# builds only have the old names. Same signatures.
all_gather_raw = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_raw = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a peer raised and stopped participating, died, or sent
    data of another size). The message names the collective and the ranks of its group."""


def describe_group(group) -> str:
    """``"the EP group (global ranks [0, 1, 2, 3])"``-style text for error messages."""
    try:
        if group is None or group is dist.group.WORLD:
            ranks = list(range(dist.get_world_size()))
        else:
            ranks = list(dist.get_process_group_ranks(group))
    except Exception:  # pragma: no cover - group already destroyed
        ranks = "?"
    return f"group of global ranks {ranks}"


def group_timeout(group) -> Optional[float]:
    """The timeout (seconds) of ``group``'s backend, ``None`` if it cannot be read."""
    pg = dist.group.WORLD if group is None else group
    for dev in ("cpu", "cuda", "npu"):
        try:
            return pg._get_backend(torch.device(dev)).options._timeout.total_seconds()
        except Exception:
            continue
    return None


def guarded(what: str, group, fn):
    """Run ``fn()`` (a collective or a wait on one) and turn a backend failure into a
    :class:`CollectiveError` that names ``what`` and the group."""
    try:
        return fn()
    except CollectiveError:
        raise
    except RuntimeError as e:
        t = group_timeout(group)
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CollectiveError(
            f"{what} over the {describe_group(group)} failed on global rank {dist.get_rank()}: a "
            f"peer raised and stopped participating, died, or disagreed on sizes "
            f"(process-group timeout {'?' if t is None else f'{t:g}'} s). Backend said: {first}") from e


class Pending:
    """Work handles of collectives launched with ``async_op=True``."""

    def __init__(self):
        self.works: list = []
        self._alive: list = []  # inputs of in-flight collectives, kept alive until wait()
        self._then: list = []  # local work that needs the received data, run by wait()

    def then(self, fn) -> None:
        self._then.append(fn)

    def add(self, work, *tensors, what: str = "collective", group=None) -> None:
        if work is not None:
            self.works.append((work, what, group))
            self._alive.extend(tensors)

    def wait(self) -> None:
        works, self.works = self.works, []
        # Under grad mode, gloo's Work.wait() on torch 2.13 writes the result into the output with
        # an op autograd records (the output's grad_fn is replaced and its gradient is lost), so
        # wait without recording.
        with torch.no_grad():
            for w, what, group in works:
                guarded(what, group, w.wait)
            then, self._then = self._then, []
            for fn in then:
                fn()
        self._alive = []


def group_size(group) -> int:
    return dist.get_world_size(group)


_launch_hook = threading.local()


def on_launch(hook) -> None:
    """Set (or clear, with ``None``) this thread's launch hook: ``hook(what)`` is called each time
    a collective of this module is issued on this thread (before it is handed to the backend).
    :mod:`.overlap` uses it to record and order its pipeline."""
    _launch_hook.fn = hook


def _launched(what: str) -> None:
    fn = getattr(_launch_hook, "fn", None)
    if fn is not None:
        fn(what)


def _issue(what: str, group, pending: Optional[Pending], alive: Sequence[Tensor], call) -> None:
    """Issue the collective ``call(async_op)`` under :func:`guarded`: synchronous without
    ``pending``, else asynchronous with its work (and the tensors ``alive`` it reads or writes)
    added to ``pending``."""
    work = guarded(what, group, lambda: call(pending is not None))
    if pending is not None:
        pending.add(work, *alive, what=what, group=group)


def _a2a(x: Tensor, send: Sequence[int], recv: Sequence[int], group, pending: Optional[Pending],
         what: str = "all_to_all"):
    x = x.contiguous()
    _launched(what)
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    if group_size(group) == 1:
        out.copy_(x[: sum(send)])
        return out
    _issue(what, group, pending, (x,), lambda async_op: dist.all_to_all_single(
        out, x, list(recv), list(send), group=group, async_op=async_op))
    return out


def _all_gather(x: Tensor, group, pending: Optional[Pending], what: str = "all_gather"):
    x = x.contiguous()
    _launched(what)
    n = group_size(group)
    out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
    if n == 1:
        out.copy_(x)
        return out
    if x.numel() == 0:  # every member knows the global size is 0: nothing to move
        return out
    _issue(what, group, pending, (x,), lambda async_op: all_gather_raw(
        out, x, group=group, async_op=async_op))
    return out


def _reduce_scatter(x: Tensor, group, pending: Optional[Pending], what: str = "reduce_scatter"):
    x = x.contiguous()
    _launched(what)
    n = group_size(group)
    out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
    if n == 1:
        out.copy_(x)
        return out
    if x.numel() == 0:
        return out
    if dist.get_backend(group) == "gloo":
        # gloo's reduce_scatter moved about twice the optimal bytes (51.0 vs 34.0 MB per fwd+bwd
        # step on the emulated two-node link, bench/bench_ep_dispatcher.py --netns, see
        # docs/ops/ep_dispatcher.md), so on gloo: an all-to-all of the n chunks plus a local sum, which is
        # byte-optimal ((n-1)/n of the input per rank), sums in rank order (deterministic) and
        # accumulates in fp32 (fp64 for fp64) before rounding once.
        chunks = torch.empty_like(x)
        _issue(what, group, pending, (x, chunks), lambda async_op: dist.all_to_all_single(
            chunks, x, group=group, async_op=async_op))
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32

        def finish():
            with torch.no_grad():
                out.copy_(chunks.view((n,) + tuple(out.shape)).to(acc).sum(0))

        if pending is None:
            finish()
        else:
            pending.then(finish)
        return out
    _issue(what, group, pending, (x,), lambda async_op: reduce_scatter_raw(
        out, x, op=dist.ReduceOp.SUM, group=group, async_op=async_op))
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group, pending, what):
        ctx.send, ctx.recv, ctx.group, ctx.what = list(send), list(recv), group, what
        return _a2a(x, send, recv, group, pending, what)

    @staticmethod
    def backward(ctx, g):
        return (_a2a(g, ctx.recv, ctx.send, ctx.group, None, ctx.what + " (backward)"),
                None, None, None, None, None)


class _SlotsAllToAll(torch.autograd.Function):
    """One all-to-all for the per-row slot data of a hierarchical leg: the ``[R, K]`` int32 slot
    ids and (optionally) the ``[R, K]`` probs travel as the bytes of one uint8 buffer (a plain
    copy, no arithmetic, so both arrive bit-exact). Differentiable w.r.t. ``probs``: the backward
    is the reverse all-to-all of the probs gradient."""

    @staticmethod
    def forward(ctx, ids, probs, send, recv, group, pending, what):
        ctx.send, ctx.recv, ctx.group, ctx.what = list(send), list(recv), group, what
        R, K = ids.shape
        parts = [ids.to(torch.int32).contiguous().view(torch.uint8)]
        if probs is not None:
            parts.append(probs.contiguous().view(torch.uint8))
        buf = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        out = _a2a(buf, send, recv, group, pending, what)
        n = out.shape[0]
        ids_out = torch.empty((n, K), dtype=torch.int32, device=ids.device)
        probs_out = None if probs is None else torch.empty((n, K), dtype=probs.dtype,
                                                            device=probs.device)

        def unpack():
            if n == 0:
                return
            with torch.no_grad():
                ids_out.copy_(out[:, :4 * K].contiguous().view(torch.int32))
                if probs_out is not None:
                    probs_out.copy_(out[:, 4 * K:].contiguous().view(probs.dtype))

        if pending is None:
            unpack()
        else:
            pending.then(unpack)
        ctx.mark_non_differentiable(ids_out)
        return ids_out, probs_out

    @staticmethod
    def backward(ctx, g_ids, g_probs):
        gp = None
        if g_probs is not None:
            gp = _a2a(g_probs, ctx.recv, ctx.send, ctx.group, None, ctx.what + " (backward)")
        return None, gp, None, None, None, None, None


def all_to_all_slots(ids: Tensor, probs: Optional[Tensor], send_splits: Sequence[int],
                     recv_splits: Sequence[int], group=None, *, pending: Optional[Pending] = None,
                     what: str = "all_to_all of slots"):
    """``(ids [R', K] int32, probs [R', K] or None)``: both moved by one all-to-all (see
    :class:`_SlotsAllToAll`); with ``pending`` the outputs are valid after ``pending.wait()``."""
    if probs is None:
        return _a2a(ids.to(torch.int32), send_splits, recv_splits, group, pending, what), None
    return _SlotsAllToAll.apply(ids, probs, list(send_splits), list(recv_splits), group, pending, what)


class _AllGather(torch.autograd.Function):
    """All-gathers several tensors (same leading size) in one autograd node, so their backward
    reduce-scatters run in a fixed order on every rank."""

    @staticmethod
    def forward(ctx, group, pending, what, *xs):
        ctx.group, ctx.what = group, what
        return tuple(_all_gather(x, group, pending, what) for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        return (None, None, None) + tuple(_reduce_scatter(g, ctx.group, None, ctx.what + " (backward)")
                                          for g in gs)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, pending, what):
        ctx.group, ctx.what = group, what
        return _reduce_scatter(x, group, pending, what)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, None, ctx.what + " (backward)"), None, None, None


def all_to_all(x: Tensor, send_splits: Sequence[int], recv_splits: Sequence[int], group=None, *,
               pending: Optional[Pending] = None, debug: bool = False,
               what: str = "all_to_all") -> Tensor:
    """Differentiable ``all_to_all_single`` over dim 0 with uneven splits.

    ``send_splits[j]`` rows of ``x`` (in order) go to rank ``j`` of ``group``; ``recv_splits[j]``
    rows arrive from rank ``j``. With ``debug=True`` the split sizes are first exchanged and
    cross-checked (a mismatch raises :class:`SplitMismatchError` on every rank instead of silently
    corrupting data). A failure or timeout of the collective raises :class:`CollectiveError`
    naming ``what`` and the group.
    """
    if debug:
        check_splits(send_splits, recv_splits, group, rows_available=x.shape[0], what=what)
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group, pending, what)


def all_gather(xs: Sequence[Tensor], group=None, *, pending: Optional[Pending] = None,
               what: str = "all_gather") -> List[Tensor]:
    """Differentiable all-gather (concatenated along dim 0) of every tensor in ``xs``."""
    return list(_AllGather.apply(group, pending, what, *xs))


def reduce_scatter(x: Tensor, group=None, *, pending: Optional[Pending] = None,
                   what: str = "reduce_scatter") -> Tensor:
    """Differentiable sum reduce-scatter along dim 0 (``x.shape[0]`` divisible by the group size)."""
    return _ReduceScatter.apply(x, group, pending, what)


def gather_ints(values: Tensor, group, what: str, device=None) -> Tensor:
    """Collective: all-gather a 1-D int64 tensor (same length on every rank) -> ``[n, len]`` on
    the CPU. Failures raise :class:`CollectiveError` naming ``what``."""
    n = group_size(group)
    _launched(what)
    mine = values.to(device=device or values.device, dtype=torch.int64).contiguous()
    everyone = torch.empty(n * mine.numel(), dtype=torch.int64, device=mine.device)
    if n > 1 and mine.numel() > 0:  # (the length is the same on every member)
        guarded(what, group, lambda: all_gather_raw(everyone, mine, group=group))
    else:
        everyone.copy_(mine)
    return everyone.view(n, mine.numel()).cpu()


class SplitMismatchError(RuntimeError):
    """Raised (on every rank) by the debug checks when ranks disagree."""


def check_splits(send_splits: Sequence[int], recv_splits: Sequence[int], group=None, *,
                 rows_available: Optional[int] = None, what: str = "all_to_all") -> None:
    """Collective: all-gather every rank's send/recv splits and verify that what rank ``i`` sends
    to ``j`` is what ``j`` expects from ``i``. Every rank raises the same error on a mismatch."""
    n = group_size(group)
    if len(send_splits) != n or len(recv_splits) != n:
        bad = torch.tensor([1], dtype=torch.int64)
    else:
        bad = torch.tensor([0], dtype=torch.int64)
    mine = torch.tensor(list(send_splits)[:n] + [0] * (n - len(send_splits)) +
                        list(recv_splits)[:n] + [0] * (n - len(recv_splits)) +
                        [int(bad), -1 if rows_available is None else rows_available],
                        dtype=torch.int64)
    table = gather_ints(mine, group, f"split check of {what}")
    send, recv = table[:, :n], table[:, n:2 * n]
    problems = []
    for i in range(n):
        if table[i, 2 * n]:
            problems.append(f"rank {i} of the group passed {len(send_splits)} send / "
                            f"{len(recv_splits)} recv splits for a group of size {n}")
        avail = int(table[i, 2 * n + 1])
        if avail >= 0 and int(send[i].sum()) > avail:
            problems.append(f"rank {i} sends {int(send[i].sum())} rows but its input has {avail}")
    mism = torch.nonzero(send != recv.t())
    for i, j in mism.tolist()[:8]:
        problems.append(f"rank {i} sends {int(send[i, j])} rows to rank {j}, which expects "
                        f"{int(recv[j, i])}")
    if problems:
        raise SplitMismatchError(f"split sizes of {what} disagree between ranks (group ranks): "
                                 + "; ".join(problems))
