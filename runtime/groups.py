"""Process groups over a pipeline's program ranks, made so that every process agrees on them.

torch names a group created with `use_local_synchronization=True` after its members *and the
number of groups the calling process already belongs to*; two processes whose histories
differ (one joined more groups than the other, e.g. replica groups of an earlier pipeline)
then disagree on the name and wait for each other forever.  So groups are made
world-collectively — every process calls `new_group` for every group, in one order — whenever
the layout of every pipeline is known: the world is one pipeline, or a `ParallelMesh` lays
out all of them (its pipelines are the columns of the mesh at each dp and tp coordinate).
Only a user's own sub-group, whose sibling pipelines are unknown, falls back to local
synchronisation among the members.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pipedsl.parallel.mesh import ParallelMesh, backend_device_type


def timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """`group`'s timeout (the launcher's), for the groups made from it; None where torch does not say.  Read from
    the backend of the group's device: NCCL's is CUDA's (asked for the CPU's, it had none, and the groups made
    on NCCL took torch's default instead of the launcher's)."""
    with contextlib.suppress(AttributeError, RuntimeError):  # older torch: the default timeout
        return group._get_backend(torch.device(backend_device_type(group))).options._timeout
    return None


class PipelineGroups:
    """Makes the groups a pipeline needs (messages, replicas, ties) from program ranks."""

    def __init__(self, group: dist.ProcessGroup | None, mesh: ParallelMesh | None = None) -> None:
        self.group = group
        self.mesh = mesh
        self.whole = group is None or group is dist.group.WORLD
        self.members = dist.get_process_group_ranks(group) if not self.whole else list(range(dist.get_world_size()))
        self.me = dist.get_rank()
        self.made: list[dist.ProcessGroup] = []  # the groups this process is a member of, for close()
        self.timeout = timeout_of(group if not self.whole else dist.group.WORLD)

    def everywhere(self, flag: bool) -> bool:
        """Whether `flag` holds on every process that makes groups together with this one (the world when groups
        are world-collective, else this pipeline's members): a choice that decides which groups to make must be
        the same on all of them.  Collective over those processes."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=None if (self.whole or self.mesh is not None) else self.group)
        return bool(int(t))

    def global_rank(self, rank: int) -> int:
        """The global rank of program rank `rank` of this pipeline."""
        return self.members[rank]

    def source_rank(self, rank: int) -> int:
        """The global rank of program rank `rank` in data-parallel replica 0 (this rank's tp coordinate)."""
        if self.mesh is None:
            return self.global_rank(rank)
        grid, tail = self._grid()
        return int(grid[(rank, 0, *tail)])

    def new(self, ranks: Sequence[int], across_dp: bool = False,
            backend: str | None = None) -> dist.ProcessGroup | None:
        """The group of program ranks `ranks` of this pipeline — with `across_dp`, of every data-parallel
        replica's pipeline at this tp coordinate — or None where this process is not a member.  `backend`: the
        world's unless named ("gloo": host tensors under NCCL).
        Collective: every process calls it with the same arguments, in the same order."""
        ranks = sorted(ranks)
        if self.mesh is not None:
            return self._new_on_mesh(ranks, across_dp, backend)
        members = [self.members[r] for r in ranks]
        if self.whole:
            group = dist.new_group(members, timeout=self.timeout, backend=backend)
            return self._keep(group) if self.me in members else None
        if self.me not in members:
            return None
        return self._keep(dist.new_group(members, timeout=self.timeout, backend=backend,
                                         use_local_synchronization=True))

    def close(self) -> None:
        """Destroys every group made here: each gloo group keeps threads and sockets until then."""
        from torch.distributed import distributed_c10d as c10d

        made, self.made = self.made, []
        for group in made:
            if group in c10d._world.pg_map:  # not already gone with the whole world
                dist.destroy_process_group(group)

    def _keep(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        self.made.append(group)
        return group

    def _grid(self) -> tuple[torch.Tensor, tuple[int, ...]]:
        """Global ranks [pp, dp, *tp] and this rank's tp part.  Expert parallelism's mesh is (pp, edp, ep, *tp):
        its two dp dimensions are merged, dp = edp·ep + ep rank as `ParallelMesh.coords` counts it, so "every dp
        replica" means all of them (a tie's group spanned only the edp replicas at this ep rank)."""
        assert self.mesh is not None
        mesh = self.mesh.device_mesh
        grid, coordinate = mesh.mesh, list(mesh.get_coordinate())
        if self.mesh.config.ep > 1:
            grid = grid.reshape(grid.shape[0], grid.shape[1] * grid.shape[2], *grid.shape[3:])
            coordinate = [coordinate[0], coordinate[1] * self.mesh.config.ep + coordinate[2], *coordinate[3:]]
        return grid, tuple(coordinate[2:])

    def _new_on_mesh(self, ranks: list[int], across_dp: bool, backend: str | None) -> dist.ProcessGroup | None:
        grid, _ = self._grid()
        mine = None
        tails = list(itertools.product(*(range(n) for n in grid.shape[2:])))
        columns = [(slice(None), *t) for t in tails] if across_dp else \
            [(d, *t) for d in range(grid.shape[1]) for t in tails]
        for col in columns:  # every pipeline's group, on every process, in one order
            members = sorted(int(x) for x in grid[ranks][(slice(None), *col)].flatten())
            group = dist.new_group(members, timeout=self.timeout, backend=backend)
            if self.me in members:
                mine = self._keep(group)
        return mine
