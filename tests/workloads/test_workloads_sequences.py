"""Per-user histories (``read_sequences`` / ``read_count_sequences``) on hand-written files, and their
agreement with the streaming readers that share their line parsers."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError, DataError, InputError
from flexshard.workloads import (
    ITEM_TABLE,
    Sequences,
    data_root,
    fingerprint,
    read_count_sequences,
    read_sequences,
    read_workload,
    sequences_from_counts,
    sequences_from_lines,
)
from flexshard.workloads import _text as text_mod
from flexshard.workloads.readers import read_seq


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def as_dict(seq: Sequences) -> dict[int, list[int]]:
    """{raw user id: items}, checking the arrays' shapes and dtypes on the way."""
    assert seq.users.dtype == seq.offsets.dtype == seq.items.dtype == np.int64
    assert seq.offsets.shape == (seq.users.size + 1,) and seq.offsets[0] == 0
    assert seq.offsets[-1] == seq.items.size and (np.diff(seq.offsets) >= 0).all()
    assert (np.diff(seq.users) > 0).all()  # distinct, ascending
    return {int(u): seq.history(k).tolist() for k, u in enumerate(seq.users)}


def reference(text: str, max_len: int | None = None) -> dict[int, list[int]]:
    """The histories of a ``user item ...`` text, the slow obvious way."""
    out: dict[int, list[int]] = {}
    for line in text.splitlines():
        if line.split():
            user, *items = map(int, line.split())
            out.setdefault(user, []).extend(items)
    return {u: (v[-max_len:] if max_len else v) for u, v in sorted(out.items())}


def random_text(seed: int, lines: int, users: int, items: int, longest: int) -> str:
    """``lines`` lines ``user item ...`` of random users (repeating, interleaved) and 0..longest items."""
    rng = np.random.default_rng(seed)
    rows = [
        [rng.integers(0, users), *rng.integers(0, items, rng.integers(0, longest + 1))] for _ in range(lines)
    ]
    return "".join(" ".join(map(str, row)) + "\n" for row in rows)


def small_chunks(monkeypatch: pytest.MonkeyPatch, size: int = 64) -> None:
    monkeypatch.setattr(text_mod.read_chunks, "__defaults__", (size,))


# ------------------------------------------------------------------------------------------ layouts


def test_one_line_per_user(tmp_path: Path) -> None:
    seq = read_sequences(write(tmp_path / "a.txt", "1 5 3 5\n\n2 3\n3\n"))
    assert as_dict(seq) == {1: [5, 3, 5], 2: [3], 3: []}  # a user with no items: an empty history
    assert len(seq) == 3 and seq.lengths.tolist() == [3, 1, 0]
    assert seq.offsets.tolist() == [0, 3, 4, 4] and seq.items.tolist() == [5, 3, 5, 3]


def test_one_line_per_interaction(tmp_path: Path) -> None:
    seq = read_sequences(write(tmp_path / "sasrec.txt", "2 7\n1 5\n2 8\n1 6\n2 7\n"))
    assert seq.users.tolist() == [1, 2]
    assert seq.offsets.tolist() == [0, 2, 5]
    assert seq.items.tolist() == [5, 6, 7, 8, 7]


def test_mixed_and_interleaved_lines(tmp_path: Path) -> None:
    text = "3 1 2\n1 9\r\n3 4\n\n  1\t8 7  \n2\n10 0\n"
    seq = read_sequences(write(tmp_path / "mix.txt", text))
    assert as_dict(seq) == {1: [9, 8, 7], 2: [], 3: [1, 2, 4], 10: [0]} == reference(text)


def test_max_len_keeps_the_most_recent_items_of_each_user(tmp_path: Path) -> None:
    text = "3 1 2\n1 9\n3 4\n1 8 7\n2\n1 6\n"
    f = write(tmp_path / "mix.txt", text)
    assert as_dict(read_sequences(f, max_len=2)) == {1: [7, 6], 2: [], 3: [2, 4]} == reference(text, 2)
    assert as_dict(read_sequences(f, max_len=1)) == {1: [6], 2: [], 3: [4]}
    assert as_dict(read_sequences(f, max_len=10)) == reference(text)


def test_chunk_boundaries_do_not_matter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(3)
    lines = [
        " ".join(map(str, [rng.integers(0, 40), *rng.integers(0, 500, rng.integers(0, 9))]))
        for _ in range(600)
    ]
    text = "\n".join(lines) + "\n"
    f = write(tmp_path / "r.txt", text)
    whole = as_dict(read_sequences(f))
    small_chunks(monkeypatch)
    assert as_dict(read_sequences(f)) == whole == reference(text)
    assert as_dict(read_sequences(f, max_len=3)) == reference(text, 3)


