"""Data files as users have them, through the CLI: a ``user,item,timestamp`` CSV through stats, plan and
train; string ids through the vocabulary stats writes, the plan records and train reuses (or refuses);
each reproduction of issue 22 as one line and exit status 2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fails, run

from flexshard.train import main as train
from flexshard.training.data import DataOptions, SequenceFileSource
from flexshard.workloads import ParquetColumns, load_stats, load_stats_with_vocabulary

TOPOLOGY = "h100:1x1"  # one rank: train runs in this process


@pytest.fixture(autouse=True)
def _one_rank(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _log(path: Path, rows: list[tuple], header: str) -> Path:
    path.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return path


def _rows(seed: int, n: int = 600, codes: bool = False) -> list[tuple]:
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, 40, n), rng.zipf(1.4, n) % 90
    times = rng.integers(1_600_000_000, 1_700_000_000, n)
    if codes:
        return [(f"C{u:03d}", f"B{i:05X}", t) for u, i, t in zip(users, items, times, strict=True)]
    return list(zip(users.tolist(), items.tolist(), times.tolist(), strict=True))


def _stats_and_plan(capsys, data: Path, tmp_path: Path, tag: str) -> tuple[Path, Path]:
    npz, plan = tmp_path / f"{tag}.npz", tmp_path / f"{tag}.json"
    rc, out, err = run(capsys, "stats", str(data), "--dim", "16", "--out", str(npz))
    assert rc == 0, err
    rc, _out, err = run(capsys, "plan", "--workload", str(npz), "--topology", TOPOLOGY, "--batch-size", "16",
                        "--out", str(plan))  # fmt: skip
    assert rc == 0, err
    return npz, plan


def test_user_item_timestamp_csv_goes_through_stats_plan_and_train(tmp_path, capsys):
    """The issue's "done when": was a 34.9 TiB allocation traceback (the timestamp taken for a count)."""
    data = _log(tmp_path / "x.csv", _rows(0), "user,item,timestamp")
    rc, out, err = run(capsys, "stats", str(data), "--dim", "16", "--out", str(tmp_path / "s.npz"))
    assert rc == 0 and err.splitlines() == [f"wrote {tmp_path / 's.npz'}" + err.split("npz", 1)[1].rstrip()]
    assert "no time column" not in out + err  # histories are in time order
    workload, orders = load_stats(tmp_path / "s.npz")
    items = np.array([r[1] for r in _rows(0)])
    item = next(t for t in workload.tables if t.name == "item_id")
    assert item.num_rows == items.max() + 1 and len(orders["item_id"]) == np.unique(items).size
    _npz, plan = _stats_and_plan(capsys, data, tmp_path, "x")
    assert "vocabulary" not in json.loads(plan.read_text())["fingerprints"]  # integer ids
    assert train(["--data", str(data), "--plan", str(plan), "--steps", "2"]) == 0
    out, err = capsys.readouterr()
    assert (
        "no time column" not in out + err and f"data {data} " in err
    )  # the log names the data, not its order


def test_without_time_the_summary_says_file_order(tmp_path, capsys):
    data = _log(tmp_path / "ui.csv", [(r[0], r[1]) for r in _rows(1)], "user,item")
    rc, _out, err = run(capsys, "stats", str(data), "--out", str(tmp_path / "s.npz"))
    assert rc == 0
    assert f"note: {data} has no time column: each user's history is in file order" in err


