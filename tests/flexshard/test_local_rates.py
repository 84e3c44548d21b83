"""The time model's local rates measured on the machine at hand (flexshard.local_rates) and how the
benchmark uses them (--rates): units per piece, the rate arithmetic, the pieces' results against brute
force, the median over real ranks, the flag's errors and the prediction with a measured local step."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from flexshard.bench.config import BenchConfig, check
from flexshard.bench.data import default_data
from flexshard.bench.plans import h100_view
from flexshard.bench.predict import predicted_parts_ms
from flexshard.bench.worker import machine_rates
from flexshard.local_rates import (
    PIECES,
    RATE_FIELD,
    RatePoint,
    measured_rates,
    pack,
    rates_from_points,
    route,
    time_in_turn,
    time_pieces,
)
from flexshard.runtime.local import run_on_ranks
from solvers.planner import budget_bytes, make_plan
from solvers.time_model import step_time
from solvers.time_types import LocalRates

BASE = LocalRates(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, "base", 7.0, 8.0, 9.0, 10.0)


def test_a_rate_is_summed_seconds_over_summed_units():
    points = [
        RatePoint("gather", 64, 100, 1.0),
        RatePoint("gather", 32, 300, 1.0),
        RatePoint("dedup", 0, 50, 0.5),
    ]
    got = rates_from_points(points, BASE, "here")
    assert got.gather_s_per_value == pytest.approx(2.0 / 400)
    assert got.dedup_s_per_lookup == pytest.approx(0.01)
    # pieces without points and the host terms keep the base's figures
    assert (got.route_s_per_lookup, got.update_s_per_value, got.pack_s_per_value) == (2.0, 5.0, 7.0)
    assert (got.collective_call_s, got.table_stage_s, got.step_s) == (6.0, 9.0, 10.0)
    assert got.source == "here"


def test_every_piece_is_timed_in_its_units():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 500, (3000,), generator=gen)
    uniq = int(torch.unique(ids).numel())
    points = {p.piece: p for p in time_pieces(ids, 16, 500, min_s=0.0)}
    assert list(points) == list(PIECES)
    n = 3000
    expected = {"dedup": n, "route": n, "gather": n * 16, "scatter_add": n * 16, "update": uniq * 16,
                "output": n * 16, "pack": 2 * n * 16}  # fmt: skip
    assert {k: p.units for k, p in points.items()} == expected
    assert all(p.seconds > 0 and p.dim == 16 for p in points.values())


def test_runs_are_timed_in_turn_with_one_untimed_turn(monkeypatch):
    """Each turn runs every run once in order; the first is untimed; turns go on until they took
    ``min_s`` per run in all (at least 3); a point is a run's mean seconds (a fake clock: a takes 1 s,
    b 3 s)."""
    import flexshard.local_rates as lr

    clock, order = [0.0], []

    def run(name, seconds):
        def fn():
            order.append(name)
            clock[0] += seconds

        return fn

    monkeypatch.setattr(lr.time, "perf_counter", lambda: clock[0])
    runs = [(8, ("gather", 10, run("a", 1.0))), (4, ("dedup", 6, run("b", 3.0)))]
    points = time_in_turn(runs, min_s=0.0)
    assert order == ["a", "b"] * 4  # the untimed turn, then 3
    assert points == [RatePoint("gather", 8, 10, 1.0), RatePoint("dedup", 4, 6, 3.0)]
    order.clear()
    time_in_turn(runs, min_s=10.0)  # 2 runs x 10 s: 4 turns take 16 s, 5 take 20
    assert order == ["a", "b"] * 6
    assert time_in_turn([], min_s=1.0) == []


def test_the_job_times_each_piece_over_every_table_in_turn(monkeypatch):
    import flexshard.local_rates as lr

    seen = []

    def fake(runs, min_s, sync):
        seen.append([(piece, dim, units) for dim, (piece, units, _) in runs])
        return [RatePoint(piece, dim, units, 1.0) for dim, (piece, units, _) in runs]

    monkeypatch.setattr(lr, "time_in_turn", fake)
    a, b = torch.arange(5) % 3, torch.arange(7) % 4
    empty = torch.zeros(0, dtype=torch.int64)
    got = measured_rates([(a, 2, 10), (empty, 8, 10), (b, 4, 10)], BASE, repeats=2)
    expected = []
    for piece in PIECES:  # piece-major, as a step runs them; a table without lookups has no runs
        for ids, dim in ((a, 2), (b, 4)):
            n, uniq = ids.numel(), int(torch.unique(ids).numel())
            units = {"dedup": n, "route": n, "update": uniq * dim, "pack": 2 * n * dim}.get(piece, n * dim)
            expected.append((piece, dim, units))
    assert seen == [expected, expected]
    assert got.dedup_s_per_lookup == pytest.approx(2 / 12)  # 1 s per run, 5 + 7 lookups


def test_route_and_pack_do_what_the_runtime_does():
    ids = torch.tensor([5, 9, 2, 9, 14, 3, 5, 0])
    hot = torch.tensor([2, 9])
    order, owner_sorted_index = route(hot, ids, peers=4)
    owner = np.where(np.isin(ids.numpy(), hot.numpy()), -1, ids.numpy() % 4)
    assert order.tolist() == sorted(owner.tolist())
    assert owner_sorted_index.tolist() == np.argsort(owner, kind="stable").tolist()
    columns = [torch.arange(12.0).view(4, 3), torch.ones(2, 5), torch.zeros(0, 2)]
    out = pack(columns)
    assert [o.shape for o in out] == [c.shape for c in columns]
    assert all(torch.equal(o, c) for o, c in zip(out, columns, strict=True))
    assert out[0].data_ptr() != columns[0].data_ptr()  # copied out of the buffer


def test_one_process_keeps_the_host_terms_and_measures_the_rest():
    ids = torch.randint(0, 1000, (2000,))
    got = measured_rates([(ids, 8, 1000), (torch.zeros(0, dtype=torch.int64), 8, 10)], BASE, min_s=0.0)
    assert (got.collective_call_s, got.table_stage_s, got.step_s) == (6.0, 9.0, 10.0)
    for piece in PIECES:
        value = getattr(got, RATE_FIELD[piece])
        assert math.isfinite(value) and 0 < value < 1e-3, piece  # seconds per unit, not the base's
    assert got.source == "measured on the job's 1 rank at the run's sizes; host: base"


def _ranks_measure(rank: int, world: int) -> list[float]:
    ids = torch.randint(0, 1000, (1000 * (rank + 1),), generator=torch.Generator().manual_seed(rank))
    got = measured_rates([(ids, 8, 1000)], BASE, min_s=0.0)
    return [getattr(got, RATE_FIELD[p]) for p in PIECES] + [got.source]


@pytest.mark.slow
def test_every_rank_prices_with_the_median_over_ranks():
    got = run_on_ranks(_ranks_measure, 3)
    assert got[0] == got[1] == got[2]  # one set of rates for the job, whichever rank made the plans
    assert got[0][-1].startswith("measured on the job's 3 ranks")


def test_the_flag_takes_measured_stored_or_a_rates_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        check(BenchConfig(rates="fast"))
    assert str(err.value).startswith("--rates: expected measured, stored or a rates file; local rates file")
    assert "'fast'" in str(err.value) and "\n" not in str(err.value)
    path = tmp_path / "rates.json"
    BASE.save(path)
    cfg = BenchConfig(rates=str(path))
    check(cfg)
    assert machine_rates(cfg) == BASE  # a file is used as written
    stored = machine_rates(BenchConfig(nproc=4, rates="stored"))
    assert stored == machine_rates(BenchConfig(nproc=4, rates="measured"))  # no data: the stored figures


def test_a_measured_local_step_replaces_the_modeled_local_work():
    """A local step measured as a whole (TorchRec's, its buffer copies included) stands in for the whole
    modeled local work, the buffer copies (the pack piece) too; latency and bandwidth stay modeled."""
    data = default_data(16, 0, 4)
    view = h100_view(4, 2)
    plan = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0)).plan
    rates = replace(LocalRates.default(), source="t")
    st = step_time(data.workload, view, plan, rates=rates)
    assert st.local_by_piece["pack"] > 0  # a piece the measured step's own copies replace
    got = predicted_parts_ms(data.workload, view, plan, rates=rates, local_s=0.004)
    assert got["total"] == pytest.approx((st.latency_s + st.bandwidth_s + 0.004) * 1e3, rel=1e-12)
    assert got["local"] == pytest.approx(4.0, rel=1e-12) and got["host"] == 0.0
    modeled = predicted_parts_ms(data.workload, view, plan, rates=rates)["total"]
    assert modeled == pytest.approx(st.total_s * 1e3)


def test_the_prediction_names_its_host_part_the_stored_terms_per_step_and_per_table_stage():
    """The ``host`` part (of ``local``) is ``step_s + (stage_s + table_stage_s x tables) x collectives``:
    the row-wise plan's 3 collectives of 3 tables priced by hand; twice the terms, twice the part and the
    rest of the step unchanged; 0 where a measured local step (TorchRec's) stands in."""
    data = default_data(16, 0, 4)
    view = h100_view(4, 2)
    plan = make_plan("row_wise", data.workload, view, budget_bytes(data.workload, view, 1.0)).plan
    rates = replace(LocalRates.default(), step_s=2e-3, stage_s=1e-4, table_stage_s=5e-4, source="t")
    got = predicted_parts_ms(data.workload, view, plan, rates=rates)
    assert got["host"] == pytest.approx((2e-3 + (1e-4 + 5e-4 * 3) * 3) * 1e3, rel=1e-12)  # 6.8 ms
    doubled = predicted_parts_ms(
        data.workload, view, plan, rates=replace(rates, step_s=4e-3, stage_s=2e-4, table_stage_s=1e-3)
    )
    assert doubled["host"] == pytest.approx(2 * got["host"], rel=1e-12)
    assert doubled["total"] - doubled["host"] == pytest.approx(got["total"] - got["host"], rel=1e-12)
    assert predicted_parts_ms(data.workload, view, plan, rates=rates, local_s=0.004)["host"] == 0.0
