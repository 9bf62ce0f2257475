"""``EPTopology``: the expert-parallel group seen as ``nodes x local_size`` ranks.

EP rank ``r`` (its rank inside the EP group) sits on node ``r // local_size`` at local index
``r % local_size``. Two families of subgroups are built once:

* ``intra_group``: the ``local_size`` ranks of this rank's node (fast links: HCCS / NVLink / the
  namespace loopback in the emulation);
* ``inter_group``: the ``nodes`` ranks that share this rank's local index, one per node (the slow
  inter-node links).

Rank numbering follows the usual launcher convention (``torchrun``, ``msrun``): consecutive ranks
share a node. If your launcher numbers ranks differently, build an EP group whose rank order has
that property and pass it as ``group``.
"""

from __future__ import annotations

import datetime
from typing import List, Optional, Union

import torch
import torch.distributed as dist

from ._autograd import gather_ints, group_timeout


class EPTopology:
    """Split an expert-parallel process group into nodes.

    Args:
        group: the EP process group; ``None`` = the default (world) group.
        local_size: ranks per node ``G``. ``None`` reads ``LOCAL_WORLD_SIZE`` from the environment
            (set by ``torchrun``), else assumes one node.
        timeout: timeout of the subgroups' collectives (seconds or a ``timedelta``). ``None`` =
            the EP group's own timeout (``init_process_group(timeout=...)``), so a peer that fails
            or dies makes the hierarchical collectives raise after the same time as the flat
            ones. (``new_group`` without a timeout would use the 30-minute default.)

    Construction is collective. With ``group=None`` every rank of the world must construct the
    topology at the same point (it calls ``torch.distributed.new_group`` for every subgroup, in the
    same order on every rank). With an explicit ``group`` only that group's members construct it;
    the subgroups are then created with ``use_local_synchronization=True``.

    Attributes:
        world_size, rank: size of the EP group and this process's rank inside it.
        local_size, num_nodes, node, local_rank: the ``nodes x local_size`` split.
        ranks: global ranks of the EP group, in EP-rank order.
        group, intra_group, inter_group: process groups (``None`` means the default group for
            ``group``; the subgroups are always explicit objects).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, local_size: Optional[int] = None,
                 *, timeout: Union[None, float, datetime.timedelta] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("EPTopology needs torch.distributed to be initialized "
                               "(call torch.distributed.init_process_group first)")
        self.group = group
        if group is None or group is dist.group.WORLD:
            self.ranks: List[int] = list(range(dist.get_world_size()))
        else:
            self.ranks = list(dist.get_process_group_ranks(group))
        self.world_size = len(self.ranks)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the EP group passed to EPTopology")
        if local_size is None:
            import os
            local_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"local_size must be a positive int, got {local_size!r}")
        if self.world_size % local_size:
            raise ValueError(f"the EP group has {self.world_size} ranks, which is not divisible by "
                             f"local_size={local_size} (ranks per node)")
        self.local_size = local_size
        self.num_nodes = self.world_size // local_size
        self.node = self.rank // local_size
        self.local_rank = self.rank % local_size

        G, N = local_size, self.num_nodes
        world = group is None or group is dist.group.WORLD
        if timeout is None:
            t = group_timeout(group)
            timeout = None if t is None else datetime.timedelta(seconds=t)
        elif not isinstance(timeout, datetime.timedelta):
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
                raise ValueError(f"timeout must be a positive number of seconds or a timedelta, "
                                 f"got {timeout!r}")
            timeout = datetime.timedelta(seconds=timeout)
        self.timeout = timeout
        # Every rank must split the group the same way, or the subgroups below never form (each rank
        # would wait in new_group for peers creating other groups, until the store timeout): one
        # all-gather of this rank's local_size first, a ValueError on every rank if they disagree.
        sizes = gather_ints(torch.tensor([local_size]), group, "EPTopology: local_size exchange",
                            device=self.collective_device())[:, 0].tolist()
        if any(v != sizes[0] for v in sizes):
            raise ValueError(f"EPTopology: the ranks of the group disagree on local_size (ranks per node): "
                             f"per-rank values {sizes}; pass the same local_size (or LOCAL_WORLD_SIZE) on every rank")

        def subgroup(members, mine):
            # with the world group every rank creates every subgroup, in the same order;
            # with an explicit EP group only the members of each subgroup create it
            if world:
                pg = dist.new_group(members, timeout=timeout)
                return pg if mine else None
            return (dist.new_group(members, timeout=timeout, use_local_synchronization=True)
                    if mine else None)

        # Same creation order on every rank: all intra-node groups, then all inter-node groups.
        intra = [subgroup([self.ranks[n * G + i] for i in range(G)], n == self.node) for n in range(N)]
        inter = [subgroup([self.ranks[n * G + i] for n in range(N)], i == self.local_rank)
                 for i in range(G)]
        self.intra_group = intra[self.node]
        self.inter_group = inter[self.local_rank]

    def collective_device(self) -> torch.device:
        """Where the group's small metadata collectives run: the current CUDA device under NCCL, the
        current NPU under HCCL (torch_npu), else the CPU (gloo)."""
        backend = dist.get_backend(self.group)
        if backend == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if backend == "hccl":  # torch_npu
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        return torch.device("cpu")

    def node_of(self, ep_rank: int) -> int:
        return ep_rank // self.local_size

    def __repr__(self) -> str:
        return (f"EPTopology(world_size={self.world_size}, nodes={self.num_nodes}, "
                f"local_size={self.local_size}, rank={self.rank})")
