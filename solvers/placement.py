"""Placement: which GPU owns which warm and cold rows.

Rows of a tier are dealt to owners by a weighted interleave over hotness rank (:mod:`solvers.dealing`).
Two decisions are left to placement:

* the owners' shares. On a homogeneous cluster every share is even. Where links differ (a host behind
  a slower uplink), a small PuLP program (:func:`balance`) picks the shares that minimise the slowest
  rank's modeled time under the per-GPU memory budget: one cold share per rank and one warm share per
  position in the group (replicas of a warm shard must line up across groups for their all-reduce).
  Send and receive bytes are both bounded, so the program balances each rank's traffic by its link
  speed;
* where each table's deal starts (:func:`spread_heads`). The owner dealt a tier's hottest row also gets
  the hottest row of every round of the pattern, so it serves more than its share of the accesses;
  started at the same owner, every table would add its excess to the same rank. Tables are taken
  heaviest head first and each starts at the owner with the least load so far.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pulp

from core.vocabulary import Deal, Direction, FetchMode, LinkClass
from solvers import dealing, wire
from solvers.cost_model import (
    evaluate,
    exchanges,
    hierarchical_allreduce_bytes,
    routing_bytes,
    split_bytes,
    sync_mask_rows,
)
from solvers.types import CostReport, Plan, Workload
from solvers.volumes import TableMass, tier_volumes, view_mass
from topology.views import ClusterView


def is_homogeneous(view: ClusterView) -> bool:
    arrays = (view.intra_bw_Bps, view.inter_bw_Bps)
    return view.uniform_group_size is not None and all(np.ptp(a) <= 1e-9 * a.max() for a in arrays)


def balance(workload: Workload, view: ClusterView, plan: Plan, budget_bytes: float) -> Plan:
    """Plan with owner shares balanced by link speed (returns ``plan`` unchanged on a homogeneous cluster).

    The program's traffic is :mod:`solvers.wire`'s formulas applied to the share variables: a rank's
    cold share ``a[r]`` (its group's and its position's ``sum a``) and its position's warm share ``b[j]``.
    """
    if is_homogeneous(view) or view.uniform_group_size is None:
        return plan
    n, g = view.num_ranks, view.uniform_group_size
    grp, loc = view.group_of_rank, view.local_index
    # per exchange, lookups per GPU per iteration over all tables, and the same weighted by vector bytes
    volume = {"warm": 0.0, "cold": 0.0, "group": 0.0, "group rows": 0.0}
    vector_volume = dict.fromkeys(volume, 0.0)
    hot_payload = warm_payload = 0.0
    mem_fixed = mem_cold = mem_warm = 0.0
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        v = tier_volumes(view_mass(workload, view, t), tp, plan.dedup)
        if tp.fetch is FetchMode.GROUP:
            cold = (("group", v.cold_volume), ("group rows", v.cold_group_volume or 0.0))
        else:
            cold = (("cold", v.cold_volume),)
        for key, vol in (("warm", v.warm_volume), *cold):
            volume[key] += vol
            vector_volume[key] += vol * t.wire_bytes(plan.wire)
        hot_payload += wire.sync_payload(v.hot_touched, tp.hot_rows, t.wire_bytes(plan.wire), plan.sync)
        warm_payload += wire.sync_payload(v.warm_touched, tp.warm_rows, t.wire_bytes(plan.wire), plan.sync)
        mem_fixed += t.row_bytes * tp.hot_rows + routing_bytes(tp)
        mem_cold += t.row_bytes * tp.cold_rows
        mem_warm += t.row_bytes * tp.warm_rows
    fixed = split_bytes(view, len(workload.tables), exchanges(plan))
    mask = wire.sync_mask_bytes(sync_mask_rows(view, plan), plan.sync)  # every rank: no share in it
    fixed += hierarchical_allreduce_bytes(view, hot_payload + mask)  # [N, 2], each direction
    mean_vector = {k: vector_volume[k] / volume[k] if volume[k] > 0 else 0.0 for k in volume}

    prob = pulp.LpProblem("flexshard_placement", pulp.LpMinimize)
    a = [pulp.LpVariable(f"a_{r}", 0, 1) for r in range(n)]  # cold share per rank
    b = [pulp.LpVariable(f"b_{j}", 0, 1) for j in range(g)]  # warm share per position in the group
    slowest_us = pulp.LpVariable("slowest_rank_us", 0)
    prob += slowest_us
    prob += pulp.lpSum(a) == 1
    prob += pulp.lpSum(b) == 1
    mb = 1e-6  # constraints in MB
    group_a = [pulp.lpSum(a[o] for o in members) for members in view.groups]
    position_a = [pulp.lpSum(a[o] for o in np.flatnonzero(loc == j)) for j in range(g)]
    for r in range(n):
        k, j, br = int(grp[r]), int(loc[r]), b[int(loc[r])]
        sent = {link: float(fixed[r, link]) for link in LinkClass}
        received = dict(sent)
        # flat cold rows over the cluster (the group holds sum a), warm rows inside the group (b sums
        # to 1), group-fetched cold rows through the rail peers (the position holds sum a)
        lookups = [
            (*wire.lookups_by_link(a[r], group_a[k], g, n, volume["cold"], False), mean_vector["cold"]),
            (*wire.lookups_by_link(br, 1.0, g, n, volume["warm"], True), mean_vector["warm"]),
        ]
        # the group fetch's NVLink hop (per-GPU volume) and fabric hop (per-group volume), each with
        # its own mean vector size (the function is linear and separable in the two volumes)
        for asked, served, vector_bytes in lookups:
            for link in LinkClass:
                messages = wire.lookup_messages(asked[link], served[link], vector_bytes)
                for (_, direction), nbytes in messages.items():
                    (sent if direction is Direction.SEND else received)[link] += nbytes
        for key, per_gpu, per_group in (
            ("group", volume["group"], 0.0),
            ("group rows", 0.0, volume["group rows"]),
        ):
            messages = wire.group_fetch_messages(
                a[r], position_a[j], group_a[k], g, n, view.num_groups, per_gpu, per_group, mean_vector[key]
            )
            for link in LinkClass:
                for (_, direction), nbytes in messages[link].items():
                    (sent if direction is Direction.SEND else received)[link] += nbytes
        warm_sync = wire.ring_allreduce_bytes(view.num_groups, warm_payload * br)
        sent[LinkClass.INTER_GROUP] += warm_sync
        received[LinkClass.INTER_GROUP] += warm_sync
        time_us = []
        bandwidth = {LinkClass.INTRA_GROUP: view.intra_bw_Bps[r], LinkClass.INTER_GROUP: view.inter_bw_Bps[r]}
        for link in view.link_classes:  # one group: no inter-group link (its bytes are 0 for any shares)
            bw = bandwidth[link]
            y = pulp.LpVariable(f"{link.label}_{r}", 0)
            prob += y >= sent[link] * mb
            prob += y >= received[link] * mb
            time_us.append(y * (1e12 / bw))
        prob += slowest_us >= pulp.lpSum(time_us)
        prob += (mem_fixed + mem_cold * a[r] + mem_warm * br) * mb <= budget_bytes * mb
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        return plan  # keep even shares: the tier optimizer already checked they fit
    # Many share vectors reach the same slowest-rank time; among them take the one closest to
    # shares proportional to the bandwidth cold lookups leave a rank by (so fast ranks are treated
    # alike): inter-group, or intra-group on a cluster of one group.
    best_us = float(slowest_us.value() or 0.0)
    out_bw = view.inter_bw_Bps if view.has_inter_group else view.intra_bw_Bps
    target = out_bw / out_bw.sum()
    dev = [pulp.LpVariable(f"dev_{r}", 0) for r in range(n)]
    for r in range(n):
        prob += dev[r] >= a[r] - float(target[r])
        prob += dev[r] >= float(target[r]) - a[r]
    prob += slowest_us <= best_us * (1 + 1e-6) + 1e-9
    prob.setObjective(pulp.lpSum(dev))
    status = prob.solve(pulp.PULP_CBC_CMD(msg=False))
    if pulp.LpStatus[status] != "Optimal":
        return plan
    a_val = np.clip(np.array([x.value() or 0.0 for x in a]), 0, None)
    b_val = np.clip(np.array([x.value() or 0.0 for x in b]), 0, None)
    a_val /= a_val.sum()
    b_val /= b_val.sum()
    tables = tuple(replace(tp, warm_share=b_val[loc].copy(), cold_share=a_val.copy()) for tp in plan.tables)
    balanced = replace(plan, tables=tables, solver={**plan.solver, "placement": "balanced"})
    before, after = evaluate(workload, view, plan), evaluate(workload, view, balanced)
    if after.memory_per_gpu_bytes > budget_bytes * (1 + 1e-9):
        balanced, after = _pulled_into_budget(workload, view, plan, balanced, before, after, budget_bytes)
    if after.modeled_time_s > before.modeled_time_s or after.memory_per_gpu_bytes > budget_bytes * (1 + 1e-9):
        return plan
    return balanced


def _pulled_into_budget(
    workload: Workload,
    view: ClusterView,
    even: Plan,
    balanced: Plan,
    before: CostReport,
    after: CostReport,
    budget_bytes: float,
) -> tuple[Plan, CostReport]:
    """``balanced`` with its shares moved back towards ``even``'s (which fit) just far enough that every
    rank fits ``budget_bytes``, and its report. CBC reports the shares to about 8 significant digits, so
    a rank the program filled to the budget can come back a few hundred bytes over it (2x row-wise on
    ``skewed:4x2``: 795 B of 42.7 GB), and without this the whole balance would be dropped. Memory is
    linear in the shares, so the step back ``t`` is exact."""
    if before.memory_per_gpu_bytes > budget_bytes:
        return balanced, after  # the even shares do not fit either: nothing to step back to
    over = after.memory_bytes > budget_bytes  # these ranks grew: before fits, after does not
    grown = after.memory_bytes[over] - before.memory_bytes[over]
    t = float(np.min((budget_bytes - before.memory_bytes[over]) / grown))
    tables = tuple(
        replace(
            tp,
            warm_share=e.warm_share + t * (tp.warm_share - e.warm_share),
            cold_share=e.cold_share + t * (tp.cold_share - e.cold_share),
        )
        for e, tp in zip(even.tables, balanced.tables, strict=True)
    )
    pulled = replace(balanced, tables=tables)
    return pulled, evaluate(workload, view, pulled)


def spread_heads(workload: Workload, view: ClusterView, plan: Plan) -> Plan:
    """``plan`` with each table's warm and cold deal started at the owner least loaded so far.

    Load is the bytes of vectors an owner serves per iteration (lookup volume, or for a group fetch the
    groups' distinct rows, times the vector bytes), divided by the owner's share. Tables whose tier has
    the heaviest first row go first. Tiers dealt by ``ranges`` or held by a single owner keep their
    start. The plan is returned unchanged when spreading would raise its modeled time."""
    return priced_spread(workload, view, plan)[0]


def priced_spread(workload: Workload, view: ClusterView, plan: Plan) -> tuple[Plan, CostReport]:
    """:func:`spread_heads` and the :func:`~solvers.cost_model.evaluate` report of the plan it returns
    (the comparison prices both, and a caller that needs the report need not price it again)."""
    period = dealing.OWNER_PATTERN_PERIOD
    volume = TableMass.FIELDS.index("unique" if plan.dedup else "lookups")
    tiers = []  # (bytes of the tier's first row, table, tier, first row, last row, owner shares, column)
    cumulative = {}
    for i, (t, tp) in enumerate(zip(workload.tables, plan.tables, strict=True)):
        mass = view_mass(workload, view, t)
        cumulative[i] = (mass.rows, mass.stacked())
        h, w = tp.hot_rows, tp.warm_rows
        cold_column = TableMass.FIELDS.index("group") if tp.fetch is FetchMode.GROUP else volume
        for tier, first, last, shares, col in (
            ("warm", h, h + w, np.asarray(tp.warm_share, dtype=np.float64)[list(view.groups[0])], volume),
            ("cold", h + w, t.num_rows, np.asarray(tp.cold_share, dtype=np.float64), cold_column),
        ):
            if last <= first or (shares > 0).sum() < 2 or (tier == "cold" and tp.deal is Deal.RANGES):
                continue
            head = np.diff(np.interp([first, first + 1], mass.rows, cumulative[i][1][:, col]))[0]
            tiers.append((float(head) * t.wire_bytes(plan.wire), i, tier, first, last, shares, col))
    if not tiers:
        return plan, evaluate(workload, view, plan)
    load = {"warm": np.zeros(int(view.group_sizes.max())), "cold": np.zeros(view.num_ranks)}
    starts = {}
    for _, i, tier, first, last, shares, col in sorted(tiers, key=lambda x: -x[0]):
        base = dealing.owner_pattern(shares, period)
        live = np.bincount(base, minlength=shares.size) > 0  # owners with a position in the pattern
        owner = int(np.flatnonzero(live)[np.argmin(load[tier][live] / shares[live])])
        start = dealing.first_position(base, owner)
        pattern = dealing.owner_pattern(shares, period, start)
        _, masses = dealing.interleave_masses(*cumulative[i], first, last, pattern, shares.size)
        load[tier] += masses[:, col] * workload.tables[i].wire_bytes(plan.wire)
        starts[(i, tier)] = start
    tables = tuple(
        replace(
            tp,
            warm_start=starts.get((i, "warm"), tp.warm_start),
            cold_start=starts.get((i, "cold"), tp.cold_start),
        )
        for i, tp in enumerate(plan.tables)
    )
    spread = replace(plan, tables=tables)
    before, after = evaluate(workload, view, plan), evaluate(workload, view, spread)
    return (plan, before) if after.modeled_time_s > before.modeled_time_s else (spread, after)
