"""Per-row cost and memory coefficients of each tier, the linear form of the cost model.

For the optimizer the cluster is taken as symmetric (every rank owns an even share) and each link
class runs at its slowest rank's bandwidth, so a rank's modeled time is a sum over rows of
per-tier coefficients. ``tests/solvers/test_optimizer.py`` checks that these sums equal
:func:`solvers.cost_model.evaluate` on uniform clusters.

With :class:`~solvers.time_types.LocalRates`, each row also carries its local work
(:func:`solvers.time_model.local_work` at even shares): a served row (warm, cold) costs its owner a gather and
a scatter-add per requesting rank (per group in a group fetch, plus the rail peer's dedup, forward and sum of
each lookup) and one update per step where it was touched anywhere, and every exchanged row is copied into and
out of the all-to-all buffers by its requester, its owner and a rail peer; a replicated row costs every
replica the pack, unpack and update of its sync. Work that every plan does (each lookup's dedup, routing,
gather and scatter-add, the loss over its output) and the collectives' host calls and the runtime's host work
are a fixed cost
(:func:`fixed_local_s`), their latency another
(:func:`fixed_time_s` with ``include_latency``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.traffic import Traffic
from core.vocabulary import Component, FetchMode, LinkClass, SyncMode, Tier, WireDtype
from solvers import wire
from solvers.cost_model import (
    Exchanges,
    group_lookup_traffic,
    hierarchical_allreduce_bytes,
    lookup_traffic,
    split_bytes,
    uniform_shares,
    warm_sync_bytes,
)
from solvers.schedule import StepShape, shape_schedule
from solvers.time_types import BufferCopies, LatencyTable, LocalRates, shape_latency_s
from solvers.types import ROUTING_BYTES_PER_REPLICATED_ROW, Workload
from solvers.volumes import routed_ids, view_mass
from topology.views import ClusterView

IDS = Component.IDS


@dataclass(frozen=True)
class LinkTimes:
    """Seconds per unit of each tier's traffic at the slowest rank, on the symmetric cluster.

    Each entry is the cost model's own formula evaluated at one unit (one lookup, one payload byte)
    and divided by the slowest rank's bandwidth per link class.
    """

    inv_bw_s_per_byte: np.ndarray  # float64[2]: 1 / slowest bandwidth per link class (0 if unused)
    hot_sync: float  # per byte of hot sync payload (every replica)
    warm_sync: float  # per byte of warm sync payload of the whole tier (a rank holds 1/g of it)
    group_size: int
    num_ranks: int
    view: ClusterView

    def seconds(self, traffic: Traffic, component: Component | None = None) -> float:
        """Seconds of ``traffic`` at the slowest rank per link class: all components, or one."""
        per_link = traffic.per_link() if component is None else traffic.bytes[..., component, :].max(axis=-1)
        return float(per_link.max(axis=0) @ self.inv_bw_s_per_byte)

    def lookup_s(self, vector_bytes: int, within_group: bool, component: Component | None = None) -> float:
        """Seconds per lookup (one id, one embedding, one gradient; or only ``component``'s part) of a warm
        (``within_group``) or cold row of ``vector_bytes``, at even shares
        (:func:`solvers.cost_model.lookup_traffic` at volume 1)."""
        warm_share, cold_share = uniform_shares(self.view)
        share = warm_share if within_group else cold_share
        return self.seconds(lookup_traffic(self.view, share, 1.0, vector_bytes, within_group), component)

    def group_lookup_s(self, vector_bytes: int, component: Component | None = None) -> tuple[float, float]:
        """Seconds per cold lookup of a GPU (its NVLink hop to the rail peer) and per distinct row of a
        group (the rail peer's fetch across the fabric) in a group fetch, at even shares
        (:func:`solvers.cost_model.group_lookup_traffic` at one unit of each volume); all components or
        only ``component``'s part."""
        _, share = uniform_shares(self.view)
        out = []
        for volume, group_volume in ((1.0, 0.0), (0.0, 1.0)):
            traffic = group_lookup_traffic(self.view, share, volume, group_volume, vector_bytes)
            out.append(self.seconds(traffic, component))
        return out[0], out[1]


def link_times(view: ClusterView) -> LinkTimes:
    """Seconds per unit of each tier's traffic at the slowest rank's bandwidth per link class."""
    inv = np.array(
        [
            1.0 / float(view.intra_bw_Bps.min()),
            1.0 / float(view.inter_bw_Bps.min()) if view.num_groups > 1 else 0.0,
        ]
    )
    g = int(view.group_sizes.max())
    hot = hierarchical_allreduce_bytes(view, 1.0).max(axis=0)  # [2 links] per payload byte
    warm = float(warm_sync_bytes(view, 1.0 / g))
    return LinkTimes(
        inv_bw_s_per_byte=inv,
        hot_sync=float(hot @ inv),
        warm_sync=warm * inv[LinkClass.INTER_GROUP],
        group_size=g,
        num_ranks=view.num_ranks,
        view=view,
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
    cold_group_time_s: np.ndarray | None = None  # [K]: the bucket cold, fetched once per group
    fetch: FetchMode = FetchMode.FLAT  # the cold fetch mode ``time_s`` prices
    # the parts of ``time_s`` the pipelined step overlaps (solvers.time_model.step_time's overlap): the
    # input distribution's (ids bytes, the rail peer's dedup) and the replica sync's (sync bytes, the
    # synced rows' work); zeros under the bytes objective's callers that never overlap
    input_s: np.ndarray | None = None  # [3, K]
    sync_s: np.ndarray | None = None  # [3, K]
    cold_group_input_s: np.ndarray | None = None  # [K]: input part of ``cold_group_time_s``

    def for_fetch(self, mode: FetchMode) -> TableCoefficients:
        """These coefficients with the cold row priced for ``mode``."""
        if mode is self.fetch:
            return self
        if mode is not FetchMode.GROUP or self.cold_group_time_s is None:
            raise ValueError(f"coefficients: no cold prices for fetch mode {mode}")
        time_s = self.time_s.copy()
        time_s[Tier.COLD] = self.cold_group_time_s
        input_s = self.input_s
        if input_s is not None and self.cold_group_input_s is not None:
            input_s = input_s.copy()
            input_s[Tier.COLD] = self.cold_group_input_s
        return replace(self, time_s=time_s, fetch=mode, input_s=input_s)

    @property
    def other_s(self) -> np.ndarray:
        """[3, K]: the part of ``time_s`` that neither the input distribution nor the sync holds."""
        return self.time_s - self.input_s - self.sync_s


def table_coefficients(
    workload: Workload,
    view: ClusterView,
    dedup: bool,
    sync: SyncMode,
    routing_metadata: bool = True,
    wire_dtype: WireDtype = WireDtype.FP32,
    rates: LocalRates | None = None,
) -> list[TableCoefficients]:
    """Coefficients of every table's histogram buckets (cold priced flat; :meth:`TableCoefficients.for_fetch`
    gives the group fetch's prices where the cluster has several groups of equal size), vectors sent as
    ``wire_dtype``; with ``rates``, each row's local work too (module docstring)."""
    lt = link_times(view)
    g, n = lt.group_size, lt.num_ranks
    meta = ROUTING_BYTES_PER_REPLICATED_ROW if routing_metadata else 0
    groups_of_equal_size = view.num_groups > 1 and view.uniform_group_size is not None
    out = []
    copies = BufferCopies.of([t.dim for t in workload.tables], wire_dtype)
    for t in workload.tables:
        vec = t.wire_bytes(wire_dtype)
        mass = view_mass(workload, view, t)
        rows = np.diff(mass.rows)
        volume = np.diff(mass.unique if dedup else mass.lookups)
        touched = np.diff(mass.touched)
        payload = wire.sync_payload(touched, rows, vec, sync)
        mask = wire.sync_mask_bytes(rows, sync)  # hot and warm marks: one all-reduce over every rank
        warm_mask = mask if view.num_groups > 1 else 0.0 * mask
        sync_s = np.stack(
            [lt.hot_sync * (payload + mask), lt.warm_sync * payload + lt.hot_sync * warm_mask, 0.0 * rows]
        )
        ids = IDS
        input_s = np.stack(
            [0.0 * rows, lt.lookup_s(vec, True, ids) * volume, lt.lookup_s(vec, False, ids) * volume]
        )
        time_s = sync_s + np.stack(
            [
                0.0 * rows,
                lt.lookup_s(vec, within_group=True) * volume,
                lt.lookup_s(vec, within_group=False) * volume,
            ]
        )
        per_row = 0.0
        if rates is not None and n > 1:  # one rank: no owner-side work, no sync (a fixed cost)
            move = rates.gather_s_per_value + rates.scatter_add_s_per_value
            served = move * t.dim  # a row served to one requester: gathered, its gradient scatter-added
            update = rates.update_s_per_value * t.dim  # a row its owner updates, once per step
            per_row = served + update  # a synced row on one replica
            synced = touched if SyncMode(sync) is SyncMode.SPARSE else rows
            sync_s[0] += per_row * synced
            time_s[0] += per_row * synced
            if view.num_groups > 1:
                sync_s[1] += per_row * synced / g
                time_s[1] += served * volume + per_row * synced / g
            else:  # a warm tier on one group is never used; priced as served rows, touched ones updated
                time_s[1] += served * volume + update * touched / g
            time_s[2] += served * volume + update * touched / n
            pack = rates.pack_s_per_value * t.dim  # one value copied into or out of a buffer
            time_s[1:] += (
                pack * (copies.requested + copies.served) * volume
            )  # its lookups and those it serves
        memory = np.stack(
            [rows * (t.row_bytes + meta), rows * (t.row_bytes / g + meta), rows * t.row_bytes / n]
        )
        cold_group = cold_group_input = None
        if groups_of_equal_size:
            per_lookup_s, per_group_row_s = lt.group_lookup_s(vec)
            cold_group = per_lookup_s * volume + per_group_row_s * np.diff(mass.group)
            ids_lookup_s, ids_group_row_s = lt.group_lookup_s(vec, IDS)
            cold_group_input = ids_lookup_s * volume + ids_group_row_s * np.diff(mass.group)
            if rates is not None:  # rows served once per group; the rail peer dedups, forwards and sums
                relay_dedup = rates.dedup_s_per_lookup if dedup else 0.0
                relay = relay_dedup + t.dim * move
                cold_group = cold_group + served * np.diff(mass.group) / g + update * touched / n
                cold_group = cold_group + relay * volume
                # its own lookups, and the relay's rows (as many as its group's lookups at its position)
                cold_group = cold_group + pack * (copies.requested + copies.group) * volume
                # the rail peer copies the distinct rows it fetches (its group's keys need no routing);
                # lookups owned in other groups are deduplicated at their owners and routed twice, but on
                # 2 groups with dedup not (time_model.local_work: an all-cold table dedups into rail order;
                # priced so here whatever the tiers)
                other = (1.0 - g / n) * volume
                twice = 0.0 if dedup and view.num_groups == 2 else rates.route_s_per_lookup * other
                cold_group = cold_group + twice
                served_and_fetched = 2 * copies.group * np.diff(mass.group) / g
                cold_group = cold_group + rates.dedup_s_per_lookup * other + pack * served_and_fetched
                # the input distribution's part (time_model.local_work's "input"): the relay's dedup and
                # the second routing
                cold_group_input = cold_group_input + relay_dedup * volume + twice
        out.append(
            TableCoefficients(
                rows,
                time_s,
                memory,
                float(meta * t.num_rows),
                cold_group,
                input_s=input_s,
                sync_s=sync_s,
                cold_group_input_s=cold_group_input,
            )
        )
    return out


def fixed_time_s(
    view: ClusterView,
    num_tables: int,
    hot: bool,
    uses: Exchanges,
    sync: SyncMode,
    include_latency: bool = False,
    latency: LatencyTable | None = None,
    wire_dtype: WireDtype = WireDtype.FP32,
) -> float:
    """Seconds per iteration that do not scale with rows, for a plan that runs the given exchanges (on
    the symmetric cluster, slowest rank per link class): the split sizes, and with ``include_latency``
    the latency of the step's collectives (:func:`solvers.time_types.shape_latency_s`, ``latency`` or the
    view's table)."""
    lt = link_times(view)
    splits = split_bytes(view, num_tables, uses).max(axis=0)
    bandwidth = float(splits @ lt.inv_bw_s_per_byte)
    if not include_latency:
        return bandwidth
    return bandwidth + shape_latency_s(exchange_shape(view, hot, uses, sync, wire_dtype), view, latency)


def exchange_shape(
    view: ClusterView, hot: bool, uses: Exchanges, sync: SyncMode, wire_dtype: WireDtype = WireDtype.FP32
) -> StepShape:
    """The :class:`~solvers.schedule.StepShape` of a plan with hot rows (or not) and these exchanges."""
    several = view.num_ranks > 1
    return StepShape(
        remote=several and (uses.warm or uses.cold_flat or uses.cold_group),
        group_fetch=several and uses.cold_group,
        flat_fetch=several and uses.cold_flat,
        warm=several and uses.warm,
        hot_sync=several and hot,
        warm_sync=uses.warm and view.num_groups > 1,
        sync=SyncMode(sync),
        wire=WireDtype(wire_dtype),
    )


def fixed_local_s(
    workload: Workload, view: ClusterView, shape: StepShape, dedup: bool, rates: LocalRates
) -> float:
    """Local seconds per step every plan of ``shape`` pays whatever its tier boundaries: each lookup's
    dedup, the routing of the ids (the distinct ones with dedup), each lookup's gather into the output
    and scatter-add of its gradient, the collectives' host calls and, on one rank, the update of the
    rows its batch touched
    (:func:`solvers.time_model.local_work`)."""
    move = rates.gather_s_per_value + rates.scatter_add_s_per_value
    schedule = shape_schedule(shape, view)
    total = rates.collective_call_s * len(schedule)
    total += rates.host_s(len(workload.tables), len(schedule))
    for t in workload.tables:
        lookups = workload.lookups_per_gpu(t)
        mass = view_mass(workload, view, t) if dedup or view.num_ranks == 1 else None
        total += rates.route_s_per_lookup * routed_ids(workload, view, t, dedup, mass)
        total += lookups * (rates.dedup_s_per_lookup if dedup else 0.0)
        total += lookups * t.dim * (move + rates.output_s_per_value)
        if mass is not None and view.num_ranks == 1:
            total += rates.update_s_per_value * t.dim * (mass.unique if dedup else mass.lookups)[-1]
    return float(total)
