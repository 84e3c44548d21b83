"""Running the ``flexshard`` command in-process from tests."""

from __future__ import annotations

from flexshard.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``flexshard argv...``."""
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def fails(capsys, *argv: str) -> str:
    """Run a command that must fail: exit 2 and exactly one line on stderr, returned."""
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (rc, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]
