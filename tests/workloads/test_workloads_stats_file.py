"""Stats files: exact round trip, atomic writes, validation, fingerprints."""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, DataError, OutputError
from flexshard.workloads import (
    Sampling,
    Sequences,
    default_workload,
    fingerprint,
    load_stats,
    read_workload,
    save_stats,
)
from flexshard.workloads import stats_file as sf
from flexshard.workloads.measured import with_touch_rates
from solvers.types import RowHistogram, TableSpec, Workload


def small_workload() -> tuple[Workload, dict[str, np.ndarray]]:
    h = RowHistogram(rows=np.array([1, 2, 7]), prob=np.array([0.5, 0.25, 0.0]))
    t1 = TableSpec("a", 10, 8, 2.5, h, length_values=np.array([2, 3]), length_probs=np.array([0.5, 0.5]))
    t2 = TableSpec("b", 4, 16, 1.0, RowHistogram(rows=np.array([4]), prob=np.array([0.25])), element_bytes=2)
    return Workload("small", (t1, t2), 32), {"a": np.array([3, 1, 2], dtype=np.int64)}


def assert_same(w1: Workload, w2: Workload) -> None:
    assert w1.name == w2.name and w1.batch_size_per_gpu == w2.batch_size_per_gpu
    for a, b in zip(w1.tables, w2.tables, strict=True):
        for fld in ("name", "num_rows", "dim", "ids_per_sample", "element_bytes", "optimizer_bytes_per_row"):
            assert getattr(a, fld) == getattr(b, fld)
        assert (a.hist.rows == b.hist.rows).all() and (a.hist.prob == b.hist.prob).all()
        assert a.hist.prob.dtype == b.hist.prob.dtype == np.float64
        if a.length_values is None:
            assert b.length_values is None
        else:
            assert (a.length_values == b.length_values).all() and (a.length_probs == b.length_probs).all()


def test_round_trip_is_exact(tmp_path: Path) -> None:
    w, orders = small_workload()
    path = save_stats(tmp_path / "s.npz", w, orders)
    w2, o2 = load_stats(path)
    assert_same(w, w2)
    assert list(o2) == ["a"] and o2["a"].tolist() == [3, 1, 2] and o2["a"].dtype == np.int64
    assert fingerprint(w2) == fingerprint(w)
    d = default_workload()
    save_stats(tmp_path / "d.npz", d)
    d2, o = load_stats(tmp_path / "d.npz")
    assert_same(d, d2) and o == {}
    assert sorted(os.listdir(tmp_path)) == ["d.npz", "s.npz"]  # no temporary files left


def test_round_trip_of_real_reader_output(tmp_path: Path) -> None:
    f = tmp_path / "toy.txt"
    f.write_text("1 5 3 5\n2 3\n3\n")
    w, orders = read_workload(f)
    w2, o2 = load_stats(save_stats(tmp_path / "toy.npz", w, orders))
    assert_same(w, w2)
    assert {k: v.tolist() for k, v in o2.items()} == {k: v.tolist() for k, v in orders.items()}


def test_failed_write_leaves_old_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w, orders = small_workload()
    target = save_stats(tmp_path / "s.npz", w, orders)
    before = target.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sf.np, "savez", boom)
    with pytest.raises(OutputError, match="cannot write"):
        save_stats(target, default_workload())
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.npz"]
    with pytest.raises(OutputError, match="folder .*missing_dir' does not exist"):
        save_stats(tmp_path / "missing_dir" / "x.npz", w)


def test_bad_orders_are_rejected_on_save(tmp_path: Path) -> None:
    w, _ = small_workload()
    with pytest.raises(ConfigError, match="no table named 'zz'"):
        save_stats(tmp_path / "s.npz", w, {"zz": np.array([0])})
    with pytest.raises(ConfigError, match="outside the table"):
        save_stats(tmp_path / "s.npz", w, {"a": np.array([10])})
    with pytest.raises(ConfigError, match="integer"):
        save_stats(tmp_path / "s.npz", w, {"a": np.array([0.5])})
    assert not list(tmp_path.iterdir())


