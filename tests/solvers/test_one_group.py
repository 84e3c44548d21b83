"""A cluster of one group (one host, one NVLink domain): no inter-group link class at all.

The view has no inter-group bandwidth, every strategy's plan moves exactly 0 bytes across groups (not a
rounding residue such as -2e-10 B, which printed as "-0 B", nor a positive one divided by a bandwidth of 0,
which priced a plan at inf), warm rows are cold rows with routing metadata, the optimizer chooses hot
against cold by intra-group cost and memory (brute force), and placement balances owner shares over
unequal intra-group links (it divided by the missing inter-group bandwidth: a PuLP error)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest

from core.errors import PlannerError
from core.vocabulary import INDEX_BYTES, Component, Direction, FetchMode, LinkClass
from solvers import cost_model
from solvers.cost_model import table_plan
from solvers.optimizer import OptimizerConfig, optimize_tiers
from solvers.placement import balance
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from solvers.types import Plan, RowHistogram, TableSpec, Workload
from topology import cluster_view, from_preset, read_json
from topology.views import uniform_view

BYTES = OptimizerConfig(step_time=False)  # the bytes objective these tests check

FIXTURES = Path(__file__).resolve().parents[1] / "topology" / "fixtures"
PROBED = {  # made by the real probe on one host: `flexshard probe --quick` and `--nproc 4 --groups 1`
    "probe 1x2": FIXTURES / "probe_one_host.json",
    "probe 1x4": FIXTURES / "probe_one_group_4.json",
}
INTRA, INTER = LinkClass.INTRA_GROUP, LinkClass.INTER_GROUP


def one_group_view(name: str):
    return cluster_view(read_json(PROBED[name]) if name in PROBED else from_preset(name))


def one_row_table(name: str, weights: list[float], dim: int, ids_per_sample: float) -> TableSpec:
    p = np.asarray(weights, dtype=np.float64)
    hist = RowHistogram(rows=np.ones(p.size, dtype=np.int64), prob=p / p.sum())
    return TableSpec(name, num_rows=p.size, dim=dim, ids_per_sample=ids_per_sample, hist=hist)


def zipf_workload() -> Workload:
    """Two Zipf tables, one numbered hottest first and one with real ids (row-wise deals it by id ranges)."""
    tables = []
    for name, rows, s, dim, ids, order in (
        ("a", 20_000, 1.05, 32, 8.0, None),
        ("b", 5_000, 0.9, 16, 4.0, np.random.default_rng(0).permutation(5_000)),
    ):
        w = np.arange(1, rows + 1, dtype=np.float64) ** -s
        counts = np.rint(w / w.sum() * 1e6).astype(np.int64)
        tables.append(TableSpec(name, rows, dim, ids, RowHistogram.from_counts(counts), order=order))
    return Workload("zipf", tuple(tables), batch_size_per_gpu=256)


def test_the_view_of_one_group_has_no_inter_group_link():
    for view in (
        uniform_view(1, 4, 450e9, 50e9, intra_latency_s=3e-6, inter_latency_s=8e-6),
        cluster_view(from_preset("h100:1x4")),  # its NICs sit on a leaf: still nothing leaves the group
        one_group_view("probe 1x4"),
    ):
        assert view.num_groups == 1 and not view.has_inter_group and view.link_classes == (INTRA,)
        assert np.array_equal(view.inter_bw_Bps, np.zeros(4)) and np.array_equal(
            view.inter_latency_s, np.zeros(4)
        )
    two = cluster_view(from_preset("h100:2x4"))
    assert two.has_inter_group and two.link_classes == (INTRA, INTER) and np.all(two.inter_bw_Bps == 50e9)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("topology", ["h100:1", "h100:1x4", "probe 1x2", "probe 1x4"])
def test_no_strategy_moves_a_byte_across_groups_on_one_group(topology, dedup):
    view, workload = one_group_view(topology), zipf_workload()
    budget = budget_bytes(workload, view, 2.0)
    priced = 0
    for strategy in STRATEGIES:
        try:
            planned = make_plan(strategy, workload, view, budget, dedup=dedup, config=BYTES)
        except PlannerError:  # table-wise may not fit
            continue
        priced += 1
        report, plan = planned.report, planned.plan
        assert np.all(report.traffic.bytes[:, INTER] == 0.0), strategy  # exactly: no residue either sign
        assert np.all(report.traffic.bytes >= 0.0), strategy
        assert np.isfinite(report.time_s).all() and np.isfinite(report.latency_s), strategy
        assert report.inter_group_bytes == 0.0 and report.intra_group_bytes > 0, strategy
        assert all(tp.warm_rows == 0 or strategy != "flexshard" for tp in plan.tables)
        assert all(tp.fetch is FetchMode.FLAT for tp in plan.tables), strategy
    assert priced >= len(STRATEGIES) - 1


def _all(table: TableSpec, view, hot: int, warm: int, sync: str) -> Plan:
    return Plan("hand", (table_plan(table, view, hot, warm),), dedup=False, sync=sync)


def test_hand_computed_cold_and_hot_bytes_on_one_group_of_four():
    """Table of 4 rows, dim 4 (16 B vectors), 2 ids per sample, batch 4: n = 8 lookups per GPU; one group
    of g = N = 4 at 100 B/s.

    All cold: a GPU asks (g-1)/g n = 6 lookups of its peers and serves n/g (g-1) = 6: each way
    6 (8 + 16 + 16) = 240 B, plus 3 peers x 1 table x 8 B of split sizes = 264 B, 2.64 s.
    All hot, dense sync: payload 4 rows x 16 B = 64 B, ring all-reduce in the group 2 (3/4) 64 = 96 B
    each way, 0.96 s; no exchange, no split sizes. Nothing crosses groups in either."""
    table = one_row_table("t", [4, 3, 2, 1], 4, 2.0)
    workload = Workload("hand", (table,), batch_size_per_gpu=4)
    view = uniform_view(1, 4, 100.0, 10.0)
    for hot, sync, each_way, sync_bytes in ((0, "sparse", 264.0, 0.0), (4, "dense", 96.0, 96.0)):
        report = cost_model.evaluate(workload, view, _all(table, view, hot, 0, sync), dealt=False)
        for direction in Direction:
            np.testing.assert_allclose(report.traffic.bytes[:, INTRA, :, direction].sum(axis=1), each_way)
        np.testing.assert_allclose(report.traffic.bytes[:, INTRA, Component.SYNC, Direction.SEND], sync_bytes)
        assert np.all(report.traffic.bytes[:, INTER] == 0.0)
        np.testing.assert_allclose(report.time_s, each_way / 100.0, rtol=1e-12)
    cold = cost_model.evaluate(workload, view, _all(table, view, 0, 0, "sparse"), dealt=False)
    ids = cold.traffic.bytes[0, INTRA, Component.IDS, Direction.SEND]
    assert ids == pytest.approx(6 * INDEX_BYTES + 3 * 8)


def test_warm_rows_on_one_group_are_cold_rows_with_routing_metadata():
    """One copy per group split over its g GPUs is one copy in the cluster split over N = g: the same
    lookups and memory per GPU; warm pays 12 B of routing metadata per row and its own exchange's
    split sizes, and its sync across groups is empty. So the optimizer never needs it there."""
    table = one_row_table("t", [8, 5, 3, 2, 1, 1], 8, 3.0)
    workload = Workload("warm", (table,), batch_size_per_gpu=8)
    view = uniform_view(1, 4, 1e9, 0.0)
    warm = cost_model.evaluate(workload, view, _all(table, view, 1, 3, "sparse"), dealt=False)
    cold = cost_model.evaluate(workload, view, _all(table, view, 1, 0, "sparse"), dealt=False)
    for component in (Component.FORWARD, Component.BACKWARD, Component.SYNC):
        np.testing.assert_allclose(warm.traffic.bytes[:, :, component], cold.traffic.bytes[:, :, component])
    extra_splits = warm.traffic.bytes[:, INTRA, Component.IDS] - cold.traffic.bytes[:, INTRA, Component.IDS]
    np.testing.assert_allclose(extra_splits, 3 * 1 * 8)  # the warm exchange's split sizes, each way
    np.testing.assert_allclose(warm.memory_bytes - cold.memory_bytes, 3 * 12)  # metadata of 3 warm rows


def test_optimizer_chooses_hot_against_cold_by_brute_force_on_one_group():
    """Every (hot, warm) choice of 3 small tables, priced by the cost model, at budgets from every row cold
    to every row hot: the optimizer's plan is the cheapest that fits (latency included, so the fixed cost
    of an exchange counts), and it has no warm row."""
    view = uniform_view(1, 4, 2e9, 0.0, intra_latency_s=1e-7)
    tables = (
        one_row_table("a", [8, 5, 3, 2], 4, 2.0),
        one_row_table("b", [6, 4, 3], 2, 1.0),
        one_row_table("c", [9, 7, 4, 1, 1], 8, 3.0),
    )
    workload = Workload("one group", tables, batch_size_per_gpu=4)
    choices = [[(h, w) for h in range(t.num_rows + 1) for w in range(t.num_rows + 1 - h)] for t in tables]
    for dedup, sync in itertools.product((False, True), ("sparse", "dense")):
        priced = []
        for combo in itertools.product(*choices):
            plan_tables = tuple(table_plan(t, view, h, w) for t, (h, w) in zip(tables, combo, strict=True))
            report = cost_model.evaluate(workload, view, Plan("brute", plan_tables, dedup, sync), dealt=False)
            priced.append((report.time_with_latency_s, report.memory_per_gpu_bytes, combo))
        floor = sum(t.num_rows * t.row_bytes / 4 for t in tables)
        for factor in (1.0, 1.5, 2.0, 3.0, 4.0, 8.0):
            budget = floor * factor
            best = min(p[0] for p in priced if p[1] <= budget * (1 + 1e-12))
            config = OptimizerConfig(dedup=dedup, sync=sync, include_latency=True, step_time=False)
            res = optimize_tiers(workload, view, budget, config)
            report = cost_model.evaluate(workload, view, res.plan, dealt=False)
            assert report.memory_per_gpu_bytes <= budget * (1 + 1e-9)
            assert report.time_with_latency_s == pytest.approx(best, rel=1e-9), (dedup, sync, factor)
            assert all(tp.warm_rows == 0 for tp in res.plan.tables)
            assert np.all(report.traffic.bytes[:, INTER] == 0.0)


def test_placement_balances_owner_shares_over_unequal_links_in_one_group():
    """Intra-group links of 1, 1, 2 and 4 GB/s in one group: the balanced shares give the 4 GB/s rank the
    most cold rows and the plan is faster than with even shares; before, the program divided by the
    missing inter-group bandwidth and PuLP refused it."""
    view = dataclasses.replace(uniform_view(1, 4, 1e9, 0.0), intra_bw_Bps=np.array([1e9, 1e9, 2e9, 4e9]))
    workload = zipf_workload()
    budget = budget_bytes(workload, view, 2.0)
    even = optimize_tiers(workload, view, budget, OptimizerConfig(step_time=False)).plan
    balanced = balance(workload, view, even, budget)
    assert balanced.solver.get("placement") == "balanced"
    share = balanced.tables[0].cold_share
    assert share.sum() == pytest.approx(1.0) and share[3] == share.max() and share[3] > share[0]
    before, after = cost_model.evaluate(workload, view, even), cost_model.evaluate(workload, view, balanced)
    assert after.modeled_time_s < 0.9 * before.modeled_time_s
    assert after.memory_per_gpu_bytes <= budget * (1 + 1e-9)
    assert np.all(after.traffic.bytes[:, INTER] == 0.0)


def test_a_single_gpu_moves_nothing_and_waits_for_no_peer():
    """One GPU (``h100:1x1``, ``probe --nproc 1``): no link is used, so no bytes and no collective latency
    (it was charged 4 all-to-all hops of NVLink latency, 12 us, for an exchange with no peer)."""
    view = cluster_view(from_preset("h100:1x1"))
    workload = zipf_workload()
    for strategy in STRATEGIES:
        report = make_plan(strategy, workload, view, budget_bytes(workload, view, 1.0), config=BYTES).report
        assert np.all(report.traffic.bytes == 0.0) and report.latency_s == 0.0, strategy
        assert report.modeled_time_s == 0.0 and report.time_with_latency_s == 0.0, strategy