def test_tab_separated_counts_and_named_columns(tmp_path, capsys):
    """Tab-separated ``user item count`` (was read as a sequence file, counts becoming item ids), and columns
    chosen by the Parquet flags."""
    tsv = tmp_path / "plays.tsv"
    tsv.write_text("1\t5\t3\n2\t6\t1\n")
    assert run(capsys, "stats", str(tsv), "--touch-rates", "off", "--out", str(tmp_path / "t.npz"))[0] == 0
    workload, orders = load_stats(tmp_path / "t.npz")
    item = next(t for t in workload.tables if t.name == "item_id")
    assert orders["item_id"].tolist() == [5, 6] and item.num_rows == 7 and item.ids_per_sample == 2.0
    log = tmp_path / "log.csv"
    log.write_text("who,what,when,n\n1,5,9,1\n1,6,1,2\n")
    flags = ["--user-col", "who", "--item-col", "what", "--time-col", "when", "--count-col", "n"]
    assert run(capsys, "stats", str(log), *flags, "--out", str(tmp_path / "l.npz"))[0] == 0
    assert load_stats(tmp_path / "l.npz")[1]["item_id"].tolist() == [6, 5]  # 6 twice
    line = fails(capsys, "stats", str(log), "--out", str(tmp_path / "m.npz"))
    assert line.startswith(
        f"flexshard stats: error: {log}:1: no user column in the header 'who, what, when, n'"
    )


def test_string_ids_vocabulary_written_recorded_and_reused(tmp_path, capsys):
    codes = _log(tmp_path / "codes.csv", _rows(2, codes=True), "customer_id,product_id,timestamp")
    npz, plan = _stats_and_plan(capsys, codes, tmp_path, "codes")
    workload, _orders, vocab = load_stats_with_vocabulary(npz)
    firsts = list(dict.fromkeys(r[1] for r in _rows(2, codes=True)))
    assert vocab.strings("item_id") == firsts  # first-seen order
    sizes = {t.name: t.num_rows for t in workload.tables}
    assert sizes == {"item_id": len(firsts), "user_id": vocab.size("user_id")}
    assert json.loads(plan.read_text())["fingerprints"]["vocabulary"] == vocab.fingerprint()
    base = ["--data", str(codes), "--plan", str(plan), "--steps", "2", "--quiet"]
    assert train([*base, "--vocab", str(npz)]) == 0
    assert train(base) == 0  # the vocabulary built from the same file is the same
    # the same rows in another order: other first-seen rows for the same strings
    shuffled = _log(tmp_path / "shuffled.csv", _rows(2, codes=True)[::-1], "customer_id,product_id,timestamp")
    other_npz, _ = _stats_and_plan(capsys, shuffled, tmp_path, "shuffled")
    for argv in ([*base, "--vocab", str(other_npz)], ["--data", str(shuffled), *base[2:]]):
        capsys.readouterr()
        assert train(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            "flexshard train: error: --plan was made from data whose string ids map to rows by"
        )
        assert "pass --vocab with the stats file the plan was made from" in err and err.count("\n") == 1


def test_train_source_maps_through_the_stats_vocabulary(tmp_path, capsys):
    codes = _log(tmp_path / "codes.csv", _rows(3, codes=True), "customer_id,product_id,timestamp")
    npz, _plan = _stats_and_plan(capsys, codes, tmp_path, "codes")
    _w, _o, vocab = load_stats_with_vocabulary(npz)
    subset = _log(tmp_path / "subset.csv", _rows(3, codes=True)[300:], "customer_id,product_id,timestamp")
    source = SequenceFileSource(str(subset), 16, 5, 1, 8, 0, DataOptions(vocab=str(npz)))
    assert dict((n, r) for n, r, _d in source.tables) == {"item_id": vocab.size("item_id"),
                                                           "user_id": vocab.size("user_id")}  # fmt: skip
    batch = source.batch(0, 0)
    assert batch.history["item_id"].max() < vocab.size("item_id")
    strings = vocab.strings("item_id")
    rows = _rows(3, codes=True)[300:]
    # every history item is the stats row of its string: the items of the users with two or more rows
    per_user: dict[str, list[str]] = {}
    for user, product, _t in rows:
        per_user.setdefault(user, []).append(product)
    expected = sorted(p for products in per_user.values() if len(products) > 1 for p in products)
    assert sorted(strings[i] for i in source.sampler.items.tolist()) == expected
    unknown = _log(tmp_path / "unknown.csv", [("C001", "NEW", 1)], "customer_id,product_id,timestamp")
    with pytest.raises(
        Exception, match=r"unknown\.csv: column 'product_id': id 'NEW' is not in the vocabulary"
    ):
        SequenceFileSource(str(unknown), 16, 5, 1, 8, 0, DataOptions(vocab=str(npz)))
    ints = _stats_and_plan(capsys, _log(tmp_path / "i.csv", _rows(3), "user,item,timestamp"), tmp_path, "i")[
        0
    ]
    with pytest.raises(Exception, match=r"--vocab: .*i\.npz: holds no vocabulary"):
        SequenceFileSource(str(codes), 16, 5, 1, 8, 0, DataOptions(ParquetColumns(), str(ints)))


