"""Timing links inside a probe job: what to time, the timers, and :func:`measure`, which runs them.

Every rank calls :func:`measure` with the same groups (a partition of the ranks, see
:class:`core.ranks.RankLayout`). It times

* point-to-point transfers (ping-pong, one way = half the round trip) between rank pairs: all pairs up to
  ``ProbeConfig.all_pairs_max_ranks`` ranks, else a sample (:func:`sample_pairs`), run in rounds of
  disjoint pairs (:func:`schedule_rounds`);
* ``all_to_all`` inside each group and across the whole job, and ``all_reduce`` across the replica groups
  (the ranks at the same position of every group),

each at every message size of :class:`ProbeConfig` (bytes), and fits ``time = latency + bytes /
bandwidth`` per pair and per collective (:func:`topology.probe.measurements.fit_latency_bandwidth`).
Times are seconds. The device follows the backend (GPU under NCCL, CPU under gloo); ``torch`` is
imported inside the timers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import ProbeError
from core.ranks import RankLayout
from topology.probe.measurements import Measurements, ProbeConfig, RankInfo, fit_latency_bandwidth
from topology.probe.session import ProbeSession, gather_rank_info

ProgressFn = Callable[[int, int, str], None]  # (steps done, steps in all, note)
Samples = dict[str, tuple[list[int], list[float]]]  # key -> (message bytes, seconds), one entry a repeat


# --- what to time -----------------------------------------------------------------------------------


def sample_pairs(
    groups: Sequence[Sequence[int]], world_size: int, all_pairs_max_ranks: int, seed: int = 0
) -> list[tuple[int, int]]:
    """Pairs to time: all pairs on small worlds; else one partner in the group and one outside it per
    rank (deterministic in ``seed``), so every rank has an intra- and an inter-group measurement."""
    if world_size <= all_pairs_max_ranks:
        return [(a, b) for a in range(world_size) for b in range(a + 1, world_size)]
    layout = RankLayout.of(groups, world_size)
    group_of = layout.group_of_rank
    rng = random.Random(seed)
    pairs: set[tuple[int, int]] = set()
    for r in range(world_size):
        inside = [p for p in layout.group_of(r) if p != r]
        if inside:
            p = rng.choice(inside)
            pairs.add((min(r, p), max(r, p)))
        if layout.num_groups > 1:
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


def collectives_to_time(layout: RankLayout, config: ProbeConfig) -> list[tuple[str, list[list[int]]]]:
    """(name, member lists) of each collective to time, on the process groups a training step uses
    (:mod:`solvers.schedule`): all-to-all in the groups (when one has two ranks), across the job and
    between rail peers (when there are two groups), all-reduce across the replica (rail) groups and across
    the job."""
    if not config.collectives:
        return []
    out: list[tuple[str, list[list[int]]]] = []
    if any(len(g) >= 2 for g in layout.groups):
        out.append(("all_to_all/group", layout.to_lists()))
    if layout.num_groups >= 2 and layout.num_ranks >= 2:
        out.append(("all_to_all/world", [list(range(layout.num_ranks))]))
    replicas = layout.replica_groups()
    if replicas:
        out.append(("all_to_all/rail", replicas))
        out.append(("all_reduce/replicas", replicas))
    if layout.num_ranks >= 2:
        out.append(("all_reduce/world", [list(range(layout.num_ranks))]))
    return out


def bus_factors(collectives: Sequence[tuple[str, list[list[int]]]]) -> dict[str, float]:
    """Bytes on the busiest link per message byte: (n-1)/n for all-to-all, 2(n-1)/n for ring all-reduce."""
    out = {}
    for name, member_lists in collectives:
        n = max(len(m) for m in member_lists)
        out[name] = (n - 1) / n if name.startswith("all_to_all") else 2 * (n - 1) / n
    return out


# --- timers -----------------------------------------------------------------------------------------


def _p2p(session: ProbeSession, peer: int, size: int, config: ProbeConfig, phase: str) -> list[float]:
    """Ping-pong of ``size`` bytes with ``peer``; one-way seconds (half the round trip) per repeat."""
    import torch

    dist, me = session.dist, session.rank
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
    session: ProbeSession,
    kind: str,
    group: Any,
    members: Sequence[int],
    size: int,
    config: ProbeConfig,
    phase: str,
) -> list[float]:
    """Seconds per repeat of ``kind`` ("all_to_all" or "all_reduce") over ``members`` at ``size`` bytes per
    rank (rounded down to a multiple of the member count, at least one byte each)."""
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


def _subgroups(session: ProbeSession, groups: Sequence[Sequence[int]]) -> Any:
    """This rank's process group among ``groups`` (a partition of the ranks; every rank creates all)."""
    mine = None
    for members in groups:
        pg = session.dist.new_group(list(members), timeout=session.timeout)
        if session.rank in members:
            mine = pg
    return mine


