"""The collective half of the cluster probe: measure links with torch.distributed and write them on the graph.

Runs inside an initialised ``torch.distributed`` job (gloo on CPU, NCCL on GPU; the device follows the
backend). Every rank calls :func:`measure` with the same groups; it times

* point-to-point transfers (ping-pong, one way = half the round trip) between rank pairs: all pairs up to
  ``ProbeConfig.all_pairs_max_ranks`` ranks, else a sample (for every rank one partner in its group and one
  outside it, deterministic in ``seed``), scheduled in rounds of disjoint pairs;
* ``all_to_all`` inside each group and across the whole job, and ``all_reduce`` across the replica groups
  (the ranks at the same position of every group),

each at several message sizes. A least-squares fit of ``time = latency + bytes / bandwidth`` per pair and
per collective gives the link numbers. :func:`measured_graph` writes them onto a topology graph
(``measured=True``, ``measured_by="collective"``, the nominal figure kept as ``nominal_GBps``; not
``source``, which node-link JSON uses for the edge's end): either onto the
NVML graph of the job (:func:`restrict_to_job`) or onto a graph built from the measurements alone (one
switch per group standing for its intra-group link, one NIC per rank for the path out of the group).

Every wait is bounded: a rank that never joins (:func:`rendezvous`) or stops answering raises
:class:`ProbeError` naming the rank within ``timeout_s``. ``torch`` is imported inside the functions that
need it, so importing this module stays light.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

import datetime
import math
import os
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from core.errors import TopologyError
from topology.graph import add_link, gpu_id, new_topology, nic_id, nvswitch_id, validate

KiB, MiB = 2**10, 2**20
MEASURED_BY = "collective"
Progress = Callable[[int, int, str], None]  # (done, total, note)


class ProbeError(TopologyError):
    """A probe that could not finish: a rank missing or silent, bad groups. One line, names the rank."""


@dataclass(frozen=True)
class ProbeConfig:
    """What to measure. ``sizes``: message bytes per transfer (per rank for collectives)."""

    sizes: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB)
    repeats: int = 5
    warmup: int = 1
    timeout_s: float = 60.0
    all_pairs_max_ranks: int = 16  # all pairs up to this many ranks, a sample beyond
    slow_factor: float = 0.5  # slow: below this x the median of its class
    collectives: bool = True
    seed: int = 0

    @classmethod
    def quick(cls, **kw: Any) -> ProbeConfig:
        """Fewer sizes and repeats: seconds on a small job."""
        base = {"sizes": (8 * KiB, 256 * KiB, 2 * MiB), "repeats": 3, "warmup": 1}
        return cls(**{**base, **kw})


@dataclass(frozen=True)
class RankInfo:
    """Who a rank is: host, index on the host, device and what the planner needs to know about it."""

    rank: int
    host: str
    local_rank: int
    device: str  # "cpu" or "cuda:<i>"
    bus_id: str | None  # PCI bus id of the GPU (NVML spelling), None on CPU
    memory_bytes: int
    model: str


@dataclass(frozen=True)
class Fit:
    """``time = latency_s + bytes / bandwidth_Bps`` fitted on median times per message size."""

    latency_s: float
    bandwidth_Bps: float
    sizes: tuple[int, ...]
    median_s: tuple[float, ...]

    @property
    def bandwidth_GBps(self) -> float:
        return self.bandwidth_Bps / 1e9

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6

    def to_dict(self) -> dict:
        return {
            "bandwidth_GBps": self.bandwidth_GBps,
            "latency_us": self.latency_us,
            "sizes": list(self.sizes),
            "median_us": [t * 1e6 for t in self.median_s],
        }


@dataclass
class Measurements:
    """What :func:`measure` found (complete on every rank)."""

    ranks: tuple[RankInfo, ...]
    groups: tuple[tuple[int, ...], ...]
    group_names: tuple[str, ...]
    pairs: dict[tuple[int, int], Fit]  # (a, b), a < b: one-way point-to-point
    collectives: dict[str, Fit]  # "all_to_all/group", "all_to_all/world", "all_reduce/replicas"
    bus_factor: dict[str, float]  # collective -> bytes on the busiest link per message byte
    config: ProbeConfig
    seconds: float = 0.0
    group_of_rank: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.group_of_rank = {r: k for k, members in enumerate(self.groups) for r in members}

    def same_group(self, a: int, b: int) -> bool:
        return self.group_of_rank[a] == self.group_of_rank[b]

    def link_class(self, a: int, b: int) -> str:
        return "p2p/intra" if self.same_group(a, b) else "p2p/inter"


# --- fitting ----------------------------------------------------------------------------------------


def fit_latency_bandwidth(sizes: Sequence[int], seconds: Sequence[float]) -> Fit:
    """Least squares of ``seconds = latency + size / bandwidth`` on the median time of each size.

    A fit with a non-positive slope (noise on a link faster than the sizes can show) falls back to the
    largest size's throughput; a negative intercept is clamped to 0.
    """
    by_size: dict[int, list[float]] = {}
    for s, t in zip(sizes, seconds, strict=True):
        by_size.setdefault(int(s), []).append(float(t))
    if not by_size:
        raise ProbeError("fit: no samples; measure at least one message size")
    xs = np.array(sorted(by_size), dtype=np.float64)
    ys = np.array([np.median(by_size[int(x)]) for x in xs])
    slope, intercept = np.polyfit(xs, ys, 1) if len(xs) >= 2 else (0.0, 0.0)
    if not slope > 0:
        slope = ys[-1] / xs[-1] if ys[-1] > 0 else 1e-12
        intercept = float(ys.min()) if len(xs) >= 2 else 0.0
    return Fit(
        latency_s=max(float(intercept), 0.0),
        bandwidth_Bps=float(1.0 / slope),
        sizes=tuple(int(x) for x in xs),
        median_s=tuple(float(y) for y in ys),
    )


# --- groups and schedules ---------------------------------------------------------------------------


def consecutive_groups(world_size: int, num_groups: int) -> list[list[int]]:
    """``num_groups`` groups of consecutive ranks (``--groups G``); the world must divide evenly."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
        raise ProbeError(f"--groups: {num_groups!r}; expected a positive number of groups")
    if world_size % num_groups:
        raise ProbeError(
            f"--groups: {num_groups} groups do not divide {world_size} ranks evenly; choose a divisor"
        )
    size = world_size // num_groups
    return [list(range(k * size, (k + 1) * size)) for k in range(num_groups)]


