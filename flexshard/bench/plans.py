"""The strategies the benchmark compares, their plans, and the machine views they are made and priced for.

On FlexShard's runtime: ``flexshard`` (the tier optimizer at ``--budget`` x row-wise memory), ``row_wise``
(its ablation: the row-wise plan with per-rank dedup, every row cold) and ``row_wise_group_dedup``
(:func:`solvers.baselines.row_wise_group_dedup`, every row cold, fetched once per group). Outside it:
``torchrec_row_wise`` (TorchRec's ``EmbeddingCollection`` sharded ``ROW_WISE``, no dedup), priced as the
row-wise plan without dedup in TorchRec's own five collectives (:func:`solvers.schedule.torchrec_schedule`).

``--plan-for probed`` plans for the machine the ranks run on: a quick probe of the launched ranks
(:func:`topology.probe.timing.measure` on their process group) gives a topology with the measured figures.
The predictions are priced on the median of that probe and one after every round (:func:`measured_view`):
one quick probe of ranks on shared cores can read a collective's latency 30% off.
``--plan-for h100`` plans for :func:`topology.presets.h100_cluster` with the same ranks and groups.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from flexshard.bench.data import BenchData
from flexshard.bench.predict import predicted_parts_ms
from flexshard.plan_file import to_dict
from solvers.planner import PlannedStrategy, budget_bytes, make_plan
from solvers.schedule import Stage, torchrec_schedule
from solvers.tier_program import OptimizerConfig
from solvers.time_types import LocalRates
from solvers.types import Plan, Workload
from topology import cluster_view
from topology.presets import h100_cluster
from topology.probe.measurements import Measurements
from topology.views import ClusterView

log = logging.getLogger(__name__)

RUNTIME_STRATEGIES = ("flexshard", "row_wise", "row_wise_group_dedup")
TORCHREC = "torchrec_row_wise"
# timings per message size of each of the bench's quick probes (`flexshard probe --quick` takes 3): on 4
# ranks sharing 2 cores, 3 gave a world all-to-all latency of 0.45-2.5 ms from one probe to the next and
# the step's priced latency 2.8-6.0 ms from one bench run to the next at batch 64 (steps 20.6-23.0 ms);
# 15 gave 0.5-1.1 ms and 3.2-4.5 ms, at 0.8 s a probe (2026-11-27)
PROBE_REPEATS = 15
LABELS = {
    "flexshard": "FlexShard",
    "row_wise": "row-wise ablation (dedup)",
    "row_wise_group_dedup": "row_wise_group_dedup",
    TORCHREC: "TorchRec row-wise",
}


@dataclass
class StrategyPlan:
    """One strategy's plan: the plan file ``document`` (None for TorchRec, which shards by itself), the
    cost model's modeled bytes and the time model's prediction on the running machine (ms)."""

    key: str
    document: dict[str, Any] | None
    modeled_inter_bytes: float
    modeled_intra_bytes: float
    predicted_ms: float  # the time model's step on the running machine
    summary: str
    plan: Plan | None = None  # what the prediction prices (repriced with the rates measured in the rounds)
    predicted_parts_ms: dict[str, float] = field(default_factory=dict)  # predict.predicted_parts_ms


def repriced(
    plans: dict[str, StrategyPlan],
    workload: Workload,
    machine_view: ClusterView,
    rates: LocalRates,
    torchrec_local_s: float | None = None,
    threads_per_core: float = 1.0,
) -> dict[str, StrategyPlan]:
    """``plans`` with their predictions on ``machine_view`` priced again with ``rates`` (and TorchRec's
    with its measured local step ``torchrec_local_s``, :func:`~flexshard.bench.results.thread_cpu_s`), e.g.
    with the rates measured between the rounds; a plan without its :class:`Plan` keeps its prediction.
    ``threads_per_core``: as :func:`~flexshard.bench.predict.predicted_parts_ms` takes it."""
    out = {}
    for key, sp in plans.items():
        if sp.plan is None:
            out[key] = sp
            continue
        local_s = torchrec_local_s if key == TORCHREC else None
        parts = predicted_parts_ms(
            workload,
            machine_view,
            sp.plan,
            rates=rates,
            local_s=local_s,
            threads_per_core=threads_per_core,
            stages=stages_of(key, machine_view),
        )
        out[key] = replace(sp, predicted_ms=parts["total"], predicted_parts_ms=parts)
    return out


def stages_of(key: str, view: ClusterView) -> tuple[Stage, ...] | None:
    """The collectives of strategy ``key``'s step where another implementation than FlexShard's runtime
    runs its plan (TorchRec's: :func:`solvers.schedule.torchrec_schedule`); None for the runtime's."""
    return torchrec_schedule(view) if key == TORCHREC else None


def probe_ranks(groups: int, timeout_s: float, repeats: int = PROBE_REPEATS) -> Measurements:
    """A quick probe of the running job's ranks in ``groups`` consecutive groups, ``repeats`` timings per
    message size (collective: every rank calls it; the same measurements on every rank)."""
    import torch.distributed as dist

    from core.ranks import RankLayout
    from topology.probe.measurements import ProbeConfig
    from topology.probe.timing import measure

    layout = RankLayout.consecutive(dist.get_world_size(), groups, "--groups")
    names = [f"g{k}" for k in range(layout.num_groups)]
    return measure(layout.groups, ProbeConfig.quick(timeout_s=timeout_s, repeats=repeats), group_names=names)


def measured_view(probes: list[Measurements]) -> ClusterView:
    """The view of the running job from its probes: each figure the median over them
    (:func:`topology.probe.median_measurements`)."""
    from topology.probe.measurements import median_measurements
    from topology.probe.results import measured_graph

    return cluster_view(measured_graph(median_measurements(probes), None, name="bench-probe"))


def probed_view(groups: int, timeout_s: float) -> ClusterView:
    """The view of the running job from one quick probe of its ranks (:func:`probe_ranks`; collective)."""
    return measured_view([probe_ranks(groups, timeout_s)])


def h100_view(nproc: int, groups: int) -> ClusterView:
    """H100 nodes (NVLink inside, 400 Gb/s NICs between): ``groups`` nodes of ``nproc / groups`` GPUs."""
    return cluster_view(h100_cluster(groups, nproc // groups))


def file_view(path: str, nproc: int, groups: int) -> ClusterView:
    """The view of the topology file at ``path``; ConfigError (naming ``--plan-for``) unless it has
    ``nproc`` ranks in ``groups`` groups of consecutive ranks, as the benchmark runs them."""
    from core.errors import ConfigError
    from core.ranks import RankLayout
    from topology import load_topology

    view = cluster_view(load_topology(path))
    wanted = RankLayout.consecutive(nproc, groups, "--groups").groups
    if view.num_ranks != nproc or [list(g) for g in view.groups] != [list(g) for g in wanted]:
        raise ConfigError(
            f"--plan-for {path}: its {view.num_ranks} ranks in {view.num_groups} "
            f"group{'s' if view.num_groups != 1 else ''} "
            f"({[list(g) for g in view.groups]}) are not the run's {nproc} ranks in {groups} groups of "
            "consecutive ranks"
        )
    return view


def plan_view(plan_for: str, machine: ClusterView | None, nproc: int, groups: int) -> ClusterView:
    """The view ``--plan-for`` names: the probed ``machine``, the H100 shape or a topology file's."""
    if plan_for == "probed":
        assert machine is not None
        return machine
    if plan_for == "h100":
        return h100_view(nproc, groups)
    return file_view(plan_for, nproc, groups)


def plan_for_text(plan_for: str) -> str:
    """What the plans were made for, in words."""
    if plan_for == "probed":
        return "this machine as a quick probe measured it"
    return "the H100 preset shape" if plan_for == "h100" else f"the topology in {plan_for}"


def view_figures(view: ClusterView) -> dict[str, float]:
    """The median per-rank bandwidths of ``view`` (GB/s = 1e9 B/s) and its latencies (us)."""
    return {
        "intra_GBps": float(np.median(view.intra_bw_Bps)) / 1e9,
        "inter_GBps": float(np.median(view.inter_bw_Bps)) / 1e9,
        "intra_latency_us": float(np.median(view.intra_latency_s)) * 1e6,
        "inter_latency_us": float(np.median(view.inter_latency_s)) * 1e6,
    }


def _summary(planned: PlannedStrategy) -> str:
    tp = planned.plan.tables
    hot, warm, cold = (sum(getattr(t, f) for t in tp) for f in ("hot_rows", "warm_rows", "cold_rows"))
    fetch = "/".join(sorted({t.fetch.value for t in tp}))
    chosen = planned.plan.solver.get("chosen")
    return f"hot {hot:,} / warm {warm:,} / cold {cold:,} rows, fetch {fetch}" + (
        f" ({chosen})" if chosen else ""
    )


def make_plans(
    data: BenchData,
    plan_view: ClusterView,
    machine_view: ClusterView,
    budget_x: float,
    torchrec: bool,
    objective: str = "step",
    rates: LocalRates | None = None,
    gpu_host: str = "fused",
    threads_per_core: float = 1.0,
) -> dict[str, StrategyPlan]:
    """Every strategy's plan for ``plan_view``, priced on ``machine_view`` (the running machine), in
    :data:`RUNTIME_STRATEGIES` order then TorchRec's; FlexShard's planner minimises ``objective`` (``step``
    time or ``bytes``); ``gpu_host``: the host work the plans price on a GPU preset
    (:meth:`~solvers.time_types.LocalRates.for_view`); ``rates``: the running machine's local-work rates
    (None: the view's), which the plans for the running machine (``plan_view`` is ``machine_view``) are
    also made with, so that the planner picks by the step the prediction prices (TorchRec's too, until
    :func:`repriced` prices it with its own measured local work); ``threads_per_core``:
    the job's torch threads on this host per core (:func:`~flexshard.bench.predict.predicted_parts_ms`)."""
    w = data.workload
    row_wise_budget = budget_bytes(w, plan_view, 1.0)
    here = plan_view is machine_view  # --plan-for probed: priced as the running machine's rates price it
    cfg = OptimizerConfig(step_time=objective == "step", gpu_host=gpu_host, rates=rates if here else None)
    made = {
        "flexshard": make_plan("flexshard", w, plan_view, budget_bytes(w, plan_view, budget_x), config=cfg),
        "row_wise": make_plan("row_wise", w, plan_view, row_wise_budget, dedup=True, config=cfg),
        "row_wise_group_dedup": make_plan(
            "row_wise_group_dedup", w, plan_view, row_wise_budget, dedup=True, config=cfg
        ),
    }
    if torchrec:
        made[TORCHREC] = make_plan("row_wise", w, plan_view, row_wise_budget, dedup=False, config=cfg)
    out = {}
    for key, planned in made.items():
        document = None
        if key != TORCHREC:
            document = to_dict(planned.plan, w, plan_view, planned.report, f"bench-{w.name}", data.orders)
        parts = predicted_parts_ms(
            w,
            machine_view,
            planned.plan,
            rates=rates,
            threads_per_core=threads_per_core,
            stages=stages_of(key, machine_view),
        )
        out[key] = StrategyPlan(
            key,
            document,
            float(planned.report.inter_group_bytes),
            float(planned.report.intra_group_bytes),
            parts["total"],
            _summary(planned),
            planned.plan,
            parts,
        )
        log.debug(f"bench: {key}: {out[key].summary}")
    return out
