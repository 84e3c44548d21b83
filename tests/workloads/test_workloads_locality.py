"""Batch locality in closed form vs Monte-Carlo, the Meta calibration and the locality-file parser."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, DataError
from flexshard.workloads import (
    DEFAULT_ALPHA,
    DEFAULT_TAIL_MASS,
    HEAD_ROWS_PER_LOOKUP,
    META_RANGES,
    REFERENCE_ITERATION_LOOKUPS,
    BatchLocality,
    batch_locality,
    calibration_locality,
    calibration_table,
    data_root,
    default_workload,
    iteration_lookups,
    parse_locality_stats,
    poisson_sf,
    top_share,
    zipf_histogram,
    zipf_slope,
)
from solvers.types import RowHistogram


def monte_carlo(hist: RowHistogram, lookups: int, reps: int, seed: int = 0) -> dict[str, float]:
    p = np.repeat(hist.prob, hist.rows)
    rng = np.random.default_rng(seed)
    fracs = ("0.001", "0.01", "0.1", "0.25")
    out: dict[str, list[float]] = {"unique": [], "once": [], **{f: [] for f in fracs}}
    for _ in range(reps):
        c = rng.multinomial(lookups, p)
        c = np.sort(c[c > 0])[::-1]
        out["unique"].append(c.size)
        out["once"].append(float(np.mean(c == 1)))
        cum = np.cumsum(c) / lookups
        for f in fracs:
            k = float(f) * c.size  # fractional top set: the boundary row counts pro rata
            whole = int(k)
            share = cum[whole - 1] if whole else 0.0
            out[f].append(share + (k - whole) * c[whole] / lookups)
    return {k: float(np.mean(v)) for k, v in out.items()}


def test_matches_monte_carlo_on_a_small_table() -> None:
    hist = zipf_histogram(3000, 0.95, 0.1)
    lookups = 6000
    mc = monte_carlo(hist, lookups, reps=300)
    got = batch_locality(hist, lookups, fractions=(0.01, 0.1, 0.25))
    assert got.unique_rows == pytest.approx(mc["unique"], rel=0.005)
    assert got.touched_once_share == pytest.approx(mc["once"], abs=0.005)
    assert got.mean_reuse == pytest.approx(lookups / got.unique_rows)
    for f in (0.01, 0.1, 0.25):
        assert got.top_share[f] == pytest.approx(mc[str(f)], abs=0.006), f
    expected = batch_locality(hist, lookups, fractions=(0.01, 0.1, 0.25), method="expected")
    assert expected.unique_rows == got.unique_rows
    for f in (0.01, 0.1, 0.25):  # ranking by probability never beats ranking by realised counts
        assert expected.top_share[f] <= got.top_share[f] + 1e-9


def test_exact_formulas_on_a_two_row_table() -> None:
    hist = RowHistogram(rows=np.array([1, 1]), prob=np.array([0.75, 0.25]))
    got = batch_locality(hist, 2)
    # P(touched) = 1 - 0.25^2 and 1 - 0.75^2; P(once) = 2 * 0.75 * 0.25 for both rows
    assert got.unique_rows == pytest.approx((1 - 0.0625) + (1 - 0.5625))
    assert got.touched_once_share == pytest.approx(2 * 0.375 / got.unique_rows)
    one = batch_locality(hist, 1)
    assert one.unique_rows == pytest.approx(1.0) and one.touched_once_share == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="lookups"):
        batch_locality(hist, 0)
    with pytest.raises(ConfigError, match="method"):
        batch_locality(hist, 10, method="magic")


def test_poisson_tail_against_direct_sums() -> None:
    for lam in [1e-9, 0.01, 0.7, 3.0, 31.0, 50.0, 400.0, 5000.0]:
        for c in [1, 2, 3, 10, 31, 32, 40, 60, 400, 5200]:
            top = max(c, lam) + 40 * math.sqrt(lam) + 200
            j = np.arange(c, int(top), dtype=np.float64)
            log_pmf = j * math.log(lam) - lam - np.array([math.lgamma(x + 1) for x in j])
            want = math.fsum(np.exp(log_pmf).tolist())
            got = float(poisson_sf(c, np.array([lam]))[0])
            tol = 1e-12 + 1e-10 * want if c < 32 else 2e-3
            assert abs(got - want) <= tol, (lam, c, got, want)
    assert poisson_sf(0, np.array([0.0, 5.0])).tolist() == [1.0, 1.0]


def test_matches_monte_carlo_on_a_small_head_tail_table() -> None:
    # the calibrated shape, scaled down: a head of 0.08 L ranks, the tail over R >> tail_mass L rows
    lookups = 25_000
    hist = zipf_histogram(200_000, DEFAULT_ALPHA, DEFAULT_TAIL_MASS, head_rows=2_000)
    mc = monte_carlo(hist, lookups, reps=200, seed=1)
    got = batch_locality(hist, lookups, fractions=(0.001, 0.01, 0.1, 0.25))
    assert got.unique_rows == pytest.approx(mc["unique"], rel=0.005)
    assert got.touched_once_share == pytest.approx(mc["once"], abs=0.005)
    for f in (0.001, 0.01, 0.1, 0.25):
        assert got.top_share[f] == pytest.approx(mc[str(f)], abs=0.003), f


def meta_figures(loc: BatchLocality) -> dict[str, float]:
    return {
        "top_0.1%": loc.top_share[0.001],
        "top_1%": loc.top_share[0.01],
        "top_10%": loc.top_share[0.1],
        "touched_once": loc.touched_once_share,
        "mean_reuse": loc.mean_reuse,
    }


def assert_meta_like(loc: BatchLocality) -> None:
    values = meta_figures(loc)
    for key, (lo, hi) in META_RANGES.items():
        assert lo <= values[key] <= hi, (key, values[key])
    # rows touched once carry one lookup each: Meta's 2021 traces put 5.6-6.9% of lookups there
    assert 0.05 <= loc.touched_once_share / loc.mean_reuse <= 0.10


def test_default_item_table_is_inside_the_meta_ranges_at_one_iteration() -> None:
    item = default_workload().tables[0]
    assert item.name == "item_id" and item.num_rows == 200_000_000
    lookups = iteration_lookups(item.ids_per_sample)  # 64 GPUs x 512 samples x 157.6 ids
    assert lookups == pytest.approx(REFERENCE_ITERATION_LOOKUPS) and 5.1e6 < lookups < 5.2e6
    loc = batch_locality(item.hist, lookups)
    assert_meta_like(loc)
    # near the middle of the box, not on an edge
    assert 0.28 <= loc.top_share[0.001] <= 0.30 and 0.70 <= loc.top_share[0.1] <= 0.72
    # calibration_table is the same distribution
    table = calibration_table()
    assert table.num_rows == 200_000_000 and table.ids_per_sample == pytest.approx(item.ids_per_sample)
    assert (table.hist.rows == item.hist.rows).all() and (table.hist.prob == item.hist.prob).all()
    assert calibration_locality() == loc


@pytest.mark.parametrize("rows", [50_000_000, 10_000_000])
def test_calibration_holds_for_smaller_tables(rows: int) -> None:
    loc = calibration_locality(rows)
    assert_meta_like(loc)
    hist = calibration_table(rows).hist
    assert int(hist.rows[:-1].sum()) == round(HEAD_ROWS_PER_LOOKUP * REFERENCE_ITERATION_LOOKUPS)
    # the large item-side attribute tables of the default workload are the same mixture
    if rows == 50_000_000:
        creator = default_workload().tables[1]
        assert creator.name == "item_creator" and creator.num_rows == rows
        assert (creator.hist.prob == hist.prob).all()


def test_top_share_and_slope() -> None:
    hist = RowHistogram(rows=np.array([10, 90]), prob=np.array([0.05, 0.5 / 90]))
    assert top_share(hist, 0.1) == pytest.approx(0.5)
    assert top_share(hist, 0.05) == pytest.approx(0.25)
    assert top_share(hist, 1.0) == pytest.approx(1.0)
    with_zero = RowHistogram(rows=np.array([10, 10]), prob=np.array([0.1, 0.0]))
    assert top_share(with_zero, 0.5, touched_only=True) == pytest.approx(0.5)
    assert top_share(with_zero, 0.5) == pytest.approx(1.0)
    for alpha in (0.5, 1.0, 1.3):
        assert zipf_slope(zipf_histogram(10**6, alpha, 0.0)) == pytest.approx(alpha, abs=0.02)
    assert zipf_slope(RowHistogram(rows=np.array([1]), prob=np.array([1.0]))) == 0.0


SAMPLE = """fbgemm_t2_bs4.pt
Locality stats after processing 1 batches of size 4
Avg # of indices: 100
Avg # of unique cols: 40
Avg col size: 2.5
Histogram of col sizes:
(0, 1]: 0.500
(1, 2]: 0.250
(2, 4]: 0.250
(4+: 0.000
[0, 1, 2, 4]
['0.000', '0.500', '0.750', '1.000', '1.000']
Ratio of index distribution at different column sizes:
(0, 1]: 0.200
(1, 2]: 0.200
(2, 4]: 0.600
(4+: 0.000
[0, 1, 2, 4]
['0.000', '0.200', '0.400', '1.000', '1.000']
"""


def test_parse_locality_stats_on_a_small_file(tmp_path: Path) -> None:
    f = tmp_path / "locality_stats.txt"
    f.write_text(SAMPLE + "\n" + SAMPLE.replace("t2_bs4", "t2_bs4_1"))
    secs = parse_locality_stats(f)
    assert [s.trace for s in secs] == ["fbgemm_t2_bs4.pt", "fbgemm_t2_bs4_1.pt"]
    s = secs[0]
    assert (s.batch_size, s.lookups, s.unique_rows, s.mean_reuse) == (4, 100, 40, 2.5)
    assert s.edges.tolist() == [0, 1, 2, 4]
    assert s.touched_once_share == 0.5
    assert s.lookup_share.tolist() == [0.2, 0.2, 0.6, 0.0]
    assert s.top_share(0.25) == pytest.approx(0.6)  # the (2, 4] bin: 25% of rows, 60% of lookups
    assert s.top_share(0.125) == pytest.approx(0.3)
    bad = tmp_path / "bad.txt"
    bad.write_text(SAMPLE.replace("(1, 2]: 0.250", "(1, 2]: oops"))
    with pytest.raises(DataError, match=r"bad.txt:8"):
        parse_locality_stats(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="no locality sections"):
        parse_locality_stats(empty)


META = data_root() / "meta-dlrm-locality"


@pytest.mark.skipif(not META.is_dir(), reason=f"real data folder {META} is absent (set FLEXSHARD_DATA)")
def test_real_meta_files_and_calibration_agree() -> None:
    secs = []
    for year in ("2021", "2022"):
        secs += parse_locality_stats(META / year / "locality_stats.txt")
    assert len(secs) > 10
    for s in secs:
        assert s.mean_reuse == pytest.approx(s.lookups / s.unique_rows, abs=0.06)
        assert s.row_share.sum() == pytest.approx(1.0, abs=0.01)
        assert s.lookup_share.sum() == pytest.approx(1.0, abs=0.01)
    once = [s.touched_once_share for s in secs]
    reuse = [s.mean_reuse for s in secs]
    assert min(once) == pytest.approx(0.342) and max(once) == pytest.approx(0.473)
    assert min(reuse) == pytest.approx(6.9) and max(reuse) == pytest.approx(12.7)
    loc = calibration_locality()
    assert min(once) <= loc.touched_once_share <= max(once)
    assert min(reuse) <= loc.mean_reuse <= max(reuse)
    for f in (0.001, 0.01, 0.1):  # binned, 3-decimal data: compare within 2 points of the file's range
        file_shares = [s.top_share(f) for s in secs]
        assert min(file_shares) - 0.02 <= loc.top_share[f] <= max(file_shares) + 0.02, f
