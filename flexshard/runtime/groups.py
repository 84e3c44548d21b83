"""Process groups of a plan: the global group, one group per NVLink domain and one replica group per
position inside a group (the ranks holding copies of the same warm shard)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.distributed as dist


def emulated_groups(world_size: int, num_groups: int) -> list[list[int]]:
    """``num_groups`` groups of ``world_size / num_groups`` consecutive ranks (``--groups G`` on one host)."""
    if num_groups <= 0 or world_size % num_groups:
        raise ValueError(f"groups: {num_groups} groups do not divide world size {world_size} evenly")
    g = world_size // num_groups
    return [list(range(k * g, (k + 1) * g)) for k in range(num_groups)]


def check_groups(groups: list[list[int]], world_size: int) -> None:
    flat = sorted(r for grp in groups for r in grp)
    if flat != list(range(world_size)):
        raise ValueError(f"groups: {groups} do not partition ranks 0..{world_size - 1}")


@dataclass
class ProcessGroups:
    """This rank's view of the plan's groups."""

    rank: int
    world_size: int
    groups: list[list[int]]
    group_of_rank: np.ndarray  # int64[N]
    position_of_rank: np.ndarray  # int64[N]
    intra: object  # process group of this rank's group
    intra_ranks: list[int]  # global ranks of ``intra`` in group-rank order
    replica: object | None  # process group of the ranks at this rank's position in every group
    replica_ranks: list[int]

    @property
    def group(self) -> int:
        return int(self.group_of_rank[self.rank])

    @property
    def position(self) -> int:
        return int(self.position_of_rank[self.rank])

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def uniform(self) -> bool:
        return len({len(g) for g in self.groups}) == 1


def make_process_groups(groups: list[list[int]]) -> ProcessGroups:
    """Create the intra-group and replica process groups (collective: every rank calls it with the
    same ``groups``; groups are created in the same order everywhere)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    check_groups(groups, world)
    group_of = np.empty(world, dtype=np.int64)
    position = np.empty(world, dtype=np.int64)
    for k, members in enumerate(groups):
        group_of[members] = k
        position[members] = np.arange(len(members))
    intra = intra_ranks = None
    for members in groups:
        pg = dist.new_group(ranks=list(members))
        if rank in members:
            intra = pg
            intra_ranks = dist.get_process_group_ranks(pg)
    replica, replica_ranks = None, [rank]
    if len({len(g) for g in groups}) == 1:
        for p in range(len(groups[0])):
            members = [grp[p] for grp in groups]
            pg = dist.new_group(ranks=members)
            if rank in members:
                replica = pg
                replica_ranks = dist.get_process_group_ranks(pg)
    return ProcessGroups(rank, world, groups, group_of, position, intra, intra_ranks, replica, replica_ranks)
