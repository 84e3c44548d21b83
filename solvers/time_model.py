"""The time model: a plan's modeled step time from the collectives it issues, the bytes they carry and the
local work around them (docs/cost_model.md, "Step time").

For every rank ``r`` (the plan's time is the slowest rank's):

* ``latency_s``: the sum over the step's stages (:func:`solvers.schedule.step_schedule`) of each one's
  latency from a :class:`~solvers.time_types.LatencyTable` (kind, scope, participants). Every rank issues
  every stage, so latency is the same on every rank. TorchRec's own sharding runs a row-wise plan in its
  own five collectives (:func:`solvers.schedule.torchrec_schedule`, the ``stages`` of :func:`step_time`).
* ``bandwidth_s``: bytes over bandwidth from the cost model's :class:`core.traffic.Traffic`, component by
  component (ids, forward, backward, sync; the stage ``ids``, ``rows``+``scatter``,
  ``grads``+``rail_grads``, the sync stages): ``sum over components and link classes of max(send, recv)
  / bandwidth``. A component travels in its own collectives, each a synchronisation point, so a rank's
  sends of one component do not overlap its receives of another.
* ``local_s``: expected counts of one step (:mod:`solvers.volumes`) times
  :class:`~solvers.time_types.LocalRates`: every lookup is deduplicated (with dedup) and routed, gathered into
  the output and scatter-added in the backward; every row a rank serves to a requester (warm and cold, one per
  requesting rank, or per group in a group fetch) is gathered and its gradient scatter-added, and each row it
  owns that was touched anywhere is updated once; a group fetch's rail peer deduplicates, forwards and sums
  its group's requests (keys ``owner * rows + slot``: no routing) and copies the distinct rows it fetches, its
  owners deduplicate the slots other groups send them, and its requesters route the lookups owned in other
  groups a second time (their slots; not with dedup on 2 groups, where an all-cold table's lookups dedup into
  the order both columns are sent in); every replicated row synced (touched ones with the sparse sync) is
  packed, unpacked and updated on every replica (a single rank updates the rows its batch touched); each
  collective costs ``collective_call_s`` on the host (where ranks share cores, the host terms fitted on shared
  cores hold their wait for descheduled ranks; docs/cost_model.md section 10.2.1b). Around the exchange:
  vector elements a rank sends or receives in an all-to-all are copied into a send buffer or out of a receive
  buffer (``pack_s_per_value``, per :class:`~solvers.time_types.BufferCopies`: twice per value it requested,
  forward and backward; where every table has one dim and the wire is float32, once per value it serves
  warm or flat and never for a group fetch's owner and relay, whose rows are gathered straight into the
  send buffer and whose sums stay where they arrive, nor for a requester whose rows of every table lie
  in one buffer in wire order, every table cold and group fetched or flat; else twice each); every looked-up
  output element carries the loss and its gradient (``output_s_per_value``); the runtime's host work (Python,
  small tensors) costs ``step_s`` per step and ``stage_s`` plus ``table_stage_s`` per table per collective
  (:meth:`~solvers.time_types.LocalRates.host_s`; this machine's rates: ``stage_s`` alone, measured steps
  not growing with the tables at the same lookups, docs/cost_model.md section 10.2.1b).
  A hot lookup has no owner-side work, no bytes and no stage of its own: that is where replication
  pays.
* ``total_s = latency_s + bandwidth_s + local_s``. With ``overlap`` (the pipelined step, off until the
  runtime pipelines), the next batch's input distribution (``ids``: latency, bytes, dedup
  and routing) runs beside the replica sync (sync stages, bytes and synced-row work), and the step pays
  ``max(input, sync)`` for the two instead of their sum.
"""

from __future__ import annotations

import numpy as np

from core.vocabulary import Component, FetchMode, SyncMode
from solvers.cost_model import evaluate
from solvers.schedule import Phase, Stage, rows_in_wire_order, step_schedule
from solvers.time_types import BufferCopies, LatencyTable, LocalRates, StageTime, StepTime, stage_latency_s
from solvers.types import Plan, Workload
from solvers.volumes import dealt_volumes, routed_ids, tier_volumes, view_mass
from topology.views import ClusterView

__all__ = ["LatencyTable", "LocalRates", "StepTime", "local_work", "stage_latency_s", "step_time"]
PIECES = ("dedup", "route", "gather", "scatter_add", "update", "calls", "pack", "output", "host")
INPUT_STAGES = ("ids",)


