"""Delimited files read by their header (``flexshard.workloads.delimited``): header variants, tabs,
quotes, column flags, string ids through a vocabulary, time order, and one-line errors. Expected
histories and counts are written out by hand for each small file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, DataError
from flexshard.workloads import (
    ParquetColumns,
    Vocabulary,
    csv_histories,
    delimited,
    delimited_reads,
    detect_format,
    load_stats_with_vocabulary,
    order_note,
    parsed,
    read_workload,
    save_stats,
    sequences_from_lines,
)
from flexshard.workloads.paths import check_file


def write(path: Path, text: str) -> Path:
    path.write_bytes(text.encode("utf-8"))
    return path


def histories(path: Path, **kwargs) -> dict:
    seq = csv_histories(path, **kwargs)
    return {int(u): seq.history(k).tolist() for k, u in enumerate(seq.users)}


# user 1: items 5 (t=3), 6 (t=1), 7 (t=3); user 2: 5 (t=2), 7 (t=0). Time order: 1 -> [6, 5, 7] (5 and 7
# tie at t=3: file order), 2 -> [7, 5]. File order: 1 -> [5, 6, 7], 2 -> [5, 7].
ROWS = [(1, 5, 3), (1, 6, 1), (2, 5, 2), (1, 7, 3), (2, 7, 0)]
TIME_ORDER = {1: [6, 5, 7], 2: [7, 5]}
FILE_ORDER = {1: [5, 6, 7], 2: [5, 7]}


def table(header: str, sep: str = ",", rows=ROWS, quote: bool = False, eol: str = "\n") -> str:
    q = '"' if quote else ""
    lines = [header] + [sep.join(f"{q}{v}{q}" for v in r) for r in rows]
    return eol.join(lines) + eol


@pytest.mark.parametrize(
    "name, text",
    [
        ("a.csv", table("user,item,timestamp")),
        ("b.csv", table("User_ID,Item_ID,Timestamp")),
        ("c.tsv", table("user_id\titem_id\ttime", sep="\t")),
        ("d.txt", table("userid;itemid;ts", sep=";")),
        ("e.csv", table('"user","item","timestamp"', quote=True)),
        ("f.csv", "\ufeff" + table("user,item,timestamp", eol="\r\n")),  # BOM, CRLF
        ("g.csv", table("customer id , product_id , Date Time")),  # spaces around names
    ],
)
def test_header_variants_give_histories_in_time_order(tmp_path, name, text):
    f = write(tmp_path / name, text)
    assert detect_format(f) == "csv"
    assert histories(f) == TIME_ORDER
    assert order_note(f) is None  # it has a time column


def test_movielens_ratings_are_not_counts_and_time_orders(tmp_path):
    f = write(tmp_path / "ratings.csv", "userId,movieId,rating,timestamp\n1,5,4.5,3\n1,6,3.0,1\n2,5,5.0,2\n")
    assert histories(f) == {1: [6, 5], 2: [5]}  # one interaction per rating, whatever its value


def test_user_item_without_time_is_file_order_and_says_so(tmp_path):
    """The ``user,item`` reproduction (headerless, was "value '0 432'") and its header variant."""
    for name, text in (("h.csv", "user,item\n0,432\n1,5\n0,7\n"), ("n.csv", "0,432\n1,5\n0,7\n")):
        f = write(tmp_path / name, text)
        assert histories(f) == {0: [432, 7], 1: [5]}
        assert "has no time column: each user's history is in file order" in order_note(f)
        w, orders = read_workload(f)
        assert {t.name: t.num_rows for t in w.tables} == {"item_id": 433, "user_id": 2}
        assert orders["item_id"].tolist() == [5, 7, 432]  # each once: ids ascending


@pytest.mark.parametrize("header", ["", "user\titem\tcount\n"])
def test_tab_separated_counts_are_counts_not_items(tmp_path, header):
    """The tab reproduction: ``user item count`` was read as a sequence file (counts became items)."""
    f = write(tmp_path / "plays.txt", header + "1\t5\t3\n2\t6\t1\n1\t6\t0\n")
    assert detect_format(f) == "csv"
    assert histories(f) == {1: [5, 5, 5], 2: [6]}
    w, orders = read_workload(f)
    item = next(t for t in w.tables if t.name == "item_id")
    assert item.num_rows == 7 and item.ids_per_sample == 2.0  # 4 lookups over 2 users
    assert orders["item_id"].tolist() == [5, 6]


def test_headerless_comma_counts_keep_the_numpy_parser(tmp_path):
    f = write(tmp_path / "plays.csv", "2,5,2\n0,1,1\n2,3,0\n")
    assert delimited.sniff(f).legacy
    assert histories(f) == {0: [1], 2: [5, 5]}


def test_space_separated_sequences_are_not_delimited(tmp_path):
    f = write(tmp_path / "s.txt", "1 2 3\n")
    assert detect_format(f) == "seq" and order_note(f) is None


def test_column_flags_override_the_header(tmp_path):
    f = write(tmp_path / "log.csv", "a,user,b,when\n9,1,5,3\n9,1,6,1\n8,2,5,2\n")
    cols = ParquetColumns(user="a", item="b", time="when")
    assert histories(f, columns=cols) == {8: [5], 9: [6, 5]}
    assert histories(f, columns=ParquetColumns(item="b")) == {1: [5, 6], 2: [5]}  # user by name, no time
    with pytest.raises(DataError, match=r"log\.csv: no column 'x' \(--count-col\); the header has a, user"):
        histories(f, columns=ParquetColumns(item="b", count="x"))
    g = write(tmp_path / "plain.csv", "1,5\n")
    with pytest.raises(ConfigError, match=r"--item-col: .*plain\.csv has no header line"):
        histories(g, columns=ParquetColumns(item="b"))


def test_string_ids_map_through_a_first_seen_vocabulary(tmp_path):
    f = write(tmp_path / "codes.csv", 'customer_id,asin,ts\n"C9",B07,5\nC1,"B03",1\nC9,B03,2\nC1,B99,0\n')
    vocab = Vocabulary()
    w, orders = read_workload(f, vocabulary=vocab)
    assert vocab.strings("user_id") == ["C9", "C1"] and vocab.strings("item_id") == ["B07", "B03", "B99"]
    assert {t.name: t.num_rows for t in w.tables} == {"item_id": 3, "user_id": 2}
    assert orders["item_id"].tolist() == [1, 0, 2]  # B03 twice, then B07, B99 by row
    # time order within each user: C9 -> B03 (t=2), B07 (t=5); C1 -> B99 (t=0), B03 (t=1)
    assert histories(f, vocabulary=vocab) == {0: [1, 0], 1: [2, 1]}
    again = Vocabulary()
    read_workload(f, vocabulary=again)
    assert again.fingerprint() == vocab.fingerprint()  # deterministic
    frozen = Vocabulary.from_arrays(vocab.arrays(), vocab.tables, "s.npz")
    g = write(tmp_path / "more.csv", "customer_id,asin\nC1,B07\nC2,B07\n")
    with pytest.raises(DataError, match=r"more\.csv: column 'customer_id': id 'C2' is not in the vocabulary"):
        read_workload(g, vocabulary=frozen)


def test_string_ids_across_blocks_match_one_block(tmp_path):
    rng = np.random.default_rng(1)
    users, items = rng.integers(0, 50, 3000), rng.integers(0, 400, 3000)
    text = "user,item\n" + "".join(f"u{u},i{i:x}\n" for u, i in zip(users, items, strict=True))
    f = write(tmp_path / "big.csv", text)
    layout = delimited.sniff(f)
    one, many = Vocabulary(), Vocabulary()
    a = list(delimited.chunks(layout, one))
    b = list(delimited.chunks(layout, many, block_bytes=256))
    assert len(a) == 1 and len(b) > 50
    assert np.concatenate([c.items for c in b]).tolist() == a[0].items.tolist()
    assert many.fingerprint() == one.fingerprint()
    # brute force: first-seen order of the strings
    seen = list(dict.fromkeys(f"i{i:x}" for i in items))
    assert one.strings("item_id") == seen
    assert a[0].items.tolist() == [seen.index(f"i{i:x}") for i in items]


def test_integer_and_string_ids_do_not_mix_across_inputs(tmp_path):
    a = write(tmp_path / "a.csv", "user,item\n1,5\n")
    b = write(tmp_path / "b.csv", "user,item\n1,B5\n")
    with pytest.raises(DataError, match=r"b\.csv: column 'item' holds string ids, an earlier input integer"):
        read_workload([a, b])
    w, _ = read_workload([b, a])  # strings first: the integers are their text ("5")
    assert {t.name: t.num_rows for t in w.tables}["item_id"] == 2


def test_max_len_keeps_the_latest_by_time(tmp_path):
    f = write(tmp_path / "t.csv", table("user,item,timestamp"))
    assert histories(f, max_len=2) == {1: [5, 7], 2: [7, 5]}
    w, orders = read_workload(f, max_len=1)
    assert orders["item_id"].tolist() == [5, 7]  # user 1's 7 and user 2's 5
    codes = write(tmp_path / "codes.csv", "user,item,timestamp\nu1,OLD,1\nu1,B,2\nu1,C,3\n")
    vocab = Vocabulary()
    w, orders = read_workload(codes, max_len=2, vocabulary=vocab)
    assert vocab.strings("item_id") == ["OLD", "B", "C"] and orders["item_id"].tolist() == [1, 2]
    assert {t.name: t.num_rows for t in w.tables}["item_id"] == 3  # OLD keeps its row, untouched
    g = write(tmp_path / "c.csv", "user,item,count\n1,5,2\n")
    with pytest.raises(ConfigError, match="count matrix without a time column"):
        read_workload(g, max_len=1)


@pytest.mark.parametrize(
    "text, message",
    [
        ("", r"x\.csv: empty file"),
        ("user,item\n", r"x\.csv: no rows after the header"),
        ("uzer,item\n1,2\n", r"x\.csv:1: no user column in the header 'uzer, item'"),
        ("user_id,uid,item\n1,1,2\n", r"x\.csv:1: columns 'user_id' and 'uid' both name the user"),
        ("user,user,item\n1,1,2\n", r"x\.csv:1: the header names column 'user' twice"),
        ("user,item\n1,\n", r"x\.csv: row 1: column 'item' value '': missing id"),
        ("user,item\n1,2\n-3,2\n", r"x\.csv: row 2: column 'user' value -3: ids < 0"),
        ("user,item\n1,4294967296\n", r"x\.csv: row 1: column 'item' value 4294967296: ids of 4,294,967,296"),
        ("user,item,count\n1,2,x\n", r"x\.csv: row 1: column 'count' value 'x': not a number"),
        ("user,item,count\n1,2,2.5\n", r"x\.csv: row 1: column 'count' value 2.5: counts must be whole"),
        ("user,item,count\n1,2,-1\n", r"x\.csv: row 1: column 'count' value -1: negative count"),
        ("user,item,count\n1,2,nan\n", r"x\.csv: row 1: column 'count' value nan: NaN count"),
        ("user,item,count\n1,2,1e19\n", r"x\.csv: row 1: column 'count' .*count past the largest, 4,611"),
        ("user,item,time\n1,2,soon\n", r"x\.csv: row 1: column 'time' value 'soon': not a number, a date"),
        ("user,item,time\n1,2,1.5\n1,3,nan\n", r"x\.csv: row 2: column 'time' value nan: not a number"),
        ("1\t2\t3\t4\n", r"x\.csv:1: 4 tab-separated fields and no header"),
        (
            "1\tB2\n",
            r"x\.csv: row 1: column 'item' value 'B2': not an integer id \(string ids need a header\)",
        ),
        ("user,item\n1,2,3\n", r"x\.csv: cannot parse the rows after row 0 \(CSV parse error: Expected 2"),
        ("1 2 3\n", r"x\.csv:1: no comma, tab or semicolon in the first line"),
    ],
)
def test_bad_files_are_one_line(tmp_path, text, message):
    f = write(tmp_path / "x.csv", text)
    with pytest.raises(DataError, match=message) as err:
        read_workload(f)
    assert "\n" not in str(err.value)


def test_a_later_block_of_another_type_is_one_line(tmp_path):
    f = write(tmp_path / "x.csv", "user,item\n" + "1,2\n" * 200 + "1,B\n")
    with pytest.raises(DataError, match=r"x\.csv: cannot parse the rows after row \d+ .*int64"):
        list(delimited.chunks(delimited.sniff(f), Vocabulary(), block_bytes=256))


def test_counts_whose_histories_do_not_fit_name_the_limit(tmp_path, monkeypatch):
    """The 1e14 reproduction and the timestamp taken for a count (headerless, as the old reader did)."""
    monkeypatch.setattr(parsed, "physical_memory_bytes", lambda: 16 * 1000)
    f = write(tmp_path / "big.csv", "user,item,count\n1,5,1e14\n2,5,1\n")
    with pytest.raises(DataError) as err:
        csv_histories(f)
    assert str(err.value) == (
        f"{f}: column 'count': the counts add up to 1e+14 interactions, past the 1,000 that fit in this "
        "machine's memory as histories (16 bytes each; largest count 100,000,000,000,000); a count is "
        "interactions of one user with one item: if that column is a timestamp or a rating, name the "
        "columns in a header line (e.g. user,item,timestamp)"
    )
    read_workload(f)  # counting alone is fine: one int64 per item
    g = write(tmp_path / "ts.csv", "1,5,1600000003\n")
    with pytest.raises(DataError, match=r"ts\.csv: column 3 \(count\): the counts add up to 1\.6e\+09"):
        csv_histories(g)
    h = write(tmp_path / "ok.csv", "1,5,999\n")
    assert len(csv_histories(h).items) == 999  # at the limit


def test_fifo_folder_and_missing_paths_are_named(tmp_path):
    for name in ("pipe.csv", "pipe"):  # by extension, and by content (sniffed: opening would block)
        fifo = tmp_path / name
        os.mkfifo(fifo)
        with pytest.raises(DataError, match=rf"{name}: is a named pipe \(fifo\), not a regular file"):
            read_workload(fifo)
    with pytest.raises(DataError, match=r"pipe: is a named pipe"):
        detect_format(fifo)
    with pytest.raises(DataError, match=r"--data: .*: is a folder, not a file"):
        check_file(tmp_path, "--data")
    with pytest.raises(DataError, match=r"nope\.csv: no such file$"):
        check_file(tmp_path / "nope.csv")
    with pytest.raises(
        DataError, match=r"empty: cannot tell which files of this folder to read \(it is empty\)"
    ):
        (tmp_path / "empty").mkdir()
        read_workload(tmp_path / "empty")


def test_stats_file_keeps_the_vocabulary_under_its_fingerprint(tmp_path):
    f = write(tmp_path / "codes.csv", "user,item\nu1,B2\nu2,B1\nu1,B1\n")
    vocab = Vocabulary()
    w, orders = read_workload(f, vocabulary=vocab)
    out = save_stats(tmp_path / "s.npz", w, orders, vocab)
    _w, _o, back = load_stats_with_vocabulary(out)
    assert back.frozen and back.strings("item_id") == ["B2", "B1"] and back.strings("user_id") == ["u1", "u2"]
    assert back.fingerprint() == vocab.fingerprint()
    plain = save_stats(tmp_path / "p.npz", w, orders)
    assert load_stats_with_vocabulary(plain)[2] is None
    # an altered vocabulary (same size, other strings) is refused
    z = dict(np.load(out))
    z["vocab.item_id.data"] = np.frombuffer(b"B1B2", dtype=np.uint8).copy()
    np.savez(tmp_path / "t.npz", **z)
    with pytest.raises(DataError, match=r"t\.npz: the vocabulary does not match its fingerprint"):
        load_stats_with_vocabulary(tmp_path / "t.npz")


def test_vocabulary_fingerprint_depends_on_order():
    import pyarrow as pa

    a, b = Vocabulary(), Vocabulary()
    a.encode("item_id", pa.array(["x", "y"]), "a")
    b.encode("item_id", pa.array(["y", "x"]), "b")
    assert a.fingerprint() != b.fingerprint() and Vocabulary().fingerprint() == ""


@pytest.mark.parametrize("timed", [True, False])
def test_large_files_group_on_disk_as_in_memory(tmp_path, timed):
    """Past ``spill_bytes`` the histories come from a temporary Parquet log grouped by parquet_histories
    (partitions of ``memory_bytes``): the same histories, string ids and decimal times included."""
    rng = np.random.default_rng(7)
    n = 4000
    users, items = rng.integers(0, 300, n), rng.integers(0, 900, n)
    times = np.round(rng.normal(0, 1e6, n), 3)  # decimals, negative ones too
    counts = rng.integers(0, 3, n)
    head = "user,item," + ("timestamp," if timed else "") + "count\n"
    body = "".join(
        f"u{u},p{i}," + (f"{t}," if timed else "") + f"{c}\n"
        for u, i, t, c in zip(users, items, times, counts, strict=True)
    )
    f = write(tmp_path / "log.csv", head + body)
    vocab = Vocabulary()
    whole = csv_histories(f, vocabulary=vocab)
    parts = list(delimited_reads.history_chunks(f, vocabulary=vocab, spill_bytes=0, memory_bytes=1 << 16))
    assert len(parts) > 1
    spilled = csv_histories(f, vocabulary=vocab, spill_bytes=0)
    for got in (spilled, sequences_from_lines(
        np.concatenate([p.users for p in parts]), np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.items for p in parts]),
    )):  # fmt: skip
        assert got.users.tolist() == whole.users.tolist()
        assert got.offsets.tolist() == whole.offsets.tolist() and got.items.tolist() == whole.items.tolist()
    # brute force: user u's items sorted by (time, row), each count times
    user_rows = vocab.strings("user_id")
    item_rows = {s: k for k, s in enumerate(vocab.strings("item_id"))}
    k = int(rng.integers(0, len(whole)))
    name = user_rows[int(whole.users[k])]
    mine = [r for r in range(n) if f"u{users[r]}" == name]
    if timed:
        mine.sort(key=lambda r: (times[r], r))
    expected = [item_rows[f"p{items[r]}"] for r in mine for _ in range(counts[r])]
    assert whole.history(k).tolist() == expected


def test_ordered_int64_keeps_the_order_of_decimal_times():
    t = np.array([3.5, -2.25, 0.0, -0.0, 1e300, -1e300, 2.0, -2.5])
    keys = delimited_reads.ordered_int64(t)
    assert np.argsort(keys, kind="stable").tolist() == np.argsort(t, kind="stable").tolist()
    ints = np.array([5, -3, 0])
    assert delimited_reads.ordered_int64(ints).tolist() == [5, -3, 0]


def test_id_sorted_histories_are_named():
    """gowalla's train_reconstructed.txt rises in id at every step (item sets); Amazon's half the time."""
    from flexshard.workloads import id_sorted_note, sequences_from_lines

    seq = sequences_from_lines(np.array([1, 2]), np.array([4, 3]), np.array([1, 2, 5, 9, 3, 4, 8]))
    assert seq.ascending_pairs() == (5, 5)  # no pair across users (9 -> 3)
    assert id_sorted_note(5, 5, "x.txt") is None  # too few pairs to tell
    assert id_sorted_note(100, 99, "x.txt") == (
        "x.txt: 99.0% of consecutive history items that differ rise in id: the histories look sorted by "
        "item id, not by time (item sets, not sequences); next-item samples will learn id order"
    )
    assert id_sorted_note(100, 98, "x.txt") is None
    shuffled = sequences_from_lines(np.array([1]), np.array([6]), np.array([3, 1, 2, 9, 4, 5]))
    assert shuffled.ascending_pairs() == (5, 3)
    repeats = sequences_from_lines(np.array([1]), np.array([5]), np.array([7, 7, 7, 2, 2]))
    assert repeats.ascending_pairs() == (1, 0)  # repeat consumption is neither
