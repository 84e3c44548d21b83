"""Parquet interaction logs: exact histories of a hand-written log (unsorted users, time ties, counts 0),
the external group-by spilled to partitions agreeing with the in-memory one, counts agreeing with the
csv reader, every bad input as one DataError line, format detection and ``flexshard stats``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from flexshard.cli import main
from flexshard.workloads import (
    ITEM_TABLE,
    USER_TABLE,
    ParquetColumns,
    Sequences,
    detect_format,
    fingerprint,
    load_stats,
    parquet_histories,
    read_parquet,
    read_workload,
    write_parquet_log,
)
from flexshard.workloads.readers import read_csv

# user, item, time, count: users unsorted, ties in time (rows 1/4 and 0/5), counts 0 (rows 3 and 7)
LOG = np.array(
    [
        [3, 10, 5, 1],
        [1, 11, 2, 2],
        [3, 12, 1, 1],
        [2, 13, 7, 0],
        [1, 14, 2, 1],
        [3, 15, 5, 3],
        [1, 16, 0, 1],
        [3, 17, 9, 0],
    ]
)
TIMED = ParquetColumns(time="time", count="count")
BY_TIME = {1: [16, 11, 11, 14], 2: [], 3: [12, 10, 15, 15, 15]}  # ties keep file order


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "log.parquet"
    write_parquet_log(path, LOG[:, 0], LOG[:, 1], LOG[:, 2], LOG[:, 3], row_group_rows=3)
    return path


def as_dict(parts: list[Sequences]) -> dict[int, list[int]]:
    """{user: items} over all partitions; each user once, ascending within a partition."""
    out: dict[int, list[int]] = {}
    for seq in parts:
        assert seq.users.dtype == seq.items.dtype == seq.offsets.dtype == np.int64
        assert (np.diff(seq.users) > 0).all() and seq.offsets[-1] == seq.items.size
        for k, u in enumerate(seq.users.tolist()):
            assert u not in out, f"user {u} in two partitions"
            out[u] = seq.history(k).tolist()
    return dict(sorted(out.items()))


def reference(users, items, times, counts, max_len=None) -> dict[int, list[int]]:
    """The histories the slow obvious way: rows by (user, time, row), each item count times."""
    out: dict[int, list[int]] = {}
    for r in np.lexsort((np.arange(len(users)), times, users)):
        out.setdefault(int(users[r]), []).extend([int(items[r])] * int(counts[r]))
    return {u: (h[-max_len:] if max_len else h) for u, h in sorted(out.items())}


# ---------------------------------------------------------------------------------------- histories


def test_histories_in_time_order_with_ties_counts_and_max_len(log: Path) -> None:
    assert as_dict(list(parquet_histories(log, TIMED))) == BY_TIME
    assert as_dict(list(parquet_histories(log, TIMED, max_len=2))) == {1: [11, 14], 2: [], 3: [15, 15]}
    assert as_dict(list(parquet_histories(log, TIMED, max_len=4)))[3] == [10, 15, 15, 15]
    file_order = as_dict(list(parquet_histories(log, ParquetColumns(count="count"))))
    assert file_order == {1: [11, 11, 14, 16], 2: [], 3: [10, 12, 15, 15, 15]}
    no_counts = as_dict(list(parquet_histories(log, ParquetColumns(time="time"))))
    assert no_counts == {1: [16, 11, 14], 2: [13], 3: [12, 10, 15, 17]}


def test_spilled_partitions_give_the_same_histories(log: Path, tmp_path: Path, monkeypatch) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    seen: list[tuple[int, int]] = []
    parts = list(parquet_histories(log, TIMED, memory_bytes=200, progress=lambda d, t: seen.append((d, t))))
    assert len(parts) > 1  # P > 1: the users were hashed into several partition files
    assert as_dict(parts) == BY_TIME
    assert seen == [(3, 8), (6, 8), (8, 8)]  # after each row group
    assert list(spill.iterdir()) == []  # the temporary folder is gone
    spilled = as_dict(list(parquet_histories(log, TIMED, max_len=2, memory_bytes=200)))
    assert spilled == as_dict(list(parquet_histories(log, TIMED, max_len=2)))
    stopped = parquet_histories(log, TIMED, memory_bytes=200)
    next(stopped)
    assert len(list(spill.iterdir())) == 1  # the partition files, until the reader is closed
    stopped.close()
    assert list(spill.iterdir()) == []


@pytest.mark.parametrize("max_len", [None, 3])
def test_random_log_spilled_or_not_matches_the_reference(tmp_path: Path, max_len: int | None) -> None:
    rng = np.random.default_rng(7)
    n = 3000
    users, items = rng.integers(0, 200, n), rng.integers(0, 1000, n)
    times, counts = rng.integers(0, 30, n), rng.integers(0, 3, n)
    path = tmp_path / "random.parquet"
    write_parquet_log(path, users, items, times, counts, row_group_rows=500)
    expected = reference(users, items, times, counts, max_len)
    whole = list(parquet_histories(path, TIMED, max_len=max_len))
    spilled = list(parquet_histories(path, TIMED, max_len=max_len, memory_bytes=20_000))
    assert len(whole) == 1 and len(spilled) > 4
    assert as_dict(whole) == as_dict(spilled) == expected


def test_an_error_in_a_late_row_group_removes_the_spill(tmp_path: Path, monkeypatch) -> None:
    spill = tmp_path / "spill"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    users = np.arange(100) % 7
    users[95] = -4
    path = tmp_path / "late.parquet"
    write_parquet_log(path, users, np.arange(100), row_group_rows=10)
    with pytest.raises(DataError, match=r"row 95: column 'user' value -4"):
        list(parquet_histories(path, memory_bytes=500))
    assert list(spill.iterdir()) == []


# -------------------------------------------------------------------------------------------- counts


def test_read_parquet_counts_equal_read_csv(log: Path, tmp_path: Path) -> None:
    csv = tmp_path / "log.csv"
    csv.write_text("".join(f"{u},{i},{c}\n" for u, i, _, c in LOG))
    a, b = read_parquet(log, columns=TIMED), read_csv(csv)
    assert a.counts[ITEM_TABLE].tolist() == b.counts[ITEM_TABLE].tolist()
    assert a.num_rows == b.num_rows and a.per_sample_table == b.per_sample_table == USER_TABLE
    wa, oa = read_workload(log, columns=TIMED)
    wb, ob = read_workload(csv)
    assert fingerprint(wa) == fingerprint(wb)
    assert {t: o.tolist() for t, o in oa.items()} == {t: o.tolist() for t, o in ob.items()}
    limited = read_parquet(log, num_rows={USER_TABLE: 10, ITEM_TABLE: 20}, columns=TIMED)
    assert limited.num_rows == {ITEM_TABLE: 20, USER_TABLE: 10}


def test_read_parquet_max_len_counts_the_kept_items(log: Path) -> None:
    parsed = read_parquet(log, max_len=2, columns=TIMED)
    assert parsed.sample_user.tolist() == [1, 2, 3]
    assert parsed.lengths[ITEM_TABLE].tolist() == [2, 0, 2]  # {1: [11, 14], 2: [], 3: [15, 15]}
    assert np.flatnonzero(parsed.counts[ITEM_TABLE]).tolist() == [11, 14, 15]
    assert parsed.counts[ITEM_TABLE][[11, 14, 15]].tolist() == [1, 1, 2]


def test_timestamp_and_date_columns_order_histories(tmp_path: Path) -> None:
    path = tmp_path / "ts.parquet"
    stamps = pa.array(np.array([30, 10, 20], dtype="datetime64[s]"), type=pa.timestamp("s", tz="UTC"))
    dates = pa.array(np.array([3, 1, 2], dtype="datetime64[D]"), type=pa.date32())
    table = pa.table({"user": [5, 5, 5], "item": [1, 2, 3], "ts": stamps, "day": dates})
    pq.write_table(table, path)
    for col in ("ts", "day"):
        parts = list(parquet_histories(path, ParquetColumns(time=col)))
        assert as_dict(parts) == {5: [2, 3, 1]}


# -------------------------------------------------------------------------------------------- errors


def write_table(path: Path, **cols) -> Path:
    pq.write_table(pa.table(cols), path)
    return path


def one_line_error(path: Path, columns: ParquetColumns = ParquetColumns(), **kwargs) -> str:  # noqa: B008
    with pytest.raises(DataError) as e:
        read_parquet(path, columns=columns, **kwargs)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    with pytest.raises(DataError) as again:  # the histories read the same checks
        list(parquet_histories(path, columns, limits=kwargs.get("num_rows")))
    assert str(again.value) == message
    return message


U, T, C = ParquetColumns(), ParquetColumns(time="t"), ParquetColumns(count="n")
BAD = [  # columns, ParquetColumns, num_rows, the message
    (
        {"uid": [1], "item": [2]},
        U,
        None,
        "no column 'user' (the user column); the file has columns uid, item",
    ),
    ({"user": [1], "item": [2.5]}, U, None, "column 'item' (item) has type double; expected integers"),
    ({"user": [1], "item": ["a"]}, U, None, "column 'item' (item) has type string"),
    ({"user": [1], "item": [2], "t": [0.5]}, T, None, "column 't' (time) has type double"),
    ({"user": [1, 2, None], "item": [2, 3, 4]}, U, None, "row 2: column 'user' value null"),
    ({"user": [1, 2, 3, -1], "item": [2, 3, 4, 5]}, U, None, "row 3: column 'user' value -1: ids < 0"),
    (
        {"user": [1, 2], "item": [4, 7]},
        U,
        {ITEM_TABLE: 5},
        "row 1: column 'item' value 7: ids outside the table ('item_id' has num_rows 5)",
    ),
    (
        {"user": [2**32], "item": [1]},
        U,
        None,
        "row 0: column 'user' value 4294967296: ids of 4,294,967,296 and above need remapping to dense "
        "ids (or an explicit num_rows)",
    ),
    (
        {"user": [1, 1], "item": [1, 2], "n": [1, -2]},
        C,
        None,
        "row 1: column 'n' value -2: counts must be >= 0",
    ),
    ({"user": [1, 1], "item": [1, 2], "n": [1, None]}, C, None, "row 1: column 'n' value null"),
]


@pytest.mark.parametrize(("cols", "columns", "num_rows", "expected"), BAD)
def test_bad_content_is_one_data_error_line(tmp_path: Path, cols, columns, num_rows, expected) -> None:
    path = write_table(tmp_path / "bad.parquet", **cols)
    assert expected in one_line_error(path, columns, num_rows=num_rows)


def test_not_parquet_missing_and_empty_files(tmp_path: Path) -> None:
    text = tmp_path / "text.parquet"
    text.write_text("1 2 3\n")
    assert f"{text}: not a Parquet file (" in one_line_error(text)
    assert "cannot read" in one_line_error(tmp_path / "missing.parquet")
    empty = tmp_path / "empty.parquet"
    write_parquet_log(empty, np.zeros(0, np.int64), np.zeros(0, np.int64))
    assert one_line_error(empty) == f"{empty}: empty file (no rows)"


# ------------------------------------------------------------------------------- formats and the CLI


def test_detect_format_by_extension_and_magic_bytes(log: Path, tmp_path: Path) -> None:
    assert detect_format(log) == "parquet"
    assert detect_format(tmp_path / "x.PQ") == "parquet"
    renamed = tmp_path / "log.bin"
    renamed.write_bytes(log.read_bytes())
    assert detect_format(renamed) == "parquet"
    folder = tmp_path / "splits"
    folder.mkdir()
    write_parquet_log(folder / "a.parquet", [1, 2], [3, 4])
    write_parquet_log(folder / "b.pq", [2], [5])
    workload, orders = read_workload(folder)  # a folder of Parquet splits, merged by user
    assert orders[ITEM_TABLE].tolist() == [3, 4, 5] and orders[USER_TABLE].tolist() == [1, 2]
    items = workload.tables[[t.name for t in workload.tables].index(ITEM_TABLE)]
    assert items.length_values.tolist() == [1, 2] and items.ids_per_sample == 1.5  # user 2: 4 and 5


def test_stats_command_reads_parquet_like_csv(log: Path, tmp_path: Path, capsys) -> None:
    csv = tmp_path / "log.csv"
    csv.write_text("".join(f"{u},{i},{c}\n" for u, i, _, c in LOG))
    out_csv, out_pq, out_recent = tmp_path / "c.npz", tmp_path / "p.npz", tmp_path / "r.npz"
    assert main(["stats", str(csv), "--out", str(out_csv)]) == 0
    assert main(["stats", str(log), "--count-col", "count", "--out", str(out_pq)]) == 0
    assert fingerprint(load_stats(out_pq)[0]) == fingerprint(load_stats(out_csv)[0])
    ones = tmp_path / "ones.csv"  # without --count-col every row is one interaction
    ones.write_text("".join(f"{u},{i},1\n" for u, i, _, _ in LOG))
    assert main(["stats", str(ones), "--out", str(out_csv)]) == 0
    assert main(["stats", str(log), "--out", str(out_pq)]) == 0
    assert fingerprint(load_stats(out_pq)[0]) == fingerprint(load_stats(out_csv)[0])
    args = [
        "stats",
        str(log),
        "--time-col",
        "time",
        "--count-col",
        "count",
        "--max-len",
        "2",
        "--touch-rates",
        "off",
    ]
    assert main([*args, "--out", str(out_recent)]) == 0
    assert load_stats(out_recent)[0].tables[0].ids_per_sample == pytest.approx(4 / 3)  # 2 + 0 + 2 items
    capsys.readouterr()
    assert main(["stats", str(log), "--user-col", "uid", "--out", str(tmp_path / "x.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no column 'uid'" in err[0] and not (tmp_path / "x.npz").exists()
