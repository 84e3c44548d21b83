"""A folder held by one job at a time: a lock file created with ``O_EXCL`` semantics.

The lock file (``<folder>/.flexshard-lock``) is JSON naming its holder: ``host``, ``pid``, when it took
the lock (``started``, UTC), the kernel's start time of the process (``ticks``, which tells a reused pid
from the holder) and, under torchrun, the job's run id and restart attempt. It appears whole (written to
a private file, then hard-linked into place: ``link`` fails when the name exists, atomically, on local
and network file systems; ``O_CREAT | O_EXCL`` where there are no hard links), and
:meth:`FolderLock.release` removes it only while it is still this holder's.

A lock is stale, and taken over, when its holder is gone: a process on this host that no longer runs
(or whose pid now belongs to another process), or an earlier attempt of this same torchrun job (the
agent restarted its workers, maybe on other hosts). A holder on another host cannot be checked from
here: its lock stands until it is released or removed by hand. Taking over is serialised by a second
lock (``.flexshard-lock.break``), so two jobs that find the same stale lock cannot both take it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import OutputError
from core.osutil import process_alive

LOCK_NAME = ".flexshard-lock"


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def holder_record() -> dict[str, Any]:
    """This process as a lock holder: host, pid, now, its start ticks, torchrun run id and attempt."""
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ticks": _start_ticks(os.getpid()),
        "job": os.environ.get("TORCHELASTIC_RUN_ID") or None,
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    }


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names; None when it is gone; ``{}`` when it cannot be read as one."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def is_stale(holder: dict[str, Any], me: dict[str, Any]) -> bool:
    """Whether ``holder``'s lock may be taken over by ``me``: an earlier attempt of the same torchrun job,
    or a process of this host that has ended (its pid gone, or now another process's)."""
    job, attempt = holder.get("job"), holder.get("attempt")
    if job and job != "none" and job == me["job"] and isinstance(attempt, int) and attempt < me["attempt"]:
        return True
    pid = holder.get("pid")
    if holder.get("host") != me["host"] or not isinstance(pid, int) or pid <= 0:
        return False
    if not process_alive(pid):
        return True
    ticks = holder.get("ticks")
    return isinstance(ticks, int) and _start_ticks(pid) not in (None, ticks)


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unreadable lock"
    text = f"host {holder.get('host')!r}, pid {holder.get('pid')}"
    return text + (f", since {holder['started']}" if holder.get("started") else "")


@dataclass
class FolderLock:
    """A held lock on ``folder`` (see the module docstring); :meth:`release` it when done."""

    folder: Path
    holder: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.folder / LOCK_NAME

    @classmethod
    def acquire(cls, folder: str | os.PathLike, what: str) -> FolderLock:
        """Hold ``folder`` for this process; OutputError ``what: <folder> is in use by another job (host,
        pid ...)`` when a live holder has it."""
        folder = Path(folder)
        me = holder_record()
        path = folder / LOCK_NAME
        for _attempt in range(3):  # a lock released or broken while we looked: look again
            if _link_new(path, me, what):
                return cls(folder, me)
            holder = _read(path)
            if holder is None:
                continue
            if not is_stale(holder, me):
                raise OutputError(
                    f"{what}: {folder} is in use by another job ({describe(holder)}; lock {path}); wait for "
                    "it to end, or remove the lock if that job is gone"
                )
            _break_stale(path, holder, me, what)
        raise OutputError(f"{what}: {folder}: its lock {path} changed hands repeatedly; try again")

    def held(self) -> bool:
        """Whether the lock file is still this holder's (not removed or taken over by hand)."""
        return _read(self.path) == self.holder

    def release(self) -> None:
        """Remove the lock file if it is still this holder's."""
        if self.held():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def _link_new(path: Path, holder: dict[str, Any], what: str) -> bool:
    """Create ``path`` holding ``holder``, whole, unless it exists: True when created. Where the file
    system has no hard links, ``O_CREAT | O_EXCL`` (a reader may then briefly find it empty: it counts as
    held)."""
    text = json.dumps(holder) + "\n"
    tmp = path.with_name(f"{path.name}.{holder['host']}.{holder['pid']}.{time.monotonic_ns()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _create_new(path, text)
        return True
    except OSError as e:
        raise OutputError(f"{what}: cannot lock {path.parent}: {e.strerror or e}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_new(path: Path, text: str) -> bool:
    """``O_CREAT | O_EXCL`` create of ``path`` with ``text``: True when created, False when it exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    return True


def _break_stale(path: Path, stale: dict[str, Any], me: dict[str, Any], what: str) -> None:
    """Remove the stale lock ``path`` if it still names ``stale``, under the break lock (one breaker at a
    time; a breaker that finds the break lock held by a live process leaves it to that one)."""
    guard = path.with_name(path.name + ".break")
    if not _link_new(guard, me, what):
        other = _read(guard)
        if other is not None and not is_stale(other, me):
            raise OutputError(
                f"{what}: {path.parent}: another job ({describe(other)}) is taking over its stale lock; "
                "try again"
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guard)  # its breaker died within the break: nothing else holds it
        return
    try:
        if _read(path) == stale:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(guard)
