"""Readers on tiny hand-written files with hand-computed counts, and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, DataError
from flexshard.workloads import detect_format, hotness_order, read_workload
from flexshard.workloads._text import read_chunks, tokenize
from flexshard.workloads.recbole import recbole_histories


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def tables(workload) -> dict:
    return {t.name: t for t in workload.tables}


def counts_of(table) -> np.ndarray:
    """Per-row counts back from a histogram (probabilities times total lookups), hottest first."""
    return np.repeat(table.hist.prob, table.hist.rows)


# ------------------------------------------------------------------------------------------- seq


def test_seq_counts_lengths_and_orders(tmp_path: Path) -> None:
    f = write(tmp_path / "toy.txt", "1 5 3 5\n\n2 3\n3\n")
    w, orders = read_workload(f, dim=8, batch_size_per_gpu=4)
    t = tables(w)
    assert w.name == "toy" and w.batch_size_per_gpu == 4
    assert list(t) == ["item_id", "user_id"]
    item, user = t["item_id"], t["user_id"]
    assert item.num_rows == 6 and user.num_rows == 4 and item.dim == 8
    # item counts: id 3 -> 2, id 5 -> 2 (of 4 lookups); rows 0, 1, 2, 4 untouched
    assert item.hist.rows.tolist() == [2, 4] and item.hist.prob.tolist() == [0.5, 0.0]
    assert item.ids_per_sample == pytest.approx(4 / 3)
    assert item.length_values.tolist() == [0, 1, 3]
    np.testing.assert_allclose(item.length_probs, [1 / 3] * 3)
    assert user.ids_per_sample == 1.0
    assert user.hist.rows.tolist() == [3, 1]
    assert orders["item_id"].tolist() == [3, 5]
    assert orders["user_id"].tolist() == [1, 2, 3]


def test_seq_with_attributes(tmp_path: Path) -> None:
    f = write(tmp_path / "toy.txt", "1 5 3 5\n2 3\n3\n")
    (tmp_path / "toy_item2attributes.json").write_text(json.dumps({"3": [7, 7, 8], "5": [8], "9": [1]}))
    w, orders = read_workload(f)
    attr = tables(w)["item_attribute"]
    # distinct attributes per item: 3 -> {7, 8}, 5 -> {8}; 7 gets count(3)=2, 8 gets 2+2=4
    assert attr.num_rows == 9
    assert orders["item_attribute"].tolist() == [8, 7]
    assert attr.hist.prob[:2].tolist() == [4 / 6, 2 / 6]
    assert attr.ids_per_sample == pytest.approx(6 / 3)
    assert attr.length_values.tolist() == [0, 2, 4]


def test_seq_max_len_keeps_the_most_recent_items(tmp_path: Path) -> None:
    f = write(tmp_path / "toy.txt", "1 5 3 5\n2 3 4\n")
    w, orders = read_workload(f, max_len=1)
    item = tables(w)["item_id"]
    assert orders["item_id"].tolist() == [4, 5]  # last item of each line
    assert item.ids_per_sample == 1.0


def test_merging_two_files_merges_users(tmp_path: Path) -> None:
    a = write(tmp_path / "train.txt", "0 1 2\n1 2\n")
    b = write(tmp_path / "test.txt", "0 3\n2 2\n")
    w, orders = read_workload([a, b])
    t = tables(w)
    assert w.name == "train+test"
    assert orders["user_id"].tolist() == [0, 1, 2]  # 3 samples: user 0's two lines are one sample
    assert t["user_id"].ids_per_sample == 1.0
    assert t["item_id"].ids_per_sample == pytest.approx(5 / 3)
    assert orders["item_id"].tolist() == [2, 1, 3]
    assert t["item_id"].length_values.tolist() == [1, 3]


# ------------------------------------------------------------------------------------------- csv


def test_csv_counts(tmp_path: Path) -> None:
    f = write(tmp_path / "plays.csv", "0,1,3\n0,2,1\n1,1,2.0\n3,0,0\n")
    w, orders = read_workload(f)
    t = tables(w)
    item, user = t["item_id"], t["user_id"]
    assert item.num_rows == 3 and user.num_rows == 4
    assert orders["item_id"].tolist() == [1, 2]
    assert item.hist.prob[0] == pytest.approx(5 / 6)
    assert item.ids_per_sample == pytest.approx(6 / 3)  # users 0, 1, 3 with 4, 2, 0 plays
    assert item.length_values.tolist() == [0, 2, 4]
    assert user.ids_per_sample == 1.0 and orders["user_id"].tolist() == [0, 1, 3]


def test_csv_folder_merges_splits(tmp_path: Path) -> None:
    d = tmp_path / "lastfm"
    d.mkdir()
    write(d / "validation.csv", "0,1,3\n1,1,1\n")
    write(d / "test.csv", "0,2,2\n")
    w, orders = read_workload(d)
    assert w.name == "lastfm"
    item = tables(w)["item_id"]
    assert item.ids_per_sample == pytest.approx(6 / 2)
    assert orders["item_id"].tolist() == [1, 2]
    assert item.length_values.tolist() == [1, 5]


# ---------------------------------------------------------------------------------------- recbole

INTER = (
    "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    "u1\ti1\t5\t30\nu2\ti2\t3\t10\nu1\ti2\t4\t20\n\nu1\ti3\t1\t40\n"
)
USER = "user_id:token\tage:token\tgender:token\nu1\t20\tM\nu2\t30\tF\nu3\t20\tM\n"
ITEM = (
    "item_id:token\tgenre:token_seq\tyear:token\tsize:float\n"
    "i1\tA B\t1990\t1.5\ni2\tB\t1990\t2\ni4\tC\t2000\t3\n"
)


def recbole_files(tmp_path: Path) -> Path:
    write(tmp_path / "toy.user", USER)
    write(tmp_path / "toy.item", ITEM)
    return write(tmp_path / "toy.inter", INTER)


def test_recbole_tables(tmp_path: Path) -> None:
    inter = recbole_files(tmp_path)
    w, orders = read_workload(inter)
    t = tables(w)
    assert list(t) == ["user_id", "item_id", "age", "gender", "genre", "year"]  # size is float: skipped
    # dense ids in first-seen order: users u1=0, u2=1, u3=2 (.user only); items i1=0, i2=1, i3=2, i4=3
    assert t["user_id"].num_rows == 3 and orders["user_id"].tolist() == [0, 1]
    assert t["item_id"].num_rows == 4 and orders["item_id"].tolist() == [1, 0, 2]
    for name in ("user_id", "item_id", "age", "gender"):
        assert t[name].ids_per_sample == 2.0  # 4 interactions, 2 users with interactions
    assert t["age"].num_rows == 2 and orders["age"].tolist() == [0, 1]
    assert t["age"].hist.prob.tolist() == [0.75, 0.25]
    # genre: A <- i1 (1 lookup), B <- i1 + i2 (1 + 2), C <- i4 (never)
    assert t["genre"].num_rows == 3 and orders["genre"].tolist() == [1, 0]
    assert t["genre"].hist.prob.tolist() == [0.75, 0.25, 0.0]
    assert t["genre"].ids_per_sample == 2.0 and t["genre"].length_values.tolist() == [1, 3]
    # year: 1990 <- i1 + i2 = 3 lookups (i3 has no features)
    assert t["year"].hist.prob.tolist() == [1.0, 0.0] and t["year"].ids_per_sample == 1.5
    assert t["item_id"].length_values.tolist() == [1, 3]


def test_recbole_max_len_uses_timestamps(tmp_path: Path) -> None:
    inter = recbole_files(tmp_path)
    w, orders = read_workload(inter, max_len=2)
    # u1 by time: i2 (20), i1 (30), i3 (40) -> keeps i1, i3; u2 keeps i2
    assert orders["item_id"].tolist() == [0, 1, 2]
    assert tables(w)["user_id"].hist.prob[:2].tolist() == [2 / 3, 1 / 3]


def test_recbole_histories_by_timestamp_with_the_workloads_ids(tmp_path: Path) -> None:
    inter = recbole_files(tmp_path)
    seq = recbole_histories(inter)
    # users u1=0, u2=1; items i1=0, i2=1, i3=2; u1 by time: i2 (20), i1 (30), i3 (40)
    assert seq.users.tolist() == [0, 1] and seq.offsets.tolist() == [0, 3, 4]
    assert seq.items.tolist() == [1, 0, 2, 1]
    short = recbole_histories(inter, max_len=2)
    assert short.items.tolist() == [0, 2, 1]  # the most recent two, as read_workload(max_len=2) counts
    w, orders = read_workload(inter, max_len=2)
    counts = np.bincount(short.items, minlength=tables(w)["item_id"].num_rows)
    assert counts[orders["item_id"]].tolist() == [1, 1, 1]
    write(tmp_path / "plain.inter", "user_id:token\titem_id:token\nb\tx\na\ty\nb\tz\n")
    plain = recbole_histories(tmp_path / "plain.inter")  # no timestamp: file order
    assert plain.users.tolist() == [0, 1] and plain.items.tolist() == [0, 2, 1]


def test_recbole_folder_and_feature_file_paths(tmp_path: Path) -> None:
    recbole_files(tmp_path)
    w1, _ = read_workload(tmp_path)
    w2, _ = read_workload(tmp_path / "toy.item")
    assert [t.name for t in w1.tables] == [t.name for t in w2.tables]


def test_dims_mapping(tmp_path: Path) -> None:
    inter = recbole_files(tmp_path)
    w, _ = read_workload(inter, dim={"item_id": 32, "*": 8})
    assert {t.name: t.dim for t in w.tables}["item_id"] == 32
    assert {t.name: t.dim for t in w.tables}["age"] == 8
    with pytest.raises(ConfigError, match="dim"):
        read_workload(inter, dim={"nope": 3})


# ------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.txt", "1 2 3\n2 x 4\n", r"a\.txt:2: field 'item id' value 'x'"),
        ("a.txt", "1 2 3\n2 -4\n", r"a\.txt:2: field 'item id' value '-4': ids < 0"),
        ("a.txt", "1 2\n-2 4\n", r"a\.txt:2: field 'user id' value '-2'"),
        ("a.txt", "1 2\n1 99999999999\n", r"a\.txt:2: field 'item id' value '99999999999': ids of"),
        ("a.txt", "", r"a\.txt: empty file"),
        ("a.txt", "\n \n", r"a\.txt: empty file"),
        ("b.csv", "0,1,3\n0,1\n", r"b\.csv:2: field 'user,item,count' value '0 1': expected 3 fields"),
        ("b.csv", "0,1,3\n0,1,-2\n", r"b\.csv:2: field 'count' value '-2': negative count"),
        ("b.csv", "0,1,nan\n", r"b\.csv:1: field 'count' value 'nan': NaN count"),
        ("b.csv", "0,1,2.5\n", r"b\.csv:1: field 'count' value '2.5': counts must be whole"),
        ("b.csv", "0,1,abc\n", r"b\.csv:1: field 'count' value 'abc': not a number"),
        ("b.csv", "name,item,count\n0,1,1\n", r"b\.csv:1: no user column in the header 'name, item, count'"),
        ("b.csv", "", r"b\.csv: empty file"),
        ("c.inter", "user_id:token\titem_id:token\n1\t2\n3\n", r"c\.inter:3: field 'line' .*expected 2"),
        ("c.inter", "user_id:token\titem_id:blob\n1\t2\n", r"c\.inter:1: field 'item_id' value 'blob'"),
        ("c.inter", "user_id:token\trating:float\n1\t2\n", r"field 'item_id': missing"),
        ("c.inter", "user_id:token\titem_id:token\n", r"c\.inter: empty file \(header only\)"),
        (
            "c.inter",
            "user_id:token\titem_id:token\ttimestamp:float\n1\t2\tsoon\n",
            r"c\.inter:2: field 'timestamp'",
        ),
        ("d.dat", "hello world\n", r"d\.dat: unknown format"),
    ],
)
def test_bad_input_raises_one_line_error(tmp_path: Path, name: str, text: str, match: str) -> None:
    f = write(tmp_path / name, text)
    with pytest.raises(DataError, match=match) as err:
        read_workload(f)
    assert "\n" not in str(err.value)


def test_ids_outside_an_explicit_table(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "1 2 3\n2 5\n")
    w, _ = read_workload(f, num_rows={"item_id": 10})
    assert tables(w)["item_id"].num_rows == 10
    with pytest.raises(DataError, match=r"a\.txt:2: field 'item id' value '5': ids outside the table"):
        read_workload(f, num_rows={"item_id": 5})
    with pytest.raises(ConfigError, match=r"num_rows\['item_id'\]: rows must be a positive"):
        read_workload(f, num_rows={"item_id": 0})
    with pytest.raises(ConfigError, match="no table named 'items'"):
        read_workload(f, num_rows={"items": 10})
    inter = recbole_files(tmp_path)
    with pytest.raises(DataError, match=r"toy\.user:4: field 'user_id' value 'u3': ids outside the table"):
        read_workload(inter, num_rows={"user_id": 2})
    with pytest.raises(DataError, match=r"toy\.item:4: field 'genre' value 'C': ids outside the table"):
        read_workload(inter, num_rows={"genre": 2})


def test_other_bad_arguments(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "1 2 3\n")
    with pytest.raises(ConfigError, match="dim"):
        read_workload(f, dim=0)
    with pytest.raises(ConfigError, match="dim"):
        read_workload(f, dim=-3)
    with pytest.raises(ConfigError, match="batch_size_per_gpu"):
        read_workload(f, batch_size_per_gpu=0)
    with pytest.raises(ConfigError, match="max_len"):
        read_workload(f, max_len=0)
    with pytest.raises(ConfigError, match="fmt: unknown format 'xml'"):
        read_workload(f, fmt="xml")
    with pytest.raises(DataError, match="no such file"):
        read_workload(tmp_path / "missing.txt")
    c = write(tmp_path / "b.csv", "0,1,1\n")
    with pytest.raises(ConfigError, match="max_len"):
        read_workload(c, max_len=5)
    (tmp_path / "x_item2attributes.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="attribute file"):
        read_workload(tmp_path / "x_item2attributes.json")
    s = write(tmp_path / "s.txt", "1 2\n")
    (tmp_path / "s_item2attributes.json").write_text('{"2": [1, "a"]}')
    with pytest.raises(DataError, match="item2attributes"):
        read_workload(s)
    (tmp_path / "s_item2attributes.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_workload(s)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(DataError, match="cannot tell which files"):
        read_workload(empty)


def test_format_detection(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path / "a.txt", "1 2 3\n")) == "seq"
    assert detect_format(write(tmp_path / "a.dat", "\n1,2,3\n")) == "csv"
    assert detect_format(write(tmp_path / "a.tsv", "user_id:token\titem_id:token\n")) == "recbole"
    assert detect_format(tmp_path / "x.inter") == "recbole"
    w, _ = read_workload(tmp_path / "a.dat")  # sniffed as csv
    assert tables(w)["item_id"].ids_per_sample == 3.0


def test_tokenizer_and_chunks(tmp_path: Path) -> None:
    tok = tokenize(b"12 7\n\n x -3 123456789012345678901\r\n8,9", 5, separators=b",")
    assert tok.values.tolist() == [12, 7, -1, -1, -1, 8, 9]
    assert tok.line.tolist() == [5, 5, 7, 7, 7, 8, 8]
    assert tok.line_starts().tolist() == [True, False, True, False, False, True, False]
    assert tok.as_strings(np.array([2, 3])).tolist() == [b"x", b"-3"]
    f = tmp_path / "big.txt"
    f.write_bytes(b"".join(b"%d 1 2\n" % i for i in range(1000)) + b"1000 5")  # no final newline
    pieces = list(read_chunks(f, chunk_bytes=97))
    assert b"".join(p for p, _ in pieces) == f.read_bytes()
    assert all(p.endswith(b"\n") for p, _ in pieces[:-1])
    lines = [first for _, first in pieces]
    assert lines[0] == 1 and lines == sorted(lines)
    total = sum(tokenize(p, first).size for p, first in pieces)
    assert total == 3 * 1000 + 2


def test_chunked_reading_gives_the_same_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    lines = [" ".join(map(str, [u, *rng.integers(0, 50, rng.integers(0, 9))])) for u in range(300)]
    f = write(tmp_path / "r.txt", "\n".join(lines) + "\n")
    w_big, o_big = read_workload(f)
    import flexshard.workloads._text as text_mod

    monkeypatch.setattr(text_mod, "CHUNK_BYTES", 64)
    monkeypatch.setattr(text_mod.read_chunks, "__defaults__", (64,))
    w_small, o_small = read_workload(f)
    for a, b in zip(w_big.tables, w_small.tables, strict=True):
        assert a.ids_per_sample == b.ids_per_sample
        assert (a.hist.rows == b.hist.rows).all() and (a.hist.prob == b.hist.prob).all()
    for k in o_big:
        assert (o_big[k] == o_small[k]).all()


def test_hotness_order_ties_by_id() -> None:
    assert hotness_order(np.array([0, 3, 1, 3, 0, 2])).tolist() == [1, 3, 5, 2]
