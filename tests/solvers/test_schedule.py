"""The step's collectives, counted by hand for each plan shape."""

from __future__ import annotations

import numpy as np
import pytest

from core.vocabulary import FetchMode, SyncMode, WireDtype
from solvers.cost_model import table_plan
from solvers.schedule import (
    CollectiveKind,
    Phase,
    Scope,
    collectives_per_step,
    rows_in_wire_order,
    step_schedule,
    torchrec_schedule,
)
from solvers.types import Plan, RowHistogram, TableSpec
from topology.views import uniform_view


def _view(num_groups: int, group_size: int):
    return uniform_view(num_groups, group_size, 450e9, 50e9)


def _plan(
    view, hot: int, warm: int, fetch=FetchMode.FLAT, sync=SyncMode.SPARSE, wire=WireDtype.FP32, tables=3
):
    specs = [
        TableSpec(f"t{i}", 1000, 16, 20.0, RowHistogram(np.array([1000]), np.array([1e-3])))
        for i in range(tables)
    ]
    tps = tuple(table_plan(s, view, hot, warm, fetch) for s in specs)
    return Plan("test", tps, dedup=True, sync=sync, wire=wire)


def _names(plan, view):
    return [s.name for s in step_schedule(plan, view)]


def _stages(plan, view):
    return {s.name: s for s in step_schedule(plan, view)}


def test_row_wise_is_ids_rows_grads():
    view = _view(2, 4)
    assert _names(_plan(view, 0, 0), view) == ["ids", "rows", "grads"]


def test_every_tier_and_the_group_fetch_at_eight_ranks_in_two_groups_is_nine():
    view = _view(2, 4)
    plan = _plan(view, 10, 20, FetchMode.GROUP)
    assert _names(plan, view) == [
        "ids",
        "rows",
        "scatter",
        "grads",
        "rail_grads",
        "sync_mask",
        "sync_group_reduce",
        "sync_rail",
        "sync_group_gather",
    ]
    assert collectives_per_step(plan, view) == 9
    kinds = [s.kind for s in step_schedule(plan, view)]
    assert kinds.count(CollectiveKind.ALL_REDUCE) == 2


@pytest.mark.parametrize("tables", [1, 3, 26])
def test_the_count_does_not_depend_on_the_number_of_tables(tables):
    view = _view(2, 4)
    assert collectives_per_step(_plan(view, 10, 20, FetchMode.GROUP, tables=tables), view) == 9


def test_dense_sync_has_no_mask_and_half_precision_splits_the_rail_all_reduce():
    view = _view(2, 4)
    dense = _names(_plan(view, 10, 0, sync=SyncMode.DENSE), view)
    assert "sync_mask" not in dense and dense[-3:] == ["sync_group_reduce", "sync_rail", "sync_group_gather"]
    half = _names(_plan(view, 10, 0, wire=WireDtype.FP16), view)
    assert half[-4:] == ["sync_group_reduce", "sync_rail_reduce", "sync_rail_gather", "sync_group_gather"]


def test_one_group_has_no_rail_stage_and_one_rank_has_none():
    view = _view(1, 4)
    names = _names(_plan(view, 10, 20), view)
    assert names == ["ids", "rows", "grads", "sync_mask", "sync_group_reduce", "sync_group_gather"]
    assert all(s.scope is not Scope.RAIL for s in step_schedule(_plan(view, 10, 20), view))
    one = _view(1, 1)
    assert step_schedule(_plan(one, 10, 0), one) == ()


def test_participants_and_links_follow_the_scope():
    view = _view(4, 2)
    stages = _stages(_plan(view, 10, 20, FetchMode.GROUP), view)
    assert stages["ids"].participants(view) == 8
    assert stages["scatter"].participants(view) == 2
    assert stages["rail_grads"].participants(view) == 4
    assert [lc.label for lc in stages["scatter"].link_classes(view)] == ["intra_group"]
    assert [lc.label for lc in stages["rail_grads"].link_classes(view)] == ["inter_group"]


def _unequal_view():
    """3 ranks in groups of 2 and 1: no rail groups."""
    from core.ranks import RankLayout
    from topology.views import ClusterView

    n = 3
    return ClusterView(
        layout=RankLayout.of([[0, 1], [2]], n),
        host_of_rank=("a", "a", "b"),
        intra_bw_Bps=np.full(n, 450e9),
        inter_bw_Bps=np.full(n, 50e9),
        intra_latency_s=np.zeros(n),
        inter_latency_s=np.zeros(n),
        memory_bytes=np.full(n, 80 * 2**30, dtype=np.int64),
    )