def test_truncated_or_garbage_files_raise(tmp_path: Path) -> None:
    w, orders = small_workload()
    good = save_stats(tmp_path / "s.npz", w, orders).read_bytes()
    for n in (0, 10, len(good) // 2, len(good) - 5):
        bad = tmp_path / f"cut{n}.npz"
        bad.write_bytes(good[:n])
        with pytest.raises(DataError, match=r"cut\d+\.npz"):
            load_stats(bad)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(os.urandom(4096))
    with pytest.raises(DataError, match="junk.npz"):
        load_stats(junk)
    with pytest.raises(DataError, match="no such stats file"):
        load_stats(tmp_path / "absent.npz")
    other = tmp_path / "other.npz"
    np.savez(other, x=np.arange(3))
    with pytest.raises(DataError, match="no metadata"):
        load_stats(other)


def rewrite(src: Path, dst: Path, change) -> Path:
    """Copy an .npz, letting ``change(arrays)`` edit its arrays."""
    with np.load(src) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    np.savez(dst, **arrays)
    return dst


def test_tampered_content_raises(tmp_path: Path) -> None:
    import json

    w, orders = small_workload()
    src = save_stats(tmp_path / "s.npz", w, orders)

    def set_meta(arrays, edit):
        meta = json.loads(arrays["meta"].tobytes())
        edit(meta)
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)

    cases = [
        (lambda a: a.__setitem__("t0.prob", a["t0.prob"] * 1.0001), "fingerprint|sum to 1"),
        (lambda a: a.__setitem__("t1.rows", np.array([3])), "histogram"),
        (lambda a: a.pop("t0.order"), "array 't0.order' is missing"),
        (lambda a: a.__setitem__("t0.order", np.array([3, 3])), "repeats a row id"),
        (lambda a: a.__setitem__("t0.rows", a["t0.rows"].astype(np.float64)), "t0.rows"),
        (lambda a: set_meta(a, lambda m: m.__setitem__("version", 99)), "version 99"),
        (lambda a: set_meta(a, lambda m: m.__setitem__("format", "x")), "not a FlexShard stats file"),
        (lambda a: set_meta(a, lambda m: m["tables"][0].__setitem__("dim", "8")), "field 'dim'"),
        (lambda a: set_meta(a, lambda m: m["tables"][0].__setitem__("dim", 9)), "fingerprint"),
        (lambda a: set_meta(a, lambda m: m.pop("tables")), "field 'tables'"),
        (lambda a: a.__setitem__("meta", np.frombuffer(b"{oops", dtype=np.uint8)), "corrupt metadata"),
    ]
    for i, (change, match) in enumerate(cases):
        dst = rewrite(src, tmp_path / f"t{i}.npz", change)
        with pytest.raises(DataError, match=match):
            load_stats(dst)


def test_crc_corruption_raises(tmp_path: Path) -> None:
    w, orders = small_workload()
    path = save_stats(tmp_path / "s.npz", w, orders)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("t0.prob.npy")
    offset = info.header_offset + 30 + len(info.filename) + len(info.extra) + 130  # inside the array
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(DataError):
        load_stats(path)


def test_fingerprint_sensitivity() -> None:
    w, _ = small_workload()
    base = fingerprint(w)
    assert len(base) == 64 and base == fingerprint(small_workload()[0])
    renamed = Workload("other name", w.tables, 999)  # name and batch size do not matter
    assert fingerprint(renamed) == base
    t0, t1 = w.tables
    variants = [
        TableSpec("a2", 10, 8, 2.5, t0.hist, length_values=t0.length_values, length_probs=t0.length_probs),
        TableSpec("a", 10, 4, 2.5, t0.hist, length_values=t0.length_values, length_probs=t0.length_probs),
        TableSpec("a", 10, 8, 2.6, t0.hist, length_values=t0.length_values, length_probs=t0.length_probs),
        TableSpec("a", 10, 8, 2.5, RowHistogram(rows=np.array([2, 8]), prob=np.array([0.5, 0.0]))),
    ]
    for v in variants:
        assert fingerprint(Workload("small", (v, t1), 32)) != base
    # a pinned value: the hash must not drift between runs, machines or versions
    assert base == "5832419cfba10711354b2aa129d11e47475abac5e178282974b0be99d232b4e9"


def measured_workload() -> tuple[Workload, dict[str, np.ndarray]]:
    """Beauty-like small histories with touch rates measured for next-item samples."""
    lengths = np.array([3, 5, 2, 6])
    items = np.array([1, 2, 1, 3, 3, 4, 1, 5, 2, 2, 6, 1, 7, 1, 3, 4])
    seq = Sequences(np.arange(4), np.concatenate([[0], np.cumsum(lengths)]), items)
    counts = np.bincount(items)
    hist = RowHistogram.from_counts(counts)
    order = np.flatnonzero(counts)[np.argsort(-counts[np.flatnonzero(counts)], kind="stable")]
    table = TableSpec("item_id", counts.size, 8, float(lengths.mean()), hist)
    workload = Workload("m", (table,), 16)
    return with_touch_rates(workload, {"item_id": order}, lambda: [seq], Sampling("next-item", 2, 1)), {
        "item_id": order
    }


