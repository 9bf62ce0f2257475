"""Expert-parallel communication on ``torch.distributed`` (HCCL, NCCL, gloo): not dispatcher ops.

* :class:`EPTopology` splits the EP group into ``nodes x local_size`` with intra-/inter-node groups;
* :class:`MoEDispatcher` dispatches tokens to expert ranks and combines the results, with a flat
  all-to-all, the node-deduplicated hierarchical scheme (default hierarchical mode) or the
  AllGather hierarchical scheme;
* :func:`all_to_all`, :func:`all_gather`, :func:`reduce_scatter`: the differentiable collectives
  it is built from; :func:`check_splits` the debug cross-check of split sizes;
* :func:`moe_forward_overlapped`: the chunked dispatch -> experts -> combine pipeline that
  overlaps communication with expert compute (forward and backward).
"""

from ._autograd import CollectiveError, Pending, SplitMismatchError, all_gather, all_to_all, check_splits, reduce_scatter
from .dispatcher import DispatchHandle, MoEDispatcher, PendingCombine, PendingDispatch
from .overlap import moe_forward_overlapped
from .topology import EPTopology

__all__ = ["EPTopology", "MoEDispatcher", "DispatchHandle", "PendingDispatch", "PendingCombine",
           "Pending", "SplitMismatchError", "CollectiveError", "all_to_all", "all_gather", "reduce_scatter",
           "check_splits", "moe_forward_overlapped"]
