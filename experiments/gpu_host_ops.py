"""The runtime's aten ops per step as a GPU issues them, over the tables and the collectives, and the host
terms of ``--gpu-host measured`` fitted to them.

On a GPU the runtime's host work is its ops (each tens of microseconds of dispatch and launch): the
measured GPU host terms (:data:`solvers.time_types.H100_RUNTIME_RATES`) are ops per step times the host
time per op of one H100. This counts the ops on the CPU with the GPU's op choices
(:func:`flexshard.runtime.device_rules.counted_as_gpu`: the same ops a GPU issues), at batch 2 per rank
(the values cost nothing), for the row-wise plan (flat fetch), ``row_wise_group_dedup`` (the group
fetch's two more collectives) and FlexShard's plan under the bytes objective (replicated rows: a sync
stage more) on spawned gloo ranks (1; 4 and 8 in 2 groups), on workloads of 1, 2, 3, 6
and 9 tables sharing 225 ids per sample and 150,000 rows (``experiments/host_terms.py``) and on the
bench's default tables. Rank 0's ops per step over the timed steps, and its collectives.

Then fits, by least squares over the counts, ``ops = step + table_stage x tables x collectives`` (the
shape the stored terms have), the same with ``stage x collectives``, and with ``table x tables`` too (the
per-table work outside the collectives), and prints each fit's residuals. Results to
docs/results/gpu_host_ops.{json,md} (``--no-write``: printed only; ``--from FILE``: the counts of a
written JSON, none counted). Run:

    nice .venv/bin/python experiments/gpu_host_ops.py [--tables 1,2,3,6,9] [--ranks 1,4,8] [--no-write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import study  # noqa: E402

from core.osutil import free_port  # noqa: E402

RESULTS = study.RESULTS
STRATEGIES = ("row_wise", "row_wise_group_dedup")
BYTES_PLAN = "flexshard_bytes"  # FlexShard's plan under the bytes objective: replicas, so a sync stage
BATCH = 2  # per rank: the values cost nothing
WARMUP, STEPS = 2, 4
TERMS = {  # fit name -> the columns of its design matrix, each a function of (tables, collectives)
    "step + table_stage x tables x collectives": ("step", "table_stage"),
    "step + (stage + table_stage x tables) x collectives": ("step", "stage", "table_stage"),
    "step + table x tables + (stage + table_stage x tables) x collectives": (
        "step",
        "table",
        "stage",
        "table_stage",
    ),
}
COLUMNS = {
    "step": lambda t, c: 1.0,
    "table": lambda t, c: float(t),
    "stage": lambda t, c: float(c),
    "table_stage": lambda t, c: float(t * c),
}


def _rank(rank: int, nproc: int, groups: int, workload: str, port: int, out: str) -> None:
    import os

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    torch.set_num_threads(1)
    from flexshard.bench.config import BenchConfig
    from flexshard.bench.plans import make_plans, plan_view, probed_view
    from flexshard.bench.worker import _build, load_data
    from flexshard.runtime.collective_count import count_collectives
    from flexshard.runtime.device_rules import counted_as_gpu
    from flexshard.runtime.op_count import OpCount
    from solvers.time_types import DEFAULT_RATES

    cfg = BenchConfig(
        nproc=nproc, groups=groups, batch=BATCH, workload=workload, plan_for="h100", torchrec=False
    )
    data = load_data(cfg, nproc)
    machine = probed_view(groups, 60.0)
    view = plan_view("h100", machine, nproc, groups)
    plans = make_plans(data, view, machine, cfg.budget, False, "step", DEFAULT_RATES)
    with_replicas = make_plans(data, view, machine, cfg.budget, False, "bytes", DEFAULT_RATES)["flexshard"]
    counted = {**{k: plans[k] for k in STRATEGIES}, BYTES_PLAN: with_replicas}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        systems, _failed = _build(cfg, data, counted, Path(tmp))
    batches = [data.make_batch(s, rank) for s in range(WARMUP + STEPS)]
    with counted_as_gpu():
        for s in systems:
            for b in batches[:WARMUP]:
                s.step(b)
            ops = OpCount()
            with count_collectives() as seen, ops:
                for b in batches[WARMUP:]:
                    s.step(b)
            records.append(
                {
                    "strategy": s.key,
                    "ranks": nproc,
                    "groups": groups,
                    "tables": len(data.tables),
                    "workload": Path(workload).stem if workload != "default" else "default",
                    "collectives": len(seen) / STEPS,
                    "ops": ops.ops / STEPS,
                }
            )
    if rank == 0:
        Path(out, "ops.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()


def count(nproc: int, groups: int, workload: str) -> list[dict]:
    """Rank 0's ops and collectives per step of each strategy (spawned ranks)."""
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _rank, args=(nproc, groups, workload, free_port(), out), nprocs=nproc, start_method="spawn"
        )
        return json.loads(Path(out, "ops.json").read_text())


