"""TorchRec's default layout (solvers.torchrec_default): contiguous ranges of the ids as given, and for
tables without an id order the expected slowest rank over uniformly random id orders, against brute
force over every id order and hand-computed figures."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from core.vocabulary import COMPONENTS, Deal, LinkClass
from solvers import dealing, torchrec_default
from solvers.baselines import row_wise, torchrec_default_report
from solvers.cost_model import evaluate
from solvers.types import RowHistogram, TableSpec, Workload
from topology.views import uniform_view

VIEW = uniform_view(2, 2, 100.0, 10.0)


def _table(name: str, prob: list[float], rows: list[int] | None = None) -> TableSpec:
    rows = np.ones(len(prob), dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
    return TableSpec(name, int(rows.sum()), 2, 1.0, RowHistogram(rows, np.asarray(prob)), element_bytes=4)


def test_range_deal_hand_computed():
    # 8 rows on 3 ranks: ranges of ceil(8/3) = 3 ids, the last one short
    np.testing.assert_array_equal(dealing.range_rows(8, 3), [3, 3, 2])
    # one bucket of 5 rows (value 1 each) and 3 rows of value 10; ids hottest first [7, 0, 4, 1, 2, 3, 5, 6]:
    # the rows of value 10 are ids 7 (rank 2), 0 (rank 0), 4 (rank 1); every rank also gets its other ids
    edges = np.array([0.0, 3.0, 8.0])
    cumulative = np.array([[0.0], [30.0], [35.0]])
    order = np.array([7, 0, 4, 1, 2, 3, 5, 6])
    rows, masses = dealing.range_masses(edges, cumulative, order, 8, 3)
    np.testing.assert_array_equal(rows, [3, 3, 2])
    np.testing.assert_allclose(masses[:, 0], [10 + 2, 10 + 2, 10 + 1])


def _brute_force_max(values: np.ndarray, num_ranks: int) -> float:
    """E[max over ranks of the sum of its range's values] over every order of the ids."""
    size = dealing.range_size(values.size, num_ranks)
    owner = np.arange(values.size) // size
    total, count = 0.0, 0
    for perm in itertools.permutations(range(values.size)):
        total += np.bincount(owner, weights=values[list(perm)], minlength=num_ranks).max()
        count += 1
    return total / count


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize(
    "values",
    [
        [8.0, 4.0, 2.0, 1.0, 1.0, 0.5, 0.5, 0.25],
        [9.0, 3.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01],  # six light rows of one value
    ],
    ids=["distinct", "light-rows"],
)
def test_expected_busiest_rank_against_every_order(values, num_ranks):
    values = np.asarray(values)
    want = _brute_force_max(values, num_ranks)
    rows, value = np.unique(values, return_counts=True)[::-1]  # counts, values
    order = np.argsort(-value)
    rng = np.random.default_rng(7)
    caps = dealing.range_rows(values.size, num_ranks)
    draws = torchrec_default._random_subsets(rows[order], value[order], values.size, caps, 20_000, rng)
    np.testing.assert_allclose(draws.sum(axis=1), values.sum(), rtol=1e-12)  # every row placed once
    best = draws.max(axis=1)
    stderr = best.std(ddof=1) / np.sqrt(best.size)
    assert abs(best.mean() - want) <= 4 * stderr + 1e-9 * want, (best.mean(), want, stderr)


def test_rest_has_the_exact_mean_and_variance_of_a_random_subset():
    # 3 heavy rows and 10^6 light rows of two values: a rank's load is the sum over a uniform subset of
    # its range's size c of the R rows: mean c/R x total, variance c s^2 (R - c) / (R - 1)
    rows = np.array([1, 1, 1, 400_000, 600_000])
    value = np.array([1000.0, 800.0, 600.0, 0.02, 0.01])
    r = int(rows.sum())
    caps = dealing.range_rows(r, 4)
    draws = torchrec_default._random_subsets(rows, value, r, caps, 20_000, np.random.default_rng(3))
    total = float((rows * value).sum())
    np.testing.assert_allclose(draws.sum(axis=1), total, rtol=1e-6)  # every row dealt once
    mean = total / r
    s2 = float((rows * (value - mean) ** 2).sum()) / r
    np.testing.assert_allclose(draws.mean(axis=0), caps / r * total, rtol=0.02)
    np.testing.assert_allclose(draws.var(axis=0), caps * s2 * (r - caps) / (r - 1), rtol=0.05)


def test_rest_by_its_moments_agrees_with_every_row_placed(monkeypatch):
    # a Zipf table of 6000 rows on 8 ranks: the heaviest rows placed one by one and the rest drawn by its
    # mean and variance give the same expected busiest rank as every row placed one by one (exact)
    rows = np.ones(6000, dtype=np.int64)
    value = 1.0 / np.arange(1, 6001) ** 1.1
    caps = dealing.range_rows(6000, 8)

    def mean_max(seed: int) -> tuple[float, float]:
        best = torchrec_default._random_subsets(rows, value, 6000, caps, 4000, np.random.default_rng(seed))
        best = best.max(axis=1)
        return float(best.mean()), float(best.std(ddof=1) / np.sqrt(best.size))

    by_moments, err_moments = mean_max(1)
    monkeypatch.setattr(torchrec_default, "SMALL_TABLE_ROWS", 10_000)
    exact, err_exact = mean_max(2)
    assert by_moments == pytest.approx(exact, abs=4 * np.hypot(err_moments, err_exact))


def test_evaluate_is_the_expected_slowest_rank_over_every_id_order():
    # 2 tables on 2 groups of 2: the report's slowest rank is the mean, over all 4! x 4! id orders,
    # of the slowest rank of TorchRec's ranges of those ids (each priced as real ids)
    tables = (_table("a", [0.4, 0.3, 0.2, 0.1]), _table("b", [0.7, 0.1, 0.1, 0.1]))
    wl = Workload("hand", tables, batch_size_per_gpu=3)
    plan = row_wise(wl, VIEW, 1e9, False, "sparse")
    assert all(tp.deal is Deal.RANGES for tp in plan.tables)
    report = evaluate(wl, VIEW, plan)
    times, inter = [], []
    for pa in itertools.permutations(range(4)):
        for pb in itertools.permutations(range(4)):
            ordered = wl.with_orders({"a": np.array(pa), "b": np.array(pb)})
            r = evaluate(ordered, VIEW, plan)
            slowest = int(np.argmax(r.time_s))
            times.append(r.time_s.max())
            inter.append(r.link_bytes(LinkClass.INTER_GROUP)[slowest])
    meta = report.random_order
    assert meta["draws"] >= 1000 and meta["rel_stderr"] < torchrec_default.TARGET_REL_STDERR
    tol = 4 * meta["rel_stderr"]
    assert report.modeled_time_s == pytest.approx(np.mean(times), rel=tol)
    assert report.link_bytes(LinkClass.INTER_GROUP)[0] == pytest.approx(np.mean(inter), rel=tol)
    # ranks are slowest first; the mean over ranks is the even share's (each rank's expected load)
    assert np.all(np.diff(report.time_s) <= 1e-15)
    even = evaluate(wl, VIEW, plan, dealt=False)
    fwd = COMPONENTS.index("forward")
    np.testing.assert_allclose(
        report.traffic.bytes[:, :, fwd].mean(axis=0), even.traffic.bytes[:, :, fwd].mean(axis=0), rtol=0.01
    )


def test_one_heavy_row_hand_computed():
    # table a alone, one row per rank: the slowest rank always owns row 0 (p 0.4) and serves it to the 3
    # others, 3 x 3 lookups x 0.4 = 3.6, of which 2.4 across groups (forward send 2.4 x 8 B exactly);
    # its group peer owns each other row with probability 1/3, so it asks across groups
    # 3 x (0.6 - E[p_peer]) = 3 x 0.4 = 1.2 lookups (forward recv 9.6 B)
    wl = Workload("hand", (_table("a", [0.4, 0.3, 0.2, 0.1]),), batch_size_per_gpu=3)
    report = evaluate(wl, VIEW, row_wise(wl, VIEW, 1e9, False, "sparse"))
    send, recv = report.traffic.bytes[0, LinkClass.INTER_GROUP, COMPONENTS.index("forward")]
    assert send == pytest.approx(2.4 * 8, rel=1e-12)
    assert recv == pytest.approx(1.2 * 8, rel=0.02)


def test_real_ids_are_not_drawn():
    wl = Workload("hand", (_table("a", [0.4, 0.3, 0.2, 0.1]),), batch_size_per_gpu=3)
    ordered = wl.with_orders({"a": np.array([3, 2, 1, 0])})
    report = evaluate(ordered, VIEW, row_wise(ordered, VIEW, 1e9, False, "sparse"))
    assert report.random_order is None
    send = report.traffic.bytes[3, LinkClass.INTER_GROUP, COMPONENTS.index("forward"), 0]
    assert send == pytest.approx(2.4 * 8)  # id 3 is the hottest row, in rank 3's range


def test_draws_reproduce_and_tables_draw_independently():
    t = torchrec_default.RandomRangeTable("x", np.array([0.0, 1.0, 4.0]), np.array([0.0, 5.0, 8.0]), 4, 8)
    u = dataclasses.replace(t, name="y")
    a, b = torchrec_default.random_range_draws(t, 4, 0), torchrec_default.random_range_draws(t, 4, 0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, torchrec_default.random_range_draws(u, 4, 0))  # same values, another table
    assert not np.array_equal(a, torchrec_default.random_range_draws(t, 4, 1))  # another chunk


def test_torchrec_default_report_is_row_wise_without_dedup():
    wl = Workload("hand", (_table("a", [0.4, 0.3, 0.2, 0.1]),), batch_size_per_gpu=3)
    got = torchrec_default_report(wl, VIEW)
    want = evaluate(wl, VIEW, row_wise(wl, VIEW, 1e9, False, "sparse"))
    assert got.inter_group_bytes == want.inter_group_bytes
    assert got.modeled_time_s == want.modeled_time_s


def test_kept_statistics_equal_a_fresh_computation_and_callers_cannot_change_them():
    wl = Workload("hand", (_table("a", [0.4, 0.3, 0.2, 0.1]), _table("b", [0.7, 0.1, 0.1, 0.1])), 3)
    plan = row_wise(wl, VIEW, 1e9, False, "sparse")
    torchrec_default._MEMO.clear()
    first = evaluate(wl, VIEW, plan)
    first.traffic.bytes += 1.0  # a caller adding to its report
    first.time_s += 1.0
    again = evaluate(wl, VIEW, plan)  # from the kept statistics
    torchrec_default._MEMO.clear()
    fresh = evaluate(wl, VIEW, plan)
    np.testing.assert_array_equal(again.traffic.bytes, fresh.traffic.bytes)
    np.testing.assert_array_equal(again.time_s, fresh.time_s)
    # another bandwidth is another pricing, not the kept one
    slower = uniform_view(2, 2, VIEW.intra_bw_Bps[0], VIEW.inter_bw_Bps[0] / 2)
    assert evaluate(wl, slower, plan).modeled_time_s > fresh.modeled_time_s