# --------------------------------------------------------------------------------------- count csv


def test_count_csv_expands_counts_users_ascending_rows_in_file_order(tmp_path: Path) -> None:
    f = write(tmp_path / "plays.csv", "2,5,2\n0,1,1\n2,3,0\n2,4,1\n0,7,2.0\n1,9,0\n0,1,1\n")
    seq = read_count_sequences(f)
    assert as_dict(seq) == {0: [1, 7, 7, 1], 1: [], 2: [5, 5, 4]}  # count-0 rows add nothing
    assert seq.offsets.tolist() == [0, 4, 4, 7]
    assert as_dict(seq.subset(seq.lengths > 0)) == {0: [1, 7, 7, 1], 2: [5, 5, 4]}


def test_arrays_to_sequences() -> None:
    seq = sequences_from_counts(np.array([4, 1, 4]), np.array([8, 9, 6]), np.array([1, 3, 2]))
    assert as_dict(seq) == {1: [9, 9, 9], 4: [8, 6, 6]}
    seq = sequences_from_lines(np.array([5, 2, 5, 2]), np.array([2, 0, 1, 1]), np.array([1, 2, 3, 4]))
    assert as_dict(seq) == {2: [4], 5: [1, 2, 3]}
    assert as_dict(sequences_from_lines(np.zeros(0), np.zeros(0), np.zeros(0))) == {}
    assert as_dict(seq.truncated(1)) == {2: [4], 5: [3]}
    assert seq.truncated(3) is seq
    with pytest.raises(ConfigError, match="lines"):
        sequences_from_lines(np.array([1]), np.array([2]), np.array([1]))
    with pytest.raises(ConfigError, match="counts"):
        sequences_from_counts(np.array([1]), np.array([2]), np.array([-1]))
    with pytest.raises(ConfigError, match="max_len"):
        seq.truncated(0)
    with pytest.raises(ConfigError, match="keep"):
        seq.subset(np.array([True]))


# ------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.txt", "1 2 3\n2 x 4\n", r"a\.txt:2: field 'item id' value 'x': not a non-negative integer id"),
        ("a.txt", "1 2 3\n2 -4\n", r"a\.txt:2: field 'item id' value '-4': ids < 0 are not allowed"),
        ("a.txt", "1 2\n\n-2 4\n", r"a\.txt:3: field 'user id' value '-2': ids < 0"),
        ("a.txt", "1 2\n1 99999999999\n", r"a\.txt:2: field 'item id' value '99999999999': ids of"),
        ("a.txt", "1 2\n1 3.5\n", r"a\.txt:2: field 'item id' value '3\.5'"),
        ("a.txt", "\n \n", r"a\.txt: empty file"),
        ("b.csv", "0,1,3\n0,1\n", r"b\.csv:2: field 'user,item,count' value '0 1': expected 3 fields"),
        ("b.csv", "0,1,3\n0,1,-2\n", r"b\.csv:2: field 'count' value '-2': negative count"),
        ("b.csv", "0,x,3\n", r"b\.csv:1: field 'item' value 'x'"),
        ("b.csv", "-1,2,3\n", r"b\.csv:1: field 'user' value '-1': ids < 0"),
        ("b.csv", "", r"b\.csv: empty file"),
    ],
)
def test_bad_files_raise_one_line_data_errors(tmp_path: Path, name: str, text: str, match: str) -> None:
    f = write(tmp_path / name, text)
    reader = read_count_sequences if name.endswith(".csv") else read_sequences
    with pytest.raises(DataError, match=match) as err:
        reader(f)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=match):  # the streaming reader says the same
        read_workload(f)


def test_bad_arguments_and_missing_files(tmp_path: Path) -> None:
    f = write(tmp_path / "a.txt", "1 2 3\n2 5\n")
    assert as_dict(read_sequences(f, num_rows={"item_id": 6, "user_id": 3})) == {1: [2, 3], 2: [5]}
    with pytest.raises(DataError, match=r"a\.txt:2: field 'item id' value '5': ids outside the table"):
        read_sequences(f, num_rows={"item_id": 5})
    with pytest.raises(DataError, match=r"a\.txt:2: field 'user id' value '2': ids outside the table"):
        read_sequences(f, num_rows={"user_id": 2})
    with pytest.raises(ConfigError, match=r"num_rows\['item_id'\]"):
        read_sequences(f, num_rows={"item_id": 0})
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="max_len"):
            read_sequences(f, max_len=bad)
    with pytest.raises(DataError, match="missing.txt: cannot read"):
        read_sequences(tmp_path / "missing.txt")
    with pytest.raises(InputError, match="cannot read"):  # callers may catch the base class
        read_count_sequences(tmp_path / "missing.csv")


