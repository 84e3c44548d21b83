"""The probe's records: who a rank is (:class:`RankInfo`), what to measure (:class:`ProbeConfig`), a
latency / bandwidth fit (:class:`Fit`, :func:`fit_latency_bandwidth`) and what a probe found
(:class:`Measurements`).

Message sizes are bytes, times seconds, bandwidths bytes per second (``_GBps``: GB/s, 1 GB = 1e9 B),
latencies seconds (``_us``: microseconds). Plain data and numpy; no ``torch``.
"""

# ruff: noqa: N802, N815  (unit suffixes such as _GBps keep their case: B = bytes)

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import ConfigError, ProbeError
from core.ranks import RankLayout

KiB, MiB = 2**10, 2**20


@dataclass(frozen=True)
class RankInfo:
    """Who a rank is: host, index on the host, device and what the planner needs to know about it."""

    rank: int
    host: str
    local_rank: int
    device: str  # "cpu" or "cuda:<i>"
    bus_id: str | None  # PCI bus id of the GPU (NVML spelling), None on CPU
    memory_bytes: int  # the GPU's memory; on CPU the host's memory split among its ranks
    model: str
    cpus: tuple[int, ...] = ()  # the CPU ids the rank's process may run on (its affinity mask); (): not known


@dataclass(frozen=True)
class ProbeConfig:
    """What to measure. ``sizes``: message bytes per transfer (per rank for collectives)."""

    sizes: tuple[int, ...] = (4 * KiB, 64 * KiB, 1 * MiB, 8 * MiB)
    # timed repeats per size: on 4 ranks sharing 2 cores, four probes of 5 put the rail all-to-all's
    # latency at 178-871 us and the group's at 321-1254; four of 15 at 122-199 and 137-628 (2026-11-28)
    repeats: int = 15
    warmup: int = 1  # untimed repeats before them
    timeout_s: float = 60.0  # the longest any rank waits for another
    all_pairs_max_ranks: int = 16  # all pairs up to this many ranks, a sample beyond
    slow_factor: float = 0.5  # slow: below this x the median of its class
    collectives: bool = True
    seed: int = 0  # of the pair sample

    @classmethod
    def quick(cls, **kw: Any) -> ProbeConfig:
        """Fewer sizes and repeats: seconds on a small job."""
        base = {"sizes": (8 * KiB, 256 * KiB, 2 * MiB), "repeats": 3, "warmup": 1}
        return cls(**{**base, **kw})


@dataclass(frozen=True)
class Fit:
    """``time = latency_s + bytes / bandwidth_Bps`` fitted on median times per message size."""

    latency_s: float
    bandwidth_Bps: float
    sizes: tuple[int, ...]  # message bytes
    median_s: tuple[float, ...]  # median seconds at each size

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
    """What :func:`topology.probe.timing.measure` found (the same on every rank). ``groups`` are ordered as
    :class:`RankLayout` orders them (by lowest rank, members ascending); ``group_names[k]`` names
    ``groups[k]``."""

    ranks: tuple[RankInfo, ...]
    groups: tuple[tuple[int, ...], ...]
    group_names: tuple[str, ...]
    pairs: dict[tuple[int, int], Fit]  # (a, b), a < b: one-way point-to-point
    collectives: dict[str, Fit]  # "all_to_all/group", "all_to_all/world", "all_reduce/replicas"
    bus_factor: dict[str, float]  # collective -> bytes on the busiest link per message byte
    config: ProbeConfig
    seconds: float = 0.0  # wall time of the probe
    layout: RankLayout = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.layout = RankLayout.of(self.groups, len(self.ranks), "measurements: groups")
        if self.layout.groups != tuple(tuple(g) for g in self.groups):
            raise ConfigError(
                f"measurements: groups {[list(g) for g in self.groups]} must be ordered by their lowest "
                "rank, members ascending"
            )

    def group_index(self, rank: int) -> int:
        """Index into ``groups`` and ``group_names`` of ``rank``'s group."""
        return int(self.layout.group_of_rank[rank])

    def same_group(self, a: int, b: int) -> bool:
        return self.group_index(a) == self.group_index(b)

    def link_class(self, a: int, b: int) -> str:
        return "p2p/intra" if self.same_group(a, b) else "p2p/inter"


# --- fitting ----------------------------------------------------------------------------------------


def fit_latency_bandwidth(sizes: Sequence[int], seconds: Sequence[float]) -> Fit:
    """Least squares of ``seconds = latency + size / bandwidth`` on the median time of each size (bytes).

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


def median_measurements(taken: Sequence[Measurements]) -> Measurements:
    """Several probes of the same ranks as one: each pair's and each collective's median time per message
    size over the probes, fitted again (:func:`fit_latency_bandwidth`); ``seconds`` is the probes' total.
    A single probe comes back unchanged. ProbeError unless every probe timed the same pairs and collectives
    of the same groups."""
    if not taken:
        raise ProbeError("median_measurements: no probes; measure at least once")
    first = taken[0]
    for m in taken[1:]:
        if (
            m.groups != first.groups
            or set(m.pairs) != set(first.pairs)
            or set(m.collectives) != set(first.collectives)
        ):
            raise ProbeError(
                "median_measurements: the probes timed different groups, pairs or collectives "
                f"({sorted(first.collectives)} in the first, {sorted(m.collectives)} in another)"
            )
    if len(taken) == 1:
        return first

    def refit(fits: list[Fit]) -> Fit:
        return fit_latency_bandwidth(
            [s for f in fits for s in f.sizes], [t for f in fits for t in f.median_s]
        )

    return Measurements(
        ranks=first.ranks,
        groups=first.groups,
        group_names=first.group_names,
        pairs={k: refit([m.pairs[k] for m in taken]) for k in first.pairs},
        collectives={k: refit([m.collectives[k] for m in taken]) for k in first.collectives},
        bus_factor=dict(first.bus_factor),
        config=first.config,
        seconds=float(sum(m.seconds for m in taken)),
    )
