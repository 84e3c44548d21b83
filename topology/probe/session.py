"""Joining a probe job and waiting in it with bounds: rendezvous, process group, rank identities.

Every rank of the probe meets the others through a ``TCPStore`` (:func:`rendezvous`), starts the process
group on it (:func:`init_probe_group`: NCCL when CUDA is there, else gloo) and exchanges its
:class:`RankInfo` (:func:`gather_rank_info`). :class:`ProbeSession` bounds every later wait by
``timeout_s`` (seconds) and marks the phases each rank reaches in the store, so a rank that never joins or
stops answering ends the probe with a :class:`~core.errors.ProbeError` naming it. ``torch`` is imported
inside the functions that need it.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from core.errors import ProbeError
from core.ranks import BACKEND_ENV, launcher_gpu, pick_backend
from topology.probe.measurements import RankInfo
from topology.probe.pci import normalize_bus_id

STORE_PREFIX = "flexshard-probe/"  # every key the probe writes in the job's store
CPU_MEMORY_FALLBACK_BYTES = 16 * 2**30  # when the OS does not say how much memory it has


# --- joining ----------------------------------------------------------------------------------------


def _last_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[-1] if text else type(err).__name__


def _open_store(rank: int, master_addr: str, master_port: int, timeout_s: float, host_store: bool) -> Any:
    """The ``TCPStore`` at ``master_addr:master_port`` (hosted here when ``host_store``)."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            master_addr,
            int(master_port),
            None,
            host_store,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:
        role = "host" if host_store else "reach"
        raise ProbeError(
            f"rank {rank}: cannot {role} the rendezvous store at {master_addr}:{master_port} within "
            f"{timeout_s:g} s ({_last_line(err)[:160]})"
        ) from None


def _give_up(store: Any, rank: int, world_size: int, keys: Sequence[str], timeout_s: float) -> ProbeError:
    """Post (and return) the verdict naming the ranks that did not join; rank 0 keeps the store up for up
    to 2 s until the others have read it."""
    missing = [r for r, k in enumerate(keys) if not store.check([k])]
    joined = [r for r in range(world_size) if r not in missing]
    names = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    message = (
        f"rank{'s' if len(missing) > 1 else ''} {names} of {world_size} did not join within "
        f"{timeout_s:g} s (joined: {', '.join(map(str, joined)) or 'none'}); start the probe on "
        "every host with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
    )
    store.set(f"{STORE_PREFIX}abort", message)
    if rank == 0:
        seen = [f"{STORE_PREFIX}abort-seen/{r}" for r in joined if r != 0]
        until = time.monotonic() + 2.0
        while seen and not store.check(seen) and time.monotonic() < until:
            time.sleep(0.02)
    return ProbeError(message)


def rendezvous(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    *,
    client_only: bool = False,
) -> Any:
    """A ``TCPStore`` every rank has joined, or :class:`ProbeError` naming the ranks that did not join.

    Rank 0 hosts the store unless ``client_only`` (torchrun's agent already hosts one). Each rank writes a
    ``joined`` key and waits up to ``timeout_s`` seconds for all others (the other ranks 2 s longer, so
    rank 0 decides first and they report its verdict).
    """
    if not 0 <= rank < world_size:
        raise ProbeError(f"rank {rank}: outside 0..{world_size - 1}; check RANK and WORLD_SIZE")
    store = _open_store(rank, master_addr, master_port, timeout_s, rank == 0 and not client_only)
    keys = [f"{STORE_PREFIX}joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s + (0 if rank == 0 else 2.0)
    try:
        store.set(keys[rank], socket.gethostname())
        while not store.check(keys):
            if store.check([f"{STORE_PREFIX}abort"]):  # rank 0 gave up: say what it said
                store.set(f"{STORE_PREFIX}abort-seen/{rank}", "1")
                raise ProbeError(store.get(f"{STORE_PREFIX}abort").decode())
            if time.monotonic() > deadline:
                raise _give_up(store, rank, world_size, keys, timeout_s)
            time.sleep(0.02)
    except RuntimeError as err:  # the store's host (rank 0) went away
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise ProbeError(
            f"rank {rank}: lost the rendezvous store at {master_addr}:{master_port} before every rank "
            f"joined ({reason}); see rank 0's error"
        ) from None
    return store


def init_probe_group(
    rank: int, world_size: int, store: Any, timeout_s: float, backend: str | None = None
) -> str:
    """``init_process_group`` on ``store`` (``backend``, else as ``FLEXSHARD_BACKEND`` says: by default NCCL
    when CUDA is there, else gloo); returns the backend."""
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = pick_backend(os.environ.get(BACKEND_ENV), torch.cuda.is_available())
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        local = launcher_gpu(gpus, default_local_rank=rank % max(gpus, 1))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"{STORE_PREFIX}pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return backend


# --- who each rank is -------------------------------------------------------------------------------


def probe_device() -> Any:
    """The ``torch.device`` the job's backend runs on: this rank's GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def usable_cpus() -> tuple[int, ...]:
    """The CPU ids this process may run on: its affinity mask where the OS has one, else every CPU of the
    host (ascending)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 0))