def fit(records: list[dict], terms: tuple[str, ...]) -> tuple[dict[str, float], np.ndarray]:
    """Non-negative least-squares coefficients (ops are counts) of ``terms`` over the records, and each
    record's residual (ops): the least-squares fit on every subset of the terms (the others at 0), the
    best of those with no negative coefficient (the non-negative optimum is the unconstrained one on
    its own support; a few terms, so every subset)."""
    a = np.array([[COLUMNS[k](r["tables"], r["collectives"]) for k in terms] for r in records])
    y = np.array([r["ops"] for r in records])
    best, best_sse = np.zeros(len(terms)), float(y @ y)
    for size in range(1, len(terms) + 1):
        for support in itertools.combinations(range(len(terms)), size):
            cols = list(support)
            coef = np.zeros(len(terms))
            coef[cols], *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            sse = float(np.sum((y - a @ coef) ** 2))
            if coef.min() >= 0 and sse < best_sse - 1e-9:
                best, best_sse = coef, sse
    return dict(zip(terms, best.tolist(), strict=True)), y - a @ best


EARLIER = {"step": 167.6, "table_stage": 9.67}  # ops: the terms fitted on 2026-11-28 at 3 tables only


def earlier_ops(tables: int, collectives: float) -> float:
    """The ops per step the earlier measured GPU host terms (:data:`EARLIER`) price."""
    return EARLIER["step"] + EARLIER["table_stage"] * tables * collectives


def fitted_records(records: list[dict]) -> list[dict]:
    """The counts the fits are made on: the fetch modes' (:data:`STRATEGIES`) on more than one rank. A
    one-rank step runs every stage as a local copy, which a count of 0 collectives does not price; a plan
    with replicated rows issues more ops per table than its collectives say (the tiers' columns and
    the sync's), shown beside the fit, not in it."""
    return [r for r in records if r["ranks"] > 1 and r["strategy"] in STRATEGIES]


def fitted_terms(records: list[dict]) -> dict[str, float]:
    """Ops of each term of the full fit (``step``, ``table``, ``stage``, ``table_stage``) over
    :func:`fitted_records`: what :data:`solvers.time_types.H100_RUNTIME_RATES` holds."""
    return fit(fitted_records(records), TERMS[list(TERMS)[-1]])[0]


def report(records: list[dict]) -> str:
    """The counts as a table (with what the earlier terms and the full fit price), then every fit over
    :func:`fitted_records` with its residuals."""
    fitted = fitted_records(records)
    last = list(TERMS)[-1]
    coef, _ = fit(fitted, TERMS[last])
    rows = []
    for r in records:
        t, c = r["tables"], r["collectives"]
        mine = sum(v * COLUMNS[k](t, c) for k, v in coef.items())
        shown = f"{mine - r['ops']:+.0f}" if r["ranks"] > 1 else "-"
        shown += "" if r["ranks"] == 1 or r["strategy"] in STRATEGIES else " (not fitted)"
        rows.append(
            (
                r["workload"],
                t,
                r["ranks"],
                r["strategy"],
                f"{c:g}",
                f"{r['ops']:g}",
                f"{earlier_ops(t, c) - r['ops']:+.0f}",
                shown,
            )
        )
    head = ("workload", "tables", "ranks", "strategy", "collectives", "ops per step", "earlier terms", "fit")
    lines = [study.md_table(head, rows, "lrrlrrrr")]
    lines.append("")
    errors = np.array([earlier_ops(r["tables"], r["collectives"]) - r["ops"] for r in fitted])
    lines.append(
        f"- the earlier terms (2026-11-28, fitted at 3 tables: 167.6 a step, 9.67 per table per collective): "
        f"{errors.min():+.0f} to {errors.max():+.0f} ops on the fitted counts (rms "
        f"{float(np.sqrt(np.mean(errors**2))):.1f})"
    )
    for name, terms in TERMS.items():
        coef, res = fit(fitted, terms)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in coef.items())
        rms = float(np.sqrt(np.mean(res**2)))
        lines.append(
            f"- `ops = {name}`: {shown} ops; residuals {res.min():+.1f} to {res.max():+.1f} (rms {rms:.1f})"
        )
    return "\n".join(lines)


