"""Synthetic Zipf head + uniform tail histograms, the default workload and benchmark workloads."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from core.errors import ConfigError
from flexshard.workloads import (
    DEFAULT_ALPHA,
    DEFAULT_TAIL_MASS,
    HEAD_ROWS_PER_LOOKUP,
    REFERENCE_GPUS,
    SYNTHETIC_REFERENCE_GPUS,
    default_workload,
    fingerprint,
    head_rows_for,
    iteration_lookups,
    rank_grid,
    synthetic_workload,
    zipf_histogram,
    zipf_table,
)
from solvers.types import PlannerError, RowHistogram


def brute_probs(R: int, alpha: float, tail: float, head: int | None = None) -> np.ndarray:
    """Per-rank probabilities of the mixture, materialised: Zipf over ranks 1..head + uniform tail."""
    H = R if head is None else head
    i = np.arange(1, R + 1, dtype=np.float64)
    z = np.where(i <= H, i**-alpha, 0.0)
    return (1 - tail) * z / z.sum() + tail / R


def head_rows_of(hist: RowHistogram) -> int:
    """Rows before the final bucket (the head, when the table has a separate tail bucket)."""
    return int(hist.rows[:-1].sum())


@pytest.mark.parametrize("R", [1, 7, 64, 65, 1000, 123_457])
@pytest.mark.parametrize(("alpha", "tail"), [(0.0, 0.0), (0.55, 0.0), (0.91, 0.005), (1.0, 0.2), (1.4, 0.05)])
def test_histogram_matches_materialised_distribution(R: int, alpha: float, tail: float) -> None:
    hist = zipf_histogram(R, alpha, tail)
    assert hist.num_rows == R
    assert float(np.dot(hist.rows, hist.prob)) == pytest.approx(1.0, abs=1e-12)
    assert (np.diff(hist.prob) <= 0).all()
    p = brute_probs(R, alpha, tail)
    first, last = rank_grid(R)
    assert (hist.rows == last - first + 1).all()
    starts = first - 1
    bucket_mean = np.add.reduceat(p, starts) / hist.rows
    np.testing.assert_allclose(hist.prob, bucket_mean, rtol=1e-9, atol=0)
    # the exact head: ranks 1..64 are single-row buckets with their own probability
    head = min(R, 64)
    np.testing.assert_allclose(hist.prob[:head], p[:head], rtol=1e-9, atol=0)


@pytest.mark.parametrize(
    ("R", "H"),
    [(1, 1), (10, 1), (100, 7), (1000, 64), (1000, 65), (5000, 999), (123_457, 2_000), (123_457, 123_456)],
)
@pytest.mark.parametrize(("alpha", "tail"), [(0.87, 0.045), (1.05, 0.0), (0.0, 0.3), (1.4, 1.0)])
def test_head_tail_histogram_matches_materialised_mixture(R: int, H: int, alpha: float, tail: float) -> None:
    hist = zipf_histogram(R, alpha, tail, head_rows=H)
    assert hist.num_rows == R
    assert float(np.dot(hist.rows, hist.prob)) == pytest.approx(1.0, abs=1e-12)
    assert (np.diff(hist.prob) <= 0).all()
    p = brute_probs(R, alpha, tail, H)
    first, last = rank_grid(H)
    if H < R:  # the head's buckets, then one bucket of the ranks beyond it
        first, last = np.append(first, H + 1), np.append(last, R)
    assert (hist.rows == last - first + 1).all()
    bucket_mean = np.add.reduceat(p, first - 1) / hist.rows
    np.testing.assert_allclose(hist.prob, bucket_mean, rtol=1e-9, atol=0)
    head = min(H, 64)  # ranks 1..64 of the head are exact single-row buckets
    np.testing.assert_allclose(hist.prob[:head], p[:head], rtol=1e-9, atol=0)
    if H < R:
        assert hist.prob[-1] == pytest.approx(tail / R, rel=1e-12, abs=0)
        # the tail bucket's access mass is exactly its share of the uniform part
        assert hist.rows[-1] * hist.prob[-1] == pytest.approx(tail * (R - H) / R, rel=1e-12, abs=1e-300)


def test_head_rows_none_is_the_whole_table() -> None:
    a = zipf_histogram(10_000, 0.9, 0.05)
    b = zipf_histogram(10_000, 0.9, 0.05, head_rows=10_000)
    assert (a.rows == b.rows).all() and (a.prob == b.prob).all()
    t = zipf_table("x", 10_000, 16, 2.0, 0.9, 0.05, head_rows=100)
    assert head_rows_of(t.hist) == 100 and t.hist.num_rows == 10_000


def test_head_rows_for_and_iteration_lookups() -> None:
    assert iteration_lookups(157.6) == pytest.approx(64 * 512 * 157.6)
    assert iteration_lookups(1.0, 128, 256) == 128 * 256
    assert head_rows_for(10**9, 1e6) == round(HEAD_ROWS_PER_LOOKUP * 1e6)
    assert head_rows_for(1000, 1e9) == 1000
    assert head_rows_for(10, 1e-6) == 1
    with pytest.raises(ConfigError, match="head_rows_per_lookup"):
        head_rows_for(10, 1.0, 0.0)


def test_histogram_is_compact_for_a_billion_rows() -> None:
    t0 = time.perf_counter()
    hist = zipf_histogram(10**9, 1.0, 0.1)
    assert time.perf_counter() - t0 < 1.0
    assert hist.num_rows == 10**9
    assert hist.num_buckets < 2000
    assert float(np.dot(hist.rows, hist.prob)) == pytest.approx(1.0, abs=1e-12)
    # rows within a bucket span at most a factor 1.01 of ranks
    first, last = rank_grid(10**9)
    assert ((last / first)[64:] <= 1.0101).all()


def test_rank_grid_covers_every_rank_once() -> None:
    first, last = rank_grid(10**6, exact_ranks=10, ratio=1.05)
    assert first[0] == 1 and last[-1] == 10**6
    assert (first[1:] == last[:-1] + 1).all()
    assert (last >= first).all()
    assert (first[:10] == np.arange(1, 11)).all()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_rows": 0}, "num_rows"),
        ({"num_rows": 10, "alpha": -1.0}, "alpha"),
        ({"num_rows": 10, "alpha": float("nan")}, "alpha"),
        ({"num_rows": 10, "tail_mass": 1.5}, "tail_mass"),
        ({"num_rows": 10, "ratio": 1.0}, "ratio"),
        ({"num_rows": 10, "head_rows": 0}, "head_rows"),
        ({"num_rows": 10, "head_rows": 11}, "head_rows"),
        ({"num_rows": 10, "head_rows": 2.5}, "head_rows"),
        ({"num_rows": 10, "head_rows": "5"}, "head_rows"),
    ],
)
def test_bad_parameters_raise(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        zipf_histogram(**kwargs)


def test_zipf_table_and_length_pmf() -> None:
    t = zipf_table("x", 1000, 16, None, length_values=np.array([1, 3]), length_probs=np.array([0.5, 0.5]))
    assert t.ids_per_sample == 2.0 and t.num_rows == 1000 and t.dim == 16
    with pytest.raises(ConfigError, match="length_probs"):
        zipf_table("x", 10, 4, None, length_values=np.array([1]), length_probs=np.array([0.4]))
    with pytest.raises(PlannerError, match="dim"):
        zipf_table("x", 10, 0, 1.0)


def test_default_workload_shape() -> None:
    w = default_workload()
    assert w.name == "default"
    assert 2e8 <= w.num_rows <= 1e9
    assert 512 <= w.batch_size_per_gpu <= 1024
    names = [t.name for t in w.tables]
    assert names[0] == "item_id" and "user_id" in names and len(names) >= 6
    item = w.tables[0]
    assert item.num_rows >= 1e8 and item.dim == 128 and 100 <= item.ids_per_sample <= 200
    assert item.length_values is not None and item.length_probs is not None
    assert float(np.dot(item.length_values, item.length_probs)) == pytest.approx(item.ids_per_sample)
    for t in w.tables:
        assert 32 <= t.dim <= 128
        assert t.hist.num_buckets < 2000
    assert {t.ids_per_sample for t in w.tables if t.name.startswith("item")} == {item.ids_per_sample}
    assert default_workload(alpha=1.2).tables[0].hist.prob[0] > item.hist.prob[0]


def test_default_workload_heads_are_sized_for_one_reference_iteration() -> None:
    w = default_workload()
    assert w.num_rows == 362_121_000
    sizes = {t.name: t.num_rows for t in w.tables}
    assert sizes == {
        "item_id": 200_000_000,
        "item_creator": 50_000_000,
        "item_seller": 10_000_000,
        "item_brand": 2_000_000,
        "item_category": 20_000,
        "action_type": 1_000,
        "user_id": 100_000_000,
        "user_geo": 100_000,
    }
    for t in w.tables:
        lookups = REFERENCE_GPUS * 512 * t.ids_per_sample  # one iteration of 8 x 8 GPUs at batch 512
        head = min(t.num_rows, round(HEAD_ROWS_PER_LOOKUP * lookups))
        tail_prob = DEFAULT_TAIL_MASS / t.num_rows
        if head < t.num_rows:
            assert head_rows_of(t.hist) == head, t.name
            assert t.hist.prob[-1] == pytest.approx(tail_prob, rel=1e-12), t.name
        else:  # small vocabularies: the head is the whole table
            assert t.hist.prob[-1] > tail_prob, t.name
    heads = {t.name: head_rows_of(t.hist) for t in w.tables}
    assert heads["item_id"] == round(HEAD_ROWS_PER_LOOKUP * 64 * 512 * 157.6) == 413_139
    assert heads["user_id"] == round(HEAD_ROWS_PER_LOOKUP * 64 * 512) == 2_621
    # the head follows the reference cluster, not the per-GPU batch
    assert (default_workload(batch_size_per_gpu=128).tables[0].hist.prob == w.tables[0].hist.prob).all()
    # no head: the Zipf spans every row, as before the mixture
    flat = default_workload(head_rows_per_lookup=None).tables[0].hist
    assert flat.num_buckets > w.tables[0].hist.num_buckets and flat.prob[-1] > DEFAULT_TAIL_MASS / 2e8


def test_default_workload_is_deterministic_across_processes() -> None:
    here = fingerprint(default_workload())
    assert fingerprint(default_workload()) == here
    code = "from flexshard.workloads import default_workload as d, fingerprint as f; print(f(d()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_synthetic_workload_benchmark_size() -> None:
    t0 = time.perf_counter()
    w = synthetic_workload(100, 10**9, seed=7)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0
    assert len(w.tables) == 100 and w.num_rows == 10**9
    buckets = sum(t.hist.num_buckets for t in w.tables)
    assert buckets * 16 < 4e6  # histogram bytes: a few MB at most
    for t in w.tables:  # heads sized for one iteration of 128 GPUs at batch 512
        head = min(
            t.num_rows, round(HEAD_ROWS_PER_LOOKUP * SYNTHETIC_REFERENCE_GPUS * 512 * t.ids_per_sample)
        )
        if head < t.num_rows:
            assert head_rows_of(t.hist) == head, t.name
            assert t.hist.prob[-1] == pytest.approx(DEFAULT_TAIL_MASS / t.num_rows, rel=1e-12)
    assert any(head_rows_of(t.hist) < t.num_rows // 2 for t in w.tables)
    sizes = np.array([t.num_rows for t in w.tables])
    assert sizes.min() >= 1 and sizes.max() / sizes.min() > 1e3  # log-uniform spread
    alphas_ok = all(t.hist.prob[0] > t.hist.prob[-1] for t in w.tables if t.num_rows > 1)
    assert alphas_ok
    again = synthetic_workload(100, 10**9, seed=7)
    assert fingerprint(again) == fingerprint(w)
    assert fingerprint(synthetic_workload(100, 10**9, seed=8)) != fingerprint(w)
    with pytest.raises(ConfigError, match="total_rows"):
        synthetic_workload(10, 5)


def test_defaults_are_the_documented_constants() -> None:
    assert (DEFAULT_ALPHA, HEAD_ROWS_PER_LOOKUP, DEFAULT_TAIL_MASS) == (0.87, 0.08, 0.045)
    assert (REFERENCE_GPUS, SYNTHETIC_REFERENCE_GPUS) == (64, 128)


def test_sample_ids_follow_the_histogram():
    """Buckets: 2 rows of 0.3, 1 row of 0.2, 4 rows of 0.05 (sum 1): each row's frequency over 200k
    draws is within 5 standard errors of its probability, and ids stay inside the table."""
    from flexshard.workloads import sample_ids

    hist = RowHistogram(np.array([2, 1, 4]), np.array([0.3, 0.2, 0.05]))
    n = 200_000
    ids = sample_ids(hist, n, np.random.default_rng(3))
    assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() <= 6
    freq = np.bincount(ids, minlength=7) / n
    want = np.array([0.3, 0.3, 0.2, 0.05, 0.05, 0.05, 0.05])
    assert np.all(np.abs(freq - want) < 5 * np.sqrt(want * (1 - want) / n))
