"""Cost model vs measured bytes: the runtime's traffic counters on gloo against ``solvers.cost_model``.

Method. For each scenario (workload x cluster shape x strategy x dedup x id source) the parent plans the
workload with ``solvers.planner.make_plan`` on ``topology.views.uniform_view(G, g, 100 GB/s, 10 GB/s)``
and writes a plan file (for real ids, one that names the data set's hotness order); then ``G x g`` gloo
processes (``torch.multiprocessing`` spawn, ``MASTER_ADDR=127.0.0.1``, a free port, CPU, one thread
each) build a ``flexshard.runtime.ShardedSequenceEmbedding`` from it and run forward, backward (loss =
sum of the outputs) and an SGD ``step()`` for a number of iterations. Each iteration every rank reads
the module's ``traffic`` record (bytes ``[link class, component, send/recv]`` of that iteration).
Measured values are means over the iterations; the prediction is ``solvers.cost_model.evaluate`` of the
same workload, view and plan. Compared per link class (intra / inter group) and component (ids, forward,
backward, sync): the mean over ranks of the bytes each rank sends (equal to the mean received) and the
bottleneck rank's ``max(send, recv)``. Sampling noise: two standard errors of the measured mean over the
iterations (every iteration draws fresh ids). One process group per cluster shape runs all its
scenarios, so the ranks start once per shape.

Id sources:

* ``iid`` (synthetic workloads): every rank draws ``batch x ids_per_sample`` ids per table independently
  from the table's row distribution (the ``RowHistogram``: hotness ranks, mapped to ids through a seeded
  random permutation, the table's id order, so that row-wise's contiguous ranges of ids hold rows of
  every hotness, as with real ids), i.e. exactly the independent-draw model's assumption; agreement is
  expected within sampling noise;
* ``real`` (every data set of user histories under ``flexshard.workloads.data_root()``): every rank draws
  ``REAL_BATCH`` = 32 samples per iteration with ``flexshard.workloads.HistorySampler``, the sampler
  training uses (next-item: a random user and cut, the 50 items before the cut, the target and 4 random
  negatives), and looks up their raw item ids, routed with the data set's hotness order. The workload
  is the data set's ``item_id`` table with touch rates measured for that sampling
  (``flexshard.workloads.measured.with_touch_rates``, what ``flexshard stats --window 50 --negatives 4``
  writes); plans are made from it and predicted by ``evaluate``. Beside it, the same plan priced by the
  independent-draw model (the table's histogram at the same lookups per sample) shows what the
  measured rates correct. A data set whose file is absent is skipped with a note on stderr.

Workloads: ``zipf0.9`` / ``zipf1.2``: two tables (``items`` 20,000 rows, dim 16, 20 ids per sample,
Zipf alpha 0.9 + 5% uniform tail / alpha 1.2 + 2% tail; ``tags`` 500 rows, dim 8, 4 ids per sample,
same alpha, no tail), batch 16 per rank. Real: Amazon Beauty, Sports, Toys, Yelp and LastFM
(``amazon-yelp-sequences``: ``user item ...`` lines, few repeats), gowalla check-ins
(``train_reconstructed.txt``), and the repeat-consumption count matrices lastfm (``test.csv``), tw_ny,
go_sf and go_ny (``train.csv``; a user's history is its rows in file order, each item ``count`` times),
and MovieLens-100K (``ml-100k.inter``, RecBole; a user's ratings in timestamp order), dim 16.
Cluster shapes:
4 ranks = 2 groups of 2, 8 ranks = 4 groups of 2.
Strategies: every strategy of ``solvers.planner.STRATEGIES`` at a 2x row-wise memory budget (the
smallest of 2x, 4x, 8x where a baseline cannot plan at 2x); a plan identical to one already in the
grid (e.g. ``2d`` and ``data_parallel`` that replicate nothing here and equal ``row_wise``) is run
once and its aliases are listed.

Run:

    .venv/bin/python experiments/validate_bytes.py [--quick] [--no-write]

``--quick``: 4 ranks only, no ``zipf1.2``, real data beauty and lastfm only, strategies row_wise,
flexshard and hybrid, 15 iterations (100 otherwise). Writes docs/results/
validate_bytes.md and validate_bytes.png.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import study
import torch
import torch.distributed as dist

from core.errors import PlannerError
from core.vocabulary import COMPONENTS, LINK_CLASSES, FetchMode
from flexshard import workloads
from flexshard.plan_file import read_plan, to_dict, write_plan
from flexshard.runtime import ShardedSequenceEmbedding
from flexshard.runtime.local import run_on_ranks
from flexshard.workloads import sample_ids, zipf_table
from flexshard.workloads.measured import histories as measured_histories
from flexshard.workloads.measured import with_touch_rates
from solvers.cost_model import evaluate
from solvers.planner import STRATEGIES, budget_bytes, make_plan
from solvers.types import Plan, RowHistogram, Workload
from topology.views import ClusterView, uniform_view

INTRA_BW, INTER_BW = 100e9, 10e9
BUDGETS_X = (2.0, 4.0, 8.0)  # a strategy runs at the first budget it can plan under
FIRST = ("row_wise", "flexshard", "hybrid")  # then the other strategies, in STRATEGIES order
STRATEGY_ORDER = FIRST + tuple(s for s in STRATEGIES if s not in FIRST)
SHAPES = {4: (2, 2), 8: (4, 2)}  # world -> (groups, group size)
SAMPLING = workloads.Sampling("next-item", 50, 4)  # how a real sample is formed (as training does)
REAL_BATCH = 32  # real samples per rank
REAL_DATA = study.HISTORY_DATA_SETS
QUICK_REAL = ("beauty", "lastfm")
SEED = 1
TIMEOUT_S = 900.0
NOISE_FLOOR = 0.001
ITERATIONS = 100  # per scenario (every iteration draws fresh ids); --quick: 15
LINK_SHORT = {"intra_group": "intra", "inter_group": "inter"}
MARKERS = {"ids": "o", "forward": "^", "backward": "v", "sync": "s"}
COLORS = {
    "row_wise": "tab:gray",
    "flexshard": "tab:red",
    "hybrid": "tab:blue",
    "table_wise": "tab:green",
    "2d": "tab:purple",
    "data_parallel": "tab:orange",
}


# --- workloads and id sources ----------------------------------------------------------------------


@dataclass
class Source:
    """A workload and where its ids come from."""

    name: str
    workload: Workload  # what plans are made from (measured touch rates for real histories)
    sampler: tuple[workloads.Sequences, workloads.Sampling, np.ndarray] | None = None  # real batches
    orders: dict[str, np.ndarray] | None = None  # hotness orders for raw ids (real batches)
    independent: Workload | None = None  # the same tables priced as independent draws (real only)


def synthetic(alpha: float, tail: float) -> Workload:
    tables = (
        zipf_table("items", 20_000, 16, 20.0, alpha, tail),
        zipf_table("tags", 500, 8, 4.0, alpha, 0.0),
    )
    return Workload(f"zipf{alpha:g}", tables, batch_size_per_gpu=16)


def real_source(name: str, path: Path) -> Source | None:
    """The ``item_id`` table of a data file with touch rates measured on ``SAMPLING`` (and the same table
    priced as independent draws at the same lookups per sample), its histories and hotness order."""
    if not path.is_file():
        study.note_missing(path, f"the {name} scenarios")
        return None
    fmt = workloads.detect_format(path)
    wl, orders = workloads.load_workload_with_orders(path, dim=16, batch_size_per_gpu=REAL_BATCH)
    items = next(t for t in wl.tables if t.name == "item_id")
    wl = dataclasses.replace(wl, name=name, tables=(items,))
    (seq,) = measured_histories(path, fmt)()  # one chunk of users for the text formats
    measured = with_touch_rates(wl, orders, lambda: [seq], SAMPLING)
    per_sample = measured.tables[0].ids_per_sample
    independent = dataclasses.replace(wl, tables=(dataclasses.replace(items, ids_per_sample=per_sample),))
    order = orders["item_id"]
    return Source(name, measured, (seq, SAMPLING, order), {"item_id": order}, independent)


def synthetic_source(alpha: float, tail: float) -> Source:
    """A synthetic workload whose ids are a seeded random permutation of the hotness ranks (the ``iid``
    draws are ranks, mapped through each table's order), as real ids are: TorchRec's contiguous ranges
    of ids then hold rows of every hotness, and the model prices the ranges from that exact order."""
    wl = synthetic(alpha, tail)
    rng = np.random.default_rng([SEED, int(alpha * 100)])
    orders = {t.name: rng.permutation(t.num_rows).astype(np.int64) for t in wl.tables}
    return Source(wl.name, wl.with_orders(orders), orders=orders)


def sources(quick: bool) -> list[Source]:
    out = [synthetic_source(0.9, 0.05)]
    if not quick:
        out.append(synthetic_source(1.2, 0.02))
    root = workloads.data_root()
    real = [(name, root / rel) for name, rel in REAL_DATA if not quick or name in QUICK_REAL]
    return out + [s for s in (real_source(name, path) for name, path in real) if s is not None]


# --- scenarios ------------------------------------------------------------------------------------


@dataclass
class Job:
    """One scenario as the ranks run it (picklable)."""

    key: str
    plan_path: str
    tables: list[tuple[str, int, int]]
    dedup: bool
    batch: int  # samples per rank
    iterations: int
    ids_per_sample: list[float]
    hists: list[RowHistogram]  # per table, for iid draws
    sampler: tuple | None  # (histories, sampling, negative pool): real batches when set
    orders: dict[str, np.ndarray] | None


@dataclass
class Scenario:
    key: str
    source: str
    ids: str  # "iid" or "real"
    world: int
    strategy: str
    aliases: list[str]
    budget_x: float
    dedup: bool
    plan: Plan
    predicted: np.ndarray  # [N, 2, 4, 2] bytes per iteration
    job: Job
    measured: np.ndarray | None = None  # [N, iterations, 2, 4, 2]
    independent: np.ndarray | None = None  # real ids: the prediction of the independent-draw model
    wall_s: float = 0.0


def tiers_key(plan: Plan) -> tuple:
    """What makes two strategies' plans run the same exchange: tiers, owner shares and fetch modes."""
    return tuple(
        (
            tp.hot_rows,
            tp.warm_rows,
            tp.cold_rows,
            tp.fetch,
            tuple(np.round(tp.warm_share, 9)),
            tuple(np.round(tp.cold_share, 9)),
        )
        for tp in plan.tables
    )


def plan_once(strategy: str, wl: Workload, view: ClusterView, dedup: bool) -> tuple[Plan, float] | None:
    """``strategy``'s plan at the smallest budget it fits, and that budget (x row-wise). FlexShard plans by
    the bytes objective (``plan --objective bytes``): this is a study of bytes, and its tiers are what it
    checks (the step objective keeps every row cold on these small tables)."""
    for bx in BUDGETS_X if strategy != "flexshard" else BUDGETS_X[:1]:
        try:
            config = study.optimizer_config(False, objective="bytes") if strategy == "flexshard" else None
            return make_plan(strategy, wl, view, budget_bytes(wl, view, bx), dedup, config=config).plan, bx
        except PlannerError:
            continue
    print(f"note: {strategy} cannot plan {wl.name} under {BUDGETS_X[-1]:g}x; skipped", file=sys.stderr)
    return None


def scenarios(
    srcs: list[Source], world: int, iterations: int, strategies: tuple[str, ...], tmp: Path
) -> list[Scenario]:
    groups, gsize = SHAPES[world]
    view = uniform_view(groups, gsize, INTRA_BW, INTER_BW)
    out: list[Scenario] = []
    for src in srcs:
        wl = src.workload
        for dedup in (True, False):
            seen: dict[tuple, Scenario] = {}
            for strategy in strategies:
                planned = plan_once(strategy, wl, view, dedup)
                if planned is None:
                    continue
                plan, bx = planned
                if tiers_key(plan) in seen:
                    seen[tiers_key(plan)].aliases.append(strategy)
                    continue
                report = evaluate(wl, view, plan)
                ids = "real" if src.sampler is not None else "iid"
                stem = f"{src.name}-w{world}-{strategy}-{'dedup' if dedup else 'nodedup'}"
                path = tmp / f"{stem}-{ids}.json"  # real ids are routed through the data set's hotness order
                write_plan(path, to_dict(plan, wl, view, report, "validate_bytes", src.orders))
                job = Job(
                    key=f"{stem}-{ids}",
                    plan_path=str(path),
                    tables=[(t.name, t.num_rows, t.dim) for t in wl.tables],
                    dedup=dedup,
                    batch=wl.batch_size_per_gpu,
                    iterations=iterations,
                    ids_per_sample=[t.ids_per_sample for t in wl.tables],
                    hists=[t.hist for t in wl.tables],
                    sampler=src.sampler,
                    orders=src.orders,
                )
                pred = report.traffic.bytes
                sc = Scenario(job.key, src.name, ids, world, strategy, [], bx, dedup, plan, pred, job)
                if src.independent is not None:
                    sc.independent = evaluate(src.independent, view, plan).traffic.bytes
                out.append(sc)
                seen[tiers_key(plan)] = sc
    return out


# --- the ranks ------------------------------------------------------------------------------------


def even_lengths(total: int, batch: int) -> np.ndarray:
    """``batch`` lengths differing by at most one, summing to ``total``."""
    edges = (np.arange(batch + 1) * total) // batch
    return np.diff(edges)


def batch_of(
    job: Job, rng: np.random.Generator, sampler: workloads.HistorySampler | None, step: int, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if sampler is not None:  # real samples as training forms them (single-table workloads)
        b = sampler.batch(step, rank)
        cand = b.candidates.reshape(-1)
        lengths = np.concatenate([b.lengths, np.ones(cand.size, dtype=np.int64)])  # as lookup_features
        return {job.tables[0][0]: (torch.as_tensor(b.item_ids()), torch.as_tensor(lengths))}
    out = {}
    for (name, _rows, _dim), hist, per in zip(job.tables, job.hists, job.ids_per_sample, strict=True):
        n = int(round(job.batch * per))
        ids = sample_ids(hist, n, rng)  # hotness ranks, as raw ids through the table's order
        ids = ids if job.orders is None else job.orders[name][ids]
        out[name] = (torch.as_tensor(ids), torch.as_tensor(even_lengths(n, job.batch)))
    return out


def run_job(job: Job, rank: int) -> tuple[np.ndarray, float]:
    """Per-iteration traffic ``[iterations, 2, 4, 2]`` of this rank and the scenario's wall time."""
    dist.barrier()
    start = time.perf_counter()
    model = ShardedSequenceEmbedding(
        read_plan(job.plan_path), job.tables, job.orders, init=SEED, optimizer="sgd", lr=0.01
    )
    assert model.dedup == job.dedup, "the plan file carries the scenario's dedup setting"
    seed = zlib.crc32(job.key.encode())
    rng = np.random.default_rng([SEED, rank, seed])
    sampler = None
    if job.sampler is not None:
        seq, sampling, pool = job.sampler
        sampler = workloads.HistorySampler(seq, sampling, job.batch, seed, pool)
    traffic = np.zeros((job.iterations, 2, 4, 2))
    for it in range(job.iterations):
        out = model(batch_of(job, rng, sampler, it, rank))
        sum(o.sum() for o in out.values()).backward()
        model.step()
        traffic[it] = model.traffic.bytes
    dist.barrier()
    return traffic, time.perf_counter() - start


def run_jobs(rank: int, world: int, jobs: list[Job]) -> dict[str, tuple[np.ndarray, float]]:
    """On every rank (inside the process group): run ``jobs`` in order; per job this rank's traffic and
    the job's wall time."""
    results = {}
    for i, job in enumerate(jobs):
        results[job.key] = run_job(job, rank)
        if rank == 0:
            print(f"  [{i + 1}/{len(jobs)}] {job.key}: {results[job.key][1]:.1f} s", file=sys.stderr)
    return results


# --- comparison -----------------------------------------------------------------------------------


@dataclass
class Point:
    """One scenario x link class x component."""

    sc: Scenario
    link: str
    comp: str
    pred_mean: float  # bytes per rank per iteration, mean over ranks (sent = received)
    meas_mean: float
    noise: float  # two standard errors of meas_mean, relative
    pred_max: float  # bottleneck rank's max(send, recv)
    meas_max: float
    noise_max: float  # two standard errors of meas_max (the busiest rank's mean), relative
    indep_mean: float | None = None  # real ids: the independent-draw model's mean over ranks

    @property
    def err_indep(self) -> float | None:
        return None if self.indep_mean is None else rel_err(self.meas_mean, self.indep_mean)

    @property
    def err(self) -> float:
        return rel_err(self.meas_mean, self.pred_mean)

    @property
    def err_max(self) -> float:
        return rel_err(self.meas_max, self.pred_max)


def rel_err(meas: float, pred: float) -> float:
    if pred == 0:
        return 0.0 if meas == 0 else float("inf")
    return meas / pred - 1.0


def points(sc: Scenario) -> list[Point]:
    m = sc.measured  # [N, it, 2, 4, 2]
    assert m is not None
    iters = m.shape[1]
    per_iter = m[:, :, :, :, 0].mean(axis=0)  # [it, 2, 4]: sent, mean over ranks
    mean = per_iter.mean(axis=0)
    se = per_iter.std(axis=0, ddof=1) / np.sqrt(iters)
    per_rank = m.mean(axis=1)  # [N, 2, 4, 2]
    meas_max = per_rank.max(axis=3).max(axis=0)  # [2, 4]
    rank_se = m.std(axis=1, ddof=1) / np.sqrt(iters)  # [N, 2, 4, 2]
    pred_mean = sc.predicted[:, :, :, 0].mean(axis=0)
    pred_max = sc.predicted.max(axis=3).max(axis=0)
    indep = None if sc.independent is None else sc.independent[:, :, :, 0].mean(axis=0)
    out = []
    for li, link in enumerate(LINK_CLASSES):
        for ci, comp in enumerate(COMPONENTS):
            if pred_mean[li, ci] == 0 and mean[li, ci] == 0:
                continue
            noise = 2 * se[li, ci] / mean[li, ci] if mean[li, ci] > 0 else 0.0
            r, d = np.unravel_index(np.argmax(per_rank[:, li, ci, :]), per_rank[:, li, ci, :].shape)
            top = meas_max[li, ci]
            noise_max = 2 * rank_se[r, li, ci, d] / top if top > 0 else 0.0
            out.append(
                Point(
                    sc,
                    link,
                    comp,
                    pred_mean[li, ci],
                    mean[li, ci],
                    noise,
                    pred_max[li, ci],
                    meas_max[li, ci],
                    noise_max,
                    None if indep is None else float(indep[li, ci]),
                )
            )
    return out


def link_totals(sc: Scenario) -> dict[str, tuple[float, float, float, float]]:
    """Per link class: (predicted mean, measured mean, predicted bottleneck, measured bottleneck), all
    components, bottleneck = max over ranks of max(send, recv) of the component sum."""
    assert sc.measured is not None
    meas = sc.measured.mean(axis=1)  # [N, 2, 4, 2]
    out = {}
    for li, link in enumerate(LINK_CLASSES):
        out[link] = (
            float(sc.predicted[:, li, :, 0].sum(axis=1).mean()),
            float(meas[:, li, :, 0].sum(axis=1).mean()),
            float(sc.predicted[:, li].sum(axis=1).max()),
            float(meas[:, li].sum(axis=1).max()),
        )
    return out


# --- output ---------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return "n/a" if not np.isfinite(x) else f"{100 * x:+.1f}%"


def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f}"


def tier_text(plan: Plan) -> str:
    """hot/warm/cold rows per table, ``g`` after the cold count where a group fetches them once."""
    return " + ".join(
        f"{tp.hot_rows}/{tp.warm_rows}/{tp.cold_rows}{'g' if tp.fetch is FetchMode.GROUP else ''}"
        for tp in plan.tables
    )


def scenario_table(scs: list[Scenario]) -> str:
    header = ["workload", "ids", "ranks (GxG)", "strategy", "budget", "dedup", "tiers h/w/c"]
    header += ["inter pred / meas KB", "err", "intra pred / meas KB", "err", "bottleneck err inter / intra"]
    header += ["worst component (err, 2SE)", "wall s"]
    rows = []
    for sc in scs:
        tot = link_totals(sc)
        pi, mi, pbi, mbi = tot["inter_group"]
        pa, ma, pba, mba = tot["intra_group"]
        worst = max(points(sc), key=lambda p: abs(p.err))
        g, s = SHAPES[sc.world]
        strat = sc.strategy + (f" (= {', '.join(sc.aliases)})" if sc.aliases else "")
        shape = f"{sc.world} ({g}x{s})"
        setup = [sc.source, sc.ids, shape, strat, f"{sc.budget_x:g}x", "on" if sc.dedup else "off"]
        inter = [f"{_kb(pi)} / {_kb(mi)}", _pct(rel_err(mi, pi))]
        intra = [f"{_kb(pa)} / {_kb(ma)}", _pct(rel_err(ma, pa))]
        bottleneck = f"{_pct(rel_err(mbi, pbi))} / {_pct(rel_err(mba, pba))}"
        where = f"{LINK_SHORT[worst.link]} {worst.comp} ({_pct(worst.err)}, ±{100 * worst.noise:.1f}%)"
        rows.append([*setup, tier_text(sc.plan), *inter, *intra, bottleneck, where, f"{sc.wall_s:.1f}"])
    return study.md_table(header, rows)


def beyond(p: Point, limit: float, bottleneck: bool = False) -> bool:
    """Whether ``p``'s error exceeds ``limit`` and two standard errors of the measured value."""
    err, noise = (p.err_max, p.noise_max) if bottleneck else (p.err, p.noise)
    return abs(err) > limit and abs(err) > noise + NOISE_FLOOR


def within_noise(p: Point) -> bool:
    """|error| within two standard errors of the measured mean (plus 0.1% for nearly deterministic
    bytes such as split sizes and saturated sync, whose standard error is ~0)."""
    return abs(p.err) <= p.noise + NOISE_FLOOR


def _med_max(errs: list[float]) -> str:
    if not errs:
        return "-"
    e = 100 * np.abs(errs)
    return f"{np.median(e):.2f}% / {e.max():.2f}%"


def summary_table(pts: list[Point]) -> str:
    """Per id source, workload and dedup: median / max |error| per component (both link classes)."""
    header = ["ids", "workload", "dedup", "points", *COMPONENTS, "all (mean over ranks)", "within noise"]
    header += ["all (bottleneck rank)", "all, independent-draw model"]
    rows = []
    names = list(dict.fromkeys(p.sc.source for p in pts))
    for ids in ("iid", "real"):
        for name in names:
            for dedup in (True, False):
                sel = [p for p in pts if p.sc.ids == ids and p.sc.source == name and p.sc.dedup == dedup]
                if not sel:
                    continue
                comps = [_med_max([p.err for p in sel if p.comp == c]) for c in COMPONENTS]
                share = 100 * np.mean([within_noise(p) for p in sel])
                indep = [p.err_indep for p in sel if p.err_indep is not None]
                rows.append(
                    [ids, name, "on" if dedup else "off", len(sel), *comps, _med_max([p.err for p in sel])]
                    + [f"{share:.0f}%", _med_max([p.err_max for p in sel]), _med_max(indep)]
                )
    return study.md_table(header, rows)


def _where(p: Point) -> str:
    sc = p.sc
    return (
        f"{sc.source} {sc.ids}, {sc.world} ranks, {sc.strategy}, dedup {'on' if sc.dedup else 'off'}, "
        f"{LINK_SHORT[p.link]} {p.comp}"
    )


def headline(pts: list[Point]) -> list[str]:
    out = []
    iid = [p for p in pts if p.sc.ids == "iid"]
    if iid:
        per = ", ".join(
            f"{c} {100 * max(abs(p.err) for p in iid if p.comp == c):.1f}%"
            for c in COMPONENTS
            if any(p.comp == c for p in iid)
        )
        worst = max(iid, key=lambda p: abs(p.err))
        worst_b = max(iid, key=lambda p: abs(p.err_max))
        med_b = 100 * np.median(np.abs([p.err_max for p in iid]))
        out += [
            f"* **i.i.d. ids** ({len(iid)} points, {len({p.sc.key for p in iid})} scenarios): mean over "
            f"ranks |error| median {100 * np.median(np.abs([p.err for p in iid])):.2f}%, max "
            f"{100 * abs(worst.err):.2f}% ({_where(worst)}); max per component: {per}; "
            f"{100 * np.mean([within_noise(p) for p in iid]):.0f}% of points within noise.",
            f"* **i.i.d. ids, bottleneck rank**: median {med_b:.2f}%, "
            f"max {_pct(worst_b.err_max)} ({_where(worst_b)}).",
        ]
    real = [p for p in pts if p.sc.ids == "real"]
    if real:
        worst = max(real, key=lambda p: abs(p.err))
        worst_b = max(real, key=lambda p: abs(p.err_max))
        names = list(dict.fromkeys(p.sc.source for p in real))
        out += [
            f"* **real histories, measured touch rates** ({len(names)} data sets, {len(real)} points, "
            f"{len({p.sc.key for p in real})} scenarios): mean over ranks |error| median "
            f"{100 * np.median(np.abs([p.err for p in real])):.2f}%, max {100 * abs(worst.err):.2f}% "
            f"({_where(worst)}); {sum(abs(p.err) > 0.05 for p in real)} points beyond 5%, "
            f"{sum(beyond(p, 0.05) for p in real)} beyond both 5% and their noise; bottleneck "
            f"rank median {100 * np.median(np.abs([p.err_max for p in real])):.2f}%, "
            f"max {_pct(worst_b.err_max)} ({_where(worst_b)}, ±{100 * worst_b.noise_max:.1f}%), "
            f"{sum(abs(p.err_max) > 0.10 for p in real)} points beyond 10%, "
            f"{sum(beyond(p, 0.10, bottleneck=True) for p in real)} beyond both 10% and their noise.",
        ]
        for name in names:
            parts = []
            for dedup in (True, False):
                sel = [p for p in real if p.sc.source == name and p.sc.dedup == dedup]
                if sel:
                    measured = [p.err for p in sel]
                    indep = [p.err_indep for p in sel if p.err_indep is not None]
                    parts.append(
                        f"dedup {'on' if dedup else 'off'}: measured rates {_range(measured)}, "
                        f"independent draws {_range(indep)}"
                    )
            out.append(f"  * {name} (error range over points): " + "; ".join(parts) + ".")
    return out


def _range(errs: list[float]) -> str:
    return f"{_pct(min(errs))} to {_pct(max(errs))}"


def figure(path: Path, pts: list[Point]) -> None:
    from matplotlib.lines import Line2D

    panels = [ids for ids in ("iid", "real") if any(p.sc.ids == ids for p in pts)]
    fig, axes = study.subplots(2, len(panels), figsize=(6.5 * len(panels), 10), squeeze=False)
    titles = {
        "iid": "ids drawn i.i.d. from the row distribution (model's assumption)",
        "real": "real user histories (Beauty: no repeats; lastfm: repeated plays)",
    }
    lo = min(min(p.pred_mean, p.meas_mean) for p in pts if p.pred_mean > 0) / 2
    hi = max(max(p.pred_mean, p.meas_mean) for p in pts) * 2
    for col, ids in enumerate(panels):
        sel = [p for p in pts if p.sc.ids == ids and p.pred_mean > 0 and p.meas_mean > 0]
        ax, ax_err = axes[0, col], axes[1, col]
        xs = np.geomspace(lo, hi, 50)
        for a in (ax, ax_err):
            a.set_xscale("log")
            a.grid(alpha=0.3, which="both", lw=0.5)
        ax.set_yscale("log")
        ax.fill_between(xs, xs * 0.95, xs * 1.05, color="0.85", label="±5%")
        ax.plot(xs, xs, color="black", lw=0.8, label="y = x")
        ax_err.axhspan(-5, 5, color="0.85")
        ax_err.axhline(0, color="black", lw=0.8)
        for p in sel:
            filled = p.link == "inter_group"
            color = COLORS.get(p.sc.strategy, "black")
            kw = {
                "marker": MARKERS[p.comp],
                "s": 30,
                "facecolors": color if filled else "none",
                "edgecolors": color,
                "linewidths": 1.0,
                "alpha": 0.8,
            }
            ax.scatter([p.pred_mean], [p.meas_mean], **kw)
            ax_err.scatter([p.pred_mean], [100 * p.err], **kw)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax_err.set_xlim(lo, hi)
        ax.set_title(titles[ids], fontsize=10)
        ax.set_xlabel("predicted bytes / rank / iteration (cost model, mean over ranks)")
        ax.set_ylabel("measured bytes / rank / iteration (runtime counters)")
        ax_err.set_xlabel("predicted bytes / rank / iteration")
        ax_err.set_ylabel("measured / predicted - 1 (%)")
        span = max(6.0, 1.15 * max((100 * abs(p.err) for p in sel), default=5.0))
        ax_err.set_ylim(-span, span)
    strategies = sorted({p.sc.strategy for p in pts}, key=STRATEGY_ORDER.index)
    handles = [Line2D([], [], ls="", marker="o", color=COLORS.get(s, "black"), label=s) for s in strategies]
    handles += [
        Line2D([], [], ls="", marker=m, color="black", mfc="none", label=c) for c, m in MARKERS.items()
    ]
    handles += [
        Line2D([], [], ls="", marker="o", color="black", label="inter-group (filled)"),
        Line2D([], [], ls="", marker="o", color="black", mfc="none", label="intra-group (hollow)"),
    ]
    axes[0, 0].legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    worlds = " and ".join(str(w) for w in sorted({p.sc.world for p in pts}))
    fig.suptitle(
        f"Cost model vs runtime byte counters (gloo, {worlds} CPU ranks); grey band = ±5%; "
        "forward and backward points coincide (same bytes)",
        fontsize=11,
    )
    fig.tight_layout()
    study.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick="4 ranks, fewer workloads, strategies, iterations")
    args = p.parse_args(argv)
    start = time.perf_counter()
    iterations = 15 if args.quick else ITERATIONS
    worlds = (4,) if args.quick else (4, 8)
    strategies = STRATEGY_ORDER[:3] if args.quick else STRATEGY_ORDER
    srcs = sources(args.quick)
    done: list[Scenario] = []
    with tempfile.TemporaryDirectory(prefix="validate_bytes-") as tmp_s:
        tmp = Path(tmp_s)
        for world in worlds:
            scs = scenarios(srcs, world, iterations, strategies, tmp)
            print(f"world {world}: {len(scs)} scenarios x {iterations} iterations", file=sys.stderr)
            results = run_on_ranks(
                run_jobs, world, [sc.job for sc in scs], timeout_s=TIMEOUT_S, label=f"world {world}"
            )
            for sc in scs:
                sc.measured = np.stack([r[sc.key][0] for r in results])
                sc.wall_s = float(results[0][sc.key][1])
            done.extend(scs)
            print(f"world {world} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    pts = [pt for sc in done for pt in points(sc)]
    elapsed = time.perf_counter() - start
    body = "\n".join(
        [
            "## Summary",
            "",
            *headline(pts),
            "",
            "Median / max |measured / predicted - 1| per component over both link classes and all",
            "scenarios of a row (mean over ranks unless stated); within noise: share of points whose",
            "error is within two standard errors of the measured mean (+0.1%).",
            "",
            summary_table(pts),
            "",
            "Reading. With i.i.d. ids the mean-over-ranks bytes agree within sampling noise for every",
            "component (the model's volumes are exact expectations for independent draws). Real histories",
            "priced with measured touch rates agree as closely: a batch is independent samples, and the",
            "rates are exact expectations over the sampler that forms them. Priced as independent draws at",
            "the same lookups per sample (last column), the same runs are over-predicted most where users",
            "repeat items (the repeat-consumption data sets). The bottleneck rank is priced from the rows",
            "each owner is actually dealt (FlexShard's interleave from each table's start position, or",
            "TorchRec's contiguous id ranges for row_wise on the real ids), so a rank that holds a heavy row",
            "is predicted to serve its accesses; what remains is sampling noise, larger at the busiest rank",
            "(a maximum over ranks of noisy means) than for the mean over ranks. Rows inside a hotness",
            "bucket are alike to FlexShard's interleave, which deals every owner rows from all over a",
            "bucket; TorchRec's id ranges take a bucket's rows by id, and where ids follow how many users",
            "touch a row (ids numbered by first visit) a range holds more widely shared rows than the",
            "bucket's average, so ranges are priced row by row from the profile's record of which entry",
            "each row is (docs/cost_model.md 2.1; bucket averages left go_sf's busiest rank 11% short).",
            "",
            "## Scenarios",
            "",
            "Bytes per rank per iteration, mean over ranks, all components; bottleneck = the busiest",
            "rank's max(send, recv). Tiers: hot/warm/cold rows per table (g: the cold rows fetched once per",
            "group).",
            "",
            scenario_table(done),
        ]
    )
    print(body)
    print(f"\n{elapsed:.0f} s")
    if not args.no_write:
        figure(study.RESULTS / "validate_bytes.png", pts)
        cmd = study.command(__file__, *(["--quick"] if args.quick else []))
        doc = (__doc__ or "").split("Method. ", 1)[1].split("\n\nRun:", 1)[0]
        head = [
            "# Cost model vs measured bytes (gloo runs of the runtime)",
            "",
            study.generated(cmd, elapsed, f"{iterations} iterations per scenario"),
            "",
            "What is measured: bytes are counted by the runtime's own counters "
            "(`ShardedSequenceEmbedding.traffic`) on the send side of each all-to-all (ids incl. split "
            "sizes, embeddings, gradients), from the realised split sizes of every iteration, on gloo over "
            "loopback on CPU. Replica sync (`sync`) bytes are not wire measurements: the runtime performs "
            "the all-reduces (touched mask with MAX, then the touched rows' gradients) and books the "
            "cost model's hierarchical (hot) / ring (warm) all-reduce formula applied to the realised "
            "payload (rows touched anywhere in the cluster x vector bytes + one mask byte per replicated "
            "row), so the sync comparison checks the model's touched-row estimate, not the collective's "
            "algorithm. No GPU, no timing model: wall times are 2 loaded CPU cores and only show the cost "
            "of the run.",
            "",
            "Method. " + doc.strip(),
            "",
            "![predicted vs measured bytes](validate_bytes.png)",
            "",
        ]
        study.write_markdown(study.RESULTS / "validate_bytes.md", "\n".join(head) + "\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
