"""Measured touch rates: exact per-row rates against brute force, the sampler replayed, the compact
profile's stated errors, and the cost model priced on a profile."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.errors import ConfigError, PlannerError
from flexshard.training import data
from flexshard.workloads import (
    HistorySampler,
    Sampling,
    Sequences,
    item_rates,
    read_sequences,
    touch_profile,
    user_rates,
)
from flexshard.workloads.touch import profile_error, refined_edges
from solvers.types import RowHistogram, TableSpec, TouchProfile
from solvers.volumes import table_mass


def small_histories(seed: int = 0, users: int = 7, rows: int = 6, longest: int = 9) -> Sequences:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, longest, users)
    items = rng.integers(0, rows, int(lengths.sum()))
    return Sequences(np.arange(users) * 3, np.concatenate([[0], np.cumsum(lengths)]), items)


def brute_force(
    seq: Sequences, sampling: Sampling, rows: int, pool: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row touch probability and lookups of one sample, by enumerating every user, cut and draw."""
    q, m = np.zeros(rows), np.zeros(rows)
    lengths = seq.lengths
    users = [u for u in range(len(seq)) if lengths[u] >= (2 if sampling.mode == "next-item" else 1)]
    for u in users:
        h = list(seq.history(u))
        n = len(h)
        if sampling.mode == "history":
            windows = [(h if sampling.window is None else h[max(n - sampling.window, 0) :], 1.0)]
        else:
            windows = [(h[max(c - sampling.window, 0) : c] + [h[c]], 1.0 / (n - 1)) for c in range(1, n)]
        for window, w in windows:
            draws = list(itertools.product(pool.tolist(), repeat=sampling.negatives))
            for negs in draws:
                ids = window + list(negs)
                weight = w / len(users) / len(draws)
                for r in set(ids):
                    q[r] += weight
                for r in ids:
                    m[r] += weight
    return q, m


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling("next-item", 3, 0),
        Sampling("next-item", 1, 0),
        Sampling("next-item", 2, 2),
        Sampling("history", 3, 0),
        Sampling("history", None, 0),
    ],
    ids=lambda s: s.describe(),
)
def test_item_rates_equal_brute_force(sampling: Sampling) -> None:
    seq = small_histories()
    pool = np.array([0, 2, 3, 5])
    q, m, users = item_rates([seq], sampling, 6, pool)
    qb, mb = brute_force(seq, sampling, 6, pool)
    np.testing.assert_allclose(q, qb, atol=1e-12)
    np.testing.assert_allclose(m, mb, atol=1e-12)
    assert users == int((seq.lengths >= (2 if sampling.mode == "next-item" else 1)).sum())


def test_item_rates_add_up_over_chunks_of_users() -> None:
    seq = small_histories(seed=3, users=12)
    sampling = Sampling("next-item", 2, 0)
    whole = item_rates([seq], sampling, 6)
    halves = [seq.subset(np.arange(12) < 5), seq.subset(np.arange(12) >= 5)]
    parts = item_rates(halves, sampling, 6)
    np.testing.assert_allclose(whole[0], parts[0], atol=1e-15)
    np.testing.assert_allclose(whole[1], parts[1], atol=1e-15)
    assert whole[2] == parts[2]


def test_sampler_replayed_matches_the_exact_rates() -> None:
    """Batches drawn by the sampler training uses: per-row frequency of a touch per sample, and the mean
    distinct rows of a batch of 8 samples, agree with the exact rates within sampling noise."""
    seq = small_histories(seed=1, users=40, rows=30, longest=25)
    sampling = Sampling("next-item", 4, 1)
    pool = np.arange(30)
    q, m, _ = item_rates([seq], sampling, 30, pool)
    sampler = HistorySampler(seq, sampling, batch_size=1, seed=5, pool=pool)
    steps = 20_000
    touched = np.zeros(30)
    for step in range(steps):
        touched[np.unique(sampler.batch(step, 0).item_ids())] += 1
    se = np.sqrt(q * (1 - q) / steps)
    assert np.all(np.abs(touched / steps - q) <= 5 * se + 1e-12)
    batch = HistorySampler(seq, sampling, batch_size=8, seed=6, pool=pool)
    distinct = np.array([np.unique(batch.batch(s, 0).item_ids()).size for s in range(4000)])
    expected = float((-np.expm1(8 * np.log1p(-np.minimum(q, 1 - 1e-16)))).sum())
    assert abs(distinct.mean() - expected) <= 5 * distinct.std() / np.sqrt(distinct.size)


