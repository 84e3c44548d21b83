"""Operating-system helpers every layer uses: atomic file writes, free loopback ports, live processes and
the machine's memory."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from core.errors import OutputError


def check_writable(path: str | os.PathLike, what: str = "output") -> Path:
    """``path`` as a Path when a file can be created or replaced there (its folder exists and is writable,
    and ``path`` is not a folder); else :class:`~core.errors.OutputError` naming ``what`` and the path.
    Call it before long work, so a bad output path fails first."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{what}: {str(path)!r} is a folder; give a file name")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{what}: {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{what}: {str(path)!r}: permission denied")
    return target


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", what: str = "output") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing and move it onto ``path`` when the block ends
    without an exception (``os.replace``); on an exception the temporary file is removed and ``path`` is
    left as it was. ``mode``: ``"w"`` (UTF-8 text) or ``"wb"``. A path that cannot be written raises
    :class:`~core.errors.OutputError` naming ``path`` (never the temporary file). The file gets the
    permissions of a plain ``open`` (the process umask), not ``mkstemp``'s 0600."""
    path = check_writable(path, what)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None
        raise


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (Linux ``/proc``; a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (``sysconf``), or None where the system does not say.

    An allocation above it cannot be used whole, even where the kernel's overcommit lets ``np.zeros``
    succeed lazily and the process is killed later, when the pages are touched."""
    try:
        pages, page_bytes = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None
