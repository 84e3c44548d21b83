"""Where a FlexShardSharder's plan comes from: a plan file (``flexshard plan``), or row statistics and the
job's topology, planned on rank 0 when the module is sharded and broadcast to every rank.

The plan covers one ``EmbeddingCollection``: its tables, in the collection's order. A stats file's tables
the collection does not have are left out; its tables are planned at the collection's dims (a stats
file's dim is a parameter of ``flexshard stats``, not a property of the data).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import networkx as nx
import numpy as np
import torch.distributed as dist

from core.errors import ConfigError, PlanMismatchError
from core.ranks import RankLayout
from flexshard.plan_file import PlanFile, read_plan, to_dict
from flexshard.training.planning import broadcast_plan
from flexshard.workloads import fingerprint, load_stats
from solvers.optimizer import OptimizerConfig
from solvers.planner import budget_bytes, make_plan
from solvers.types import Workload
from topology.io import load_topology
from topology.presets import h100_cluster
from topology.views import cluster_view

OBJECTIVES = ("step", "bytes")


@dataclass(frozen=True)
class PlanSource:
    """A plan file (``plan``: a :class:`PlanFile` or its path) or statistics to plan from (``stats``: a
    :class:`Workload` or a stats file path; ``topology``: a graph, topology JSON path or preset such as
    ``"h100:2x4"``, default H100-class hosts of ``groups`` NVLink groups of consecutive ranks), with
    ``strategy``, ``budget`` (times row-wise memory), ``dedup`` and ``objective`` (``"step"``, the modeled
    step time as ``flexshard plan``; ``"bytes"``). ``orders``: each table's hotness order (touched ids
    hottest first); default the stats file's."""

    plan: PlanFile | str | os.PathLike | None = None
    stats: Workload | str | os.PathLike | None = None
    topology: nx.Graph | str | os.PathLike | None = None
    groups: int = 1
    strategy: str = "flexshard"
    budget: float = 2.0
    dedup: bool = True
    objective: str = "step"
    orders: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        if (self.plan is None) == (self.stats is None):
            raise ConfigError(
                "FlexShardSharder: give exactly one of plan (a plan file) or stats (row statistics)"
            )
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"objective: must be one of {OBJECTIVES}, got {self.objective!r}")

    def resolve(self, tables: list[tuple[str, int, int]]) -> tuple[PlanFile, dict[str, np.ndarray] | None]:
        """(the plan for ``tables`` (``(name, rows, dim)``, the collection's order), the hotness orders).
        Made on rank 0 and broadcast when planning from statistics (collective)."""
        if self.plan is not None:
            plan_file = self.plan if isinstance(self.plan, PlanFile) else read_plan(self.plan)
            return plan_file, self.orders
        workload, orders = self.stats, self.orders
        if not isinstance(workload, Workload):
            workload, file_orders = load_stats(workload)
            orders = file_orders if orders is None else orders
        workload = _restricted(workload, tables)
        orders = {n: o for n, o in (orders or {}).items() if n in {t[0] for t in tables}} or None
        world = dist.get_world_size()

        def document() -> dict:
            if self.topology is None:
                layout = RankLayout.consecutive(world, self.groups, "groups")
                view = cluster_view(h100_cluster(layout.num_groups, world // layout.num_groups))
            else:
                view = cluster_view(load_topology(self.topology))
            planned = make_plan(
                self.strategy,
                workload,
                view,
                budget_bytes(workload, view, self.budget),
                self.dedup,
                config=OptimizerConfig(step_time=self.objective == "step"),
            )
            return to_dict(planned.plan, workload, view, planned.report, fingerprint(workload), orders)

        return broadcast_plan(document, dist.get_rank()), orders


def _restricted(workload: Workload, tables: list[tuple[str, int, int]]) -> Workload:
    """The workload's specs of ``tables`` in their order, at their dims; PlanMismatchError naming a table
    the statistics lack."""
    specs = {t.name: t for t in workload.tables}
    missing = [name for name, _rows, _dim in tables if name not in specs]
    if missing:
        raise PlanMismatchError(
            f"stats: no table {missing[0]!r} in workload {workload.name!r} (tables {sorted(specs)}): run "
            "flexshard stats over the collection's tables"
        )
    picked = tuple(dataclasses.replace(specs[name], dim=int(dim)) for name, _rows, dim in tables)
    return dataclasses.replace(workload, tables=picked)
