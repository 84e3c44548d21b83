"""The cost model: bytes per link class per iteration, modeled time and memory, per rank.

One iteration, per table (formulas in docs/cost_model.md):

* each GPU looks up ``n = batch_size_per_gpu * ids_per_sample`` ids; the *volume* of a tier is
  ``n * P(tier)`` lookups without dedup, or ``sum_rows 1 - (1 - p)^n`` unique rows with per-rank
  dedup (a row costs its probability of appearing at least once in the rank's batch). Where a table
  has a measured :class:`~solvers.types.TouchProfile`, the batch is ``batch_size_per_gpu``
  independent samples and a row's chance to be in it is ``1 - (1 - q)^batch`` with ``q`` its measured
  per-sample touch rate (:func:`solvers.volumes.table_mass`);
* hot lookups are local; warm lookups go to the row's owner inside the group; cold lookups to its
  owner in the cluster. Each remote lookup moves one id (requester -> owner), one embedding
  (owner -> requester) and one gradient (requester -> owner). An owner serves the accesses of the rows
  it is dealt (:mod:`solvers.dealing`): heavier rows weigh more, so its share of a tier's volume is its
  rows' share of the tier's mass, not of the rows;
* replicas are synchronised after the backward pass: hot rows by a hierarchical all-reduce
  (reduce-scatter in the group, all-reduce across groups, all-gather in the group), warm shards by a
  ring all-reduce across the groups' copies. ``sync="sparse"`` moves only rows touched somewhere in
  the cluster this step (``sum 1 - (1 - p)^(N n)`` rows) after an all-reduce of a one-byte touched
  mask; ``sync="dense"`` moves every replicated row.

A rank's modeled time is ``sum over link classes of max(send, recv) / bandwidth``; the plan's is
the slowest rank's. Collective latency (the step's collectives, :mod:`solvers.schedule`, each priced by
the view's :class:`~solvers.time_types.LatencyTable`) is reported beside it, not in it; the step time
with latency and local work is :func:`solvers.time_model.step_time`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from core.errors import PlannerError
from core.traffic import Traffic
from core.vocabulary import Component, Deal, FetchMode, LinkClass
from solvers import dealing, torchrec_default, wire
from solvers.schedule import step_shape
from solvers.time_types import shape_latency_s
from solvers.types import (
    ROUTING_BYTES_PER_REPLICATED_ROW,
    CostReport,
    Plan,
    TablePlan,
    TableSpec,
    Workload,
)
from solvers.volumes import TableMass, TierVolumes, dealt_volumes, tier_volumes, view_mass
from topology.views import ClusterView


def lookup_traffic(
    view: ClusterView, share: np.ndarray, volume: float, vector_bytes: int, within_group: bool
) -> Traffic:
    """Expected bytes per rank of one tier's flat lookups (:func:`solvers.wire.lookups_by_link` priced
    by :func:`solvers.wire.lookup_messages`).

    ``share[r]``: share of the tier's accesses served by rank r (its rows' share of ``volume``), summing
    to 1 over the owners' scope (each group when ``within_group``, else the cluster); ``volume``: lookups
    (or unique ids) per requesting GPU per iteration.
    """
    out = Traffic.zeros(view.num_ranks)
    if volume <= 0:
        return out
    gsize = view.group_size_of_rank().astype(np.float64)
    asked, served = wire.lookups_by_link(
        share, view.group_share(share), gsize, view.num_ranks, volume, within_group
    )
    return _priced(out, asked, served, vector_bytes)


def group_lookup_traffic(
    view: ClusterView, share: np.ndarray, volume: float, group_volume: float, vector_bytes: int
) -> Traffic:
    """Expected bytes per rank of one tier's lookups in a group fetch
    (:func:`solvers.wire.group_fetch_messages`): ``volume`` lookups per GPU (per-rank dedup or not),
    ``group_volume`` distinct rows per group, ``share[r]`` rank r's share of the tier's accesses."""
    out = Traffic.zeros(view.num_ranks)
    if volume <= 0 and group_volume <= 0:
        return out
    position = view.local_index
    position_share = np.bincount(position, weights=share)[position]
    gsize = view.group_size_of_rank().astype(np.float64)
    messages = wire.group_fetch_messages(
        share,
        position_share,
        view.group_share(share),
        gsize,
        view.num_ranks,
        view.num_groups,
        volume,
        group_volume,
        vector_bytes,
    )
    for link, by_kind in messages.items():
        for (component, direction), b in by_kind.items():
            out.bytes[:, link, component, direction] += b
    return out


def _priced(out: Traffic, asked: dict, served: dict, vector_bytes: int) -> Traffic:
    """``out`` plus the lookup messages of ``asked`` and ``served`` lookups per link class."""
    for link in LinkClass:
        for (component, direction), b in wire.lookup_messages(
            asked[link], served[link], vector_bytes
        ).items():
            out.bytes[:, link, component, direction] += b
    return out


def hierarchical_allreduce_bytes(view: ClusterView, payload_bytes: float) -> np.ndarray:
    """Per-rank bytes [N, 2 links] sent (= received) by a hierarchical all-reduce of ``payload_bytes``
    (:func:`solvers.wire.hierarchical_allreduce_bytes` with each rank's group size)."""
    g = view.group_size_of_rank().astype(np.float64)
    per_link = wire.hierarchical_allreduce_bytes(g, view.num_groups, payload_bytes)
    return np.stack([np.broadcast_to(per_link[link], g.shape) for link in LinkClass], axis=1)


def sync_mask_rows(view: ClusterView, plan: Plan) -> int:
    """Rows of the sparse sync's touched mask: every hot row when there are several ranks, and the whole
    warm tier when there are several groups (one all-reduce over every rank)."""
    hot = sum(tp.hot_rows for tp in plan.tables) if view.num_ranks > 1 else 0
    warm = sum(tp.warm_rows for tp in plan.tables) if view.num_groups > 1 else 0
    return int(hot + warm)


def warm_sync_bytes(view: ClusterView, payload_bytes: np.ndarray | float) -> np.ndarray | float:
    """Inter-group bytes each way of the warm sync: a ring all-reduce across the groups' copies of a
    rank's warm shard of ``payload_bytes``."""
    return wire.ring_allreduce_bytes(view.num_groups, payload_bytes)


def routing_bytes(plan: TablePlan) -> float:
    """Per-rank bytes of a table's routing metadata: the sorted hot and warm ids (and their slots)
    that every rank searches to route a lookup; nothing when one tier holds the whole table (owners
    then follow from arithmetic on the id)."""
    if max(plan.hot_rows, plan.warm_rows, plan.cold_rows) == (
        plan.hot_rows + plan.warm_rows + plan.cold_rows
    ):
        return 0.0
    return float(ROUTING_BYTES_PER_REPLICATED_ROW * (plan.hot_rows + plan.warm_rows))


def check_plan(workload: Workload, view: ClusterView, plan: Plan) -> None:
    """Raise PlannerError when ``plan`` does not fit ``workload`` on ``view``."""
    if len(plan.tables) != len(workload.tables):
        raise PlannerError(f"plan: has {len(plan.tables)} tables, the workload has {len(workload.tables)}")
    n = view.num_ranks
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        if tp.name != t.name:
            raise PlannerError(f"plan: table {tp.name!r} where the workload has {t.name!r}")
        if (
            min(tp.hot_rows, tp.warm_rows, tp.cold_rows) < 0
            or tp.hot_rows + tp.warm_rows + tp.cold_rows != t.num_rows
        ):
            raise PlannerError(
                f"plan table {t.name!r}: tiers {tp.hot_rows}+{tp.warm_rows}+{tp.cold_rows} "
                f"do not cover {t.num_rows} rows"
            )
        for fld in ("warm_share", "cold_share"):
            s = getattr(tp, fld)
            if s.shape != (n,) or not np.isfinite(s).all() or (s < 0).any():
                raise PlannerError(f"plan table {t.name!r}: {fld} must be {n} non-negative shares")
        if abs(tp.cold_share.sum() - 1.0) > 1e-6:
            raise PlannerError(f"plan table {t.name!r}: cold_share sums to {tp.cold_share.sum():.6g}, not 1")
        if tp.warm_rows > 0:
            per_group = np.bincount(view.group_of_rank, weights=tp.warm_share, minlength=view.num_groups)
            if np.abs(per_group - 1.0).max() > 1e-6:
                raise PlannerError(f"plan table {t.name!r}: warm_share must sum to 1 in every group")
            if view.uniform_group_size is None:
                raise PlannerError(f"plan table {t.name!r}: warm rows need groups of equal size")
        if tp.fetch is FetchMode.GROUP and tp.cold_rows > 0 and view.uniform_group_size is None:
            raise PlannerError(f"plan table {t.name!r}: a group fetch needs groups of equal size")
        if tp.deal is Deal.RANGES and tp.cold_rows != t.num_rows:
            raise PlannerError(f"plan table {t.name!r}: the ranges deal needs every row cold")
        for fld in ("warm_start", "cold_start"):
            start = getattr(tp, fld)
            if not 0 <= start < dealing.OWNER_PATTERN_PERIOD:
                period = dealing.OWNER_PATTERN_PERIOD
                raise PlannerError(f"plan table {t.name!r}: {fld} must be in [0, {period}), got {start!r}")


def evaluate(workload: Workload, view: ClusterView, plan: Plan, dealt: bool = True) -> CostReport:
    """Modeled per-iteration bytes, time and memory of ``plan`` (see the module docstring), with the
    rows dealt to their owners as the runtime deals them (:func:`dealt_volumes`), or with ``dealt=False``
    every owner's share of the accesses equal to its share of the rows (the symmetric model the tier
    optimizer minimises, :mod:`solvers.coefficients`)."""
    check_plan(workload, view, plan)
    masses = [view_mass(workload, view, t) for t in workload.tables]
    volumes = [
        dealt_volumes(mass, t, tp, view, plan.dedup) if dealt else tier_volumes(mass, tp, plan.dedup)
        for t, tp, mass in zip(workload.tables, plan.tables, masses, strict=True)
    ]
    random = [
        i for i, tp in enumerate(plan.tables) if tp.deal is Deal.RANGES and workload.tables[i].order is None
    ]
    if not dealt or not random:
        return evaluate_volumes(workload, view, plan, volumes)
    # TorchRec's ranges of tables without an id order: the expected slowest rank over random orders
    column = TableMass.FIELDS.index("unique" if plan.dedup else "lookups")
    tables = [torchrec_default.random_table(workload.tables[i], plan, masses[i], column) for i in random]
    for i in random:  # their lookups are added per draw
        volumes[i] = replace(volumes[i], cold_volume=0.0, cold_by_rank=None)
    return torchrec_default.expected_report(view, evaluate_volumes(workload, view, plan, volumes), tables)


def evaluate_volumes(
    workload: Workload, view: ClusterView, plan: Plan, volumes: list[TierVolumes]
) -> CostReport:
    """:func:`evaluate` with each table's tier volumes given (e.g. priced on another trace window)."""
    n = view.num_ranks
    traffic = Traffic.zeros(n)
    memory = np.zeros((n, 4))  # hot, warm, cold, routing
    hot_payload = 0.0
    warm_payload = np.zeros(n)
    position = view.local_index
    for t, tp, vol in zip(workload.tables, plan.tables, volumes, strict=True):
        vec = t.wire_bytes(plan.wire)
        warm_share = _access_share(vol.warm_by_position, tp.warm_share, position)
        traffic += lookup_traffic(view, warm_share, vol.warm_volume, vec, within_group=True)
        cold_share = _access_share(vol.cold_by_rank, tp.cold_share)
        if tp.fetch is FetchMode.GROUP:
            if vol.cold_group_volume is None:
                raise PlannerError(f"table {t.name!r}: a group fetch needs the cold rows' group volume")
            group_share = _access_share(vol.cold_group_by_rank, tp.cold_share)
            traffic += group_lookup_traffic(view, cold_share, vol.cold_volume, 0.0, vec)
            traffic += group_lookup_traffic(view, group_share, 0.0, vol.cold_group_volume, vec)
        else:
            traffic += lookup_traffic(view, cold_share, vol.cold_volume, vec, within_group=False)
        hot_payload += wire.sync_payload(vol.hot_touched, tp.hot_rows, vec, plan.sync)
        if vol.warm_rows_by_position is not None and vol.warm_touched_by_position is not None:
            warm_payload += wire.sync_payload(
                vol.warm_touched_by_position[position], vol.warm_rows_by_position[position], vec, plan.sync
            )
        else:
            warm_payload += tp.warm_share * wire.sync_payload(vol.warm_touched, tp.warm_rows, vec, plan.sync)
        memory[:, 0] += t.row_bytes * tp.hot_rows
        memory[:, 1] += t.row_bytes * tp.warm_rows * tp.warm_share
        memory[:, 2] += t.row_bytes * tp.cold_rows * tp.cold_share
        memory[:, 3] += routing_bytes(tp)
    uses = exchanges(plan)
    splits = split_bytes(view, len(workload.tables), uses)
    mask = wire.sync_mask_bytes(sync_mask_rows(view, plan), plan.sync)  # priced as the hot rows' all-reduce
    hot_sync = hierarchical_allreduce_bytes(view, hot_payload + mask)
    warm_sync = warm_sync_bytes(view, warm_payload)
    for link in LinkClass:
        traffic.add(link, Component.IDS, splits[:, link], splits[:, link])
        traffic.add(link, Component.SYNC, hot_sync[:, link], hot_sync[:, link])
    traffic.add(LinkClass.INTER_GROUP, Component.SYNC, warm_sync, warm_sync)
    latency = shape_latency_s(step_shape(plan, view), view)
    return CostReport(
        traffic=traffic, time_s=link_time_s(view, traffic), memory_by_part_bytes=memory, latency_s=latency
    )


def _access_share(by_owner: np.ndarray | None, row_share: np.ndarray, position: np.ndarray | None = None):
    """Each rank's share of a tier's accesses: ``by_owner`` normalised (indexed by ``position`` for warm
    owners, which are positions in the group), or the row shares where there is no split or no volume."""
    if by_owner is None or by_owner.sum() <= 0:
        return row_share
    share = by_owner / by_owner.sum()
    return share if position is None else share[position]


def link_time_s(view: ClusterView, traffic: Traffic) -> np.ndarray:
    """float64[N]: each rank's modeled seconds, ``sum over link classes of max(send, recv) / bandwidth``,
    over the view's link classes (a cluster of one group has no inter-group link, and no bytes on it)."""
    per_link = traffic.per_link()  # [N, 2]
    if not view.has_inter_group and per_link[:, LinkClass.INTER_GROUP].any():
        raise AssertionError("cost model: inter-group bytes on a cluster of one group (a bug)")
    bw = np.stack([view.intra_bw_Bps, view.inter_bw_Bps], axis=1)
    return np.divide(per_link, bw, out=np.zeros_like(per_link), where=per_link > 0).sum(axis=1)


@dataclass(frozen=True)
class Exchanges:
    """Which lookup exchanges a plan runs each iteration (each has fixed costs: split sizes, rounds)."""

    warm: bool = False  # warm lookups, within the group
    cold_flat: bool = False  # cold lookups straight to their owners
    cold_group: bool = False  # cold lookups through the rail peers, once per group


def exchanges(plan: Plan) -> Exchanges:
    return Exchanges(
        warm=any(tp.warm_rows > 0 for tp in plan.tables),
        cold_flat=plan.cold_fetch(FetchMode.FLAT),
        cold_group=plan.cold_fetch(FetchMode.GROUP),
    )


def split_bytes(view: ClusterView, num_tables: int, uses: Exchanges) -> np.ndarray:
    """Per-rank bytes [N, 2 links] (each direction) of the split sizes of every exchange
    (:func:`solvers.wire.split_bytes`, every table in every column, in the headers of the ``ids``
    all-to-all): warm to the peers of the group, flat cold to every peer, group cold ids to the peers of
    the group and its slots to the ranks of the other groups."""
    peers = view.layout.peers_by_link().astype(np.float64)  # [N, 2]: in the group, outside it
    out = np.zeros((view.num_ranks, 2))
    if uses.warm:
        out[:, LinkClass.INTRA_GROUP] += wire.split_bytes(peers[:, LinkClass.INTRA_GROUP], num_tables)
    if uses.cold_flat:
        out += wire.split_bytes(peers, num_tables)
    if uses.cold_group:
        out += wire.split_bytes(peers, num_tables)
    return out


def uniform_shares(view: ClusterView) -> tuple[np.ndarray, np.ndarray]:
    """(warm_share, cold_share): rows split evenly inside each group and across the cluster."""
    return 1.0 / view.group_size_of_rank().astype(np.float64), np.full(view.num_ranks, 1.0 / view.num_ranks)


def table_plan(
    table: TableSpec, view: ClusterView, hot_rows: int, warm_rows: int, fetch: FetchMode = FetchMode.FLAT
) -> TablePlan:
    """A TablePlan with the given tier sizes, even (uniform) owner shares and cold ``fetch`` mode."""
    warm_share, cold_share = uniform_shares(view)
    hot_rows, warm_rows = int(hot_rows), int(warm_rows)
    return TablePlan(
        name=table.name,
        hot_rows=hot_rows,
        warm_rows=warm_rows,
        cold_rows=table.num_rows - hot_rows - warm_rows,
        warm_share=warm_share,
        cold_share=cold_share,
        fetch=fetch,
    )


def row_wise_memory_bytes(workload: Workload, view: ClusterView) -> float:
    """Per-GPU bytes of row-wise sharding (ceil(rows / N) rows of every table): the 1.0x budget."""
    n = view.num_ranks
    return float(sum(-(-t.num_rows // n) * t.row_bytes for t in workload.tables))
