"""Ranks partitioned into groups: the one place for rank / group arithmetic.

A *group* is an NVLink domain (by default one host). Ranks are ``0..N-1``; groups are tuples of ranks,
ascending, ordered by their lowest rank; a rank's *position* is its index inside its group. The ranks
at the same position of every group form a *replica group*: they hold copies of the same warm shard.
The probe, the cost model (through :class:`topology.views.ClusterView`) and the runtime all use
:class:`RankLayout`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from core.errors import ConfigError
from core.vocabulary import LinkClass


@dataclass(frozen=True)
class RankLayout:
    """Ranks ``0..N-1`` in groups. Build with :meth:`of`, :meth:`consecutive` or :meth:`by_host`."""

    groups: tuple[tuple[int, ...], ...]
    group_of_rank: np.ndarray = field(repr=False)  # int64[N]: group index 0..G-1
    position_of_rank: np.ndarray = field(repr=False)  # int64[N]: index inside the group

    @classmethod
    def of(
        cls, groups: Sequence[Sequence[int]], world_size: int | None = None, what: str = "groups"
    ) -> RankLayout:
        """The layout of ``groups``, which must cover ranks ``0..world_size-1`` exactly once (``world_size``
        defaults to the number of ranks listed). Members are sorted; groups are ordered by their lowest
        rank. Raises :class:`~core.errors.ConfigError` naming ``what``."""
        try:
            members = [sorted(int(r) for r in g) for g in groups]
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: {groups!r} is not a list of lists of ranks") from None
        members = sorted((g for g in members if g), key=lambda g: g[0])
        flat = sorted(r for g in members for r in g)
        n = len(flat) if world_size is None else int(world_size)
        if not members or flat != list(range(n)):
            raise ConfigError(f"{what}: {[list(g) for g in groups]} must cover ranks 0..{n - 1} exactly once")
        group_of = np.empty(n, dtype=np.int64)
        position = np.empty(n, dtype=np.int64)
        for k, g in enumerate(members):
            group_of[g] = k
            position[g] = np.arange(len(g))
        return cls(tuple(tuple(g) for g in members), group_of, position)

    @classmethod
    def consecutive(cls, world_size: int, num_groups: int, what: str = "groups") -> RankLayout:
        """``num_groups`` groups of ``world_size / num_groups`` consecutive ranks (several nodes emulated
        on one host); the number of groups must divide the world size."""
        if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups <= 0:
            raise ConfigError(f"{what}: {num_groups!r}; expected a positive number of groups")
        if world_size <= 0 or world_size % num_groups:
            raise ConfigError(
                f"{what}: {num_groups} groups do not divide {world_size} ranks evenly; choose a divisor"
            )
        g = world_size // num_groups
        return cls.of([range(k * g, (k + 1) * g) for k in range(num_groups)], world_size, what)

    @classmethod
    def by_host(cls, hosts: Sequence[str]) -> RankLayout:
        """One group per host name (``hosts[r]``: the host of rank r)."""
        members: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            members.setdefault(host, []).append(rank)
        return cls.of(list(members.values()), len(hosts))

    @classmethod
    def single(cls, world_size: int) -> RankLayout:
        """All ranks in one group."""
        return cls.consecutive(world_size, 1)

    # --- sizes -------------------------------------------------------------------------------------

    @property
    def num_ranks(self) -> int:
        return int(self.group_of_rank.size)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_sizes(self) -> np.ndarray:
        """int64[G]: ranks per group."""
        return np.array([len(g) for g in self.groups], dtype=np.int64)

    @property
    def uniform_group_size(self) -> int | None:
        """The common group size, or None when groups differ in size."""
        sizes = {len(g) for g in self.groups}
        return sizes.pop() if len(sizes) == 1 else None

    def group_size_of_rank(self) -> np.ndarray:
        """int64[N]: the size of each rank's group."""
        return self.group_sizes[self.group_of_rank]

    # --- relations ---------------------------------------------------------------------------------

    def group_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group."""
        return self.groups[int(self.group_of_rank[rank])]

    def same_group(self, rank: int) -> np.ndarray:
        """bool[N]: which ranks are in ``rank``'s group (``rank`` included)."""
        return self.group_of_rank == self.group_of_rank[rank]

    def replica_groups(self, min_size: int = 2) -> list[list[int]]:
        """The ranks at each position of every group that has it (those of at least ``min_size`` ranks):
        the copies of one warm shard, all-reduced together."""
        depth = max(len(g) for g in self.groups)
        out = [[g[j] for g in self.groups if j < len(g)] for j in range(depth)]
        return [r for r in out if len(r) >= min_size]

    def replica_group_of(self, rank: int) -> list[int]:
        """The ranks at ``rank``'s position in every group (``rank`` included)."""
        pos = int(self.position_of_rank[rank])
        return [g[pos] for g in self.groups if pos < len(g)]

    def link_class(self, a: int | np.ndarray, b: int | np.ndarray) -> np.ndarray:
        """:class:`LinkClass` values (as int64) of the path between ranks ``a`` and ``b`` (broadcast)."""
        same = self.group_of_rank[np.asarray(a)] == self.group_of_rank[np.asarray(b)]
        return np.where(same, int(LinkClass.INTRA_GROUP), int(LinkClass.INTER_GROUP)).astype(np.int64)

    def peers_by_link(self) -> np.ndarray:
        """int64[N, 2]: each rank's number of other ranks in its group and outside it."""
        g = self.group_size_of_rank()
        return np.stack([g - 1, self.num_ranks - g], axis=1)

    # --- identity ----------------------------------------------------------------------------------

    def to_lists(self) -> list[list[int]]:
        return [list(g) for g in self.groups]

    def fingerprint(self) -> str:
        """sha256 (hex) of the world size and the groups: what a plan's owner map depends on."""
        text = json.dumps({"world_size": self.num_ranks, "groups": self.to_lists()}, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RankLayout) and self.groups == other.groups

    def __hash__(self) -> int:
        return hash(self.groups)


