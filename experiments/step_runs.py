"""The step-time study's part 1 over several runs: each run one pass over every configuration (ranks,
batch, plan), minutes apart, so that the machine's run-to-run spread shows. A row's figures are the
median over runs (each run's ratio taken within the run: its strategies ran on the same batches in
alternating rounds), with the lowest and highest run beside them; the issue's marks are judged in each
run and on those medians (:func:`marks`).

A record is one ``flexshard bench --json`` record with the study's ``nproc``, ``batch`` and
``planned_for``, and its run's ``run`` (0, 1, ...), ``run_started_utc`` and ``run_commit``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import study

CONFIG = ("nproc", "batch", "planned_for")  # one bench run of the study
TORCHREC = "TorchRec row-wise"  # the label of TorchRec's records
FLEXSHARD = "FlexShard"
WITHIN = 0.2  # the model's error bound, relative
PROBED, H100 = "probed", "h100"  # the plans the marks speak of (planned_for)
PROBED_MARK, H100_MARK, TORCHREC_MARK, COLLECTIVES_MARK = 1.05, 1.15, 0.8, 10
COLLECTIVES_RANKS = 8  # the collectives mark is counted at 8 ranks


def tagged(records: list[dict], run: int, started_utc: str, commit: str) -> list[dict]:
    """``records`` of one run with its number, start (``HH:MM`` UTC, with the date) and commit."""
    return [{**r, "run": run, "run_started_utc": started_utc, "run_commit": commit} for r in records]


def runs(records: list[dict]) -> list[list[dict]]:
    """The records of each run, in run order (a record without ``run`` is run 0)."""
    by: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        by[int(r.get("run", 0))].append(r)
    return [by[k] for k in sorted(by)]


def run_name(records: list[dict]) -> str:
    """A run's start and commit, as its column is headed."""
    first = records[0]
    return f"{first.get('run_started_utc', '?')} ({first.get('run_commit', '?')})"


@dataclass
class Row:
    """One (ranks, batch, plan, strategy) over the runs: the medians, and each run's figure in run order
    (``vs_torchrec`` empty where TorchRec did not run)."""

    nproc: int
    batch: int
    planned_for: str
    label: str
    step_ms: list[float]
    vs_ablation: list[float]
    vs_torchrec: list[float]
    collectives: float  # per step (the same in every run: the plan's count)
    predicted_ms: list[float]
    local_ms: list[float]

    @property
    def errors(self) -> list[float]:
        """The model's error in each run: modeled over measured, minus one."""
        return [p / s - 1 for p, s in zip(self.predicted_ms, self.step_ms, strict=True)]

    def median(self, name: str) -> float:
        """The median over runs of the list attribute ``name`` (or of ``errors``)."""
        return float(np.median(getattr(self, name)))


def rows(records: list[dict]) -> list[Row]:
    """One :class:`Row` per (ranks, batch, plan, strategy) in the records' first order; each run's
    ratio to TorchRec is taken on the same run's TorchRec record of the configuration."""
    torchrec = {
        (r.get("run", 0), *(r[k] for k in CONFIG)): r["step_ms_median"]
        for r in records
        if r["label"] == TORCHREC
    }
    grouped: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        grouped[(*(r[k] for k in CONFIG), r["label"])].append(r)
    out = []
    for (nproc, batch, planned_for, label), recs in grouped.items():
        recs = sorted(recs, key=lambda r: r.get("run", 0))
        base = [torchrec.get((r.get("run", 0), nproc, batch, planned_for)) for r in recs]
        out.append(
            Row(
                nproc,
                batch,
                planned_for,
                label,
                [r["step_ms_median"] for r in recs],
                [r["vs_ablation"] for r in recs],
                [r["step_ms_median"] / b for r, b in zip(recs, base, strict=True) if b],
                max(r["collectives_per_step"] for r in recs),
                [r["predicted_step_ms"] for r in recs],
                [float(r.get("predicted_parts_ms", {}).get("local", 0.0)) for r in recs],
            )
        )
    return out


@dataclass
class Mark:
    """One of the issue's marks: its words, the bound, and the figure found (``where``: the row that
    decides it)."""

    name: str
    bound: str
    value: str
    met: bool
    where: str = ""

    def cell(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.value}{at}: {'met' if self.met else 'missed'}"


def _worst(
    rows_: list[Row],
    pick: Callable[[Row], float | None],
    name: str,
    planned: tuple[str, ...],
    bound: float,
    fmt: str,
) -> Mark:
    """The largest ``pick(row)`` over FlexShard's rows planned for ``planned``, against ``bound``."""
    found = [(pick(r), r) for r in rows_ if r.label == FLEXSHARD and r.planned_for in planned]
    found = [(v, r) for v, r in found if v is not None]
    if not found:
        return Mark(name, f"<= {bound:{fmt}}", "-", False)
    value, row = max(found, key=lambda x: x[0])
    return Mark(name, f"<= {bound:{fmt}}", f"{value:{fmt}}", value <= bound, f"{row.nproc}r/{row.batch}")


def marks(rows_: list[Row]) -> list[Mark]:
    """The issue's marks on ``rows_`` (one run's, or the medians over runs): FlexShard's collectives per
    step at 8 ranks; the worst point of the plan for the probed machine and of the plan for the H100
    shape against the ablation; the worst of either against TorchRec; the rows the model predicts within
    20%."""
    at8 = [r.collectives for r in rows_ if r.label == FLEXSHARD and r.nproc == COLLECTIVES_RANKS]
    most = max(at8, default=float("nan"))
    out = [
        Mark(
            f"FlexShard's collectives per step, {COLLECTIVES_RANKS} ranks",
            f"<= {COLLECTIVES_MARK}",
            f"{most:g}",
            bool(at8) and most <= COLLECTIVES_MARK,
        ),
        _worst(
            rows_,
            lambda r: r.median("vs_ablation"),
            "plan for the probed machine vs ablation",
            (PROBED,),
            PROBED_MARK,
            ".3f",
        ),
        _worst(
            rows_,
            lambda r: r.median("vs_ablation"),
            "plan for the H100 shape vs ablation",
            (H100,),
            H100_MARK,
            ".3f",
        ),
        _worst(
            rows_,
            lambda r: r.median("vs_torchrec") if r.vs_torchrec else None,
            "either plan vs TorchRec",
            (PROBED, H100),
            TORCHREC_MARK,
            ".2f",
        ),
    ]
    within = sum(abs(r.median("errors")) <= WITHIN for r in rows_)
    out.append(Mark("model within 20%", "every row", f"{within} of {len(rows_)} rows", within == len(rows_)))
    return out


def marks_table(records: list[dict]) -> str:
    """The issue's marks (:func:`marks`) in each run and on the medians over runs, a column each."""
    per_run = runs(records)
    columns = [marks(rows(r)) for r in per_run]
    header = ["mark", "bound", *(f"run {i + 1}: {run_name(r)}" for i, r in enumerate(per_run))]
    if len(per_run) > 1:
        columns.append(marks(rows(records)))
        header.append("median of the runs")
    table = [[m[0].name, m[0].bound, *(c.cell() for c in m)] for m in zip(*columns, strict=True)]
    return study.md_table(header, table, "l" * len(header))


def spread(values: list[float], fmt: str) -> str:
    """The median of ``values`` and, over several, the lowest and highest in brackets."""
    mid = f"{np.median(values):{fmt}}"
    return mid if len(values) < 2 else f"{mid} ({min(values):{fmt}} to {max(values):{fmt}})"
