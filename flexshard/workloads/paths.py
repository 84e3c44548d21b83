"""What an input path is, checked before it is opened (opening a fifo would block until a writer comes)."""

from __future__ import annotations

import stat
from pathlib import Path

from core.errors import DataError

_KINDS = (
    (
        stat.S_ISFIFO,
        "a named pipe (fifo), not a regular file: data files are read more than once; save it "
        "to a file first",
    ),
    (stat.S_ISSOCK, "a socket, not a regular file"),
    (stat.S_ISCHR, "a character device, not a regular file"),
    (stat.S_ISBLK, "a block device, not a regular file"),
)


def not_a_file(path: str | Path, folder: str = "a folder, not a file") -> str | None:
    """Why ``path`` is not a regular file (``"no such file"``, ``folder``, ``"a named pipe (fifo) ..."``),
    or None when it is one. Symbolic links are followed."""
    try:
        mode = Path(path).stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as exc:
        return f"cannot read ({exc.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return folder
    return next((text for test, text in _KINDS if test(mode)), "not a regular file")


def check_file(path: str | Path, what: str = "", folder: str = "a folder, not a file") -> Path:
    """``path`` when it is a regular file, else one-line DataError ``"<what>: <path>: is <why>"``."""
    why = not_a_file(path, folder)
    if why is None:
        return Path(path)
    prefix = f"{what}: " if what else ""
    verb = "" if why.startswith(("no such", "cannot")) else "is "
    raise DataError(f"{prefix}{path}: {verb}{why}")
