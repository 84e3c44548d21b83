"""Presets, load_workload dispatch, build_stats and describe."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError, DataError
from flexshard.workloads import (
    build_stats,
    default_workload,
    describe,
    fingerprint,
    load_workload,
    load_workload_with_orders,
    preset_names,
    save_stats,
)


def test_presets() -> None:
    assert fingerprint(load_workload("default")) == fingerprint(default_workload())
    z = load_workload("zipf:1.2")
    assert z.name == "default-zipf1.2" and len(z.tables) == len(default_workload().tables)
    s = load_workload("synthetic:20:1e7:0.95:3")
    assert len(s.tables) == 20 and s.num_rows == 10**7
    assert fingerprint(s) == fingerprint(load_workload("synthetic:20:1e7:0.95:3"))
    c = load_workload("calibration")
    assert len(c.tables) == 1
    w, orders = load_workload_with_orders("default", batch_size_per_gpu=128)
    assert w.batch_size_per_gpu == 128 and orders == {}


@pytest.mark.parametrize(
    "spec", ["nope", "zipf:abc", "zipf", "synthetic:10", "synthetic:1.5:100", "zipf:inf"]
)
def test_unknown_or_malformed_specs_list_the_presets(spec: str) -> None:
    with pytest.raises(ConfigError, match="workload") as err:
        load_workload(spec)
    if spec == "nope":
        for name in preset_names():
            assert name in str(err.value)


def test_files_and_folders(tmp_path: Path) -> None:
    f = tmp_path / "toy.txt"
    f.write_text("1 5 3 5\n2 3\n")
    w, orders = load_workload_with_orders(f, dim=16, batch_size_per_gpu=8)
    assert w.batch_size_per_gpu == 8 and {t.dim for t in w.tables} == {16}
    assert orders["item_id"].tolist() == [3, 5]
    stats = save_stats(tmp_path / "toy.npz", w, orders)
    w2, o2 = load_workload_with_orders(str(stats))
    assert fingerprint(w2) == fingerprint(w) and o2["item_id"].tolist() == [3, 5]
    assert load_workload(stats, batch_size_per_gpu=64).batch_size_per_gpu == 64
    with pytest.raises(DataError, match="no such file"):
        load_workload(tmp_path / "missing.npz")


def test_build_stats(tmp_path: Path) -> None:
    a = tmp_path / "a.csv"
    a.write_text("0,1,2\n1,1,1\n")
    b = tmp_path / "b.csv"
    b.write_text("0,2,4\n")
    w, orders = build_stats([str(a), str(b)], batch_size_per_gpu=16)
    assert w.batch_size_per_gpu == 16 and orders["item_id"].tolist() == [2, 1]
    p, o = build_stats(["default"], batch_size_per_gpu=1024)
    assert o == {} and p.batch_size_per_gpu == 1024
    with pytest.raises(DataError, match="no such file"):
        build_stats([str(tmp_path / "nothing.txt")])
    with pytest.raises(ConfigError, match="at least one"):
        build_stats([])


def test_describe_lists_every_table() -> None:
    w = default_workload()
    text = describe(w)
    for t in w.tables:
        assert t.name in text
    assert fingerprint(w)[:12] in text
    header = text.splitlines()[1]
    for col in ("rows", "dim", "ids/smp", "top0.1%", "top1%", "top10%", "slope", "untouched"):
        assert col in header
    assert "200M" in text
