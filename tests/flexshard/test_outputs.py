"""Outputs never destroy inputs (issue 22, Deliver 3): an output that resolves to an input (the same path
spelled otherwise, a hard link, a symlink either way, a file of an input folder) is refused before any
work with one line naming the flag and both paths, exit 2, the input byte for byte as it was; and one rule
for symlinked outputs: every output (stats, plan, topology --out; train --metrics-out, fresh or resumed)
replaces the link with a new file and leaves the link's target as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import fails, run

from core.errors import OutputError
from core.osutil import check_writable, input_clash, replace_for_append

TRAIN = ["--steps", "1", "--batch-size", "8", "--dim", "8", "--quiet"]


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


def _histories(path: Path) -> Path:
    """30 users' histories over 20 items (every id present)."""
    lines = [" ".join(str(x) for x in [u, u % 20, (3 * u + 1) % 20, (7 * u + 2) % 20]) for u in range(30)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _aliases(tmp_path: Path, target: Path) -> dict[str, Path]:
    """Other names of ``target``: itself spelled relative with '..', a hard link and a symlink."""
    hard, soft = tmp_path / f"hard-{target.name}", tmp_path / f"soft-{target.name}"
    os.link(target, hard)
    soft.symlink_to(target)
    dotted = target.parent / ".." / target.parent.name / target.name
    return {"same path": dotted, "hard link": hard, "symlink": soft}


def test_input_clash_finds_every_name_of_an_input(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("1 2 3\n")
    other = tmp_path / "other.txt"
    other.write_text("x\n")
    for how, alias in _aliases(tmp_path, data).items():
        assert input_clash(alias, [("--data", data)]) == f"--data {str(data)!r}", how
        assert input_clash(data, [("--data", alias)]) == f"--data {str(alias)!r}", how  # the input aliased
    folder = tmp_path / "parts"
    folder.mkdir()
    (folder / "a.parquet").write_text("a")
    os.link(folder / "a.parquet", tmp_path / "a-link.parquet")
    assert input_clash(tmp_path / "a-link.parquet", [("input", folder)]) == (
        f"input {str(folder)!r} (its file 'a.parquet')"
    )
    assert input_clash(other, [("--data", data), ("--plan", None), ("--workload", "default")]) == ""
    assert input_clash(tmp_path / "new.txt", [("--data", data)]) == ""  # a new file destroys nothing
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "gone")
    assert input_clash(dangling, [("--data", data)]) == ""
    with pytest.raises(OutputError) as err:
        check_writable(tmp_path / "soft-d.txt", "--out", [("input", data)])
    assert str(err.value) == (
        f"--out: {str(tmp_path / 'soft-d.txt')!r} is the same file as input {str(data)!r}: writing it would "
        "destroy that input; give another output path"
    )


def _case_args(tmp_path: Path) -> dict[str, tuple[list[str], Path]]:
    """Per command: its argv with ``{out}`` for the output, and the input the output will alias."""
    data = _histories(tmp_path / "d.txt")
    stats = tmp_path / "s.npz"
    assert run_quiet(["stats", str(data), "--dim", "8", "--touch-rates", "off", "--out", str(stats)]) == 0
    topo = tmp_path / "t.json"
    assert run_quiet(["topology", "--topology", "h100:1x1", "--out", str(topo)]) == 0
    plan = tmp_path / "p.json"
    assert run_quiet(["plan", "--workload", str(stats), "--topology", "h100:1x1", "--batch-size", "8",
                      "--out", str(plan)]) == 0  # fmt: skip
    plan_with = ["plan", "--workload", str(stats), "--topology"]
    return {
        "stats": (["stats", str(data), "--touch-rates", "off", "--out", "{out}"], data),
        "plan --workload": ([*plan_with, "h100:1x1", "--out", "{out}"], stats),
        "plan --topology": ([*plan_with, str(topo), "--out", "{out}"], topo),
        "topology": (["topology", "--topology", str(topo), "--out", "{out}"], topo),
        "train --data": (["train", "--data", str(data), *TRAIN, "--metrics-out", "{out}"], data),
        "train --plan": (["train", "--data", str(data), "--plan", str(plan), *TRAIN, "--metrics-out", "{out}"
                          ], plan),
    }  # fmt: skip


def run_quiet(argv: list[str]) -> int:
    from flexshard.cli import main

    return main(argv)


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(tmp_path, capsys):
    cases = _case_args(tmp_path)
    capsys.readouterr()
    for name, (argv, source) in cases.items():
        before = source.read_bytes()
        command = argv[0]
        flag = "--metrics-out" if command == "train" else "--out"
        input_flag = "the input" if command == "stats" else name.split()[-1] if " " in name else "--topology"
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        for how, alias in {"the input itself": source, **_aliases(folder, source)}.items():
            line = fails(capsys, *[a.replace("{out}", str(alias)) for a in argv])
            assert line == (
                f"flexshard {command}: error: {flag}: {str(alias)!r} is the same file as {input_flag} "
                f"{str(source)!r}: writing it would destroy that input; give another output path"
            ), (name, how)
            assert source.read_bytes() == before, (name, how)
            assert alias.exists() and (alias.is_symlink() or alias.samefile(source)), (name, how)


def test_every_output_replaces_a_symlink_and_leaves_its_target(tmp_path, capsys):
    """The one rule for symlinked outputs: the link is replaced by the new file; the file it pointed to
    (here an unrelated file, which a write-through would have overwritten) keeps its bytes."""
    cases = _case_args(tmp_path)
    capsys.readouterr()
    keep = tmp_path / "keep.txt"
    keep.write_text("not to be overwritten\n")
    for name, (argv, _source) in cases.items():
        link = tmp_path / f"out-{name.replace(' ', '_')}"
        link.symlink_to(keep)
        rc, out, err = run(capsys, *[a.replace("{out}", str(link)) for a in argv])
        assert rc == 0, (name, out, err)
        assert not link.is_symlink() and link.is_file(), name
        assert link.stat().st_size > 0, name
        assert keep.read_text() == "not to be overwritten\n", name


def test_a_resumed_metrics_log_continues_the_file_not_its_link_target(tmp_path, capsys):
    ckpt, target, log = tmp_path / "ckpt", tmp_path / "target.jsonl", tmp_path / "m.jsonl"
    assert run_quiet(["train", *TRAIN, "--checkpoint-dir", str(ckpt), "--metrics-out", str(target)]) == 0
    first = target.read_text()
    log.symlink_to(target)
    argv = [
        "train",
        *TRAIN,
        "--steps",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--resume",
        "--metrics-out",
        str(log),
    ]
    assert run_quiet(argv) == 0
    assert target.read_text() == first  # the link's target as it was
    assert not log.is_symlink()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["header", "step", "end", "header", "step", "end"]
    assert log.read_text().startswith(first) and records[3]["start_step"] == 1


def test_replace_for_append_never_writes_into_another_name(tmp_path):
    plain, other = tmp_path / "plain.jsonl", tmp_path / "other.jsonl"
    plain.write_text("a\n")
    with replace_for_append(plain, keep=True) as f:  # one name only: appended in place
        f.write("b\n")
    assert plain.read_text() == "a\nb\n"
    os.link(plain, other)
    with replace_for_append(plain, keep=True) as f:
        f.write("c\n")
    assert (plain.read_text(), other.read_text()) == ("a\nb\nc\n", "a\nb\n")
    with replace_for_append(other, keep=False) as f:
        f.write("fresh\n")
    assert (plain.read_text(), other.read_text()) == ("a\nb\nc\n", "fresh\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.jsonl", "plain.jsonl"]  # no temporary left
    with pytest.raises(OutputError, match="folder"):
        replace_for_append(tmp_path / "missing" / "m.jsonl", keep=False, what="--metrics-out")