def _add(samples: Samples, key: str, sizes: list[int], seconds: list[float]) -> None:
    xs, ys = samples.setdefault(key, ([], []))
    xs += sizes
    ys += seconds


@dataclass
class _Timing:
    """This rank's share of the timing: the samples it keeps, and a progress step after each part."""

    session: ProbeSession
    config: ProbeConfig
    step: Callable[[str], None]
    samples: Samples = field(default_factory=dict)

    def pairs(self, rounds: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Time this rank's pairs, round by round; the lower rank of a pair keeps its samples ("a-b")."""
        me = self.session.rank
        for k, pairs_k in enumerate(rounds):
            phase = f"p2p/{k}"
            self.session.barrier(phase)
            for a, b in pairs_k:
                if me in (a, b):
                    peer = b if me == a else a
                    for size in self.config.sizes:
                        times = _p2p(self.session, peer, size, self.config, phase)
                        if me == a:
                            _add(self.samples, f"{a}-{b}", [size] * len(times), times)
            self.step(f"point-to-point round {k + 1}/{len(rounds)}")

    def collectives(self, collectives: Sequence[tuple[str, list[list[int]]]]) -> None:
        """Time each collective at each size; samples keyed "<name>@<lowest member>" (bytes per rank)."""
        session = self.session
        for name, member_lists in collectives:
            kind = name.split("/")[0]
            if name.endswith("/world"):
                pg, members = None, list(range(session.world))
            else:
                pg = _subgroups(session, member_lists)
                members = next((m for m in member_lists if session.rank in m), [])
            for size in self.config.sizes:
                phase = f"{name}/{size}"
                session.barrier(phase)
                if members and len(members) >= 2:
                    times = _collective(session, kind, pg, members, size, self.config, phase)
                    moved = max(size // len(members), 1) * len(members)
                    _add(self.samples, f"{name}@{members[0]}", [moved] * len(times), times)
                self.step(f"{name} {size} B")


def _merge(gathered: Sequence[Samples]) -> Samples:
    """Every rank's samples in one table; a collective's groups pooled under its name."""
    merged: Samples = {}
    for part in gathered:
        for key, (xs, ys) in part.items():
            _add(merged, key.split("@")[0], xs, ys)
    return merged


def measure(
    groups: Sequence[Sequence[int]],
    config: ProbeConfig | None = None,
    *,
    infos: Sequence[RankInfo] | None = None,
    store: Any = None,
    progress: ProgressFn | None = None,
    group_names: Sequence[str] | None = None,
) -> Measurements:
    """Time point-to-point transfers and collectives; every rank must call it with the same ``groups``.

    ``groups``: a partition of the ranks (see :class:`core.ranks.RankLayout`); ``infos``: every rank's
    :class:`RankInfo` (gathered here when None); ``store``: the job's store, used to name ranks that never
    reached a phase; ``progress(done, total, note)`` is called on rank 0 only. Returns the same
    :class:`Measurements` on every rank.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ProbeError("measure: torch.distributed is not initialised; call init_probe_group first")
    config = config or ProbeConfig()
    if not config.sizes or min(config.sizes) <= 0 or config.repeats <= 0:
        raise ProbeError(f"probe config: sizes {config.sizes} and repeats {config.repeats} must be positive")
    started = time.perf_counter()
    session = ProbeSession(config.timeout_s, store)
    layout = RankLayout.of(groups, session.world)
    if infos is None:
        infos = gather_rank_info(config.timeout_s, store)
    names = list(group_names) if group_names else [f"g{k}" for k in range(layout.num_groups)]
    pairs = sample_pairs(layout.groups, session.world, config.all_pairs_max_ranks, config.seed)
    rounds = schedule_rounds(pairs)
    collectives = collectives_to_time(layout, config)
    total = len(rounds) + len(collectives) * len(config.sizes) + 1
    done = 0

    def step(note: str) -> None:
        nonlocal done
        done += 1
        if progress is not None and session.rank == 0:
            progress(done, total, note)

    timing = _Timing(session, config, step)
    timing.pairs(rounds)
    timing.collectives(collectives)
    merged = _merge(session.gather(timing.samples, "results"))
    step("done")
    return Measurements(
        ranks=tuple(infos),
        groups=layout.groups,
        group_names=tuple(names),
        pairs={(a, b): fit_latency_bandwidth(*merged[f"{a}-{b}"]) for a, b in pairs},
        collectives={name: fit_latency_bandwidth(*merged[name]) for name, _ in collectives if name in merged},
        bus_factor=bus_factors(collectives),
        config=config,
        seconds=time.perf_counter() - started,
    )