def test_round_trip_keeps_the_touch_profile(tmp_path: Path) -> None:
    w, orders = measured_workload()
    tp = w.tables[0].touch
    assert tp is not None and tp.sampling == "next-item, window 2, negatives 1"
    loaded, _ = load_stats(save_stats(tmp_path / "m.npz", w, orders))
    got = loaded.tables[0].touch
    assert got is not None and fingerprint(loaded) == fingerprint(w)
    for name in ("lookups", "entry_bucket", "entry_prob", "entry_rows"):
        assert np.array_equal(getattr(got, name), getattr(tp, name))
    assert (got.quantization, got.bucket_error, got.sampling) == (
        tp.quantization,
        tp.bucket_error,
        tp.sampling,
    )
    bare = dataclasses.replace(w.tables[0], touch=None)
    assert fingerprint(dataclasses.replace(w, tables=(bare,))) != fingerprint(w)  # the profile is hashed


def test_version_1_files_are_still_read(tmp_path: Path) -> None:
    w, orders = small_workload()
    path = save_stats(tmp_path / "s.npz", w, orders)
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    meta["version"] = 1
    for t in meta["tables"]:
        del t["touch"]
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(tmp_path / "v1.npz", **arrays)
    loaded, _ = load_stats(tmp_path / "v1.npz")
    assert fingerprint(loaded) == fingerprint(w) and all(t.touch is None for t in loaded.tables)
    meta["version"] = 4
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(tmp_path / "v4.npz", **arrays)
    with pytest.raises(DataError, match="stats file version 4; this FlexShard reads versions 1, 2, 3"):
        load_stats(tmp_path / "v4.npz")


def _rewrite(path: Path, out: Path, edit) -> Path:
    """``path``'s arrays and metadata, changed by ``edit(arrays, meta)``, written to ``out``."""
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays["meta"].tobytes())
    edit(arrays, meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(out, **arrays)
    return out


def test_rank_entry_round_trip_and_version_2_files(tmp_path: Path) -> None:
    w, orders = measured_workload()
    tp = w.tables[0].touch
    assert tp is not None and tp.rank_entry is not None and tp.rank_entry.dtype == np.int32
    path = save_stats(tmp_path / "m.npz", w, orders)
    loaded, _ = load_stats(path)
    assert np.array_equal(loaded.tables[0].touch.rank_entry, tp.rank_entry)

    def as_version_2(arrays, meta):  # what a version 2 writer made: no rank_entry, its own fingerprint
        meta["version"] = 2
        del arrays["t0.touch_rank_entry"]
        del meta["tables"][0]["touch"]["has_rank_entry"]
        bare = dataclasses.replace(tp, rank_entry=None)
        meta["fingerprint"] = fingerprint(
            dataclasses.replace(w, tables=(dataclasses.replace(w.tables[0], touch=bare),))
        )

    old, _ = load_stats(_rewrite(path, tmp_path / "v2.npz", as_version_2))
    assert old.tables[0].touch.rank_entry is None
    assert fingerprint(old) != fingerprint(w)  # which row is which is hashed: it prices TorchRec's ranges


def test_bad_rank_entry_raises(tmp_path: Path) -> None:
    w, orders = measured_workload()
    path = save_stats(tmp_path / "m.npz", w, orders)
    ranks = w.tables[0].touch.rank_entry
    live = np.flatnonzero(ranks >= 0)

    def swap(arrays, meta):  # rows of two buckets trade entries: every entry's count holds
        a, bucket = arrays["t0.touch_rank_entry"].copy(), arrays["t0.touch_bucket"]
        i, j = live[0], next(k for k in live if bucket[a[k]] != bucket[a[live[0]]])
        a[i], a[j] = a[j], a[i]
        arrays["t0.touch_rank_entry"] = a

    with pytest.raises(DataError, match=r"rank_entry: rank \d+ is outside bucket \d+"):
        load_stats(_rewrite(path, tmp_path / "swap.npz", swap))

    def drop(arrays, meta):
        a = arrays["t0.touch_rank_entry"].copy()
        a[live[0]] = -1
        arrays["t0.touch_rank_entry"] = a

    with pytest.raises(DataError, match="touch profile.rank_entry: lists .* rows of entry"):
        load_stats(_rewrite(path, tmp_path / "drop.npz", drop))

    def wide(arrays, meta):
        arrays["t0.touch_rank_entry"] = arrays["t0.touch_rank_entry"].astype(np.int64)

    with pytest.raises(DataError, match="'t0.touch_rank_entry' is int64 .*, expected 1-D int32"):
        load_stats(_rewrite(path, tmp_path / "wide.npz", wide))