def test_refined_edges_bound_bucket_width() -> None:
    hist = RowHistogram.from_counts(np.repeat([9, 2, 1], [3, 10_000, 20_000]))
    edges = refined_edges(hist, 0.05)
    assert edges[0] == 0 and edges[-1] == 30_003
    assert {3, 10_003}.issubset(set(edges.tolist()))
    width = np.diff(edges)
    assert np.all(width <= np.maximum(1, np.ceil(0.05 * edges[:-1]) + 1))


def profile_case(seed: int = 2) -> tuple:
    rng = np.random.default_rng(seed)
    counts = rng.zipf(1.6, 500).astype(np.int64) % 50
    hist = RowHistogram.from_counts(counts)
    touched = np.flatnonzero(counts > 0)
    order = touched[np.argsort(-counts[touched], kind="stable")]
    q = np.where(counts > 0, np.minimum(counts * rng.uniform(0.001, 0.004, 500), 1.0), 0.0)
    m = counts * 0.01
    return hist, order, q, m


def test_profile_distinct_within_the_stated_quantization() -> None:
    hist, order, q, m = profile_case()
    refined, profile = touch_profile(hist, order, q, m, Sampling("history", None, 0), quantization=0.02)
    assert refined.num_rows == hist.num_rows and refined.num_buckets >= hist.num_buckets
    edges = np.concatenate([[0], np.cumsum(refined.rows)])
    listed = np.zeros(500, dtype=bool)
    listed[order] = True
    q_rank = q[np.concatenate([order, np.flatnonzero(~listed)])]
    for s in (1.0, 7.0, 300.0, 1e5):
        exact = -np.expm1(s * np.log1p(-np.minimum(q_rank, 1 - 1e-16)))
        per_bucket = np.add.reduceat(exact, edges[:-1])
        got = profile.distinct(s)
        assert np.all(np.abs(got - per_bucket) <= 0.01 * per_bucket + 1e-12)  # quantization / 2
    np.testing.assert_allclose(profile.lookups.sum(), m.sum())


def test_rank_entry_names_each_rows_bucket_and_rate() -> None:
    hist, order, q, m = profile_case(seed=3)
    refined, profile = touch_profile(hist, order, q, m, Sampling("history", None, 0), quantization=0.02)
    edges = np.concatenate([[0], np.cumsum(refined.rows)])
    listed = np.zeros(500, dtype=bool)
    listed[order] = True
    q_rank = q[np.concatenate([order, np.flatnonzero(~listed)])]
    ranks = profile.rank_entry
    assert ranks.dtype == np.int32 and ranks.size == np.flatnonzero(q_rank > 0)[-1] + 1
    for rank in range(500):  # brute force, row by row
        entry = int(ranks[rank]) if rank < ranks.size else -1
        if q_rank[rank] == 0:
            assert entry == -1
            continue
        assert edges[profile.entry_bucket[entry]] <= rank < edges[profile.entry_bucket[entry] + 1]
        assert abs(profile.entry_prob[entry] / q_rank[rank] - 1) <= 0.01 + 1e-12  # quantization / 2
    profile.check_ranks(edges)
    with pytest.raises(PlannerError, match="rank_entry: lists"):
        TouchProfile(**{**profile.__dict__, "rank_entry": np.where(ranks == ranks.max(), -1, ranks)})
    with pytest.raises(PlannerError, match="rank_entry: entry 9999 is outside"):
        TouchProfile(**{**profile.__dict__, "rank_entry": np.append(ranks, 9999)})


def test_profile_bucket_error_is_the_worst_cut_by_brute_force() -> None:
    hist, order, q, m = profile_case(seed=4)
    refined, profile = touch_profile(hist, order, q, m, Sampling("history", None, 0))
    edges = np.concatenate([[0], np.cumsum(refined.rows)])
    listed = np.zeros(500, dtype=bool)
    listed[order] = True
    by_rank = np.concatenate([order, np.flatnonzero(~listed)])
    worst = 0.0
    for s in (None, 1.0, 16.0, 256.0, 4096.0):
        per_row = m[by_rank] if s is None else -np.expm1(s * np.log1p(-np.minimum(q[by_rank], 1 - 1e-16)))
        per_bucket = profile.lookups if s is None else profile.distinct(s)
        cum_bucket = np.concatenate([[0.0], np.cumsum(per_bucket)])
        for cut in range(501):  # brute force: every cut point, interpolated inside its bucket
            k = min(int(np.searchsorted(edges, cut, side="right")) - 1, len(per_bucket) - 1)
            model = cum_bucket[k] + (cut - edges[k]) / (edges[k + 1] - edges[k]) * per_bucket[k]
            worst = max(worst, abs(model - per_row[:cut].sum()) / per_row.sum())
    assert profile.bucket_error == pytest.approx(worst, rel=1e-9, abs=1e-15)
    assert profile_error(profile, edges, q[by_rank], m[by_rank]) == profile.bucket_error


