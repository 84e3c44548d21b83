"""Hot-set drift: plan on an earlier window of a real trace, pay for it on a later one.

FlexShard picks each table's hot and warm rows from access statistics. Here the statistics come from
an earlier window and the traffic from a later one:

* repeat-consumption ``lastfm``: earlier = ``validation.csv``, later = ``test.csv`` (``train.csv`` is
  not in the shared folder);
* repeat-consumption ``tw_ny``, ``go_sf``, ``go_ny``: earlier = ``train.csv``, later = ``validation.csv``
  + ``test.csv``;
* MovieLens-100K (``ml-100k.inter``): interactions sorted by timestamp, earlier = the first 80%, later
  = the last 20%.

Tables are built the way ``flexshard.workloads`` builds them from these files: ``item_id`` (each access
one lookup; a csv line adds ``count`` lookups) and ``user_id`` (csv: one lookup per user of the window;
RecBole: one per interaction), one sample per user, dim 64, batch 512 per GPU. Files are read here with
numpy so that row ids stay aligned across windows: a table's rows are ``0 .. max id`` over both
windows (RecBole ids are the integer tokens), and each window gives per-row counts. The MovieLens
feature tables are left out.

Method, per data set, at ``h100:8`` (64 GPUs), budget 2x row-wise, dedup on and off:

1. **plan on the earlier window**: ``make_plan`` on the workload of ``RowHistogram.from_counts`` of the
   earlier counts. The plan's ``h`` hot and ``w`` warm rows of a table are the first ``h`` and next ``w``
   ids of the earlier window's hotness order (``flexshard.workloads.hotness_order``: count descending,
   ties by id ascending; then untouched ids ascending);
2. **evaluate on the later window without re-sorting**: the later window's per-row probabilities are
   listed in the earlier window's order (``RowHistogram`` requires non-increasing probabilities, so
   ``solvers.cost_model.evaluate`` cannot price that order). ``tier_volumes_from_probs`` computes each
   row's lookups, dedup volume ``1 - (1 - p)^n`` and touched probability ``1 - (1 - p)^(N n)`` with the
   formulas of ``solvers.volumes.table_mass`` (``n`` = the later window's lookups per GPU), deals the
   rows to their owners as the runtime would (``solvers.volumes.dealt_volumes``, every row its own
   bucket; row-wise is TorchRec's contiguous ranges of the real ids), and
   ``solvers.cost_model.evaluate_volumes`` prices them with
   the same traffic, sync, split-size and time functions as ``solvers.cost_model.evaluate``
   (self-check on sorted input: the oracle below and row-wise agree with ``evaluate`` to 1e-9);
3. **oracle**: ``make_plan`` on the later window itself, priced by ``evaluate``.

Reported: row-wise inter-group bytes on the later window, the inter-group saving vs row-wise that the
planner predicts on the earlier window, the saving the stale plan achieves on the later window, the
oracle's, the share of the oracle saving that survives, the later window's access share landing on
replicated (hot + warm) rows, and modeled times. The same for the hybrid baseline (its hot set is also
chosen from the earlier window). Writes docs/results/hot_set_drift.md and hot_set_drift.png. Run:

    .venv/bin/python experiments/hot_set_drift.py [--quick] [--no-write]

``--quick``: lastfm, tw_ny and ml-100k only, no integer finish.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import study

from flexshard import workloads
from solvers.cost_model import evaluate_volumes
from solvers.planner import budget_bytes, make_plan
from solvers.types import CostReport, Plan, RowHistogram, TablePlan, TableSpec, Workload
from solvers.volumes import TableMass, TierVolumes, dealt_volumes
from topology import ClusterView, cluster_view, h100_cluster

DIM = 64
BATCH = 512
NODES = 8
BUDGET_X = 2.0


@dataclass
class Window:
    """Per-table per-row counts of one window (aligned row ids) and its number of samples (users)."""

    counts: dict[str, np.ndarray]
    samples: int


# ------------------------------------------------------------------------------------------ reading


def read_csv_window(paths: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Concatenated ``user, item, count`` columns of the csv splits of one window."""
    parts = [np.loadtxt(p, delimiter=",", dtype=np.int64, ndmin=2) for p in paths]
    data = np.concatenate(parts)
    return data[:, 0], data[:, 1], data[:, 2]


def csv_windows(earlier: list[Path], later: list[Path]) -> tuple[Window, Window]:
    cols = [read_csv_window(earlier), read_csv_window(later)]
    n_items = max(int(c[1].max()) for c in cols) + 1
    n_users = max(int(c[0].max()) for c in cols) + 1
    out = []
    for user, item, count in cols:
        present = np.unique(user)
        item_counts = np.bincount(item, weights=count, minlength=n_items).astype(np.int64)
        user_counts = np.bincount(present, minlength=n_users).astype(np.int64)  # one lookup per sample
        out.append(Window({"item_id": item_counts, "user_id": user_counts}, int(present.size)))
    return out[0], out[1]


