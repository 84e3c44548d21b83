"""The nouns of the time model (:mod:`solvers.time_model`): collective latencies, local work rates and a
step's modeled time.

:class:`LatencyTable` prices one collective from its kind, scope and participants: linear interpolation in
``log2(participants)`` between the measured or published points of a topology
(``G.graph["collective_latency_us"]``, :mod:`topology.latency`); outside them an all-to-all scales with the
peers, ``t(p) = t(p_end) (p - 1) / (p_end - 1)`` (one message to every peer), and an all-reduce with the
tree depth, ``t(p) = t(p_end) log2(p) / log2(p_end)``, from the nearest point. A (kind, scope) with no
point falls back to the link model of :class:`topology.views.ClusterView`: an all-to-all takes one link
latency, an all-reduce ``2 ceil(log2 p)`` of them (a tree up and down).

:class:`LocalRates` holds seconds per unit of each piece of local work, measured by
``experiments/calibrate_local.py`` (rates are plain numbers: solvers never import torch).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import ConfigError
from solvers.schedule import Scope, Stage, StepShape, shape_schedule
from topology import presets
from topology.latency import KINDS, SCOPES, LatencyPoints, parse_latency
from topology.views import ClusterView, cluster_view


@dataclass(frozen=True)
class LatencyTable:
    """Seconds of latency of one small-message collective, by kind, scope and participants (module doc)."""

    points_us: LatencyPoints = field(default_factory=dict)  # {kind: {scope: {participants: us}}}
    intra_link_s: float = 0.0  # the link model's latencies, for a (kind, scope) without points
    inter_link_s: float = 0.0
    source: str = ""

    def seconds(self, kind: str, scope: str, participants: int) -> float:
        """Latency in seconds of a ``kind`` collective on ``participants`` ranks of a ``scope`` group
        (``"group"`` for a world stage on a cluster of one group; the caller says so)."""
        kind, scope = str(getattr(kind, "value", kind)), str(getattr(scope, "value", scope))
        if kind not in KINDS or scope not in SCOPES:
            raise ValueError(f"latency table: no collective {kind!r} on scope {scope!r}")
        p = int(participants)
        if p <= 1:
            return 0.0
        pts = self.points_us.get(kind, {}).get(scope)
        if not pts:
            link = self.intra_link_s if scope == "group" else self.inter_link_s
            return link if kind == "all_to_all" else 2 * math.ceil(math.log2(p)) * link
        ps = np.array(sorted(pts), dtype=np.float64)
        us = np.array([pts[int(q)] for q in ps])
        if ps[0] <= p <= ps[-1]:
            return float(np.interp(math.log2(p), np.log2(ps), us)) * 1e-6
        end = ps[0] if p < ps[0] else ps[-1]
        y = us[0] if p < ps[0] else us[-1]
        if kind == "all_to_all":
            return float(y * (p - 1) / (end - 1)) * 1e-6
        return float(y * math.log2(p) / math.log2(end)) * 1e-6

    @classmethod
    def from_view(cls, view: ClusterView) -> LatencyTable:
        """The view's collective latencies (from its topology graph) over its link model."""
        inter = float(view.inter_latency_s.max()) if view.num_groups > 1 else 0.0
        return cls(
            points_us=view.collective_latency_us or {},
            intra_link_s=float(view.intra_latency_s.max()),
            inter_link_s=inter,
            source=view.collective_latency_source or "link latencies of the topology",
        )

    @classmethod
    def from_graph(cls, G: Any) -> LatencyTable:
        """The collective latencies of a topology graph (``G.graph["collective_latency_us"]``), over the
        link model of its view."""
        return cls.from_view(cluster_view(G))

    @classmethod
    def links_only(cls, view: ClusterView) -> LatencyTable:
        """The link model alone (one link latency per all-to-all, ``2 ceil(log2 p)`` per all-reduce)."""
        return replace_points(cls.from_view(view), {}, "link latencies of the topology")

    @classmethod
    def preset(cls, name: str, view: ClusterView | None = None) -> LatencyTable:
        """The NCCL figures of preset ``name`` (``h100`` or ``nvl72``; :mod:`topology.presets`)."""
        figures = {"h100": presets.H100_NCCL_LATENCY_US, "nvl72": presets.NVL72_NCCL_LATENCY_US}
        if name not in figures:
            raise ConfigError(f"latency preset {name!r}: unknown; expected one of {', '.join(figures)}")
        base = cls() if view is None else cls.from_view(view)
        return replace_points(base, parse_latency(figures[name]), presets.NCCL_LATENCY_SOURCE)


