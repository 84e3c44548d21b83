"""Row statistics computed elsewhere (Parquet: table, row, lookups, [samples_touched,] samples): the same
workload as the in-repo history measurement of the log they were counted from (exact per-row q and m, the
same histogram, profile and fingerprint), counts only, several tables and files, every bad input as one
line naming the column, the table and the value, and ``flexshard stats`` feeding ``flexshard plan``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import ConfigError, DataError
from flexshard.cli import main
from flexshard.plan_file import read_plan
from flexshard.training import data
from flexshard.workloads import (
    ITEM_TABLE,
    USER_TABLE,
    ParquetColumns,
    Sampling,
    fingerprint,
    item_rates,
    load_stats,
    read_row_stats,
    read_workload,
    row_stats_inputs,
    write_parquet_log,
)
from flexshard.workloads.measured import histories, with_touch_rates
from flexshard.workloads.readers import hotness_order
from solvers.types import RowHistogram

WINDOW = 3


def small_log(path, seed: int = 3, users: int = 40, items: int = 25, n: int = 300):
    """A log with time ties (broken by file order) written in several row groups; its arrays."""
    rng = np.random.default_rng(seed)
    u = rng.integers(0, users, n)
    it = rng.integers(0, items, n) ** 2 % items  # skewed, some ids never used
    t = rng.integers(0, 30, n)
    write_parquet_log(path, u, it, times=t, row_group_rows=70)
    return u, it, t


def brute_rows(u, it, t, window: int) -> dict:
    """Per table: row -> (lookups, samples touched) over each user's last ``window`` interactions (by
    time, ties by file order), and the samples (users): a plain loop, as the documented query counts."""
    lookups, touched = {}, {}
    users = sorted(set(u.tolist()))
    for user in users:
        mine = [k for k in range(u.size) if u[k] == user]
        mine.sort(key=lambda k: (t[k], k))
        last = [int(it[k]) for k in mine[-window:]]
        for row in last:
            lookups[row] = lookups.get(row, 0) + 1
        for row in set(last):
            touched[row] = touched.get(row, 0) + 1
    return {
        ITEM_TABLE: {r: (lookups[r], touched[r]) for r in lookups},
        USER_TABLE: {r: (1, 1) for r in users},
        "samples": len(users),
    }


def write_rows(path, records, touched: bool = True, row_group_size: int = 5, types=None) -> None:
    """``records``: (table, row, lookups, samples_touched, samples) tuples."""
    cols = ["table", "row", "lookups", "samples_touched", "samples"]
    data = {c: [r[i] for r in records] for i, c in enumerate(cols)}
    if not touched:
        del data["samples_touched"]
    arrays = {c: pa.array(v, type=(types or {}).get(c)) for c, v in data.items()}
    pq.write_table(pa.table(arrays), path, row_group_size=row_group_size)


def records_of(rows: dict) -> list[tuple]:
    s = rows["samples"]
    return [(t, r, lk, st, s) for t in (ITEM_TABLE, USER_TABLE) for r, (lk, st) in sorted(rows[t].items())]


def test_rows_give_the_in_repo_history_measurement_exactly(tmp_path):
    log = tmp_path / "log.parquet"
    u, it, t = small_log(log)
    rows = brute_rows(u, it, t, WINDOW)
    sampling = Sampling("history", WINDOW)
    # the brute-force rows are the in-repo definition: per-row q and m exactly equal
    chunks = histories(log, "parquet", columns=ParquetColumns(time="time"))
    q, m, users = item_rates(chunks(), sampling, 25)
    assert users == rows["samples"]
    q_rows, m_rows = np.zeros(25), np.zeros(25)
    for r, (lk, st) in rows[ITEM_TABLE].items():
        q_rows[r], m_rows[r] = st / users, lk / users
    np.testing.assert_array_equal(q, q_rows)
    np.testing.assert_array_equal(m, m_rows)

    path = tmp_path / "rows.parquet"
    rng = np.random.default_rng(0)
    records = records_of(rows)
    write_rows(path, [records[k] for k in rng.permutation(len(records))])  # any record order
    got, got_orders = read_row_stats(path, sampling, dim=16)
    # the in-repo measurement of the same log, each history cut to the window (the counts too)
    workload, orders = read_workload(log, dim=16, max_len=WINDOW, columns=ParquetColumns(time="time"))
    chunks = histories(log, "parquet", WINDOW, columns=ParquetColumns(time="time"))
    expected = with_touch_rates(workload, orders, chunks, sampling)
    assert [tb.name for tb in got.tables] == [ITEM_TABLE, USER_TABLE]
    for a, b in zip(got.tables, expected.tables, strict=True):
        assert a.num_rows == b.num_rows and a.touch is not None and b.touch is not None
        np.testing.assert_array_equal(a.hist.rows, b.hist.rows)
        np.testing.assert_array_equal(a.hist.prob, b.hist.prob)
        np.testing.assert_array_equal(a.touch.entry_prob, b.touch.entry_prob)
        np.testing.assert_array_equal(a.touch.lookups, b.touch.lookups)
        assert a.touch.sampling == "history, window 3"
        np.testing.assert_array_equal(got_orders[a.name], orders[a.name])
    assert fingerprint(got) == fingerprint(expected)


def test_counts_only_and_float_lookups(tmp_path):
    path = tmp_path / "rows.parquet"
    records = [("t", 4, 2.5, None, 10), ("t", 1, 2.5, None, 10), ("t", 0, 5.0, None, 10)]
    write_rows(path, records, touched=False)
    workload, orders = read_row_stats(path, num_rows={"t": 8})
    (table,) = workload.tables
    assert table.touch is None and table.num_rows == 8
    assert table.ids_per_sample == pytest.approx(1.0)  # 10 lookups over 10 samples
    np.testing.assert_array_equal(orders["t"], [0, 1, 4])  # ties by id
    counts = np.array([5.0, 2.5, 0, 0, 2.5, 0, 0, 0])
    expected = RowHistogram.from_counts(counts, 8)
    np.testing.assert_array_equal(table.hist.rows, expected.rows)
    np.testing.assert_array_equal(table.hist.prob, expected.prob)
    np.testing.assert_array_equal(hotness_order(counts), orders["t"])


def test_several_tables_and_part_files(tmp_path):
    """A folder of part files is one data set: tables span files, sorted by name; a table
    in files without samples_touched keeps the independent-draw model while the others are measured."""
    parts = tmp_path / "out"
    parts.mkdir()
    (parts / "_SUCCESS").write_text("")
    write_rows(
        parts / "part-0.parquet",
        [("b", 0, 3, 2, 4), ("a", 2, 1, 1, 4), ("b", 5, 1, 1, 4), ("a", 0, 4, 3, 4)],
        row_group_size=1,
    )
    write_rows(parts / "part-1.parquet", [("b", 3, 2, 2, 4), ("b", 1, 6, 4, 4)], row_group_size=3)
    write_rows(parts / "part-2.parquet", [("c", 1, 7, None, 2)], touched=False)
    assert row_stats_inputs([parts]) == sorted(parts.glob("*.parquet"))
    workload, orders = read_row_stats(parts, Sampling("history", 5))
    assert [t.name for t in workload.tables] == ["a", "b", "c"]
    a, b, c = workload.tables
    assert (b.num_rows, a.num_rows, c.num_rows) == (6, 3, 2)
    np.testing.assert_array_equal(orders["b"], [1, 0, 3, 5])
    np.testing.assert_array_equal(orders["a"], [0, 2])
    assert b.ids_per_sample == pytest.approx(12 / 4) and a.ids_per_sample == pytest.approx(5 / 4)
    assert b.touch is not None and a.touch is not None and c.touch is None
    assert c.ids_per_sample == pytest.approx(7 / 2)
    # per-sample touch probabilities: b's rows 1, 0, 3, 5 are touched by 4, 2, 2, 1 of 4 samples
    assert sorted(np.repeat(b.touch.entry_prob, b.touch.entry_rows)) == pytest.approx(
        [0.25, 0.5, 0.5, 1.0], rel=0.006
    )


GOOD = [("t", 0, 3, 2, 4), ("t", 1, 1, 1, 4), ("u", 0, 2, 2, 2)]


def _with(k: int, **changes) -> list[tuple]:
    cols = ["table", "row", "lookups", "samples_touched", "samples"]
    out = [list(r) for r in GOOD]
    for c, v in changes.items():
        out[k][cols.index(c)] = v
    return [tuple(r) for r in out]


@pytest.mark.parametrize(
    "records, expected",
    [
        (_with(1, lookups=-1), "record 1: table 't': column 'lookups' value -1: must be >= 0"),
        (_with(0, row=-2), "record 0: table 't': column 'row' value -2: row ids must be >= 0"),
        (_with(1, samples_touched=5, lookups=9), "column 'samples_touched' value 5: more than the samples 4"),
        (_with(0, samples_touched=4), "column 'samples_touched' value 4: more than the row's lookups 3"),
        (_with(0, samples_touched=0), "column 'samples_touched' value 0: the row has lookups 3"),
        (
            _with(1, samples=5),
            "record 1: table 't': column 'samples' value 5: differs from the table's samples 4",
        ),
        (_with(2, samples=0), "table 'u': column 'samples' value 0: must be a positive integer"),
        (_with(1, row=0), "record 1: table 't': column 'row' value 0: appears twice for this table"),
        (_with(2, table=None), "record 2: column 'table' value null: missing values are not allowed"),
        (_with(1, samples_touched=None), "table 't': column 'samples_touched' value null"),
        ([(t, r, 0, 0, s) for t, r, _, _, s in GOOD], "table 't': every row has lookups 0"),
    ],
)
def test_bad_values_name_the_column_table_and_value(tmp_path, records, expected):
    path = tmp_path / "rows.parquet"
    write_rows(path, records, row_group_size=10)
    with pytest.raises(DataError) as info:
        read_row_stats(path, Sampling("history", 5))
    assert expected in str(info.value) and str(info.value).startswith(str(path))
    assert len(str(info.value).splitlines()) == 1


def test_errors_across_batches_and_files_and_of_the_schema(tmp_path):
    path = tmp_path / "rows.parquet"
    write_rows(path, [("t", 3, 1, 1, 4), ("t", 3, 1, 1, 4)], row_group_size=1)  # duplicate, next batch
    with pytest.raises(DataError, match=r"record 1: table 't': column 'row' value 3: appears twice"):
        read_row_stats(path)
    write_rows(path, [("t", 3, 1, 1, 4), ("t", 2, 1, 1, 6)], row_group_size=1)
    with pytest.raises(DataError, match=r"column 'samples' value 6: differs from the table's samples 4 \("):
        read_row_stats(path)
    write_rows(path, [("t", 3, 1.0, 1, 4)], types={"lookups": pa.float64()})
    with pytest.raises(DataError, match="column 'row' value 3: outside the table \\('t' has num_rows 2\\)"):
        read_row_stats(path, num_rows={"t": 2})
    with pytest.raises(ConfigError, match="num_rows: no table named 'x'; tables are t"):
        read_row_stats(path, num_rows={"x": 2})
    write_rows(path, [("t", 3, float("nan"), 1, 4)])
    with pytest.raises(DataError, match="column 'lookups' value nan: must be a finite number"):
        read_row_stats(path)
    pq.write_table(pa.table({"table": ["t"], "row": [1], "lookups": [2]}), path)
    with pytest.raises(DataError, match="no column 'samples' \\(row statistics have columns table, row"):
        read_row_stats(path)
    pq.write_table(pa.table({"table": ["t"], "row": [1.5], "lookups": [2], "samples": [3]}), path)
    with pytest.raises(DataError, match="column 'row' has type double; expected integers"):
        read_row_stats(path)
    write_rows(path, [("t", 1, 2, None, 3)], touched=False)
    with pytest.raises(ConfigError, match="needs per-row 'samples_touched'"):
        read_row_stats(path, Sampling("history", 5))
    other = tmp_path / "other.parquet"
    write_rows(other, [("t", 0, 2, 1, 3)])
    with pytest.raises(DataError, match="table 't': some of its records have a 'samples_touched' column"):
        read_row_stats([path, other])


def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_stats_on_rows_then_plan(tmp_path, capsys):
    log = tmp_path / "log.parquet"
    u, it, t = small_log(log)
    rows = tmp_path / "rows.parquet"
    write_rows(rows, records_of(brute_rows(u, it, t, WINDOW)))
    a, b, plan = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "plan.json"
    history = ("--touch-rates", "history", "--window", WINDOW)
    rc, text, _ = cli(capsys, "stats", rows, *history, "--dim", 16, "--out", a)
    assert rc == 0, text
    assert "Touch rates: item_id measured (history, window 3; bucketing error" in text
    rc, _, _ = cli(
        capsys, "stats", log, "--time-col", "time", "--max-len", WINDOW, *history, "--dim", 16, "--out", b
    )
    assert rc == 0
    assert fingerprint(load_stats(a)[0]) == fingerprint(load_stats(b)[0])
    assert set(load_stats(a)[1]) == {ITEM_TABLE, USER_TABLE}
    rc, text, _ = cli(capsys, "plan", "--workload", a, "--topology", "h100:2x2", "--out", plan)
    assert rc == 0 and "Touch rates: item_id measured (history, window 3" in text
    assert read_plan(plan).tables[0].touch_rates == "history, window 3"


def test_stats_on_rows_flags(tmp_path, capsys):
    rows, log = tmp_path / "rows.parquet", tmp_path / "log.parquet"
    write_rows(rows, GOOD)
    small_log(log)
    out = tmp_path / "s.npz"

    def fails(*argv) -> str:
        rc, _, err = cli(capsys, "stats", *argv, "--out", out)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and not out.exists(), err
        return err.strip()

    assert "--touch-rates: " in fails(rows) and "has samples_touched" in fails(rows)
    assert "--max-len: row statistics are counted already" in fails(
        rows, "--touch-rates", "off", "--max-len", 5
    )
    assert "pass one kind at a time" in fails(rows, log)
    assert "no column 'table'" in fails(log, "--format", "rows")
    rc, text, _ = cli(capsys, "stats", rows, "--touch-rates", "off", "--num-rows", "t=5", "--out", out)
    assert rc == 0 and "Touch rates: independent draws" in text
    workload, _ = load_stats(out)
    assert [t.num_rows for t in workload.tables] == [5, 1]
    counts_only = tmp_path / "counts.parquet"
    write_rows(counts_only, GOOD, touched=False)
    out.unlink()
    assert "has no samples_touched column" in fails(counts_only, "--touch-rates", "history")
    rc, _text, err = cli(capsys, "stats", counts_only, "--out", out)
    assert rc == 0 and "note: no samples_touched column" in err  # the log


def test_train_refuses_row_statistics_as_data(tmp_path):
    path = tmp_path / "rows.parquet"
    write_rows(path, [("item_id", 0, 3, 2, 5), ("item_id", 1, 1, 1, 5)])
    with pytest.raises(DataError, match=r"--data: .*rows\.parquet: per-row statistics \(table, row, lookups"):
        data.SequenceFileSource(str(path), dim=4, max_len=2, negatives=1, batch_size=8, seed=0)
