"""TorchRec's own planner (torchrec 1.8.0, CPU) on FlexShard's tables and topology, next to FlexShard.

Method. Each scenario (workload, ``topology`` preset, per-GPU budget as a multiple of row-wise memory)
is translated into TorchRec's planner inputs:

* every ``TableSpec`` becomes an ``EmbeddingConfig`` (rows, dim, fp32) of an ``EmbeddingCollection``
  on the meta device (sequence tables, unpooled; one collection per embedding dim, because a
  collection needs one dim for all its tables), sharded by ``EmbeddingCollectionSharder``; each
  weight is tagged with TorchRec's ``RowWiseAdagrad`` so its storage estimate adds one fp32 per row,
  as ``TableSpec.optimizer_bytes_per_row`` does;
* ``ParameterConstraints(pooling_factors=[ids_per_sample], compute_kernels=["fused", "dense"])``:
  the mean ids per sample, HBM-resident kernels only (no UVM / SSD offload, as our model assumes);
  ``sharding_types`` is left free or restricted to one type;
* ``Topology(world_size=N, local_world_size=group size, compute_device="cuda", hbm_cap=budget,
  intra_host_bw, inter_host_bw)`` from the ``ClusterView`` (bandwidths converted from bytes/s to
  TorchRec's bytes/ms) and ``batch_size`` = our batch per GPU.

``EmbeddingShardingPlanner.plan`` runs with its default enumerator, proposers, greedy partitioner and
15% heuristic HBM reservation. Its best plan (``planner._best_plan``) gives each table's sharding
type, kernel and ranks, and each shard's ``Perf`` and ``Storage``; the per-rank estimated
communication time is the sum of ``fwd_comms + bwd_comms`` of the shards on that rank (milliseconds,
as TorchRec's bandwidths are bytes/ms). Next to it the FlexShard cost model (``solvers.cost_model
.evaluate``) prices FlexShard, our row-wise and table-wise baselines (``make_plan``) and TorchRec's
plan itself where it maps onto our tiers (row-wise -> cold tier split evenly over all ranks,
table-wise -> cold tier on the one owner, data-parallel -> hot tier; column-wise has no
equivalent). Both models are estimates; nothing is measured and no GPU is used. Run:

    .venv/bin/python experiments/torchrec_planner.py [--quick] [--no-write]

Writes docs/results/torchrec_planner.md and docs/results/torchrec_planner.png and prints the tables.
``--quick`` plans the default on ``h100:2`` only (free and row-wise only) and skips FlexShard's
integer finish.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import study

from core.errors import PlannerError
from flexshard import workloads
from flexshard.report import human_bytes
from solvers.baselines import row_wise_table
from solvers.cost_model import evaluate, table_plan, uniform_shares
from solvers.placement import spread_heads
from solvers.planner import budget_bytes, make_plan
from solvers.types import CostReport, Plan, TablePlan, Workload
from topology import ClusterView, cluster_view, from_preset

TORCHREC_MISSING = "torchrec is not installed: run scripts/setup_torchrec.sh"
KERNELS = ("fused", "dense")  # HBM-resident: fused for sharded tables, dense for data-parallel
MAPPABLE = ("row_wise", "table_wise", "data_parallel")
FREE_TYPES = ("data_parallel", "table_wise", "column_wise", "row_wise")  # EmbeddingCollectionSharder's
OURS = ("flexshard", "row_wise", "table_wise")
LABELS = {"flexshard": "FlexShard", "row_wise": "row-wise", "table_wise": "table-wise"}
MS_PER_S = 1e3
H100_HBM_BYTES = 80 * 2**30
SWEEP_BUDGETS = (1.0, 1.25, 1.5, 2.0, 4.0, 8.0)


def import_torchrec() -> SimpleNamespace:
    """TorchRec's planner API, imported lazily; ImportError with a one-line hint when absent."""
    try:
        import torch
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed.embedding import EmbeddingCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
        from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
        from torchrec.optim import RowWiseAdagrad
    except ImportError as exc:
        raise ImportError(TORCHREC_MISSING) from exc
    for name in ("torchrec", "torchrec.distributed.planner"):
        logging.getLogger(name).setLevel(logging.ERROR)  # Topology / reservation / kernel-filter chatter
    warnings.filterwarnings("ignore", message="HeuristicalStorageReservation", category=FutureWarning)
    return SimpleNamespace(
        torch=torch,
        EmbeddingCollection=EmbeddingCollection,
        EmbeddingConfig=EmbeddingConfig,
        EmbeddingCollectionSharder=EmbeddingCollectionSharder,
        EmbeddingShardingPlanner=EmbeddingShardingPlanner,
        ParameterConstraints=ParameterConstraints,
        Topology=Topology,
        HeuristicalStorageReservation=HeuristicalStorageReservation,
        RowWiseAdagrad=RowWiseAdagrad,
    )