# ------------------------------------------------------------------------- agreement with readers


def merged_counts(f: Path, max_len: int | None = None) -> tuple[np.ndarray, dict[int, int]]:
    """``read_seq``'s item counts and its item lookups per user (lines of a user added up)."""
    parsed = read_seq(f, max_len=max_len)
    users, inverse = np.unique(parsed.sample_user, return_inverse=True)
    lengths = np.bincount(inverse, weights=parsed.lengths[ITEM_TABLE]).astype(np.int64)
    per_user = dict(zip(users.tolist(), lengths.tolist(), strict=True))
    return parsed.counts[ITEM_TABLE], per_user


def assert_counts_agree(f: Path, max_len: int | None = None) -> None:
    seq = read_sequences(f, max_len=max_len)
    counts, per_user = merged_counts(f, max_len)
    np.testing.assert_array_equal(counts, np.bincount(seq.items, minlength=counts.size))
    assert per_user == dict(zip(seq.users.tolist(), seq.lengths.tolist(), strict=True))


def test_read_seq_counts_equal_read_sequences_in_small_chunks(tmp_path: Path, monkeypatch) -> None:
    rng = np.random.default_rng(5)
    lines = [
        " ".join(map(str, [rng.integers(0, 30), *rng.integers(0, 200, rng.integers(0, 6))]))
        for _ in range(400)
    ]
    f = write(tmp_path / "r.txt", "\n".join(lines) + "\n")
    small_chunks(monkeypatch)
    for max_len in (None, 1, 4, 100):
        assert_counts_agree(f, max_len)


def test_read_seq_counts_equal_read_sequences_on_beauty() -> None:
    f = data_root() / "amazon-yelp-sequences" / "Beauty.txt"
    if not f.is_file():
        pytest.skip(f"real data file {f} is absent (set FLEXSHARD_DATA to the shared data folder)")
    seq = read_sequences(f)
    assert len(seq) == 22_363 and seq.items.size == 198_502  # the README's users and interactions
    for max_len in (None, 5):
        assert_counts_agree(f, max_len)


def per_interaction(text: str, rng: np.random.Generator) -> str:
    """The same histories, one ``user item`` line per interaction, users interleaved at random
    (each user's items stay in order)."""
    pairs = [(int(u), int(i)) for line in text.splitlines() for u, *items in [line.split()] for i in items]
    owner = np.array([u for u, _ in pairs])
    slots = rng.permutation(owner.size)  # shuffle, then put each user's items back in order
    out = [None] * owner.size
    for user in np.unique(owner):
        mine = [p for p in pairs if p[0] == user]
        for slot, pair in zip(sorted(slots[owner == user]), mine, strict=True):
            out[slot] = pair
    return "".join(f"{u} {i}\n" for u, i in out)


@pytest.mark.parametrize("max_len", [None, 2])
def test_per_interaction_file_gives_the_same_workload(tmp_path: Path, max_len: int | None) -> None:
    rng = np.random.default_rng(11)
    rows = [[u, *rng.integers(1, 40, rng.integers(1, 7))] for u in range(1, 25)]
    per_user = "".join(" ".join(map(str, r)) + "\n" for r in rows)
    a = write(tmp_path / "users.txt", per_user)
    b = write(tmp_path / "inter.txt", per_interaction(per_user, rng))
    assert b.read_text().count("\n") == sum(len(r) - 1 for r in rows)
    attrs = json.dumps({str(i): [i % 3, 5 + i % 4] for i in range(1, 40)})
    for stem in ("users", "inter"):
        (tmp_path / f"{stem}_item2attributes.json").write_text(attrs)
    assert as_dict(read_sequences(a, max_len=max_len)) == as_dict(read_sequences(b, max_len=max_len))
    wa, oa = read_workload(a, max_len=max_len, name="x")
    wb, ob = read_workload(b, max_len=max_len, name="x")
    assert [t.name for t in wa.tables] == ["item_id", "item_attribute", "user_id"]
    assert fingerprint(wa) == fingerprint(wb)
    assert oa.keys() == ob.keys() and all(np.array_equal(oa[k], ob[k]) for k in oa)


def test_no_function_local_imports_in_workloads() -> None:
    """Imports sit at module top (a local import would hide a cycle between the modules)."""
    folder = Path(__file__).resolve().parents[2] / "flexshard" / "workloads"
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                local = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
                assert not local, f"{path.name}:{local[0].lineno}: import inside {node.name}()"