def local_info(rank: int) -> RankInfo:
    """This rank's :class:`RankInfo` (host name, device, memory, the CPUs it may run on); ``local_rank`` -1
    without LOCAL_RANK."""
    import torch

    device = probe_device()
    host = socket.gethostname()
    local = int(os.environ.get("LOCAL_RANK", -1))
    cpus = usable_cpus()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = None
        if hasattr(props, "pci_bus_id"):
            domain = getattr(props, "pci_domain_id", 0)
            bus = normalize_bus_id(f"{domain:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")
        return RankInfo(rank, host, local, str(device), bus, int(props.total_memory), str(props.name), cpus)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = CPU_MEMORY_FALLBACK_BYTES
    return RankInfo(rank, host, local, "cpu", None, max(int(total), 1), "cpu", cpus)  # memory: split later


# --- bounded waits ----------------------------------------------------------------------------------


class ProbeSession:
    """Bounded waits and phase markers (so a timeout can say which rank never arrived).

    Control traffic (barriers, object gathers) runs on gloo: the job's group under gloo, else a gloo
    group made here. ``timeout_s``: seconds any wait may take; ``store``: the job's store, where each rank
    marks the phases it reaches (None: timeouts cannot name the missing rank).
    """

    def __init__(self, timeout_s: float, store: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store
        self.device = probe_device()
        gloo = "gloo" in str(dist.get_backend()).lower()
        self.control = None if gloo else dist.new_group(backend="gloo", timeout=self.timeout)

    def mark(self, phase: str) -> None:
        if self.store is not None:
            self.store.set(f"{STORE_PREFIX}phase/{phase}/{self.rank}", "1")

    def absent(self, phase: str, ranks: Sequence[int]) -> list[int]:
        """The ``ranks`` that have not marked ``phase`` ([] when the store cannot tell)."""
        if self.store is None:
            return []
        try:
            return [r for r in ranks if not self.store.check([f"{STORE_PREFIX}phase/{phase}/{r}"])]
        except RuntimeError:
            return []

    def fail(self, phase: str, what: str, peers: Sequence[int], err: BaseException) -> ProbeError:
        """One line saying that ``what`` timed out in ``phase`` and which of ``peers`` is to blame."""
        peers = [p for p in peers if p != self.rank]
        missing = self.absent(phase, peers)
        reason = _last_line(err).split("] ", 1)[-1][:120]
        if missing:
            who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing[:8]))} never reached it"
        elif len(peers) == 1:
            who = f"rank {peers[0]} did not answer"
        else:
            listed = ", ".join(map(str, peers[:8])) + (" ..." if len(peers) > 8 else "")
            who = f"one of ranks {listed} did not answer"
        return ProbeError(
            f"rank {self.rank}: {what} did not finish within {self.timeout_s:g} s: {who} ({reason})"
        )

    def wait(self, work: Any, phase: str, what: str, peers: Sequence[int]) -> None:
        """Wait for an async ``work`` handle, at most ``timeout_s``."""
        try:
            work.wait(self.timeout)
        except RuntimeError as err:
            raise self.fail(phase, what, peers, err) from None

    def barrier(self, phase: str) -> None:
        """Every rank has reached ``phase`` (a monitored barrier names the ranks that did not)."""
        self.mark(phase)
        try:
            self.dist.monitored_barrier(group=self.control, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            raise self.fail(phase, f"barrier before {phase}", range(self.world), err) from None

    def gather(self, obj: Any, phase: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), on every rank, after a barrier on ``phase``."""
        self.barrier(phase)
        out: list[Any] = [None] * self.world
        try:
            self.dist.all_gather_object(out, obj, group=self.control)
        except RuntimeError as err:
            raise self.fail(phase, f"gather of {phase}", range(self.world), err) from None
        return out

    def sync(self) -> None:
        """Wait for the device's queued work (GPU only), so host timers see it finish."""
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def all_gather(obj: Any, phase: str, timeout_s: float = 60.0, store: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), on every rank; bounded, naming ranks that never reach ``phase``."""
    return ProbeSession(timeout_s, store).gather(obj, phase)


def _numbered_by_host(infos: Sequence[RankInfo]) -> list[RankInfo]:
    """``infos`` with local ranks filled in (unknown: the rank's index among its host's ranks) and CPU
    memory split evenly among the ranks of a host."""
    seen: dict[str, int] = {}
    out = []
    for info in infos:
        index = seen.get(info.host, 0)
        seen[info.host] = index + 1
        local = info.local_rank if info.local_rank >= 0 else index
        hosts_ranks = sum(1 for i in infos if i.host == info.host)
        memory = info.memory_bytes // hosts_ranks if info.device == "cpu" else info.memory_bytes
        out.append(replace(info, local_rank=local, memory_bytes=max(int(memory), 1)))
    if len({(i.host, i.local_rank) for i in out}) != len(out):  # LOCAL_RANK repeated: number by rank
        seen.clear()
        fixed = []
        for info in out:
            fixed.append(replace(info, local_rank=seen.get(info.host, 0)))
            seen[info.host] = seen.get(info.host, 0) + 1
        out = fixed
    return out


def gather_rank_info(timeout_s: float = 60.0, store: Any = None) -> list[RankInfo]:
    """Every rank's :class:`RankInfo`, on every rank; local ranks filled in by host when not in the env."""
    session = ProbeSession(timeout_s, store)
    return _numbered_by_host(session.gather(local_info(session.rank), "info"))