def local_work(
    workload: Workload,
    view: ClusterView,
    plan: Plan,
    rates: LocalRates,
    dealt: bool = True,
    stages: tuple[Stage, ...] | None = None,
) -> dict[str, np.ndarray]:
    """Seconds per rank of each piece of local work (``PIECES``) in one step, and ``"synced"``: the part
    of them spent on replicated rows (for the overlap rule) and ``"input"``: dedup and routing.
    ``stages``: the collectives of another implementation's step (each costs ``collective_call_s``; the
    host terms stay the runtime's, per its own :func:`~solvers.schedule.step_schedule` of ``plan``)."""
    n = view.num_ranks
    out = {p: np.zeros(n) for p in PIECES}
    synced_s, input_s = np.zeros(n), np.zeros(n)
    position = view.local_index
    gsize = view.group_size_of_rank().astype(np.float64)
    big_g = view.num_groups
    move = rates.gather_s_per_value + rates.scatter_add_s_per_value
    copies = BufferCopies.of([t.dim for t in workload.tables], plan.wire, rows_in_wire_order(plan, view))
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        mass = view_mass(workload, view, t)
        vol = dealt_volumes(mass, t, tp, view, plan.dedup) if dealt else tier_volumes(mass, tp, plan.dedup)
        lookups = workload.lookups_per_gpu(t)
        warm_share = _share(vol.warm_by_position, tp.warm_share, position)
        cold_share = _share(vol.cold_by_rank, tp.cold_share)
        served = warm_share * vol.warm_volume * gsize if n > 1 else np.zeros(n)
        relay, fetched, routed_twice, asked_in = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
        served_group = np.zeros(n)
        if n > 1 and tp.fetch is FetchMode.GROUP and tp.cold_rows > 0:
            group_share = _share(vol.cold_group_by_rank, tp.cold_share)
            served_group = group_share * (vol.cold_group_volume or 0.0) * big_g
            position_share = np.bincount(position, weights=cold_share)[position]
            relay = position_share * vol.cold_volume * gsize
            # the group fetch's own work: the rail peer copies the distinct rows it fetches (in, and their
            # gradient sums out; its group's keys need no routing); the requester sends the lookups owned
            # in other groups twice (keys to the rail peer, slots to the owner), sorted a second time
            # but not with dedup on 2 groups (an all-cold table dedups into rail order; a table with
            # tiers sorts them once more, not priced: the planner's linear form cannot see the tiers
            # here, and this equals it); the owner deduplicates those slots
            fetched = position_share * (vol.cold_group_volume or 0.0)
            if not (plan.dedup and big_g == 2):
                routed_twice = (1.0 - view.group_share(cold_share)) * vol.cold_volume
            asked_in = cold_share * vol.cold_volume * (n - gsize)
        elif n > 1:
            served = served + cold_share * vol.cold_volume * n
        group_work = served_group + relay + fetched
        sparse = SyncMode(plan.sync) is SyncMode.SPARSE
        hot_rows = (vol.hot_touched if sparse else tp.hot_rows) if n > 1 else 0.0
        warm_rows = (vol.warm_touched if sparse else tp.warm_rows) * tp.warm_share if big_g > 1 else 0.0
        synced = hot_rows + warm_rows
        dedup = rates.dedup_s_per_lookup * (lookups + relay) if plan.dedup else np.zeros(n)
        out["dedup"] += dedup + rates.dedup_s_per_lookup * asked_in
        routed = routed_ids(workload, view, t, plan.dedup, mass)
        out["route"] += rates.route_s_per_lookup * (routed + routed_twice)
        moved = lookups + served + served_group + relay + synced
        out["gather"] += rates.gather_s_per_value * t.dim * moved
        out["scatter_add"] += rates.scatter_add_s_per_value * t.dim * moved
        # an owner updates each row it holds once per step, however many ranks or groups asked for it: its
        # cold rows touched anywhere (warm rows on one group: touched in it; replicas: the synced rows)
        owned = _share(vol.cold_touched_by_rank, tp.cold_share) * vol.cold_touched if n > 1 else 0.0
        if n > 1 and big_g == 1:
            owned = owned + _share(vol.warm_touched_by_position, tp.warm_share, position) * vol.warm_touched
        own = 0.0 if n > 1 else (mass.unique if plan.dedup else mass.lookups)[-1]  # one rank updates its rows
        out["update"] += rates.update_s_per_value * t.dim * (owned + synced + own)
        requested = vol.warm_volume + vol.cold_volume if n > 1 else 0.0  # its own rows and gradients
        copied = copies.requested * requested + copies.served * served + copies.group * group_work
        out["pack"] += rates.pack_s_per_value * t.dim * copied
        out["output"] += rates.output_s_per_value * t.dim * lookups
        synced_s += (move + rates.update_s_per_value) * t.dim * synced
        input_s += dedup + rates.route_s_per_lookup * (routed + routed_twice)
    # the host terms are fitted to the runtime's own stages; another implementation's collectives (stages)
    # cost their call each, its host work per table and stage is the runtime's
    schedule = step_schedule(plan, view)
    out["calls"] += rates.collective_call_s * len(schedule if stages is None else stages)
    out["host"] += rates.host_s(len(workload.tables), len(schedule))
    out["synced"] = synced_s
    out["input"] = input_s
    return out


