"""Process groups of a plan: the global group, one group per NVLink domain and one replica group per
position inside a group (the ranks holding copies of the same warm shard)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from core.ranks import RankLayout


@dataclass
class ProcessGroups:
    """This rank's process groups for a :class:`~core.ranks.RankLayout`."""

    rank: int
    layout: RankLayout
    intra: object  # process group of this rank's group
    intra_ranks: list[int]  # global ranks of ``intra`` in group-rank order
    replica: object | None  # process group of the ranks at this rank's position in every group
    replica_ranks: list[int]

    @property
    def groups(self) -> list[list[int]]:
        """Ranks of each group, as lists (the checkpoint manifest's spelling)."""
        return self.layout.to_lists()

    @property
    def group(self) -> int:
        return int(self.layout.group_of_rank[self.rank])

    @property
    def position(self) -> int:
        return int(self.layout.position_of_rank[self.rank])

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups


def make_process_groups(layout: RankLayout, timeout: timedelta | None = None) -> ProcessGroups:
    """Create the intra-group and replica process groups (collective: every rank calls it with the same
    ``layout``, so groups are created in the same order everywhere). Replica groups exist only when the
    groups have equal size (warm rows need it). ``timeout``: how long a collective on them waits for a
    peer before it fails (None: torch's default, which subgroups do not inherit from the job's)."""
    rank = dist.get_rank()
    intra = intra_ranks = None
    for members in layout.groups:
        pg = dist.new_group(ranks=list(members), timeout=timeout)
        if rank in members:
            intra, intra_ranks = pg, dist.get_process_group_ranks(pg)
    replica, replica_ranks = None, [rank]
    if layout.uniform_group_size is not None:
        for members in layout.replica_groups(min_size=1):
            pg = dist.new_group(ranks=members, timeout=timeout)
            if rank in members:
                replica, replica_ranks = pg, dist.get_process_group_ranks(pg)
    return ProcessGroups(rank, layout, intra, intra_ranks, replica, replica_ranks)