# --- scenarios ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    label: str
    workload: str  # "default" or a data set path
    preset: str  # topology preset, e.g. "h100:8"
    budget_x: float
    sharding_types: tuple[str, ...] | None = None  # None: TorchRec's free choice
    reservation: float = 0.15  # TorchRec's heuristic HBM reservation (its default)
    hbm_bytes: float | None = None  # per-GPU budget in bytes, instead of budget_x (e.g. the whole HBM)

    def budget(self, workload: Workload, view: ClusterView) -> float:
        return self.hbm_bytes if self.hbm_bytes is not None else budget_bytes(workload, view, self.budget_x)


def scenarios(quick: bool) -> list[Scenario]:
    """The scenarios of the per-scenario tables (free, restricted, relaxed, other cluster, real data)."""
    if quick:
        return [
            Scenario("default, h100:2, 2x", "default", "h100:2", 2.0),
            Scenario("default, h100:2, 2x, row-wise only", "default", "h100:2", 2.0, ("row_wise",)),
        ]
    beauty = workloads.data_root() / "amazon-yelp-sequences" / "Beauty.txt"
    out = [
        Scenario("default, h100:8, 2x", "default", "h100:8", 2.0),
        Scenario("default, h100:8, 2x, row-wise only", "default", "h100:8", 2.0, ("row_wise",)),
        Scenario("default, h100:8, 2x, table-wise only", "default", "h100:8", 2.0, ("table_wise",)),
        Scenario("default, h100:8, 1x, no reservation", "default", "h100:8", 1.0, reservation=0.0),
        Scenario("default, h100:2, 2x", "default", "h100:2", 2.0),
    ]
    if beauty.exists():
        out += [
            Scenario("Beauty, h100:8, 2x", str(beauty), "h100:8", 2.0),
            Scenario("Beauty, h100:8, 80 GiB", str(beauty), "h100:8", 0.0, hbm_bytes=float(H100_HBM_BYTES)),
        ]
    else:
        study.note_missing(beauty, "the real-data scenarios")
    return out


def sweep(quick: bool) -> list[Scenario]:
    """TorchRec's free plan on the default over per-GPU budgets (where does it first find a plan?)."""
    preset, budgets = ("h100:2", (1.0,)) if quick else ("h100:8", SWEEP_BUDGETS)
    return [Scenario(f"default, {preset}, {x:g}x", "default", preset, x) for x in budgets]


def load(scenario: Scenario) -> tuple[Workload, ClusterView]:
    w = (
        workloads.default_workload()
        if scenario.workload == "default"
        else workloads.load_workload(scenario.workload)
    )
    return w, cluster_view(from_preset(scenario.preset))


# --- TorchRec -----------------------------------------------------------------------------------------


def torchrec_module(tr: SimpleNamespace, workload: Workload):
    """One meta-device EmbeddingCollection per embedding dim (a collection needs one dim), in a ModuleDict."""
    dims = sorted({t.dim for t in workload.tables})
    module = tr.torch.nn.ModuleDict(
        {
            f"dim{d}": tr.EmbeddingCollection(
                tables=[
                    tr.EmbeddingConfig(
                        name=t.name, embedding_dim=d, num_embeddings=t.num_rows, feature_names=[t.name]
                    )
                    for t in workload.tables
                    if t.dim == d
                ],
                device=tr.torch.device("meta"),
            )
            for d in dims
        }
    )
    for p in module.parameters():
        p._optimizer_classes = [tr.RowWiseAdagrad]  # storage estimate: + 1 fp32 per row, as ours
    return module