def _share(by_owner: np.ndarray | None, row_share: np.ndarray, position: np.ndarray | None = None):
    """Each rank's share of a tier's accesses (as :func:`solvers.cost_model.evaluate` prices them)."""
    if by_owner is None or by_owner.sum() <= 0:
        return np.asarray(row_share, dtype=np.float64)
    share = by_owner / by_owner.sum()
    return share if position is None else share[position]


def component_seconds(view: ClusterView, traffic_bytes: np.ndarray) -> np.ndarray:
    """float64[N, components]: per rank, ``sum over link classes of max(send, recv) / bandwidth`` of each
    traffic component (``traffic_bytes``: [N, link, component, direction])."""
    bw = np.stack([view.intra_bw_Bps, view.inter_bw_Bps], axis=1)  # [N, 2]
    per = traffic_bytes.max(axis=-1)  # [N, link, component]
    bw_b = np.broadcast_to(bw[:, :, None], per.shape)
    return np.divide(per, bw_b, out=np.zeros_like(per), where=per > 0).sum(axis=1)


def step_time(
    workload: Workload,
    view: ClusterView,
    plan: Plan,
    latency: LatencyTable | None = None,
    rates: LocalRates | None = None,
    *,
    overlap: bool = False,
    dealt: bool = True,
    stages: tuple[Stage, ...] | None = None,
) -> StepTime:
    """Modeled time of one step of ``plan`` (module docstring). ``latency``: the view's collective
    latencies by default (:meth:`LatencyTable.from_view`); ``rates``: :meth:`LocalRates.for_view`;
    ``dealt``: owners' shares as the runtime deals rows (else even shares, the optimizer's model);
    ``stages``: the collectives the step issues, where another implementation runs the plan (e.g.
    :func:`~solvers.schedule.torchrec_schedule`; default: FlexShard's runtime,
    :func:`~solvers.schedule.step_schedule`)."""
    latency = LatencyTable.from_view(view) if latency is None else latency
    rates = LocalRates.for_view(view) if rates is None else rates
    report = evaluate(workload, view, plan, dealt=dealt)
    stages = tuple(
        StageTime(s.name, s.phase.value, s.kind.value, s.scope.value, s.participants(view), seconds)
        for s in (step_schedule(plan, view) if stages is None else stages)
        for seconds in (stage_latency_s(s, view, latency),)
    )
    lat = float(sum(s.latency_s for s in stages))
    by_comp = component_seconds(view, report.traffic.bytes)  # [N, 4]
    work = local_work(workload, view, plan, rates, dealt=dealt, stages=stages)
    local = sum(work[p] for p in PIECES)
    bandwidth = by_comp.sum(axis=1)
    total = lat + bandwidth + local
    hidden = np.zeros_like(total)
    if overlap:
        input_lat = sum(s.latency_s for s in stages if s.name in INPUT_STAGES)
        sync_lat = sum(s.latency_s for s in stages if s.phase == Phase.SYNC.value)
        input_part = input_lat + by_comp[:, Component.IDS] + work["input"]
        sync_part = sync_lat + by_comp[:, Component.SYNC] + work["synced"]
        hidden = np.minimum(input_part, sync_part)
        total = total - hidden
    r = int(np.argmax(total))
    return StepTime(
        latency_s=lat,
        bandwidth_s=float(bandwidth[r]),
        local_s=float(local[r]),
        total_s=float(total[r]),
        collectives=len(stages),
        stages=stages,
        bandwidth_by_component={c.label: float(by_comp[r, c]) for c in Component},
        local_by_piece={p: float(work[p][r]) for p in PIECES},
        slowest_rank=r,
        per_rank_total_s=total,
        overlap=overlap,
        overlapped_s=float(hidden[r]),
        latency_source=latency.source,
        rates_source=rates.source,
    )