def recbole_windows(path: Path, earlier_share: float = 0.8) -> tuple[Window, Window]:
    """user_id / item_id counts of the first ``earlier_share`` of interactions by timestamp and the rest."""
    raw = np.loadtxt(path, delimiter="\t", skiprows=1, usecols=(0, 1, 3), dtype=np.float64)
    order = np.argsort(raw[:, 2], kind="stable")
    user, item = raw[order, 0].astype(np.int64), raw[order, 1].astype(np.int64)
    cut = int(round(earlier_share * user.size))
    n_users, n_items = int(user.max()) + 1, int(item.max()) + 1
    out = []
    for sl in (slice(0, cut), slice(cut, None)):
        u, it = user[sl], item[sl]
        out.append(
            Window(
                {
                    "user_id": np.bincount(u, minlength=n_users),  # one lookup per interaction
                    "item_id": np.bincount(it, minlength=n_items),
                },
                int(np.unique(u).size),
            )
        )
    return out[0], out[1]


def data_sets(quick: bool) -> list[tuple[str, str, Callable[[], tuple[Window, Window]]]]:
    root = workloads.data_root()
    rc = root / "repeat-consumption-uci"
    ml = root / "movielens-100k-recbole" / "ml-100k.inter"
    later = ("validation", "test")
    sets = [("lastfm", "validation -> test", [rc / "lastfm/validation.csv"], [rc / "lastfm/test.csv"])]
    for name in ("tw_ny", "go_sf", "go_ny"):
        sets.append(
            (
                name,
                "train -> validation+test",
                [rc / name / "train.csv"],
                [rc / name / f"{s}.csv" for s in later],
            )
        )
    sets.append(("ml-100k", "first 80% -> last 20% by time", [ml], [ml]))
    if quick:
        sets = [s for s in sets if s[0] in ("lastfm", "tw_ny", "ml-100k")]
    found = []
    for name, split, earlier, later in sets:
        missing = [p for p in earlier + later if not p.exists()]
        if missing:
            study.note_missing(missing[0], name)
            continue
        if name == "ml-100k":
            found.append((name, split, lambda p=earlier[0]: recbole_windows(p)))
        else:
            found.append((name, split, lambda e=earlier, lt=later: csv_windows(e, lt)))
    return found


def workload_of(name: str, window: Window) -> Workload:
    tables = []
    for t, c in window.counts.items():
        tables.append(
            TableSpec(
                name=t,
                num_rows=int(c.size),
                dim=DIM,
                ids_per_sample=float(c.sum()) / window.samples,
                hist=RowHistogram.from_counts(c),
            )
        )
    return Workload(name=name, tables=tuple(tables), batch_size_per_gpu=BATCH)


def full_order(counts: np.ndarray) -> np.ndarray:
    """Every row id: touched ones in hotness order (count desc, ties by id), then untouched by id."""
    touched = workloads.hotness_order(counts)
    return np.concatenate([touched, np.flatnonzero(counts == 0)])


# --------------------------------------------------------------------------------------- evaluation


def tier_volumes_from_probs(
    p: np.ndarray, table: TableSpec, tp: TablePlan, view: ClusterView, dedup: bool
) -> TierVolumes:
    """Tier volumes of ``table`` under plan ``tp`` when its rows, listed in the order the plan's tiers are
    taken along (``table.order``: hot, then warm, then cold), have per-lookup probabilities ``p`` (any
    order): the per-row formulas of ``solvers.volumes.table_mass`` (a GPU's batch, a group's, the
    cluster's), dealt to owners row by row as ``solvers.volumes.dealt_volumes`` deals them."""
    n = BATCH * table.ids_per_sample  # lookups per GPU per iteration
    log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-16))

    def cumulative(per_row: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(per_row)])

    mass = TableMass(  # every row its own bucket: the dealt volumes are exact per row
        rows=np.arange(p.size + 1, dtype=np.float64),
        lookups=cumulative(p * n),
        unique=cumulative(-np.expm1(n * log_miss)),
        group=cumulative(-np.expm1(n * int(view.group_sizes.max()) * log_miss)),
        touched=cumulative(-np.expm1(n * view.num_ranks * log_miss)),
    )
    return dealt_volumes(mass, table, tp, view, dedup)