def torchrec_topology(tr: SimpleNamespace, view: ClusterView, hbm_cap: float):
    """TorchRec Topology of a uniform ClusterView: bandwidths per GPU, bytes/s -> bytes/ms."""
    g = view.uniform_group_size
    if g is None:
        raise PlannerError("torchrec_planner: TorchRec's Topology needs groups of equal size")
    return tr.Topology(
        world_size=view.num_ranks,
        local_world_size=g,
        compute_device="cuda",
        hbm_cap=int(hbm_cap),
        intra_host_bw=float(view.intra_bw_Bps.min()) / MS_PER_S,
        inter_host_bw=float(view.inter_bw_Bps.min()) / MS_PER_S,
    )


def torchrec_constraints(tr: SimpleNamespace, workload: Workload, sharding_types: tuple[str, ...] | None):
    return {
        t.name: tr.ParameterConstraints(
            sharding_types=list(sharding_types) if sharding_types else None,
            compute_kernels=list(KERNELS),
            pooling_factors=[float(t.ids_per_sample)],
        )
        for t in workload.tables
    }


@dataclass
class TorchRecResult:
    ok: bool
    seconds: float
    error: str = ""
    tables: dict[str, dict] = field(default_factory=dict)  # name -> sharding_type, kernel, ranks
    fwd_comms_ms: np.ndarray | None = None  # [N] per rank, summed over its shards
    bwd_comms_ms: np.ndarray | None = None
    input_dist_ms: np.ndarray | None = None
    total_ms: np.ndarray | None = None  # Perf.total: compute + comms (+ prefetch), what it minimises
    hbm_bytes: np.ndarray | None = None

    @property
    def comm_ms(self) -> np.ndarray:
        return self.fwd_comms_ms + self.bwd_comms_ms


def run_torchrec(tr: SimpleNamespace, workload: Workload, view: ClusterView, s: Scenario) -> TorchRecResult:
    budget = s.budget(workload, view)
    with warnings.catch_warnings():  # its FutureWarning recommends another policy; we keep the default
        warnings.simplefilter("ignore", FutureWarning)
        reservation = tr.HeuristicalStorageReservation(percentage=s.reservation)
    planner = tr.EmbeddingShardingPlanner(
        topology=torchrec_topology(tr, view, budget),
        batch_size=workload.batch_size_per_gpu,
        constraints=torchrec_constraints(tr, workload, s.sharding_types),
        storage_reservation=reservation,
        debug=False,
    )
    t0 = time.perf_counter()
    try:
        planner.plan(torchrec_module(tr, workload), [tr.EmbeddingCollectionSharder()])
    except Exception as exc:  # TorchRec raises PlannerError subclasses; report any failure as data
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return TorchRecResult(False, time.perf_counter() - t0, f"{type(exc).__name__}: {first[:300]}")
    return summarize(planner._best_plan, view.num_ranks, time.perf_counter() - t0)


def summarize(best_plan: list, n: int, seconds: float) -> TorchRecResult:
    """Per-table choices and per-rank sums of the shards' Perf and Storage of TorchRec's best plan."""
    shards = [(so, sh) for so in best_plan for sh in so.shards]
    ranks = np.array([sh.rank for _, sh in shards], dtype=np.int64)

    def per_rank(values: list[float]) -> np.ndarray:
        return np.bincount(ranks, weights=np.asarray(values, dtype=np.float64), minlength=n)

    return TorchRecResult(
        ok=True,
        seconds=seconds,
        tables={
            so.name: {
                "sharding_type": so.sharding_type,
                "kernel": so.compute_kernel,
                "ranks": sorted({sh.rank for sh in so.shards}),
            }
            for so in best_plan
        },
        fwd_comms_ms=per_rank([sh.perf.fwd_comms for _, sh in shards]),
        bwd_comms_ms=per_rank([sh.perf.bwd_comms for _, sh in shards]),
        input_dist_ms=per_rank([sh.perf.input_dist_comms for _, sh in shards]),
        total_ms=per_rank([sh.perf.total for _, sh in shards]),
        hbm_bytes=per_rank([sh.storage.hbm for _, sh in shards]),
    )


# --- our cost model -----------------------------------------------------------------------------------