@pytest.mark.parametrize(
    ("wire", "sync_stages"),
    [
        (WireDtype.FP32, ["sync_world"]),
        (WireDtype.FP16, ["sync_world_reduce", "sync_world_gather"]),
        (WireDtype.BF16, ["sync_world_reduce", "sync_world_gather"]),
    ],
)
def test_groups_of_unequal_size_sync_the_hot_rows_over_the_world(wire, sync_stages):
    view = _unequal_view()
    plan = _plan(view, 10, 0, wire=wire)
    assert _names(plan, view) == ["ids", "rows", "grads", "sync_mask", *sync_stages]
    kinds = {s.name: s.kind for s in step_schedule(plan, view)}
    want = CollectiveKind.ALL_REDUCE if wire is WireDtype.FP32 else CollectiveKind.ALL_TO_ALL
    assert all(kinds[name] is want for name in sync_stages)


def _scopes(plan, view):
    stages = _stages(plan, view)
    return stages["rows"].scope, stages["grads"].scope


def test_rows_and_grads_run_on_the_smallest_group_that_holds_their_blocks():
    view = _view(2, 4)
    # every cold row group-fetched, no warm row: rows owner -> rail peer, grads requester -> rail peer
    assert _scopes(_plan(view, 0, 0, FetchMode.GROUP), view) == (Scope.RAIL, Scope.GROUP)
    assert _scopes(_plan(view, 10, 0, FetchMode.GROUP), view) == (Scope.RAIL, Scope.GROUP)  # hot rows: local
    # warm rows come from the group: rows carries both the group's and the rail's blocks
    assert _scopes(_plan(view, 10, 20, FetchMode.GROUP), view) == (Scope.WORLD, Scope.GROUP)
    # warm rows and no cold row: both inside the group
    assert _scopes(_plan(view, 10, 990), view) == (Scope.GROUP, Scope.GROUP)
    # flat cold rows come from anywhere
    assert _scopes(_plan(view, 10, 20), view) == (Scope.WORLD, Scope.WORLD)
    assert _scopes(_plan(view, 0, 0), view) == (Scope.WORLD, Scope.WORLD)
    stages = _stages(_plan(view, 0, 0, FetchMode.GROUP), view)
    assert stages["rows"].participants(view) == 2 and stages["grads"].participants(view) == 4


def test_one_group_and_groups_of_one_rank_keep_rows_and_grads_on_the_world():
    one = _view(1, 4)
    assert _scopes(_plan(one, 10, 20, FetchMode.GROUP), one) == (Scope.WORLD, Scope.WORLD)
    singles = _view(4, 1)
    assert _scopes(_plan(singles, 0, 0, FetchMode.GROUP), singles) == (Scope.RAIL, Scope.WORLD)
    unequal = _unequal_view()
    assert _scopes(_plan(unequal, 0, 0, FetchMode.GROUP), unequal) == (Scope.WORLD, Scope.GROUP)


def test_rows_keep_wire_order_where_every_table_is_cold_and_group_fetched_with_grads_in_the_group_or_flat():
    view = _view(2, 4)
    assert rows_in_wire_order(_plan(view, 0, 0, FetchMode.GROUP), view)
    assert not rows_in_wire_order(_plan(view, 10, 0, FetchMode.GROUP), view)  # hot rows: read locally
    assert not rows_in_wire_order(_plan(view, 0, 20, FetchMode.GROUP), view)  # warm rows
    assert rows_in_wire_order(_plan(view, 0, 0), view)  # flat fetch: rows' order, by owner
    assert not rows_in_wire_order(_plan(view, 10, 0), view)  # hot rows
    assert not rows_in_wire_order(_plan(_view(1, 1), 0, 0), _view(1, 1))  # one rank: no exchange
    plan = _plan(view, 0, 0, FetchMode.GROUP)
    mixed = Plan(
        "mixed", (plan.tables[0], _plan(view, 0, 0).tables[1]), dedup=True, sync=plan.sync, wire=plan.wire
    )
    assert not rows_in_wire_order(mixed, view)  # one table flat
    no_dedup = Plan("no dedup", plan.tables, dedup=False, sync=plan.sync, wire=plan.wire)
    assert not rows_in_wire_order(no_dedup, view)
    for other in (_view(1, 4), _view(4, 1)):  # grads on the world: one group, groups of one rank
        assert not rows_in_wire_order(_plan(other, 0, 0, FetchMode.GROUP), other)
    unequal = _unequal_view()  # grads in the group (rows on the world: no rail)
    assert rows_in_wire_order(_plan(unequal, 0, 0, FetchMode.GROUP), unequal)


def test_torchrec_issues_five_world_all_to_alls_however_many_tables():
    # KJTAllToAll: split sizes, lengths, values; SequenceEmbeddingsAllToAll: rows, then their gradients
    view = _view(2, 4)
    stages = torchrec_schedule(view)
    assert [s.name for s in stages] == ["splits", "lengths", "ids", "rows", "grads"]
    assert {(s.kind, s.scope) for s in stages} == {(CollectiveKind.ALL_TO_ALL, Scope.WORLD)}
    assert [s.phase for s in stages] == [Phase.FORWARD] * 4 + [Phase.BACKWARD]
    assert torchrec_schedule(_view(1, 1)) == ()  # one rank: local copies
