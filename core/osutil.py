"""Operating-system helpers every layer uses: atomic file writes, free loopback ports, live processes and
the machine's memory.

The output rule (every output file a command names goes through :func:`check_writable` before the work,
then :func:`atomic_open` or :func:`replace_for_append`; checkpoints write into folders of their own,
``flexshard.checkpoint``):

* an output that is the same file as one of the command's inputs (the same path, a hard link, a symlink
  either way, or a file directly inside an input folder) is refused with one :class:`OutputError` line
  naming the flag and both paths, before any work;
* an output replaces the directory entry it names and never writes into an existing file: where the
  output path is a symlink, the link is replaced by a new file and its target is left as it was; where
  the file has other hard links, they keep the old contents. A symlink's target may be an input, a shared
  data set or another user's file: replacing the link can only ever change the path that was named.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, TypeVar

from core.errors import OutputError


def check_writable(
    path: str | os.PathLike, what: str = "output", inputs: Iterable[tuple[str, str | os.PathLike | None]] = ()
) -> Path:
    """``path`` as a Path when a file can be created or replaced there (its folder exists and is writable,
    ``path`` is not a folder, and it is none of ``inputs``); else :class:`~core.errors.OutputError` naming
    ``what`` and the path. ``inputs``: ``(flag, path)`` pairs of the command's inputs (``None`` and paths
    that do not exist, such as preset names, are skipped; a folder stands for the files directly in it).
    Call it before long work, so a bad output path fails first."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{what}: {str(path)!r} is a folder; give a file name")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise OutputError(f"{what}: {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{what}: {str(path)!r}: permission denied")
    clash = input_clash(target, inputs)
    if clash:
        raise OutputError(
            f"{what}: {str(path)!r} is the same file as {clash}: writing it would destroy that input; give "
            "another output path"
        )
    return target


def _file_key(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the file ``path`` resolves to (symlinks followed), or None when there is none."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def input_clash(output: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]]) -> str:
    """'' when writing ``output`` leaves every input as it was, else the clashing input as ``flag 'path'``:
    ``output`` resolves (symlinks followed, hard links alike) to the same file as an input, or to a file
    directly inside an input folder. An output that does not exist yet clashes with nothing."""
    key = _file_key(output)
    if key is None:
        return ""
    for flag, given in inputs:
        if given is None:
            continue
        if _file_key(given) == key:
            return f"{flag} {str(given)!r}"
        if os.path.isdir(given):
            try:
                with os.scandir(given) as entries:
                    for entry in entries:
                        if _file_key(entry.path) == key:
                            return f"{flag} {str(given)!r} (its file {entry.name!r})"
            except OSError:
                continue
    return ""


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", what: str = "output") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing and move it onto ``path`` when the block ends
    without an exception (``os.replace``); on an exception the temporary file is removed and ``path`` is
    left as it was (a symlink at ``path`` is replaced by the file, its target untouched: the output rule
    above). ``mode``: ``"w"`` (UTF-8 text) or ``"wb"``. A path that cannot be written raises
    :class:`~core.errors.OutputError` naming ``path`` (never the temporary file). The file gets the
    permissions of a plain ``open`` (the process umask), not ``mkstemp``'s 0600."""
    path = check_writable(path, what)
    fd, tmp = _private_temp(path, what)
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None
        raise


def _private_temp(path: Path, what: str) -> tuple[int, str]:
    """A new temporary file beside ``path`` with a plain ``open``'s permissions (the umask, not
    ``mkstemp``'s 0600): its descriptor and name. OutputError naming ``path`` when it cannot be made."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return fd, tmp


def replace_for_append(path: str | os.PathLike, keep: bool, what: str = "output") -> IO:
    """A text file at ``path`` to append to as records come (flushed by the caller), under the output
    rule: ``path`` is replaced at once by a new file (a symlink there is replaced, not followed; other
    hard links keep the old contents). ``keep``: the new file starts with the old file's contents (the
    file a resumed run continues); else it starts empty. A regular file with no other name is appended to
    in place (nothing else can see it). OutputError naming ``path`` when it cannot be written."""
    path = check_writable(path, what)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None
    try:
        if keep and st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            return open(path, "a", encoding="utf-8")  # noqa: SIM115
        fd, tmp = _private_temp(path, what)
        try:
            f = os.fdopen(fd, "a", encoding="utf-8")
            if keep and st is not None:
                with open(path, encoding="utf-8") as old:
                    shutil.copyfileobj(old, f)
                f.flush()
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return f
    except OSError as err:
        raise OutputError(f"{what}: {str(path)!r}: cannot write ({err.strerror or err})") from None


RENDEZVOUS_TRIES = 3  # local jobs started again, each on a new port, when rank 0 cannot listen on its port
T = TypeVar("T")


def on_a_free_port(run: Callable[[int], T], port_was_taken: Callable[[Exception], bool]) -> T:
    """``run(port)`` on a :func:`free_port`, started again on a new one (up to ``RENDEZVOUS_TRIES``
    times in all) while it fails with an error that ``port_was_taken`` says came from the rendezvous
    finding its port taken before it listened (nothing of the job ran); any other error is raised."""
    for attempt in range(RENDEZVOUS_TRIES):
        try:
            return run(free_port())
        except Exception as err:
            if attempt + 1 < RENDEZVOUS_TRIES and port_was_taken(err):
                continue
            raise
    raise AssertionError("unreachable")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a local rendezvous), chosen at random
    below the kernel's ephemeral range where there is room: a port the kernel handed out (``bind`` to
    port 0) may be handed out again, to any outgoing connection, before the rendezvous listens on it
    (``EADDRINUSE``, seen once in a CI run); a port below the range is only ever taken by an explicit bind.
    Never the same port twice in one process (two rendezvous started before either listens would
    otherwise meet on one port): every port returned is remembered in ``_HANDED_OUT``."""
    with _HANDED_OUT_LOCK:
        port = _pick_port()
        _HANDED_OUT.add(port)
        return port


def _pick_port() -> int:
    """A bindable port not in ``_HANDED_OUT``: random below the ephemeral range, else the kernel's."""
    low = _ephemeral_low()
    if low > FIXED_PORTS_FROM + 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(FIXED_PORTS_FROM, low)
            if port not in _HANDED_OUT and _bindable(port):
                return port
    for _ in range(1000):  # the kernel's choice, which may repeat one handed out before
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            return port
    raise OSError("free_port: no free port left that this process has not handed out")


def _bindable(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


_HANDED_OUT: set[int] = set()  # every port free_port returned in this process
_HANDED_OUT_LOCK = threading.Lock()


FIXED_PORTS_FROM = 20000  # free_port's random ports start here (above common services' fixed ports)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


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