def test_user_rates_one_per_sampled_user() -> None:
    q, m = user_rates(np.array([0, 2, 5]), np.array([1, 4, 2]), Sampling("next-item", 3, 0), 6)
    np.testing.assert_allclose(q, [0, 0, 0.5, 0, 0, 0.5])
    np.testing.assert_allclose(m, q)


def test_cost_model_prices_a_profile_by_samples() -> None:
    """Two buckets, hand-computed: bucket 0 one row with q 0.5 and 2 lookups per sample, bucket 1 two rows
    with q 0.1 and 0.1 lookups each. 8 lookups per GPU = 3.6 / 0.45... samples s = lookups / ids."""
    hist = RowHistogram(rows=np.array([1, 2]), prob=np.array([0.5, 0.25]))
    profile = TouchProfile(
        lookups=np.array([2.0, 0.2]),
        entry_bucket=np.array([0, 1]),
        entry_prob=np.array([0.5, 0.1]),
        entry_rows=np.array([1, 2]),
        quantization=0.0,
        bucket_error=0.0,
        sampling="history, whole history",
    )
    table = TableSpec("t", 3, 4, 2.2, hist, touch=profile)
    mass = table_mass(table, lookups_per_gpu=2.2 * 4, num_ranks=8, group_size=2)  # 4 samples per GPU
    np.testing.assert_allclose(mass.lookups, [0, 8.0, 8.8])
    np.testing.assert_allclose(mass.unique, [0, 1 - 0.5**4, 1 - 0.5**4 + 2 * (1 - 0.9**4)])
    np.testing.assert_allclose(mass.group, [0, 1 - 0.5**8, 1 - 0.5**8 + 2 * (1 - 0.9**8)])
    np.testing.assert_allclose(mass.touched, [0, 1 - 0.5**32, 1 - 0.5**32 + 2 * (1 - 0.9**32)])


def test_profile_must_match_its_table() -> None:
    hist = RowHistogram(rows=np.array([1, 2]), prob=np.array([0.5, 0.25]))
    profile = TouchProfile(np.array([2.0]), np.array([0]), np.array([0.5]), np.array([1]), 0.0, 0.0, "x")
    with pytest.raises(PlannerError, match="does not match the histogram's 2 buckets"):
        TableSpec("t", 3, 4, 2.0, hist, touch=profile)
    good = TouchProfile(np.array([2.0, 0.2]), np.array([0]), np.array([0.5]), np.array([1]), 0.0, 0.0, "x")
    with pytest.raises(PlannerError, match="ids_per_sample 3 differs"):
        TableSpec("t", 3, 4, 3.0, hist, touch=good)
    with pytest.raises(PlannerError, match="entry_prob"):
        TouchProfile(np.array([1.0]), np.array([0]), np.array([1.5]), np.array([1]), 0.0, 0.0, "x")


def test_sampling_checks() -> None:
    with pytest.raises(ConfigError, match="unknown mode 'random'"):
        Sampling("random", 3)
    with pytest.raises(ConfigError, match="needs a window"):
        Sampling("next-item", None)
    with pytest.raises(ConfigError, match="history samples have no candidates"):
        Sampling("history", 3, 2)
    assert Sampling("next-item", 20, 4).describe() == "next-item, window 20, negatives 4"


def test_training_source_samples_every_partition_of_a_log(tmp_path, monkeypatch) -> None:
    """A log read in several partitions (users split across them) gives one sampler over all its users,
    and the measured rates are computed from the same histories (read once)."""
    path = tmp_path / "h.txt"
    path.write_text("1 5 6 7\n2 6 9\n3 5 1 2\n4 9 9 6\n")
    whole = read_sequences(path)
    parts = [
        whole.subset(np.array([False, True, False, True])),
        whole.subset(np.array([True, False, True, False])),
    ]
    reads = []

    def partitioned(p, fmt, *_args, **_options):
        def read():
            reads.append(p)  # one read of the file
            return parts

        return read

    monkeypatch.setattr(data.measured, "histories", partitioned)
    source = data.SequenceFileSource(str(path), dim=4, max_len=2, negatives=1, batch_size=64, seed=0)
    assert sorted(source.sampler.users.tolist()) == [1, 2, 3, 4]
    drawn = np.concatenate([source.batch(step, 0).users for step in range(20)])
    assert set(drawn.tolist()) == {1, 2, 3, 4}
    source.workload()
    assert len(reads) == 1
