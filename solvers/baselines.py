"""Baseline sharding strategies, expressed as tier plans so one cost model prices them all.

* ``table_wise``: each table whole on one GPU (greedy, heaviest table to the least loaded GPU);
* ``row_wise``: every table's ids split over all GPUs in contiguous ranges, as TorchRec's row-wise
  sequence sharding lays them out (with dedup off, TorchRec's default; :mod:`solvers.torchrec_default`),
  priced on the table's real ids (its hotness order): where ids follow popularity, the first GPU owns
  the head. Synthetic tables have no real ids (their rows are numbered hottest first only for
  convenience): they are priced at the expected slowest rank over uniformly random id orders;
* ``row_wise_group_dedup``: row-wise, each row fetched once per group that looks it up;
* ``2d``: TorchRec-style 2D: a table's rows split inside each group and the table replicated
  across groups, for the tables the budget allows (greedy by time saved per byte), the rest row-wise;
* ``hybrid``: HugeCTR-style hybrid embedding: rows whose expected accesses per iteration reach
  HugeCTR's bandwidth-ratio count threshold are replicated on every GPU (hottest first while the
  budget allows), the rest row-wise;
* ``data_parallel``: whole tables replicated on every GPU where that saves time and fits, the rest
  row-wise.

All baselines use the same dedup and sync settings as the FlexShard plan they are compared with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from core.errors import PlannerError
from core.vocabulary import Deal, FetchMode, SyncMode, Tier
from solvers.coefficients import TableCoefficients, table_coefficients
from solvers.cost_model import evaluate, table_plan, uniform_shares
from solvers.types import ROUTING_BYTES_PER_REPLICATED_ROW, CostReport, Plan, TablePlan, TableSpec, Workload
from topology.views import ClusterView


def row_wise_table(table: TableSpec, view: ClusterView) -> TablePlan:
    """TorchRec's row-wise layout of one table: its ids in contiguous ranges of ``ceil(rows / N)``
    (:attr:`core.vocabulary.Deal.RANGES`), priced from its hotness order (the real ids), or for a table
    without one (synthetic: its ids carry no meaning) over uniformly random id orders."""
    return replace(table_plan(table, view, 0, 0), deal=Deal.RANGES)


def row_wise(workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode) -> Plan:
    tables = tuple(row_wise_table(t, view) for t in workload.tables)
    return _checked(Plan("row_wise", tables, dedup, sync, budget_bytes), workload, view, budget_bytes)


def torchrec_default_report(workload: Workload, view: ClusterView, dedup: bool = False) -> CostReport:
    """TorchRec's default (row-wise, dedup off, flat fetch) priced once, as every figure states it: the
    slowest rank of contiguous ranges of the ids as given, or over random id orders for tables without
    one (:mod:`solvers.torchrec_default`). ``evaluate(..., dealt=False)`` of the same plan is its even
    share (each rank's expected load)."""
    return evaluate(workload, view, row_wise(workload, view, float("inf"), dedup, SyncMode.SPARSE))


def row_wise_group_dedup(
    workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode
) -> Plan:
    """Row-wise with the group-level exchange: every row cold, fetched once per group that looks it up
    (ids gathered and deduplicated in the group, across the fabric between rail peers). Plain row-wise
    where the groups differ in size or there is only one."""
    fetch = FetchMode.GROUP if view.num_groups > 1 and view.uniform_group_size is not None else FetchMode.FLAT
    tables = tuple(table_plan(t, view, 0, 0, fetch) for t in workload.tables)
    plan = Plan("row_wise_group_dedup", tables, dedup, sync, budget_bytes)
    return _checked(plan, workload, view, budget_bytes)


def table_wise(
    workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode
) -> Plan:
    """Longest-processing-time greedy: heaviest table first, onto the GPU with the least load that fits."""
    n = view.num_ranks
    coeffs = table_coefficients(workload, view, dedup, sync)
    load = np.array([c.time_s[Tier.COLD].sum() for c in coeffs])
    size = np.array([t.num_rows * t.row_bytes for t in workload.tables], dtype=np.float64)
    rank_load, rank_mem = np.zeros(n), np.zeros(n)
    owner = np.empty(len(workload.tables), dtype=np.int64)
    for i in np.argsort(-load, kind="stable"):
        fits = rank_mem + size[i] <= budget_bytes
        if not fits.any():
            t = workload.tables[i]
            raise PlannerError(
                f"table_wise: table {t.name!r} needs {size[i] / 2**30:.2f} GiB on one GPU, over the "
                f"{budget_bytes / 2**30:.2f} GiB budget"
            )
        r = int(np.flatnonzero(fits)[np.argmin(rank_load[fits])])
        owner[i] = r
        rank_load[r] += load[i]
        rank_mem[r] += size[i]
    warm_share, _ = uniform_shares(view)
    tables = tuple(
        TablePlan(t.name, 0, 0, t.num_rows, warm_share, np.eye(n)[owner[i]])
        for i, t in enumerate(workload.tables)
    )
    return _checked(Plan("table_wise", tables, dedup, sync, budget_bytes), workload, view, budget_bytes)


def two_d(workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode) -> Plan:
    if view.num_groups < 2 or view.uniform_group_size in (None, 1):
        return _renamed(row_wise(workload, view, budget_bytes, dedup, sync), "2d")
    return _whole_tables("2d", Tier.WARM, workload, view, budget_bytes, dedup, sync)


def data_parallel(
    workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode
) -> Plan:
    return _whole_tables("data_parallel", Tier.HOT, workload, view, budget_bytes, dedup, sync)


def _whole_tables(
    strategy: str,
    tier: int,
    workload: Workload,
    view: ClusterView,
    budget_bytes: float,
    dedup: bool,
    sync: SyncMode,
) -> Plan:
    """Tables moved whole to ``tier`` (by time saved per extra byte, while it saves time and fits),
    the rest row-wise."""
    coeffs = table_coefficients(workload, view, dedup, sync, routing_metadata=False)
    chosen = _greedy_whole_tables(coeffs, budget_bytes, tier)
    rows = [(t.num_rows if c else 0) for t, c in zip(workload.tables, chosen, strict=True)]
    tables = tuple(  # a table not moved stays row-wise, TorchRec's ranges
        table_plan(t, view, r if tier == Tier.HOT else 0, r if tier == Tier.WARM else 0)
        if r
        else row_wise_table(t, view)
        for t, r in zip(workload.tables, rows, strict=True)
    )
    return _checked(Plan(strategy, tables, dedup, sync, budget_bytes), workload, view, budget_bytes)


def hugectr_count_threshold(
    num_nodes: int, all_to_all_bw: float, all_reduce_bw: float, efficiency: float = 1.0
) -> float:
    """HugeCTR's frequent-category threshold (IB_NVLink), in expected accesses per iteration:
    ``n^2 / (n - 1) * all_to_all_bw / all_reduce_bw * efficiency`` for ``n`` nodes."""
    if num_nodes < 2:
        raise PlannerError(f"hybrid: the bandwidth-ratio threshold needs at least 2 nodes, got {num_nodes}")
    return num_nodes**2 / (num_nodes - 1) * all_to_all_bw / all_reduce_bw * efficiency


def modeled_bandwidth_ratio(view: ClusterView) -> float:
    """all-to-all / all-reduce algorithm bandwidth of one group in this cost model.

    A group's all-to-all payload X costs ``X (G-1)/G`` inter-group bytes; its all-reduce payload S
    costs ``2 S (G-1)/G``; both over the same links, so the ratio is 2 whatever the bandwidth.
    """
    return 2.0 if view.num_groups > 1 else 1.0


def hybrid(workload: Workload, view: ClusterView, budget_bytes: float, dedup: bool, sync: SyncMode) -> Plan:
    n = view.num_ranks
    big_g = view.num_groups
    threshold = hugectr_count_threshold(big_g, modeled_bandwidth_ratio(view), 1.0) if big_g > 1 else 1.0
    global_counts = [t.hist.prob * workload.lookups_per_gpu(t) * n for t in workload.tables]  # per bucket
    row_cost = [
        t.row_bytes + ROUTING_BYTES_PER_REPLICATED_ROW - t.row_bytes / n for t in workload.tables
    ]  # extra bytes/GPU per hot row
    floor = sum(t.num_rows * t.row_bytes / n for t in workload.tables)

    def hot_rows(cut: float) -> list[int]:
        return [int(t.hist.rows[c >= cut].sum()) for t, c in zip(workload.tables, global_counts, strict=True)]

    def extra(rows: list[int]) -> float:
        return float(sum(r * c for r, c in zip(rows, row_cost, strict=True)))

    cut = threshold
    rows = hot_rows(cut)
    if floor + extra(rows) > budget_bytes:  # hottest first while the budget allows
        lo, hi = cut, max(float(c.max()) for c in global_counts) * 2.0
        for _ in range(100):
            mid = np.sqrt(lo * hi)
            lo, hi = (mid, hi) if floor + extra(hot_rows(mid)) > budget_bytes else (lo, mid)
        rows = hot_rows(hi)
    tables = tuple(table_plan(t, view, h, 0) for t, h in zip(workload.tables, rows, strict=True))
    plan = Plan("hybrid", tables, dedup, sync, budget_bytes, solver={"count_threshold": threshold})
    return _checked(plan, workload, view, budget_bytes)


def _greedy_whole_tables(coeffs: list[TableCoefficients], budget_bytes: float, tier: int) -> list[bool]:
    """Tables moved whole to ``tier`` by time saved per extra byte, while it saves time and fits."""
    saved = np.array([c.time_s[Tier.COLD].sum() - c.time_s[tier].sum() for c in coeffs])
    extra = np.array([c.memory_bytes[tier].sum() - c.memory_bytes[Tier.COLD].sum() for c in coeffs])
    used = float(sum(c.memory_bytes[Tier.COLD].sum() for c in coeffs))
    chosen = [False] * len(coeffs)
    for i in np.argsort(-saved / np.maximum(extra, 1.0), kind="stable"):
        if saved[i] > 0 and used + extra[i] <= budget_bytes:
            chosen[i] = True
            used += extra[i]
    return chosen


def _checked(plan: Plan, workload: Workload, view: ClusterView, budget_bytes: float) -> Plan:
    report = evaluate(workload, view, plan, dealt=False)  # memory does not depend on the deal
    if report.memory_per_gpu_bytes > budget_bytes * (1 + 1e-9):
        raise PlannerError(
            f"{plan.strategy}: needs {report.memory_per_gpu_bytes / 2**30:.2f} GiB per GPU, over the "
            f"{budget_bytes / 2**30:.2f} GiB budget"
        )
    return plan


def _renamed(plan: Plan, strategy: str) -> Plan:
    return replace(plan, strategy=strategy)


BASELINES: dict[str, Callable[[Workload, ClusterView, float, bool, SyncMode], Plan]] = {
    "table_wise": table_wise,
    "row_wise": row_wise,
    "row_wise_group_dedup": row_wise_group_dedup,
    "2d": two_d,
    "hybrid": hybrid,
    "data_parallel": data_parallel,
}