METHOD = """Aten ops per step of rank 0, counted on this machine's CPU with the GPU's op choices
(`flexshard.runtime.device_rules.counted_as_gpu`: the ops a GPU issues, the same values), at batch 2
per rank (the values cost nothing), over 4 steps after 2, on spawned gloo ranks (1; 4 and 8 in 2 groups):
the row-wise plan (`row_wise`, flat fetch), `row_wise_group_dedup` (the group fetch) and FlexShard's plan
under the bytes objective (`flexshard_bytes`, with replicated rows and so a sync stage), each made for
the H100 shape; on workloads of 1, 2, 3, 6 and 9 tables sharing 225 ids per sample and 150,000 rows
(experiments/host_terms.py) and on the bench's default tables (3). "earlier terms" (2026-11-28) and
"fit" (the full fit below, which `H100_RUNTIME_RATES` holds): what each prices less the count, ops.
The fits are least squares over the fetch modes' multi-rank counts: a one-rank step runs every stage as
a local copy, which a count of 0 collectives does not price, and a plan with replicated rows issues more
ops per table than its collectives say (its tiers' columns and its sync), which no term here follows."""


def main() -> None:
    ap = study.arguments(__doc__)
    ap.add_argument("--tables", default="1,2,3,6,9", help="table counts of the shared-lookups workloads")
    ap.add_argument("--ranks", default="1,4,8", help="ranks (more than one: 2 groups)")
    ap.add_argument("--no-default", action="store_true", help="leave the bench's default tables out")
    ap.add_argument("--from", dest="source", type=Path, help="report the counts of this JSON, count none")
    args = ap.parse_args()
    t0 = time.time()
    if args.source:
        stored = json.loads(args.source.read_text())
        records, stamp = stored["records"], stored["when"]
    else:
        records, stamp = count_all(args), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = report(records)
    print(text)
    if not args.no_write:
        study.write_markdown(
            RESULTS / "gpu_host_ops.json", json.dumps({"when": stamp, "records": records}, indent=1)
        )
        made = study.generated(study.command(__file__, *sys.argv[1:]), time.time() - t0)
        head = f"# The runtime's ops per step as a GPU issues them\n\nCounted {stamp}. {METHOD} {made}\n\n"
        study.write_markdown(RESULTS / "gpu_host_ops.md", head + text)


def count_all(args: argparse.Namespace) -> list[dict]:
    """Every workload's counts at every number of ranks, with progress."""
    from host_terms import tables_workload

    records = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        workloads = []
        for n in [int(x) for x in args.tables.split(",") if x]:
            path = Path(tmp, f"tables{n}.npz")
            tables_workload(path, n)
            workloads.append(str(path))
        if not args.no_default:
            workloads.append("default")
        for workload in workloads:
            for nproc in [int(x) for x in args.ranks.split(",")]:
                got = count(nproc, 1 if nproc == 1 else 2, workload)
                records += got
                for r in got:
                    print(
                        f"[{time.time() - t0:5.0f} s] {r['workload']} x{r['ranks']} {r['strategy']}: "
                        f"{r['collectives']:g} collectives, {r['ops']:g} ops",
                        flush=True,
                    )
    return records


if __name__ == "__main__":
    main()