BACKEND_ENV = "FLEXSHARD_BACKEND"  # the process group's backend: auto (default), gloo or nccl
BACKENDS = ("auto", "gloo", "nccl")


def pick_backend(asked: str | None, cuda: bool) -> str:
    """The backend for a job: ``asked`` (``FLEXSHARD_BACKEND``; None or "auto": NCCL where CUDA is
    available, else gloo). ConfigError for another name, or NCCL without CUDA."""
    asked = asked or "auto"
    if asked not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}: {asked!r} is not a backend; choose from {', '.join(BACKENDS)}")
    if asked == "nccl" and not cuda:
        raise ConfigError(f"{BACKEND_ENV}: 'nccl' needs CUDA, which this process cannot see; use gloo")
    return ("nccl" if cuda else "gloo") if asked == "auto" else asked


def launcher_gpu(gpus: int, default_local_rank: int = 0) -> int:
    """:func:`local_gpu` from the launcher's ``LOCAL_RANK`` (else ``default_local_rank``) and
    ``LOCAL_WORLD_SIZE`` (else just enough processes for that rank)."""
    local = int(os.environ.get("LOCAL_RANK", default_local_rank))
    return local_gpu(local, int(os.environ.get("LOCAL_WORLD_SIZE", local + 1)), gpus)


def local_gpu(local_rank: int, local_world: int, gpus: int) -> int:
    """The CUDA device of the process at ``local_rank`` of the ``local_world`` processes on this host
    (NCCL: one GPU per process). :class:`~core.errors.ConfigError` when they outnumber the host's
    ``gpus``: NCCL refuses two ranks on one GPU, and a device index past the last is CUDA's bare
    'invalid device ordinal'."""
    if local_world > gpus or not 0 <= local_rank < gpus:
        raise ConfigError(
            f"{max(local_world, local_rank + 1)} processes on this host but {gpus} CUDA GPU(s): NCCL needs "
            f"one GPU per process; launch at most {gpus} per host (--nproc-per-node {gpus}), or run on the "
            f"CPU with gloo ({BACKEND_ENV}=gloo)"
        )
    return local_rank
