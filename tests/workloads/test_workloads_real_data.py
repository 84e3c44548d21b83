"""Every real data set reads and matches the statistics in its README (skipped without the data)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from flexshard.workloads import Sampling, read_workload, top_share
from flexshard.workloads.measured import histories, with_touch_rates


def _data_dir() -> Path:
    env = os.environ.get("FLEXSHARD_DATA")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "data"


DATA = _data_dir()


def need(folder: str) -> Path:
    path = DATA / folder
    if not path.is_dir():
        pytest.skip(f"real data folder {path} is absent (set FLEXSHARD_DATA to the shared data folder)")
    return path


def readme_top(hist, touched: int, fraction: float) -> float:
    """Share of accesses of the hottest ceil(fraction * touched) touched rows (the READMEs' convention)."""
    return top_share(hist, math.ceil(fraction * touched) / touched, touched_only=True)


def summary(workload, orders, table: str) -> tuple[int, int]:
    """(touched rows, total lookups) of a table; lookups = ids per sample x samples."""
    t = {x.name: x for x in workload.tables}[table]
    samples = orders["user_id"].size if "user_id" in orders else None
    return orders[table].size, round(t.ids_per_sample * samples) if samples else -1


AMAZON = [
    # name, users, items, interactions, top 0.1/1/10% (of touched rows), attr rows, attr lookups, hottest attr
    ("Beauty", 22_363, 12_101, 198_502, (0.022, 0.105, 0.428), 637, 754_217, 0.086),
    ("Sports_and_Outdoors", 35_598, 18_357, 296_337, (0.028, 0.120, 0.418), 2_277, 1_712_163, 0.173),
    ("Toys_and_Games", 19_412, 11_924, 167_597, (0.015, 0.084, 0.358), 1_027, 717_849, 0.233),
    ("Yelp", 30_431, 20_033, 316_354, (0.018, 0.091, 0.375), 1_001, 1_614_709, 0.153),
    ("LastFM", 1_090, 3_646, 52_551, (0.013, 0.082, 0.365), 388, 1_192_490, 0.025),
]


@pytest.mark.parametrize(("name", "users", "items", "inter", "tops", "arows", "alook", "ahot"), AMAZON)
def test_amazon_yelp_sequences(name, users, items, inter, tops, arows, alook, ahot) -> None:
    folder = need("amazon-yelp-sequences")
    w, orders = read_workload(folder / f"{name}.txt")
    t = {x.name: x for x in w.tables}
    assert orders["user_id"].size == users
    assert summary(w, orders, "item_id") == (items, inter)
    for f, want in zip((0.001, 0.01, 0.1), tops, strict=True):
        assert readme_top(t["item_id"].hist, items, f) == pytest.approx(want, abs=0.0011)
    assert summary(w, orders, "item_attribute") == (arows, alook)
    assert t["item_attribute"].hist.prob[0] == pytest.approx(ahot, abs=0.0005)
    assert orders["item_id"].min() >= 1  # 1-based ids: row 0 is never touched
    assert t["item_id"].num_rows == orders["item_id"].max() + 1


def test_gowalla_train_and_test() -> None:
    folder = need("gowalla-lightgcn")
    w, orders = read_workload([folder / "train_reconstructed.txt", folder / "test.txt"])
    t = {x.name: x for x in w.tables}
    assert orders["user_id"].size == 29_858
    assert summary(w, orders, "item_id") == (40_981, 1_027_370)
    for f, want in zip((0.001, 0.01, 0.1), (0.037, 0.132, 0.396), strict=True):
        assert readme_top(t["item_id"].hist, 40_981, f) == pytest.approx(want, abs=0.0011)
    assert t["item_id"].hist.prob[0] == pytest.approx(0.0022, abs=0.00005)
    train, _ = read_workload(folder / "train_reconstructed.txt")
    assert round(train.tables[0].ids_per_sample * 29_858) == 810_128


REPEAT = [
    # folder, users, items, accesses, top 0.1/1/10%, hottest row
    ("lastfm", 893, 14_596, 2_251_405, (0.069, 0.265, 0.670), 0.0117),
    ("tw_ny", 30_320, 11_260, 690_801, (0.193, 0.422, 0.734), 0.0444),
    ("go_sf", 2_593, 7_702, 138_185, (0.063, 0.181, 0.505), 0.0277),
    ("go_ny", 1_828, 7_689, 76_301, (0.055, 0.176, 0.452), 0.0124),
]


@pytest.mark.parametrize(("split", "users", "items", "accesses", "tops", "hottest"), REPEAT)
def test_repeat_consumption(split, users, items, accesses, tops, hottest) -> None:
    folder = need("repeat-consumption-uci") / split
    w, orders = read_workload(folder)  # all csv splits of the folder, merged
    t = {x.name: x for x in w.tables}
    assert orders["user_id"].size == users
    assert summary(w, orders, "item_id") == (items, accesses)
    for f, want in zip((0.001, 0.01, 0.1), tops, strict=True):
        assert readme_top(t["item_id"].hist, items, f) == pytest.approx(want, abs=0.0011)
    assert t["item_id"].hist.prob[0] == pytest.approx(hottest, abs=0.0005)


ML_TABLES = [
    # table, rows, lookups, hottest row, top 10%
    ("item_id", 1_682, 100_000, 0.006, 0.429),
    ("user_id", 943, 100_000, 0.007, 0.322),
    ("zip_code", 795, 100_000, 0.011, 0.339),
    ("release_year", 73, 100_000, 0.187, 0.691),
    ("age", 61, 100_000, 0.064, None),
    ("occupation", 21, 100_000, 0.220, None),
    ("class", 19, 212_595, 0.188, None),
    ("gender", 2, 100_000, 0.743, None),
]


def test_movielens_100k_recbole() -> None:
    folder = need("movielens-100k-recbole")
    w, orders = read_workload(folder / "ml-100k.inter")
    t = {x.name: x for x in w.tables}
    samples = orders["user_id"].size
    assert samples == 943
    for name, rows, lookups, hottest, top10 in ML_TABLES:
        assert t[name].num_rows == rows, name
        assert round(t[name].ids_per_sample * samples) == lookups, name
        assert t[name].hist.prob[0] == pytest.approx(hottest, abs=0.0006), name
        if top10 is not None:
            assert readme_top(t[name].hist, rows, 0.1) == pytest.approx(top10, abs=0.0011), name
    # item table: 8% of items rated once
    item = t["item_id"]
    once = item.hist.rows[item.hist.prob == item.hist.prob[item.hist.prob > 0].min()].sum() / item.num_rows
    assert once == pytest.approx(0.08, abs=0.005)
    # the histories behind measured touch rates: every rating, with the item table's ids
    (seq,) = histories(folder / "ml-100k.inter", "recbole")()
    assert len(seq) == 943 and seq.items.size == 100_000
    counts = np.bincount(seq.items, minlength=item.num_rows)
    np.testing.assert_allclose(np.sort(counts)[::-1] / 100_000, np.repeat(item.hist.prob, item.hist.rows))
    measured = with_touch_rates(w, orders, lambda: [seq], Sampling("next-item", 50, 4))
    assert {x.name for x in measured.tables if x.touch is not None} == {"user_id", "item_id"}
    # truncating histories to the 50 most recent ratings (by timestamp) keeps 943 users
    short, short_orders = read_workload(folder, max_len=50)
    assert short_orders["user_id"].size == 943
    assert {x.name: x for x in short.tables}["item_id"].ids_per_sample <= 50