def stage_latency_s(stage: Stage, view: ClusterView, latency: LatencyTable) -> float:
    """Latency of one stage on ``view``: a world stage on a cluster of one group is priced as a group
    collective (it never leaves NVLink)."""
    scope = Scope.GROUP if stage.scope is Scope.WORLD and view.num_groups == 1 else stage.scope
    return latency.seconds(stage.kind.value, scope.value, stage.participants(view))


def shape_latency_s(shape: StepShape, view: ClusterView, latency: LatencyTable | None = None) -> float:
    """Latency of one step of a plan of this shape: the sum over its stages (the view's table by default)."""
    table = LatencyTable.from_view(view) if latency is None else latency
    return float(sum(stage_latency_s(s, view, table) for s in shape_schedule(shape, view)))


def replace_points(table: LatencyTable, points: LatencyPoints, source: str) -> LatencyTable:
    """``table`` with other points and source."""
    return LatencyTable(points, table.intra_link_s, table.inter_link_s, source)


GPU_HOST_WORK = ("fused", "measured")  # a GPU preset's host work: none around collectives, or this runtime's


@dataclass(frozen=True)
class LocalRates:
    """Seconds per unit of local work on one rank. ``_per_value``: per embedding element moved (a row of
    ``dim`` values costs ``dim`` of them); ``collective_call_s``: the host's fixed cost of issuing one
    collective (the call, the split bookkeeping), on top of the collective's latency."""

    dedup_s_per_lookup: float  # torch.unique(..., return_inverse=True) over the batch's ids
    route_s_per_lookup: float  # the tier test and owner of an id, and the sort into destination order
    gather_s_per_value: float  # index_select of rows
    scatter_add_s_per_value: float  # index_add_ of gradients into rows
    update_s_per_value: float  # the optimizer's update of a row (SGD or row-wise Adagrad)
    collective_call_s: float  # host overhead per collective call
    source: str = ""
    # The step's work around the exchange (0 in rates files written before they were measured):
    pack_s_per_value: float = 0.0  # a vector element copied into a send buffer or out of a receive buffer
    output_s_per_value: float = 0.0  # the loss and its gradient over one looked-up output element
    table_stage_s: float = 0.0  # the runtime's host work around one collective, per table
    step_s: float = 0.0  # the runtime's host work per step outside its collectives (checks, autograd)
    stage_s: float = 0.0  # the runtime's host work around one collective, whatever its tables
    table_s: float = 0.0  # the runtime's host work per table per step outside its collectives

    REQUIRED = (
        "dedup_s_per_lookup",
        "route_s_per_lookup",
        "gather_s_per_value",
        "scatter_add_s_per_value",
        "update_s_per_value",
        "collective_call_s",
    )
    FIELDS = (
        *REQUIRED,
        "pack_s_per_value",
        "output_s_per_value",
        "table_stage_s",
        "step_s",
        "stage_s",
        "table_s",
    )

    def __post_init__(self) -> None:
        for name in self.FIELDS:
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise ConfigError(f"local rates: field {name!r} = {value!r}; expected seconds >= 0")

    @classmethod
    def default(cls) -> LocalRates:
        """The rates ``experiments/calibrate_local.py`` printed on this project's development machine (see
        :data:`DEFAULT_RATES`)."""
        return DEFAULT_RATES

    @classmethod
    def for_view(cls, view: ClusterView, gpu_host: str = "fused") -> LocalRates:
        """The rates to price ``view`` with. A cluster that carries a preset's NCCL figures: the value work
        at the H100's HBM roofline and, by ``gpu_host`` (:data:`GPU_HOST_WORK`), no host work around the
        collectives (``fused``: :data:`GPU_ROOFLINE_RATES`) or this runtime's, measured on an H100
        (``measured``: :data:`H100_RUNTIME_RATES`). Any other: this machine's measured rates, slower where
        the view's ranks outnumber their host's cores (:meth:`shared` by ``view.ranks_per_core``)."""
        if gpu_host not in GPU_HOST_WORK:
            expected = ", ".join(GPU_HOST_WORK)
            raise ConfigError(f"gpu host work {gpu_host!r}: unknown; expected one of {expected}")
        if view.collective_latency_source == presets.NCCL_LATENCY_SOURCE:
            return H100_RUNTIME_RATES if gpu_host == "measured" else GPU_ROOFLINE_RATES
        return DEFAULT_RATES.shared(view.ranks_per_core)

    @classmethod
    def zero(cls) -> LocalRates:
        """No local work (the bytes-only model)."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "none")

    @classmethod
    def load(cls, path: str | os.PathLike) -> LocalRates:
        """Rates from the JSON ``experiments/calibrate_local.py --out`` wrote (one-line error otherwise)."""
        where = f"local rates file {str(path)!r}"
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"{where}: cannot read ({err})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: top level is a {type(data).__name__}; expected an object")
        missing = [name for name in cls.REQUIRED if name not in data]
        if missing:
            raise ConfigError(f"{where}: missing field {missing[0]!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    def host_s(self, tables: int, collectives: int) -> float:
        """The runtime's host work in a step of ``collectives`` collectives over ``tables`` tables,
        seconds: ``step_s + table_s x tables + (stage_s + table_stage_s x tables) x collectives``."""
        per_stage = self.stage_s + self.table_stage_s * tables
        return self.step_s + self.table_s * tables + per_stage * collectives

    def shared(self, ranks_per_core: float) -> LocalRates:
        """These rates on a machine where ``ranks_per_core`` ranks share each core (more ranks than cores:
        each rank's local work takes that many times longer); at most one rank per core, unchanged."""
        factor = max(1.0, float(ranks_per_core))
        if factor == 1.0:
            return self
        scaled = {name: getattr(self, name) * factor for name in self.FIELDS}
        return replace(self, **scaled, source=f"{self.source}; x{factor:g} ({factor:g} ranks per core)")


# experiments/calibrate_local.py --host, the median of each figure over 5 runs on 2026-11-26 on the
# development machine while nothing else ran (x86_64 Linux, 2 cores, torch 2.13.0+cpu, one thread): CPU
# figures, for the gloo runs on this machine, fitted in relative error (an absolute fit let the 40-80 MB
# sizes, past the caches, set gather at 2.2 ns per value where the bench's sizes take 0.2-0.4). The host
# terms are the least steady; they were fitted again at 11:35 UTC the same day (calibrate_local.py --host
# --ranks 4,8 --host-batches 2,64, the median of 3 runs: step_s 1.21-1.77 ms, table_stage_s 0.30-0.36 ms),
# because the batch-2, 4-rank fit (step_s 0.68, table_stage_s 0.23 ms) left 3-5 ms a step at 4 ranks and
# about 8 ms at 8 ranks out of batch 64 (docs/cost_model.md section 10.2.1b). These were fitted with
# Python's collector inside the timed steps; run once with it out as the bench now keeps it (22:48 UTC,
# calibrate_local.py --repeats 3 --host --ranks 4,8 --host-batches 2,64): step_s 2.19 ms, table_stage_s
# 0.20 ms, collective_call_s 49 us, i.e. less host work at 4 collectives of 3 tables (4.6 vs 5.3 ms),
# not adopted: the study's predictions at batch 64 were already 4-25% low. Since 2026-11-28 step_s and
# table_stage_s are fitted to what the bench's own prediction leaves of its measured steps
# (calibrate_local.py --host-from docs/results/step_time.json: the 144 runtime rows of the two study runs
# of 2026-11-28 08:43 UTC, priced with step_s 1.324 ms and table_stage_s 0.3252 ms, 134 of them within 20%
# before, all 144 after; fitted on either run alone, the other run's 72 all within 20%): calibrate_host.py
# subtracts a tiny collective's latency where the bench prices its probe's, and leaves the bytes in. Fitted
# again the same evening to the two balanced study runs of 11:46 and 15:09 UTC (4 rounds each, 144 runtime
# rows priced with step_s 2.169 ms, table_stage_s 0.5857 ms: 140 within 20% before, 144 after; fitted on
# the 15:09 run alone, the 11:46 run's 72 rows all within 20%, on the 11:46 run alone, 69 of 15:09's 72):
# the batch-64 steps at 4 ranks ran 12-25% faster in the later run. Since 2026-12-07 the host work is
# step_s + stage_s x collectives, no term per table (table_stage_s 0): at the same lookups and rows the
# bench's steps on 1 to 9 tables are within 8% of each other, where the per-table term priced 9 tables'
# steps up to 31% high and 1 table's 20% low. Fitted (experiments/host_terms.py) to the 57 runtime rows of
# bench runs of 2026-12-07 on 1-9 tables and on Yelp, Gowalla and Beauty, and the 144 of the two study
# runs of 2026-12-07 (docs/results/host_terms.md: within 20% in 197 of 201 rows, 194 before). A GPU
# cluster's rates come from running the script there and LocalRates.load.
DEFAULT_RATES = LocalRates(
    dedup_s_per_lookup=8.848e-09,
    route_s_per_lookup=5.308e-08,
    gather_s_per_value=2.208e-10,
    scatter_add_s_per_value=4.583e-10,
    update_s_per_value=2.26e-09,
    collective_call_s=6.045e-05,
    source="experiments/calibrate_local.py --host (median of 5), 2026-11-26, x86_64 CPU, torch 2.13.0+cpu; "
    "host terms experiments/host_terms.py, bench and study runs of 2026-12-07",
    pack_s_per_value=2.225e-10,
    output_s_per_value=4.015e-10,
    table_stage_s=0.0,
    step_s=9.966e-04,
    stage_s=1.659e-03,
)

HBM_BPS = 3.35e12  # H100 SXM HBM3, bytes/s
# Each piece's bytes of device memory traffic at the H100's HBM bandwidth, docs/cost_model.md "Step
# time": gather 8 B per value (read, write), scatter-add 12 B (read source, read and write the row),
# row-wise Adagrad 12 B, dedup 72 B per id (a radix sort's passes and the inverse), routing 224 B per id
# (a binary search's reads and the sort), and 5 us of host time to launch a collective. No host work
# around the collectives: what the step would cost if the runtime's host work per table and stage were
# fused away or hidden behind the device (a target; the H100 measured 2-17x these rates per unit and a
# host floor of milliseconds, docs/results/local_path_gpu.md).
GPU_ROOFLINE_RATES = LocalRates(
    dedup_s_per_lookup=72 / HBM_BPS,
    route_s_per_lookup=224 / HBM_BPS,
    gather_s_per_value=8 / HBM_BPS,
    scatter_add_s_per_value=12 / HBM_BPS,
    update_s_per_value=12 / HBM_BPS,
    collective_call_s=5e-6,
    source="assumed: H100 HBM roofline (3.35 TB/s), no host work around the collectives",
)

# The runtime's host work on a GPU: its aten ops times the host's seconds per op. Seconds per op: one
# H100 (16-core Xeon host, torch 2.11.0+cu130) ran a one-rank runtime step at batch 2, where the values
# cost nothing, in 6.32 and 5.92 ms for 236 aten ops (experiments/local_path_gpu.py --host-batch 2, two
# runs in one lease, 2026-11-26): 26.8 and 25.1 us per op (Python, dispatch, kernel launches and the
# step's waits for the card), their mean below. Ops: the runtime's own count as a GPU issues them (the
# same ops on every device but for the GPU-only two-pass gathers and column joins, which the CPU counts
# were taken with: their device test lifted), counted on 2026-11-27 at 23:10 UTC: 230 a step on one rank
# (local_path_gpu.py --host-batch 2 on the CPU; no collectives), and with profile_step.py --ops at batch
# 2 on the bench's 3 tables 287 and 293 at 4 and 8 ranks on the row-wise plan (4 collectives), 404 and
# 404 with the group fetch (6); a least-squares fit of ops = step + table_stage x tables x collectives
# over the five gives 207.6 and 9.67 (residuals -37..+22 ops). The counts no longer grow with the peers:
# row-wise 293 at 16 ranks too, the group fetch 404 at 16 ranks in 2 groups and 443, 439 and 434 at 8
# ranks in 4 and 8 groups and 16 in 8 (+35..+57 on the fit: its stages issue more ops per table than a
# flat fetch's, which one slope averages). Counted again on 2026-11-28 at 02:35 UTC, after the optimizer
# step became one update per bank of shards (flexshard.runtime.shards.banked_shards) instead of one per
# table and tier: 190, 247, 253, 364 and 364, each 40 fewer, a fit of 167.6 and 9.67 (below; the counts
# at 16 ranks and in 4 and 8 groups above were not taken again). Earlier
# fits: 207.6 and 9.67 (230, 287, 293, 404, 404), 213.6 and 9.67 (230, 287, 323, 404, 404, before
# the GPU's column joins and two-pass gathers; 395 and 508 at 16 ranks and at 8 groups), 217.5 and 13.4
# (236, 321, 381, 454, 502, 2026-11-26), 243.3 and 19.2 (401, 569, 513, 651, before commit 0697ed2).
# Counted again on 2026-12-07 by experiments/gpu_host_ops.py (the GPU's op choices taken on the CPU by
# flexshard.runtime.device_rules.counted_as_gpu; docs/results/gpu_host_ops.md) on 1, 2, 3, 6 and 9
# tables at 4 and 8 ranks, flat (3 collectives) and group fetch (5). At about 15:00 UTC: 129 to 487 and 208
# to 722 ops, where the terms above priced 9 tables' steps 58 and 119 ops low and 1 table's up to 68
# high: most of a table's ops lie outside its collectives (its dedup, routing, output and their
# autograd; about 45 a table on one rank, where no collective runs). At 15:38 UTC, after the group
# fetch's routing and rail sums stopped issuing ops per table (flexshard.runtime.route, relay): the group
# fetch 219 to 566. Fitted, none negative, as step + table x tables + (stage + table_stage x tables) x
# collectives: 0, 39.63, 35.58 and 0.80 ops (residuals -19.8 to +6.8 ops). The fetch modes have 3 and 5
# collectives only, so a step's fixed ops and a collective's are not told apart: the fit puts them in
# the collectives (unconstrained, -29.8 ops a step and 42.6 a collective).
H100_HOST_S_PER_OP = 25.95e-6  # seconds of host time per aten op of the runtime's step
RUNTIME_STEP_OPS = 0.0  # aten ops per step, whatever its tables and collectives
RUNTIME_TABLE_OPS = 39.63  # aten ops per table per step outside the work around collectives
RUNTIME_STAGE_OPS = 35.58  # aten ops per collective, whatever its tables
RUNTIME_TABLE_STAGE_OPS = 0.80  # aten ops per table per collective
H100_RUNTIME_RATES = replace(
    GPU_ROOFLINE_RATES,
    step_s=RUNTIME_STEP_OPS * H100_HOST_S_PER_OP,
    table_s=RUNTIME_TABLE_OPS * H100_HOST_S_PER_OP,
    stage_s=RUNTIME_STAGE_OPS * H100_HOST_S_PER_OP,
    table_stage_s=RUNTIME_TABLE_STAGE_OPS * H100_HOST_S_PER_OP,
    source="H100: value work at the HBM roofline (3.35 TB/s, assumed); host work measured (aten ops x "
    "25.95 us per op, experiments/local_path_gpu.py --host-batch 2, 2026-11-26; ops counted 2026-12-07)",
)


@dataclass(frozen=True)
class BufferCopies:
    """Copies of each vector value into a send buffer or out of a receive buffer per step, as the runtime
    makes them (:mod:`flexshard.runtime.transfer`, :mod:`flexshard.runtime.relay`): per value a rank
    ``requested`` (its row placed, its gradient packed), per value ``served`` from a warm or flat cold
    shard (its row packed, its gradient joined), and per value of a group fetch's ``group`` work (the
    owner's rows served once per group, the rail peer's fetched rows and its relayed rows and sums)."""

    requested: float
    served: float
    group: float

    @staticmethod
    def of(dims: Any, wire: Any, wire_order: bool = False) -> BufferCopies:
        """The copies of a step whose tables have ``dims`` and whose vectors travel as ``wire``: where every
        table has one dim and the wire is float32, rows are gathered straight into send buffers and the
        relay's rows and sums stay in the buffers they arrive in (:mod:`flexshard.runtime.relay`), and a
        requester whose rows lie in the exchange's wire order (``wire_order``:
        :func:`solvers.schedule.rows_in_wire_order`: every table cold and group fetched, or flat) copies
        none of its own; else every value is copied in and out both ways."""
        one_dim = len({int(d) for d in dims}) == 1
        if one_dim and str(getattr(wire, "value", wire)) == "fp32":
            return BufferCopies(requested=0.0 if wire_order else 2.0, served=1.0, group=0.0)
        return BufferCopies(requested=2.0, served=2.0, group=2.0)


@dataclass(frozen=True)
class StageTime:
    """One collective of the step: its latency in seconds."""

    name: str
    phase: str
    kind: str
    scope: str
    participants: int
    latency_s: float


@dataclass(frozen=True)
class StepTime:
    """Modeled seconds of one training step at its slowest rank, split into latency, bandwidth and local
    work (:func:`solvers.time_model.step_time`)."""

    latency_s: float  # sum over the step's collectives of their latency
    bandwidth_s: float  # bytes over bandwidth, component by component (sum over link classes)
    local_s: float  # lookups, unique rows, rows served and synced times the local rates
    total_s: float  # latency + bandwidth + local, or with ``overlap`` the pipelined step (module doc)
    collectives: int  # collectives per step
    stages: tuple[StageTime, ...]
    bandwidth_by_component: dict[str, float]  # slowest rank: seconds per traffic component
    local_by_piece: dict[str, float]  # slowest rank: seconds per piece of local work
    slowest_rank: int
    per_rank_total_s: np.ndarray  # float64[N]
    overlap: bool = False
    # with ``overlap``: the slowest rank's seconds hidden by running the next batch's input distribution
    # beside the replica sync (the shorter of the two); total = latency + bandwidth + local - overlapped
    overlapped_s: float = 0.0
    latency_source: str = ""  # where the latencies come from (LatencyTable.source)
    rates_source: str = ""  # where the local rates come from (LocalRates.source)