def torchrec_plan_as_ours(
    workload: Workload, view: ClusterView, tables: dict[str, dict], dedup: bool, budget: float
) -> Plan | None:
    """TorchRec's plan as FlexShard tiers, or None when a table's sharding type has no equivalent."""
    if any(tables[t.name]["sharding_type"] not in MAPPABLE for t in workload.tables):
        return None
    warm_share, _ = uniform_shares(view)
    out = []
    for t in workload.tables:
        kind, ranks = tables[t.name]["sharding_type"], tables[t.name]["ranks"]
        if kind == "table_wise":
            owner = np.zeros(view.num_ranks)
            owner[ranks[0]] = 1.0
            out.append(TablePlan(t.name, 0, 0, t.num_rows, warm_share, owner))
        elif kind == "row_wise":
            out.append(row_wise_table(t, view))
        else:
            out.append(table_plan(t, view, t.num_rows, 0))
    return spread_heads(workload, view, Plan("torchrec", tuple(out), dedup, budget_bytes=budget))


def price_ours(workload: Workload, view: ClusterView, budget: float, dedup: bool, quick: bool) -> dict:
    """Plans and CostReports of OURS (None where infeasible)."""
    out = {}
    for strategy in OURS:
        try:
            config = study.optimizer_config(quick)
            out[strategy] = make_plan(strategy, workload, view, budget, dedup, config=config)
        except PlannerError:
            out[strategy] = None
    return out


def run_scenario(tr: SimpleNamespace, s: Scenario, quick: bool) -> dict:
    w, view = load(s)
    budget = s.budget(w, view)
    print(f"[{s.label}] TorchRec planner on {view.num_ranks} ranks ...", file=sys.stderr, flush=True)
    res = run_torchrec(tr, w, view, s)
    print(
        f"[{s.label}] TorchRec {'planned' if res.ok else 'failed'} in {res.seconds:.1f} s; our model ...",
        file=sys.stderr,
        flush=True,
    )
    rec: dict = {"scenario": s, "workload": w, "view": view, "budget": budget, "torchrec": res}
    for dedup in (False, True):
        plan = torchrec_plan_as_ours(w, view, res.tables, dedup, budget) if res.ok else None
        rec[("torchrec_ours", dedup)] = evaluate(w, view, plan) if plan is not None else None
        rec[("ours", dedup)] = price_ours(w, view, budget, dedup, quick) if s.sharding_types is None else {}
    return rec


# --- output -------------------------------------------------------------------------------------------


def rank_ranges(ranks: list[int]) -> str:
    """'0-63', '5', '0-7, 16' from sorted ranks."""
    r = np.asarray(ranks, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(r) != 1) + 1
    runs = np.split(r, breaks)
    return ", ".join(f"{x[0]}" if x.size == 1 else f"{x[0]}-{x[-1]}" for x in runs)


def budget_text(rec: dict) -> str:
    s: Scenario = rec["scenario"]
    if s.hbm_bytes is not None:
        return f"{human_bytes(rec['budget'])} (the whole HBM, not a multiple of row-wise)"
    return f"{s.budget_x:g}x row-wise = {human_bytes(rec['budget'])}"


def ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f} ms"


def summary_rows(rec: dict) -> list[tuple[str, str, str, float | None, float | None, float | None]]:
    """(plan, estimator, dedup, max-rank comm ms, mean comm ms, memory per GPU) rows of one scenario."""
    res: TorchRecResult = rec["torchrec"]
    rows = []
    if res.ok:
        rows.append(
            (
                "TorchRec planner",
                "TorchRec (fwd+bwd comms)",
                "off",
                float(res.comm_ms.max()),
                float(res.comm_ms.mean()),
                float(res.hbm_bytes.max()),
            )
        )
    else:
        rows.append(("TorchRec planner", "TorchRec", "off", None, None, None))
    for dedup in (False, True):
        rep: CostReport | None = rec[("torchrec_ours", dedup)]
        if res.ok:
            rows.append(("TorchRec planner's plan", "ours", _onoff(dedup), *_ours_cells(rep)))
        for strategy, planned in rec[("ours", dedup)].items():
            rows.append(
                (f"our {LABELS[strategy]}", "ours", _onoff(dedup), *_ours_cells(planned and planned.report))
            )
    return rows


def _onoff(dedup: bool) -> str:
    return "on" if dedup else "off"


def _ours_cells(rep: CostReport | None) -> tuple[float | None, float | None, float | None]:
    if rep is None:
        return None, None, None
    return rep.modeled_time_s * MS_PER_S, float(rep.time_s.mean()) * MS_PER_S, rep.memory_per_gpu_bytes


