"""Bad input found by trying the tool as a new user (issue 13): each case is one line naming the field and
the value, exit status 2, and no output file."""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import run

from core.errors import CheckpointError, DataError
from core.osutil import physical_memory_bytes
from flexshard.workloads._text import grow


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "huge.txt",
            f"1 {2**64 + 5} 3\n2 5 6\n",
            f"huge.txt:1: field 'item id' value '{2**64 + 5}': ids of 4,294,967,296 and above need remapping "
            "to dense ids (or an explicit num_rows)",
        ),
        ("neg.txt", "1 4 3\n2 -4\n", "neg.txt:2: field 'item id' value '-4': ids < 0 are not allowed"),
        (
            "mid.csv",
            "1,2,3\nuser,item,count\n",
            "mid.csv:2: field 'user' value 'user': not a non-negative integer id",
        ),
        (
            "cols.csv",
            "uzer,item,x\n1,2,3\n",
            "cols.csv:1: no user column in the header 'uzer, item, x' (recognised names: user, userid, uid, "
            "useridx, customer, customerid ...; or --user-col NAME; a file of string ids needs a header "
            "line)",
        ),
    ],
)
def test_bad_ids_and_misplaced_headers_fail_with_one_line(tmp_path, capsys, name, text, message):
    data, out = tmp_path / name, tmp_path / "out.npz"
    data.write_text(text)
    rc, _out, err = run(capsys, "stats", str(data), "--out", str(out))
    assert rc == 2 and err.strip() == f"flexshard stats: error: {tmp_path / message}"
    assert not out.exists()


def test_a_csv_header_line_naming_the_columns_is_skipped(tmp_path, capsys):
    plain, headed = tmp_path / "plain.csv", tmp_path / "headed.csv"
    rows = "1,2,3\n1,3,1\n2,2,1\n"
    plain.write_text(rows)
    headed.write_text("User_ID,Item_ID,Counts\n" + rows)
    for f in (plain, headed):
        assert run(capsys, "stats", str(f), "--out", str(f.with_suffix(".npz")))[0] == 0
    a, b = (np.load(f.with_suffix(".npz")) for f in (plain, headed))
    assert {k: a[k].tolist() for k in a.files if "count" in k} == {
        k: b[k].tolist() for k in b.files if "count" in k
    }


def test_ids_too_large_for_memory_are_a_data_error():
    """Refused from the machine's physical memory, not from a MemoryError: with overcommit (a 128 GiB GPU
    machine) ``np.zeros`` of 80 TB succeeded lazily and the error never came."""
    have = physical_memory_bytes()
    assert have is not None and 2**30 < have < 10**13 * 8
    with pytest.raises(DataError) as err:
        grow(np.zeros(1, np.int64), 10**13)  # 80 TB of per-row counts
    assert str(err.value) == (
        "ids up to 9,999,999,999,999 need a 74505.8 GiB per-row array, more than this machine's "
        f"{have / 2**30:.1f} GiB of memory: remap the ids to dense ones (0..rows-1)"
    )
    assert grow(np.arange(3), 5).tolist() == [0, 1, 2, 0, 0]  # under the bound: zero-padded


@pytest.mark.parametrize("content", [b"\x00\x01garbage" * 100, b"", b"PK\x03\x04not really a zip"])
def test_a_rank_file_that_is_not_a_checkpoint_is_one_line(tmp_path, content):
    """Even where the manifest records the garbage's own size and hash (so it reaches the unpickler)."""
    import hashlib

    from flexshard.checkpoint_manifest import Manifest, RankFileRecord, TableEntry, read_rank_file

    (tmp_path / "rank0.pt").write_bytes(content)
    record = RankFileRecord("rank0.pt", len(content), hashlib.sha256(content).hexdigest())
    manifest = Manifest(
        tmp_path, 1, 1, [[0]], (TableEntry("item", 10, 4),), "adagrad", "f" * 64, (record,), None
    )
    with pytest.raises(CheckpointError) as err:
        read_rank_file(manifest, 0)
    assert str(err.value).startswith(
        f"checkpoint {str(tmp_path)!r}: cannot read rank0.pt (not a FlexShard rank file: "
    )
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_output_files_follow_the_users_umask(tmp_path, capsys, umask):
    """Plans, stats and checkpoint manifests are written through temporary files; the result has a plain
    open's permissions (0666 less the umask), not a temporary file's 0600."""
    import os
    import stat

    old = os.umask(umask)
    try:
        out = tmp_path / f"plan-{umask:o}.json"
        assert run(capsys, "plan", "--topology", "h100:1x2", "--out", str(out))[0] == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
