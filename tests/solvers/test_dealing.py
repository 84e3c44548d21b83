"""Rows dealt to owners (solvers.dealing) and the model that prices them, against brute force and
hand-computed figures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from core.vocabulary import COMPONENTS, Deal
from solvers import dealing
from solvers.baselines import row_wise
from solvers.cost_model import evaluate, table_plan
from solvers.placement import spread_heads
from solvers.types import Plan, RowHistogram, TableSpec, TouchProfile, Workload
from solvers.volumes import dealt_volumes, table_mass
from topology.views import uniform_view


def test_owner_pattern_is_the_rotated_interleave():
    base = dealing.interleave_pattern(np.array([0.5, 0.3, 0.2]), 10)
    assert dealing.owner_pattern(np.array([0.5, 0.3, 0.2]), 10, 3).tolist() == np.roll(base, -3).tolist()
    assert dealing.first_position(np.array([2, 0, 1, 0]), 1) == 2
    with pytest.raises(ValueError, match="owner 3 has no position"):
        dealing.first_position(np.array([2, 0, 1, 0]), 3)


def test_owner_rows_against_brute_force():
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 5, size=13)
    for x in (0, 1, 12, 13, 14, 40, 7, 100, 26, 3):
        want = np.bincount(pattern[np.arange(x) % 13], minlength=6)
        assert dealing.owner_rows(pattern, x, 6).tolist() == want.tolist()


def _brute_force_masses(hist_rows, per_row, first, last, owner_of_item):
    """Per owner: rows and the sum of per-row values of rows first..last-1 (owner_of_item(j) of item j)."""
    value = np.repeat(per_row, hist_rows, axis=0)
    rows, masses = {}, {}
    for j, r in enumerate(range(first, last)):
        o = owner_of_item(j)
        rows[o] = rows.get(o, 0) + 1
        masses[o] = masses.get(o, 0) + value[r]
    return rows, masses


@pytest.mark.parametrize(("first", "last", "start"), [(0, 60, 0), (7, 60, 5), (13, 41, 2), (59, 60, 1)])
def test_interleave_masses_against_brute_force(first, last, start):
    hist_rows = np.array([3, 10, 17, 30])  # 60 rows in 4 buckets
    per_row = np.array([[5.0, 1.0], [2.0, 0.5], [1.0, 0.25], [0.1, 0.0]])  # two quantities per row
    edges = np.concatenate([[0], np.cumsum(hist_rows)]).astype(float)
    cumulative = np.concatenate([np.zeros((1, 2)), np.cumsum(per_row * hist_rows[:, None], axis=0)])
    shares = np.array([0.4, 0.35, 0.25])
    pattern = dealing.owner_pattern(shares, 11, start)
    rows, masses = dealing.interleave_masses(edges, cumulative, first, last, pattern, 3)
    want_rows, want_mass = _brute_force_masses(hist_rows, per_row, first, last, lambda j: pattern[j % 11])
    for o in range(3):
        assert rows[o] == want_rows.get(o, 0)
        np.testing.assert_allclose(masses[o], want_mass.get(o, np.zeros(2)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", [None, "permuted", "short"])
def test_range_masses_against_brute_force(order):
    hist_rows = np.array([2, 5, 9, 7])  # 23 rows; the last bucket has no mass
    per_row = np.array([[4.0], [1.0], [0.5], [0.0]])
    edges = np.concatenate([[0], np.cumsum(hist_rows)]).astype(float)
    cumulative = np.concatenate([np.zeros((1, 1)), np.cumsum(per_row * hist_rows[:, None], axis=0)])
    rng = np.random.default_rng(3)
    ids = {None: None, "permuted": rng.permutation(23), "short": rng.permutation(23)[:9]}[order]
    rows, masses = dealing.range_masses(edges, cumulative, ids, 23, 4)
    assert rows.tolist() == [6, 6, 6, 5]  # ceil(23 / 4) = 6 ids per range
    full = np.arange(23) if ids is None else np.concatenate([ids, np.setdiff1d(np.arange(23), ids)])
    value = np.repeat(per_row[:, 0], hist_rows)
    want = np.zeros(4)
    for rank_in_hotness, row_id in enumerate(full):
        want[row_id // 6] += value[rank_in_hotness]
    np.testing.assert_allclose(masses[:, 0], want, rtol=1e-12)


@pytest.mark.parametrize("order", [None, "permuted", "short"])
def test_range_masses_by_entry_against_brute_force(order):
    rng = np.random.default_rng(5)
    rank_entry = np.array([2, 0, 1, -1, 1, 2, 0, 0, -1, 1, 2], dtype=np.int32)  # 11 of 23 rows listed
    per_entry = rng.uniform(0.1, 1.0, (3, 2))
    ids = {None: None, "permuted": rng.permutation(23), "short": rng.permutation(23)[:7]}[order]
    edges, cumulative = np.array([0.0, 23.0]), np.zeros((2, 2))  # bucket averages, unused with entries
    rows, masses = dealing.range_masses(edges, cumulative, ids, 23, 4, (rank_entry, per_entry))
    assert rows.tolist() == [6, 6, 6, 5]
    full = np.arange(23) if ids is None else np.concatenate([ids, np.setdiff1d(np.arange(23), ids)])
    want = np.zeros((4, 2))
    for rank_in_hotness, entry in enumerate(rank_entry):
        if entry >= 0:
            want[full[rank_in_hotness] // 6] += per_entry[entry]
    np.testing.assert_allclose(masses, want, rtol=1e-12)


def test_ranges_price_which_rows_of_a_bucket_are_widely_shared():
    """One bucket of 4 rows, 2 lookups per sample: two rows touched by 90% of samples, two by 10%. Ids by
    hotness rank [0, 2, 3, 1] put both 0.9 rows (ranks 0 and 3) on rank 0 (ids 0, 1) of 2. At 2 samples
    per GPU, rank 0 serves 2 (1 - 0.1^2) = 1.98 distinct rows per GPU and rank 1 2 (1 - 0.9^2) = 0.38; the
    bucket's average would give each 1.18."""
    hist = RowHistogram(np.array([4]), np.array([0.25]))
    profile = TouchProfile(
        lookups=np.array([2.0]),
        entry_bucket=np.array([0, 0]),
        entry_prob=np.array([0.1, 0.9]),
        entry_rows=np.array([2, 2]),
        quantization=0.0,
        bucket_error=0.0,
        sampling="history, whole history",
        rank_entry=np.array([1, 0, 0, 1], dtype=np.int32),
    )
    table = TableSpec("t", 4, 2, 2.0, hist, touch=profile, order=np.array([0, 2, 3, 1]))
    workload = Workload("shared", (table,), batch_size_per_gpu=2)
    view = uniform_view(1, 2, 100.0, 10.0)
    plan = row_wise(workload, view, 1e9, True, "sparse")
    assert plan.tables[0].deal is Deal.RANGES
    mass = table_mass(table, workload.lookups_per_gpu(table), 2, 2)
    volumes = dealt_volumes(mass, table, plan.tables[0], view, dedup=True)
    np.testing.assert_allclose(volumes.cold_by_rank, [1.98, 0.38], rtol=1e-12)
    np.testing.assert_allclose(volumes.cold_group_by_rank, [2 * (1 - 0.1**4), 2 * (1 - 0.9**4)], rtol=1e-12)
    bare = dataclasses.replace(table, touch=dataclasses.replace(profile, rank_entry=None))
    bare_mass = table_mass(bare, workload.lookups_per_gpu(bare), 2, 2)
    averaged = dealt_volumes(bare_mass, bare, plan.tables[0], view, dedup=True)
    np.testing.assert_allclose(averaged.cold_by_rank, [1.18, 1.18], rtol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_interleave_masses_random_buckets_against_brute_force(seed):
    rng = np.random.default_rng(seed)
    hist_rows = rng.integers(1, 40, size=12)  # buckets of any size, values not monotone
    per_row = rng.uniform(0.0, 3.0, size=(12, 3))
    edges = np.concatenate([[0], np.cumsum(hist_rows)]).astype(float)
    cumulative = np.concatenate([np.zeros((1, 3)), np.cumsum(per_row * hist_rows[:, None], axis=0)])
    total = int(hist_rows.sum())
    first, last = sorted(rng.integers(0, total + 1, size=2))
    pattern = dealing.owner_pattern(
        rng.uniform(0.1, 1.0, size=5), int(rng.integers(3, 30)), int(rng.integers(0, 3))
    )
    rows, masses = dealing.interleave_masses(edges, cumulative, first, last, pattern, 5)
    want_rows, want_mass = _brute_force_masses(
        hist_rows, per_row, first, last, lambda j: pattern[j % pattern.size]
    )
    for o in range(5):
        assert rows[o] == want_rows.get(o, 0)
        np.testing.assert_allclose(masses[o], want_mass.get(o, np.zeros(3)), rtol=1e-10, atol=1e-10)


# --- the cost model with rows dealt: hand-computed figures ---------------------------------------
#
# Table "a" of tests/solvers/test_cost_model.py: 4 rows, p = 0.4, 0.3, 0.2, 0.1, vec = 8 B, n = 3
# lookups per GPU, on 2 groups x 2 GPUs. All cold, even shares, start 0: rank r is dealt row r, so it
# serves the accesses of p_r (not 1/4 of them).

VIEW = uniform_view(2, 2, 100.0, 10.0)
TABLE = TableSpec(
    "a", 4, 2, 1.0, RowHistogram(np.ones(4, dtype=np.int64), np.array([0.4, 0.3, 0.2, 0.1])), element_bytes=4
)
WORKLOAD = Workload("hand", (TABLE,), batch_size_per_gpu=3)


def _bytes(report, rank: int, link: int, component: str) -> tuple[float, float]:
    send, recv = report.traffic.bytes[rank, link, COMPONENTS.index(component)]
    return float(send), float(recv)


def test_all_cold_no_dedup_rank_serves_its_rows_accesses():
    report = evaluate(WORKLOAD, VIEW, Plan("hand", (table_plan(TABLE, VIEW, 0, 0),), dedup=False))
    # rank 0 (group {0, 1}) owns row 0 (p 0.4). As requester: intra 3 x p1 = 0.9 lookups, inter
    # 3 x (p2 + p3) = 0.9. As owner: 3 x 0.4 = 1.2 to its group peer, 2 x 1.2 = 2.4 to the other group.
    # ids: send 0.9 x 8 + 8 (split) = 15.2 intra, 0.9 x 8 + 16 = 23.2 inter; recv 1.2 x 8 + 8 = 17.6,
    # 2.4 x 8 + 16 = 35.2. forward: send served x 8 (9.6, 19.2), recv asked x 8 (7.2, 7.2).
    assert _bytes(report, 0, 0, "ids") == pytest.approx((15.2, 17.6))
    assert _bytes(report, 0, 1, "ids") == pytest.approx((23.2, 35.2))
    assert _bytes(report, 0, 0, "forward") == pytest.approx((9.6, 7.2))
    assert _bytes(report, 0, 1, "forward") == pytest.approx((19.2, 7.2))
    assert _bytes(report, 0, 1, "backward") == pytest.approx((7.2, 19.2))
    # rank 3 owns row 3 (p 0.1): serves 0.3 intra, 0.6 inter; asks 3 x p2 = 0.6 intra, 3 x 0.7 = 2.1 inter
    assert _bytes(report, 3, 1, "forward") == pytest.approx((0.6 * 8, 2.1 * 8))
    assert _bytes(report, 3, 0, "forward") == pytest.approx((0.3 * 8, 0.6 * 8))
    # the mean over ranks is the symmetric model's: 0.75 x 8 = 6 intra, 1.5 x 8 = 12 inter forward
    fwd = report.traffic.bytes[:, :, COMPONENTS.index("forward"), 0].mean(axis=0)
    np.testing.assert_allclose(fwd, [6.0, 12.0], rtol=1e-12)
    # the busiest rank is rank 0: inter max(send 23.2 + 19.2 + 7.2, recv 35.2 + 7.2 + 19.2) = 61.6
    assert report.inter_group_bytes == pytest.approx(61.6)


def test_start_rotates_the_deal():
    tp = dataclasses.replace(table_plan(TABLE, VIEW, 0, 0), cold_start=2)
    report = evaluate(WORKLOAD, VIEW, Plan("hand", (tp,), dedup=False))
    # row 0 now goes to rank 2 (pattern 0,1,2,3 from position 2): rank 2 serves 2.4 inter
    assert _bytes(report, 2, 1, "forward")[0] == pytest.approx(2.4 * 8)
    assert _bytes(report, 0, 1, "forward")[0] == pytest.approx(3 * 0.2 * 2 * 8)  # row 2 (p 0.2)


def test_warm_sync_payload_follows_the_positions_rows():
    # 2 warm rows (p 0.4, 0.3) and 2 cold; the warm rows go to positions 0 and 1 of each group. Dense sync:
    # each position all-reduces its one row (8 B) across the 2 groups: 2 x (2-1)/2 x 8 = 8 B inter.
    plan = Plan("hand", (table_plan(TABLE, VIEW, 0, 2),), dedup=False, sync="dense")
    sync = evaluate(WORKLOAD, VIEW, plan).traffic.bytes[:, 1, COMPONENTS.index("sync"), 0]
    np.testing.assert_allclose(sync, [8.0, 8.0, 8.0, 8.0], rtol=1e-12)
    # 3 warm rows: position 0 holds rows 0 and 2 (16 B -> 16 B inter), position 1 holds row 1 (8 B)
    plan = Plan("hand", (table_plan(TABLE, VIEW, 0, 3),), dedup=False, sync="dense")
    sync = evaluate(WORKLOAD, VIEW, plan).traffic.bytes[:, 1, COMPONENTS.index("sync"), 0]
    np.testing.assert_allclose(sync, [16.0, 8.0, 16.0, 8.0], rtol=1e-12)


def test_row_wise_ranges_price_the_real_ids():
    # ids 0..3 with hotness order [3, 2, 1, 0]: the hottest row (p 0.4) is id 3, owned by rank 3
    ordered = dataclasses.replace(
        WORKLOAD, tables=(dataclasses.replace(TABLE, order=np.array([3, 2, 1, 0])),)
    )
    plan = row_wise(ordered, VIEW, 1e9, False, "sparse")
    assert plan.tables[0].deal is Deal.RANGES
    report = evaluate(ordered, VIEW, plan)
    assert _bytes(report, 3, 1, "forward")[0] == pytest.approx(2.4 * 8)
    assert _bytes(report, 0, 1, "forward")[0] == pytest.approx(3 * 0.1 * 2 * 8)
    # synthetic tables (no order) are TorchRec's ranges too, priced over random id orders
    # (tests/solvers/test_torchrec_default.py)
    assert row_wise(WORKLOAD, VIEW, 1e9, False, "sparse").tables[0].deal is Deal.RANGES


def test_spread_heads_puts_each_tables_head_on_another_owner():
    hist = RowHistogram(np.array([1, 399], dtype=np.int64), np.array([0.2, 0.8 / 399]))
    tables = tuple(TableSpec(f"t{i}", 400, 8, 4.0, hist) for i in range(4))
    workload = Workload("heads", tables, batch_size_per_gpu=64)
    plan = Plan("p", tuple(table_plan(t, VIEW, 0, 0) for t in tables), dedup=False)
    spread = spread_heads(workload, VIEW, plan)
    heads = [
        int(dealing.owner_pattern(tp.cold_share, dealing.OWNER_PATTERN_PERIOD, tp.cold_start)[0])
        for tp in spread.tables
    ]
    assert sorted(heads) == [0, 1, 2, 3]
    before, after = evaluate(workload, VIEW, plan), evaluate(workload, VIEW, spread)
    assert after.modeled_time_s < before.modeled_time_s
    assert after.inter_group_bytes < before.inter_group_bytes
    # the volume is the same, only who serves it moved
    np.testing.assert_allclose(after.traffic.bytes.sum(), before.traffic.bytes.sum(), rtol=1e-12)


def test_table_mass_unchanged_by_dealing():
    # dealing splits the same volumes: the sum over owners equals the tier's volume
    mass = table_mass(TABLE, 3.0, 4)
    cumulative = mass.stacked()
    _, masses = dealing.interleave_masses(
        mass.rows, cumulative, 1, 4, dealing.owner_pattern(np.full(4, 0.25), 8), 4
    )
    np.testing.assert_allclose(masses.sum(axis=0), cumulative[4] - cumulative[1], rtol=1e-12)