def price_in_order(
    workload: Workload, view: ClusterView, plan: Plan, window: Window, orders: dict[str, np.ndarray]
) -> tuple[CostReport, float, dict[str, float]]:
    """Cost of ``plan`` (tiers taken along ``orders``) under ``window``'s traffic, the share of the
    window's lookups (all tables) that hit replicated rows, and that share per table."""
    volumes, replicated, total, per_table = [], 0.0, 0.0, {}
    for t, tp in zip(workload.tables, plan.tables, strict=True):
        c = window.counts[t.name][orders[t.name]].astype(np.float64)
        p = c / c.sum()
        listed = dataclasses.replace(t, order=orders[t.name])  # rank -> id, for TorchRec's id ranges
        volumes.append(tier_volumes_from_probs(p, listed, tp, view, plan.dedup))
        hit = float(c[: tp.hot_rows + tp.warm_rows].sum())
        per_table[t.name] = hit / float(c.sum())
        replicated += hit
        total += float(c.sum())
    return evaluate_volumes(workload, view, plan, volumes), replicated / total, per_table


def drift_study(name: str, early: Window, late: Window, view: ClusterView, dedup: bool, quick: bool) -> dict:
    order_early = {t: full_order(c) for t, c in early.counts.items()}
    order_late = {t: full_order(c) for t, c in late.counts.items()}
    # the real ids ride along: row-wise is TorchRec's contiguous id ranges of them
    w_early = workload_of(f"{name}-earlier", early).with_orders(order_early)
    w_late = workload_of(f"{name}-later", late).with_orders(order_late)
    rw_late = make_plan("row_wise", w_late, view, budget_bytes(w_late, view, BUDGET_X), dedup).report
    rw_early = make_plan("row_wise", w_early, view, budget_bytes(w_early, view, BUDGET_X), dedup).report
    rec: dict = {"rw_inter": rw_late.inter_group_bytes, "rw_time": rw_late.modeled_time_s}
    for strategy in ("flexshard", "hybrid"):
        cfg = study.optimizer_config(quick) if strategy == "flexshard" else None
        stale = make_plan(strategy, w_early, view, budget_bytes(w_early, view, BUDGET_X), dedup, config=cfg)
        late_budget = budget_bytes(w_late, view, BUDGET_X)
        oracle = make_plan(strategy, w_late, view, late_budget, dedup, config=study.optimizer_config(quick))
        stale_rep, stale_cov, stale_tables = price_in_order(w_late, view, stale.plan, late, order_early)
        check, oracle_cov, oracle_tables = price_in_order(w_late, view, oracle.plan, late, order_late)
        ref = oracle.report.inter_group_bytes
        if not math.isclose(check.inter_group_bytes, ref, rel_tol=1e-9, abs_tol=1e-6):  # self-check
            raise AssertionError(f"{name}: evaluate_volumes {check.inter_group_bytes} != evaluate {ref}")
        rec[strategy] = {
            "predicted": 1 - stale.report.inter_group_bytes / rw_early.inter_group_bytes,
            "stale": 1 - stale_rep.inter_group_bytes / rw_late.inter_group_bytes,
            "oracle": 1 - ref / rw_late.inter_group_bytes,
            "stale_inter": stale_rep.inter_group_bytes,
            "oracle_inter": ref,
            "stale_time": stale_rep.modeled_time_s,
            "oracle_time": oracle.report.modeled_time_s,
            "stale_cov": stale_cov,
            "oracle_cov": oracle_cov,
            "replicated": {tp.name: tp.hot_rows + tp.warm_rows for tp in stale.plan.tables},
            "oracle_replicated": {tp.name: tp.hot_rows + tp.warm_rows for tp in oracle.plan.tables},
            "stale_tables": stale_tables,
            "oracle_tables": oracle_tables,
        }
    # row-wise: the self-check on an all-cold plan
    rw_plan = make_plan("row_wise", w_late, view, budget_bytes(w_late, view, BUDGET_X), dedup).plan
    rw_check, _, _ = price_in_order(w_late, view, rw_plan, late, order_early)
    if not math.isclose(rw_check.inter_group_bytes, rw_late.inter_group_bytes, rel_tol=1e-9):
        raise AssertionError(f"{name}: row-wise check failed")
    return rec


# ------------------------------------------------------------------------------------------ output


def survival(s: dict) -> str:
    return f"{s['stale'] / s['oracle']:.0%}" if s["oracle"] > 1e-9 else "n/a"