def scenario_md(rec: dict) -> str:
    s: Scenario = rec["scenario"]
    res: TorchRecResult = rec["torchrec"]
    w: Workload = rec["workload"]
    view: ClusterView = rec["view"]
    types = ", ".join(s.sharding_types) if s.sharding_types else f"free ({', '.join(FREE_TYPES)})"
    lines = [
        f"### {s.label}",
        "",
        f"Workload `{w.name}` ({len(w.tables)} tables, {w.num_rows:,} rows, batch {w.batch_size_per_gpu} "
        f"per GPU) on `{s.preset}` ({view.num_ranks} GPUs, {view.uniform_group_size} per node); budget "
        f"{budget_text(rec)} per GPU (TorchRec `hbm_cap`); TorchRec "
        f"sharding types: {types}; HBM reservation {s.reservation:.0%}. TorchRec planning took "
        f"{res.seconds:.1f} s.",
        "",
    ]
    if not res.ok:
        lines += [f"**TorchRec's planner found no plan**: `{res.error}`", ""]
    fs = {d: rec[("ours", d)].get("flexshard") for d in (False, True)}
    header = ["table", "rows", "dim", "ids/sample", "TorchRec type", "kernel", "ranks"]
    header += [
        f"FlexShard hot / warm / cold rows (dedup {_onoff(d)})" for d in (False, True) if fs[d] is not None
    ]
    rows = []
    for t in w.tables:
        tt = res.tables.get(t.name, {})
        cells = [tt.get("sharding_type", "-"), tt.get("kernel", "-"), rank_ranges(tt["ranks"]) if tt else "-"]
        for d in (False, True):
            if fs[d] is not None:
                tp = next(p for p in fs[d].plan.tables if p.name == t.name)
                cells.append(f"{tp.hot_rows:,} / {tp.warm_rows:,} / {tp.cold_rows:,}")
        rows.append([t.name, f"{t.num_rows:,}", t.dim, f"{t.ids_per_sample:.1f}", *cells])
    lines.append(study.md_table(header, rows))
    lines += ["", summary_md([rec], with_scenario=False)]
    if res.ok:
        lines += [
            "",
            f"TorchRec per rank: fwd comms max {res.fwd_comms_ms.max():.3f} ms, bwd comms max "
            f"{res.bwd_comms_ms.max():.3f} ms, input-dist comms max {res.input_dist_ms.max():.3f} ms (not in "
            f"`Perf.total`), `Perf.total` max {res.total_ms.max():.3f} ms (the rating its planner minimises; "
            f"includes compute).",
        ]
    return "\n".join(lines)


def summary_md(recs: list[dict], with_scenario: bool = True) -> str:
    header = ["strategy / planner", "estimator", "dedup", "est. comm time, max rank", "mean rank"]
    header = (["scenario"] if with_scenario else []) + header + ["memory per GPU"]
    rows = []
    for rec in recs:
        for plan, est, dedup, mx, mean, mem in summary_rows(rec):
            if mx is None and plan.startswith("our") and "table-wise" in plan:
                cells = ["infeasible (a table is larger than the budget)", "", ""]
            elif mx is None and plan == "TorchRec planner's plan":
                cells = ["n/a (column-wise has no equivalent)", "", ""]
            elif mx is None:
                cells = ["no plan", "", ""]
            else:
                cells = [ms(mx), ms(mean), human_bytes(mem)]
            prefix = [rec["scenario"].label] if with_scenario else []
            rows.append([*prefix, plan, est, dedup, *cells])
    return study.md_table(header, rows)


def choice_text(res: TorchRecResult) -> str:
    """'6 row_wise, 2 data_parallel' for a plan, or the planner's error."""
    if not res.ok:
        return "no plan: " + res.error.split(":", 1)[-1].strip().rstrip(".")
    kinds, counts = np.unique([t["sharding_type"] for t in res.tables.values()], return_counts=True)
    return ", ".join(f"{c} {k}" for k, c in zip(kinds, counts, strict=True))