def test_reproductions_are_one_line(tmp_path, capsys):
    out = str(tmp_path / "o.npz")
    big = tmp_path / "big.csv"
    big.write_text("user,item,count\n1,5,1e14\n2,5,1\n")
    line = fails(capsys, "stats", str(big), "--out", out)
    assert line.startswith(
        f"flexshard stats: error: {big}: column 'count': the counts add up to 1e+14 interactions, past the "
    )
    assert "that fit in this machine's memory as histories" in line and not Path(out).exists()
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    assert fails(capsys, "stats", str(fifo), "--out", out) == (
        f"flexshard stats: error: {fifo}: is a named pipe (fifo), not a regular file: data files are read "
        "more than once; save it to a file first"
    )
    folder = tmp_path / "folder"
    folder.mkdir()
    assert fails(capsys, "stats", str(folder), "--out", out) == (
        f"flexshard stats: error: {folder}: cannot tell which files of this folder to read (it is empty); "
        "pass the files"
    )
    for path, what in (
        (folder, "is a folder; train reads one file of user histories"),
        (fifo, "is a named pipe"),
    ):
        assert train(["--data", str(path), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"flexshard train: error: --data: {path}: {what}") and err.count("\n") == 1
    assert train(["--data", str(big), "--steps", "1"]) == 2
    assert "the counts add up to 1e+14 interactions" in capsys.readouterr().err
    assert train(["--vocab", "s.npz", "--steps", "1"]) == 2
    assert "--vocab needs --data" in capsys.readouterr().err


def test_train_column_flags_apply_to_parquet_and_csv(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(4)
    who, what, when = (pa.array([r[k] for r in rows]) for k in range(3))
    pq.write_table(pa.table({"who": who, "what": what, "when": when}), tmp_path / "log.parquet")
    csv = _log(tmp_path / "log.csv", rows, "who,what,when")
    flags = ParquetColumns("who", "what", "when")
    a = SequenceFileSource(str(tmp_path / "log.parquet"), 8, 5, 1, 8, 0, DataOptions(flags))
    b = SequenceFileSource(str(csv), 8, 5, 1, 8, 0, DataOptions(flags))
    assert a.tables == b.tables and a.sampler.items.tolist() == b.sampler.items.tolist()
    assert b.note is None  # a time column
    with pytest.raises(Exception, match=r"log\.parquet: no column 'user' \(the user column\)"):
        SequenceFileSource(str(tmp_path / "log.parquet"), 8, 5, 1, 8, 0)
    assert (
        train(["--data", str(csv), "--user-col", "who", "--item-col", "what", "--steps", "1", "--quiet"]) == 0
    )


def test_resume_and_plans_on_the_fly_keep_the_vocabulary(tmp_path, capsys):
    """A run planned on the fly records its vocabulary in its run identity: resuming it with string ids
    mapped by another vocabulary is refused; with the same one it goes on."""
    rows = _rows(5, codes=True)
    codes = _log(tmp_path / "codes.csv", rows, "customer_id,product_id,timestamp")
    other = _log(tmp_path / "other.csv", rows[::-1], "customer_id,product_id,timestamp")
    other_npz, _ = _stats_and_plan(capsys, other, tmp_path, "other")
    ckpt = str(tmp_path / "ckpt")
    base = ["--data", str(codes), "--batch-size", "16", "--quiet", "--checkpoint-dir", ckpt]
    assert train([*base, "--steps", "2"]) == 0
    assert train([*base, "--steps", "3", "--resume"]) == 0
    capsys.readouterr()
    assert train([*base, "--steps", "4", "--resume", "--vocab", str(other_npz)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flexshard train: error: --resume: {ckpt}") and "was saved by another run" in err


def test_resume_refuses_another_vocabulary_with_the_same_plan(tmp_path, capsys):
    """Counts alike, so the plan made on the fly is the same; only the users' rows swap (u2 is seen first
    in the other file): the run identity's data names the vocabulary."""
    rows = [("u1", "A", 1), ("u1", "B", 2), ("u2", "B", 3), ("u2", "A", 4)] * 3
    codes = _log(tmp_path / "codes.csv", rows, "user,item,timestamp")
    other = _log(tmp_path / "other.csv", rows[::-1], "user,item,timestamp")
    other_npz, _ = _stats_and_plan(capsys, other, tmp_path, "other")
    ckpt = str(tmp_path / "ckpt")
    base = ["--data", str(codes), "--batch-size", "4", "--quiet", "--checkpoint-dir", ckpt]
    assert train([*base, "--steps", "2"]) == 0
    capsys.readouterr()
    assert train([*base, "--steps", "3", "--resume", "--vocab", str(other_npz)]) == 2
    err = capsys.readouterr().err
    assert "was saved by another run (data: 'codes.csv (statistics " in err
    assert ", vocabulary " in err and err.count("\n") == 1


def test_id_sorted_files_are_named_by_stats_and_train(tmp_path, capsys):
    rows = sorted((u, i) for u, i, _t in _rows(6))  # an export sorted by user, then item id
    data = _log(tmp_path / "sorted.csv", rows, "user,item")
    rc, _out, err = run(capsys, "stats", str(data), "--out", str(tmp_path / "s.npz"))
    assert rc == 0 and f"note: {data}: " in err and "the histories look sorted by item id" in err
    timed = _log(tmp_path / "timed.csv", _rows(6), "user,item,timestamp")
    rc, _out, err = run(capsys, "stats", str(timed), "--out", str(tmp_path / "t.npz"))
    assert rc == 0 and "note:" not in err
    source = SequenceFileSource(str(data), 8, 5, 1, 8, 0)
    assert "has no time column" in source.describe() and "look sorted by item id" in source.describe()
    assert "note" not in SequenceFileSource(str(timed), 8, 5, 1, 8, 0).describe()


def test_the_first_steps_need_no_dim_flag(tmp_path, capsys):
    """stats (default dim 64), plan and train with no --dim anywhere: train takes the plan's dim (it used
    its own default, 16, and refused the plan); an explicit other --dim is still refused, naming the flag."""
    data = _log(tmp_path / "x.csv", _rows(0), "user,item,timestamp")
    npz, plan = tmp_path / "s.npz", tmp_path / "p.json"
    assert run(capsys, "stats", str(data), "--out", str(npz))[0] == 0
    rc, _out, err = run(capsys, "plan", "--workload", str(npz), "--topology", TOPOLOGY, "--out", str(plan))
    assert rc == 0, err
    assert {t["dim"] for t in json.loads(plan.read_text())["tables"]} == {64}
    assert train(["--data", str(data), "--plan", str(plan), "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"data \S+x\.csv \(item_id \d+ x 64, user_id \d+ x 64\)", err), err
    assert train(["--data", str(data), "--plan", str(plan), "--steps", "1", "--dim", "16"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the plan was made for dim 64, the model has dim 16: train with --dim 64" in line, line
