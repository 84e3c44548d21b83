"""The time model: latency interpolation, local rates and hand-computed step times on 2 groups x 2 GPUs."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from core.errors import ConfigError, TopologyError
from core.vocabulary import FetchMode, SyncMode, WireDtype
from solvers.cost_model import table_plan
from solvers.schedule import torchrec_schedule
from solvers.time_model import step_time
from solvers.time_types import LatencyTable, LocalRates
from solvers.types import Plan, RowHistogram, TableSpec, Workload
from topology import from_preset, read_json, write_json
from topology.latency import parse_latency
from topology.views import cluster_view, uniform_view

REL = 1e-12
VIEW = uniform_view(2, 2, 100.0, 10.0)  # N = 4 in groups of 2, as tests/solvers/test_cost_model.py
TABLE = TableSpec(
    "a",
    num_rows=4,
    dim=2,
    ids_per_sample=1.0,
    hist=RowHistogram(rows=np.ones(4, dtype=np.int64), prob=np.array([0.4, 0.3, 0.2, 0.1])),
    element_bytes=4,
)
WORKLOAD = Workload("hand", (TABLE,), batch_size_per_gpu=3)  # n = 3 lookups per GPU
# seconds: a world all-to-all 1, a group one 0.5, a world all-reduce 2, a rail one 1.5
TABLE_S = LatencyTable(
    parse_latency(
        {
            "all_to_all": {"world": {"4": 1e6}, "group": {"2": 0.5e6}},
            "all_reduce": {"world": {"4": 2e6}, "rail": {"2": 1.5e6}},
        }
    )
)
RATES = LocalRates(1.0, 2.0, 3.0, 5.0, 7.0, 11.0)  # dedup, route, gather, scatter-add, update, call


def _plan(hot: int, dedup: bool = False) -> Plan:
    return Plan("hand", (table_plan(TABLE, VIEW, hot, 0),), dedup=dedup, sync=SyncMode.SPARSE)


# --- latency table ------------------------------------------------------------------------------


def test_interpolation_is_linear_in_log2_participants():
    table = LatencyTable(parse_latency({"all_to_all": {"world": {"2": 10.0, "8": 30.0}}}))
    # log2 4 = 2 is halfway between log2 2 = 1 and log2 8 = 3
    assert table.seconds("all_to_all", "world", 4) == pytest.approx(20e-6, rel=REL)
    assert table.seconds("all_to_all", "world", 8) == pytest.approx(30e-6, rel=REL)
    assert table.seconds("all_to_all", "world", 1) == 0.0


def test_beyond_the_points_all_to_all_scales_with_peers_and_all_reduce_with_depth():
    table = LatencyTable(
        parse_latency(
            {"all_to_all": {"rail": {"4": 12.0, "8": 30.0}}, "all_reduce": {"world": {"2": 10.0, "16": 40.0}}}
        )
    )
    assert table.seconds("all_to_all", "rail", 16) == pytest.approx(30e-6 * 15 / 7, rel=REL)
    assert table.seconds("all_to_all", "rail", 2) == pytest.approx(12e-6 * 1 / 3, rel=REL)
    assert table.seconds("all_reduce", "world", 64) == pytest.approx(40e-6 * 6 / 4, rel=REL)


def test_a_kind_and_scope_without_points_uses_the_link_model():
    table = LatencyTable({}, intra_link_s=3e-6, inter_link_s=8e-6)
    assert table.seconds("all_to_all", "group", 8) == 3e-6
    assert table.seconds("all_to_all", "world", 16) == 8e-6
    assert table.seconds("all_reduce", "rail", 5) == pytest.approx(2 * math.ceil(math.log2(5)) * 8e-6)


def test_preset_figures_reach_the_view_and_round_trip_through_a_topology_file(tmp_path):
    G = from_preset("h100:2")
    write_json(G, tmp_path / "t.json")
    view = cluster_view(read_json(tmp_path / "t.json"))
    table = LatencyTable.from_view(view)
    assert table.seconds("all_reduce", "world", 16) == pytest.approx(47.6e-6, rel=REL)
    assert table == LatencyTable.from_view(cluster_view(G))
    assert table.source.startswith("NCCL figures")


def test_probe_latency_round_trips_through_the_topology_file(tmp_path):
    G = from_preset("skewed:2x2")
    measured = {
        "all_to_all": {"world": {"4": 812.5}, "group": {"2": 95.0}},
        "all_reduce": {"rail": {"2": 130}},
    }
    G.graph["collective_latency_us"] = measured
    G.graph["collective_latency_source"] = "flexshard probe, gloo on loopback"
    write_json(G, tmp_path / "t.json")
    view = cluster_view(read_json(tmp_path / "t.json"))
    assert view.collective_latency_us == {
        "all_to_all": {"world": {4: 812.5}, "group": {2: 95.0}},
        "all_reduce": {"rail": {2: 130.0}},
    }
    assert view.collective_latency_source == "flexshard probe, gloo on loopback"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"broadcast": {}}, "kind 'broadcast'"),
        ({"all_to_all": {"pod": {"2": 1.0}}}, "scope 'pod'"),
        ({"all_to_all": {"world": {"1": 1.0}}}, "participants '1'"),
        ({"all_reduce": {"world": {"4": -3.0}}}, "= -3.0; expected a positive number"),
        ([1, 2], "expected an object"),
    ],
)
def test_bad_latency_attributes_are_named(value, message):
    G = from_preset("h100:1")
    G.graph["collective_latency_us"] = value
    with pytest.raises(TopologyError, match="collective_latency_us") as err:
        cluster_view(G)
    assert message in str(err.value)


def test_preset_tables_at_scale_and_from_the_graph():
    """The h100 preset's figures: fabric all-to-all 83 us at 64 GPUs and 531 us at 512 (20 us + 1 us per
    peer), world all-reduce 47.6 us at 16 (NVIDIA/nccl#1244); beyond 512 an all-to-all grows per peer."""
    G = from_preset("h100:8")
    table = LatencyTable.from_graph(G)
    assert table.seconds("all_to_all", "world", 64) == pytest.approx(83e-6, rel=REL)
    assert table.seconds("all_to_all", "world", 512) == pytest.approx(531e-6, rel=REL)
    assert table.seconds("all_to_all", "world", 1024) == pytest.approx(531e-6 * 1023 / 511, rel=REL)
    assert table.seconds("all_reduce", "world", 16) == pytest.approx(47.6e-6, rel=REL)
    assert LatencyTable.preset("nvl72").seconds("all_to_all", "group", 72) == pytest.approx(59.7e-6, rel=REL)
    with pytest.raises(ConfigError, match="latency preset 'a100'"):
        LatencyTable.preset("a100")


def test_local_rates_for_a_view_say_where_they_come_from():
    gpus = cluster_view(from_preset("h100:2"))
    assert LocalRates.for_view(gpus).source.startswith("assumed: H100 HBM")
    assert LocalRates.for_view(gpus, "measured").source.startswith("H100: value work at the HBM roofline")
    assert LocalRates.for_view(VIEW) == LocalRates.for_view(VIEW, "measured") == LocalRates.default()
    assert LocalRates.default().source.startswith("experiments/calibrate_local.py")
    # a probed host where 4 ranks share each core: every rate 4x this machine's, and it says so
    crowded = LocalRates.for_view(replace(VIEW, ranks_per_core=4.0))
    default = LocalRates.default()
    assert all(getattr(crowded, f) == 4 * getattr(default, f) for f in LocalRates.FIELDS)
    assert crowded.source.endswith("x4 (4 ranks per core)")
    assert LocalRates.for_view(replace(VIEW, ranks_per_core=0.25)) == default  # idle cores: as is
    assert LocalRates.for_view(replace(gpus, ranks_per_core=4.0)).source.startswith("assumed: H100")
    with pytest.raises(ConfigError, match="gpu host work 'slow': unknown; expected one of fused, measured"):
        LocalRates.for_view(gpus, "slow")


def test_measured_gpu_host_terms_are_the_runtime_ops_at_the_h100_cost_per_op():
    """0 ops a step, 39.63 per table, 35.58 per collective and 0.80 per table per collective at 25.95 us
    each (time_types' comment): 3 tables and 5 collectives are 118.89 + 177.9 + 12.0 = 308.79 ops,
    8.0131 ms; the value work is the roofline's, unchanged."""
    from solvers.time_types import GPU_ROOFLINE_RATES, H100_RUNTIME_RATES

    assert H100_RUNTIME_RATES.step_s == 0.0
    assert H100_RUNTIME_RATES.table_s == pytest.approx(39.63 * 25.95e-6, rel=1e-12)
    assert H100_RUNTIME_RATES.stage_s == pytest.approx(35.58 * 25.95e-6, rel=1e-12)
    assert H100_RUNTIME_RATES.table_stage_s == pytest.approx(0.80 * 25.95e-6, rel=1e-12)
    assert H100_RUNTIME_RATES.host_s(3, 5) == pytest.approx(8.0131e-3, rel=1e-4)
    assert GPU_ROOFLINE_RATES.host_s(3, 5) == 0.0
    for name in ("gather_s_per_value", "scatter_add_s_per_value", "dedup_s_per_lookup", "collective_call_s"):
        assert getattr(H100_RUNTIME_RATES, name) == getattr(GPU_ROOFLINE_RATES, name)


def test_with_the_measured_gpu_host_the_group_fetch_pays_its_two_stages_per_table():
    """On 4 GPUs in 2 H100 nodes at the bench's 3 tables, a group fetch costs 2 more collectives, so
    ``2 x (stage_s + 3 x table_stage_s) + 2 x collective_call_s`` more host work than a flat fetch
    (hand-computed, 2 x (35.58 + 2.4) ops x 25.95 us + 10 us = 1.981 ms), far above the fabric time
    it saves: the planner priced with the measured host fetches flat (the group-fetch plan priced so is
    slower) and the one priced fused keeps the group fetch."""
    from flexshard.bench.data import default_data
    from flexshard.bench.plans import h100_view
    from solvers.planner import budget_bytes, make_plan
    from solvers.tier_program import OptimizerConfig
    from solvers.time_types import H100_RUNTIME_RATES as R

    w, view = default_data(1024, 0, 4).workload, h100_view(4, 2)
    budget = budget_bytes(w, view, 2.0)
    fused, measured = (
        make_plan("flexshard", w, view, budget, config=OptimizerConfig(gpu_host=host))
        for host in ("fused", "measured")
    )
    assert fused.plan.cold_fetch(FetchMode.GROUP) and fused.step.collectives == 5
    assert not measured.plan.cold_fetch(FetchMode.GROUP) and measured.step.collectives == 3
    group = step_time(w, view, fused.plan, rates=R)  # the group-fetch plan, priced with the measured host

    def host_s(step) -> float:
        return step.local_by_piece["host"] + step.local_by_piece["calls"]

    extra = 2 * (R.stage_s + 3 * R.table_stage_s) + 2 * R.collective_call_s
    assert host_s(group) - host_s(measured.step) == pytest.approx(extra, rel=1e-9)
    assert extra == pytest.approx(1.9812e-3, rel=1e-4)
    assert measured.step.total_s < group.total_s


# --- local rates --------------------------------------------------------------------------------


def test_local_rates_round_trip_and_bad_fields(tmp_path):
    RATES.save(tmp_path / "r.json")
    assert LocalRates.load(tmp_path / "r.json") == RATES
    with pytest.raises(ConfigError, match="'route_s_per_lookup' = -1"):
        LocalRates(1.0, -1, 3.0, 5.0, 7.0, 11.0)
    (tmp_path / "bad.json").write_text('{"dedup_s_per_lookup": 1}')
    with pytest.raises(ConfigError, match="missing field 'route_s_per_lookup'"):
        LocalRates.load(tmp_path / "bad.json")


# --- hand-computed step times, 2 groups x 2 GPUs, one table -------------------------------------


def test_all_cold_step_by_hand():
    st = step_time(WORKLOAD, VIEW, _plan(0), TABLE_S, RATES, dealt=False)
    # stages ids, rows, grads: world all-to-alls of 4 ranks, 1 s each
    assert [s.name for s in st.stages] == ["ids", "rows", "grads"]
    assert st.collectives == 3 and st.latency_s == pytest.approx(3.0, rel=REL)
    # bytes: tests/solvers/test_cost_model.py::test_all_cold_no_dedup, 5.46 s (send = recv per component)
    assert st.bandwidth_s == pytest.approx(5.46, rel=REL)
    # local: 3 lookups routed (2 s each); 3 rows served (share 1/4 of 3 lookups from 4 ranks);
    # gather and scatter-add of 3 + 3 rows of 2 values, 4 calls; the owner updates each of its rows
    # touched anywhere once: 12 lookups in the cluster touch sum(1 - (1 - p)^12) rows, a quarter of
    # them its own, 2 values at 7 s each
    touched = sum(1 - (1 - p) ** 12 for p in (0.4, 0.3, 0.2, 0.1))  # 3.6328...
    update = 7.0 * 2 * touched / 4  # 12.71 s: not 42 (one update per served row)
    pieces = {"dedup": 0.0, "route": 6.0, "gather": 36.0, "scatter_add": 60.0, "update": update}
    pieces |= {"calls": 33.0, "pack": 0.0, "output": 0.0, "host": 0.0}  # work around the exchange: 0 here
    assert st.local_by_piece == pytest.approx(pieces, rel=REL)
    assert st.local_s == pytest.approx(135.0 + update, rel=REL)
    assert st.total_s == pytest.approx(3.0 + 5.46 + 135.0 + update, rel=REL)


def test_torchrec_runs_the_same_plan_in_its_five_collectives_by_hand():
    plain = step_time(WORKLOAD, VIEW, _plan(0), TABLE_S, RATES, dealt=False)
    st = step_time(WORKLOAD, VIEW, _plan(0), TABLE_S, RATES, dealt=False, stages=torchrec_schedule(VIEW))
    # splits, lengths and values of the jagged ids, rows back, gradients out: world all-to-alls, 1 s each
    assert [s.name for s in st.stages] == ["splits", "lengths", "ids", "rows", "grads"]
    assert st.collectives == 5 and st.latency_s == pytest.approx(5.0, rel=REL)
    # the same bytes; two more calls at 11 s each; the host terms (0 here) stay the runtime's
    assert st.bandwidth_s == plain.bandwidth_s
    assert st.local_by_piece == pytest.approx(plain.local_by_piece | {"calls": 55.0}, rel=REL)
    assert st.total_s == pytest.approx(plain.total_s + 2.0 + 22.0, rel=REL)
    host = replace(RATES, step_s=100.0, table_stage_s=1000.0)  # 100 + 1000 x 1 table x 3 runtime stages
    priced = step_time(WORKLOAD, VIEW, _plan(0), TABLE_S, host, dealt=False, stages=torchrec_schedule(VIEW))
    assert priced.local_by_piece["host"] == pytest.approx(3100.0, rel=REL)


def test_work_around_the_exchange_by_hand():
    # only the pieces around the exchange priced: a value packed 1 s, an output value 10 s, a table's
    # host work per collective 100 s, a step's 1000 s
    rates = LocalRates(0, 0, 0, 0, 0, 0, pack_s_per_value=1.0, output_s_per_value=10.0)
    rates = replace(rates, table_stage_s=100.0, step_s=1000.0)
    st = step_time(WORKLOAD, VIEW, _plan(0), TABLE_S, rates, dealt=False)
    # all cold, no dedup: 3 lookups requested and 3 served (share 1/4 of 3 from 4 ranks), 2 values each;
    # one table, float32 wire: a requested value is copied twice (placed, its gradient packed), a served
    # one once (gathered straight into the send buffer; its gradient joined): 2 x (2 x 3 + 3); the loss
    # over 3 x 2 output values; one table in 3 collectives (ids, rows, grads)
    assert st.local_by_piece["pack"] == pytest.approx(18.0, rel=REL)
    assert st.local_by_piece["output"] == pytest.approx(60.0, rel=REL)
    assert st.local_by_piece["host"] == pytest.approx(1000.0 + 100.0 * 3, rel=REL)
    assert st.local_s == pytest.approx(1378.0, rel=REL)
    # on a bf16 wire every value goes into and out of the buffers both ways: 2 x 2 x (3 + 3)
    bf16 = replace(_plan(0), wire=WireDtype.BF16)
    assert step_time(WORKLOAD, VIEW, bf16, TABLE_S, rates, dealt=False).local_by_piece[
        "pack"
    ] == pytest.approx(24.0, rel=REL)
    # one hot row: its lookups (3 x 0.4) are neither requested nor served; 7 collectives
    hot = step_time(WORKLOAD, VIEW, _plan(1), TABLE_S, rates, dealt=False)
    assert hot.local_by_piece["pack"] == pytest.approx(2 * (2 * 1.8 + 1.8), rel=REL)
    assert hot.local_by_piece["output"] == pytest.approx(60.0, rel=REL)
    assert hot.local_by_piece["host"] == pytest.approx(1000.0 + 100.0 * 7, rel=REL)


def test_one_hot_row_step_by_hand():
    st = step_time(WORKLOAD, VIEW, _plan(1), TABLE_S, RATES, dealt=False)
    names = [s.name for s in st.stages]
    assert names == [
        "ids",
        "rows",
        "grads",
        "sync_mask",
        "sync_group_reduce",
        "sync_rail",
        "sync_group_gather",
    ]
    # 3 world all-to-alls (1 s), the mask's world all-reduce (2 s), two group all-to-alls (0.5 s), a rail
    # all-reduce (1.5 s)
    assert st.latency_s == pytest.approx(7.5, rel=REL)
    assert st.bandwidth_s == pytest.approx(
        4.48695514447872, rel=1e-12
    )  # test_one_hot_row_sparse_sync_no_dedup
    touched = 0.997823217664  # row 0 touched somewhere: 1 - 0.6^12
    served = 1.8  # cold lookups 3 * 0.6, share 1/4, from 4 ranks
    rows = 3 + served + touched
    assert st.local_by_piece["gather"] == pytest.approx(3.0 * 2 * rows, rel=REL)
    assert st.local_by_piece["scatter_add"] == pytest.approx(5.0 * 2 * rows, rel=REL)
    # updated once each: the owner's cold rows touched anywhere (rows 1-3, a quarter of them), the hot row
    cold_touched = sum(1 - (1 - p) ** 12 for p in (0.3, 0.2, 0.1)) / 4  # 0.6588
    assert st.local_by_piece["update"] == pytest.approx(7.0 * 2 * (cold_touched + touched), rel=REL)
    local = 6.0 + 8.0 * 2 * rows + 14.0 * (cold_touched + touched) + 7 * 11.0
    assert st.local_s == pytest.approx(local, rel=REL)
    assert st.total_s == pytest.approx(7.5 + 4.48695514447872 + local, rel=REL)
    # overlap: the sync (4.5 s latency, its bytes, 30 s per synced row) runs beside the next input (1 s
    # latency, the ids' bytes, routing): the step pays the larger of the two
    input_part = 1.0 + (11.6 / 100 + 23.2 / 10) + 6.0
    sync_part = 4.5 + (8.982585741312 / 100 + 4.491292870656 / 10) + 30.0 * touched
    piped = step_time(WORKLOAD, VIEW, _plan(1), TABLE_S, RATES, overlap=True, dealt=False)
    assert piped.total_s == pytest.approx(st.total_s - input_part - sync_part + max(input_part, sync_part))
    assert piped.overlapped_s == pytest.approx(min(input_part, sync_part))  # what the pipeline hides
    assert st.overlapped_s == 0.0


def test_group_fetch_work_by_hand():
    # all cold, fetched once per group, no dedup; a lookup routed 2 s, deduplicated 1 s, a value packed 1 s
    rates = LocalRates(1.0, 2.0, 0, 0, 0, 0, pack_s_per_value=1.0)
    plan = Plan("hand", (table_plan(TABLE, VIEW, 0, 0, FetchMode.GROUP),), dedup=False, sync=SyncMode.SPARSE)
    st = step_time(WORKLOAD, VIEW, plan, TABLE_S, rates, dealt=False)
    # even shares 1/4: this rank's 3 lookups, half of them owned in the other group (routed again as
    # slots: 1.5); as a rail peer it relays its group's keys owned at its position, (1/4 + 1/4) x 3 x 2 =
    # 3 (not routed: they carry owner and slot); as an owner it deduplicates the slots of the other
    # group's 2 ranks, 1/4 x 3 x 2 = 1.5
    assert st.local_by_piece["route"] == pytest.approx(2.0 * (3 + 1.5), rel=REL)
    assert st.local_by_piece["dedup"] == pytest.approx(1.0 * 1.5, rel=REL)
    # with dedup on 2 groups the lookups dedup into the order both columns are sent in: routed once, and
    # only the distinct ids, sum over rows of 1 - (1 - p)^3 = 0.784 + 0.657 + 0.488 + 0.271 = 2.2
    deduped = Plan("hand", plan.tables, dedup=True, sync=SyncMode.SPARSE)
    once = step_time(WORKLOAD, VIEW, deduped, TABLE_S, rates, dealt=False)
    assert VIEW.num_groups == 2 and once.local_by_piece["route"] == pytest.approx(2.0 * 2.2, rel=REL)
    # one table, float32 wire: the owner's rows go straight into the send buffer and the relay's rows and
    # sums stay where they arrive; only the requested values are copied, twice: 2 x 2 x 3
    assert st.local_by_piece["pack"] == pytest.approx(12.0, rel=REL)
    # on a bf16 wire: distinct rows per group (6 lookups); served once per group, 1/4 x 2 groups; fetched
    # by the rail peer, half of them; values in and out both ways: 2 x 2 x (requested + served + relay +
    # fetched)
    group_rows = sum(1 - (1 - p) ** 6 for p in (0.4, 0.3, 0.2, 0.1))
    pack = 2 * 2 * (3 + group_rows / 2 + 3 + group_rows / 2)
    bf16 = step_time(WORKLOAD, VIEW, replace(plan, wire=WireDtype.BF16), TABLE_S, rates, dealt=False)
    assert bf16.local_by_piece["pack"] == pytest.approx(pack, rel=REL)


def test_dedup_prices_every_lookup_routes_distinct_ids_and_one_rank_has_no_collectives():
    st = step_time(WORKLOAD, VIEW, _plan(0, dedup=True), TABLE_S, RATES, dealt=False)
    assert st.local_by_piece["dedup"] == pytest.approx(3.0, rel=REL)
    one = uniform_view(1, 1, 100.0, 0.0)
    plan = Plan("one", (table_plan(TABLE, one, 0, 0),), dedup=True, sync=SyncMode.SPARSE)
    st1 = step_time(WORKLOAD, one, plan, TABLE_S, RATES, dealt=False)
    assert st1.collectives == 0 and st1.latency_s == 0.0 and st1.bandwidth_s == 0.0
    # 3 lookups: dedup 3, gather 3 * 2 * 3 = 18, scatter-add 5 * 2 * 3 = 30; the 2.2 distinct ids of the
    # batch routed, 2 * 2.2 = 4.4, and their rows updated, 7 * 2 * 2.2 = 30.8; nothing served
    assert st1.total_s == pytest.approx(3.0 + 4.4 + 18.0 + 30.0 + 30.8, rel=REL)


def test_rates_of_ranks_sharing_a_core_scale_every_piece():
    base = LocalRates.default()
    assert base.shared(0.5) is base and base.shared(1.0) is base  # a core each: unchanged
    twice = base.shared(2.0)
    for name in LocalRates.FIELDS:
        assert getattr(twice, name) == pytest.approx(2.0 * getattr(base, name), rel=1e-15)
    assert "2 ranks per core" in twice.source


def test_rates_files_with_fields_of_older_versions_still_load(tmp_path):
    # the collectives' wait was a separate term until 2026-11-26 (the host terms hold it): ignored
    path = tmp_path / "rates.json"
    path.write_text(json.dumps({name: 1.0 for name in LocalRates.REQUIRED} | {"collective_wait_s": 0.5}))
    assert LocalRates.load(path) == LocalRates(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)


def test_a_plan_priced_pipelined_is_never_above_a_baseline_pipelined():
    """OptimizerConfig(overlap=True) (plan/simulate --pipeline on) compares candidates by the pipelined
    step: here a baseline's replicas pay once their sync hides under the next batch's id exchange, so the
    plan differs from the unpipelined objective's and is cheaper pipelined; no baseline is cheaper."""
    from core.errors import PlannerError
    from flexshard import workloads
    from solvers.planner import BASELINES, budget_bytes, make_plan
    from solvers.tier_program import OptimizerConfig
    from topology import cluster_view, from_preset

    w = workloads.synthetic_workload(4, 200_000, 1.0)
    view = cluster_view(from_preset("h100:2"))  # 16 GPUs (at 64 no replica pays, pipelined or not)
    budget = budget_bytes(w, view, 2.0)
    on = make_plan("flexshard", w, view, budget, config=OptimizerConfig(overlap=True))
    off = make_plan("flexshard", w, view, budget)
    assert on.step.overlap and not off.step.overlap
    assert sum(tp.hot_rows + tp.warm_rows for tp in on.plan.tables) > 0  # replicas, their sync hidden
    assert sum(tp.hot_rows + tp.warm_rows for tp in off.plan.tables) == 0
    assert on.step.overlapped_s > 0
    assert on.step.total_s < step_time(w, view, off.plan, overlap=True).total_s
    for name in BASELINES:
        try:
            base = make_plan(name, w, view, budget)
        except PlannerError:  # infeasible under the budget
            continue
        assert on.step.total_s <= step_time(w, view, base.plan, overlap=True).total_s * (1 + 1e-9), name


def test_buffer_copies_follow_the_runtimes_paths():
    from solvers.time_types import BufferCopies

    # one dim on a float32 wire: rows gathered straight into send buffers (flexshard.runtime.relay)
    assert BufferCopies.of([64, 64, 64], WireDtype.FP32) == BufferCopies(2.0, 1.0, 0.0)
    assert BufferCopies.of([64], "fp32") == BufferCopies(2.0, 1.0, 0.0)
    # every table relayed in scatter's wire order: the requester copies none of its rows or gradients
    assert BufferCopies.of([64, 64], WireDtype.FP32, wire_order=True) == BufferCopies(0.0, 1.0, 0.0)
    assert BufferCopies.of([32, 64], WireDtype.FP32, wire_order=True) == BufferCopies(2.0, 2.0, 2.0)
    # two dims, or a 16-bit wire: every value into and out of the buffers both ways
    assert BufferCopies.of([32, 64], WireDtype.FP32) == BufferCopies(2.0, 2.0, 2.0)
    assert BufferCopies.of([64, 64], WireDtype.FP16) == BufferCopies(2.0, 2.0, 2.0)
