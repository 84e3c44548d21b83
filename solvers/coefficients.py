"""Per-row cost and memory coefficients of each tier, the linear form of the cost model.

For the optimizer the cluster is taken as symmetric (every rank owns an even share) and each link
class runs at its slowest rank's bandwidth, so a rank's modeled time is a sum over rows of
per-tier coefficients. ``tests/solvers/test_optimizer.py`` checks that these sums equal
:func:`solvers.cost_model.evaluate` on uniform clusters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.cost_model import collective_latency_s, split_bytes, table_mass
from solvers.types import INDEX_BYTES, MASK_BYTES_PER_ROW, ROUTING_BYTES_PER_REPLICATED_ROW, Workload
from topology.views import ClusterView

TIERS = ("hot", "warm", "cold")


@dataclass(frozen=True)
class LinkTimes:
    """Seconds per byte of each tier's traffic, per rank, on the symmetric cluster."""

    warm_lookup: float  # per byte of lookup payload (id + embedding + gradient) in the warm tier
    cold_lookup: float
    hot_sync: float  # per byte of hot sync payload (all replicas)
    warm_sync: float  # per byte of warm sync payload of the whole tier (a rank holds 1/g of it)
    group_size: int
    num_ranks: int


def link_times(view: ClusterView) -> LinkTimes:
    """Seconds per byte of each tier's traffic at the slowest rank's bandwidth per link class."""
    n = view.num_ranks
    g = int(view.group_sizes.max())
    big_g = view.num_groups
    inv_a = 1.0 / float(view.intra_bw_Bps.min())
    inv_e = 1.0 / float(view.inter_bw_Bps.min()) if big_g > 1 else 0.0
    return LinkTimes(
        warm_lookup=(g - 1) / g * inv_a,
        cold_lookup=(g - 1) / n * inv_a + (n - g) / n * inv_e,
        hot_sync=2 * (g - 1) / g * inv_a + 2 * (big_g - 1) / (big_g * g) * inv_e,
        warm_sync=2 * (big_g - 1) / (big_g * g) * inv_e,
        group_size=g,
        num_ranks=n,
    )


@dataclass(frozen=True)
class TableCoefficients:
    """Per-bucket seconds and bytes of putting the bucket's rows in each tier.

    Arrays have shape [3 tiers (hot, warm, cold), K buckets]; ``rows`` has shape [K].
    """

    rows: np.ndarray
    time_s: np.ndarray  # modeled seconds per iteration contributed by the bucket in each tier
    memory_bytes: np.ndarray  # per-GPU bytes of the bucket in each tier, routing metadata included
    whole_table_credit_bytes: float = 0.0  # metadata not needed when one tier holds the whole table


def table_coefficients(
    workload: Workload,
    view: ClusterView,
    dedup: bool,
    sync: str,
    routing_metadata: bool = True,
) -> list[TableCoefficients]:
    """Coefficients of every table's histogram buckets."""
    lt = link_times(view)
    g, n = lt.group_size, lt.num_ranks
    meta = ROUTING_BYTES_PER_REPLICATED_ROW if routing_metadata else 0
    out = []
    for t in workload.tables:
        mass = table_mass(t, workload.lookups_per_gpu(t), n)
        rows = np.diff(mass.rows)
        volume = np.diff(mass.unique if dedup else mass.lookups)
        touched = np.diff(mass.touched)
        per_lookup = INDEX_BYTES + 2 * t.vector_bytes
        if sync == "dense":
            payload = rows * t.vector_bytes
        else:
            payload = touched * t.vector_bytes + rows * MASK_BYTES_PER_ROW
        time_s = np.stack(
            [
                lt.hot_sync * payload,
                lt.warm_lookup * volume * per_lookup + lt.warm_sync * payload,
                lt.cold_lookup * volume * per_lookup,
            ]
        )
        memory = np.stack(
            [rows * (t.row_bytes + meta), rows * (t.row_bytes / g + meta), rows * t.row_bytes / n]
        )
        out.append(TableCoefficients(rows, time_s, memory, float(meta * t.num_rows)))
    return out


def fixed_time_s(
    view: ClusterView,
    num_tables: int,
    hot: bool,
    warm: bool,
    cold: bool,
    sync: str,
    include_latency: bool = False,
) -> float:
    """Seconds per iteration that do not scale with rows, for a plan that uses the given tiers (on
    the symmetric cluster, slowest rank per link class): the split-size exchange, and with
    ``include_latency`` the collective latency."""
    splits = split_bytes(view, num_tables, warm, cold).max(axis=0)
    inv_a = 1.0 / float(view.intra_bw_Bps.min())
    inv_e = 1.0 / float(view.inter_bw_Bps.min()) if view.num_groups > 1 else 0.0
    warm_sync = warm and view.num_groups > 1
    bandwidth = float(splits[0] * inv_a + splits[1] * inv_e)
    if not include_latency:
        return bandwidth
    return bandwidth + collective_latency_s(view, warm, cold, hot, warm_sync, sync)