def host_groups(hosts: Sequence[str]) -> list[list[int]]:
    """One group per host name (``hosts[r]``: host of rank r); groups ordered by their lowest rank."""
    members: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        members.setdefault(host, []).append(rank)
    return list(members.values())


def check_groups(groups: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """Groups as sorted lists; they must partition ranks 0..world_size-1."""
    out = [sorted(int(r) for r in g) for g in groups if len(g)]
    flat = sorted(r for g in out for r in g)
    if flat != list(range(world_size)):
        raise ProbeError(f"groups {out}: must cover ranks 0..{world_size - 1} exactly once")
    return sorted(out, key=lambda g: g[0])


def replica_groups(groups: Sequence[Sequence[int]]) -> list[list[int]]:
    """The ranks at the same position of every group (those of size >= 2): the all-reduce of replicas."""
    depth = max(len(g) for g in groups)
    out = [[g[j] for g in groups if j < len(g)] for j in range(depth)]
    return [r for r in out if len(r) >= 2]


def sample_pairs(
    groups: Sequence[Sequence[int]], world_size: int, all_pairs_max_ranks: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Pairs to time: all pairs on small worlds; else one partner in the group and one outside it per
    rank (deterministic in ``seed``), so every rank has an intra- and an inter-group measurement."""
    if world_size <= all_pairs_max_ranks:
        return [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
    rng = random.Random(seed)
    group_of = {r: k for k, g in enumerate(groups) for r in g}
    pairs: set[tuple[int, int]] = set()
    for r in range(world_size):
        mine = groups[group_of[r]]
        inside = [p for p in mine if p != r]
        if inside:
            p = rng.choice(inside)
            pairs.add((min(r, p), max(r, p)))
        if len(groups) > 1:
            outside = rng.randrange(world_size)
            while group_of[outside] == group_of[r]:
                outside = rng.randrange(world_size)
            pairs.add((min(r, outside), max(r, outside)))
    return sorted(pairs)


def schedule_rounds(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Pack pairs into rounds in which no rank appears twice (greedy, in order)."""
    rounds: list[list[tuple[int, int]]] = []
    busy: list[set[int]] = []
    for a, b in pairs:
        for k, used in enumerate(busy):
            if a not in used and b not in used:
                rounds[k].append((a, b))
                used.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            busy.append({a, b})
    return rounds


# --- joining ----------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    ``joined`` key and waits up to ``timeout_s`` for all others.
    """
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ProbeError(f"rank {rank}: outside 0..{world_size - 1}; check RANK and WORLD_SIZE")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            master_addr,
            int(master_port),
            None,
            rank == 0 and not client_only,
            timeout,
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        role = "host" if rank == 0 and not client_only else "reach"
        raise ProbeError(
            f"rank {rank}: cannot {role} the rendezvous store at {master_addr}:{master_port} within "
            f"{timeout_s:g} s ({reason[:160]})"
        ) from None
    prefix = "flexshard-probe/"
    keys = [f"{prefix}joined/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s + (0 if rank == 0 else 2.0)  # rank 0 decides first
    try:
        store.set(keys[rank], socket.gethostname())
        while not store.check(keys):
            if store.check([f"{prefix}abort"]):  # rank 0 gave up: say what it said
                store.set(f"{prefix}abort-seen/{rank}", "1")
                raise ProbeError(store.get(f"{prefix}abort").decode())
            if time.monotonic() > deadline:
                missing = [r for r, k in enumerate(keys) if not store.check([k])]
                joined = [r for r in range(world_size) if r not in missing]
                names = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
                message = (
                    f"rank{'s' if len(missing) > 1 else ''} {names} of {world_size} did not join within "
                    f"{timeout_s:g} s (joined: {', '.join(map(str, joined)) or 'none'}); start the probe on "
                    "every host with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE"
                )
                store.set(f"{prefix}abort", message)
                if rank == 0:  # keep the store up until the others have read the verdict
                    seen = [f"{prefix}abort-seen/{r}" for r in joined if r != 0]
                    until = time.monotonic() + 2.0
                    while seen and not store.check(seen) and time.monotonic() < until:
                        time.sleep(0.02)
                raise ProbeError(message)
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
    """``init_process_group`` on ``store`` (NCCL when CUDA is there, else gloo); returns the backend."""
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("flexshard-probe/pg", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return backend


def _device() -> Any:
    import torch
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_info(rank: int) -> RankInfo:
    """This rank's :class:`RankInfo` (host name, device, memory)."""
    import torch

    from topology.probe.nvml import normalize_bus_id

    device = _device()
    host = socket.gethostname()
    local = int(os.environ.get("LOCAL_RANK", -1))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        bus = None
        if hasattr(props, "pci_bus_id"):
            domain = getattr(props, "pci_domain_id", 0)
            bus = normalize_bus_id(f"{domain:x}:{props.pci_bus_id:x}:{props.pci_device_id:x}.0")
        return RankInfo(rank, host, local, str(device), bus, int(props.total_memory), str(props.name))
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 * 2**30
    return RankInfo(rank, host, local, "cpu", None, max(int(total), 1), "cpu")  # split by host later


# --- measuring --------------------------------------------------------------------------------------


class _Session:
    """Bounded waits and phase markers (so a timeout can say which rank never arrived)."""

    def __init__(self, timeout_s: float, store: Any = None) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = store
        self.device = _device()
        gloo = "gloo" in str(dist.get_backend()).lower()
        self.control = None if gloo else dist.new_group(backend="gloo", timeout=self.timeout)

    def mark(self, phase: str) -> None:
        if self.store is not None:
            self.store.set(f"flexshard-probe/phase/{phase}/{self.rank}", "1")

    def absent(self, phase: str, ranks: Sequence[int]) -> list[int]:
        if self.store is None:
            return []
        try:
            return [r for r in ranks if not self.store.check([f"flexshard-probe/phase/{phase}/{r}"])]
        except RuntimeError:
            return []

    def fail(self, phase: str, what: str, peers: Sequence[int], err: BaseException) -> ProbeError:
        peers = [p for p in peers if p != self.rank]
        missing = self.absent(phase, peers)
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        reason = reason.split("] ", 1)[-1][:120]
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
        self.barrier(phase)
        out: list[Any] = [None] * self.world
        try:
            self.dist.all_gather_object(out, obj, group=self.control)
        except RuntimeError as err:
            raise self.fail(phase, f"gather of {phase}", range(self.world), err) from None
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)


def all_gather(obj: Any, phase: str, timeout_s: float = 60.0, store: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), on every rank; bounded, naming ranks that never reach ``phase``."""
    return _Session(timeout_s, store).gather(obj, phase)


def gather_rank_info(timeout_s: float = 60.0, store: Any = None) -> list[RankInfo]:
    """Every rank's :class:`RankInfo`, on every rank; local ranks filled in by host when not in the env."""
    session = _Session(timeout_s, store)
    infos: list[RankInfo] = session.gather(local_info(session.rank), "info")
    seen: dict[str, int] = {}
    out = []
    for info in infos:
        index = seen.get(info.host, 0)
        seen[info.host] = index + 1
        local = info.local_rank if info.local_rank >= 0 else index
        hosts_ranks = sum(1 for i in infos if i.host == info.host)
        memory = info.memory_bytes // hosts_ranks if info.device == "cpu" else info.memory_bytes
        out.append(
            RankInfo(info.rank, info.host, local, info.device, info.bus_id, max(int(memory), 1), info.model)
        )
    if len({(i.host, i.local_rank) for i in out}) != len(out):  # LOCAL_RANK repeated: number by rank
        seen.clear()
        fixed = []
        for info in out:
            fixed.append(RankInfo(**{**info.__dict__, "local_rank": seen.get(info.host, 0)}))
            seen[info.host] = seen.get(info.host, 0) + 1
        out = fixed
    return out


def _p2p(session: _Session, me: int, peer: int, size: int, config: ProbeConfig, phase: str) -> list[float]:
    """Ping-pong with ``peer``; the lower rank times it. Returns one-way seconds per repeat (lower rank)."""
    import torch

    dist = session.dist
    buf = torch.empty(size, dtype=torch.uint8, device=session.device)
    times = []
    what = f"point-to-point {min(me, peer)}<->{max(me, peer)} at {size} B"
    for i in range(config.warmup + config.repeats):
        session.sync()
        start = time.perf_counter()
        if me < peer:
            session.wait(dist.isend(buf, peer), phase, what, [peer])
            session.wait(dist.irecv(buf, peer), phase, what, [peer])
        else:
            session.wait(dist.irecv(buf, peer), phase, what, [peer])
            session.wait(dist.isend(buf, peer), phase, what, [peer])
        session.sync()
        if i >= config.warmup:
            times.append((time.perf_counter() - start) / 2)
    return times


def _collective(
    session: _Session,
    kind: str,
    group: Any,
    members: Sequence[int],
    size: int,
    config: ProbeConfig,
    phase: str,
) -> list[float]:
    import torch

    dist = session.dist
    n = len(members)
    size = max(size // n, 1) * n
    times = []
    what = f"{kind} over ranks {members[0]}..{members[-1]} ({n}) at {size} B"
    if kind == "all_to_all":
        src = torch.empty(size, dtype=torch.uint8, device=session.device)
        dst = torch.empty_like(src)
    else:
        src = torch.zeros(size // 4, dtype=torch.float32, device=session.device)
    for i in range(config.warmup + config.repeats):
        session.sync()
        start = time.perf_counter()
        if kind == "all_to_all":
            work = dist.all_to_all_single(dst, src, group=group, async_op=True)
        else:
            work = dist.all_reduce(src, group=group, async_op=True)
        session.wait(work, phase, what, members)
        session.sync()
        if i >= config.warmup:
            times.append(time.perf_counter() - start)
    return times


def _subgroups(session: _Session, groups: Sequence[Sequence[int]]) -> Any:
    """This rank's process group among ``groups`` (a partition of the ranks; every rank creates all)."""
    mine = None
    for members in groups:
        pg = session.dist.new_group(list(members), timeout=session.timeout)
        if session.rank in members:
            mine = pg
    return mine


def measure(
    groups: Sequence[Sequence[int]],
    config: ProbeConfig | None = None,
    *,
    infos: Sequence[RankInfo] | None = None,
    store: Any = None,
    progress: Progress | None = None,
    group_names: Sequence[str] | None = None,
) -> Measurements:
    """Time point-to-point transfers and collectives; every rank must call it with the same ``groups``.

    ``groups``: a partition of the ranks (see :func:`consecutive_groups`, :func:`host_groups`); ``store``:
    the job's store, used to name ranks that never reached a phase; ``progress(done, total, note)`` is
    called on rank 0 only. Returns the same :class:`Measurements` on every rank.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ProbeError("measure: torch.distributed is not initialised; call init_probe_group first")
    config = config or ProbeConfig()
    if not config.sizes or min(config.sizes) <= 0 or config.repeats <= 0:
        raise ProbeError(f"probe config: sizes {config.sizes} and repeats {config.repeats} must be positive")
    started = time.perf_counter()
    session = _Session(config.timeout_s, store)
    world, me = session.world, session.rank
    groups = check_groups(groups, world)
    if infos is None:
        infos = gather_rank_info(config.timeout_s, store)
    names = list(group_names) if group_names else [f"g{k}" for k in range(len(groups))]
    pairs = sample_pairs(groups, world, config.all_pairs_max_ranks, config.seed)
    rounds = schedule_rounds(pairs)
    replicas = replica_groups(groups)
    collectives: list[tuple[str, list[list[int]]]] = []
    if config.collectives:
        if any(len(g) >= 2 for g in groups):
            collectives.append(("all_to_all/group", [list(g) for g in groups]))
        if len(groups) >= 2 and world >= 2:
            collectives.append(("all_to_all/world", [list(range(world))]))
        if replicas:
            collectives.append(("all_reduce/replicas", replicas))
    total = len(rounds) + len(collectives) * len(config.sizes) + 1
    done = 0

    def step(note: str) -> None:
        nonlocal done
        done += 1
        if progress is not None and me == 0:
            progress(done, total, note)

    samples: dict[str, tuple[list[int], list[float]]] = {}
    for k, pairs_k in enumerate(rounds):
        phase = f"p2p/{k}"
        session.barrier(phase)
        for a, b in pairs_k:
            if me in (a, b):
                peer = b if me == a else a
                for size in config.sizes:
                    times = _p2p(session, me, peer, size, config, phase)
                    if me == a:
                        xs, ys = samples.setdefault(f"{a}-{b}", ([], []))
                        xs += [size] * len(times)
                        ys += times
        step(f"point-to-point round {k + 1}/{len(rounds)}")

    for name, member_lists in collectives:
        kind = name.split("/")[0]
        if name == "all_to_all/world":
            pg, members = None, list(range(world))
        else:
            pg = _subgroups(session, member_lists)
            members = next((m for m in member_lists if me in m), [])
        for size in config.sizes:
            phase = f"{name}/{size}"
            session.barrier(phase)
            if members and len(members) >= 2:
                times = _collective(session, kind, pg, members, size, config, phase)
                xs, ys = samples.setdefault(f"{name}@{members[0]}", ([], []))
                xs += [max(size // len(members), 1) * len(members)] * len(times)
                ys += times
            step(f"{name} {size} B")

    gathered = session.gather(samples, "results")
    merged: dict[str, tuple[list[int], list[float]]] = {}
    for part in gathered:
        for key, (xs, ys) in part.items():
            mx, my = merged.setdefault(key.split("@")[0], ([], []))
            mx += xs
            my += ys
    pair_fits = {}
    for a, b in pairs:
        xs, ys = merged[f"{a}-{b}"]
        pair_fits[(a, b)] = fit_latency_bandwidth(xs, ys)
    coll_fits = {name: fit_latency_bandwidth(*merged[name]) for name, _ in collectives if name in merged}
    bus = {}
    for name, member_lists in collectives:
        n = max(len(m) for m in member_lists)
        bus[name] = (n - 1) / n if name.startswith("all_to_all") else 2 * (n - 1) / n
    step("done")
    return Measurements(
        ranks=tuple(infos),
        groups=tuple(tuple(g) for g in groups),
        group_names=tuple(names),
        pairs=pair_fits,
        collectives=coll_fits,
        bus_factor=bus,
        config=config,
        seconds=time.perf_counter() - started,
    )


# --- per-rank numbers, slow parts -------------------------------------------------------------------


@dataclass(frozen=True)
class RankLinks:
    """A rank's links as measured: the best pair bandwidth of each class (a pair runs at the slower end's
    speed, so the best pair bounds the rank's own link from below) and the lowest latency."""

    intra_GBps: float | None
    intra_latency_us: float | None
    inter_GBps: float | None
    inter_latency_us: float | None


def rank_links(m: Measurements) -> list[RankLinks]:
    out = []
    for r in range(len(m.ranks)):
        best: dict[str, tuple[float, float]] = {}
        for (a, b), fit in m.pairs.items():
            if r in (a, b):
                cls = "intra" if m.same_group(a, b) else "inter"
                bw, lat = best.get(cls, (0.0, math.inf))
                best[cls] = (max(bw, fit.bandwidth_GBps), min(lat, fit.latency_us))
        intra, inter = best.get("intra"), best.get("inter")
        out.append(RankLinks(intra and intra[0], intra and intra[1], inter and inter[0], inter and inter[1]))
    return out


def slow_parts(m: Measurements, factor: float | None = None) -> list[dict]:
    """Hosts, ranks and pairs measured below ``factor`` x the median of their class, slowest first."""
    factor = m.config.slow_factor if factor is None else factor
    found: list[dict] = []

    def check(what: str, name: str, cls: str, values: dict[str, float]) -> None:
        if len(values) < 2:
            return
        median = float(np.median(list(values.values())))
        for key, bw in values.items():
            if median > 0 and bw < factor * median:
                found.append(
                    {
                        "what": what,
                        "name": key,
                        "class": cls,
                        "bandwidth_GBps": bw,
                        "median_GBps": median,
                        "ratio": bw / median,
                        "of": name,
                    }
                )

    for cls in ("p2p/intra", "p2p/inter"):
        values = {f"{a}-{b}": f.bandwidth_GBps for (a, b), f in m.pairs.items() if m.link_class(a, b) == cls}
        check("pair", "ranks", cls, values)
    links = rank_links(m)
    for cls in ("intra", "inter"):
        per_rank = {str(r): getattr(lk, f"{cls}_GBps") for r, lk in enumerate(links)}
        per_rank = {k: v for k, v in per_rank.items() if v is not None}
        check("rank", "rank", f"p2p/{cls}", per_rank)
        per_host: dict[str, list[float]] = {}
        for r, bw in per_rank.items():
            per_host.setdefault(m.ranks[int(r)].host, []).append(bw)
        check("host", "host", f"p2p/{cls}", {h: float(np.median(v)) for h, v in per_host.items()})
    found.sort(key=lambda d: (d["ratio"], d["what"], d["name"]))
    return found


# --- graphs -----------------------------------------------------------------------------------------


def restrict_to_job(G: nx.Graph, infos: Sequence[RankInfo]) -> nx.Graph | None:
    """The NVML graph ``G`` (from :func:`topology.probe.merge_hosts`) cut to the GPUs of the job and
    renumbered so that GPU ``rank`` = torch rank. GPUs are matched by PCI bus id, else by local rank.
    Returns None when a rank has no GPU in ``G`` (the caller then builds the graph from measurements)."""
    G = G.copy()
    by_bus = {
        (attrs["host"], attrs.get("bus_id")): node
        for node, attrs in G.nodes(data=True)
        if attrs.get("kind") == "gpu" and attrs.get("bus_id")
    }
    chosen: dict[Any, int] = {}
    for info in infos:
        node = by_bus.get((info.host, info.bus_id)) if info.bus_id else None
        if node is None:
            node = gpu_id(info.host, info.local_rank)
        if node not in G or G.nodes[node].get("kind") != "gpu" or node in chosen:
            return None
        chosen[node] = info.rank
    for node, attrs in list(G.nodes(data=True)):
        if attrs.get("kind") == "gpu" and node not in chosen:
            nic = nic_id(attrs["host"], attrs["local_rank"])
            G.remove_node(node)
            if nic in G:
                G.remove_node(nic)
    for node, rank in chosen.items():
        G.nodes[node]["rank"] = rank
    return validate(G)


def _set(G: nx.Graph, u: Any, v: Any, bandwidth_GBps: float, latency_us: float) -> None:
    attrs = G.edges[u, v]
    attrs.pop("source", None)  # the NVML half's provenance; node-link JSON would drop it anyway
    if not attrs.get("measured"):
        attrs["nominal_GBps"] = attrs["bandwidth_GBps"]
    attrs.update(
        bandwidth_GBps=float(bandwidth_GBps),
        latency_us=float(max(latency_us, 0.0)),
        measured=True,
        measured_by=MEASURED_BY,
    )


def _metadata(m: Measurements) -> dict:
    return {
        "seconds": round(m.seconds, 3),
        "sizes": list(m.config.sizes),
        "repeats": m.config.repeats,
        "groups": [list(g) for g in m.groups],
        "group_names": list(m.group_names),
        "pairs": {f"{a}-{b}": f.to_dict() for (a, b), f in sorted(m.pairs.items())},
        "collectives": {
            name: {**f.to_dict(), "bus_GBps": f.bandwidth_GBps * m.bus_factor[name]}
            for name, f in m.collectives.items()
        },
        "slow": slow_parts(m),
    }


def _fallback(values: Sequence[float | None], default: float) -> float:
    known = [v for v in values if v is not None and v > 0]
    return float(np.median(known)) if known else default


def measured_graph(m: Measurements, base: nx.Graph | None = None, name: str = "probe") -> nx.Graph:
    """A topology carrying the measured numbers (validated).

        With ``base`` (the job's NVML graph, ranks = torch ranks): each GPU's NVLink edge to its switch gets
        the rank's intra-group bandwidth and latency, a direct GPU-GPU edge (NVLink bridge or PCIe) its pair's
        numbers, and each NIC's network edge the rank's inter-group numbers. Without ``base``: one node per
        rank (``host``, ``group`` from the measurements), an NVSwitch-style node per group linked at the
        measured intra-group numbers, and one NIC per rank on a single leaf at the measured inter-group
        numbers (GPU->NIC at the same bandwidth and 0 latency, NIC->leaf at half the one-way latency, so the
        cluster view reads back the measured figures). Numbers a class lacks (a group of one) take the median
        of the others, marked ``measured=False``. ``G.graph["probe"]`` keeps every fit and the slow parts; a
    slow host or GPU node also gets ``slow``: a list of ``{class, bandwidth_GBps, median_GBps, ratio}``.
    """
    links = rank_links(m)
    intra_default = _fallback(
        [lk.intra_GBps for lk in links], _fallback([lk.inter_GBps for lk in links], 1.0)
    )
    inter_default = _fallback([lk.inter_GBps for lk in links], intra_default)
    lat_intra_default = _fallback([lk.intra_latency_us for lk in links], 1.0)
    lat_inter_default = _fallback([lk.inter_latency_us for lk in links], lat_intra_default)
    multi = len(m.groups) > 1
    if base is not None:
        G = base.copy()
        G.graph["name"] = name
        node_of = {attrs["rank"]: node for node, attrs in G.nodes(data=True) if attrs.get("kind") == "gpu"}
        for r, lk in enumerate(links):
            node = node_of[r]
            for _, nbr, attrs in list(G.edges(node, data=True)):
                kind_nbr = G.nodes[nbr].get("kind")
                if attrs["kind"] == "nvlink" and kind_nbr == "nvswitch" and lk.intra_GBps:
                    _set(G, node, nbr, lk.intra_GBps, lk.intra_latency_us or 0.0)
                elif kind_nbr == "gpu":
                    pair = (min(r, G.nodes[nbr]["rank"]), max(r, G.nodes[nbr]["rank"]))
                    if pair in m.pairs:
                        _set(G, node, nbr, m.pairs[pair].bandwidth_GBps, m.pairs[pair].latency_us)
                elif kind_nbr == "nic" and lk.inter_GBps:
                    for _, up, up_attrs in G.edges(nbr, data=True):
                        if up_attrs["kind"] == "network":
                            lat = (lk.inter_latency_us or 0.0) / 2 - attrs["latency_us"]
                            _set(G, nbr, up, lk.inter_GBps, lat)
    else:
        G = new_topology(name)
        for info in m.ranks:
            if info.host not in G:
                G.add_node(info.host, kind="host", name=info.host)
        for k in range(len(m.groups)):
            G.add_node(nvswitch_id(m.group_names[k]), kind="nvswitch", group=m.group_names[k])
        if multi:
            G.add_node("leaf0", kind="switch", level="leaf")
        for info, lk in zip(m.ranks, links, strict=True):
            node = gpu_id(info.host, info.local_rank)
            group = m.group_names[m.group_of_rank[info.rank]]
            G.add_node(
                node,
                kind="gpu",
                rank=info.rank,
                host=info.host,
                group=group,
                local_rank=info.local_rank,
                memory_bytes=int(info.memory_bytes),
                model=info.model,
                device=info.device,
            )
            add_link(
                G,
                node,
                nvswitch_id(group),
                "nvlink",
                lk.intra_GBps or intra_default,
                lk.intra_latency_us if lk.intra_latency_us is not None else lat_intra_default,
            )
            G.edges[node, nvswitch_id(group)].update(
                measured=lk.intra_GBps is not None, measured_by=MEASURED_BY
            )
            if multi:
                nic = nic_id(info.host, info.local_rank)
                G.add_node(nic, kind="nic", host=info.host)
                bw = lk.inter_GBps or inter_default
                lat = lk.inter_latency_us if lk.inter_latency_us is not None else lat_inter_default
                add_link(G, node, nic, "pcie", bw, 0.0)
                add_link(G, nic, "leaf0", "network", bw, lat / 2)
                for u, v in ((node, nic), (nic, "leaf0")):
                    G.edges[u, v].update(measured=lk.inter_GBps is not None, measured_by=MEASURED_BY)
    G.graph["probe"] = _metadata(m)
    gpu_of = {a["rank"]: n for n, a in G.nodes(data=True) if a.get("kind") == "gpu"}
    for part in G.graph["probe"]["slow"]:
        if part["what"] == "host":
            target = part["name"]
        elif part["what"] == "rank":
            target = gpu_of.get(int(part["name"]))
        else:
            continue  # pairs: the graph's own slow_links finds their edges
        if target in G:
            entry = {k: part[k] for k in ("class", "bandwidth_GBps", "median_GBps", "ratio")}
            G.nodes[target].setdefault("slow", []).append(entry)
    return validate(G)


# --- text -------------------------------------------------------------------------------------------


def report(m: Measurements, max_slow: int = 10) -> str:
    """Groups, a bandwidth table per link class, and the slow parts."""
    hosts = sorted({i.host for i in m.ranks})
    sizes = sorted({len(g) for g in m.groups})
    lines = [
        f"probe: {len(m.ranks)} ranks on {len(hosts)} host{'s' if len(hosts) > 1 else ''}, {len(m.groups)} "
        f"group{'s' if len(m.groups) > 1 else ''} of {'/'.join(map(str, sizes))}, {len(m.pairs)} pairs, "
        f"{m.seconds:.1f} s",
        "groups: "
        + "; ".join(f"{m.group_names[k]}: {', '.join(map(str, g))}" for k, g in enumerate(m.groups[:8]))
        + (" ..." if len(m.groups) > 8 else ""),
        f"{'link class':<27}{'n':>5}{'GB/s min':>10}{'median':>10}{'max':>10}{'lat us':>10}",
    ]
    for cls in ("p2p/intra", "p2p/inter"):
        fits = [f for (a, b), f in m.pairs.items() if m.link_class(a, b) == cls]
        if fits:
            bws = [f.bandwidth_GBps for f in fits]
            lat = float(np.median([f.latency_us for f in fits]))
            lines.append(
                f"{cls:<27}{len(fits):>5}{min(bws):>10.2f}{np.median(bws):>10.2f}{max(bws):>10.2f}{lat:>10.1f}"
            )
    for name, f in m.collectives.items():
        bus = f.bandwidth_GBps * m.bus_factor[name]
        lines.append(f"{name + ' (bus)':<27}{'':>5}{'':>10}{bus:>10.2f}{'':>10}{f.latency_us:>10.1f}")
    slow = slow_parts(m)
    lines.append(f"slow: {len(slow) if slow else 'none'} (below {m.config.slow_factor:g} x the median)")
    for s in slow[:max_slow]:
        lines.append(
            f"  {s['what']} {s['name']} ({s['class']}): {s['bandwidth_GBps']:.2f} GB/s, "
            f"{s['ratio']:.2f} x median {s['median_GBps']:.2f}"
        )
    if len(slow) > max_slow:
        lines.append(f"  ... and {len(slow) - max_slow} more")
    return "\n".join(lines)