def sweep_md(recs: list[dict]) -> str:
    header = ["budget", "per GPU", "TorchRec's choice", "TorchRec est., max rank", "TorchRec HBM, max rank"]
    header += ["TorchRec's plan, ours (dedup off / on)", "our row-wise (off / on)", "FlexShard (off / on)"]
    rows = []
    for r in recs:
        res: TorchRecResult = r["torchrec"]
        est = f"{res.comm_ms.max():.3f} ms" if res.ok else ""
        hbm = human_bytes(float(res.hbm_bytes.max())) if res.ok else ""
        pairs = [
            (r[("torchrec_ours", False)], r[("torchrec_ours", True)]),
            (_rep(r, "row_wise", False), _rep(r, "row_wise", True)),
            (_rep(r, "flexshard", False), _rep(r, "flexshard", True)),
        ]
        cells = [" / ".join(ms(None if rep is None else _t(rep)) for rep in pair) for pair in pairs]
        budget = [f"{r['scenario'].budget_x:g}x", human_bytes(r["budget"])]
        rows.append([*budget, choice_text(res), est, hbm, *cells])
    return study.md_table(header, rows)


def figure(recs: list[dict], path: Path) -> None:
    """Max-rank estimated comm time per scenario with a free TorchRec plan: five bars each."""
    recs = [r for r in recs if r["torchrec"].ok and r["scenario"].sharding_types is None]
    bars = [
        ("TorchRec planner, TorchRec's estimate", "tab:blue", lambda r: float(r["torchrec"].comm_ms.max())),
        ("TorchRec's plan, our model, dedup off", "tab:cyan", lambda r: _t(r[("torchrec_ours", False)])),
        ("TorchRec's plan, our model, dedup on", "paleturquoise", lambda r: _t(r[("torchrec_ours", True)])),
        ("our row-wise, dedup off", "dimgray", lambda r: _t(_rep(r, "row_wise", False))),
        ("our row-wise, dedup on", "silver", lambda r: _t(_rep(r, "row_wise", True))),
        ("FlexShard, dedup off", "tab:red", lambda r: _t(_rep(r, "flexshard", False))),
        ("FlexShard, dedup on", "salmon", lambda r: _t(_rep(r, "flexshard", True))),
    ]
    fig, axes = study.subplots(1, len(recs), figsize=(4.2 * len(recs) + 1, 5.0), squeeze=False)
    for ax, r in zip(axes[0], recs, strict=True):  # one panel per scenario: scales differ by 100x
        ys = np.array([get(r) for _, _, get in bars], dtype=np.float64)
        x = np.arange(len(bars))
        ax.bar(x, np.nan_to_num(ys), 0.8, color=[c for _, c, _ in bars], label=[lab for lab, _, _ in bars])
        for p, y in zip(x, ys, strict=True):
            ax.text(
                p,
                np.nan_to_num(y),
                "n/a" if np.isnan(y) else f"{y:.2f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
        ax.set_xticks([])
        ax.set_title(r["scenario"].label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("estimated comm time per iteration,\nslowest rank (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("TorchRec 1.8 planner vs FlexShard: two estimators, no measurement")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    study.save_figure(fig, path)


def _rep(rec: dict, strategy: str, dedup: bool) -> CostReport | None:
    planned = rec[("ours", dedup)].get(strategy)
    return planned.report if planned is not None else None


def _t(rep: CostReport | None) -> float:
    return np.nan if rep is None else rep.modeled_time_s * MS_PER_S


ESTIMATOR_MD = """\
## What TorchRec's estimator counts

TorchRec 1.8.0's `EmbeddingPerfEstimator` (`torchrec/distributed/planner/shard_estimators.py`) delegates
to the per-sharding-type evaluators in `torchrec/distributed/planner/estimator/estimator.py`; bandwidths
come from `BasicCommsBandwidths.get_bw` in `torchrec/distributed/planner/types.py` (bytes/ms, so `Perf`
is in ms). For a sequence (unpooled) table with `B` samples per rank, `L` ids per sample and dim `d`
(fp32):

* **row-wise** (`RowWiseEvaluator`): forward comms = `B L d 4` bytes (reduce-scatter); backward comms =
  the same bytes (all-gather) plus a "batched copy" of `2.455 B L d 4` bytes at HBM bandwidth. Each of
  the table's `N` shards is charged this whole amount, so every rank pays for every lookup of its own
  batch. The bandwidth is `inter_host_bw` as soon as `world_size > local_world_size`, so the local
  (1/N) and intra-node ((g-1)/N) parts are priced at NIC speed too;
* **table-wise** (`TableWiseEvaluator`): `B N L d 4` bytes (every rank's lookups) forward and again
  backward, all-to-all at `inter_host_bw`, charged to the owner;
* **data-parallel** (`DataParallelEvaluator`): no forward comms; backward = a dense all-reduce of the
  whole table (`rows d 4 (2m-1)/m` bytes with `m = min(nodes, 2)`, at `inter_host_bw x
  local_world_size`, doubled above 2 nodes) plus optimizer kernels (`9.22 x` table bytes at HBM
  bandwidth);
* **column-wise** is priced as table-wise on each column shard.

It has no notion of access skew or of per-rank id deduplication (every lookup is paid; the sharder's
`use_index_dedup` is off by default). Ids are not in `fwd_comms` / `bwd_comms`: the id all-to-all is a
separate `input_dist_comms` (`B L N 8` bytes per shard), which `Perf.total`, and so the planner, leave
out. Each collective is priced at one bandwidth instead of splitting intra- and inter-node bytes. The
planner minimises the slowest rank's `Perf.total` (comms + embedding compute; `NoopPerfModel`) subject
to its HBM estimate (weights, row-wise Adagrad state, input/output buffers) fitting `hbm_cap` minus a
15% reservation. Our cost model ([docs/cost_model.md](../cost_model.md)) counts expected bytes per rank
and link class (ids, embeddings, gradients, replica sync), prices intra- and inter-group bytes at their
own bandwidths, deduplicates ids per rank when dedup is on, and reads the row-access histograms.
"""

SETUP_MD = """\
## Set-up

* Tables: each `TableSpec` becomes an `EmbeddingConfig` (rows, dim, fp32) of a meta-device
  `EmbeddingCollection`, one collection per dim (a collection needs one dim), sharded by
  `EmbeddingCollectionSharder`. Weights are tagged with `RowWiseAdagrad`, so the storage estimate adds
  one fp32 per row, as ours does.
* `ParameterConstraints(pooling_factors=[mean ids per sample], compute_kernels=["fused", "dense"])`:
  HBM-resident kernels only (no UVM caching or SSD offload, which our model does not have);
  `sharding_types` free unless the scenario says otherwise. `EmbeddingCollectionSharder` offers
  data_parallel, table_wise, column_wise and row_wise (no table_row_wise / 2D for sequence tables).
* `Topology(world_size=N, local_world_size=8, compute_device="cuda", hbm_cap=budget,
  intra_host_bw=450e9/1e3, inter_host_bw=50e9/1e3)`: our `h100` preset's per-GPU NVLink and NIC
  bandwidths in TorchRec's bytes/ms. `hbm_cap` is our per-GPU budget (a multiple of row-wise memory,
  as in the other studies); `batch_size=512` per rank, as ours.
* `EmbeddingShardingPlanner(...).plan(module, [EmbeddingCollectionSharder()])` with TorchRec's default
  proposers, greedy partitioner and 15% heuristic HBM reservation. A rank's comm time is the sum of
  `fwd_comms + bwd_comms` over the shards of `planner._best_plan` on that rank.
* Ours: `make_plan` for FlexShard, row-wise and table-wise at the same budget, priced by `evaluate`
  (modeled time of the slowest rank, latency excluded), with dedup off (as TorchRec's default) and on
  (FlexShard's default). TorchRec's plan is priced by `evaluate` after mapping row-wise -> every row
  cold, split evenly over all ranks; table-wise -> cold on its one rank; data-parallel -> every row hot
  (replica sync as in our plans: sparse). Column-wise has no equivalent in our plan space.
"""

CAVEAT_MD = """\
**Every number here is an estimate from one of two analytic models (TorchRec 1.8.0's planner estimator
and FlexShard's cost model). Nothing is measured and no GPU is involved.** The two models count
different things (next sections), so compare plans within one estimator; the rows "TorchRec planner's
plan, ours" price TorchRec's plan with our model and are the like-for-like comparison.
"""


def render(recs: list[dict], budget_recs: list[dict], command: str, runtime_s: float, versions: str) -> str:
    headline = headline_md(recs)
    preset = budget_recs[0]["scenario"].preset if budget_recs else ""
    return "\n".join(
        [
            "# TorchRec's planner on FlexShard's tables and topology (issue 5(b))",
            "",
            CAVEAT_MD,
            study.generated(command, runtime_s, versions),
            "",
            SETUP_MD,
            ESTIMATOR_MD,
            "## Headline",
            "",
            headline,
            "",
            "![TorchRec planner vs FlexShard](torchrec_planner.png)",
            "",
            "## Summary",
            "",
            summary_md(recs),
            "",
            f"## Budget sweep: default workload on `{preset}`, TorchRec free",
            "",
            "TorchRec's `hbm_cap` and our budget are the same bytes per GPU. TorchRec's HBM estimate adds "
            "input/output buffers to the weights and optimizer state and reserves 15%, so it needs more than "
            "row-wise memory.",
            "",
            sweep_md(budget_recs),
            "",
            "## Per scenario",
            "",
            "\n\n".join(scenario_md(r) for r in recs),
            "",
        ]
    )


def headline_md(recs: list[dict]) -> str:
    """Bullets generated from the first free scenario that TorchRec planned."""
    rec = next((r for r in recs if r["torchrec"].ok and r["scenario"].sharding_types is None), None)
    if rec is None:
        return "* TorchRec's planner found no plan in any free scenario."
    res: TorchRecResult = rec["torchrec"]
    kinds: dict[str, list[str]] = {}
    for name, t in res.tables.items():
        kinds.setdefault(t["sharding_type"], []).append(name)
    tr_ours = {d: rec[("torchrec_ours", d)] for d in (False, True)}
    rw = {d: _rep(rec, "row_wise", d) for d in (False, True)}
    fs = {d: _rep(rec, "flexshard", d) for d in (False, True)}
    lines = [
        f"* **{rec['scenario'].label}**: TorchRec's planner chooses "
        + "; ".join(f"{k} for {', '.join(v)}" for k, v in kinds.items())
        + f". Its own estimate of the slowest rank's comm time is {res.comm_ms.max():.3f} ms "
        f"(mean {res.comm_ms.mean():.3f} ms), with {human_bytes(res.hbm_bytes.max())} HBM on the fullest "
        "rank.",
    ]
    if tr_ours[False] is not None:
        lines.append(
            f"* Our model prices the same plan at {_t(tr_ours[False]):.3f} ms with dedup off and "
            f"{_t(tr_ours[True]):.3f} ms with dedup on; our row-wise is {_t(rw[False]):.3f} / "
            f"{_t(rw[True]):.3f} ms "
            f"and FlexShard {_t(fs[False]):.3f} / {_t(fs[True]):.3f} ms (dedup off / on), i.e. FlexShard is "
            f"{_t(tr_ours[False]) / _t(fs[False]):.2f}x below TorchRec's plan with dedup off and "
            f"{_t(tr_ours[True]) / _t(fs[True]):.2f}x with dedup on, in our model."
        )
    for r in recs:
        if not r["torchrec"].ok:
            lines.append(f"* {r['scenario'].label}: no TorchRec plan (`{r['torchrec'].error[:160]}`).")
    return "\n".join(lines)


def print_tables(recs: list[dict], budget_recs: list[dict]) -> None:
    print(summary_md(recs))
    print()
    print(sweep_md(budget_recs))
    for r in recs:
        print()
        print(scenario_md(r))


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick="h100:2 only, no integer finish (under a minute)")
    args = p.parse_args(argv)
    try:
        tr = import_torchrec()
    except ImportError as exc:
        print(exc, file=sys.stderr)
        return 2
    logging.getLogger().setLevel(logging.ERROR)  # TorchRec's stats log "Sharding spec not found" on root
    t0 = time.perf_counter()
    recs = [run_scenario(tr, s, args.quick) for s in scenarios(args.quick)]
    budget_recs = [run_scenario(tr, s, args.quick) for s in sweep(args.quick)]
    runtime = time.perf_counter() - t0
    print_tables(recs, budget_recs)
    if not args.no_write:
        command = study.command(__file__, *(["--quick"] if args.quick else []))
        versions = study.versions("torch", "torchrec", "fbgemm_gpu_cpu")
        study.write_markdown(
            study.RESULTS / "torchrec_planner.md", render(recs, budget_recs, command, runtime, versions)
        )
        figure(recs, study.RESULTS / "torchrec_planner.png")
    print(f"runtime {runtime:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