def markdown(results: list[tuple[str, str, bool, dict]]) -> str:
    header = ["data set", "windows", "dedup", "strategy", "row-wise inter-group (later)"]
    header += ["saving predicted on earlier", "saving achieved on later (stale plan)", "oracle saving"]
    header += ["share of oracle saving kept", "later lookups on replicated rows: stale / oracle"]
    header += ["modeled time: row-wise / stale / oracle"]
    rows = []
    for name, split, dedup, rec in results:
        for strategy in ("flexshard", "hybrid"):
            s = rec[strategy]
            times = (
                f"{rec['rw_time'] * 1e3:.3f} / {s['stale_time'] * 1e3:.3f} / {s['oracle_time'] * 1e3:.3f} ms"
            )
            rows.append(
                [name, split, "on" if dedup else "off", strategy, f"{rec['rw_inter'] / 1e6:.2f} MB"]
                + [f"{s['predicted']:.1%}", f"{s['stale']:.1%}", f"{s['oracle']:.1%}", survival(s)]
                + [f"{s['stale_cov']:.1%} / {s['oracle_cov']:.1%}", times]
            )
    return study.md_table(header, rows)


def per_table_markdown(results: list[tuple[str, str, bool, dict]]) -> str:
    header = ["data set", "dedup", "table", "replicated rows: stale / oracle"]
    header += ["later lookups on replicated rows: stale / oracle"]
    rows = []
    for name, _, dedup, rec in results:
        s = rec["flexshard"]
        for t in s["stale_tables"]:
            rows.append(
                [name, "on" if dedup else "off", t, f"{s['replicated'][t]:,} / {s['oracle_replicated'][t]:,}"]
                + [f"{s['stale_tables'][t]:.1%} / {s['oracle_tables'][t]:.1%}"]
            )
    return study.md_table(header, rows)


def figure(path: Path, results: list[tuple[str, str, bool, dict]]) -> None:
    fig, axes = study.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    bars = (
        ("predicted", "predicted on the earlier window", "tab:gray"),
        ("stale", "achieved on the later window (plan from earlier)", "tab:red"),
        ("oracle", "oracle (plan from the later window)", "tab:blue"),
    )
    for ax, dedup in zip(axes, (True, False), strict=True):
        rows = [(n, r) for n, _, d, r in results if d == dedup]
        for k, (key, label, color) in enumerate(bars):
            xs = [i + (k - 1) * 0.27 for i in range(len(rows))]
            ax.bar(xs, [100 * r["flexshard"][key] for _, r in rows], 0.27, color=color, label=label)
        ax.set_xticks(range(len(rows)), [n for n, _ in rows])
        ax.set_title(f"FlexShard, per-rank id dedup {'on' if dedup else 'off'}")
        ax.grid(axis="y", alpha=0.3)
        ax.axhline(0, color="black", lw=0.8)
    axes[0].set_ylabel("inter-group bytes saved vs row-wise (%)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Hot-set drift: h100:{NODES} (64 GPUs), budget {BUDGET_X:g}x row-wise, batch {BATCH}/GPU")
    fig.tight_layout()
    study.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, quick="lastfm, tw_ny, ml-100k; no integer finish")
    args = p.parse_args(argv)
    start = time.perf_counter()

    view = cluster_view(h100_cluster(NODES))
    results = []
    for name, split, load in data_sets(args.quick):
        early, late = load()
        for dedup in (True, False):
            results.append((name, split, dedup, drift_study(name, early, late, view, dedup, args.quick)))
        print(f"{name} done ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if not results:
        print("no data set found under", workloads.data_root())
        return 0
    elapsed = time.perf_counter() - start
    body = (
        markdown(results)
        + "\n\nFlexShard per table (replicated = hot + warm rows of the plan):\n\n"
        + per_table_markdown(results)
    )
    print(body)
    print(f"\n{elapsed:.0f} s")
    if not args.no_write:
        figure(study.RESULTS / "hot_set_drift.png", results)
        cmd = study.command(__file__, *(["--quick"] if args.quick else []))
        doc = (__doc__ or "").split("Method, per data set", 1)[1].split("Writes docs/results", 1)[0]
        head = [
            "# Hot-set drift: plan on an earlier window, evaluate on a later one",
            "",
            study.generated(cmd, elapsed),
            "Modeled bytes and times from the cost model (docs/cost_model.md), not GPU measurements.",
            "",
            "Windows: lastfm validation -> test (no train split here); tw_ny, go_sf, go_ny train ->",
            "validation + test; ml-100k first 80% -> last 20% of interactions by timestamp. Tables item_id",
            "and user_id as `flexshard.workloads` builds them (MovieLens feature tables left out), dim 64,",
            "batch 512 per GPU; row ids aligned across windows.",
            "",
            "Method, per data set" + doc.rstrip(),
            "",
            "![hot-set drift](hot_set_drift.png)",
            "",
        ]
        study.write_markdown(study.RESULTS / "hot_set_drift.md", "\n".join(head) + "\n" + body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
